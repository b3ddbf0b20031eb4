//! Forwarding to the upstream with a pooled hyper-util client.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use idem_layer::{HOP_BY_HOP, IdempotencyContext};

/// The header that tells the upstream which attempt of a key this is.
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(name);
    }
}

/// A tower service that forwards every request to the upstream. Bodies
/// stream through; the idempotency layer in front buffers keyed requests.
#[derive(Clone, Debug)]
pub struct Proxy {
    client: Client<HttpConnector, Body>,
    upstream: Uri,
    timeout: Duration,
}

impl Proxy {
    /// A proxy to `upstream` (`http://host:port`) that waits at most
    /// `timeout` for the response head.
    pub fn new(upstream: Uri, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Self {
            client,
            upstream,
            timeout,
        }
    }

    async fn forward(self, mut request: Request<Body>) -> Response<Body> {
        let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
        let uri = match Uri::builder()
            .scheme(self.upstream.scheme_str().unwrap_or("http"))
            .authority(self.upstream.authority().map_or("", |a| a.as_str()))
            .path_and_query(path)
            .build()
        {
            Ok(uri) => uri,
            Err(error) => {
                let detail = format!("cannot build the upstream URL: {error}");
                return crate::problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    "Bad gateway",
                    &detail,
                );
            }
        };
        *request.uri_mut() = uri;
        // The client's protocol is not the upstream connection's: the
        // pooled client speaks HTTP/1.1 to the upstream.
        *request.version_mut() = http::Version::HTTP_11;
        let attempt = request
            .extensions()
            .get::<IdempotencyContext>()
            .map(|ctx| ctx.generation);
        let headers = request.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(header::HOST);
        if let Some(generation) = attempt {
            headers.insert(IDEMPOTENCY_ATTEMPT, HeaderValue::from(generation));
        }
        match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(body))
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "upstream request failed");
                let detail = format!("the upstream could not be reached: {error}");
                crate::problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    "Bad gateway",
                    &detail,
                )
            }
            Err(_) => {
                let detail = format!("the upstream did not answer within {:?}", self.timeout);
                crate::problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    "Gateway timeout",
                    &detail,
                )
            }
        }
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
