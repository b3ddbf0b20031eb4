//! Hostile input at the gateway: slow-loris heads, bodies that never end,
//! oversized heads, bodies just over the limit, and 10,000 distinct keys
//! from one tenant. Bounded resources, clear errors, nothing executed twice.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{TestServer, client, send, start_gateway, upstream::Upstream};

/// What came back on a raw connection.
struct Raw {
    answer: String,
    /// From the first byte sent to the end of the read.
    elapsed: Duration,
    /// Whether the server closed the connection (EOF) before `wait`.
    closed: bool,
}

/// Sends raw bytes, then reads what comes back until EOF or `wait`.
fn raw(addr: std::net::SocketAddr, parts: &[&[u8]], pause: Duration, wait: Duration) -> Raw {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(wait)).expect("timeout");
    let started = Instant::now();
    for part in parts {
        stream.write_all(part).expect("write");
        std::thread::sleep(pause);
    }
    let mut answer = Vec::new();
    let closed = stream.read_to_end(&mut answer).is_ok();
    Raw {
        answer: String::from_utf8_lossy(&answer).into_owned(),
        elapsed: started.elapsed(),
        closed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_heads_are_cut_off() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let addr = start_gateway(&server, &["--header-timeout", "300ms"])
        .await
        .addr;
    let cut = tokio::task::spawn_blocking(move || {
        raw(
            addr,
            &[b"POST /orders HTTP/1.1\r\n", b"Host: x\r\n"],
            Duration::from_millis(50),
            Duration::from_secs(10),
        )
    })
    .await
    .expect("join");
    // hyper closes a connection whose head is late without an answer (no
    // 408): the read ends at EOF, not at its own 10 s timeout.
    assert!(
        cut.closed,
        "the connection was held for {:?}, open past the read's timeout",
        cut.elapsed
    );
    assert!(cut.answer.is_empty(), "{:?}", cut.answer);
    assert_eq!(upstream.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_body_that_never_ends_is_408() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let addr = start_gateway(&server, &["--body-timeout", "300ms"])
        .await
        .addr;
    let head = b"POST /orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: k\r\nContent-Length: 100\r\n\r\n0123456789";
    let cut = tokio::task::spawn_blocking(move || {
        raw(addr, &[head], Duration::ZERO, Duration::from_secs(10))
    })
    .await
    .expect("join");
    assert!(cut.answer.starts_with("HTTP/1.1 408"), "{:?}", cut.answer);
    assert!(cut.answer.contains("request_body_timeout"));
    // The connection is closed after the 408, not held to the read's
    // 10 s timeout.
    assert!(cut.closed, "held for {:?}", cut.elapsed);
    assert_eq!(upstream.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_heads_are_refused() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let addr = start_gateway(&server, &[]).await.addr;
    let mut head = b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n".to_vec();
    for i in 0..200 {
        head.extend_from_slice(format!("x-filler-{i}: {}\r\n", "v".repeat(32)).as_bytes());
    }
    head.extend_from_slice(b"Content-Length: 0\r\n\r\n");
    let refused = tokio::task::spawn_blocking(move || {
        raw(addr, &[&head], Duration::ZERO, Duration::from_secs(3))
    })
    .await
    .expect("join");
    assert!(
        refused.answer.starts_with("HTTP/1.1 431"),
        "{:?}",
        refused.answer
    );
    assert_eq!(upstream.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_one_byte_over_the_limit_never_executes() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let addr = start_gateway(&server, &["--max-body", "1000"]).await.addr;
    let client = client();
    let request = |len: usize, key: &str| {
        Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", key)
            .header("authorization", "Bearer a")
            .body(Full::new(Bytes::from(vec![b'x'; len])))
            .expect("request")
    };
    let over = send(&client, request(1001, "over")).await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(over.code().as_deref(), Some("request_body_too_large"));
    let at = send(&client, request(1000, "at")).await;
    assert_eq!(at.status, StatusCode::CREATED);
    assert_eq!(upstream.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_keys_from_one_tenant_stay_bounded() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    // No tenant quota: this is the capacity's bound (the quota has its
    // own test in tenants.rs).
    let addr = start_gateway(
        &server,
        &["--memory-capacity", "4000", "--memory-tenant-quota", "0"],
    )
    .await
    .addr;
    let client = client();
    let request = move |key: String| {
        Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", key)
            .header("authorization", "Bearer one-tenant")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let mut created = 0;
    let mut full = 0;
    let mut lanes = Vec::new();
    for lane in 0..8 {
        let client = client.clone();
        lanes.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in (lane..10_000).step_by(8) {
                let reply = send(&client, request(format!("key-{i}"))).await;
                statuses.push((reply.status, reply.code()));
            }
            statuses
        }));
    }
    for lane in lanes {
        for (status, code) in lane.await.expect("join") {
            match status {
                StatusCode::CREATED => created += 1,
                StatusCode::SERVICE_UNAVAILABLE => {
                    assert_eq!(code.as_deref(), Some("idempotency_store_unavailable"));
                    full += 1;
                }
                other => panic!("unexpected {other}"),
            }
        }
    }
    assert_eq!(created, 4000, "the store holds at most its capacity");
    assert_eq!(full, 6000, "the rest are refused clearly, not evicted");
    assert_eq!(
        upstream.runs(),
        4000,
        "refused keys never reached the upstream"
    );
    // Every accepted key still replays: nothing was evicted to make room.
    let mut replayed = 0;
    for i in 0..10_000 {
        let reply = send(&client, request(format!("key-{i}"))).await;
        if reply.status == StatusCode::CREATED {
            assert!(reply.replayed(), "key-{i} executed twice");
            replayed += 1;
        }
    }
    assert_eq!(replayed, 4000);
    assert_eq!(upstream.runs(), 4000);
}
