//! [`RetryLayer`] and the [`Retry`] service.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Response, header, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower::{
    Layer, Service, ServiceExt,
    retry::budget::{Budget, TpsBudget},
};

use crate::{
    backoff::{ceiling, full_jitter, parse_retry_after},
    body::{BoxError, ReplayBody},
    limits::{GateError, Limits, Refusal},
};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(idem_core::protocol::IDEMPOTENCY_KEY);

/// Why the middleware stopped retrying a request whose last answer was
/// retryable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// Not an idempotent method and no `Idempotency-Key`: retrying could
    /// execute the action twice.
    UnsafeMethod,
    /// The body was not buffered (over the limit or of unknown length), so
    /// it could not be sent again.
    BodyNotReplayable,
    /// The attempt limit was reached.
    MaxAttempts,
    /// The next attempt would have started after the deadline.
    Deadline,
    /// The shared retry budget is spent.
    BudgetExhausted,
}

impl StopReason {
    fn label(self) -> &'static str {
        match self {
            StopReason::UnsafeMethod => "unsafe_method",
            StopReason::BodyNotReplayable => "body_not_replayable",
            StopReason::MaxAttempts => "max_attempts",
            StopReason::Deadline => "deadline",
            StopReason::BudgetExhausted => "budget_exhausted",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What happened to a request: in the extensions of the final response,
/// and in every [`Error`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryInfo {
    /// How many attempts were sent.
    pub attempts: u32,
    /// Why retrying stopped although the last answer was retryable; `None`
    /// when the last answer was final.
    pub stopped: Option<StopReason>,
    /// The `Idempotency-Key` every attempt carried, if any.
    pub key: Option<String>,
    /// The boundary the request was limited on, if any (see
    /// [`RetryLayer::limits`]).
    pub boundary: Option<String>,
    /// How long its attempts were held for their boundary's turn, in all.
    pub held: Duration,
}

/// A request that failed without a response.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The inner service failed on the last attempt.
    Service {
        /// The inner error.
        source: E,
        /// The attempts made.
        info: RetryInfo,
    },
    /// The last attempt did not answer within the attempt timeout.
    TimedOut {
        /// The attempt timeout.
        after: Duration,
        /// The attempts made.
        info: RetryInfo,
    },
    /// The request body (to buffer it) or a 409 body (to read its problem
    /// code) could not be read.
    Body(BoxError),
    /// The boundary's turn would come after the deadline: the attempt was
    /// not sent.
    Limited {
        /// The boundary.
        boundary: String,
        /// How long the request would have had to wait.
        wait: Duration,
        /// The attempts made before.
        info: RetryInfo,
    },
    /// The limit gate's store failed, and the limits hold requests back
    /// then ([`OnGateError::HoldBack`](crate::OnGateError::HoldBack)).
    Gate {
        /// The gate's error.
        source: GateError,
        /// The attempts made before.
        info: RetryInfo,
    },
}

