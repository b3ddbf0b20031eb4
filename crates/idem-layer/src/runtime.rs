//! What the request path, the commands and the records API share: the
//! [`Runtime`] (store, settings, background work), store calls under the
//! timeout, releasing a lease, the 503 answer, the caller's tenant and the
//! operation name.

use std::{future::Future, sync::Arc, task::Poll, time::Duration};

use http::{Response, request::Parts};
use idem_core::{Current, Lease, Release, ScopeHash, Store, StoreError};
use tokio_util::task::TaskTracker;

use crate::{
    ResponseBody,
    config::Config,
    metrics::{self as m, Outcome as Counted, StoreOp},
    problem::{ProblemCode, problem},
    recent::Recent,
    tenant::ANONYMOUS_TENANT,
};

/// What every part of the layer works with: the store, the settings, and
/// the work that outlives its request, behind one reference count (cloned
/// several times per request, on every core at once: one shared count
/// instead of three); the public [`IdempotencyLayer`](crate::IdempotencyLayer)
/// holds one and hands it to the services it makes.
pub(crate) struct Runtime<S>(Arc<Shared<S>>);

/// The parts of a [`Runtime`].
pub(crate) struct Shared<S> {
    pub(crate) store: Arc<S>,
    pub(crate) config: Arc<Config>,
    /// Work that outlives its request: detached handlers, completions
    /// retried after a store error, answers awaited after an unknown
    /// outcome. Shared by clones; `IdempotencyLayer::drain` waits for it.
    pub(crate) tasks: TaskTracker,
    /// The records API's listings, shared by every records service of the
    /// layer.
    pub(crate) listings: Arc<crate::listing::ListingBudget>,
    /// Outcomes held here that a store error kept from being recorded
    /// yet, by scope (see [`pending`](crate::pending)).
    pub(crate) pending: Arc<crate::pending::Pending>,
    /// Whether `config` passed validation, decided once (a router may
    /// apply the layer per request) and again after every change.
    pub(crate) valid: std::sync::OnceLock<bool>,
    /// Completed records this process was answered with (see
    /// [`ReplayCache`](crate::storm::ReplayCache)), made at first use from
    /// the settings; none when they turn it off.
    pub(crate) replays: std::sync::OnceLock<Option<crate::storm::ReplayCache>>,
    /// The reservations in flight, by scope (single flight).
    pub(crate) flights: Arc<crate::storm::Flights>,
    /// Cancelled when the server stops taking requests
    /// ([`IdempotencyLayer::close`](crate::IdempotencyLayer::close)):
    /// answers fetched by key stop waiting.
    pub(crate) closing: tokio_util::sync::CancellationToken,
}

impl<S> Runtime<S> {
    pub(crate) fn new(store: S, mut config: Config) -> Self
    where
        S: Store,
    {
        config.store_bound = store.call_bound();
        config.timeout_busy = store.timeout_means_busy();
        Self(Arc::new(Shared {
            store: Arc::new(store),
            config: Arc::new(config),
            tasks: TaskTracker::new(),
            listings: Default::default(),
            pending: Default::default(),
            valid: std::sync::OnceLock::new(),
            replays: std::sync::OnceLock::new(),
            flights: Default::default(),
            closing: Default::default(),
        }))
    }

    /// The replay cache, if the settings keep one.
    pub(crate) fn replays(&self) -> Option<&crate::storm::ReplayCache>
    where
        S: Store,
    {
        self.0
            .replays
            .get_or_init(|| {
                let config = &self.0.config;
                let (bytes, bound) = config.replay_cache;
                let feed = || self.0.store.erasures();
                crate::storm::ReplayCache::new(bytes, bound, feed, config.store_timeout)
            })
            .as_ref()
    }

    /// The settings, to change while the layer is being built (copied on
    /// write if services already share them).
    pub(crate) fn config_mut(&mut self) -> &mut Config {
        let shared = Arc::make_mut(&mut self.0);
        shared.valid = std::sync::OnceLock::new();
        shared.replays = std::sync::OnceLock::new();
        Arc::make_mut(&mut shared.config)
    }
}

