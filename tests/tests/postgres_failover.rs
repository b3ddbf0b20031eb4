//! A PostgreSQL primary fails over while the gateway takes payments: a
//! private primary with a streaming standby, workers paying fresh keys
//! through the gateway (retrying each key until it is answered), the
//! primary stopped as a crash would (`pg_ctl -m immediate`: no checkpoint,
//! no goodbye to its clients), the standby promoted, and the gateway's
//! connections moved to it by a TCP proxy that stands in for the virtual
//! address production uses (sqlx takes one host per URL).
//!
//! With a synchronous standby (`synchronous_standby_names`) no key runs
//! twice and every payment replays its one outcome. With an asynchronous
//! one, a commit the primary acknowledged may not have reached the standby:
//! the test prints how many keys ran twice (the known limit, in numbers)
//! and asserts only that every key is answered.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{
    TestServer, client, cutter::ReplyCutter, postgres_server::PgServer, send, start_gateway,
    upstream::Upstream, wait_until,
};

/// What one failover came to.
struct Failover {
    /// Each paid key and the body of its first 201.
    paid: HashMap<String, Bytes>,
    /// How many times the upstream ran each key.
    runs: HashMap<String, usize>,
    /// From the primary's stop to the first payment sent after it and
    /// answered.
    recovery: Duration,
    /// The gateway's address, for replays.
    gateway: std::net::SocketAddr,
    /// What the gateway runs on, kept for the replays.
    _kept: (PgServer, PgServer, ReplyCutter, TestServer),
}

fn pay(gateway: std::net::SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{gateway}/payments"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer shop")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"amount\":100}")))
        .expect("request")
}

async fn fail_over(synchronous: bool) -> Option<Failover> {
    let primary = PgServer::private()?;
    let standby = primary.standby();
    if synchronous {
        primary
            .psql(
                "postgres",
                "ALTER SYSTEM SET synchronous_standby_names = 'standby'",
            )
            .expect("synchronous standby");
        primary
            .psql("postgres", "SELECT pg_reload_conf()")
            .expect("reload");
    }
    let wanted = if synchronous { "sync" } else { "async" };
    wait_until(
        Duration::from_secs(30),
        "the standby to stream",
        async || {
            primary
                .psql(
                    "postgres",
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
                )
                .is_ok_and(|state| state == wanted)
        },
    )
    .await;
    let database = primary.database();
    let proxy = ReplyCutter::start(([127, 0, 0, 1], primary.port).into()).await;
    let url = database.replace(
        &format!("127.0.0.1:{}/", primary.port),
        &format!("{}/", proxy.addr),
    );
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &["--store", &url]).await.addr;

    let paid = Arc::new(Mutex::new(HashMap::new()));
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // When each answered request was sent and answered.
    let answered = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
    let workers: Vec<_> = (0..4)
        .map(|worker| {
            let (paid, done, stop) = (Arc::clone(&paid), Arc::clone(&done), Arc::clone(&stop));
            let answered = Arc::clone(&answered);
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let key = format!("w{worker}-{n}");
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        let sent = Instant::now();
                        let reply = send(&client(), pay(gateway, &key)).await;
                        if reply.status == StatusCode::CREATED {
                            paid.lock().expect("paid").insert(key.clone(), reply.body);
                            done.fetch_add(1, Ordering::SeqCst);
                            let pair = (sent, Instant::now());
                            answered.lock().expect("answered").push(pair);
                            break;
                        }
                        assert!(
                            Instant::now() < deadline,
                            "{key} unanswered for a minute: {} {:?}",
                            reply.status,
                            reply.code()
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    n += 1;
                }
            })
        })
        .collect();
    let paid_by = async |count: usize| {
        wait_until(Duration::from_secs(60), "payments", async || {
            done.load(Ordering::SeqCst) >= count
        })
        .await;
    };
    paid_by(40).await;
    // The primary goes; the standby takes over; the address moves to it.
    primary.crash();
    let stopped = Instant::now();
    standby.promote();
    proxy.move_to(([127, 0, 0, 1], standby.port).into());
    let before = done.load(Ordering::SeqCst);
    paid_by(before + 40).await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.expect("a worker");
    }
    // The first request sent after the stop and answered.
    let first_after = answered
        .lock()
        .expect("answered")
        .iter()
        .filter(|(sent, _)| *sent >= stopped)
        .map(|(_, answered)| *answered)
        .min()
        .unwrap_or(stopped);
    let mut runs = HashMap::new();
    for seen in upstream.seen.lock().expect("seen").iter() {
        // Forwarded in its sf-string form: "w0-1".
        if let Some(key) = &seen.key {
            *runs.entry(key.trim_matches('"').to_owned()).or_insert(0) += 1;
        }
    }
    let paid = std::mem::take(&mut *paid.lock().expect("paid"));
    Some(Failover {
        paid,
        runs,
        recovery: first_after.saturating_duration_since(stopped),
        gateway,
        _kept: (primary, standby, proxy, origin),
    })
}

/// With a synchronous standby: no key ran twice, and every payment
/// replays its one outcome from the promoted standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_takes_over_with_no_key_run_twice() {
    let Some(failover) = fail_over(true).await else {
        return;
    };
    println!(
        "FAILOVER synchronous: {} payments, recovered {:?} after the primary stopped",
        failover.paid.len(),
        failover.recovery
    );
    let twice: Vec<_> = failover.runs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys run twice: {twice:?}");
    for (key, body) in &failover.paid {
        assert_eq!(failover.runs.get(key), Some(&1), "{key}");
        let replay = send(&client(), pay(failover.gateway, key)).await;
        assert_eq!(replay.status, StatusCode::CREATED, "{key}");
        assert!(replay.replayed(), "{key}");
        assert_eq!(&replay.body, body, "{key}");
    }
}

/// With an asynchronous standby the known limit: a commit the primary
/// acknowledged may be missing on the standby. A lost completion leaves
/// its record processing under the old lease (its retry answers `409`
/// until the lease lapses, then runs again as a takeover); a lost
/// reservation lets its retry run again at once. Every key is still
/// answered (a replay or `409`, never a 5xx); the figures are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_standby_takes_over_and_the_limit_is_counted() {
    let Some(failover) = fail_over(false).await else {
        return;
    };
    let twice = failover.runs.values().filter(|n| **n > 1).count();
    let (mut replayed, mut in_progress) = (0, 0);
    for key in failover.paid.keys() {
        let reply = send(&client(), pay(failover.gateway, key)).await;
        match (reply.status, reply.code().as_deref()) {
            (StatusCode::CREATED, _) if reply.replayed() => replayed += 1,
            (StatusCode::CONFLICT, Some("idempotency_in_progress")) => in_progress += 1,
            (status, code) => panic!("{key}: {status} {code:?}"),
        }
    }
    println!(
        "FAILOVER asynchronous: {} payments, {twice} run twice, {in_progress} completions \
         lost (in progress until their lease lapses, then run again), {replayed} replayed; \
         recovered {:?} after the primary stopped",
        failover.paid.len(),
        failover.recovery
    );
}
