//! The [`Idempotency`] service: the request path of the layer.

use std::{
    collections::VecDeque,
    future::Future,
    panic::AssertUnwindSafe,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, future::BoxFuture};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, header, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{
    Attempt, Completion, Current, IdempotencyKey, KeyError, Lease, Outcome, Release, Renewal,
    Replay, Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse,
};
use tower::Service;
use tracing::Instrument;

use crate::{
    IdempotencyContext, IdempotencyLayer, InFlight, OnDisconnect, ResponseBody,
    body::BoxError,
    layer::Config,
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
    tenant::ANONYMOUS_TENANT,
};

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The service produced by [`IdempotencyLayer`].
///
/// Requests of other methods, and keyless requests (unless a key is
/// required), reach the inner service untouched. Keyed requests are
/// buffered, fingerprinted and reserved; the inner service runs at most once
/// per scope at a time, and its stored outcome is replayed to duplicates.
pub struct Idempotency<I, S> {
    inner: I,
    layer: IdempotencyLayer<S>,
}

impl<I: Clone, S> Clone for Idempotency<I, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<I: std::fmt::Debug, S> std::fmt::Debug for Idempotency<I, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<I, S> Idempotency<I, S> {
    pub(crate) fn new(inner: I, layer: IdempotencyLayer<S>) -> Self {
        Self { inner, layer }
    }
}

impl<I, S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<I, S>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = I::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Take the service that was driven to readiness, leave a clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.layer.config.methods.contains(request.method()) {
            let future = inner.call(request);
            return Box::pin(async move { Ok(future.await?.map(ResponseBody::inner)) });
        }
        Box::pin(handle(self.layer.clone(), inner, request))
    }
}

fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).into_iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse(value.as_bytes()).map(Some)
}

fn operation(parts: &Parts) -> String {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return format!("{} {}", parts.method, path.as_str());
    }
    format!("{} {}", parts.method, parts.uri.path())
}

async fn passthrough<I, ReqBody, ResBody>(
    mut inner: I,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    Ok(inner.call(request).await?.map(ResponseBody::inner))
}

async fn handle<I, S, ReqBody, ResBody>(
    layer: IdempotencyLayer<S>,
    inner: I,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let config = &layer.config;
    let key = match read_key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => {
            m::count(Counted::Rejected);
            let detail = format!(
                "{} requests must carry an Idempotency-Key header",
                request.method()
            );
            return Ok(problem(ProblemCode::KeyMissing, &detail, None));
        }
        Ok(None) => return passthrough(inner, request).await,
        Err(error) => {
            m::count(Counted::Rejected);
            return Ok(problem(ProblemCode::KeyInvalid, &error.to_string(), None));
        }
    };

    let (parts, body) = request.into_parts();
    let tenant = match config.tenant.tenant(&parts) {
        Some(tenant) => tenant,
        None if config.allow_anonymous => ANONYMOUS_TENANT.to_owned(),
        None => {
            m::count(Counted::Rejected);
            let detail = "a request with an Idempotency-Key must come from an identified caller";
            return Ok(problem(ProblemCode::TenantMissing, detail, None));
        }
    };
    let body = match read_body(&parts, body, config.max_body, config.body_timeout).await {
        Ok(body) => body,
        Err(refusal) => {
            m::count(Counted::Rejected);
            return Ok(refusal);
        }
    };
    let operation = operation(&parts);
    let fingerprint = match &config.fingerprint_fn {
        Some(f) => f(&operation, &parts, &body),
        None => {
            crate::fingerprint::fingerprint(&operation, &parts, &config.fingerprint_headers, &body)
        }
    };
    let scope = Scope::new(tenant, operation, key);
    let span =
        tracing::debug_span!("idempotency", scope = %scope.hash(), operation = scope.operation());
    let reserve = ReserveRequest {
        scope,
        fingerprint,
        lease: config.lease,
        retention: config.retention,
    };
    let keyed = Keyed {
        layer: layer.clone(),
        inner,
        parts,
        body,
        reserve,
        request_body: std::marker::PhantomData,
    };
    keyed.run().instrument(span).await
}

/// Reads a keyed request's body within the limit, or the refusal.
async fn read_body<B, R>(
    parts: &Parts,
    body: B,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, Response<ResponseBody<R>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        let detail = format!("the request body exceeds the limit of {limit} bytes");
        problem(ProblemCode::BodyTooLarge, &detail, None)
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    let Ok(collected) = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await
    else {
        let detail = format!("the request body did not arrive within {timeout:?}");
        return Err(problem(ProblemCode::BodyTimeout, &detail, None));
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(too_large()),
        Err(error) => {
            let detail = format!("the request body could not be read: {error}");
            Err(problem(ProblemCode::BodyInvalid, &detail, None))
        }
    }
}

