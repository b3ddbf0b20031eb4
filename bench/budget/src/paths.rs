//! The request paths the budget counts, each built as a user builds it on
//! defaults, and how one request goes down each.

use std::{convert::Infallible, time::Duration};

use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use idem_layer::{IdempotencyLayer, TenantFromAuthorization, sealing::Keyring};
use idem_memory::MemoryStore;
use tower::ServiceExt;

/// One request path users pay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// A fresh key per request, memory store: reserve, run, complete.
    MemoryNew,
    /// One key, memory store: every counted request is a replay.
    MemoryReplay,
    /// A fresh key per request on Redis (this process's work only).
    RedisNew,
    /// One key on Redis: every counted request is a replay.
    RedisReplay,
    /// A unary gRPC call with a fresh key, memory store.
    GrpcNew,
    /// A fresh key per request with stored responses sealed, memory store.
    SealedNew,
    /// The gateway (memory store, a deployment secret, so sealed and
    /// keyed as deployed) forwarding a keyed POST to its built-in
    /// upstream over loopback, with the client that sends it.
    GatewayNew,
}

const ALL: [Path; 7] = [
    Path::MemoryNew,
    Path::MemoryReplay,
    Path::RedisNew,
    Path::RedisReplay,
    Path::GrpcNew,
    Path::SealedNew,
    Path::GatewayNew,
];

impl Path {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::MemoryNew => "memory-new",
            Self::MemoryReplay => "memory-replay",
            Self::RedisNew => "redis-new",
            Self::RedisReplay => "redis-replay",
            Self::GrpcNew => "grpc-new",
            Self::SealedNew => "sealed-new",
            Self::GatewayNew => "gateway-new",
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<Self> {
        ALL.into_iter().find(|path| path.name() == name)
    }

    pub(crate) fn names() -> String {
        ALL.map(Path::name).join(", ")
    }

    fn replays(self) -> bool {
        matches!(self, Self::MemoryReplay | Self::RedisReplay)
    }
}

/// The order every HTTP path posts.
const ORDER: &str = r#"{"amount":100,"currency":"eur","items":[1,2,3]}"#;
/// A deployment secret, as the gateway's and the sealed path's operators
/// would set one.
const SECRET: &str = "a budget deployment secret of 32";
const GRPC_PATH: &str = "/payments.v1.Payments/Charge";

/// A path ready to take requests.
pub(crate) struct Bench {
    path: Path,
    target: Target,
    sent: usize,
    /// Keys unique to this process, so a Redis that outlives it holds none.
    run: u32,
}

enum Target {
    /// The layer in front of a handler, called through tower's `oneshot`.
    Layered(Router),
    /// A running gateway, called over loopback HTTP/1.1.
    Gateway {
        client: Box<Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>>,
        base: String,
        _stop: tokio::sync::oneshot::Sender<()>,
    },
}

