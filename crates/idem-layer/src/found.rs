//! What a record says to a request that does not run: the answer the
//! engine, single flight and the callers share.

use std::time::Duration;

use idem_core::Replay;

/// What the record says, for a request that does not run.
#[derive(Clone)]
pub(crate) enum Found {
    /// The outcome to replay.
    Completed(Replay),
    /// An attempt runs (here or elsewhere); retry after this hint.
    InProgress(Duration),
    /// The record was cancelled.
    Cancelled,
    /// The key was used with another payload.
    Conflict,
}
