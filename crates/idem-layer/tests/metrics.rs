//! Metrics through the `metrics` facade (contract section 11).

mod common;

use common::*;
use metrics_util::{
    CompositeKey, MetricKind,
    debugging::{DebugValue, DebuggingRecorder},
};

fn counter(
    snapshot: &[(
        CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )],
    outcome: &str,
) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| {
            key.kind() == MetricKind::Counter
                && key.key().name() == "idem_requests_total"
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "outcome" && l.value() == outcome)
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

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
    assert_eq!(counter(&snapshot, "executed"), 1);
    assert_eq!(counter(&snapshot, "replayed"), 2);
    assert_eq!(counter(&snapshot, "conflict"), 1);
    assert_eq!(counter(&snapshot, "released"), 1);
    let reserve_latency = snapshot.iter().find(|(key, ..)| {
        key.key().name() == "idem_store_duration_seconds"
            && key.key().labels().any(|l| l.value() == "reserve")
    });
    match reserve_latency {
        // Five requests; the conflict reserves twice (its record is tried
        // in the other fingerprint format too).
        Some((.., DebugValue::Histogram(values))) => assert_eq!(values.len(), 6),
        other => panic!("no reserve latency histogram: {other:?}"),
    }
    assert!(
        snapshot
            .iter()
            .any(|(key, ..)| key.key().name() == "idem_replay_age_seconds")
    );
}
