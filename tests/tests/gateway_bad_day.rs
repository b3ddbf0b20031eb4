//! Bad days through the gateway over real HTTP: upstream timeouts and
//! unreadable answers (unknown outcomes), answers broken mid-body, path aliases, method case, big
//! numbers, released records, proxy headers and flags that once panicked.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use idem_tests::{Reply, TestServer, client, poll_until, send, start_gateway, upstream::Upstream};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

fn keyed(
    gateway: SocketAddr,
    method: Method,
    path: &str,
    key: &str,
    body: &str,
) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://{gateway}{path}"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .expect("request")
}

async fn post(gateway: SocketAddr, path: &str, key: &str) -> Reply {
    send(&client(), keyed(gateway, Method::POST, path, key, "{}")).await
}

/// Retries `attempt` every 50 ms until `done` holds, for at most `within`.
/// The upstream takes longer than the gateway waits: the client gets 504,
/// retries get 409 (no second execution while the first may still run),
/// and when the upstream's answer arrives it is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_timeout_keeps_the_key_and_records_the_late_answer() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &["--upstream-timeout", "200ms"]).await;
    let first = post(gateway.addr, "/slow", "late-1").await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(first.code().as_deref(), Some("upstream_timeout"));
    for _ in 0..3 {
        let retry = post(gateway.addr, "/slow", "late-1").await;
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "the key is not released"
        );
        assert_eq!(retry.code().as_deref(), Some("idempotency_in_progress"));
    }
    assert_eq!(upstream.runs(), 1);
    upstream.gate.add_permits(1);
    let replay = poll_until(
        Duration::from_secs(10),
        async || post(gateway.addr, "/slow", "late-1").await,
        Reply::replayed,
    )
    .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed(), "the late answer is replayed");
    assert_eq!(&replay.body[..], b"slow run 1");
    assert_eq!(upstream.runs(), 1, "the upstream ran once");
}

/// While the gateway waits for a late answer, it keeps renewing the lease:
/// retries well past the first lease (1 s) still get 409, the upstream
/// never sees a second attempt, and the answer that comes at 3 s is
/// recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_renewed_while_the_late_answer_is_awaited() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &server,
        &[
            "--lease",
            "1s",
            "--upstream-timeout",
            "100ms",
            "--unknown-outcome-wait",
            "10s",
        ],
    )
    .await;
    let sent = std::time::Instant::now();
    let first = post(gateway.addr, "/slow", "renewed-1").await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    // From 1.5 s to 2.5 s after the request: the first lease has lapsed
    // unless it was renewed.
    tokio::time::sleep(Duration::from_millis(1500).saturating_sub(sent.elapsed())).await;
    let mut retries = 0;
    while sent.elapsed() < Duration::from_millis(2500) {
        let retry = post(gateway.addr, "/slow", "renewed-1").await;
        assert_eq!(
            (retry.status, retry.code().as_deref()),
            (StatusCode::CONFLICT, Some("idempotency_in_progress")),
            "{:?} after the request: the lease was not renewed",
            sent.elapsed()
        );
        retries += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(retries > 0);
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(sent.elapsed())).await;
    upstream.gate.add_permits(1);
    let replay = poll_until(
        Duration::from_secs(10),
        async || post(gateway.addr, "/slow", "renewed-1").await,
        Reply::replayed,
    )
    .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(&replay.body[..], b"slow run 1");
    assert_eq!(upstream.runs(), 1, "the upstream ran once");
    let seen = upstream.seen.lock().expect("seen").clone();
    assert!(
        seen.iter().all(|s| s.attempt.as_deref() == Some("1")),
        "{seen:?}"
    );
}

/// When the late answer does not come within the wait, the lease lapses
/// and only then a retry takes over, with `Idempotency-Attempt: 2`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_answers_is_taken_over_after_the_lease() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &server,
        &[
            "--upstream-timeout",
            "100ms",
            "--unknown-outcome-wait",
            "100ms",
            "--lease",
            "1s",
        ],
    )
    .await;
    // The lease starts after this instant: no takeover comes before a
    // lease from it.
    let sent = std::time::Instant::now();
    assert_eq!(
        post(gateway.addr, "/slow", "never-1").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    // Right after the 504 (the wait for a late answer is over), the key
    // is still held: the outcome is unknown, nothing released it.
    let busy = post(gateway.addr, "/slow", "never-1").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    // The records API shows the attempt's outcome as unknown.
    let record = send(
        &client(),
        keyed(
            gateway.addr,
            Method::GET,
            "/_idempotency/records?method=POST&path=/slow&key=never-1",
            "never-1",
            "",
        ),
    )
    .await;
    assert_eq!(record.status, StatusCode::OK, "{record:?}");
    let json: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(json["state"], "processing", "{json}");
    assert_eq!(json["attempts"][0]["outcome"]["kind"], "unknown", "{json}");
    // After the lease (measured by the store), a retry takes over.
    let takeover = poll_until(
        Duration::from_secs(10),
        async || post(gateway.addr, "/slow", "never-1").await,
        |r| r.status != StatusCode::CONFLICT,
    )
    .await;
    assert_eq!(takeover.status, StatusCode::GATEWAY_TIMEOUT);
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_secs(1),
        "taken over {waited:?} after the first request, before its 1 s lease lapsed"
    );
    upstream.gate.add_permits(2);
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].attempt.as_deref(), Some("1"));
    assert_eq!(seen[1].attempt.as_deref(), Some("2"));
}

