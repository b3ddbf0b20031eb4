//! Metrics through the `metrics` facade.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idem_requests_total` | counter | `outcome`: executed, replayed, conflict, in_progress, released, takeover, fenced, cancelled, store_error, quota_exceeded, fail_open, rejected, unknown |
//! | `idem_store_duration_seconds` | histogram | `op`: reserve, renew, complete, release, cancel, get, list, force_release, erase |
//! | `idem_replay_age_seconds` | histogram | |
//! | `idem_outcomes_pending` | gauge | |
//! | `idem_store_calls_saved_total` | counter | `via`: cache (a replay from the replay cache), flight (a duplicate answered from the reservation of the same key in flight) |
//! | `idem_records_erased_total` | counter | none: records an operator erased through the records API |
//! | `idem_records_unopened_total` | counter | none: sealed records that did not open ([`sealing`](crate::sealing)), never replayed |
//!
//! `idem_outcomes_pending` counts the outcomes this process holds that a
//! store error kept from being recorded yet (tried again in the
//! background): above zero for longer than an outage, the store takes
//! reservations but refuses completions; at a shutdown that cannot wait
//! for them, they are lost with the process.
//!
//! Install any `metrics` recorder (the gateway uses the Prometheus
//! exporter) to collect them; without one they cost next to nothing.
//!
//! Each event looks its metric up in the recorder current where it happens
//! (a hash and a map lookup: about 600 instructions with the Prometheus
//! exporter, a few per keyed request). A process whose recorder is
//! installed once, at start, can call [`register_handles`] after
//! installing it: the layers of the process then record through handles
//! registered with it once.

use std::{sync::OnceLock, time::Duration};

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata};

/// The name of the request counter.
pub const REQUESTS_TOTAL: &str = "idem_requests_total";
/// The name of the store latency histogram.
pub const STORE_DURATION: &str = "idem_store_duration_seconds";
/// The name of the replay age histogram.
pub const REPLAY_AGE: &str = "idem_replay_age_seconds";
/// The name of the gauge of outcomes held for a background completion.
pub const OUTCOMES_PENDING: &str = "idem_outcomes_pending";
/// The name of the counter of records erased through the records API.
pub const RECORDS_ERASED: &str = "idem_records_erased_total";
/// The name of the counter of store calls saved (the replay cache, single
/// flight).
pub const CALLS_SAVED: &str = "idem_store_calls_saved_total";

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
    /// A new key refused: its tenant holds its quota of live records.
    QuotaExceeded,
    FailOpen,
    Rejected,
    Unknown,
}

/// What `metrics`' macros would attach: this module, at level INFO.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// A key whose name and one label are known at compile time: built once,
/// where the macros would build (and allocate) a key on every call.
macro_rules! static_key {
    ($name:expr, $label:literal, $value:expr) => {{
        static LABELS: [Label; 1] = [Label::from_static_parts($label, $value)];
        static KEY: Key = Key::from_static_parts($name, &LABELS);
        &KEY
    }};
}

/// `fn key(self) -> &'static Key` for an enum whose variants are the
/// values of one label of one metric, and `ALL`, its variants in the
/// order of their discriminants (an index of the registered handles).
macro_rules! keyed_by_variant {
    ($type:ident, $name:expr, $label:literal: $($variant:ident => $value:literal),* $(,)?) => {
        impl $type {
            const ALL: &'static [$type] = &[$($type::$variant),*];

            fn key(self) -> &'static Key {
                match self {
                    $($type::$variant => static_key!($name, $label, $value),)*
                }
            }
        }
    };
}

keyed_by_variant!(Outcome, REQUESTS_TOTAL, "outcome":
    Executed => "executed",
    Replayed => "replayed",
    Conflict => "conflict",
    InProgress => "in_progress",
    Released => "released",
    Takeover => "takeover",
    Fenced => "fenced",
    Cancelled => "cancelled",
    StoreError => "store_error",
    QuotaExceeded => "quota_exceeded",
    FailOpen => "fail_open",
    Rejected => "rejected",
    Unknown => "unknown",
);

/// How a request was answered without a store call of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Saved {
    /// From the replay cache.
    Cache,
    /// From the reservation of its key in flight.
    Flight,
}

keyed_by_variant!(Saved, CALLS_SAVED, "via":
    Cache => "cache",
    Flight => "flight",
);

/// A store call saved.
pub(crate) fn saved(via: Saved) {
    match HANDLES.get() {
        Some(handles) => handles.saved[via as usize].increment(1),
        None => {
            metrics::with_recorder(|recorder| recorder.register_counter(via.key(), &METADATA))
                .increment(1);
        }
    }
}