impl Bench {
    /// Builds the path as a user would on defaults.
    pub(crate) async fn start(path: Path) -> Result<Self, String> {
        let target = match path {
            Path::MemoryNew | Path::MemoryReplay => {
                Target::Layered(orders().layer(
                    IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromAuthorization),
                ))
            }
            Path::SealedNew => Target::Layered(
                orders().layer(
                    IdempotencyLayer::new(MemoryStore::new())
                        .tenant(TenantFromAuthorization)
                        .sealing(Keyring::derived(SECRET.as_bytes())),
                ),
            ),
            Path::RedisNew | Path::RedisReplay => {
                let url = std::env::var("REDIS_URL").map_err(|_| "REDIS_URL is not set")?;
                let store = idem_redis::RedisStore::from_url(&url).map_err(|e| e.to_string())?;
                Target::Layered(
                    orders().layer(IdempotencyLayer::new(store).tenant(TenantFromAuthorization)),
                )
            }
            Path::GrpcNew => {
                Target::Layered(Router::new().route(GRPC_PATH, post(charge)).layer(
                    IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromAuthorization),
                ))
            }
            Path::GatewayNew => gateway().await?,
        };
        Ok(Self {
            path,
            target,
            sent: 0,
            run: std::process::id(),
        })
    }

    /// Sends `requests` requests one after another; how many were
    /// answered as the path should answer.
    pub(crate) async fn send(&mut self, requests: usize) -> usize {
        let mut ok = 0;
        for _ in 0..requests {
            let key = if self.path.replays() {
                format!("budget-{}-replayed", self.run)
            } else {
                format!("budget-{}-{}", self.run, self.sent)
            };
            self.sent += 1;
            if self.one(&key).await {
                ok += 1;
            }
        }
        ok
    }

    async fn one(&self, key: &str) -> bool {
        match &self.target {
            Target::Layered(router) => {
                let grpc = self.path == Path::GrpcNew;
                let request = if grpc {
                    Request::post(GRPC_PATH)
                        .header(header::CONTENT_TYPE, "application/grpc")
                        .header("te", "trailers")
                        .body(Body::from(message(b"\x08\x64\x12\x03eur")))
                } else {
                    Request::post("/orders")
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Body::from(ORDER))
                };
                let Ok(mut request) = request else {
                    return false;
                };
                let headers = request.headers_mut();
                headers.insert(
                    header::AUTHORIZATION,
                    HeaderValue::from_static("Bearer budget"),
                );
                let Ok(key) = HeaderValue::from_str(key) else {
                    return false;
                };
                headers.insert("idempotency-key", key);
                let Ok(response) = router.clone().oneshot(request).await;
                let expected = if grpc {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                };
                let status = response.status();
                let Ok(collected) = response.into_body().collect().await else {
                    return false;
                };
                let trailers_ok = !grpc
                    || collected
                        .trailers()
                        .and_then(|t| t.get("grpc-status"))
                        .is_some_and(|s| s == "0");
                status == expected && trailers_ok && !collected.to_bytes().is_empty()
            }
            Target::Gateway { client, base, .. } => {
                let Ok(request) = Request::post(format!("{base}/orders"))
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::AUTHORIZATION, "Bearer budget")
                    .header("idempotency-key", key)
                    .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
                else {
                    return false;
                };
                let Ok(response) = client.request(request).await else {
                    return false;
                };
                let status = response.status();
                let Ok(body) = response.into_body().collect().await else {
                    return false;
                };
                status == StatusCode::CREATED && !body.to_bytes().is_empty()
            }
        }
    }
}

/// The handler a typical JSON API runs behind the layer.
fn orders() -> Router {
    Router::new().route("/orders", post(create_order))
}

async fn create_order(body: Bytes) -> Response<Body> {
    let json = format!("{{\"id\":\"1\",\"len\":{}}}", body.len());
    let mut response = Response::new(Body::from(json));
    *response.status_mut() = StatusCode::CREATED;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A unary gRPC answer: one message, then `grpc-status: 0` in the trailers.
async fn charge(_body: Bytes) -> Response<Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = [
        Frame::data(message(b"\x0a\x04paid")),
        Frame::trailers(trailers),
    ];
    let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
    let mut response = Response::new(Body::new(http_body_util::StreamBody::new(stream)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

/// One length-prefixed, uncompressed gRPC message.
fn message(bytes: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + bytes.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
    Bytes::from(out)
}

/// The gateway on defaults with a deployment secret, in front of its
/// built-in upstream, and a client with one kept-alive connection to it.
async fn gateway() -> Result<Target, String> {
    use clap::Parser;
    let config = idem_gateway::Config::try_parse_from([
        "idem-gateway",
        "--listen",
        "127.0.0.1:0",
        "--tenant-secret",
        SECRET,
    ])
    .map_err(|e| e.to_string())?;
    let (started, stop, _task) = idem_gateway::start(config)
        .await
        .map_err(|e| e.to_string())?;
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(600))
        .build_http();
    Ok(Target::Gateway {
        client: Box::new(client),
        base: format!("http://{}", started.addr),
        _stop: stop,
    })
}
