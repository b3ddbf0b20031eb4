//! Metrics through the `metrics` facade (contract section 11).

mod common;

use common::*;
use metrics_util::debugging::DebuggingRecorder;

#[tokio::test]
async fn outcomes_and_store_latency_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    // Without the replay cache, every request reserves in the store.
    let (_store, _probe, svc) =
        fresh_with(|layer| layer.replay_cache(0, std::time::Duration::ZERO));
    send(&svc, order("k", r#"{"a":1}"#)).await;
    send(&svc, order("k", r#"{"a":1}"#)).await;
    send(&svc, order("k", r#"{"a":1}"#)).await;
    send(&svc, order("k", r#"{"a":2}"#)).await;
    send(&svc, keyed("/status/503", "x")).await;

    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(outcome_count(&snapshot, "executed"), 1);
    assert_eq!(outcome_count(&snapshot, "replayed"), 2);
    assert_eq!(outcome_count(&snapshot, "conflict"), 1);
    assert_eq!(outcome_count(&snapshot, "released"), 1);
    // Five requests; the conflict reserves twice (its record is tried in
    // the other fingerprint format too).
    assert_eq!(
        histogram_samples(&snapshot, "idem_store_duration_seconds", Some("reserve")),
        6
    );
    assert!(
        snapshot
            .iter()
            .any(|(key, ..)| key.key().name() == "idem_replay_age_seconds")
    );
    assert_eq!(saved(&snapshot, "cache"), 0);
}

/// Store calls saved, by how (`idem_store_calls_saved_total`).
fn saved(snapshot: &Snapshot, via: &str) -> u64 {
    counter_total(snapshot, "idem_store_calls_saved_total", "via", via)
}

/// With the replay cache (the default), the second replay is answered
/// from it: one reservation fewer, counted as saved; the answers are the
/// same, a changed payload still conflicts.
#[tokio::test]
async fn a_replay_from_the_cache_saves_its_store_call() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let (_store, probe, svc) = fresh();
    let first = send(&svc, order("k", r#"{"a":1}"#)).await;
    let from_store = send(&svc, order("k", r#"{"a":1}"#)).await;
    let from_cache = send(&svc, order("k", r#"{"a":1}"#)).await;
    let changed = send(&svc, order("k", r#"{"a":2}"#)).await;
    assert_eq!(probe.calls(), 1);
    for replay in [&from_store, &from_cache] {
        assert_eq!(replay.status, first.status);
        assert_eq!(replay.body, first.body);
        assert_eq!(
            replay.headers.get("location"),
            first.headers.get("location")
        );
    }
    assert_eq!(changed.code().as_deref(), Some("idempotency_conflict"));

    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(outcome_count(&snapshot, "replayed"), 2);
    assert_eq!(outcome_count(&snapshot, "conflict"), 1);
    assert_eq!(
        histogram_samples(&snapshot, "idem_store_duration_seconds", Some("reserve")),
        4
    );
    assert_eq!(saved(&snapshot, "cache"), 1);
}
