//! Shared helpers for idem's end-to-end tests: servers on free loopback
//! ports and a small HTTP client.

pub mod browser;
pub mod cutter;
pub mod deploy;
pub mod layer_suite;
pub mod nats_server;
pub mod pgbouncer;
pub mod postgres_server;
pub mod process;
pub mod redis_server;
pub mod tls;
pub mod upstream;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

pub use idem_core::conformance::{poll_until, wait_until};

/// A running axum server on an ephemeral loopback port; stops on drop.
#[derive(Debug)]
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    /// Serves `app` on `127.0.0.1:0`.
    pub async fn start(app: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        Self { addr, task }
    }

    /// Serves `app` over TLS on `127.0.0.1:0`, with the server certificate
    /// of `ca` (HTTP/1.1).
    pub async fn start_tls(app: axum::Router, ca: &tls::TestCa) -> Self {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca.cert())
            .expect("cert file")
            .collect::<Result<_, _>>()
            .expect("certs");
        let key = PrivateKeyDer::from_pem_file(ca.key()).expect("key");
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Self { addr, task }
    }

    /// `http://addr{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The gateway's configuration in front of `upstream` on `127.0.0.1:0`,
/// with extra flags.
pub fn gateway_config(upstream: std::net::SocketAddr, flags: &[&str]) -> idem_gateway::Config {
    gateway_config_for(&format!("http://{upstream}"), flags)
}

/// The configuration of a gateway on `127.0.0.1:0` in front of the
/// upstream at `url` (`http://…` or `https://…`), with extra flags.
pub fn gateway_config_for(url: &str, flags: &[&str]) -> idem_gateway::Config {
    use clap::Parser;
    let mut args = vec!["idem-gateway", "--listen", "127.0.0.1:0", "--upstream", url];
    args.extend_from_slice(flags);
    idem_gateway::Config::try_parse_from(args).expect("valid flags")
}

