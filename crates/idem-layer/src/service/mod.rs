//! The [`Idempotency`] service: the request path of the layer.

use std::{
    future::Future,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use idem_core::{ReserveRequest, Scope, Store};
use tower::Service;
use tracing::Instrument;

mod keyed;
mod request;

use keyed::Keyed;

use crate::{
    ResponseBody,
    body::BoxError,
    disconnect::ResponseFuture,
    headers::read_key,
    metrics::{self as m, Outcome as Counted},
    normalize_path,
    path::shared_operation_name,
    problem::{ProblemCode, problem},
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
        if let Some(records) = &self.rt.config.records.path
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
            Ok(None) if !config.require_key => return passthrough(inner, request).await,
            unkeyed => return Ok(request::key_refusal(unkeyed.err(), request.method())),
        };

        let (mut parts, body) = request.into_parts();
        normalize_uri(&mut parts);
        let Some(tenant) = config.tenant_of(&parts) else {
            m::count(Counted::Rejected);
            let detail = config.tenant_missing_detail();
            return Ok(problem(ProblemCode::TenantMissing, detail, None));
        };
        let (body, print) = match request::read(&parts, body, protocol, config).await {
            Ok(read) => read,
            Err(refusal) => {
                m::count(Counted::Rejected);
                return Ok(refusal);
            }
        };
        let operation = operation(&parts);
        let printed = print.as_ref().unwrap_or(&body);
        let fingerprint = config.fingerprints.of(&operation, &parts, printed);
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
            lease: config.timing.lease,
            retention: config.timing.retention,
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