/// A raw upstream that answers every request with `answer`, closes the
/// connection and counts the requests it got.
async fn raw_upstream(answer: &'static [u8]) -> (SocketAddr, Arc<AtomicUsize>) {
    raw_upstream_then(answer, true).await
}

/// [`raw_upstream`], keeping the connection open after the answer unless
/// `close` (an upstream that stalls mid-answer).
async fn raw_upstream_then(answer: &'static [u8], close: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&count);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                let mut read = Vec::new();
                // Read the head and the small body (content-length 2).
                while let Ok(n) = stream.read(&mut buffer).await {
                    if n == 0 {
                        return;
                    }
                    read.extend_from_slice(&buffer[..n]);
                    if let Some(head) = read.windows(4).position(|w| w == b"\r\n\r\n")
                        && read.len() >= head + 4 + 2
                    {
                        break;
                    }
                }
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = stream.write_all(answer).await;
                if close {
                    let _ = stream.shutdown().await;
                } else {
                    // Held open, silent, until the gateway gives up on it.
                    let _ = stream.read(&mut buffer).await;
                }
            });
        }
    });
    (addr, count)
}

async fn start(config: idem_gateway::Config) -> SocketAddr {
    let (started, stop, _task) = idem_gateway::start(config).await.expect("gateway starts");
    std::mem::forget(stop);
    started.addr
}

/// An answer the gateway cannot read: 502, and the key stays reserved
/// (the upstream may have acted), so retries get 409, not a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_answer_keeps_the_key() {
    let (upstream, count) = raw_upstream(b"THIS IS NOT HTTP\r\n\r\n").await;
    let gateway = start(idem_tests::gateway_config(upstream, &[])).await;
    let first = post(gateway, "/orders", "garbage-1").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(first.code().as_deref(), Some("upstream_answer_lost"));
    let retry = post(gateway, "/orders", "garbage-1").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// An answer with an obs-folded header is an answer: stored and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_obs_folded_answer_is_recorded() {
    let (upstream, count) = raw_upstream(
        b"HTTP/1.1 201 Created\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    )
    .await;
    let gateway = start(idem_tests::gateway_config(upstream, &[])).await;
    let first = post(gateway, "/orders", "fold-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = post(gateway, "/orders", "fold-1").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(&replay.body[..], b"ok");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// A 201 head and 9 of its body's 100 bytes.
const HEAD_AND_PART: &[u8] =
    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"order\":";

/// `409 idempotency_response_not_stored`, marked replayed or not.
fn assert_not_stored(reply: &Reply, replayed: bool) {
    assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
    assert_eq!(
        reply.code().as_deref(),
        Some("idempotency_response_not_stored")
    );
    assert_eq!(reply.replayed(), replayed, "{reply:?}");
}

/// An upstream that answers 201 and breaks the connection mid-body has
/// done its work: the key is not released for a second run. The outcome
/// is recorded without the response, so the client and every retry get
/// `409 idempotency_response_not_stored`, and the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_broken_mid_body_never_runs_twice() {
    let (upstream, count) = raw_upstream(HEAD_AND_PART).await;
    let gateway = start(idem_tests::gateway_config(upstream, &[])).await;
    assert_not_stored(&post(gateway, "/orders", "broken-1").await, false);
    for _ in 0..2 {
        assert_not_stored(&post(gateway, "/orders", "broken-1").await, true);
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "the upstream ran once");
}

/// An upstream that sends a 201 head and part of its body, then nothing
/// while holding the connection open, is bounded by `--upstream-timeout`
/// as if it had broken the connection: the outcome is recorded without the
/// response, the client and its retries get
/// `409 idempotency_response_not_stored`, and the upstream ran once. (Before,
/// the gateway waited for the body for good, renewing the lease: the key
/// stayed processing and every retry got 409 in progress.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stalled_mid_body_is_bounded_and_never_runs_twice() {
    let (upstream, count) = raw_upstream_then(HEAD_AND_PART, false).await;
    let gateway = start(idem_tests::gateway_config(
        upstream,
        &["--upstream-timeout", "300ms"],
    ))
    .await;
    // Far beyond the 300 ms bound: without it, the answer never comes.
    let first = tokio::time::timeout(
        Duration::from_secs(20),
        post(gateway, "/orders", "stalled-1"),
    )
    .await
    .expect("the gateway answers a stalled upstream");
    assert_not_stored(&first, false);
    assert_not_stored(&post(gateway, "/orders", "stalled-1").await, true);
    assert_eq!(count.load(Ordering::SeqCst), 1, "the upstream ran once");
}

/// A refused connection provably never reached the upstream: the key is
/// released at once and the retry is a first run, not a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_releases_the_key() {
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        listener.local_addr().expect("addr")
    };
    let gateway = start(idem_tests::gateway_config(closed, &[])).await;
    for _ in 0..2 {
        let answer = post(gateway, "/orders", "refused-1").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(answer.code().as_deref(), Some("upstream_unreachable"));
    }
}