/// Runs a store call under the configured timeout and records its latency.
pub(crate) async fn store_call<T>(
    config: &Config,
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let result = match tokio::time::timeout(config.store_timeout, call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Timeout(config.store_timeout)),
    };
    m::store_latency(op, started.elapsed());
    result
}

fn store_unavailable<B>(error: &StoreError) -> Response<ResponseBody<B>> {
    m::count(Counted::StoreError);
    tracing::warn!(%error, "idempotency store call failed");
    let detail = match error {
        StoreError::Full { capacity } => format!(
            "the idempotency store is full ({capacity} live records); retry after records expire"
        ),
        other => format!("the idempotency store could not be reached: {other}"),
    };
    problem(
        ProblemCode::StoreUnavailable,
        &detail,
        Some(Duration::from_secs(1)),
    )
}

/// A keyed request on its way through the state machine.
struct Keyed<I, S, ReqBody> {
    layer: IdempotencyLayer<S>,
    inner: I,
    parts: Parts,
    body: Bytes,
    reserve: ReserveRequest,
    request_body: std::marker::PhantomData<fn() -> ReqBody>,
}

impl<I, S, ReqBody, ResBody> Keyed<I, S, ReqBody>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async fn run(self) -> Result<Response<ResponseBody<ResBody>>, I::Error> {
        let config = Arc::clone(&self.layer.config);
        let store = Arc::clone(&self.layer.store);
        let deadline = match config.in_flight {
            InFlight::Wait(bound) => Some(tokio::time::Instant::now() + bound),
            InFlight::Reject => None,
        };
        loop {
            let reservation = match store_call(&config, "reserve", store.reserve(&self.reserve))
                .await
            {
                Ok(reservation) => reservation,
                Err(error) if config.fail_open => {
                    tracing::warn!(%error, "idempotency store failed; running the handler unprotected");
                    m::count(Counted::FailOpen);
                    let request = Request::from_parts(self.parts, ReqBody::from(self.body));
                    return passthrough(self.inner, request).await;
                }
                Err(error) => return Ok(store_unavailable(&error)),
            };
            match reservation {
                Reservation::Acquired(lease) => return self.execute(lease, None).await,
                Reservation::TakenOver { lease, superseded } => {
                    m::count(Counted::Takeover);
                    tracing::info!(
                        generation = lease.generation,
                        superseded = %superseded.id,
                        "lease lapsed; taking over"
                    );
                    return self.execute(lease, Some(superseded)).await;
                }
                Reservation::InProgress { retry_after } => {
                    if let Some(deadline) = deadline {
                        let now = tokio::time::Instant::now();
                        if now < deadline {
                            store
                                .changed(self.reserve.scope.hash(), deadline - now)
                                .await;
                            continue;
                        }
                    }
                    return Ok(in_progress(retry_after));
                }
                Reservation::Completed(replay) => return Ok(replay_response(replay)),
                Reservation::Cancelled => return Ok(cancelled()),
                Reservation::Conflict => {
                    m::count(Counted::Conflict);
                    let detail = "this Idempotency-Key was used with a different request payload";
                    return Ok(problem(ProblemCode::Conflict, detail, None));
                }
            }
        }
    }

    async fn execute(
        self,
        lease: Lease,
        superseded: Option<Attempt>,
    ) -> Result<Response<ResponseBody<ResBody>>, I::Error> {
        let Keyed {
            layer,
            inner,
            mut parts,
            body,
            reserve,
            ..
        } = self;
        let scope = reserve.scope;
        parts.extensions.insert(IdempotencyContext {
            key: scope.key().clone(),
            tenant: scope.tenant().to_owned(),
            operation: scope.operation().to_owned(),
            scope: *scope.hash(),
            fingerprint: reserve.fingerprint,
            attempt: lease.attempt,
            generation: lease.generation,
            superseded,
        });
        let request = Request::from_parts(parts, ReqBody::from(body));
        match layer.config.on_disconnect {
            OnDisconnect::Detach => {
                // The attempt runs inline while the client waits; if the
                // client goes away, the unfinished attempt moves to a task
                // of its own and its outcome is still recorded.
                RunToCompletion::new(attempt(layer, inner, request, lease).in_current_span()).await
            }
            OnDisconnect::Release => {
                let guard = ReleaseOnDrop {
                    layer: layer.clone(),
                    lease: Some(lease.clone()),
                };
                let result = attempt(layer, inner, request, lease).await;
                guard.disarm();
                result
            }
        }
    }
}

