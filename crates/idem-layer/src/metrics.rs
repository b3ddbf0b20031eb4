//! Metrics through the `metrics` facade.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idem_requests_total` | counter | `outcome`: executed, replayed, conflict, in_progress, released, takeover, fenced, cancelled, store_error, fail_open, rejected, unknown |
//! | `idem_store_duration_seconds` | histogram | `op`: reserve, renew, complete, release, cancel, get |
//! | `idem_replay_age_seconds` | histogram | |
//!
//! Install any `metrics` recorder (the gateway uses the Prometheus
//! exporter) to collect them; without one they cost next to nothing.

use std::time::Duration;

/// The name of the request counter.
pub const REQUESTS_TOTAL: &str = "idem_requests_total";
/// The name of the store latency histogram.
pub const STORE_DURATION: &str = "idem_store_duration_seconds";
/// The name of the replay age histogram.
pub const REPLAY_AGE: &str = "idem_replay_age_seconds";

/// How a keyed request was answered, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Executed,
    Replayed,
    Conflict,
    InProgress,
    Released,
    Takeover,
    Fenced,
    Cancelled,
    StoreError,
    FailOpen,
    Rejected,
    Unknown,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::InProgress => "in_progress",
            Outcome::Released => "released",
            Outcome::Takeover => "takeover",
            Outcome::Fenced => "fenced",
            Outcome::Cancelled => "cancelled",
            Outcome::StoreError => "store_error",
            Outcome::FailOpen => "fail_open",
            Outcome::Rejected => "rejected",
            Outcome::Unknown => "unknown",
        }
    }
}

pub(crate) fn count(outcome: Outcome) {
    metrics::counter!(REQUESTS_TOTAL, "outcome" => outcome.label()).increment(1);
}

pub(crate) fn store_latency(op: &'static str, elapsed: Duration) {
    metrics::histogram!(STORE_DURATION, "op" => op).record(elapsed.as_secs_f64());
}

pub(crate) fn replay_age(age: Duration) {
    metrics::histogram!(REPLAY_AGE).record(age.as_secs_f64());
}