/// `//orders`, `/./orders` and `/x/../orders` are one scope, and the
/// upstream gets the normalized path once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_aliases_are_one_scope_and_forwarded_normalized() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    let first = post(gateway.addr, "//orders", "alias-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    for alias in ["/./orders", "/x/../orders", "/orders"] {
        let replay = post(gateway.addr, alias, "alias-1").await;
        assert!(replay.replayed(), "{alias}");
        assert_eq!(replay.body, first.body);
    }
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/orders");
}

/// `post` is never forwarded unprotected, with or without `--require-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowercase_method_is_refused() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    for flags in [&[][..], &["--require-key"][..]] {
        let gateway = start_gateway(&server, flags).await;
        let lower = Method::from_bytes(b"post").expect("method");
        let answer = send(
            &client(),
            keyed(gateway.addr, lower, "/orders", "lower-1", "{}"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(answer.code().as_deref(), Some("method_case_mismatch"));
    }
    assert_eq!(upstream.runs(), 0);
}

/// Amounts beyond 2^53 that differ are a conflict, not a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_amounts_that_differ_conflict() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    let http = client();
    let send_amount = |body: &'static str| {
        send(
            &http,
            keyed(gateway.addr, Method::POST, "/orders", "amount-1", body),
        )
    };
    assert_eq!(
        send_amount("{\"amount\":10000000000000001}").await.status,
        StatusCode::CREATED
    );
    let other = send_amount("{\"amount\":10000000000000000}").await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(upstream.runs(), 1);
}

/// A released record (after a 503) has nothing to cancel: 404, and the key
/// stays free for the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_released_record_is_not_found() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    assert_eq!(
        post(gateway.addr, "/status/503", "released-1").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let cancel = send(
        &client(),
        Request::delete(format!(
            "http://{}/_idempotency/records?method=POST&path=/status/503&key=released-1",
            gateway.addr
        ))
        .header("authorization", "Bearer alice")
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await;
    assert_eq!(cancel.status, StatusCode::NOT_FOUND);
    assert_eq!(
        cancel.code().as_deref(),
        Some("idempotency_record_not_found")
    );
    assert_eq!(
        post(gateway.addr, "/status/503", "released-1").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(upstream.runs(), 2, "the retry ran: the key was free");
}

/// `Connection` may not strip the headers the layer used; the upstream
/// gets one spelling of the key; a client's `Idempotency-Attempt` never
/// reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_headers_are_the_gateways_own() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    for named in [
        "authorization",
        "Idempotency-Key",
        "keep-alive, idempotency-attempt",
    ] {
        let mut request = keyed(gateway.addr, Method::POST, "/orders", "conn-1", "{}");
        request
            .headers_mut()
            .insert("connection", named.parse().expect("value"));
        let answer = send(&client(), request).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{named}");
        assert_eq!(answer.code().as_deref(), Some("connection_header_invalid"));
    }
    assert_eq!(upstream.runs(), 0);
    // Bare and quoted spellings name one key; the attempt that runs
    // forwards it as its client sent it.
    let bare = post(gateway.addr, "/orders", "spell-1").await;
    assert_eq!(bare.status, StatusCode::CREATED);
    let quoted = post(gateway.addr, "/orders", "\"spell-1\"").await;
    assert!(quoted.replayed());
    // An unkeyed request with a forged attempt header.
    let mut forged = Request::post(format!("http://{}/orders", gateway.addr))
        .header("idempotency-attempt", "7")
        .body(Full::new(Bytes::new()))
        .expect("request");
    forged
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("value"));
    assert_eq!(send(&client(), forged).await.status, StatusCode::CREATED);
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key.as_deref(), Some("spell-1"));
    assert_eq!(seen[0].attempt.as_deref(), Some("1"));
    assert_eq!(seen[1].key, None);
    assert_eq!(
        seen[1].attempt, None,
        "the client's attempt header is dropped"
    );
    // A key first sent quoted goes on quoted.
    let quoted = post(gateway.addr, "/orders", "\"spell-2\"").await;
    assert_eq!(quoted.status, StatusCode::CREATED);
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen[2].key.as_deref(), Some("\"spell-2\""));
}

/// An upstream that answers `101 Switching Protocols` to a keyed POST that
/// asked for no upgrade: the request reached it, so the outcome is
/// unknown: the client gets `502 upstream_answer_invalid` (not a bare 101),
/// the key is kept, and the retry gets 409 instead of a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unasked_101_keeps_the_key() {
    let (upstream, count) = raw_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n",
    )
    .await;
    let gateway = start(idem_tests::gateway_config(upstream, &[])).await;
    let first = post(gateway, "/orders", "switch-1").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(first.code().as_deref(), Some("upstream_answer_invalid"));
    for _ in 0..2 {
        let retry = post(gateway, "/orders", "switch-1").await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
        assert_eq!(retry.code().as_deref(), Some("idempotency_in_progress"));
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "the upstream ran once");
}

/// Sends `head` and `body` as they are over a new connection and reads
/// the answer to its end: its status and body.
async fn raw_request(addr: SocketAddr, head: &[u8], body: &[u8]) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head).await.expect("write head");
    stream.write_all(body).await.expect("write body");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// One key sent to `/orders/é` as raw UTF-8 and then to `/orders/%C3%A9`
