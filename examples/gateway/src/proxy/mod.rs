//! Forwarding to the upstream with a pooled hyper-util client.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

mod headers;

use headers::{add_forwarded, answer_headers, strip_admin_token, strip_hop_by_hop, upstream_host};
pub(crate) use headers::{connection_names, strip_operator_cookie};

use crate::trace::Hop;
use axum::body::Body;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use idem_layer::{IdempotencyContext, UnknownOutcome};

/// A gRPC call's deadline.
const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The gateway's answer to a keyed gRPC call whose deadline passed while
/// the upstream runs: a trailers-only `DEADLINE_EXCEEDED`.
fn deadline_exceeded() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from_static("4"));
    // The retry replays the answer once it is recorded: retry, shortly.
    headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("1000"));
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    headers.insert(
        "grpc-message",
        HeaderValue::from_static(
            "the%20deadline%20passed%20while%20the%20upstream%20runs%3B%20its%20answer%20is%20recorded%20for%20a%20retry",
        ),
    );
    response
        .extensions_mut()
        .insert(crate::answer::GatewayCode("deadline_exceeded"));
    response
}

/// The header that tells the upstream which attempt of a key this is.
pub const IDEMPOTENCY_ATTEMPT: HeaderName =
    HeaderName::from_static(idem_core::protocol::IDEMPOTENCY_ATTEMPT);

/// The upstream's response as the gateway answers it. A keyed request's
/// body is bounded by `stall` (see [`StallBound`]); others stream as they
/// come (a long download or an event stream may pause for longer).
fn upstream_response(
    response: Response<hyper::body::Incoming>,
    stall: Option<Duration>,
) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    answer_headers(&mut parts.headers);
    // An upstream's answer: the layer classifies its status as one that
    // may come from in front of an executor that goes on (a deadline, a
    // proxy's 504): unknown, never released (docs/design.md, section 1).
    parts.extensions.insert(idem_layer::classify::RemoteAnswer);
    let body = match stall {
        Some(bound) => Body::new(StallBound::new(body, bound)),
        None => Body::new(body),
    };
    Response::from_parts(parts, body)
}

pin_project_lite::pin_project! {
    /// An upstream body that fails once it has sent nothing for `bound`.
    ///
    /// The layer reads a keyed request's answer whole before it records
    /// it, renewing the lease meanwhile: an upstream that sent its head and
    /// then stalled would hold the key, and the task, for good. Failed by
    /// this bound, it is a body that broke after its head: with a status
    /// the layer stores, the answer is recorded without its body (the
    /// upstream acted: retries get `409 idempotency_response_not_stored`,
    /// nothing runs twice); with a 5xx the key is released. The timer is
    /// armed only while the body has nothing ready, so a body that arrived
    /// with its head costs none.
    struct StallBound<B> {
        #[pin]
        body: B,
        #[pin]
        wait: Option<tokio::time::Sleep>,
        bound: Duration,
    }
}

impl<B> StallBound<B> {
    fn new(body: B, bound: Duration) -> Self {
        Self {
            body,
            wait: None,
            bound,
        }
    }
}

