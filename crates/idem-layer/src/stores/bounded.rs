//! [`Bounded`]: every store call under the layer's store timeout, timed,
//! and its timeout classified.

use std::{future::Future, sync::Arc, time::Duration};

use idem_core::{
    Cancellation, Completion, Erasure, ErasureFeed, Fleet, ForceRelease, IdentityClaim, Lease,
    Outcome, Record, RecordQuery, RecordsAdmin, Release, Renewal, Reservation, ReserveRequest,
    ScopeHash, Store, StoreError,
};

use crate::{
    body::within,
    metrics::{self as m, StoreOp},
};

/// The least time a records listing is given: it reads every record of
/// the store, which takes longer than one call. The records API budgets
/// listings, so a long one does not load the store.
pub const LISTING_TIMEOUT: Duration = Duration::from_secs(30);

/// A store whose every call is bounded by the layer's store timeout and
/// timed (`idem_store_duration_seconds`, by operation). A call that runs
/// out of time answers [`StoreError::Timeout`], or [`StoreError::Busy`]
/// for a store whose timeouts mean its pooler queued the call
/// ([`Store::timeout_means_busy`]): never an outage that fail-open could
/// cover. A store that bounds its own calls within the timeout
/// ([`Store::call_bound`]) is given no timer of the layer's for them.
///
/// Each call's future is boxed at once: a store's futures can be large
/// (a Redis call holds its script invocation, connection and guards), and
/// kept inline they would make every future of the request path that
/// awaits one as large.
#[derive(Debug)]
pub struct Bounded<S> {
    inner: Arc<S>,
    timeout: Duration,
    /// Whether the store's own bound of reserve, renew, complete and
    /// release is within `timeout`.
    bounds_itself: bool,
    busy: bool,
}

impl<S: Store> Bounded<S> {
    /// `inner` with every call bounded by `timeout`.
    pub fn new(inner: Arc<S>, timeout: Duration) -> Self {
        Self {
            bounds_itself: inner.call_bound().is_some_and(|bound| bound <= timeout),
            busy: inner.timeout_means_busy(),
            inner,
            timeout,
        }
    }

    /// The store inside.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    /// The timeout every call is given.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A call of `op`: bounded by the timeout unless the store bounds such
    /// calls itself within it.
    fn call<T, F>(&self, op: StoreOp, call: F) -> impl Future<Output = Result<T, StoreError>> + Send
    where
        F: Future<Output = Result<T, StoreError>> + Send,
        T: Send,
    {
        let own = matches!(
            op,
            StoreOp::Reserve | StoreOp::Renew | StoreOp::Complete | StoreOp::Release
        ) && self.bounds_itself;
        self.timed(op, (!own).then_some(self.timeout), call)
    }

    /// A completion committed through the handler's own transaction: not
    /// a call of the store, so it is always bounded.
    pub(crate) fn commit<T, F>(&self, call: F) -> impl Future<Output = Result<T, StoreError>> + Send
    where
        F: Future<Output = Result<T, StoreError>> + Send,
        T: Send,
    {
        self.timed(StoreOp::Complete, Some(self.timeout), call)
    }

    /// A call within `bound` (`None`: the store bounds it itself), its
    /// latency recorded as `op`'s.
    fn timed<T, F>(
        &self,
        op: StoreOp,
        bound: Option<Duration>,
        call: F,
    ) -> impl Future<Output = Result<T, StoreError>> + Send
    where
        F: Future<Output = Result<T, StoreError>> + Send,
        T: Send,
    {
        let mut call = Box::pin(call);
        async move {
            let started = std::time::Instant::now();
            // No timer for a call the store bounds itself (its own timer
            // ends the call first); `within` arms none for a call answered
            // at once (the memory store's).
            let result = match within(bound, &mut call).await {
                Ok(result) => result,
                // Behind a pooler that queues calls, the time ran out in
                // its queue: busy, never an outage fail-open could cover.
                Err(_) if self.busy => Err(StoreError::Busy {
                    retry_after: Duration::from_secs(1),
                }),
                Err(_) => Err(StoreError::Timeout(bound.unwrap_or(self.timeout))),
            };
            m::store_latency(op, started.elapsed());
            result
        }
    }
}

impl<S: Store> Store for Bounded<S> {
    fn reserve(
        &self,
        request: &ReserveRequest,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send {
        self.call(StoreOp::Reserve, self.inner.reserve(request))
    }

    fn renew(&self, lease: &Lease) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        self.call(StoreOp::Renew, self.inner.renew(lease))
    }

    fn mark_unknown(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        // A write of the lease's record like a renewal, timed as one.
        self.call(StoreOp::Renew, self.inner.mark_unknown(lease))
    }

    fn complete(
        &self,
        lease: &Lease,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        self.call(StoreOp::Complete, self.inner.complete(lease, outcome))
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<Release, StoreError>> + Send {
        self.call(StoreOp::Release, self.inner.release(lease))
    }

    fn cancel(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Cancellation, StoreError>> + Send {
        self.call(StoreOp::Cancel, self.inner.cancel(scope))
    }

    fn get(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.call(StoreOp::Get, self.inner.get(scope))
    }

    /// Every call ends within the layer's timeout.
    fn call_bound(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    /// A timeout is answered as the wrapped store means it: no call of
    /// this store runs out of time unanswered.
    fn timeout_means_busy(&self) -> bool {
        false
    }

    fn completes_in_transactions(&self) -> bool {
        self.inner.completes_in_transactions()
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        self.inner.settled()
    }

    fn background_tasks(&self) -> usize {
        self.inner.background_tasks()
    }

    fn erasures(&self) -> Option<ErasureFeed> {
        self.inner.erasures()
    }

    /// The wrapped store's wait, boxed for the reason every call is.
    fn changed(&self, scope: &ScopeHash, timeout: Duration) -> impl Future<Output = ()> + Send {
        Box::pin(self.inner.changed(scope, timeout))
    }
}

impl<S: RecordsAdmin> RecordsAdmin for Bounded<S> {
    /// Bounded by the store timeout or [`LISTING_TIMEOUT`], the longer.
    fn list(
        &self,
        query: &RecordQuery,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send {
        let bound = self.timeout.max(LISTING_TIMEOUT);
        self.timed(StoreOp::List, Some(bound), self.inner.list(query))
    }

    /// Bounded as a listing is.
    fn count_lapsed(&self, limit: usize) -> impl Future<Output = Result<usize, StoreError>> + Send {
        let bound = self.timeout.max(LISTING_TIMEOUT);
        self.timed(StoreOp::List, Some(bound), self.inner.count_lapsed(limit))
    }

    fn force_release(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<ForceRelease, StoreError>> + Send {
        self.call(StoreOp::ForceRelease, self.inner.force_release(scope))
    }

    fn erase(&self, scope: &ScopeHash) -> impl Future<Output = Result<Erasure, StoreError>> + Send {
        self.call(StoreOp::Erase, self.inner.erase(scope))
    }
}

/// Claims pass through: they keep a fleet's agreement, not a request's
/// record, and their callers bound and retry them.
impl<S: Fleet> Fleet for Bounded<S> {
    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.claim_duty(duty, holder, ttl)
    }

    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        self.inner.claim_identity(marker, ttl, replace)
    }
}