/// names one operation: the second replays, and the upstream ran once,
/// given the percent-encoded path (it ran twice: two scopes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_utf8_in_the_path_is_one_operation_with_its_escapes() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    let mut head = b"POST /orders/".to_vec();
    head.extend_from_slice("é".as_bytes());
    head.extend_from_slice(
        b" HTTP/1.1\r\nHost: gateway\r\nIdempotency-Key: utf8-1\r\n\
          Authorization: Bearer alice\r\nContent-Type: application/json\r\n\
          Content-Length: 2\r\nConnection: close\r\n\r\n",
    );
    let (status, body) = raw_request(gateway.addr, &head, b"{}").await;
    assert_eq!(status, 201, "{body}");
    let escaped = post(gateway.addr, "/orders/%C3%A9", "utf8-1").await;
    assert_eq!(escaped.status, StatusCode::CREATED, "{escaped:?}");
    assert!(escaped.replayed(), "one operation, replayed");
    assert_eq!(&escaped.body[..], body.as_bytes());
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].path, "/orders/%C3%A9", "forwarded escaped");
}

/// The records API's admin credential is the gateway's own: it never
/// reaches the upstream, on a keyed or unkeyed POST or a GET;
/// `Authorization` still does. A mistyped records path is the gateway's
/// too (everything under the records prefix is): refused, never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_never_reaches_the_upstream() {
    const ADMIN: &str = "admin token of sixteen bytes or more";
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &["--records-admin-token", ADMIN]).await;
    let with_token = |method: Method, path: &str, key: Option<&str>| {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", gateway.addr))
            .header("authorization", "Bearer alice")
            .header("x-idem-admin-token", ADMIN)
            .header("content-type", "application/json");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", key);
        }
        builder
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let http = client();
    for request in [
        with_token(Method::POST, "/orders", Some("admin-1")),
        with_token(Method::POST, "/orders", None),
        with_token(Method::GET, "/anything", None),
    ] {
        let answer = send(&http, request).await;
        assert!(answer.status.is_success(), "{answer:?}");
    }
    let mistyped = send(
        &http,
        with_token(Method::POST, "/_idempotency/recordz", Some("admin-2")),
    )
    .await;
    assert_eq!(mistyped.status, StatusCode::NOT_FOUND, "{mistyped:?}");
    assert_eq!(mistyped.code().as_deref(), Some("gateway_path_reserved"));
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for seen in &seen {
        assert_eq!(seen.admin_token, None, "{seen:?}");
    }
}

/// An upstream that answers `/gz` coded as the request accepts (`gzip`,
/// `br`, or not at all), counting its runs.
fn coding_upstream(runs: Arc<AtomicUsize>) -> axum::Router {
    use std::io::Write;
    axum::Router::new().route(
        "/gz",
        axum::routing::post(move |headers: http::HeaderMap| {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let plain = format!("{{\"order\":{n},\"pad\":\"{}\"}}", "x".repeat(500));
                let accept = headers
                    .get("accept-encoding")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let mut response = if accept.contains("gzip") {
                    let mut gz =
                        flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    gz.write_all(plain.as_bytes()).expect("gzip");
                    let mut response =
                        http::Response::new(axum::body::Body::from(gz.finish().expect("gzip")));
                    response
                        .headers_mut()
                        .insert("content-encoding", http::HeaderValue::from_static("gzip"));
                    response
                } else if accept.contains("br") {
                    let mut response =
                        http::Response::new(axum::body::Body::from("pretend brotli"));
                    response
                        .headers_mut()
                        .insert("content-encoding", http::HeaderValue::from_static("br"));
                    response
                } else {
                    http::Response::new(axum::body::Body::from(plain))
                };
                *response.status_mut() = StatusCode::CREATED;
                response
            }
        }),
    )
}

/// A replay never carries a content coding the retry did not accept: the
/// first try accepted gzip and got it; a retry with `identity` (or no
/// `Accept-Encoding`) gets the decoded bytes without `Content-Encoding`; a
/// retry that accepts gzip gets the stored bytes; a coding the layer
/// cannot decode (`br`) is `406 idempotency_replay_not_acceptable`. The
/// upstream ran once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_never_sends_a_coding_the_retry_did_not_accept() {
    let runs = Arc::new(AtomicUsize::new(0));
    let server = TestServer::start(coding_upstream(Arc::clone(&runs))).await;
    let gateway = start_gateway(&server, &[]).await;
    let http = client();
    let with_accept = |key: &str, accept: Option<&str>| {
        let mut request = keyed(gateway.addr, Method::POST, "/gz", key, "{}");
        if let Some(accept) = accept {
            request
                .headers_mut()
                .insert("accept-encoding", accept.parse().expect("value"));
        }
        send(&http, request)
    };
    let first = with_accept("gz-1", Some("gzip")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("content-encoding"), Some("gzip"));
    let mut plain = String::new();
    std::io::Read::read_to_string(
        &mut flate2::read::GzDecoder::new(&first.body[..]),
        &mut plain,
    )
    .expect("gunzip");
    for accept in [Some("identity"), None, Some("gzip;q=0, br")] {
        let retry = with_accept("gz-1", accept).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{accept:?}");
        assert!(retry.replayed());
        assert_eq!(retry.header("content-encoding"), None, "{accept:?}");
        assert_eq!(&retry.body[..], plain.as_bytes(), "{accept:?}");
    }
    let coded = with_accept("gz-1", Some("gzip, deflate")).await;
    assert_eq!(coded.header("content-encoding"), Some("gzip"));
    assert_eq!(coded.body, first.body, "the stored bytes");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let br = with_accept("br-1", Some("br")).await;
    assert_eq!(br.header("content-encoding"), Some("br"));
    let refused = with_accept("br-1", Some("identity")).await;
    assert_eq!(refused.status, StatusCode::NOT_ACCEPTABLE);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_replay_not_acceptable")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "never run again");
}