impl<E> Error<E> {
    /// The attempts made, when any were.
    pub fn info(&self) -> Option<&RetryInfo> {
        match self {
            Error::Service { info, .. }
            | Error::TimedOut { info, .. }
            | Error::Limited { info, .. }
            | Error::Gate { info, .. } => Some(info),
            Error::Body(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = |info: &RetryInfo| {
            info.stopped
                .map_or("the error is final".to_owned(), |s| format!("stopped: {s}"))
        };
        match self {
            Error::Service { source, info } => {
                write!(
                    f,
                    "request failed after {} attempt(s) ({}): {source}",
                    info.attempts,
                    stopped(info)
                )
            }
            Error::TimedOut { after, info } => {
                write!(
                    f,
                    "request timed out after {after:?} on attempt {} ({})",
                    info.attempts,
                    stopped(info)
                )
            }
            Error::Body(error) => write!(f, "body could not be read: {error}"),
            Error::Limited { boundary, wait, .. } => write!(
                f,
                "not sent: the turn of boundary {boundary:?} would come in {wait:?}, after the deadline"
            ),
            Error::Gate { source, .. } => write!(f, "not sent: {source}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Service { source, .. } => Some(source),
            Error::TimedOut { .. } | Error::Limited { .. } => None,
            Error::Body(error) => Some(error.as_ref()),
            Error::Gate { source, .. } => Some(source),
        }
    }
}

#[derive(Clone)]
struct Config {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    deadline: Duration,
    body_limit: usize,
    attempt_timeout: Option<Duration>,
    key_methods: Vec<Method>,
    budget: Arc<TpsBudget>,
    limits: Option<Limits>,
}

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

fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

fn clone_parts(parts: &Parts) -> Parts {
    let (mut copy, ()) = Request::new(()).into_parts();
    copy.method = parts.method.clone();
    copy.uri = parts.uri.clone();
    copy.version = parts.version;
    copy.headers = parts.headers.clone();
    copy.extensions = parts.extensions.clone();
    copy
}

/// The outcome of one attempt.
enum Attempt<R, E> {
    Answer(Response<ReplayBody<R>>),
    Failed(E),
    TimedOut(Duration),
}

/// The most of a 409 body read to find its problem `code`.
const IN_PROGRESS_BODY_LIMIT: usize = 64 * 1024;

/// Whether an answer may be retried, and why ("503", "in_progress", ...).
async fn classify<R>(
    response: Response<R>,
) -> Result<(Response<ReplayBody<R>>, Option<String>), BoxError>
where
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    let status = response.status();
    match status.as_u16() {
        408 | 425 | 429 | 502 | 503 | 504 => Ok((
            response.map(ReplayBody::once),
            Some(status.as_str().to_owned()),
        )),
        409 => {
            // Only an idempotency layer's "in progress" is worth retrying;
            // its problem document is small. A larger body is not one: it
            // reaches the caller whole, read bytes first.
            let (parts, body) = response.into_parts();
            let mut body = Box::pin(body);
            let mut read = BytesMut::new();
            while read.len() <= IN_PROGRESS_BODY_LIMIT {
                match body.frame().await {
                    Some(frame) => {
                        if let Ok(data) = frame.map_err(Into::into)?.into_data() {
                            read.extend_from_slice(&data);
                        }
                    }
                    None => break,
                }
            }
            let bytes = read.freeze();
            if bytes.len() > IN_PROGRESS_BODY_LIMIT {
                return Ok((
                    Response::from_parts(parts, ReplayBody::prefixed(bytes, body)),
                    None,
                ));
            }
            let code = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
            let reason = (code.as_deref() == Some(idem_core::protocol::codes::IN_PROGRESS))
                .then(|| "in_progress".to_owned());
            Ok((
                Response::from_parts(parts, ReplayBody::buffered(bytes)),
                reason,
            ))
        }
        _ => Ok((response.map(ReplayBody::once), None)),
    }
}

/// The request's key: its own, or a fresh one for a method of
/// [`RetryLayer::key_methods`] (kept for every attempt).
fn ensure_key(config: &Config, parts: &mut Parts) -> Option<String> {
    let key = parts
        .headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if key.is_some() || !config.key_methods.contains(&parts.method) {
        return key;
    }
    let fresh = uuid::Uuid::new_v4().to_string();
    let value = HeaderValue::try_from(fresh.as_str()).ok()?;
    parts.headers.insert(IDEMPOTENCY_KEY, value);
    Some(fresh)
}

/// The body, buffered when it is small enough and of known length (so it
/// can be sent again); otherwise handed back to be sent once.
async fn buffer_body<B>(config: &Config, body: B) -> Result<(Option<Bytes>, Option<B>), BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let replayable = body
        .size_hint()
        .upper()
        .is_some_and(|upper| upper <= config.body_limit as u64);
    if !replayable {
        return Ok((None, Some(body)));
    }
    let bytes = Limited::new(body, config.body_limit)
        .collect()
        .await?
        .to_bytes();
    Ok((Some(bytes), None))
}

/// Waits for the boundary's turn (see [`Limits`]); the time held, or the
/// error that stops the request before this attempt is sent.
async fn admit<E>(
    limits: &Limits,
    (boundary, owner): &(String, String),
    deadline: Option<tokio::time::Instant>,
    info: RetryInfo,
) -> Result<Duration, Error<E>> {
    match limits.admit(boundary, owner, deadline).await {
        Ok(waited) => Ok(waited),
        Err(Refusal::TooLate(wait)) => {
            metrics::counter!("idem_client_limit_refusals_total", "boundary" => boundary.clone())
                .increment(1);
            Err(Error::Limited {
                boundary: boundary.clone(),
                wait,
                info,
            })
        }
        Err(Refusal::Gate(source)) => Err(Error::Gate { source, info }),
    }
}

/// One attempt: what came back, why it may be retried (`None`: final),
/// and the `Retry-After` it asked for.
type Sent<R, E> = (Attempt<R, E>, Option<String>, Option<Duration>);

async fn send_once<S, B, R>(
    config: &Config,
    inner: S,
    request: Request<ReplayBody<B>>,
    attempt: u32,
) -> Result<Sent<R, S::Error>, Error<S::Error>>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    let span = tracing::debug_span!("attempt", attempt);
    let entered = span.enter();
    let call = inner.oneshot(request);
    drop(entered);
    let outcome = match config.attempt_timeout {
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result.map_err(Some),
            Err(_) => Err(None),
        },
        None => call.await.map_err(Some),
    };
    Ok(match outcome {
        Ok(response) => {
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| parse_retry_after(v.as_bytes(), SystemTime::now()));
            let (response, reason) = classify(response).await.map_err(Error::Body)?;
            (Attempt::Answer(response), reason, retry_after)
        }
        Err(Some(error)) => (Attempt::Failed(error), Some("transport".to_owned()), None),
        Err(None) => {
            let after = config.attempt_timeout.unwrap_or_default();
            (Attempt::TimedOut(after), Some("timeout".to_owned()), None)
        }
    })
}

