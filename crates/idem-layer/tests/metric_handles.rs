//! `metrics::register_handles`: once registered, the layer records through
//! the handles of the recorder that was current then, whatever recorder is
//! current later. One test in a file of its own: the handles are the
//! process's.

mod common;

use common::*;
use metrics_util::{
    MetricKind,
    debugging::{DebugValue, DebuggingRecorder},
};

#[tokio::test]
async fn registered_handles_record_into_the_recorder_they_were_registered_with() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    {
        let _guard = metrics::set_default_local_recorder(&recorder);
        assert!(idem_layer::metrics::register_handles());
    }
    // Registered once: a second call changes nothing.
    assert!(!idem_layer::metrics::register_handles());

    // No recorder is current here any more: only the handles reach one.
    let (_store, _probe, svc) = fresh();
    send(&svc, order("k", r#"{"a":1}"#)).await;
    send(&svc, order("k", r#"{"a":1}"#)).await;
    send(&svc, order("k", r#"{"a":2}"#)).await;
    send(&svc, keyed("/status/503", "x")).await;

    let snapshot = snapshotter.snapshot().into_vec();
    let counted = |outcome: &str| -> u64 {
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
    };
    assert_eq!(counted("executed"), 1);
    assert_eq!(counted("replayed"), 1);
    assert_eq!(counted("conflict"), 1);
    assert_eq!(counted("released"), 1);
    let samples = |name: &str, op: Option<&str>| -> usize {
        snapshot
            .iter()
            .filter(|(key, ..)| {
                key.key().name() == name
                    && op.is_none_or(|op| key.key().labels().any(|l| l.value() == op))
            })
            .map(|(.., value)| match value {
                DebugValue::Histogram(values) => values.len(),
                _ => 0,
            })
            .sum()
    };
    // Four requests; the conflict reserves twice (its record is tried in
    // the other fingerprint format too).
    assert_eq!(samples("idem_store_duration_seconds", Some("reserve")), 5);
    assert_eq!(samples("idem_store_duration_seconds", Some("complete")), 1);
    assert_eq!(samples("idem_store_duration_seconds", Some("release")), 1);
    assert_eq!(samples("idem_replay_age_seconds", None), 1);
}