/// Durations no clock can hold are refused when the flags are read, and
/// so is a zero bound on a wait every request makes (the upstream's
/// answer, a request's head, its body), which would refuse every request
/// (`--upstream-timeout 0s` answered nearly everything `504` and left
/// keys reserved as unknown outcomes). A zero that means "do not wait" is
/// accepted.
#[test]
fn absurd_durations_are_refused_at_start() {
    let parse = |flags: &[&str]| {
        let mut args = vec!["idem-gateway"];
        args.extend_from_slice(flags);
        <idem_gateway::Config as clap::Parser>::try_parse_from(&args)
    };
    for flags in [
        &[][..],
        &["--unknown-outcome-wait", "0s"][..],
        &["--drain-timeout", "0s"][..],
        &["--upstream-timeout", "1ms"][..],
    ] {
        assert!(parse(flags).is_ok(), "{flags:?} refused");
    }
    for flags in [
        &["--in-flight", "wait:292400000000y"][..],
        &["--retention", "9000y"][..],
        &["--lease", "200y"][..],
        &["--upstream-timeout", "1000y"][..],
        &["--upstream-timeout", "0s"][..],
        &["--header-timeout", "0s"][..],
        &["--body-timeout", "0ms"][..],
    ] {
        let refused = parse(flags).expect_err("accepted");
        assert!(
            refused.to_string().contains(flags[0]),
            "{flags:?}: {refused}"
        );
    }
}

/// A client with idem-client's defaults meets the gateway's 409: the short
/// `Retry-After` keeps it within its deadline, so it retries until the
/// first attempt's outcome is replayed. (A hint of the whole lease, 30 s,
/// made it give up at the first 409.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_client_waits_out_a_409() {
    use idem_client::{RetryInfo, RetryLayer};
    use tower::{Layer, ServiceExt};
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    let first = tokio::spawn(post(gateway.addr, "/slow", "client-1"));
    upstream.wait_runs(1).await;
    // The inner client tells when the gateway answered 409.
    let (http, mut on_409) = idem_tests::client_counting_409s();
    let retrying = RetryLayer::new().layer(http);
    let second = tokio::spawn(retrying.oneshot(keyed(
        gateway.addr,
        Method::POST,
        "/slow",
        "client-1",
        "{}",
    )));
    on_409.wait_for(|n| *n >= 1).await.expect("a 409 was met");
    upstream.gate.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::CREATED);
    let second = second.await.expect("join").expect("the client's answer");
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(second.headers().contains_key("idempotent-replayed"));
    let info = second.extensions().get::<RetryInfo>().expect("info");
    assert!(info.attempts >= 2);
    assert_eq!(upstream.runs(), 1);
}

/// An `https://` upstream: verified against `--upstream-ca`, keyed requests
/// run once and replay; a gateway that does not trust the upstream's CA
/// never sends it the request (502 `upstream_unreachable`, the key free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_verified() {
    let Some(ca) = idem_tests::tls::TestCa::new() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start_tls(upstream.router(), &ca).await;
    let url = format!("https://127.0.0.1:{}", server.addr.port());
    let ca_file = ca.ca().display().to_string();
    let start = |flags: &[&str]| idem_tests::gateway_config_for(&url, flags);
    let post = |addr: std::net::SocketAddr| {
        Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", "https-1")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let (doubting, _stop_doubting, _) = idem_gateway::start(start(&[])).await.expect("gateway");
    let refused = send(&client(), post(doubting.addr)).await;
    assert_eq!(refused.status, StatusCode::BAD_GATEWAY, "{refused:?}");
    assert_eq!(refused.code().as_deref(), Some("upstream_unreachable"));
    assert_eq!(upstream.runs(), 0);
    let (trusting, _stop_trusting, _) = idem_gateway::start(start(&["--upstream-ca", &ca_file]))
        .await
        .expect("gateway");
    let first = send(&client(), post(trusting.addr)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&client(), post(trusting.addr)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);
}

