//! The gateway in-process on a real listener, in front of a counting
//! upstream on loopback, over real HTTP: on the memory store and on
//! spawned redis-servers.

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use idem_gateway::{Config, Started};
use idem_tests::{
    Reply, TestServer, client, poll_until,
    redis_server::{RedisCluster, RedisServer},
    send,
    upstream::Upstream,
    wait_until,
};

struct Gateway {
    started: Started,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), idem_gateway::StartError>>>,
}

impl Gateway {
    async fn start(upstream: &TestServer, flags: &[&str]) -> Self {
        let config = idem_tests::gateway_config(upstream.addr, flags);
        let (started, stop, task) = idem_gateway::start(config).await.expect("gateway starts");
        Self {
            started,
            stop: Some(stop),
            task: Some(task),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.started.addr, path)
    }

    /// Shuts down gracefully and waits until it has.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

fn request(
    gw: &Gateway,
    method: Method,
    path: &str,
    key: Option<&str>,
    auth: Option<&str>,
    body: &str,
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(gw.url(path))
        .header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    if let Some(auth) = auth {
        builder = builder.header("authorization", auth);
    }
    builder
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .expect("request")
}

async fn post(gw: &Gateway, path: &str, key: &str, body: &str) -> Reply {
    send(
        &client(),
        request(
            gw,
            Method::POST,
            path,
            Some(key),
            Some("Bearer alice"),
            body,
        ),
    )
    .await
}

async fn setup(flags: &[&str]) -> (Upstream, TestServer, Gateway) {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = Gateway::start(&server, flags).await;
    (upstream, server, gateway)
}

// ===== behaviour, shared by the memory and Redis runs =====

/// An upstream answer sent with `idem-no-store`: its client gets it without
/// that header, it is not stored, and a retry is told so without calling
/// the upstream again.
async fn an_opted_out_answer_is_not_stored(flags: &[&str]) {
    let (upstream, _server, gw) = setup(flags).await;
    let first = post(&gw, "/no-store", "secret-1", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.body.starts_with(b"one-time secret"));
    assert_eq!(first.header("idem-no-store"), None);
    let retry = post(&gw, "/no-store", "secret-1", "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.code().as_deref(),
        Some("idempotency_response_not_stored")
    );
    assert!(!retry.body.windows(6).any(|w| w == b"secret"));
    assert_eq!(upstream.runs(), 1);
}

async fn replay_conflict_and_headers(flags: &[&str]) {
    let (upstream, _server, gw) = setup(flags).await;
    let first = post(&gw, "/orders", "k1", r#"{"sku":"book","qty":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("set-cookie"), Some("session=1"));
    let replay = post(&gw, "/orders", "k1", r#"{"qty":1,"sku":"book"}"#).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "identical bytes");
    assert_eq!(
        replay.header("location"),
        Some("/orders/1"),
        "Location kept"
    );
    assert_eq!(replay.header("set-cookie"), None, "Set-Cookie dropped");
    let conflict = post(&gw, "/orders", "k1", r#"{"sku":"book","qty":2}"#).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(upstream.runs(), 1);
    let seen = upstream.seen.lock().expect("seen")[0].clone();
    assert_eq!(
        seen.key.as_deref(),
        Some("k1"),
        "the key is forwarded as the client sent it"
    );
    assert_eq!(
        seen.attempt.as_deref(),
        Some("1"),
        "Idempotency-Attempt: 1 on the first attempt"
    );
    gw.stop().await;
}

async fn concurrent_duplicates_execute_once(flags: &[&str]) {
    let (upstream, _server, gw) = setup(flags).await;
    let client = client();
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..40 {
        let request = request(
            &gw,
            Method::POST,
            "/slow",
            Some("dup"),
            Some("Bearer alice"),
            "{}",
        );
        let (reply, answers) = (send(&client, request), answers.clone());
        tokio::spawn(async move {
            let _ = answers.send(reply.await);
        });
    }
    // While the one execution is held, the 39 duplicates get 409.
    for _ in 0..39 {
        let reply = answered.recv().await.expect("a reply");
        assert_eq!(reply.status, StatusCode::CONFLICT);
        assert_eq!(reply.code().as_deref(), Some("idempotency_in_progress"));
    }
    upstream.gate.add_permits(1);
    let last = answered.recv().await.expect("the executed reply");
    assert_eq!(last.status, StatusCode::CREATED);
    assert!(!last.replayed());
    assert_eq!(upstream.runs(), 1, "40 concurrent duplicates executed once");
    gw.stop().await;
}

async fn outcomes_and_tenants(flags: &[&str]) {
    let (upstream, _server, gw) = setup(flags).await;
    let client = client();
    // 5xx and 429 release the key: the retry executes again.
    for code in [500, 503, 429] {
        let path = format!("/status/{code}");
        let first = post(&gw, &path, &format!("r{code}"), "{}").await;
        assert_eq!(first.status.as_u16(), code);
        let again = post(&gw, &path, &format!("r{code}"), "{}").await;
        assert!(!again.replayed());
        assert_ne!(again.body, first.body);
    }
    assert_eq!(upstream.runs(), 6);
    // 4xx is stored.
    let first = post(&gw, "/status/404", "s404", "{}").await;
    let again = post(&gw, "/status/404", "s404", "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(upstream.runs(), 7);
    // Tenants: another credential with the same key executes on its own.
    let bob = send(
        &client,
        request(
            &gw,
            Method::POST,
            "/orders",
            Some("shared"),
            Some("Bearer bob"),
            "{}",
        ),
    )
    .await;
    let alice = post(&gw, "/orders", "shared", "{}").await;
    assert!(!bob.replayed() && !alice.replayed());
    assert_eq!(upstream.runs(), 9);
    // No tenant: 401, upstream untouched.
    let nobody = send(
        &client,
        request(&gw, Method::POST, "/orders", Some("x"), None, "{}"),
    )
    .await;
    assert_eq!(nobody.status, StatusCode::UNAUTHORIZED);
    assert_eq!(nobody.code().as_deref(), Some("idempotency_tenant_missing"));
    // Too large: 413 before the upstream is reached.
    let big = "x".repeat(2048);
    let too_large = post(&gw, "/orders", "big", &big).await;
    assert_eq!(too_large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(too_large.code().as_deref(), Some("request_body_too_large"));
    assert_eq!(upstream.runs(), 9);
    // Keyless and non-keyed methods pass straight through.
    let keyless = send(
        &client,
        request(&gw, Method::POST, "/orders", None, None, "{}"),
    )
    .await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(upstream.runs(), 10);
    gw.stop().await;
}

async fn records_api_and_cancel(flags: &[&str]) {
    let (upstream, _server, gw) = setup(flags).await;
    let client = client();
    let slow = {
        let request = request(
            &gw,
            Method::POST,
            "/slow",
            Some("c1"),
            Some("Bearer alice"),
            "{}",
        );
        let client = client.clone();
        tokio::spawn(async move { send(&client, request).await })
    };
    upstream.wait_runs(1).await;
    let records = |method: Method, auth: &str| {
        Request::builder()
            .method(method)
            .uri(gw.url("/_idempotency/records?method=POST&path=/slow&key=c1"))
            .header("authorization", auth)
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    let processing = send(&client, records(Method::GET, "Bearer alice")).await;
    assert_eq!(processing.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&processing.body).expect("json");
    assert_eq!(json["state"], "processing");
    let other = send(&client, records(Method::GET, "Bearer bob")).await;
    assert_eq!(
        other.status,
        StatusCode::NOT_FOUND,
        "another tenant's record reads as absent"
    );
    let cancel = send(&client, records(Method::DELETE, "Bearer alice")).await;
    let json: serde_json::Value = serde_json::from_slice(&cancel.body).expect("json");
    assert_eq!(json["result"], "cancelled");
    upstream.gate.add_permits(1);
    assert_eq!(slow.await.expect("join").status, StatusCode::GONE);
    let retry = post(&gw, "/slow", "c1", "{}").await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.code().as_deref(), Some("idempotency_cancelled"));
    assert_eq!(upstream.runs(), 1);
    gw.stop().await;
}

async fn client_disconnect_records_the_outcome(flags: &[&str]) {
    use tokio::io::AsyncWriteExt;
    let (upstream, _server, gw) = setup(flags).await;
    // A raw connection, so the disconnect certainly happens: the socket is
    // closed while the upstream runs, and nothing was read from it.
    let mut socket = tokio::net::TcpStream::connect(gw.started.addr)
        .await
        .expect("connect");
    socket
        .write_all(
            b"POST /slow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n\
              Idempotency-Key: d1\r\nContent-Type: application/json\r\n\
              Content-Length: 2\r\n\r\n{}",
        )
        .await
        .expect("write");
    upstream.wait_runs(1).await;
    socket.shutdown().await.expect("shutdown");
    drop(socket);
    upstream.gate.add_permits(1);
    let retry = poll_until(
        Duration::from_secs(10),
        async || post(&gw, "/slow", "d1", "{}").await,
        |reply| reply.status != StatusCode::CONFLICT,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the retry is replayed, not re-executed");
    assert_eq!(upstream.runs(), 1);
    gw.stop().await;
}

// ===== memory store =====

/// One test per behaviour, on a gateway with the memory store and these
/// flags.
macro_rules! on_memory {
    ($($name:ident => $behaviour:ident($flags:expr)),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $behaviour($flags).await;
            }
        )*
    };
}

on_memory!(
    memory_replay_conflict_and_headers => replay_conflict_and_headers(&[]),
    memory_concurrent_duplicates => concurrent_duplicates_execute_once(&[]),
    memory_outcomes_and_tenants => outcomes_and_tenants(&["--max-body", "1024"]),
    memory_records_api_and_cancel => records_api_and_cancel(&[]),
    memory_client_disconnect => client_disconnect_records_the_outcome(&[]),
    memory_opted_out_answer => an_opted_out_answer_is_not_stored(&[]),
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_is_502_and_releases_the_key() {
    // A port that nothing listens on any more: bound, then closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind");
    let url = format!("http://{addr}");
    let config = Config::try_parse_from([
        "idem-gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &url,
    ])
    .expect("flags");
    let (started, stop, _task) = idem_gateway::start(config).await.expect("start");
    let gw = Gateway {
        started,
        stop: Some(stop),
        task: None,
    };
    let reply = post(&gw, "/orders", "u1", "{}").await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_eq!(reply.code().as_deref(), Some("upstream_unreachable"));
    // Released: the next try is a new attempt, not a replay of the 502.
    let again = post(&gw, "/orders", "u1", "{}").await;
    assert_eq!(again.status, StatusCode::BAD_GATEWAY);
    assert!(!again.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_metrics_and_invalid_flags() {
    let (_upstream, _server, gw) = setup(&["--tenant-header", "x-tenant"]).await;
    let client = client();
    let get = |path: &str| {
        Request::get(gw.url(path))
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    assert_eq!(send(&client, get("/healthz")).await.status, StatusCode::OK);
    let metrics = send(&client, get("/metrics")).await;
    assert_eq!(metrics.status, StatusCode::OK);
    // With the tenant header configured, Authorization alone is no tenant.
    let reply = post(&gw, "/orders", "t", "{}").await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    for bad in [
        vec!["--lease", "10x"],
        vec!["--in-flight", "sometimes"],
        vec!["--store", "mysql://x"],
        vec!["--store", "postgres://x:notaport/db"],
        vec!["--upstream", "ftp://x"],
        vec!["--methods", "PO ST"],
        vec!["--records-prefix", "x"],
    ] {
        let mut args = vec!["idem-gateway"];
        args.extend(bad.iter().copied());
        assert!(
            Config::try_parse_from(&args).is_err(),
            "{bad:?} must be refused"
        );
    }
    let config = Config::try_parse_from([
        "idem-gateway",
        "--lease",
        "30s",
        "--retention",
        "10s",
        "--listen",
        "127.0.0.1:0",
    ])
    .expect("flags parse");
    assert!(
        idem_gateway::start(config).await.is_err(),
        "retention not longer than the lease is refused at start"
    );
    gw.stop().await;
}

// ===== Redis =====

fn redis_flags(url: &str) -> Vec<&str> {
    vec![
        "--store",
        url,
        // Short, so a paused server is answered 503 well within 5 s; long
        // enough that a loaded machine's ordinary calls never time out.
        "--store-timeout",
        "1s",
        // Two gateways on one Redis must derive the same tenants.
        "--tenant-secret",
        "the test gateways' shared tenant secret",
    ]
}

macro_rules! on_redis {
    ($name:ident, $behaviour:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(redis) = RedisServer::spawn() else {
                return;
            };
            let url = redis.url();
            let flags = redis_flags(&url);
            $behaviour(&flags).await;
        }
    };
}

on_redis!(
    redis_replay_conflict_and_headers,
    replay_conflict_and_headers
);
on_redis!(
    redis_concurrent_duplicates,
    concurrent_duplicates_execute_once
);
on_redis!(redis_records_api_and_cancel, records_api_and_cancel);
on_redis!(redis_opted_out_answer, an_opted_out_answer_is_not_stored);
on_redis!(
    redis_client_disconnect,
    client_disconnect_records_the_outcome
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outcomes_and_tenants() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let url = redis.url();
    let mut flags = redis_flags(&url);
    flags.extend(["--max-body", "1024"]);
    outcomes_and_tenants(&flags).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_is_503_within_the_timeout_and_upstream_untouched() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let url = redis.url();
    let flags = redis_flags(&url);
    let (upstream, _server, gw) = setup(&flags).await;
    // Warm the store's connections, so the call below is really queued
    // behind the paused server.
    for n in 0..8 {
        assert_eq!(
            post(&gw, "/orders", &format!("before-{n}"), "{}")
                .await
                .status,
            StatusCode::CREATED
        );
    }
    redis.pause();
    let started = Instant::now();
    let reply = post(&gw, "/orders", "during", "{}").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        reply.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert!(reply.header("retry-after").is_some());
    // By the 1 s store timeout: without it the call waits for the paused
    // server for good.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after {:?}",
        started.elapsed()
    );
    let health = send(
        &client(),
        Request::get(gw.url("/healthz"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(health.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        upstream.runs(),
        8,
        "nothing executed while the store was unreachable"
    );
    redis.resume();
    // Recovery: the key that got 503 is free and runs once, well within
    // its 30 s lease; the earlier keys replay.
    let recovered = poll_until(
        Duration::from_secs(10),
        async || post(&gw, "/orders", "during", "{}").await,
        |reply| reply.status == StatusCode::CREATED,
    )
    .await;
    assert_eq!(
        recovered.status,
        StatusCode::CREATED,
        "{:?}",
        recovered.code()
    );
    assert_eq!(upstream.runs(), 9);
    assert!(post(&gw, "/orders", "before-0", "{}").await.replayed());
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_execute_once() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let url = redis.url();
    let flags = redis_flags(&url);
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let a = Gateway::start(&server, &flags).await;
    let b = Gateway::start(&server, &flags).await;
    let client = client();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let request = request(
            gw,
            Method::POST,
            "/slow",
            Some("both"),
            Some("Bearer alice"),
            "{}",
        );
        let client = client.clone();
        tasks.push(tokio::spawn(async move { send(&client, request).await }));
    }
    upstream.wait_runs(1).await;
    // The 19 duplicates are answered (409) while the one execution is held.
    wait_until(
        Duration::from_secs(10),
        "19 duplicates answered",
        async || tasks.iter().filter(|t| t.is_finished()).count() >= 19,
    )
    .await;
    upstream.gate.add_permits(1);
    for task in tasks {
        let status = task.await.expect("join").status;
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    assert_eq!(upstream.runs(), 1);
    assert!(post(&a, "/slow", "both", "{}").await.replayed());
    assert!(post(&b, "/slow", "both", "{}").await.replayed());
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store_through_the_gateway() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let url = cluster.url();
    let flags = redis_flags(&url);
    let (upstream, _server, gw) = setup(&flags).await;
    for i in 0..10 {
        let key = format!("c{i}");
        let first = post(&gw, "/orders", &key, "{}").await;
        assert_eq!(first.status, StatusCode::CREATED);
        let replay = post(&gw, "/orders", &key, "{}").await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(upstream.runs(), 10);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_with_prior_knowledge_is_served() {
    let (upstream, _server, gw) = setup(&[]).await;
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let first = send(
        &h2,
        request(
            &gw,
            Method::POST,
            "/orders",
            Some("h2"),
            Some("Bearer alice"),
            "{}",
        ),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(
        &h2,
        request(
            &gw,
            Method::POST,
            "/orders",
            Some("h2"),
            Some("Bearer alice"),
            "{}",
        ),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);
    gw.stop().await;
}

/// Keyless requests and other methods are not buffered: a body over the
/// keyed limit streams straight through to the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_bodies_stream_through_without_the_limit() {
    let (upstream, _server, gw) = setup(&["--max-body", "1024"]).await;
    let big = "x".repeat(64 * 1024);
    let keyless = send(
        &client(),
        request(&gw, Method::POST, "/orders", None, None, &big),
    )
    .await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(
        keyless.body, "{\"id\":1,\"bytes\":65536}",
        "the upstream got the whole body"
    );
    let keyed = send(
        &client(),
        request(
            &gw,
            Method::POST,
            "/orders",
            Some("k"),
            Some("Bearer a"),
            &big,
        ),
    )
    .await;
    assert_eq!(keyed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(upstream.runs(), 1);
    gw.stop().await;
}
