//! The [`Idempotency`] service: the request path of the layer.

use std::{
    future::Future,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response, header, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{Attempt, Lease, ReserveRequest, Scope, Store, StoreError};
use tower::Service;
use tracing::Instrument;

use crate::{
    IdempotencyContext, OnDisconnect, ResponseBody,
    answer::{cancelled, in_progress_about, replay_to},
    attempt::attempt,
    body::BoxError,
    body::within,
    disconnect::{ReleaseOnDrop, ResponseFuture, attempt_started},
    engine::{Admission, Found, admit},
    headers::read_key,
    metrics::{self as m, Outcome as Counted},
    normalize_path,
    path::shared_operation_name,
    problem::store_unavailable,
    problem::{ProblemCode, RecordRef, problem, problem_about},
    protocol::Protocol,
    runtime::Runtime,
};

/// The service produced by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Requests of other methods, and keyless requests (unless a key is
/// required), reach the inner service untouched. Keyed requests are
/// buffered, fingerprinted and reserved; the inner service runs at most once
/// per scope at a time, and its stored outcome is replayed to duplicates.
pub struct Idempotency<I, S> {
    inner: I,
    rt: Runtime<S>,
    /// The configuration failed validation: protected requests are refused.
    misconfigured: bool,
}

impl<I: Clone, S> Clone for Idempotency<I, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            rt: self.rt.clone(),
            misconfigured: self.misconfigured,
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
    /// A refusal before anything was read: counted, shaped, answered.
    fn refuse<B, E>(
        &self,
        code: ProblemCode,
        detail: &str,
        protocol: Protocol,
    ) -> ResponseFuture<Response<ResponseBody<B>>, E>
    where
        B: Send + 'static,
        E: 'static,
    {
        m::count(Counted::Rejected);
        let refusal = protocol.answered(problem(code, detail, None), &self.rt.config);
        ResponseFuture::new(async move { Ok(refusal) })
    }

    pub(crate) fn new(inner: I, rt: Runtime<S>, misconfigured: bool) -> Self {
        Self {
            inner,
            rt,
            misconfigured,
        }
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
    type Future = ResponseFuture<Self::Response, Self::Error>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Take the service that was driven to readiness, leave a clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let methods = &self.rt.config.methods;
        if !methods.contains(request.method()) {
            let method = request.method().as_str();
            if methods
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method))
            {
                // `post` where `POST` is protected: many servers treat it as
                // POST, so it must not pass unprotected.
                let detail = format!(
                    "the method {method:?} differs from a protected method only by case; send it in upper case"
                );
                let protocol = Protocol::of(request.headers());
                return self.refuse(ProblemCode::MethodCaseMismatch, &detail, protocol);
            }
            let future = inner.call(request);
            return ResponseFuture::new(async move { Ok(without_no_store(future.await?)) });
        }
        // The layer never applies itself to its own records API (mounted
        // under it, as the README shows): its requests carry no key.
        if let Some(records) = &self.rt.config.records_path
            && **records == *request.uri().path()
        {
            let future = inner.call(request);
            return ResponseFuture::new(async move { Ok(without_no_store(future.await?)) });
        }
        // Picked once: what is fingerprinted, and how refusals are written
        // (a gRPC caller gets them as gRPC statuses).
        let protocol = Protocol::of(request.headers());
        if self.rt.config.store_guard.refused() {
            let detail = "the store belongs to instances that derive record identities otherwise \
                          (another secret or format); the request was not run";
            return self.refuse(ProblemCode::StoreUnavailable, detail, protocol);
        }
        if self.misconfigured {
            let detail = "the idempotency layer's configuration is invalid (see the service's log); the request was not run";
            return self.refuse(ProblemCode::Misconfigured, detail, protocol);
        }
        let rt = self.rt.clone();
        if protocol.rewrites(&rt.config) {
            let config = Arc::clone(&rt.config);
            return ResponseFuture::new_with(move || async move {
                let response = handle(rt, inner, request, protocol).await?;
                Ok(protocol.answered(response, &config))
            });
        }
        ResponseFuture::new_with(move || handle(rt, inner, request, protocol))
    }
}

/// The operation: the method and axum's route template when there is one,
/// else the (already normalized) path.
fn operation(parts: &Parts) -> Arc<str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return shared_operation_name(parts.method.as_str(), path.as_str());
    }
    shared_operation_name(parts.method.as_str(), parts.uri.path())
}