/// A client that leaves while its body is still arriving: nothing was
/// reserved and nothing ran, so the same key sent whole runs at once (no
/// 409 for a lease, no replay of a half request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_body_leaves_nothing_behind() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    let mut stream = tokio::net::TcpStream::connect(gateway.addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nidempotency-key: half-1\r\n\
         authorization: Bearer alice\r\ncontent-type: application/json\r\n\
         content-length: 1000\r\n\r\n{{\"sku\":",
        gateway.addr
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    // The gateway reads what came, then the client is gone.
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(stream);
    let whole = post(gateway.addr, "/orders", "half-1").await;
    assert_eq!(whole.status, StatusCode::CREATED, "{:?}", whole.code());
    assert!(!whole.replayed());
    assert_eq!(upstream.runs(), 1, "only the whole request ran");
}

/// A client that leaves while its reservation is on its way to the store
/// (Redis paused): the handler never starts, and the reservation the store
/// applies once it answers again is freed, so the retry runs instead of
/// meeting 409 for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_the_reservation_leaves_the_key_free() {
    let Some(redis) = idem_tests::redis_server::RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let url = redis.url();
    let gateway = start_gateway(
        &server,
        &["--store", &url, "--store-timeout", "5s", "--lease", "30s"],
    )
    .await;
    // A connection to Redis is made while it answers.
    assert_eq!(
        post(gateway.addr, "/orders", "warm-1").await.status,
        StatusCode::CREATED
    );
    redis.pause();
    let leaving = tokio::spawn(post(gateway.addr, "/orders", "gone-1"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    leaving.abort();
    let _ = leaving.await;
    redis.resume();
    let retry = poll_until(
        Duration::from_secs(15),
        async || post(gateway.addr, "/orders", "gone-1").await,
        |reply| reply.status != StatusCode::CONFLICT,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code());
    assert!(!retry.replayed());
    assert_eq!(upstream.runs(), 2, "warm-1 and the retry of gone-1, once");
}

/// An upstream's own 502 or 504 (from a proxy in front of it, which may
/// have passed the request on) is an unknown outcome, never a release: the
/// retry meets the kept key (409), and the upstream ran once. Its 500 and
/// 503 still release (`gateway.rs`: `*_outcomes_and_tenants`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_own_502_or_504_keeps_the_key() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    for (code, status) in [
        ("502", StatusCode::BAD_GATEWAY),
        ("504", StatusCode::GATEWAY_TIMEOUT),
    ] {
        let path = format!("/status/{code}");
        let key = format!("unknown-{code}");
        assert_eq!(post(gateway.addr, &path, &key).await.status, status);
        let retry = post(gateway.addr, &path, &key).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{code}: kept");
        assert_eq!(retry.code().as_deref(), Some("idempotency_in_progress"));
    }
    assert_eq!(upstream.runs(), 2, "each ran once");
}

/// A caller named twice (the tenant header or `Authorization` repeated,
/// as a proxy that appends would send it) is not identified: `401`, never
/// the first value's tenant (whose stored answer it would replay, or whose
/// key it would run again) nor the anonymous one; the records API refuses
/// it too; the upstream never runs for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_named_twice_is_not_identified() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let http = client();
    for (n, (flags, header, victim, attacker)) in [
        (
            &["--tenant-header", "x-account"][..],
            "x-account",
            "victim",
            "attacker",
        ),
        (&[][..], "authorization", "Bearer alice", "Bearer mallory"),
        (
            &["--allow-anonymous"][..],
            "authorization",
            "Bearer bob",
            "Bearer eve",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let gateway = start_gateway(&server, flags).await;
        let key = format!("pay-{n}");
        let keyed = |values: &[&str]| {
            let mut request = Request::post(format!("http://{}/orders", gateway.addr))
                .header("idempotency-key", key.as_str())
                .header("content-type", "application/json");
            for value in values {
                request = request.header(header, *value);
            }
            request
                .body(Full::new(Bytes::from_static(b"{\"amount\":100}")))
                .expect("request")
        };
        let first = send(&http, keyed(&[victim])).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let runs = upstream.runs();
        for values in [[victim, attacker], [attacker, victim]] {
            let twice = send(&http, keyed(&values)).await;
            assert_eq!(
                twice.status,
                StatusCode::UNAUTHORIZED,
                "{values:?}: {twice:?}"
            );
            assert_eq!(
                twice.code().as_deref(),
                Some("idempotency_tenant_missing"),
                "{values:?}"
            );
            assert!(!twice.replayed());
        }
        assert_eq!(upstream.runs(), runs, "never run for a caller named twice");
        let mut records = Request::get(format!(
            "http://{}/_idempotency/records?method=POST&path=/orders&key={key}",
            gateway.addr
        ));
        for value in [victim, attacker] {
            records = records.header(header, value);
        }
        let read = send(
            &http,
            records.body(Full::new(Bytes::new())).expect("request"),
        )
        .await;
        assert_eq!(read.status, StatusCode::UNAUTHORIZED, "{read:?}");
    }
}

/// An upstream that refuses a request before it runs says so with
/// `idem-nothing-ran`: the key is released and nothing stored, so the
/// retry runs; the caller never sees the marker. An unmarked 4xx stays an
/// outcome (stored and replayed: `gateway.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_says_nothing_ran_releases_the_key() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &[]).await;
    for n in 1..=2 {
        let refused = post(gateway.addr, "/nothing-ran", "unvalidated-1").await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(!refused.replayed(), "attempt {n}");
        assert!(!refused.headers.contains_key("idem-nothing-ran"));
    }
    assert_eq!(upstream.runs(), 2, "the retry ran: nothing was stored");
}