impl<B> http_body::Body for StallBound<B>
where
    B: http_body::Body,
    B::Error: Into<idem_layer::BoxError>,
{
    type Data = B::Data;
    type Error = idem_layer::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, Self::Error>>> {
        let mut this = self.project();
        if let Poll::Ready(frame) = this.body.poll_frame(cx) {
            this.wait.set(None);
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if this.wait.is_none() {
            this.wait.set(Some(tokio::time::sleep(*this.bound)));
        }
        if let Some(wait) = this.wait.as_mut().as_pin_mut()
            && wait.poll(cx).is_ready()
        {
            this.wait.set(None);
            let error = format!(
                "the upstream sent nothing of its answer's body for {:?}",
                this.bound
            );
            return Poll::Ready(Some(Err(error.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A tower service that forwards every request to the upstream. Bodies
/// stream through; the idempotency layer in front buffers keyed requests.
///
/// Cloned for every request (a tower service is): one reference count.
#[derive(Clone, Debug)]
pub struct Proxy(std::sync::Arc<Shared>);

/// What every clone of a [`Proxy`] shares: the pooled client (itself
/// several reference counts) and the settings.
#[derive(Clone, Debug)]
struct Shared {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>,
    upstream: Uri,
    timeout: Duration,
    forwarded: Forwarded,
    /// Where unknown outcomes are noted (the operator page).
    unknowns: Option<crate::operator::Unknowns>,
    /// Whether the upstream is spoken to in HTTP/2.
    http2: bool,
    /// The `Host` an HTTP/1.1 upstream is sent (its host, and its port
    /// unless the scheme's default), made once: the client would format it
    /// again for every request.
    host: Option<HeaderValue>,
}

/// Which headers tell the upstream who the client is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// `X-Forwarded-For` (the client's address appended to what came),
    /// `X-Forwarded-Proto` and `X-Forwarded-Host`.
    XForwarded,
    /// RFC 7239 `Forwarded: for=…;proto=…;host=…`, appended to what came.
    Rfc7239,
    /// Neither.
    None,
}

pub use crate::answer::PeerAddr;

/// The roots an `https://` upstream's certificate is verified against: the
/// system's (or those of `SSL_CERT_FILE`), plus the PEM certificates of
/// `extra_ca` (a private CA).
pub fn tls_config(extra_ca: Option<&std::path::Path>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = extra_ca {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(Iterator::collect)
            .map_err(|error| format!("cannot read the CA file {}: {error}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "the CA file {} holds no certificate",
                path.display()
            ));
        }
        for cert in certs {
            roots.add(cert).map_err(|error| {
                format!("unusable CA certificate in {}: {error}", path.display())
            })?;
        }
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// What [`Proxy::prepare`] keeps of a request: the stall bound of its
/// answer, the keyed request's operation, scope and generation, and the
/// caller's gRPC deadline.
type Prepared = (
    Option<Duration>,
    Option<(std::sync::Arc<str>, idem_core::ScopeHash, u64)>,
    Option<Duration>,
);

impl Proxy {
    /// A proxy to `upstream` (`http://host:port` or `https://host:port`,
    /// verified against `tls`) that waits at most `timeout` for the
    /// response head, and for each part of a keyed request's answer body.
    pub fn new(upstream: Uri, timeout: Duration, tls: rustls::ClientConfig) -> Self {
        Self(std::sync::Arc::new(Shared {
            client: Self::client(tls, false),
            host: upstream_host(&upstream),
            upstream,
            timeout,
            forwarded: Forwarded::XForwarded,
            unknowns: None,
            http2: false,
        }))
    }

    /// The pooled client: HTTP/1.1, or HTTP/2 only (cleartext with prior
    /// knowledge for `http://`, ALPN for `https://`).
    fn client(
        tls: rustls::ClientConfig,
        http2: bool,
    ) -> Client<hyper_rustls::HttpsConnector<HttpConnector>, Body> {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let mut builder = Client::builder(TokioExecutor::new());
        if http2 {
            builder.http2_only(true);
            return builder.build(connector.enable_http2().wrap_connector(http));
        }
        // An answer with an obs-folded header is still an answer: unfolded
        // rather than refused, so the action's outcome is not lost.
        builder.http1_allow_obsolete_multiline_headers_in_responses(true);
        builder.build(connector.enable_http1().wrap_connector(http))
    }

    /// Speaks HTTP/2 to the upstream (cleartext with prior knowledge for
    /// `http://`, `tls` with ALPN for `https://`), as a gRPC upstream
    /// needs; a client's `TE: trailers` is passed on.
    pub fn http2(mut self, tls: rustls::ClientConfig) -> Self {
        let shared = std::sync::Arc::make_mut(&mut self.0);
        shared.client = Self::client(tls, true);
        shared.http2 = true;
        self
    }

    /// Which headers tell the upstream who the client is (default
    /// [`Forwarded::XForwarded`]).
    pub fn forwarded(mut self, style: Forwarded) -> Self {
        std::sync::Arc::make_mut(&mut self.0).forwarded = style;
        self
    }

    /// Notes each unknown outcome (for the operator page).
    pub(crate) fn noting_unknowns(mut self, unknowns: crate::operator::Unknowns) -> Self {
        std::sync::Arc::make_mut(&mut self.0).unknowns = Some(unknowns);
        self
    }

    /// Notes an unknown outcome of the keyed request `keyed` describes.
    fn note_unknown(
        &self,
        code: &'static str,
        keyed: Option<&(std::sync::Arc<str>, idem_core::ScopeHash, u64)>,
    ) {
        if let (Some(unknowns), Some((operation, scope, attempt))) = (&self.0.unknowns, keyed) {
            unknowns.note(code, operation, *scope, *attempt);
        }
    }

    /// The upstream's URL for a request's path and query.
    fn upstream_uri(&self, request: &Request<Body>) -> Result<Uri, http::Error> {
        // Put together from parts already parsed (their clones share the
        // bytes): nothing is parsed again per request.
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(
            self.0
                .upstream
                .scheme()
                .cloned()
                .unwrap_or(http::uri::Scheme::HTTP),
        );
        parts.authority = self.0.upstream.authority().cloned();
        parts.path_and_query = Some(
            request
                .uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        );
        Ok(Uri::from_parts(parts)?)
    }

    /// The headers the upstream gets: no hop-by-hop ones, who the client
    /// is, and for a keyed request the gateway's own `Idempotency-Attempt`
    /// and one spelling of the key.
    fn upstream_headers(&self, request: &mut Request<Body>) {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_owned)
            .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
        let peer = request.extensions().get::<PeerAddr>().map(|p| p.0.ip());
        let protected = request
            .extensions()
            .get::<IdempotencyContext>()
            .map(|ctx| ctx.generation);
        let hop = request.extensions_mut().remove::<Hop>();
        let headers = request.headers_mut();
        // `TE: trailers` says the client takes trailers (gRPC requires it):
        // the one TE an HTTP/2 upstream is told again.
        let trailers = self.0.http2
            && headers
                .get_all(header::TE)
                .iter()
                .any(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
        strip_hop_by_hop(headers);
        if trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // The trace goes on with the gateway's span as the upstream's
        // parent (a proxy used without the gateway's front starts one).
        let hop = hop.unwrap_or_else(|| Hop::of(headers, false));
        hop.write(headers);
        if let Some(ctx) = request.extensions().get::<IdempotencyContext>() {
            hop.note(|| ctx.scope.to_string(), ctx.generation);
        }
        let headers = request.headers_mut();
        // The upstream's own host (what the client would write); an HTTP/2
        // upstream is told it by the request's authority.
        match &self.0.host {
            Some(host) if !self.0.http2 => headers.insert(header::HOST, host.clone()),
            _ => headers.remove(header::HOST),
        };
        add_forwarded(headers, self.0.forwarded, peer, host.as_deref());
        // The gateway owns the attempt header: a client's is never passed on.
        headers.remove(IDEMPOTENCY_ATTEMPT);
        // The records API's admin credential is the gateway's own, and so
        // is the operator page's session cookie.
        strip_admin_token(headers);
        strip_operator_cookie(headers);
        // The key goes on as the client sent it (an upstream that
        // deduplicates on its own sees the client's key); the attempt is the
        // gateway's.
        if let Some(generation) = protected {
            headers.insert(IDEMPOTENCY_ATTEMPT, HeaderValue::from(generation));
        }
    }

    async fn forward(self, mut request: Request<Body>) -> Response<Body> {
        let uri = match self.upstream_uri(&request) {
            Ok(uri) => uri,
            Err(error) => {
                let detail = format!("cannot build the upstream URL: {error}");
                return crate::answer::problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    "Bad gateway",
                    &detail,
                );
            }
        };
        let (stall, keyed, caller_deadline) = self.prepare(&mut request, uri);
        let mut pending = Box::pin(self.0.client.request(request));
        let started = tokio::time::Instant::now();
        let caller_first = caller_deadline.filter(|deadline| *deadline < self.0.timeout);
        let first_bound = caller_first.unwrap_or(self.0.timeout);
        let unknown = |mut response: Response<Body>, outcome: UnknownOutcome, code| {
            response.extensions_mut().insert(outcome);
            self.note_unknown(code, keyed.as_ref());
            response
        };
        match tokio::time::timeout(first_bound, &mut pending).await {
            Ok(Ok(response)) if response.status().is_informational() => {
                // The gateway asks for no upgrade (`Upgrade` is hop-by-hop
                // and never forwarded): a `101` or any other final 1xx is
                // no answer to the request, which reached the upstream.
                // The outcome is unknown: the key is kept, never released.
                let status = response.status().as_u16();
                tracing::warn!(status, "upstream answered with an informational status");
                let detail = format!(
                    "the upstream answered {status}, which is no final answer to this request"
                );
                let code = "upstream_answer_invalid";
                let problem =
                    crate::answer::problem(StatusCode::BAD_GATEWAY, code, "Bad gateway", &detail);
                unknown(problem, UnknownOutcome::new(), code)
            }
            Ok(Ok(response)) => upstream_response(response, stall),
            Ok(Err(error)) if error.is_connect() => {
                // Provably never reached the upstream: the key may be
                // released, a retry runs it for the first time.
                tracing::warn!(%error, "upstream unreachable");
                let detail = format!("the upstream could not be reached: {error}");
                crate::answer::problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    "Bad gateway",
                    &detail,
                )
            }
            Ok(Err(error)) => {
                // The request may have reached the upstream (its answer
                // could not be read, the connection broke): the outcome is
                // unknown, and no answer will come any more.
                tracing::warn!(%error, "upstream answer lost");
                let detail = format!("the upstream's answer could not be read: {error}");
                let code = "upstream_answer_lost";
                let problem =
                    crate::answer::problem(StatusCode::BAD_GATEWAY, code, "Bad gateway", &detail);
                unknown(problem, UnknownOutcome::new(), code)
            }
            Err(_) if caller_first.is_some() => {
                // The caller's deadline passed while the upstream runs:
                // the caller gets DEADLINE_EXCEEDED now, the outcome is
                // unknown, and the upstream's answer, when it comes within
                // the gateway's bound, is recorded for a retry.
                let left = self.0.timeout.saturating_sub(started.elapsed());
                let late = async move {
                    let response = tokio::time::timeout(left, pending).await.ok()?.ok()?;
                    Some(upstream_response(response, stall))
                };
                let late = UnknownOutcome::with_late_answer(late);
                unknown(deadline_exceeded(), late, "deadline_exceeded")
            }
            Err(_) => {
                // The upstream may still be running the action: the client
                // gets 504 now, and the layer keeps waiting for the answer.
                let detail = format!("the upstream did not answer within {:?}", self.0.timeout);
                let code = "upstream_timeout";
                let problem = crate::answer::problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    code,
                    "Gateway timeout",
                    &detail,
                );
                let late = async move {
                    let response = pending.await.ok()?;
                    Some(upstream_response(response, stall))
                };
                unknown(problem, UnknownOutcome::with_late_answer(late), code)
            }
        }
    }

    /// The request as the upstream gets it (its URL `uri`, its headers,
    /// the gateway's own deadline for a keyed gRPC call, the upstream
    /// connection's protocol), and what the forwarding keeps of it: the
    /// stall bound of an answer the layer reads whole, the keyed request's
    /// operation, scope and generation, and the caller's gRPC deadline.
    fn prepare(&self, request: &mut Request<Body>, uri: Uri) -> Prepared {
        // A keyed request's answer is read whole by the layer: bounded.
        let stall = request
            .extensions()
            .get::<IdempotencyContext>()
            .map(|_| self.0.timeout);
        let keyed = request.extensions().get::<IdempotencyContext>().map(|ctx| {
            (
                std::sync::Arc::clone(&ctx.operation),
                ctx.scope,
                ctx.generation,
            )
        });
        // A keyed gRPC call's deadline is the gateway's to keep: the
        // upstream's framework would answer DEADLINE_EXCEEDED at it while
        // its handler goes on. The caller is answered at its deadline; the
        // upstream gets the gateway's own bound and its answer is recorded.
        let keyed_grpc = keyed.is_some() && idem_core::protocol::is_grpc(request.headers());
        // A deadline the gateway cannot read is not kept either: never
        // passed on (an upstream that reads it otherwise would answer at it
        // while its handler goes on); the gateway's own bound holds.
        let caller_deadline = keyed_grpc
            .then(|| idem_core::protocol::grpc_timeout(request.headers()))
            .flatten();
        // The Host the client sent is read before the URI changes.
        self.upstream_headers(request);
        if keyed_grpc
            && let Ok(bound) =
                HeaderValue::try_from(idem_core::protocol::grpc_timeout_value(self.0.timeout))
        {
            // `insert` replaces every value the caller sent.
            request.headers_mut().insert(GRPC_TIMEOUT, bound);
        }
        *request.uri_mut() = uri;
        // The client's protocol is not the upstream connection's: the
        // pooled client speaks HTTP/1.1 (or, told to, HTTP/2) to the
        // upstream.
        *request.version_mut() = if self.0.http2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        (stall, keyed, caller_deadline)
    }
}

impl tower::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    #[inline]
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await) })
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use idem_layer::HOP_BY_HOP;

    use super::*;

    /// The upstream's scheme and authority with the request's path and
    /// query, whatever form the request's target took.
    #[test]
    fn the_upstream_url_takes_the_requests_path_and_query() {
        let tls = tls_config(None).expect("tls");
        for (upstream, target, expected) in [
            ("http://127.0.0.1:9", "/orders", "http://127.0.0.1:9/orders"),
            (
                "http://127.0.0.1:9/base",
                "/orders/7?x=1&y=%20",
                "http://127.0.0.1:9/orders/7?x=1&y=%20",
            ),
            (
                "https://api.example:8443",
                "http://client.example/a/b?c",
                "https://api.example:8443/a/b?c",
            ),
            ("127.0.0.1:9", "/", "http://127.0.0.1:9/"),
            ("http://[::1]:9", "http://client.example", "http://[::1]:9/"),
        ] {
            let proxy = Proxy::new(
                upstream.parse().expect("upstream"),
                Duration::from_secs(1),
                tls.clone(),
            );
            let request = Request::get(target).body(Body::empty()).expect("request");
            let uri = proxy.upstream_uri(&request).expect("uri");
            assert_eq!(uri.to_string(), expected, "{upstream} {target}");
        }
    }

    /// A message without hop-by-hop fields is left as it is; each one is
    /// removed wherever it is, and so is every field `Connection` names,
    /// while the end-to-end fields stay in their order.
    #[test]
    fn hop_by_hop_fields_are_stripped_and_the_rest_kept() {
        let mut plain = HeaderMap::new();
        plain.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        plain.append("x-trace", HeaderValue::from_static("a"));
        plain.append("x-trace", HeaderValue::from_static("b"));
        let before = plain.clone();
        strip_hop_by_hop(&mut plain);
        assert_eq!(plain, before);
        for hop in &HOP_BY_HOP {
            let mut headers = before.clone();
            headers.insert(hop.clone(), HeaderValue::from_static("x"));
            strip_hop_by_hop(&mut headers);
            assert_eq!(headers, before, "{hop}");
        }
        let mut named = before;
        named.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-trace, Keep-Alive"),
        );
        named.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        strip_hop_by_hop(&mut named);
        let left: Vec<&str> = named.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["content-type"]);
    }
}