/// The layer's metrics as registered once by [`register_handles`].
struct Handles {
    /// By [`Outcome`]'s discriminant.
    requests: Vec<Counter>,
    /// By [`StoreOp`]'s discriminant.
    store: Vec<Histogram>,
    replay_age: Histogram,
    outcomes_pending: Gauge,
    /// By [`Saved`]'s discriminant.
    saved: Vec<Counter>,
}

static HANDLES: OnceLock<Handles> = OnceLock::new();

/// Registers every metric of the layer once with the recorder current on
/// the calling thread (the global one, unless a local recorder is set
/// there), and makes every layer of the process record through those
/// handles from then on, instead of looking each metric up in the recorder
/// per event. Call it once the process's recorder is installed (the
/// gateway does, after installing its Prometheus exporter): metrics go to
/// that recorder from then on whatever recorder is current later, local
/// ones included, so a process that swaps recorders (tests with local
/// recorders) should not call it. Answers `false`, and changes nothing,
/// when handles were registered before.
pub fn register_handles() -> bool {
    let mut registered = false;
    HANDLES.get_or_init(|| {
        registered = true;
        metrics::with_recorder(|recorder| Handles {
            requests: Outcome::ALL
                .iter()
                .map(|outcome| recorder.register_counter(outcome.key(), &METADATA))
                .collect(),
            store: StoreOp::ALL
                .iter()
                .map(|op| recorder.register_histogram(op.key(), &METADATA))
                .collect(),
            replay_age: recorder.register_histogram(&Key::from_static_name(REPLAY_AGE), &METADATA),
            outcomes_pending: recorder
                .register_gauge(&Key::from_static_name(OUTCOMES_PENDING), &METADATA),
            saved: Saved::ALL
                .iter()
                .map(|via| recorder.register_counter(via.key(), &METADATA))
                .collect(),
        })
    });
    registered
}

pub(crate) fn count(outcome: Outcome) {
    match HANDLES.get() {
        Some(handles) => handles.requests[outcome as usize].increment(1),
        None => {
            metrics::with_recorder(|recorder| recorder.register_counter(outcome.key(), &METADATA))
                .increment(1);
        }
    }
    // The layer's `idempotency` span (DEBUG) carries the outcome too.
    if tracing::enabled!(tracing::Level::DEBUG)
        && let Some(label) = outcome.key().labels().next()
    {
        tracing::Span::current().record("outcome", label.value());
    }
}

/// Records the attempt (its lease generation: 1 for the first) on the
/// layer's `idempotency` span, when DEBUG spans are on.
pub(crate) fn trace_attempt(generation: u64) {
    if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record("attempt", generation);
    }
}

/// A store call, as its latency is labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreOp {
    Reserve,
    Renew,
    Complete,
    Release,
    Cancel,
    Get,
    List,
    ForceRelease,
    Erase,
}

keyed_by_variant!(StoreOp, STORE_DURATION, "op":
    Reserve => "reserve",
    Renew => "renew",
    Complete => "complete",
    Release => "release",
    Cancel => "cancel",
    Get => "get",
    List => "list",
    ForceRelease => "force_release",
    Erase => "erase",
);

pub(crate) fn store_latency(op: StoreOp, elapsed: Duration) {
    let seconds = elapsed.as_secs_f64();
    match HANDLES.get() {
        Some(handles) => handles.store[op as usize].record(seconds),
        None => metrics::with_recorder(|recorder| recorder.register_histogram(op.key(), &METADATA))
            .record(seconds),
    }
}

pub(crate) fn replay_age(age: Duration) {
    match HANDLES.get() {
        Some(handles) => handles.replay_age.record(age.as_secs_f64()),
        None => metrics::histogram!(REPLAY_AGE).record(age.as_secs_f64()),
    }
}

/// An outcome held for a background completion (`1.0`), or no longer
/// held (`-1.0`). Added, not set: the layers of a process share the gauge.
pub(crate) fn outcomes_pending(change: f64) {
    match HANDLES.get() {
        Some(handles) => handles.outcomes_pending.increment(change),
        None => metrics::gauge!(OUTCOMES_PENDING).increment(change),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_indexed_by_discriminant() {
        for (index, outcome) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, index);
        }
        for (index, op) in StoreOp::ALL.iter().enumerate() {
            assert_eq!(*op as usize, index);
        }
        for (index, via) in Saved::ALL.iter().enumerate() {
            assert_eq!(*via as usize, index);
        }
        assert_eq!(Outcome::ALL.len(), 13);
        assert_eq!(StoreOp::ALL.len(), 9);
    }
}
