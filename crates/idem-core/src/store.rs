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
//! Run the [`conformance`](crate::conformance) suite (feature
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

use crate::{Attempt, Fingerprint, Lease, Outcome, Record, RecordState, Scope, ScopeHash};

/// What [`Store::reserve`] needs to know.
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
}

/// The answer to [`Store::reserve`].
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

/// The answer to [`Store::renew`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Renewal {
    /// The lease now lasts another `ttl` from the store's now.
    Renewed,
    /// The lease was lost.
    Fenced(Current),
}

/// The answer to [`Store::complete`].
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

/// The answer to [`Store::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Release {
    /// The key is free again; the attempt is kept as released.
    Released,
    /// The lease was lost; the record is as `Current` says.
    Fenced(Current),
}

/// The answer to [`Store::cancel`]: which side won.
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

/// Which records [`RecordsAdmin::list`] answers, oldest first (then by key).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordQuery {
    /// Only this tenant's records (`None`: every tenant, for operators).
    pub tenant: Option<String>,
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records created at least this long ago (store clock).
    pub older_than: Option<Duration>,
    /// Only processing records whose lease has lapsed (stuck: nobody
    /// renews them and nobody took them over yet).
    pub lapsed: bool,
    /// At most this many records (0: none).
    pub limit: usize,
}

impl RecordQuery {
    /// Every tenant's processing records whose lease lapsed (stuck), at
    /// most `limit`: what [`RecordsAdmin::count_lapsed`] counts.
    pub fn stuck(limit: usize) -> Self {
        Self {
            lapsed: true,
            limit,
            ..Self::default()
        }
    }

    /// Whether `record` is one the query asks for, at `now_ms`.
    pub fn matches(&self, record: &Record, now_ms: u64) -> bool {
        let older = self.older_than.is_none_or(|age| {
            let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            now_ms.saturating_sub(record.created_at_ms) >= age
        });
        !record.is_expired(now_ms)
            && self.tenant.as_ref().is_none_or(|t| **t == *record.tenant)
            && self.state.is_none_or(|s| s == record.state)
            && older
            && (!self.lapsed
                || (record.state == RecordState::Processing
                    && record.lease_expires_at_ms <= now_ms))
    }
}

/// The oldest records of a listing, kept while the store is scanned: it
/// holds at most `limit` records at any time, so a listing over a large
/// store holds no more than its answer. Oldest means created first; records
/// created in the same millisecond go by key. A record offered again (a
/// Redis `SCAN` may name a key twice) is kept once.
#[derive(Debug)]
pub struct OldestRecords {
    limit: usize,
    /// The newest kept record on top.
    kept: std::collections::BinaryHeap<ByAge>,
    /// The scopes of the kept records.
    scopes: std::collections::HashSet<ScopeHash>,
}

#[derive(Debug)]
struct ByAge(Record);

impl ByAge {
    fn age_key(&self) -> (u64, &str) {
        (self.0.created_at_ms, &self.0.key)
    }
}

impl PartialEq for ByAge {
    fn eq(&self, other: &Self) -> bool {
        self.age_key() == other.age_key()
    }
}

impl Eq for ByAge {}

impl PartialOrd for ByAge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByAge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.age_key().cmp(&other.age_key())
    }
}

impl OldestRecords {
    /// Keeps the `limit` oldest records offered.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            kept: std::collections::BinaryHeap::with_capacity(limit.min(1024) + 1),
            scopes: std::collections::HashSet::new(),
        }
    }

    /// Whether a record created at `created_at_ms` with `key` would be
    /// kept now: check before cloning a record to offer it.
    pub fn wants(&self, created_at_ms: u64, key: &str) -> bool {
        if self.kept.len() < self.limit {
            return true;
        }
        self.kept
            .peek()
            .is_some_and(|newest| (created_at_ms, key) < newest.age_key())
    }

    /// Offers a record: kept if it is among the `limit` oldest so far and
    /// no record of its scope is kept already.
    pub fn offer(&mut self, record: Record) {
        if !self.wants(record.created_at_ms, &record.key) || !self.scopes.insert(record.scope) {
            return;
        }
        self.kept.push(ByAge(record));
        if self.kept.len() > self.limit
            && let Some(ByAge(newest)) = self.kept.pop()
        {
            self.scopes.remove(&newest.scope);
        }
    }

    /// The kept records, oldest first.
    pub fn into_oldest_first(self) -> Vec<Record> {
        self.kept
            .into_sorted_vec()
            .into_iter()
            .map(|ByAge(record)| record)
            .collect()
    }
}

/// The answer to [`RecordsAdmin::force_release`].
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
    /// answer (the Redis and PostgreSQL stores). The layer's
    /// [`drain`](https://docs.rs/idem-layer) waits for it at shutdown, so a
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttemptId, OwnerToken, machine};

    fn record(created_at_ms: u64, key: &str) -> Record {
        let request = crate::test_support::request(key);
        let mut slot = None;
        let _ = machine::reserve(
            &mut slot,
            &request,
            created_at_ms,
            AttemptId::new(),
            OwnerToken::new(),
        );
        slot.expect("reserved")
    }

    /// The `limit` oldest records come out oldest first (same millisecond:
    /// by key), whatever order they were offered in, and no more than
    /// `limit` are ever held.
    #[test]
    fn oldest_records_keep_the_oldest_and_no_more() {
        let mut offered: Vec<(u64, String)> = (0..200u64)
            .map(|i| ((i * 7919) % 101, format!("k{:03}", (i * 31) % 200)))
            .collect();
        let mut oldest = OldestRecords::new(5);
        for (created, key) in &offered {
            oldest.offer(record(*created, key));
            assert!(oldest.kept.len() <= 5);
        }
        offered.sort();
        let expected: Vec<(u64, String)> = offered.into_iter().take(5).collect();
        let kept: Vec<(u64, String)> = oldest
            .into_oldest_first()
            .into_iter()
            .map(|r| (r.created_at_ms, r.key.to_string()))
            .collect();
        assert_eq!(kept, expected);
        let mut none = OldestRecords::new(0);
        assert!(!none.wants(0, "a"));
        none.offer(record(0, "a"));
        assert!(none.into_oldest_first().is_empty());
    }

    /// A record offered twice is kept once; a record evicted by older ones
    /// leaves no trace behind.
    #[test]
    fn a_record_offered_twice_is_kept_once() {
        let keys = |oldest: OldestRecords| -> Vec<String> {
            oldest
                .into_oldest_first()
                .into_iter()
                .map(|r| r.key.to_string())
                .collect()
        };
        let mut oldest = OldestRecords::new(3);
        let twice = record(5, "a");
        oldest.offer(twice.clone());
        oldest.offer(twice);
        oldest.offer(record(6, "b"));
        assert_eq!(keys(oldest), ["a", "b"]);
        let mut oldest = OldestRecords::new(1);
        oldest.offer(record(9, "late"));
        oldest.offer(record(1, "early"));
        assert_eq!(oldest.scopes.len(), 1);
        oldest.offer(record(0, "earliest"));
        assert_eq!(keys(oldest), ["earliest"]);
    }
}