/// The request as the caller gets it: the answer with its [`RetryInfo`],
/// or the error.
fn finish<R, E>(
    attempt: Attempt<R, E>,
    info: RetryInfo,
) -> Result<Response<ReplayBody<R>>, Error<E>> {
    match attempt {
        Attempt::Answer(mut response) => {
            response.extensions_mut().insert(info);
            Ok(response)
        }
        Attempt::Failed(source) => Err(Error::Service { source, info }),
        Attempt::TimedOut(after) => Err(Error::TimedOut { after, info }),
    }
}

/// A provider that says "too many" (429) or "unavailable" (503) says it to
/// every worker of the boundary: until its `Retry-After`, or a backoff.
async fn share_cooldown(
    config: &Config,
    limits: &Limits,
    boundary: &str,
    status: http::StatusCode,
    retry_after: Option<Duration>,
    attempts: u32,
) {
    if matches!(status.as_u16(), 429 | 503) {
        let period =
            retry_after.unwrap_or_else(|| ceiling(config.base_delay, config.max_delay, attempts));
        limits.cool_down(boundary, period).await;
    }
}

/// What a retry needs to be allowed, for [`stop_reason`].
struct RetryPlan<'a> {
    safe: bool,
    replayable: bool,
    attempts: u32,
    deadline: Option<tokio::time::Instant>,
    delay: Duration,
    limited: Option<(&'a Limits, &'a str)>,
}