/// Polls a future inline; if dropped before it finished, spawns the rest
/// of it so it still runs to completion (on-disconnect `Detach` mode). This
/// costs no task per request, yet a client disconnect never cancels a
/// handler half-way.
struct RunToCompletion<F: Future + Send + 'static> {
    future: Option<std::pin::Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> RunToCompletion<F> {
    fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F: Future + Send + 'static> Future for RunToCompletion<F> {
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F: Future + Send + 'static> Drop for RunToCompletion<F> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = future.await;
            });
        }
    }
}

/// Releases the reservation if the response future is dropped before the
/// attempt finished (on-disconnect `Release` mode).
struct ReleaseOnDrop<S: Store> {
    layer: IdempotencyLayer<S>,
    lease: Option<Lease>,
}

impl<S: Store> ReleaseOnDrop<S> {
    fn disarm(mut self) {
        self.lease = None;
    }
}

impl<S: Store> Drop for ReleaseOnDrop<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let layer = self.layer.clone();
        runtime.spawn(async move {
            m::count(Counted::Released);
            let released = store_call(&layer.config, "release", layer.store.release(&lease)).await;
            if let Err(error) = released {
                tracing::warn!(%error, "could not release the reservation of a dropped request");
            }
        });
    }
}

/// What the handler produced, read as far as the storable limit.
enum Buffered<B> {
    Complete {
        parts: http::response::Parts,
        body: Bytes,
    },
    TooLarge {
        parts: http::response::Parts,
        prefix: VecDeque<Bytes>,
        rest: B,
    },
    Failed(BoxError),
}

async fn buffer<B>(response: Response<B>, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (parts, mut body) = response.into_parts();
    let mut chunks = VecDeque::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Buffered::Failed(error.into()),
        };
        // Trailers are not stored.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        chunks.push_back(data);
        if total > limit {
            return Buffered::TooLarge {
                parts,
                prefix: chunks,
                rest: body,
            };
        }
    }
    let body = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut joined = BytesMut::with_capacity(total);
            chunks
                .iter()
                .for_each(|chunk| joined.extend_from_slice(chunk));
            joined.freeze()
        }
    };
    Buffered::Complete { parts, body }
}

/// Drives `work` while renewing the lease every third of its length.
async fn renewing<S: Store, T>(
    config: &Config,
    store: &S,
    lease: &Lease,
    work: impl Future<Output = T>,
) -> T {
    let period = (config.lease / 3).max(Duration::from_millis(1));
    let mut work = std::pin::pin!(work);
    let mut renew = true;
    loop {
        tokio::select! {
            biased;
            output = &mut work => return output,
            () = tokio::time::sleep(period), if renew => {
                match store_call(config, "renew", store.renew(lease)).await {
                    Ok(Renewal::Renewed) => {}
                    Ok(Renewal::Fenced(_)) => {
                        // Keep running: stopping a handler half-way is worse. Its
                        // completion will be fenced and kept as late evidence.
                        tracing::warn!("lease lost while the handler runs");
                        renew = false;
                    }
                    Err(error) => tracing::warn!(%error, "lease renewal failed; retrying"),
                }
            }
        }
    }
}

