//! Metrics through the `metrics` facade (contract section 11).

mod common;

use common::*;
use metrics_util::debugging::DebuggingRecorder;

#[tokio::test]
async fn outcomes_and_store_latency_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let (_store, _probe, svc) = fresh();
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
}
