//! The store traits and the outcomes of their calls.
//!
//! # Writing a store
//!
//! A store keeps one [`Record`] per [`ScopeHash`] and applies the state
//! machine of the contract atomically per scope. A store that can hold a lock
//! around a read-modify-write (like `idem-memory`) reuses the pure functions
//! of [`machine`](crate::machine); a store that cannot (like Redis)
//! implements the same table in its own terms.
//!
//! The contract comes in three traits, each implemented on its own:
//!
//! * [`Store`], what the layer needs to serve requests: six required
//!   methods (`reserve`, `renew`, `complete`, `release`, `cancel`, `get`);
//!   the others have defaults that are right for any store (no bound of
//!   its own on calls, no background work, waiting duplicates poll). This
//!   is the minimum a new store (DynamoDB, say) writes.
//! * [`RecordsAdmin`], what an operator's tools need (`list`,
//!   `force_release`; `count_lapsed` defaults to a listing): the records
//!   API and the gateway's lapsed-record gauge require it.
//! * [`Fleet`], what processes sharing a store need (`claim_identity`,
//!   `claim_duty`), with no defaults: a store shared between processes
//!   answers from the store, and one whose records live in its process only
//!   says so (the memory store answers "held" and "yours").
//!
//! The [`writing_a_store`](crate::writing_a_store) guide shows a whole
//! store in sixty lines. Run the [`conformance`](crate::conformance) suite (feature
//! `conformance`) in the store's tests: the checks of `Store`, and with
//! `records_admin` those of `RecordsAdmin` too:
//!
//! ```ignore
//! idem_core::conformance_tests!(|| async { Some(MyHarness::new().await) });
//! idem_core::conformance_tests!(|| async { Some(MyHarness::new().await) }, records_admin);
//! ```
//!
//! Time (lease lapse, retention) is measured by the store's own clock, never
//! the caller's.

use std::{future::Future, time::Duration};

use crate::{
    Cancellation, Completion, Erasure, ForceRelease, IdentityClaim, Lease, Outcome, Record,
    RecordQuery, Release, Renewal, Reservation, ReserveRequest, ScopeHash, StoreError,
};

