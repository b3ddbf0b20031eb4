//! The vocabulary of idem: scopes, keys, fingerprints, records, leases, the
//! [`Store`] trait and the state machine every store implements.
//!
//! This crate does no I/O. The Tower layer lives in `idem-layer`; stores
//! live in `idem-memory`, `idem-redis` and `idem-postgres`.
//!
//! # The state machine
//!
//! | state found | same fingerprint | different fingerprint |
//! |---|---|---|
//! | absent (or expired, or released) | reserve, new attempt, run the handler | same |
//! | processing, lease live | in progress (409 + `Retry-After`) | conflict (422) |
//! | processing, lease lapsed | take over: new attempt, generation + 1 | conflict (422) |
//! | completed | replay | conflict (422) |
//! | cancelled | cancelled (410) | conflict (422) |
//!
//! A *released* record is one whose last attempt failed temporarily (5xx,
//! 408, 425, 429, an error or a panic): the key is free again, whatever the
//! fingerprint of the next request. Its attempts stay in the history.
//!
//! [`machine`] holds these rules as pure functions; [`conformance`] (feature
//! `conformance`) checks that a store follows them.

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

mod calls;
pub mod erasures;
pub mod handoff;
mod key;
pub mod machine;
pub mod protocol;
mod query;
mod record;
mod scope;
mod store;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod differential;

pub use calls::{
    Cancellation, Completion, Current, Erasure, ForceRelease, IdentityClaim, Release, Renewal,
    Replay, Reservation, ReserveRequest, StoreError,
};
pub use erasures::ErasureFeed;
pub use handoff::{CompletionSlot, DeferredCompletion};
/// The name of a stored response header ([`StoredResponse::headers`]).
pub use http::HeaderName;
pub use key::{IdempotencyKey, KeyError};
pub use query::{OldestRecords, RecordCursor, RecordQuery};
pub use record::{
    ATTEMPT_HISTORY, Attempt, AttemptId, AttemptOutcome, LateEvidence, Lease, Outcome, OwnerToken,
    Record, RecordState, StoredResponse, unix_ms,
};
pub use scope::{Fingerprint, Scope, ScopeFormat, ScopeHash, ScopeSecret, push_hex};
pub use store::{Fleet, RecordsAdmin, Store};

#[doc = include_str!("docs/writing-a-store.md")]
pub mod writing_a_store {}

/// What this crate's unit tests share.
#[cfg(test)]
mod test_support {
    use std::time::Duration;

    use crate::{Fingerprint, IdempotencyKey, ReserveRequest, Scope};

    /// A reservation of `key` for tenant `t` on `POST /orders`.
    pub(crate) fn request(key: &str) -> ReserveRequest {
        ReserveRequest {
            scope: Scope::new(
                "t",
                "POST /orders",
                IdempotencyKey::parse(key.as_bytes()).expect("key"),
            ),
            fingerprint: Fingerprint::from_bytes([0; 32]),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(3600),
        }
    }
}