/// Why the request may not be retried, if it may not.
async fn stop_reason(config: &Config, plan: RetryPlan<'_>) -> Option<StopReason> {
    let past_deadline = plan.deadline.is_some_and(|deadline| {
        tokio::time::Instant::now()
            .checked_add(plan.delay)
            .is_none_or(|at| at > deadline)
    });
    let stop = if !plan.safe {
        StopReason::UnsafeMethod
    } else if !plan.replayable {
        StopReason::BodyNotReplayable
    } else if plan.attempts >= config.max_attempts {
        StopReason::MaxAttempts
    } else if past_deadline {
        StopReason::Deadline
    } else if !config.budget.withdraw() {
        metrics::counter!("idem_client_budget_exhausted_total").increment(1);
        StopReason::BudgetExhausted
    } else if let Some((limits, boundary)) = plan.limited
        && !limits.budget(boundary, true).await
    {
        metrics::counter!("idem_client_budget_exhausted_total").increment(1);
        StopReason::BudgetExhausted
    } else {
        return None;
    };
    Some(stop)
}

async fn run<S, B, R>(
    config: Arc<Config>,
    inner: S,
    request: Request<B>,
) -> Result<Response<ReplayBody<R>>, Error<S::Error>>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    // A deadline beyond what the clock can hold is no deadline.
    let deadline = tokio::time::Instant::now().checked_add(config.deadline);
    let (mut parts, body) = request.into_parts();
    let key = ensure_key(&config, &mut parts);
    let safe = key.is_some() || is_idempotent(&parts.method);
    let (buffered, mut once) = buffer_body(&config, body).await.map_err(Error::Body)?;
    config.budget.deposit();
    let limits = config.limits.as_ref();
    let place = limits.and_then(|limits| limits.place(&parts));
    let limited = limits.zip(place.as_ref());
    if let Some((limits, (boundary, _))) = limited {
        limits.budget(boundary, false).await;
    }
    let mut held = Duration::ZERO;
    let mut attempts = 0u32;
    loop {
        let info = |attempts, held| RetryInfo {
            attempts,
            stopped: None,
            key: key.clone(),
            boundary: place.as_ref().map(|(boundary, _)| boundary.clone()),
            held,
        };
        if let Some((limits, place)) = limited {
            held += admit(limits, place, deadline, info(attempts, held)).await?;
        }
        attempts += 1;
        metrics::counter!("idem_client_attempts_total").increment(1);
        let body = match (&buffered, once.take()) {
            (Some(bytes), _) => ReplayBody::buffered(bytes.clone()),
            (None, Some(body)) => ReplayBody::once(body),
            // A body sent once is never retried (see `stop_reason`).
            (None, None) => ReplayBody::buffered(Bytes::new()),
        };
        let request = Request::from_parts(clone_parts(&parts), body);
        let (attempt, reason, retry_after) =
            send_once(&config, inner.clone(), request, attempts).await?;
        let mut info = info(attempts, held);
        let Some(reason) = reason else {
            return finish(attempt, info);
        };
        let delay = retry_after
            .unwrap_or_else(|| full_jitter(config.base_delay, config.max_delay, attempts));
        if let (Some((limits, (boundary, _))), Attempt::Answer(response)) = (limited, &attempt) {
            let status = response.status();
            share_cooldown(&config, limits, boundary, status, retry_after, attempts).await;
        }
        let plan = RetryPlan {
            safe,
            replayable: buffered.is_some(),
            attempts,
            deadline,
            delay,
            limited: limited.map(|(limits, (boundary, _))| (limits, boundary.as_str())),
        };
        if let Some(stop) = stop_reason(&config, plan).await {
            metrics::counter!("idem_client_give_ups_total", "reason" => stop.label()).increment(1);
            tracing::debug!(attempts, %stop, "not retrying");
            info.stopped = Some(stop);
            return finish(attempt, info);
        }
        metrics::counter!("idem_client_retries_total", "reason" => reason.clone()).increment(1);
        tracing::debug!(attempts, reason, ?delay, "retrying");
        drop(attempt);
        tokio::time::sleep(delay).await;
    }
}