impl<S> Clone for Runtime<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            tasks: self.tasks.clone(),
            listings: Arc::clone(&self.listings),
            pending: Arc::clone(&self.pending),
            valid: self.valid.clone(),
            // Made again from the settings, which a copy is taken to change.
            replays: std::sync::OnceLock::new(),
            flights: Arc::clone(&self.flights),
            closing: self.closing.clone(),
        }
    }
}

impl<S> std::ops::Deref for Runtime<S> {
    type Target = Shared<S>;

    fn deref(&self) -> &Shared<S> {
        &self.0
    }
}

impl<S: Store> Runtime<S> {
    /// The store's `complete` under the layer's bound: with a keyring, the
    /// response sealed for this lease's record and generation, and a
    /// stored response in the answer opened.
    pub(crate) async fn complete(
        &self,
        lease: &Lease,
        outcome: &idem_core::Outcome,
    ) -> Result<idem_core::Completion, StoreError> {
        let sealed = self.sealed(lease, outcome);
        let stored = sealed.as_ref().unwrap_or(outcome);
        let completion = store_call(
            &self.config,
            StoreOp::Complete,
            self.store.complete(lease, stored),
        )
        .await?;
        self.opened(completion, &lease.scope)
    }

    /// `outcome` as the store is to keep it under `lease`: its response
    /// sealed with the layer's keyring; `None` when it is kept as it is
    /// (no keyring, or no response).
    pub(crate) fn sealed(
        &self,
        lease: &Lease,
        outcome: &idem_core::Outcome,
    ) -> Option<idem_core::Outcome> {
        use idem_core::Outcome;
        match (&self.config.sealing, outcome) {
            (Some(keyring), Outcome::Stored(response)) if self.config.seal_new => Some(
                Outcome::Stored(keyring.seal(&lease.scope, lease.attempt, response)),
            ),
            _ => None,
        }
    }

    /// A store's answer with every sealed response in it opened (as it
    /// is without a keyring); one that does not open is an error.
    pub(crate) fn opened<T: crate::sealing::Opens>(
        &self,
        answer: T,
        scope: &idem_core::ScopeHash,
    ) -> Result<T, StoreError> {
        answer.opened(self.config.sealing.as_ref(), scope)
    }

    /// Releases the key after a temporary failure or a dropped attempt.
    /// Answers what the record says now when the lease was lost (the
    /// attempt was superseded or cancelled), so the attempt's client can
    /// get that instead.
    pub(crate) async fn release(&self, lease: &Lease) -> Option<Current> {
        m::count(Counted::Released);
        let released = store_call(&self.config, StoreOp::Release, self.store.release(lease))
            .await
            .and_then(|answer| self.opened(answer, &lease.scope));
        match released {
            Ok(Release::Released) => None,
            Ok(Release::Fenced(current)) => {
                m::count(Counted::Fenced);
                Some(current)
            }
            Err(error) => {
                self.release_in_background(lease, &error);
                None
            }
        }
    }

    /// Starts [`release_later`] after a release's store error (a rare
    /// path, kept out of [`release`](Self::release)'s code).
    #[cold]
    #[inline(never)]
    fn release_in_background(&self, lease: &Lease, error: &StoreError) {
        use tracing::Instrument;
        m::count(Counted::StoreError);
        tracing::warn!(%error, "could not release the reservation yet; retrying in the background");
        // Listed before the client gets its answer: its retry finds it.
        let pending = self.pending.register(lease.scope);
        self.tasks
            .spawn(release_later(self.clone(), lease.clone(), pending).in_current_span());
    }
}