/// Puts the request's path in normal form (see [`normalize_path`]), so
/// that the scope, the fingerprint and the inner service all see one
/// spelling. A path that cannot be rebuilt is left as it was.
fn normalize_uri(parts: &mut Parts) {
    let normal = match normalize_path(parts.uri.path()) {
        std::borrow::Cow::Borrowed(_) => return,
        std::borrow::Cow::Owned(normal) => normal,
    };
    let path_and_query = match parts.uri.query() {
        Some(query) => format!("{normal}?{query}"),
        None => normal,
    };
    let mut uri = std::mem::take(&mut parts.uri).into_parts();
    let Ok(path_and_query) = path_and_query.parse() else {
        parts.uri = http::Uri::from_parts(uri).unwrap_or_default();
        return;
    };
    uri.path_and_query = Some(path_and_query);
    parts.uri = http::Uri::from_parts(uri).unwrap_or_default();
}

async fn passthrough<I, ReqBody, ResBody>(
    mut inner: I,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    Ok(without_no_store(inner.call(request).await?))
}

/// A response passed through, without idem's own opt-out header (see
/// [`NO_STORE`](crate::NO_STORE)): it is never meant for the client.
fn without_no_store<B>(response: Response<B>) -> Response<ResponseBody<B>> {
    let mut response = response.map(ResponseBody::inner);
    response.headers_mut().remove(crate::NO_STORE);
    response.headers_mut().remove(crate::NOTHING_RAN);
    response
}