/// For clients that read a should-retry header rather than `Retry-After`
/// (`--should-retry-header`): `true` on an answer a retry may cure (in
/// progress, the upstream unreachable), `false` on one it never will (a
/// conflict, a path of the gateway's). Every retryable refusal of the
/// gateway's carries `Retry-After`; without the flag there is no header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_should_retry_header_tells_sdks_what_retrying_can_do() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &["--should-retry-header", "Stripe-Should-Retry"]).await;
    let held = tokio::spawn(post(gateway.addr, "/slow", "retry-1"));
    upstream.wait_runs(1).await;
    let in_progress = post(gateway.addr, "/slow", "retry-1").await;
    assert_eq!(in_progress.status, StatusCode::CONFLICT);
    assert_eq!(in_progress.header("stripe-should-retry"), Some("true"));
    assert!(in_progress.header("retry-after").is_some());
    upstream.gate.add_permits(1);
    assert_eq!(held.await.expect("join").status, StatusCode::CREATED);
    let conflict = send(
        &client(),
        Request::post(format!("http://{}/slow", gateway.addr))
            .header("idempotency-key", "retry-1")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"other\":true}")))
            .expect("request"),
    )
    .await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.header("stripe-should-retry"), Some("false"));
    let reserved = post(gateway.addr, "/_idempotency/nothing", "retry-2").await;
    assert_eq!(reserved.header("stripe-should-retry"), Some("false"));

    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        listener.local_addr().expect("addr")
    };
    let unreachable = start(idem_tests::gateway_config(
        closed,
        &["--should-retry-header", "x-should-retry"],
    ))
    .await;
    let refused = post(unreachable, "/orders", "retry-3").await;
    assert_eq!(refused.status, StatusCode::BAD_GATEWAY);
    assert_eq!(refused.header("x-should-retry"), Some("true"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    let plain = start(idem_tests::gateway_config(closed, &[])).await;
    let refused = post(plain, "/orders", "retry-4").await;
    assert_eq!(refused.header("x-should-retry"), None);
    assert_eq!(refused.header("retry-after"), Some("1"));
}

/// With `--problem-error-member`, refusals (the layer's and the gateway's
/// own) also carry the `error` member common SDKs read, beside the RFC
/// 9457 members; without it, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_can_carry_the_error_member_sdks_read() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&server, &["--problem-error-member"]).await;
    let plain = start_gateway(&server, &[]).await;
    assert_eq!(
        post(gateway.addr, "/orders", "sdk-1").await.status,
        StatusCode::CREATED
    );
    let conflict = send(
        &client(),
        keyed(
            gateway.addr,
            Method::POST,
            "/orders",
            "sdk-1",
            "{\"other\":1}",
        ),
    )
    .await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    let body: serde_json::Value = serde_json::from_slice(&conflict.body).expect("json");
    assert_eq!(body["code"], "idempotency_conflict", "{body}");
    assert_eq!(body["error"]["type"], "idempotency_error");
    assert_eq!(body["error"]["code"], "idempotency_conflict");
    assert_eq!(body["error"]["message"], body["detail"]);
    let reserved = post(gateway.addr, "/_idempotency/nothing", "sdk-2").await;
    let body: serde_json::Value = serde_json::from_slice(&reserved.body).expect("json");
    assert_eq!(body["error"]["code"], "gateway_path_reserved", "{body}");
    let without = post(plain.addr, "/_idempotency/nothing", "sdk-3").await;
    let body: serde_json::Value = serde_json::from_slice(&without.body).expect("json");
    assert!(body.get("error").is_none(), "{body}");
}

/// A keyed gRPC call's `grpc-timeout` never reaches the upstream, however
/// it is spelled (one the gateway cannot read included): the upstream gets
/// the gateway's own bound. And a keyed event stream marked "nothing ran"
/// releases its key, the marker never reaching the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_deadline_and_the_nothing_ran_marker_never_pass_through() {
    let timeouts = Arc::new(std::sync::Mutex::new(Vec::<Option<String>>::new()));
    let streams = Arc::new(AtomicUsize::new(0));
    let (seen, ran) = (Arc::clone(&timeouts), Arc::clone(&streams));
    let app = axum::Router::new()
        .route(
            "/payments.v1.Payments/Charge",
            axum::routing::post(move |headers: http::HeaderMap| {
                let seen = Arc::clone(&seen);
                async move {
                    let timeout = headers
                        .get("grpc-timeout")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    seen.lock().expect("seen").push(timeout);
                    (
                        [("content-type", "application/grpc"), ("grpc-status", "0")],
                        "",
                    )
                }
            }),
        )
        .route(
            "/events",
            axum::routing::post(move || {
                ran.fetch_add(1, Ordering::SeqCst);
                async {
                    (
                        [
                            ("content-type", "text/event-stream"),
                            ("idem-nothing-ran", "1"),
                        ],
                        "data: refused\n\n",
                    )
                }
            }),
        );
    let server = TestServer::start(app).await;
    let gateway = start_gateway(&server, &["--upstream-timeout", "7s"]).await;
    for (n, deadline) in ["+1S", "1S", "1.5S", "100000000m"].into_iter().enumerate() {
        let request = Request::post(format!(
            "http://{}/payments.v1.Payments/Charge",
            gateway.addr
        ))
        .header("content-type", "application/grpc")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", format!("deadline-{n}"))
        .header("grpc-timeout", deadline)
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\x01x")))
        .expect("request");
        let _ = send(&client(), request).await;
    }
    let seen = timeouts.lock().expect("seen").clone();
    assert_eq!(seen.len(), 4, "{seen:?}");
    for timeout in seen {
        assert_eq!(timeout.as_deref(), Some("7000m"), "the gateway's own bound");
    }
    for _ in 0..2 {
        let events = post(gateway.addr, "/events", "events-1").await;
        assert!(!events.headers.contains_key("idem-nothing-ran"));
        assert!(!events.replayed());
    }
    assert_eq!(streams.load(Ordering::SeqCst), 2, "released: the retry ran");
}