/// Retries a release the store did not take, like a completion (see
/// [`pending`](crate::pending)): at once when a reservation of its scope
/// reaches this layer (which waits for that try, so the retry the client
/// was told it may send runs instead of meeting `409`) or when the store
/// answers any reservation, else backing off to two tries a second, until
/// the store answers or the record's retention passed. A release is fenced
/// by its lease's generation and owner token: a late one changes nothing
/// of a record another attempt took over.
async fn release_later<S: Store>(
    rt: Runtime<S>,
    lease: Lease,
    pending: crate::pending::Registration,
) {
    let deadline = deadline_after(rt.config.retention);
    let mut pause = Duration::from_millis(100);
    loop {
        pending.pause(pause).await;
        match store_call(&rt.config, StoreOp::Release, rt.store.release(&lease)).await {
            Ok(answer) => {
                pending.tried(true);
                if let Release::Fenced(_) = answer {
                    m::count(Counted::Fenced);
                }
                tracing::info!("reservation released after a store error");
                return;
            }
            Err(error) => {
                pending.tried(false);
                if tokio::time::Instant::now() + pause >= deadline {
                    tracing::error!(
                        %error,
                        "the reservation could not be released within the record's retention"
                    );
                    return;
                }
                tracing::debug!(%error, "releasing the reservation failed again");
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// The `Retry-After` hint for a duplicate of an attempt that runs here
/// past its lapsed lease (the lease says nothing of when it ends).
pub(crate) const RUNNING_RETRY_AFTER: Duration = Duration::from_secs(1);

impl<S> Runtime<S> {
    /// Before a reservation of `scope`: `Err` when this layer holds an
    /// attempt of it that still runs after its lease lapsed, or an outcome
    /// of it that the store has not taken yet, even when tried again now
    /// (see [`pending`](crate::pending)). Either way the action ran or
    /// runs: fail-open does not apply, and the retry that the store would
    /// let take over waits instead. A running attempt is waited for until
    /// `deadline` (the in-flight wait mode's; `None`: not at all).
    pub(crate) async fn outcome_recorded(
        &self,
        scope: &ScopeHash,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), crate::pending::Held> {
        // One try of the completion: a store call, within its timeout. A
        // try that fails ends the wait at once; the floor is for a busy
        // machine that runs the try late.
        let bound = self
            .config
            .store_timeout
            .saturating_mul(2)
            .max(Duration::from_secs(2));
        loop {
            return match self.pending.settled(scope, bound).await {
                Err(crate::pending::Held::Running) => {
                    let now = tokio::time::Instant::now();
                    if let Some(deadline) = deadline.filter(|deadline| now < *deadline) {
                        self.pending.changed(scope, deadline - now).await;
                        continue;
                    }
                    Err(crate::pending::Held::Running)
                }
                settled => settled,
            };
        }
    }
}

/// `now + bound`, saturating far in the future instead of overflowing.
pub(crate) fn deadline_after(bound: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(bound)
        .unwrap_or_else(|| now + crate::MAX_DURATION)
}

/// How long a waiting duplicate waits for the record to change: until its
/// own deadline, and no longer than the holder's lease has left (a lapsed
/// lease publishes nothing; the next reservation takes it over).
pub(crate) fn wait_bound(deadline_left: Duration, lease_left: Duration) -> Duration {
    deadline_left.min(lease_left.max(Duration::from_millis(1)))
}

/// Runs a store call under the configured timeout and records its latency.
///
/// The store's future is boxed at once: a store's futures can be large
/// (a Redis call holds its script invocation, connection and guards), and
/// kept inline they would make every future of the request path that
/// awaits one as large, to be copied whole wherever it moves (into the
/// boxed service future, into a task).
pub(crate) fn store_call<'a, T: Send + 'a>(
    config: &'a Config,
    op: StoreOp,
    call: impl Future<Output = Result<T, StoreError>> + Send + 'a,
) -> impl Future<Output = Result<T, StoreError>> + Send + 'a {
    let bound = (!store_bounds(config, op)).then_some(config.store_timeout);
    timed_call(config, op, bound, call)
}

/// The least time a records listing is given: it reads every record of
/// the store, which takes longer than one call. Listings are budgeted
/// (see [`records`](crate::records)), so a long one does not load the
/// store.
pub(crate) const LISTING_TIMEOUT: Duration = Duration::from_secs(30);

/// [`store_call`] for a records listing: bounded by the store timeout or
/// [`LISTING_TIMEOUT`], the longer.
pub(crate) fn list_call<'a, T: Send + 'a>(
    config: &'a Config,
    call: impl Future<Output = Result<T, StoreError>> + Send + 'a,
) -> impl Future<Output = Result<T, StoreError>> + Send + 'a {
    let bound = config.store_timeout.max(LISTING_TIMEOUT);
    timed_call(config, StoreOp::List, Some(bound), call)
}

/// [`store_call`] for a completion committed through the handler's own
/// transaction: not a call of the store, so the layer always bounds it.
pub(crate) fn commit_call<'a, T: Send + 'a>(
    config: &'a Config,
    call: impl Future<Output = Result<T, StoreError>> + Send + 'a,
) -> impl Future<Output = Result<T, StoreError>> + Send + 'a {
    timed_call(config, StoreOp::Complete, Some(config.store_timeout), call)
}

/// A call within `bound` (`None`: the callee bounds it within the layer's
/// timeout itself), its latency recorded as `op`'s.
fn timed_call<'a, T: Send + 'a>(
    config: &'a Config,
    op: StoreOp,
    bound: Option<Duration>,
    call: impl Future<Output = Result<T, StoreError>> + Send + 'a,
) -> impl Future<Output = Result<T, StoreError>> + Send + 'a {
    let mut call: std::pin::Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>> =
        Box::pin(call);
    async move {
        let started = std::time::Instant::now();
        // No timer for a call the store bounds itself within the layer's
        // timeout (its own timer ends the call first); `within` arms none
        // for a call answered at once (the memory store's).
        let result = match within(bound, &mut call).await {
            Ok(result) => result,
            // Behind a pooler that queues calls, the time ran out in its
            // queue: busy, never an outage fail-open could cover.
            Err(_) if config.timeout_busy => Err(StoreError::Busy {
                retry_after: Duration::from_secs(1),
            }),
            Err(_) => Err(StoreError::Timeout(bound.unwrap_or(config.store_timeout))),
        };
        m::store_latency(op, started.elapsed());
        result
    }
}

