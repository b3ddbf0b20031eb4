//! What the store calls take and answer: the reservation's request, and an
//! enum per call that names every outcome.

use std::time::Duration;

use crate::{Attempt, AttemptId, Fingerprint, Lease, Outcome, Record, Scope};

/// What [`Store::reserve`](crate::Store::reserve) needs to know.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// The scope to reserve.
    pub scope: Scope,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// Lease length.
    pub lease: Duration,
    /// How long the record is kept, counted from the reservation that starts
    /// an attempt (renewals extend it while the attempt runs).
    pub retention: Duration,
}

/// A stored outcome, as found by a duplicate request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// What was stored.
    pub outcome: Outcome,
    /// How long ago it was recorded: by the store's clock, or, where a
    /// store reads no clock on a replay (Redis), this process' clock minus
    /// the completion time the store kept; never negative.
    pub age: Duration,
    /// How much longer the record lives, when the store says (`None`: it
    /// does not). A process may keep a copy of a completed record for at
    /// most this long (the layer's replay cache): a completed record does
    /// not change until it expires.
    pub expires_in: Option<Duration>,
    /// The attempt whose outcome this is (the record's current attempt),
    /// where the store tells it (every store here does). A sealed response
    /// is bound to it: a response copied into another attempt's record,
    /// even one of the same scope and generation (after an erase), does
    /// not open.
    pub attempt: Option<AttemptId>,
}

/// The answer to [`Store::reserve`](crate::Store::reserve).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Reservation {
    /// No live record: a new attempt holds the lease. Run the handler.
    Acquired(Lease),
    /// The previous attempt's lease lapsed: a new attempt holds the lease
    /// with the next generation. Run the handler; `superseded` is the
    /// attempt whose outcome is unknown.
    TakenOver {
        /// The new lease.
        lease: Lease,
        /// The attempt that lost its lease.
        superseded: Attempt,
    },
    /// Another attempt holds a live lease.
    InProgress {
        /// Time left on that lease.
        retry_after: Duration,
    },
    /// The outcome is stored: replay it.
    Completed(Replay),
    /// The record was cancelled.
    Cancelled,
    /// The record was made by a request with another fingerprint. The
    /// record is untouched.
    Conflict,
}

/// What a record says now, as told to a fenced attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Current {
    /// No record, an expired one, or a released one.
    Vacant,
    /// Another attempt holds a lease with this much time left (zero when
    /// it has lapsed but nobody took over yet).
    Processing {
        /// Time left on the lease.
        retry_after: Duration,
    },
    /// Completed, by another attempt.
    Completed(Replay),
    /// Cancelled.
    Cancelled,
}

/// The answer to [`Store::renew`](crate::Store::renew).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Renewal {
    /// The lease now lasts another `ttl` from the store's now.
    Renewed,
    /// The lease was lost.
    Fenced(Current),
}

/// The answer to [`Store::complete`](crate::Store::complete).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Completion {
    /// The outcome is the record's result.
    Recorded,
    /// The lease was lost: the outcome was kept as late evidence on the
    /// attempt (while it is still in the history) and the record is as
    /// `Current` says.
    Fenced(Current),
}

/// The answer to [`Store::release`](crate::Store::release).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Release {
    /// The key is free again; the attempt is kept as released.
    Released,
    /// The lease was lost; the record is as `Current` says.
    Fenced(Current),
}

/// The answer to [`Store::cancel`](crate::Store::cancel): which side won.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Cancellation {
    /// The record is now cancelled. A running attempt's later writes are
    /// fenced. The record after the change.
    Cancelled(Record),
    /// Completion won: the record holds the outcome.
    AlreadyCompleted(Record),
    /// It was cancelled before.
    AlreadyCancelled(Record),
    /// No live record.
    NotFound,
}

/// The answer to [`RecordsAdmin::force_release`](crate::RecordsAdmin::force_release).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum ForceRelease {
    /// The processing record is released: the key is free, and the attempt
    /// that held it is kept as released by an operator (its lease is
    /// fenced).
    Released(Record),
    /// The record is not processing; nothing changed.
    NotProcessing(Record),
    /// No live record.
    NotFound,
}

/// The answer to [`RecordsAdmin::erase`](crate::RecordsAdmin::erase).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Erasure {
    /// The record is gone (as it was before): its key is new.
    Erased(Record),
    /// The record is processing and was left as it is: erasing it would
    /// let a retry run while its attempt may still act.
    Processing(Record),
    /// No live record.
    NotFound,
}

/// A store call failed; the layer answers `503 idempotency_store_unavailable`
/// (or runs unprotected when configured to fail open).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend could not be reached, shut down, or is switching over
    /// (loading, failing over): a call may succeed once it is back. The
    /// only error (with [`Timeout`](Self::Timeout)) that fail-open covers.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The backend answered with an error of its own: a missing table, a
    /// permission, a value it refuses, out of memory. It was reached and
    /// may hold the key's record, so fail-open never covers it; the layer
    /// answers `503 idempotency_store_unavailable` and logs the cause.
    #[error("store refused the call: {0}")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The call did not finish within its timeout.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The store holds its maximum number of live records (or bytes).
    #[error("store is full: {capacity} live records")]
    Full {
        /// The configured record cap.
        capacity: usize,
        /// When a place is expected to free up: the earliest expiry the
        /// store knows of (at least one second).
        retry_after: Duration,
    },
    /// The tenant holds its quota of live records; other tenants are not
    /// affected. The layer answers `429 idempotency_quota_exceeded`.
    #[error("the tenant holds its quota of {quota} live records")]
    QuotaExceeded {
        /// The per-tenant quota.
        quota: usize,
        /// When the tenant's earliest record is expected to expire (at
        /// least one second).
        retry_after: Duration,
    },
    /// A stored record could not be decoded.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// Every connection to the backend was taken for as long as the store
    /// waits for one (a busy pool): the backend is up and serving other
    /// calls. Fail-open never covers it (running unprotected under load is
    /// how a storm of retries would run twice); the layer answers
    /// `503 idempotency_store_unavailable` with this `Retry-After`.
    #[error("every connection to the store is in use; retry after {retry_after:?}")]
    Busy {
        /// When to try again.
        retry_after: Duration,
    },
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Unavailable(error.into())
    }

    /// Wraps an error the backend answered with as [`StoreError::Refused`].
    pub fn refused(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Refused(error.into())
    }
}

/// What claiming a store for an identity found (`claim_identity` of the
/// stores that outlive a process): instances that derive tenants or scopes
/// differently find no record of each other, so a retry moving between
/// them runs again; each claims the store with a marker of how it derives
/// them (a keyed hash of its secrets and settings), and one told
/// [`IdentityClaim::Other`] should not serve.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdentityClaim {
    /// The store is claimed for the marker given.
    Held,
    /// The store is claimed for another marker (this one).
    Other(String),
}