/// Starts a gateway in front of `upstream` that lives as long as the test
/// process.
pub async fn start_gateway(upstream: &TestServer, flags: &[&str]) -> idem_gateway::Started {
    let (started, stop, _task) = idem_gateway::start(gateway_config(upstream.addr, flags))
        .await
        .expect("gateway starts");
    // Dropping the trigger would shut the gateway down.
    std::mem::forget(stop);
    started
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl Reply {
    /// The problem `code`, if any.
    pub fn code(&self) -> Option<String> {
        let value: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        value.get("code")?.as_str().map(str::to_owned)
    }

    /// Whether `Idempotent-Replayed: true` is set.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A pooled HTTP/1 client for loopback.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends a request and reads the whole reply. The future owns a clone of
/// the (pooled) client, so it can be spawned.
pub fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> impl std::future::Future<Output = Reply> + Send + 'static {
    let client = client.clone();
    async move {
        let response = client.request(request).await.expect("request");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// An HTTP client for `idem-client`'s retry layer that reports every `409`
/// it receives on the returned channel (a running count), so a test can
/// wait until a retrying client has met a request in progress instead of
/// sleeping and hoping it did.
#[allow(clippy::type_complexity)] // an opaque service and its channel
pub fn client_counting_409s() -> (
    impl tower::Service<
        Request<idem_client::ReplayBody<Full<Bytes>>>,
        Response = http::Response<hyper::body::Incoming>,
        Error = hyper_util::client::legacy::Error,
        Future: Send,
    > + Clone
    + Send
    + 'static,
    tokio::sync::watch::Receiver<usize>,
) {
    use tower::ServiceExt;
    let (met, seen) = tokio::sync::watch::channel(0usize);
    let met = std::sync::Arc::new(met);
    let http = Client::builder(TokioExecutor::new())
        .build_http::<idem_client::ReplayBody<Full<Bytes>>>()
        .map_response(move |response: http::Response<hyper::body::Incoming>| {
            if response.status() == StatusCode::CONFLICT {
                met.send_modify(|n| *n += 1);
            }
            response
        });
    (http, seen)
}

/// A conformance harness for a store on a real server: the server's own
/// clock, moved by sleeping, with a short lease and retention so the
/// time-based checks run in seconds. Holds whatever must outlive the store
/// (the server processes).
pub struct RealClock<S> {
    store: S,
    _keep: Box<dyn std::any::Any + Send + Sync>,
}

impl<S> RealClock<S> {
    /// `store`, keeping `keep` alive as long as the harness.
    pub fn new(store: S, keep: impl std::any::Any + Send + Sync) -> Self {
        Self {
            store,
            _keep: Box::new(keep),
        }
    }
}

impl<S: idem_core::Store> idem_core::conformance::Harness for RealClock<S> {
    type Store = S;

    fn store(&self) -> &S {
        &self.store
    }

    async fn advance(&self, by: std::time::Duration) {
        tokio::time::sleep(by).await;
    }

    fn lease(&self) -> std::time::Duration {
        std::time::Duration::from_millis(900)
    }

    fn retention(&self) -> std::time::Duration {
        std::time::Duration::from_millis(2500)
    }
}

/// Store requests and outcomes shared by the benchmarks.
pub mod bench {
    use std::time::Duration;

    use bytes::Bytes;
    use idem_core::{IdempotencyKey, Outcome, ReserveRequest, Scope, StoredResponse};

    /// A reservation of `key` for the `bench` tenant (30 s lease, 10 min
    /// retention).
    pub fn request(key: &str) -> ReserveRequest {
        ReserveRequest {
            scope: Scope::new(
                "bench",
                "POST /orders",
                IdempotencyKey::parse(key.as_bytes()).expect("key"),
            ),
            fingerprint: idem_core::conformance::fingerprint(1),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(600),
        }
    }

    /// A small JSON response.
    pub fn outcome() -> Outcome {
        Outcome::Stored(StoredResponse {
            status: 201,
            headers: vec![(
                http::header::CONTENT_TYPE,
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from_static(b"{\"id\":42,\"status\":\"created\"}"),
        })
    }
}

/// A fleet-wide chore ([`idem_core::Fleet::claim_duty`]) on two handles
/// of one shared store: taken when free, refused to another holder while
/// the claim lasts, extended by its holder, and taken over once it lapses.
/// A store of one process (memory) gives every holder the chore.
pub async fn duty_is_held_by_one_holder_at_a_time<S: idem_core::Fleet>(a: S, b: S) {
    use std::time::Duration;

    let claim = async |store: &S, duty: &str, holder: &str, ttl: Duration| {
        store.claim_duty(duty, holder, ttl).await.expect("claim")
    };
    // Each step that expects a claim held has seconds of margin, so that
    // a stalled machine does not let it lapse in between.
    let first = Duration::from_secs(3);
    assert!(claim(&a, "chore", "a", first).await);
    assert!(!claim(&b, "chore", "b", first).await);
    // Another chore is free.
    assert!(claim(&b, "other", "b", first).await);
    // The holder extends its claim; past the first claim's end the other
    // still cannot take it.
    assert!(claim(&a, "chore", "a", Duration::from_secs(30)).await);
    let past_first = tokio::time::Instant::now() + first + Duration::from_millis(500);
    tokio::time::sleep_until(past_first).await;
    assert!(!claim(&b, "chore", "b", first).await);
    // A holder's claim is its new length from now, shorter too; once it
    // lapses, the other takes the chore over.
    assert!(claim(&a, "chore", "a", Duration::from_millis(300)).await);
    wait_until(Duration::from_secs(10), "the claim to lapse", async || {
        claim(&b, "chore", "b", first).await
    })
    .await;
    assert!(!claim(&a, "chore", "a", first).await);
    let memory = idem_memory::MemoryStore::new();
    assert!(
        idem_core::Fleet::claim_duty(&memory, "chore", "a", first)
            .await
            .expect("claim")
    );
    assert!(
        idem_core::Fleet::claim_duty(&memory, "chore", "b", first)
            .await
            .expect("claim")
    );
}

/// Checks how a store is claimed for an identity (`claim_identity` of
/// idem-redis and idem-postgres) through `claim(marker, ttl, replace)`: the
/// first marker holds it, another is told which one holds it, the same one
/// holds it again, and a replacing claim takes it, whose holder `"v1:b"`
/// the first is then told of. The store is left claimed by `"v1:b"` for
/// about a minute.
pub async fn claims_identity<C, F>(claim: C)
where
    C: Fn(&'static str, std::time::Duration, bool) -> F,
    F: std::future::Future<Output = Result<idem_core::IdentityClaim, idem_core::StoreError>>,
{
    use idem_core::IdentityClaim::{Held, Other};
    let (hour, minute) = (
        std::time::Duration::from_secs(3600),
        std::time::Duration::from_secs(60),
    );
    let steps = [
        ("v1:a", hour, false, Held),
        ("v1:b", hour, false, Other("v1:a".to_owned())),
        ("v1:a", minute, false, Held),
        ("v1:b", minute, true, Held),
        ("v1:a", hour, false, Other("v1:b".to_owned())),
    ];
    for (marker, ttl, replace, expected) in steps {
        let found = claim(marker, ttl, replace).await.expect("claim");
        assert_eq!(
            found, expected,
            "{marker} for {ttl:?}, replacing: {replace}"
        );
    }
}

/// Reserves `request` as a new key on `store`, then waits until its lease
/// has lapsed by the store's clock (the lease and 100 ms more: the wait is
/// on the server's time, not on a condition the test could see). Answers
/// the first attempt's lease.
pub async fn reserve_and_let_lapse<S: idem_core::Store>(
    store: &S,
    request: &idem_core::ReserveRequest,
) -> idem_core::Lease {
    let idem_core::Reservation::Acquired(first) = store.reserve(request).await.expect("reserve")
    else {
        panic!("a new key is acquired");
    };
    tokio::time::sleep(request.lease + std::time::Duration::from_millis(100)).await;
    first
}

/// [`reserve_and_let_lapse`], then the same request takes the lapsed lease
/// over: the first lease, the second, and the attempt it superseded.
pub async fn lapsed_and_taken_over<S: idem_core::Store>(
    store: &S,
    request: &idem_core::ReserveRequest,
) -> (idem_core::Lease, idem_core::Lease, idem_core::Attempt) {
    let first = reserve_and_let_lapse(store, request).await;
    let idem_core::Reservation::TakenOver {
        lease: second,
        superseded,
    } = store.reserve(request).await.expect("reserve")
    else {
        panic!("the lapsed lease is taken over");
    };
    (first, second, superseded)
}

/// Two stores on one Redis, one packing new records and one not, taking
/// the calls in turn: a record one layout's store wrote is read, completed,
/// renewed, released, cancelled and listed by the other's (a rolling
/// deploy that turns packing on, or off).
pub struct Alternating {
    stores: [idem_redis::RedisStore; 2],
    next: std::sync::atomic::AtomicUsize,
}

impl Alternating {
    /// The two stores, the first one taking the first call.
    pub fn new(stores: [idem_redis::RedisStore; 2]) -> Self {
        Self {
            stores,
            next: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn pick(&self) -> &idem_redis::RedisStore {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.stores[turn % 2]
    }
}

impl idem_core::Store for Alternating {
    async fn reserve(
        &self,
        request: &idem_core::ReserveRequest,
    ) -> Result<idem_core::Reservation, idem_core::StoreError> {
        self.pick().reserve(request).await
    }

    async fn renew(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Renewal, idem_core::StoreError> {
        self.pick().renew(lease).await
    }

    async fn mark_unknown(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Renewal, idem_core::StoreError> {
        self.pick().mark_unknown(lease).await
    }

    async fn complete(
        &self,
        lease: &idem_core::Lease,
        outcome: &idem_core::Outcome,
    ) -> Result<idem_core::Completion, idem_core::StoreError> {
        self.pick().complete(lease, outcome).await
    }

    async fn release(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Release, idem_core::StoreError> {
        self.pick().release(lease).await
    }

    async fn cancel(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::Cancellation, idem_core::StoreError> {
        self.pick().cancel(scope).await
    }

    async fn get(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<Option<idem_core::Record>, idem_core::StoreError> {
        self.pick().get(scope).await
    }
}

impl idem_core::RecordsAdmin for Alternating {
    async fn list(
        &self,
        query: &idem_core::RecordQuery,
    ) -> Result<Vec<idem_core::Record>, idem_core::StoreError> {
        self.pick().list(query).await
    }

    async fn force_release(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::ForceRelease, idem_core::StoreError> {
        self.pick().force_release(scope).await
    }

    async fn erase(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::Erasure, idem_core::StoreError> {
        self.pick().erase(scope).await
    }
}