/// Awaits `future` within `bound` (`None`: unbounded), arming the timer
/// only if the future is still pending after a first poll: work that is
/// already done (a memory-store call, a body that has arrived) runs no
/// timer.
pub(crate) async fn within<F: Future + Unpin>(
    bound: Option<Duration>,
    mut future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let first = std::future::poll_fn(|cx| Poll::Ready(std::pin::Pin::new(&mut future).poll(cx)));
    match (first.await, bound) {
        (Poll::Ready(output), _) => Ok(output),
        (Poll::Pending, None) => Ok(future.await),
        (Poll::Pending, Some(bound)) => tokio::time::timeout(bound, future).await,
    }
}

/// Whether the store bounds a call of `op` within the layer's store
/// timeout itself ([`Store::call_bound`](idem_core::Store::call_bound)
/// covers reserve, renew, complete and release).
fn store_bounds(config: &Config, op: StoreOp) -> bool {
    matches!(
        op,
        StoreOp::Reserve | StoreOp::Renew | StoreOp::Complete | StoreOp::Release
    ) && config
        .store_bound
        .is_some_and(|bound| bound <= config.store_timeout)
}

/// [`Store::changed`](idem_core::Store::changed), boxed for the reason
/// [`store_call`] boxes.
pub(crate) async fn wait_for_change<S: idem_core::Store>(
    store: &S,
    scope: &idem_core::ScopeHash,
    bound: Duration,
) {
    let wait: std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> =
        Box::pin(store.changed(scope, bound));
    wait.await;
}

pub(crate) fn store_unavailable<B>(error: &StoreError) -> Response<ResponseBody<B>> {
    // A tenant at its quota is not a store in trouble: counted apart, so
    // that an alert on store errors does not fire for one busy tenant.
    m::count(match error {
        StoreError::QuotaExceeded { .. } => Counted::QuotaExceeded,
        _ => Counted::StoreError,
    });
    unavailable_problem(error)
}

/// `503 idempotency_store_unavailable` for a failed store call, of the
/// layer and of the records API alike; the error itself is logged.
pub(crate) fn unavailable_problem<B>(error: &StoreError) -> Response<ResponseBody<B>> {
    tracing::warn!(%error, "idempotency store call failed");
    // What went wrong inside is for the logs (above), not for the caller.
    let (code, detail, retry_after) = match error {
        StoreError::Full { retry_after, .. } => (
            ProblemCode::StoreUnavailable,
            "the idempotency store is full; retry after records expire",
            *retry_after,
        ),
        StoreError::Busy { retry_after } => (
            ProblemCode::StoreUnavailable,
            "every connection to the idempotency store is in use; retry shortly",
            *retry_after,
        ),
        StoreError::QuotaExceeded { retry_after, .. } => (
            ProblemCode::QuotaExceeded,
            "the caller holds its quota of idempotency records; retry after its oldest expire",
            *retry_after,
        ),
        _ => (
            ProblemCode::StoreUnavailable,
            "the idempotency store is unavailable; retry shortly",
            Duration::from_secs(1),
        ),
    };
    problem(code, detail, Some(retry_after))
}

