//! `metrics::register_handles`: once registered, the layer records through
//! the handles of the recorder that was current then, whatever recorder is
//! current later. One test in a file of its own: the handles are the
//! process's.

mod common;

use common::*;
use metrics_util::debugging::DebuggingRecorder;

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
    assert_eq!(outcome_count(&snapshot, "executed"), 1);
    assert_eq!(outcome_count(&snapshot, "replayed"), 1);
    assert_eq!(outcome_count(&snapshot, "conflict"), 1);
    assert_eq!(outcome_count(&snapshot, "released"), 1);
    // Four requests; the conflict reserves twice (its record is tried in
    // the other fingerprint format too).
    assert_eq!(
        histogram_samples(&snapshot, "idem_store_duration_seconds", Some("reserve")),
        5
    );
    assert_eq!(
        histogram_samples(&snapshot, "idem_store_duration_seconds", Some("complete")),
        1
    );
    assert_eq!(
        histogram_samples(&snapshot, "idem_store_duration_seconds", Some("release")),
        1
    );
    assert_eq!(
        histogram_samples(&snapshot, "idem_replay_age_seconds", None),
        1
    );
}
