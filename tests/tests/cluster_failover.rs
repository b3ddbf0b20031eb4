//! A Redis Cluster master killed with SIGKILL under load through the
//! gateway: nothing runs twice, every request ends with one outcome that
//! replays, service comes back within the failover bound plus a margin
//! without a restart, the healthy nodes see no storm of reconnections, and
//! `/healthz` says what is served.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{Router, http::HeaderMap, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{Reply, TestServer, client, redis_server::RedisCluster, send, start_gateway};

/// Executions per key, as the upstream saw them.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    fn router(&self) -> Router {
        let ledger = self.clone();
        Router::new().route(
            "/pay",
            post(move |headers: HeaderMap| {
                let ledger = ledger.clone();
                async move {
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        // The gateway forwards the key as an sf-string.
                        .trim_matches('"')
                        .to_owned();
                    let n = {
                        let mut runs = ledger.0.lock().expect("ledger");
                        let n = runs.entry(key.clone()).or_default();
                        *n += 1;
                        *n
                    };
                    // Long enough that some payments are in flight at the kill.
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    (StatusCode::CREATED, format!("paid {key} run {n}"))
                }
            }),
        )
    }

    fn runs(&self) -> HashMap<String, usize> {
        self.0.lock().expect("ledger").clone()
    }
}

fn pay(addr: std::net::SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/pay"))
        .header("idempotency-key", key)
        .header("x-tenant", "acme")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
        .expect("request")
}

/// Sends `key` until it is answered 201, retrying the answers a client
/// retries (503, 409) and transport errors, within a minute.
async fn pay_until_done(addr: std::net::SocketAddr, key: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(60);
    let http = client();
    loop {
        if let Ok(response) = http.request(pay(addr, key)).await {
            use http_body_util::BodyExt;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let reply = Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            };
            match reply.status {
                StatusCode::CREATED => return reply,
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {}
                other => panic!("{key}: unexpected {other}: {reply:?}"),
            }
        }
        assert!(Instant::now() < deadline, "{key} never completed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn connections_received(node: &idem_tests::redis_server::RedisServer) -> u64 {
    node.cli(&["INFO", "stats"])
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_under_load_fails_over_without_a_second_execution() {
    const NODE_TIMEOUT: Duration = Duration::from_millis(2_000);
    let Some(mut cluster) = RedisCluster::spawn_with(1, 2_000) else {
        return;
    };
    let bound = idem_redis::failover_bound(NODE_TIMEOUT);
    let ledger = Ledger::default();
    let upstream = TestServer::start(ledger.router()).await;
    let url = cluster.url();
    let gateway = start_gateway(
        &upstream,
        &[
            "--store",
            &url,
            "--tenant-header",
            "x-tenant",
            "--lease",
            "10s",
            "--retention",
            "1h",
            "--store-timeout",
            "300ms",
        ],
    )
    .await;
    let addr = gateway.addr;
    let health = || async move {
        send(
            &client(),
            Request::get(format!("http://{addr}/healthz"))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
    };
    let healthy = health().await;
    assert_eq!(healthy.status, StatusCode::OK);
    assert!(
        String::from_utf8_lossy(&healthy.body).contains("16384/16384 slots served"),
        "{healthy:?}"
    );

    // Load: workers pay fresh keys back to back until told to stop.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for worker in 0..6 {
        let stop = Arc::clone(&stop);
        workers.push(tokio::spawn(async move {
            let mut paid = Vec::new();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("w{worker}-{n}");
                let reply = pay_until_done(addr, &key).await;
                paid.push((key, reply.body));
                n += 1;
            }
            paid
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let victim = cluster.a_master();
    let survivors: Vec<usize> = (0..cluster.nodes.len()).filter(|i| *i != victim).collect();
    let connections_before: Vec<u64> = survivors
        .iter()
        .map(|i| connections_received(&cluster.nodes[*i]))
        .collect();
    let killed_at = Instant::now();
    cluster.nodes[victim].kill();

    // A probe: fresh keys, one try each, every 100 ms, until twenty in a
    // row succeed; the service is back at the first of those twenty.
    let mut saw_unhealthy = false;
    let mut streak = 0;
    let mut back_at = None;
    let mut n = 0;
    while streak < 20 {
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "the service did not come back"
        );
        let reply = send(&client(), pay(addr, &format!("probe-{n}"))).await;
        n += 1;
        if reply.status == StatusCode::CREATED {
            streak += 1;
            back_at.get_or_insert(killed_at.elapsed());
        } else {
            streak = 0;
            back_at = None;
            if !saw_unhealthy {
                saw_unhealthy = health().await.status == StatusCode::SERVICE_UNAVAILABLE;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let back_at = back_at.expect("back");
    eprintln!("service back {back_at:?} after the kill (failover bound {bound:?})");
    let margin = Duration::from_secs(5);
    assert!(
        back_at <= bound + margin,
        "service back {back_at:?} after the kill; the failover bound is {bound:?} (+{margin:?})"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut paid = Vec::new();
    for worker in workers {
        paid.extend(worker.await.expect("worker"));
    }

    // Nothing ran twice: every key the upstream saw ran exactly once.
    let runs = ledger.runs();
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    // Every payment has one outcome, which its retry replays.
    assert!(paid.len() > 20, "only {} payments under load", paid.len());
    for (key, body) in &paid {
        assert_eq!(runs.get(key), Some(&1), "{key}");
        let replay = send(&client(), pay(addr, key)).await;
        assert!(replay.replayed(), "{key} did not replay: {replay:?}");
        assert_eq!(&replay.body, body, "{key} replayed other bytes");
    }
    // No reconnection storm on the healthy nodes.
    for (i, before) in survivors.iter().zip(&connections_before) {
        let made = connections_received(&cluster.nodes[*i]) - before;
        eprintln!(
            "node {} received {made} connections",
            cluster.nodes[*i].port
        );
        assert!(
            made <= 40,
            "node {} received {made} connections during the outage",
            cluster.nodes[*i].port
        );
    }
    // Health said so during the outage, and is whole again.
    assert!(saw_unhealthy, "/healthz never reported the lost slots");
    let now = idem_tests::poll_until(Duration::from_secs(20), health, |now| {
        now.status == StatusCode::OK
    })
    .await;
    assert_eq!(
        now.status,
        StatusCode::OK,
        "health never came back: {now:?}"
    );
    assert!(String::from_utf8_lossy(&now.body).contains("16384/16384"));
}
