//! [`Sealed`]: responses sealed at rest on their way into the store and
//! opened on their way out.

use std::{future::Future, time::Duration};

use idem_core::{
    Cancellation, Completion, DeferredCompletion, Erasure, ErasureFeed, Fleet, ForceRelease,
    IdentityClaim, Lease, Outcome, Record, RecordQuery, RecordsAdmin, Release, Renewal,
    Reservation, ReserveRequest, ScopeHash, Store, StoreError,
};

use super::Bounded;
use crate::{
    sealing::{Keyring, Opens},
    settings::Sealing,
};

/// A store that keeps stored responses sealed at rest (see
/// [`sealing`](crate::sealing)): a completion's response is sealed with
/// the keyring's current key for its record and attempt, and the stored
/// response in a reservation's, a completion's or a release's answer is
/// opened, so that whoever replays it gets the plain response. A sealed
/// response that does not open (an unknown key, damaged bytes, a response
/// moved to another record or attempt), or one met without a keyring, is
/// an error. Without a keyring, responses are kept as they are.
///
/// Renewals, reads, listings, cancellations, forced releases and erasures
/// hand their records out as kept: an operator reads, cancels, releases or
/// erases a record whatever its response.
#[derive(Debug)]
pub struct Sealed<S> {
    inner: S,
    keyring: Option<Keyring>,
    /// Whether new responses are sealed (else the keyring only opens).
    seal_new: bool,
}

impl<S> Sealed<S> {
    /// `inner`, sealing and opening responses as `sealing` says.
    pub fn new(inner: S, sealing: Sealing) -> Self {
        Self {
            inner,
            keyring: sealing.keyring,
            seal_new: sealing.seal_new,
        }
    }

    /// The store inside.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `outcome` as the store is to keep it under `lease`: its response
    /// sealed with the keyring; `None` when it is kept as it is.
    fn sealed(&self, lease: &Lease, outcome: &Outcome) -> Option<Outcome> {
        match (&self.keyring, outcome) {
            (Some(keyring), Outcome::Stored(response)) if self.seal_new => Some(Outcome::Stored(
                keyring.seal(&lease.scope, lease.attempt, response),
            )),
            _ => None,
        }
    }

    /// A store's answer with every sealed response in it opened; one that
    /// does not open is an error.
    pub(crate) fn open<T: Opens>(&self, answer: T, scope: &ScopeHash) -> Result<T, StoreError> {
        answer.opened(self.keyring.as_ref(), scope)
    }
}

impl<S: Store> Sealed<Bounded<S>> {
    /// Records `outcome` through the transaction the handler left
    /// ([`DeferredCompletion`]): sealed like a completion, bounded like a
    /// store call (a commit is not one, so it is always bounded), and its
    /// answer opened.
    pub(crate) async fn commit(
        &self,
        lease: &Lease,
        deferred: Box<dyn DeferredCompletion>,
        outcome: Outcome,
    ) -> Result<Completion, StoreError> {
        let outcome = self.sealed(lease, &outcome).unwrap_or(outcome);
        let completion = self
            .inner
            .commit(deferred.commit(lease.clone(), outcome))
            .await?;
        self.open(completion, &lease.scope)
    }
}

impl<S: Store> Store for Sealed<S> {
    fn reserve(
        &self,
        request: &ReserveRequest,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send {
        let reserved = self.inner.reserve(request);
        async move { self.open(reserved.await?, request.scope.hash()) }
    }

    fn renew(&self, lease: &Lease) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        self.inner.renew(lease)
    }

    fn mark_unknown(
        &self,
        lease: &Lease,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send {
        self.inner.mark_unknown(lease)
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        let sealed = self.sealed(lease, outcome);
        let stored = sealed.as_ref().unwrap_or(outcome);
        let completion = self.inner.complete(lease, stored).await?;
        self.open(completion, &lease.scope)
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<Release, StoreError>> + Send {
        let released = self.inner.release(lease);
        async move { self.open(released.await?, &lease.scope) }
    }

    fn cancel(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Cancellation, StoreError>> + Send {
        self.inner.cancel(scope)
    }

    fn get(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.inner.get(scope)
    }

    fn call_bound(&self) -> Option<Duration> {
        self.inner.call_bound()
    }

    fn timeout_means_busy(&self) -> bool {
        self.inner.timeout_means_busy()
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

    fn changed(&self, scope: &ScopeHash, timeout: Duration) -> impl Future<Output = ()> + Send {
        self.inner.changed(scope, timeout)
    }
}

impl<S: RecordsAdmin> RecordsAdmin for Sealed<S> {
    fn list(
        &self,
        query: &RecordQuery,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send {
        self.inner.list(query)
    }

    fn count_lapsed(&self, limit: usize) -> impl Future<Output = Result<usize, StoreError>> + Send {
        self.inner.count_lapsed(limit)
    }

    fn force_release(
        &self,
        scope: &ScopeHash,
    ) -> impl Future<Output = Result<ForceRelease, StoreError>> + Send {
        self.inner.force_release(scope)
    }

    fn erase(&self, scope: &ScopeHash) -> impl Future<Output = Result<Erasure, StoreError>> + Send {
        self.inner.erase(scope)
    }
}

impl<S: Fleet> Fleet for Sealed<S> {
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