impl Config {
    /// The caller's tenant: the extractor's, or the anonymous tenant when
    /// allowed; `None` when the caller is not identified.
    /// Why a request has no tenant: with no source chosen, that the
    /// default one (the `Tenant` request extension) was not set, which is
    /// what a layer built without [`tenant`](crate::IdempotencyLayer::tenant)
    /// answers to every keyed request unless a middleware sets it.
    pub(crate) fn tenant_missing_detail(&self) -> &'static str {
        if self.tenant_chosen {
            "a request with an Idempotency-Key must come from an identified caller"
        } else {
            "no tenant: the layer's tenant source is its default, the `Tenant` request \
             extension, and nothing set it on this request (an authentication middleware in \
             front of the layer sets it; or choose a source with `IdempotencyLayer::tenant`, \
             such as a header or `Authorization`, or allow anonymous callers)"
        }
    }

    pub(crate) fn tenant_of(&self, parts: &Parts) -> Option<Arc<str>> {
        // A caller named twice is not identified, nor anonymous.
        if self.tenant.ambiguous(parts) {
            return None;
        }
        match self.tenant.shared_tenant(parts) {
            Some(tenant) => Some(tenant),
            None if self.allow_anonymous => Some(ANONYMOUS_TENANT.into()),
            None => None,
        }
    }
}

/// The operation of a scope: the method and the route (`POST /orders`).
/// The request path and the records API name operations the same way, so
/// the records API finds what the layer stored.
pub(crate) fn operation_name(method: &str, route: &str) -> String {
    let mut name = String::with_capacity(method.len() + 1 + route.len());
    name.push_str(method);
    name.push(' ');
    name.push_str(route);
    name
}

/// How many operations each thread keeps named.
const RECENT_OPERATIONS: usize = 8;

thread_local! {
    /// The operations a thread named lately, the oldest replaced first: a
    /// service has a few routes, and their names are shared, not made
    /// again for every request.
    static OPERATIONS: std::cell::RefCell<Recent<Arc<str>, RECENT_OPERATIONS>> =
        const { std::cell::RefCell::new(Recent::new()) };
}

/// [`operation_name`] as shared text, from the thread's recent operations
/// when it named this one lately.
pub(crate) fn shared_operation_name(method: &str, route: &str) -> Arc<str> {
    let names = |name: &str| {
        name.len() == method.len() + 1 + route.len()
            && name.as_bytes()[method.len()] == b' '
            && name.starts_with(method)
            && name.ends_with(route)
    };
    // A thread past its thread-locals' end (a future dropped while the
    // thread exits) names the operation anew.
    let found =
        OPERATIONS.try_with(|recent| recent.borrow().iter().find(|name| names(name)).cloned());
    if let Ok(Some(name)) = found {
        return name;
    }
    let name: Arc<str> = operation_name(method, route).into();
    let _ = OPERATIONS.try_with(|recent| recent.borrow_mut().push(Arc::clone(&name)));
    name
}

#[cfg(test)]
mod tests {
    use super::{RECENT_OPERATIONS, operation_name, shared_operation_name};

    /// The shared name of an operation is its name, whether the thread
    /// named it lately or not: routes of one length, methods of one
    /// length, and more operations than a thread keeps, each named in
    /// turn, twice.
    #[test]
    fn shared_operation_names_are_the_names() {
        let mut operations = vec![
            ("POST", "/ab"),
            ("POST", "/cd"),
            ("PUTS", "/ab"),
            ("PUT", "/abc"),
            ("PUT", "/ab c"),
            ("POST", "/"),
            ("DELETE", "/orders/{id}"),
        ];
        operations.extend((0..RECENT_OPERATIONS).map(|n| {
            (
                "PATCH",
                ["/a", "/b", "/c", "/d", "/e", "/f", "/g", "/h"][n % 8],
            )
        }));
        for _ in 0..2 {
            for &(method, route) in &operations {
                for _ in 0..2 {
                    assert_eq!(
                        &*shared_operation_name(method, route),
                        operation_name(method, route)
                    );
                }
            }
        }
    }
}
