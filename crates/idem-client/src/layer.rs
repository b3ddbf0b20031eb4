//! [`RetryLayer`], its settings, and the [`Retry`] service it makes.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use tower::{Layer, Service, retry::budget::TpsBudget};

use crate::{
    body::{BoxError, ReplayBody},
    config::Config,
    error::Error,
    limits::Limits,
    service::run,
};

/// Tower layer for safe client retries; see the [crate docs](crate).
///
/// Clones share the configuration and the retry budget.
#[derive(Clone)]
pub struct RetryLayer {
    config: Arc<Config>,
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("max_attempts", &self.config.max_attempts)
            .field("deadline", &self.config.deadline)
            .finish_non_exhaustive()
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryLayer {
    /// Defaults: 4 attempts, 100 ms base delay, 5 s maximum delay, 30 s
    /// deadline, 64 KiB body limit, no attempt timeout, keys added to POST
    /// and PATCH, and a budget of 20 % of recent requests (plus 10 retries
    /// per second) over 10 s.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                max_attempts: 4,
                base_delay: Duration::from_millis(100),
                max_delay: Duration::from_secs(5),
                deadline: Duration::from_secs(30),
                body_limit: 64 * 1024,
                attempt_timeout: None,
                key_methods: vec![Method::POST, Method::PATCH],
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
                limits: None,
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// The most attempts, the first included (at least 1).
    pub fn max_attempts(self, attempts: u32) -> Self {
        self.with(|c| c.max_attempts = attempts.max(1))
    }

    /// The backoff base: retry *n* waits up to `base * 2^(n-1)`.
    pub fn base_delay(self, delay: Duration) -> Self {
        self.with(|c| c.base_delay = delay)
    }

    /// The longest backoff delay.
    pub fn max_delay(self, delay: Duration) -> Self {
        self.with(|c| c.max_delay = delay)
    }

    /// No attempt starts later than this after the first one.
    pub fn deadline(self, deadline: Duration) -> Self {
        self.with(|c| c.deadline = deadline)
    }

    /// Bodies up to this size (and of known length) are buffered so they
    /// can be resent; others are sent once.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.with(|c| c.body_limit = bytes)
    }

    /// Gives up on an attempt after this long (a retryable timeout).
    pub fn attempt_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.attempt_timeout = Some(timeout))
    }

    /// Methods that get a fresh `Idempotency-Key` when they have none.
    pub fn key_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.key_methods = methods)
    }

    /// The retry budget shared by every clone: retries may be at most
    /// `retry_percent` of the requests of the last `ttl`, plus
    /// `min_per_sec` retries per second (see tower's `TpsBudget`).
    pub fn budget(self, ttl: Duration, min_per_sec: u32, retry_percent: f32) -> Self {
        let budget = Arc::new(TpsBudget::new(ttl, min_per_sec, retry_percent));
        self.with(|c| c.budget = budget)
    }
}

impl RetryLayer {
    /// Holds every request to its boundary's shared limits (see
    /// [`Limits`]): a rate, cooldowns after 429 and 503, a shared retry
    /// budget, fair queueing across owners.
    pub fn limits(self, limits: Limits) -> Self {
        self.with(|c| c.limits = Some(limits))
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service produced by [`RetryLayer`].
#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, B, R> Service<Request<B>> for Retry<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<ReplayBody<R>>;
    type Error = Error<S::Error>;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    #[inline]
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each attempt drives a clone of the inner service to readiness.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        Box::pin(run(Arc::clone(&self.config), self.inner.clone(), request))
    }
}