/// One execution of the handler under `lease`, and the recording of its
/// outcome.
async fn attempt<I, S, ReqBody, ResBody>(
    layer: IdempotencyLayer<S>,
    mut inner: I,
    request: Request<ReqBody>,
    lease: Lease,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S: Store,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    let config = &*layer.config;
    let store = &*layer.store;
    let max_response = config.max_response;
    let work = AssertUnwindSafe(async move {
        let response = inner.call(request).await?;
        Ok(buffer(response, max_response).await)
    })
    .catch_unwind();
    let release = || async {
        m::count(Counted::Released);
        match store_call(config, "release", store.release(&lease)).await {
            Ok(Release::Released) => {}
            Ok(Release::Fenced(_)) => m::count(Counted::Fenced),
            Err(error) => tracing::warn!(%error, "could not release the reservation"),
        }
    };
    let buffered = match renewing(config, store, &lease, work).await {
        Ok(Ok(buffered)) => buffered,
        Ok(Err(error)) => {
            release().await;
            return Err(error);
        }
        Err(_panic) => {
            release().await;
            return Ok(problem(
                ProblemCode::HandlerFailed,
                "the handler panicked",
                None,
            ));
        }
    };
    let (parts, body, outcome) = match buffered {
        Buffered::Complete { parts, body } => {
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: storable_headers(&parts.headers, &config.replay_denylist),
                body: body.clone(),
            };
            (parts, ResponseBody::full(body), Outcome::Stored(stored))
        }
        Buffered::TooLarge {
            parts,
            prefix,
            rest,
        } => {
            let status = parts.status.as_u16();
            (
                parts,
                ResponseBody::prefixed(prefix, rest),
                Outcome::NotStored { status },
            )
        }
        Buffered::Failed(error) => {
            release().await;
            let detail = format!("the handler's response body failed: {error}");
            return Ok(problem(ProblemCode::HandlerFailed, &detail, None));
        }
    };
    if !(config.should_store)(parts.status) {
        release().await;
        return Ok(Response::from_parts(parts, body));
    }
    match store_call(config, "complete", store.complete(&lease, outcome.clone())).await {
        Ok(Completion::Recorded) => m::count(Counted::Executed),
        Ok(Completion::Fenced(current)) => {
            m::count(Counted::Fenced);
            tracing::warn!("completion fenced: a newer attempt or a cancellation owns the record");
            if let Some(answer) = answer_current(current) {
                return Ok(answer);
            }
        }
        Err(error) => {
            // The handler ran; its client gets the real response, and the
            // outcome is recorded in the background while the lease lives,
            // so a store blip does not turn into a takeover and a second
            // execution.
            m::count(Counted::StoreError);
            tracing::error!(%error, "could not record the outcome yet; retrying while the lease lives");
            tokio::spawn(record_later(layer.clone(), lease, outcome).in_current_span());
        }
    }
    Ok(Response::from_parts(parts, body))
}

/// Retries a completion that failed on a store error, every 100 ms, until
/// it is recorded or fenced, or the lease would have lapsed.
async fn record_later<S: Store>(layer: IdempotencyLayer<S>, lease: Lease, outcome: Outcome) {
    let deadline = tokio::time::Instant::now() + lease.ttl;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match store_call(
            &layer.config,
            "complete",
            layer.store.complete(&lease, outcome.clone()),
        )
        .await
        {
            Ok(Completion::Recorded) => {
                m::count(Counted::Executed);
                tracing::info!("outcome recorded after a store error");
                return;
            }
            Ok(Completion::Fenced(_)) => {
                m::count(Counted::Fenced);
                return;
            }
            Err(error) => tracing::debug!(%error, "recording the outcome failed again"),
        }
    }
    tracing::error!(
        "the outcome could not be recorded before the lease lapsed; a retry will take over"
    );
}

/// The answer for a fenced attempt's client: what the record says now.
/// `None` when the record is vacant: the attempt's own response is then
/// the only evidence of what happened, and its client gets it.
fn answer_current<B>(current: Current) -> Option<Response<ResponseBody<B>>> {
    match current {
        Current::Vacant => None,
        Current::Processing { retry_after } => Some(in_progress(retry_after)),
        Current::Completed(replay) => Some(replay_response(replay)),
        Current::Cancelled => Some(cancelled()),
    }
}

fn storable_headers(headers: &HeaderMap, denylist: &[HeaderName]) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| !denylist.contains(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

fn in_progress<B>(retry_after: Duration) -> Response<ResponseBody<B>> {
    m::count(Counted::InProgress);
    let detail = "a request with this Idempotency-Key is being processed; retry later";
    problem(ProblemCode::InProgress, detail, Some(retry_after))
}

fn cancelled<B>() -> Response<ResponseBody<B>> {
    m::count(Counted::Cancelled);
    problem(
        ProblemCode::Cancelled,
        "the request with this Idempotency-Key was cancelled",
        None,
    )
}

/// A stored outcome as a response, with `Idempotent-Replayed: true`.
pub(crate) fn replay_response<B>(replay: Replay) -> Response<ResponseBody<B>> {
    m::count(Counted::Replayed);
    m::replay_age(replay.age);
    let stored = match replay.outcome {
        Outcome::Stored(stored) => stored,
        Outcome::NotStored { status } => {
            let detail = format!(
                "the request with this Idempotency-Key completed with status {status}, but its \
                 response exceeded the storable limit and cannot be replayed"
            );
            let mut response = problem(ProblemCode::ResponseNotStored, &detail, None);
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            return response;
        }
    };
    let mut response = Response::new(ResponseBody::full(stored.body));
    *response.status_mut() = http::StatusCode::from_u16(stored.status)
        .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        let name = HeaderName::from_bytes(name.as_bytes());
        let value = HeaderValue::from_maybe_shared(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