/// An upstream whose handler takes its body through `idem_layer::Validated`
/// marks a body that does not parse as "nothing ran" on the wire: the
/// gateway in front of it releases the key and stores nothing, the client
/// never sees the marker, and the corrected retry with the same key runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_validated_rejection_leaves_the_key_to_the_corrected_retry() {
    use axum::Json;
    use idem_layer::Validated;
    let runs = Arc::new(AtomicUsize::new(0));
    let ran = Arc::clone(&runs);
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(
            move |Validated(Json(order)): Validated<Json<serde_json::Value>>| {
                let ran = Arc::clone(&ran);
                async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, Json(order))
                }
            },
        ),
    );
    let server = TestServer::start(app).await;
    let gateway = start_gateway(&server, &[]).await;
    let order =
        |body: &'static str| keyed(gateway.addr, Method::POST, "/orders", "validated-1", body);
    let malformed = send(&client(), order("{\"sku\":")).await;
    assert!(malformed.status.is_client_error(), "{malformed:?}");
    assert_eq!(malformed.header("idem-nothing-ran"), None);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let corrected = send(&client(), order("{\"sku\":\"book\"}")).await;
    assert_eq!(corrected.status, StatusCode::CREATED, "{corrected:?}");
    assert!(!corrected.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let again = send(&client(), order("{\"sku\":\"book\"}")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An upstream answer that states a length beside `Transfer-Encoding:
/// chunked` is framed by its chunks (RFC 9112, 6.3): the client gets the
/// whole body with a length that matches it, its connection stays in step
/// (the next answer on it starts where this body ends), and the replay is
/// the same bytes. The gateway kept the upstream's `Content-Length: 3` and
/// sent five bytes, so the client read `hel` and took `lo` for the start
/// of its next answer; an unkeyed request got `hel` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_a_length_and_chunks_is_framed_by_its_chunks() {
    let (upstream, count) = raw_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let gateway = start(idem_tests::gateway_config(upstream, &[])).await;
    // Two requests on one connection: the keyed POST, then one without a
    // key (passed straight through).
    let keyed = "POST /orders HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer alice\r\n\
                 Idempotency-Key: framed-1\r\nContent-Type: application/json\r\n\
                 Content-Length: 2\r\n\r\n{}";
    let unkeyed = "POST /orders HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\
                   Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let mut stream = tokio::net::TcpStream::connect(gateway)
        .await
        .expect("connect");
    stream
        .write_all(format!("{keyed}{unkeyed}").as_bytes())
        .await
        .expect("write");
    let mut wire = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut wire))
        .await
        .expect("both answers within 20 s")
        .expect("read");
    let wire = String::from_utf8_lossy(&wire).into_owned();
    // The keyed answer: its head, then exactly as many bytes as it says.
    let (head, after) = wire.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 201"), "{wire:?}");
    let length = header_in(head, "content-length").expect("a length");
    assert_eq!(length, "5", "{wire:?}");
    assert_eq!(&after[..5], "hello", "{wire:?}");
    // The next answer starts right after it; passed through, it streams
    // in chunks (or states its length).
    let (head, after) = after[5..].split_once("\r\n\r\n").expect("a second head");
    assert!(head.starts_with("HTTP/1.1 201"), "{wire:?}");
    let rest = match header_in(head, "content-length") {
        Some(length) => {
            assert_eq!(length, "5", "{wire:?}");
            assert_eq!(&after[..5], "hello", "{wire:?}");
            &after[5..]
        }
        None => {
            assert_eq!(
                header_in(head, "transfer-encoding"),
                Some("chunked".to_owned())
            );
            after
                .strip_prefix("5\r\nhello\r\n0\r\n\r\n")
                .unwrap_or_else(|| panic!("the whole body in chunks: {wire:?}"))
        }
    };
    assert_eq!(rest, "", "nothing after the two answers: {wire:?}");
    let replay = post(gateway, "/orders", "framed-1").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(&replay.body[..], b"hello");
    assert_eq!(replay.header("content-length"), Some("5"));
    assert_eq!(count.load(Ordering::SeqCst), 2, "each POST once");
}

/// The value of the header `name` in a raw answer's `head`, trimmed.
fn header_in(head: &str, name: &str) -> Option<String> {
    head.lines().skip(1).find_map(|line| {
        let (field, value) = line.split_once(':')?;
        field
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_owned())
    })
}