// An async block, not an `async fn`: an `async fn` keeps its arguments
// twice in its state (as captured and as moved into the body), and this
// future is large and moved into the layer's box on every request.
#[allow(clippy::manual_async_fn)]
fn handle<I, S, ReqBody, ResBody>(
    rt: Runtime<S>,
    inner: I,
    request: Request<ReqBody>,
    protocol: Protocol,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>>
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
    async move {
        let config = &rt.config;
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

        let (mut parts, body) = request.into_parts();
        normalize_uri(&mut parts);
        let Some(tenant) = config.tenant_of(&parts) else {
            m::count(Counted::Rejected);
            let detail = config.tenant_missing_detail();
            return Ok(problem(ProblemCode::TenantMissing, detail, None));
        };
        let body = match read_body(&parts, body, config.max_body, config.body_timeout).await {
            Ok(body) => body,
            Err(refusal) => {
                m::count(Counted::Rejected);
                return Ok(refusal);
            }
        };
        // A gRPC call is fingerprinted over its message uncompressed; a
        // streaming call is refused before anything runs.
        let print = match protocol.fingerprinted(&parts, &body, config.max_body) {
            Ok(print) => print,
            Err((code, detail)) => {
                m::count(Counted::Rejected);
                return Ok(problem(code, &detail, None));
            }
        };
        let printed = print.as_ref().unwrap_or(&body);
        let operation = operation(&parts);
        let fingerprint = match &config.fingerprint_fn {
            Some(f) => f(&operation, &parts, printed),
            None => config.fingerprint_format.of(
                config
                    .fingerprint_key
                    .as_ref()
                    .filter(|_| config.fingerprint_keyed),
                &operation,
                &parts,
                &config.fingerprint_headers,
                printed,
            ),
        };
        let secret = config.scope_secret.as_ref();
        let scope = Scope::hashed_as(config.scope_format, secret, tenant, operation, key);
        // The scope hash, never the raw key; the attempt and the outcome
        // are recorded as they become known.
        let span = tracing::debug_span!(
            "idempotency",
            scope = %scope.hash(),
            operation = scope.operation(),
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let reserve = ReserveRequest {
            scope,
            fingerprint,
            lease: config.lease,
            retention: config.retention,
        };
        let keyed = Keyed {
            rt,
            inner,
            parts,
            body,
            print,
            reserve,
            request_body: std::marker::PhantomData,
        };
        // A span no subscriber records is not entered on every poll.
        if span.is_disabled() {
            keyed.run().await
        } else {
            keyed.run().instrument(span).await
        }
    }
}

/// The forms of the default fingerprint a record may have been written in
/// besides the one this layer writes, in the order they are tried: this
/// format the other way (keyed or not, when the layer has a key), then
/// the other format, the way this layer writes first.
fn other_fingerprints(
    config: &crate::config::Config,
) -> impl Iterator<Item = (crate::fingerprint::FingerprintFormat, Option<[u8; 32]>)> {
    let format = config.fingerprint_format;
    let other = format.other();
    let (written, unwritten) = match config.fingerprint_key {
        Some(key) if config.fingerprint_keyed => (Some(key), Some(None)),
        Some(key) => (None, Some(Some(key))),
        None => (None, None),
    };
    [
        unwritten.map(|key| (format, key)),
        Some((other, written)),
        unwritten.map(|key| (other, key)),
    ]
    .into_iter()
    .flatten()
}

/// Where the record of `request` is in the records API (when the layer
/// knows where it is mounted), as its own caller reads it, with the state
/// and first sighting given.
fn pointer(
    config: &crate::config::Config,
    request: &ReserveRequest,
    state: &'static str,
    first_seen: Option<String>,
) -> RecordRef {
    let href = config.records_path.as_deref().map(|records| {
        let operation = request.scope.operation();
        let (method, path) = operation.split_once(' ').unwrap_or((operation, ""));
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("method", method)
            .append_pair("path", path)
            .append_pair("key", &request.scope.key().to_sf_string())
            .finish();
        format!("{records}?{query}")
    });
    RecordRef {
        href,
        state,
        first_seen,
    }
}

/// The record a conflicting request collided with: read once more (a
/// conflict is rare, and the caller is told what its key already names).
/// `None` when the read fails or finds nothing any more: the `422` stands
/// without it.
async fn conflicting<S: Store>(rt: &Runtime<S>, request: &ReserveRequest) -> Option<RecordRef> {
    let read = rt.store.get(request.scope.hash()).await;
    let record = read.ok()??;
    let first_seen = std::time::UNIX_EPOCH + Duration::from_millis(record.created_at_ms);
    Some(pointer(
        &rt.config,
        request,
        record.state.as_str(),
        Some(humantime::format_rfc3339_millis(first_seen).to_string()),
    ))
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
    // A body that has already arrived (the usual small one) is collected
    // without a timer.
    let collect = std::pin::pin!(collect(Limited::new(body, limit)));
    let Ok(collected) = within(Some(timeout), collect).await else {
        let detail = format!("the request body did not arrive within {timeout:?}");
        return Err(problem(ProblemCode::BodyTimeout, &detail, None));
    };
    match collected {
        Ok(collected) => Ok(collected),
        Err(error) if error.is::<LengthLimitError>() => Err(too_large()),
        Err(error) => {
            let detail = format!("the request body could not be read: {error}");
            Err(problem(ProblemCode::BodyInvalid, &detail, None))
        }
    }
}

/// A body's bytes, its trailers dropped: a body of one data frame (the
/// usual small one) is taken as it is, without a copy; more are joined.
async fn collect<B: Body>(body: B) -> Result<Bytes, B::Error> {
    let mut body = std::pin::pin!(body);
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.as_mut().frame().await {
        let Ok(mut data) = frame?.into_data() else {
            continue;
        };
        let chunk = data.copy_to_bytes(data.remaining());
        match &mut joined {
            Some(joined) => joined.extend_from_slice(&chunk),
            None if first.is_empty() => first = chunk,
            None if chunk.is_empty() => {}
            None => {
                let mut both = BytesMut::with_capacity(first.len() + chunk.len());
                both.extend_from_slice(&first);
                both.extend_from_slice(&chunk);
                joined = Some(both);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

/// A keyed request on its way through the state machine.
struct Keyed<I, S, ReqBody> {
    rt: Runtime<S>,
    inner: I,
    parts: Parts,
    body: Bytes,
    /// What the fingerprint covers when it is not `body` (a compressed
    /// gRPC message, uncompressed).
    print: Option<Bytes>,
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
    // An async block, not an `async fn`, as `handle` says.
    #[allow(clippy::manual_async_fn)]
    fn run(mut self) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>> {
        async move {
            let rt = self.rt.clone();
            let config = &*rt.config;
            // The default fingerprint is read in every form it was written
            // in: a record written unkeyed (before fingerprints were keyed)
            // or in the other format is tried before a conflict.
            let mut others = config
                .fingerprint_fn
                .is_none()
                .then(|| other_fingerprints(config))
                .into_iter()
                .flatten();
            let (parts, body) = (&self.parts, self.print.as_ref().unwrap_or(&self.body));
            let admission = admit(&rt, &mut self.reserve, |request| {
                let Some((format, key)) = others.next() else {
                    return false;
                };
                request.fingerprint = format.of(
                    key.as_ref(),
                    request.scope.operation(),
                    parts,
                    &config.fingerprint_headers,
                    body,
                );
                true
            })
            .await;
            match admission {
                Admission::Run { lease, superseded } => self.execute(lease, superseded).await,
                Admission::Found(Found::InProgress(retry_after)) => {
                    // The record it collided with, linked: no store call.
                    let record = pointer(config, &self.reserve, "processing", None);
                    Ok(in_progress_about(retry_after, Some(record)))
                }
                Admission::Found(Found::Completed(replay)) => {
                    Ok(replay_to(&self.parts.headers, replay, config.max_response))
                }
                Admission::Found(Found::Cancelled) => Ok(cancelled()),
                Admission::Found(Found::Conflict) => {
                    m::count(Counted::Conflict);
                    let detail = "this Idempotency-Key was used with a different request payload";
                    let record = conflicting(&rt, &self.reserve).await;
                    Ok(problem_about(ProblemCode::Conflict, detail, None, record))
                }
                Admission::Held(error) => Ok(store_unavailable(&error)),
                // Fail-open covers a store that cannot be reached, never one
                // that answered: a full store or a record it cannot decode
                // may hold the key's outcome, and running again could
                // execute it twice.
                Admission::Failed(
                    error @ (StoreError::Unavailable(_) | StoreError::Timeout(_)),
                ) if config.fail_open => {
                    tracing::warn!(%error, "idempotency store failed; running the handler unprotected");
                    m::count(Counted::FailOpen);
                    let request = Request::from_parts(self.parts, ReqBody::from(self.body));
                    passthrough(self.inner, request).await
                }
                Admission::Failed(error) => Ok(store_unavailable(&error)),
            }
        }
    }

    // An async block, not an `async fn`, as `handle` says.
    #[allow(clippy::manual_async_fn)]
    fn execute(
        self,
        lease: Lease,
        superseded: Option<Attempt>,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>> {
        async move {
            let Keyed {
                rt,
                inner,
                mut parts,
                body,
                reserve,
                ..
            } = self;
            let scope = &reserve.scope;
            crate::metrics::trace_attempt(lease.generation);
            parts.extensions.insert(IdempotencyContext {
                key: scope.key().clone(),
                tenant: Arc::clone(scope.shared_tenant()),
                operation: Arc::clone(scope.shared_operation()),
                scope: *scope.hash(),
                fingerprint: reserve.fingerprint,
                attempt: lease.attempt,
                generation: lease.generation,
                superseded,
            });
            let request = Request::from_parts(parts, ReqBody::from(body));
            match rt.config.on_disconnect {
                OnDisconnect::Detach => {
                    // The attempt runs inline while the client waits; if the
                    // client goes away, the response future moves the rest
                    // of the request to a task of its own and the outcome is
                    // still recorded.
                    attempt_started(&rt.tasks);
                    attempt(rt, inner, request, reserve, lease).await
                }
                OnDisconnect::Release => {
                    let guard = ReleaseOnDrop {
                        rt: rt.clone(),
                        lease: Some(lease.clone()),
                    };
                    // Dropped with the response future: the handler is
                    // dropped and the guard releases the key.
                    let result = attempt(rt, inner, request, reserve, lease).await;
                    guard.disarm();
                    result
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http::HeaderMap;
    use http_body::Frame;
    use http_body_util::{StreamBody, combinators::BoxBody};

    use super::collect;

    fn body(frames: Vec<Frame<Bytes>>) -> BoxBody<Bytes, Infallible> {
        let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
        BoxBody::new(StreamBody::new(stream))
    }

    fn data(text: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(text.as_bytes()))
    }

    /// Every way the bytes may come in frames gives the same body:
    /// one frame (taken as it is), several, empty ones anywhere, trailers.
    #[tokio::test]
    async fn frames_join_into_the_body() {
        let cases: Vec<(Vec<Frame<Bytes>>, &str)> = vec![
            (vec![], ""),
            (vec![data("")], ""),
            (vec![data("abc")], "abc"),
            (vec![data(""), data("abc"), data("")], "abc"),
            (vec![data("ab"), data("c")], "abc"),
            (vec![data("a"), data(""), data("b"), data("c")], "abc"),
            (
                vec![data("ab"), Frame::trailers(HeaderMap::new()), data("c")],
                "abc",
            ),
        ];
        for (frames, want) in cases {
            let described = format!("{frames:?}");
            let got = collect(body(frames)).await.expect("infallible");
            assert_eq!(got, want, "{described}");
        }
        // One frame is the frame's own bytes, not a copy.
        let one = Bytes::from_static(b"payload");
        let got = collect(body(vec![Frame::data(one.clone())]))
            .await
            .expect("infallible");
        assert_eq!(got.as_ptr(), one.as_ptr());
    }
}