/// Persistence for idempotency records.
///
/// Every method is atomic per scope. Every write after `reserve` is a
/// compare-and-set on the lease's generation and owner token: a lease that
/// was taken over, cancelled or released is *fenced*, its write refused, and
/// the answer says what the record holds now.
///
/// The futures are `Send`, so the layer can drive them from spawned tasks.
pub trait Store: Send + Sync + 'static {
    /// Reserves `request.scope`, following the contract's state table:
    ///
    /// | found | same fingerprint | other fingerprint |
    /// |---|---|---|
    /// | absent, expired or released | [`Reservation::Acquired`] | same |
    /// | processing, lease live | [`Reservation::InProgress`] | [`Reservation::Conflict`] |
    /// | processing, lease lapsed | [`Reservation::TakenOver`] | [`Reservation::Conflict`] |
    /// | completed | [`Reservation::Completed`] | [`Reservation::Conflict`] |
    /// | cancelled | [`Reservation::Cancelled`] | [`Reservation::Conflict`] |
    ///
    /// A conflict leaves the record untouched.
    fn reserve(
        &self,
        request: &ReserveRequest,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send;

    /// Extends the lease by its `ttl` from the store's now, if it is still
    /// the record's current lease.
    fn renew(&self, lease: &Lease) -> impl Future<Output = Result<Renewal, StoreError>> + Send;

    /// Keeps in the attempt's history that its caller was answered that
    /// the outcome is unknown
    /// ([`AttemptOutcome::Unknown`](crate::AttemptOutcome::Unknown)): the
    /// action may have run, and the record stays processing under the
    /// lease it has, awaiting a late answer. Answers as [`renew`](Self::renew)
    /// would (`Renewed` when the lease is still current, which this call
    /// does not extend). The default keeps nothing (the history then shows
    /// the attempt running); every store of this project keeps it.
    fn mark_unknown(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        let _ = lease;
        std::future::ready(Ok(Renewal::Renewed))
    }

    /// Records `outcome` as the result, if `lease` is still current.
    /// Otherwise keeps the outcome's status as late evidence on the
    /// attempt and leaves the result alone.
    fn complete(
        &self,
        lease: &Lease,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Frees the key after a temporary failure, if `lease` is still current.
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<Release, StoreError>> + Send;

    /// Cancels the record: atomic against completion.
    fn cancel(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Cancellation, StoreError>> + Send;

    /// Reads the live record, if any.
    fn get(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// The longest a call of [`reserve`](Self::reserve),
    /// [`renew`](Self::renew), [`complete`](Self::complete) or
    /// [`release`](Self::release) can take, when the store bounds those
    /// calls itself (a network store's own timeout): a caller whose own
    /// bound is at least as long needs no timer of its own, since the
    /// store's ends the call first. `None` (the default): the store does
    /// not bound its calls.
    fn call_bound(&self) -> Option<Duration> {
        None
    }

    /// Whether a call of this store that runs out of time met a busy
    /// backend rather than an unreachable one: a store behind a pooler that
    /// queues calls while the database is busy (PostgreSQL with a
    /// transaction pooler), whose connection to the pooler is made. The
    /// layer then reports the timeout as [`StoreError::Busy`], which
    /// fail-open never covers; `false` (the default): a timeout may be an
    /// outage.
    fn timeout_means_busy(&self) -> bool {
        false
    }

    /// Whether a handler can complete this store's records inside its own
    /// transaction ([`CompletionSlot`](crate::CompletionSlot)): a store
    /// that keeps records in the handler's database (PostgreSQL). The
    /// layer puts a slot in an attempt's request only for such a store.
    /// `false` (the default): no handler transaction can hold a record.
    fn completes_in_transactions(&self) -> bool {
        false
    }

    /// Resolves once the store's own work that outlives its calls has
    /// finished: freeing a reservation whose call was given up before its
    /// answer (the Redis and PostgreSQL stores). The layer's `drain`
    /// (`idem_layer::IdempotencyLayer::drain`) waits for it at shutdown, so a
    /// given-up reservation does not hold its key for a lease after the
    /// process ends. The default: nothing to wait for.
    fn settled(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// How many of the tasks [`settled`](Self::settled) waits for are
    /// running now.
    fn background_tasks(&self) -> usize {
        0
    }

    /// The erasures of this store's records made by any process sharing
    /// it, as the store's push channel brings them ([`ErasureFeed`](crate::ErasureFeed));
    /// `None` (the default) for a store without one. A replay cache keeps
    /// copies longer than a second only while the feed is healthy. The
    /// first call may start the store's subscriber (inside a tokio runtime).
    fn erasures(&self) -> Option<crate::ErasureFeed> {
        None
    }

    /// Resolves when the record of `scope` may have changed, or after at
    /// most `timeout`. Used by waiting duplicates; spurious wake-ups are
    /// allowed. The default polls: it sleeps for a short interval (25 ms, or
    /// `timeout` if shorter).
    fn changed(&self, scope: &ScopeHash, timeout: Duration) -> impl Future<Output = ()> + Send {
        let _ = scope;
        tokio::time::sleep(timeout.min(Duration::from_millis(25)))
    }
}

/// Records administration: what an operator's tools need of a store (the
/// records API's listings and force release, the gateway's count of
/// lapsed records). A store implements it when it can answer those; the
/// records API requires it, so a store without it cannot be mounted there
/// by mistake.
pub trait RecordsAdmin: Store {
    /// Lists live records as `query` asks, oldest first (an operator's
    /// tool: a store may scan every record).
    fn list(
        &self,
        query: &RecordQuery,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send;

    /// How many live records are processing with their lease lapsed
    /// (stuck: what a [`RecordQuery`] with `lapsed` lists), counting no
    /// further than `limit`. The gateway's `idem_records_lapsed` gauge.
    /// The default lists them; a store that can count without reading
    /// each record out overrides it (a single Redis node counts inside the
    /// server).
    fn count_lapsed(&self, limit: usize) -> impl Future<Output = Result<usize, StoreError>> + Send {
        let query = RecordQuery::stuck(limit);
        async move { self.list(&query).await.map(|records| records.len()) }
    }

    /// Releases a processing record whatever its lease (an operator
    /// freeing a stuck key): the attempt is kept as released by an
    /// operator, and its later writes are fenced.
    fn force_release(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<ForceRelease, StoreError>> + Send;

    /// Erases a live record that is not processing (an operator's erasure
    /// for data protection, or of an answer stored by mistake): its key is
    /// new afterwards, and a retry runs again. A processing record is
    /// left as it is.
    fn erase(&self, scope: &ScopeHash) -> impl Future<Output = Result<Erasure, StoreError>> + Send;
}

/// The duties of a store shared between processes: claiming the store for
/// one way of deriving record identities, and handing a fleet-wide chore
/// to one instance. Nothing here has a default: a store shared between
/// processes answers from the store itself, and a store whose records
/// live in its process only says so in its own terms.
pub trait Fleet: Store {
    /// Claims the fleet-wide chore `duty` (the gateway's count of lapsed
    /// records, say) for `holder` for `ttl`: `true` when `holder` has it
    /// (newly, or extended to `ttl` from now), `false` while another
    /// holder's claim lasts. Instances sharing a store call it before each
    /// round of the chore, so that one of a fleet does it instead of
    /// every one. A store whose records live in its process only answers
    /// `true` (every instance does its own chore).
    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Claims the store for `marker` (how the caller derives the records'
    /// identities; see [`IdentityClaim`]) for `ttl`: a claim held for the
    /// same marker is extended (never shortened), one held for another is
    /// answered [`IdentityClaim::Other`] and left alone unless `replace`,
    /// which takes it over. A store whose records live in its process
    /// only (nothing another instance could find) answers
    /// [`IdentityClaim::Held`].
    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send;
}

impl<S: Store> Store for std::sync::Arc<S> {
    fn reserve(
        &self,
        request: &ReserveRequest,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send {
        (**self).reserve(request)
    }

    fn renew(&self, lease: &Lease) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        (**self).renew(lease)
    }

    fn mark_unknown(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        (**self).mark_unknown(lease)
    }

    fn complete(
        &self,
        lease: &Lease,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        (**self).complete(lease, outcome)
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<Release, StoreError>> + Send {
        (**self).release(lease)
    }

    fn call_bound(&self) -> Option<Duration> {
        (**self).call_bound()
    }

    fn timeout_means_busy(&self) -> bool {
        (**self).timeout_means_busy()
    }

    fn completes_in_transactions(&self) -> bool {
        (**self).completes_in_transactions()
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        (**self).settled()
    }

    fn background_tasks(&self) -> usize {
        (**self).background_tasks()
    }

    fn cancel(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Cancellation, StoreError>> + Send {
        (**self).cancel(scope)
    }

    fn get(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        (**self).get(scope)
    }

    fn changed(&self, scope: &ScopeHash, timeout: Duration) -> impl Future<Output = ()> + Send {
        (**self).changed(scope, timeout)
    }

    fn erasures(&self) -> Option<crate::ErasureFeed> {
        (**self).erasures()
    }
}

impl<S: RecordsAdmin> RecordsAdmin for std::sync::Arc<S> {
    fn list(
        &self,
        query: &RecordQuery,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send {
        (**self).list(query)
    }

    fn force_release(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<ForceRelease, StoreError>> + Send {
        (**self).force_release(scope)
    }

    fn erase(&self, scope: &ScopeHash) -> impl Future<Output = Result<Erasure, StoreError>> + Send {
        (**self).erase(scope)
    }

    fn count_lapsed(&self, limit: usize) -> impl Future<Output = Result<usize, StoreError>> + Send {
        (**self).count_lapsed(limit)
    }
}

impl<S: Fleet> Fleet for std::sync::Arc<S> {
    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).claim_duty(duty, holder, ttl)
    }

    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        (**self).claim_identity(marker, ttl, replace)
    }
}
