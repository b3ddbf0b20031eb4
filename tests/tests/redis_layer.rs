//! The layer on a real redis-server: round trips, concurrency across two
//! store instances, and faults (paused, killed, scripts flushed, a lease
//! taken over while its owner still runs).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    Completion, Current, LateEvidence, Reservation, ReserveRequest, Store,
    conformance::{fingerprint, fresh_scope, response},
};
use idem_layer::{IdempotencyLayer, InFlight, TenantFromHeader};
use idem_redis::RedisStore;
use idem_tests::{
    lapsed_and_taken_over, poll_until,
    redis_server::{RedisServer, calls_between},
    wait_until,
};
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// An app whose `/orders` counts executions and `/slow` waits for a permit.
struct App {
    router: Router,
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    layer: IdempotencyLayer<RedisStore>,
}

impl App {
    /// Sends `/slow` under `key` in a task of its own and waits, within
    /// `within`, until its handler has run it: the one run after those
    /// so far.
    async fn slow_running(
        &self,
        key: &'static str,
        within: Duration,
    ) -> tokio::task::JoinHandle<Reply> {
        let before = self.runs.load(Ordering::SeqCst);
        let router = self.router.clone();
        let task = tokio::spawn(async move { call(&router, "/slow", key, "{}").await });
        wait_until(within, "the slow request to run", async || {
            self.runs.load(Ordering::SeqCst) == before + 1
        })
        .await;
        task
    }
}

fn app(store: RedisStore) -> App {
    app_with(store, InFlight::Reject)
}

fn app_with(store: RedisStore, in_flight: InFlight) -> App {
    app_of(IdempotencyLayer::new(store).timing(|t| {
        t.store_timeout(Duration::from_millis(300))
            .in_flight(in_flight)
    }))
}

fn app_of(layer: IdempotencyLayer<RedisStore>) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let layer = layer.tenant(TenantFromHeader::new(http::HeaderName::from_static(
        "x-tenant-id",
    )));
    let (r1, r2, g) = (Arc::clone(&runs), Arc::clone(&runs), Arc::clone(&gate));
    let (r3, g3) = (Arc::clone(&runs), Arc::clone(&gate));
    let router = Router::new()
        .route(
            "/orders",
            post(move || {
                let n = r1.fetch_add(1, Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("order {n}")) }
            }),
        )
        .route(
            "/slow",
            post(move || {
                let (runs, gate) = (Arc::clone(&r2), Arc::clone(&g));
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    if let Ok(permit) = gate.acquire().await {
                        permit.forget();
                    }
                    (StatusCode::CREATED, format!("slow {n}"))
                }
            }),
        )
        .route(
            "/unavailable",
            post(move || {
                let (runs, gate) = (Arc::clone(&r3), Arc::clone(&g3));
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    if let Ok(permit) = gate.acquire().await {
                        permit.forget();
                    }
                    (StatusCode::SERVICE_UNAVAILABLE, "try again")
                }
            }),
        )
        .layer(layer.clone());
    App {
        router,
        runs,
        gate,
        layer,
    }
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    code: Option<String>,
    body: Bytes,
}

async fn call(router: &Router, path: &str, key: &str, body: &'static str) -> Reply {
    let request = Request::post(path)
        .header("idempotency-key", key)
        .header("x-tenant-id", "acme")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .expect("request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
    Reply {
        status,
        replayed,
        code,
        body,
    }
}

/// Commands the scripts run inside Redis; `INFO commandstats` counts them
/// too, but they cost no round trip.
const INSIDE_SCRIPTS: &[&str] = &[
    "hmget",
    "hdel",
    "hget",
    "hset",
    "time",
    "pexpireat",
    "pexpire",
    "del",
    "hexists",
    "hgetall",
    "publish",
    "set",
    "get",
];

/// Client round trips since `before` (every command but INFO and those run
/// inside scripts), and how many of them were EVALSHA.
fn round_trips_since(
    server: &RedisServer,
    before: &std::collections::HashMap<String, (u64, f64)>,
) -> (u64, u64) {
    let after = server.command_stats();
    let delta = |name: &str| calls_between(before, &after, name);
    let total = after
        .keys()
        .filter(|name| *name != "info" && !INSIDE_SCRIPTS.contains(&name.as_str()))
        .map(|name| delta(name))
        .sum();
    (total, delta("evalsha"))
}

/// Whether a record carries the waited-on mark (run with `EVAL`).
const MARKED: &str = "for _, k in ipairs(redis.call('KEYS', 'idem:*')) do \
    local kind = redis.call('TYPE', k).ok \
    if kind == 'hash' and redis.call('HGET', k, 'w') then return 1 end \
    if kind == 'string' and string.sub(redis.call('GET', k), 1, 2) == '3a' then return 1 end \
    end return 0";

/// Completions and releases of records nobody waits on publish nothing:
/// a `PUBLISH` per outcome would cost Redis a command for every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_nobody_waits_on_publish_nothing() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&server.url()).expect("store");
    let app = app_with(store, InFlight::Wait(Duration::from_secs(60)));
    let before = server.command_stats();
    for key in ["a", "b", "c"] {
        assert_eq!(
            call(&app.router, "/orders", key, "{}").await.status,
            StatusCode::CREATED
        );
    }
    assert!(call(&app.router, "/orders", "a", "{}").await.replayed);
    let end = server.command_stats();
    assert!(calls_between(&before, &end, "evalsha") > 0);
    assert_eq!(calls_between(&before, &end, "publish"), 0);
    assert_eq!(server.cli(&["EVAL", MARKED, "0"]).trim(), "0");
}

/// A duplicate waiting for a running request costs Redis no command while
/// it waits: it subscribes to the record's channel, reads its state once,
/// and is woken by the completing script's notification. (Polling every
/// 25 ms would spend about twenty reservations in the half second the
/// test watches.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_spends_no_commands_while_it_waits() {
    a_waiting_duplicate_spends_no_commands_while_it_waits_on(idem_redis::RecordFormat::V1).await;
}

/// The same with a store that packs new records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_spends_no_commands_while_it_waits_packed() {
    a_waiting_duplicate_spends_no_commands_while_it_waits_on(idem_redis::RecordFormat::V2).await;
}

/// The same with a store that keeps new records as one string (format 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_spends_no_commands_while_it_waits_string() {
    a_waiting_duplicate_spends_no_commands_while_it_waits_on(idem_redis::RecordFormat::V3).await;
}

async fn a_waiting_duplicate_spends_no_commands_while_it_waits_on(
    format: idem_redis::RecordFormat,
) {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .record_format(format)
        .build()
        .expect("store");
    let app = app_with(store, InFlight::Wait(Duration::from_secs(60)));
    // Loads the scripts, so that no NOSCRIPT retry is counted below.
    assert_eq!(
        call(&app.router, "/orders", "warm-up", "{}").await.status,
        StatusCode::CREATED
    );
    app.runs.store(0, Ordering::SeqCst);
    let first = app.slow_running("waited-on", Duration::from_secs(30)).await;

    let before = server.command_stats();
    let router = app.router.clone();
    let second = tokio::spawn(async move { call(&router, "/slow", "waited-on", "{}").await });
    // A record's channel (`idem:{…}:c`), not the erasure feed's
    // (`idem:erased`).
    wait_until(
        Duration::from_secs(30),
        "the duplicate to subscribe",
        async || {
            !server
                .cli(&["PUBSUB", "CHANNELS", "idem:{*"])
                .trim()
                .is_empty()
        },
    )
    .await;
    // Then it marks the record as waited on (and reads its state), so
    // that the completion publishes. (EVAL, not EVALSHA: not counted
    // below.)
    wait_until(
        Duration::from_secs(30),
        "the record to be marked",
        async || server.cli(&["EVAL", MARKED, "0"]).trim() == "1",
    )
    .await;
    let waiting = server.command_stats();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = server.command_stats();
    assert_eq!(
        calls_between(&waiting, &after, "evalsha"),
        0,
        "no reservation while waiting"
    );
    // No command of any kind: no polling, no keep-alive. The process's
    // one steady command is the erasure feed's heartbeat (a `PING` every
    // 500 ms on its own connection, whatever the process does, see
    // `docs/design.md` section 3): at most two in this half second.
    let mut spent = idem_tests::redis_server::commands_between(&waiting, &after);
    let pings = spent.remove("ping").unwrap_or(0);
    assert!(pings <= 2, "{pings} heartbeats in half a second");
    assert!(spent.is_empty(), "commands while waiting: {spent:?}");

    app.gate.add_permits(1);
    let first = first.await.expect("first");
    let second = second.await.expect("second");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed);
    assert_eq!(second.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    // The duplicate's whole wait: its reservation, the mark and read, its
    // reservation after the wake-up; plus the first request's completion,
    // which published because the record was marked. (A script's first
    // call answers NOSCRIPT and is sent again after a load: not counted.)
    let end = server.command_stats();
    let scripts =
        calls_between(&before, &end, "evalsha") - calls_between(&before, &end, "script|load");
    assert!(scripts <= 4, "{scripts} scripts");
    assert!(
        calls_between(&before, &end, "publish") >= 1,
        "the completion published"
    );
    wait_until(
        Duration::from_secs(30),
        "the channel to be unsubscribed",
        async || {
            server
                .cli(&["PUBSUB", "CHANNELS", "idem:{*"])
                .trim()
                .is_empty()
        },
    )
    .await;
}

/// Record format 2's round trips: each a script call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_request_and_redis_time() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let app = app(RedisStore::builder(&server.url())
        .record_format(idem_redis::RecordFormat::V2)
        .build()
        .expect("store"));
    // Warm up: connections made, scripts loaded (the read a conflict
    // makes among them).
    for lane in 0..8 {
        call(&app.router, "/orders", &format!("warm-{lane}"), "{}").await;
    }
    let warm = call(&app.router, "/orders", "warm-0", r#"{"other":1}"#).await;
    assert_eq!(warm.code.as_deref(), Some("idempotency_conflict"));

    let before = server.command_stats();
    let first = call(&app.router, "/orders", "k", r#"{"a":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        round_trips_since(&server, &before),
        (2, 2),
        "new key: reserve + complete, nothing else"
    );

    let before = server.command_stats();
    let replay = call(&app.router, "/orders", "k", r#"{"a":1}"#).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    assert_eq!(
        round_trips_since(&server, &before),
        (1, 1),
        "replay: one round trip"
    );
    // Inside the script a replay reads the record twice (its state, then
    // what it answers with) and never the clock: the record is live by
    // Redis' own expiry and the client measures the age.
    let inside = server.command_stats();
    assert_eq!(
        calls_between(&before, &inside, "time"),
        0,
        "replay: no TIME"
    );
    assert_eq!(calls_between(&before, &inside, "hget"), 1);
    assert_eq!(calls_between(&before, &inside, "hmget"), 1);
    assert_eq!(calls_between(&before, &inside, "hset"), 0);

    let before = server.command_stats();
    let conflict = call(&app.router, "/orders", "k", r#"{"a":2}"#).await;
    assert_eq!(conflict.code.as_deref(), Some("idempotency_conflict"));
    // A conflict is tried once more with the other fingerprint format
    // (the record may have been written in it), and the record it
    // collided with is read once, so that the 422 can name it: three
    // round trips, each one script.
    assert_eq!(
        round_trips_since(&server, &before),
        (3, 3),
        "conflict: two reservations and one read"
    );

    let slow = app.slow_running("s", Duration::from_secs(30)).await;
    let before = server.command_stats();
    let busy = call(&app.router, "/slow", "s", "{}").await;
    assert_eq!(busy.code.as_deref(), Some("idempotency_in_progress"));
    assert_eq!(
        round_trips_since(&server, &before),
        (1, 1),
        "in progress: one round trip"
    );
    app.gate.add_permits(1);
    assert_eq!(slow.await.expect("join").status, StatusCode::CREATED);

    // Redis time per new key: the two scripts' usec_per_call.
    let before = server.command_stats();
    for i in 0..200 {
        call(
            &app.router,
            "/orders",
            &format!("timing-{i}"),
            r#"{"sku":"book","qty":1}"#,
        )
        .await;
    }
    let after = server.command_stats();
    let (calls, usec) = after.get("evalsha").copied().unwrap_or_default();
    let (calls_before, usec_before) = before.get("evalsha").copied().unwrap_or_default();
    let total_usec = usec * calls as f64 - usec_before * calls_before as f64;
    let per_key = total_usec / 200.0;
    println!("REDIS_TIME_PER_NEW_KEY_USEC {per_key:.1}");
    for (name, (calls, usec)) in &after {
        println!("  {name}: calls {calls} usec_per_call {usec}");
    }
    assert_eq!(calls - calls_before, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_across_tasks_and_two_store_instances_execute_once() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let a = app(RedisStore::from_url(&server.url()).expect("store"));
    // A second store instance with its own pool: a second process, in
    // effect, and one that packs the records it creates (a rolling deploy
    // turning packing on).
    let b_store = RedisStore::builder(&server.url())
        .record_format(idem_redis::RecordFormat::V2)
        .build()
        .expect("store");
    let b = {
        let layer = IdempotencyLayer::new(b_store).tenant(TenantFromHeader::new(
            http::HeaderName::from_static("x-tenant-id"),
        ));
        let runs = Arc::clone(&a.runs);
        Router::new()
            .route(
                "/orders",
                post(move || {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        (StatusCode::CREATED, format!("order {n}"))
                    }
                }),
            )
            .layer(layer)
    };
    let mut tasks = Vec::new();
    for i in 0..40 {
        let router = if i % 2 == 0 {
            a.router.clone()
        } else {
            b.clone()
        };
        tasks.push(tokio::spawn(async move {
            call(&router, "/orders", "same", "{}").await
        }));
    }
    let mut created = 0;
    for task in tasks {
        let reply = task.await.expect("join");
        match reply.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert_eq!(reply.code.as_deref(), Some("idempotency_in_progress"));
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(created >= 1);
    assert_eq!(
        a.runs.load(Ordering::SeqCst),
        1,
        "exactly one execution across both instances"
    );
    // Afterwards every duplicate, from either instance, replays.
    assert!(call(&a.router, "/orders", "same", "{}").await.replayed);
    assert!(call(&b, "/orders", "same", "{}").await.replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_answers_503_within_the_timeout_and_recovers() {
    paused_redis_answers_503_within_the_timeout_and_recovers_on(idem_redis::RecordFormat::V1).await;
}

/// The same with a store that packs new records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_answers_503_within_the_timeout_and_recovers_packed() {
    paused_redis_answers_503_within_the_timeout_and_recovers_on(idem_redis::RecordFormat::V2).await;
}

/// The same with a store that keeps new records as one string (format 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_answers_503_within_the_timeout_and_recovers_string() {
    paused_redis_answers_503_within_the_timeout_and_recovers_on(idem_redis::RecordFormat::V3).await;
}

async fn paused_redis_answers_503_within_the_timeout_and_recovers_on(
    format: idem_redis::RecordFormat,
) {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .timeout(Duration::from_millis(300))
        .record_format(format)
        .build()
        .expect("store");
    let app = app(store);
    // Warm every lane (4 by default; two calls per request), so that the
    // reservation below is really sent and queued behind the paused
    // server, not stuck before a connection exists.
    for n in 0..8 {
        let warm = call(&app.router, "/orders", &format!("warm-{n}"), "{}").await;
        assert_eq!(warm.status, StatusCode::CREATED);
    }
    let runs_before = app.runs.load(Ordering::SeqCst);

    let elapsed = call_while_paused(&server, &app).await;
    // By the store's 300 ms timeout: without it the call waits for the
    // paused server for good.
    assert!(
        elapsed < Duration::from_secs(5),
        "answered after {elapsed:?}"
    );
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        runs_before,
        "the handler never ran while Redis was paused"
    );

    // A shutdown's drain waits for the store's freeing of the given-up
    // reservation: still running while the server is paused.
    assert_eq!(app.layer.drain(Duration::from_millis(200)).await, 1);
    server.resume();
    // The reservation queued during the pause lands on resume; it must not
    // hold the key for its whole 30 s lease with nobody running it: the
    // store frees it by its owner token before the drain ends, and the
    // retry runs at once.
    assert_eq!(app.layer.drain(Duration::from_secs(10)).await, 0);
    let last = call(&app.router, "/orders", "during", "{}").await;
    assert_eq!(
        last.status,
        StatusCode::CREATED,
        "the key is free again after the pause ({:?})",
        last.code
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), runs_before + 1);
    assert!(call(&app.router, "/orders", "warm-0", "{}").await.replayed);
}

/// Pauses `server` and sends the keyed request `during`, which must be
/// answered `503 idempotency_store_unavailable`; how long that took. The
/// caller resumes the server.
async fn call_while_paused(server: &RedisServer, app: &App) -> Duration {
    server.pause();
    let started = Instant::now();
    let reply = call(&app.router, "/orders", "during", "{}").await;
    let elapsed = started.elapsed();
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.code.as_deref(), Some("idempotency_store_unavailable"));
    elapsed
}

/// The layer trusts a store's own bound only within its own timeout: a
/// Redis store whose timeout is longer than the layer's still answers by
/// the layer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_timeout_holds_when_the_stores_is_longer() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("store");
    let app = app(store);
    let warm = call(&app.router, "/orders", "warm", "{}").await;
    assert_eq!(warm.status, StatusCode::CREATED);
    let elapsed = call_while_paused(&server, &app).await;
    server.resume();
    assert!(
        elapsed < Duration::from_secs(10),
        "answered after {elapsed:?}, by the store's 30 s bound instead of the layer's 300 ms"
    );
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        1,
        "nothing ran while paused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_redis_is_reconnected_and_scripts_reloaded() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(mut server) = RedisServer::spawn() else {
        return;
    };
    let app = app(RedisStore::from_url(&server.url()).expect("store"));
    assert_eq!(
        call(&app.router, "/orders", "a", "{}").await.status,
        StatusCode::CREATED
    );
    server.kill();
    let down = call(&app.router, "/orders", "b", "{}").await;
    assert_eq!(down.code.as_deref(), Some("idempotency_store_unavailable"));
    server.restart();
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..50 {
        status = call(&app.router, "/orders", "b", "{}").await.status;
        if status == StatusCode::CREATED {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        status,
        StatusCode::CREATED,
        "new connection, scripts loaded again"
    );
    let replay = call(&app.router, "/orders", "b", "{}").await;
    assert!(replay.replayed, "{:?} {:?}", replay.status, replay.code);
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        2,
        "no request ran while Redis was down"
    );
}

/// A request of `k` running its handler (it waits at the gate) on a
/// Redis that keeps its data across a restart (an append-only file synced
/// on every write), killed (SIGKILL) meanwhile; the layer's lease is 1 s.
/// `None` without Redis (outside CI).
async fn running_on_a_killed_redis() -> Option<(RedisServer, App, tokio::task::JoinHandle<Reply>)> {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let mut server = RedisServer::spawn_with(&["--appendonly", "yes", "--appendfsync", "always"])?;
    let store = RedisStore::from_url(&server.url()).expect("store");
    let app = app_of(IdempotencyLayer::new(store).timing(|t| {
        t.store_timeout(Duration::from_millis(300))
            .lease(Duration::from_secs(1))
    }));
    let first = app.slow_running("k", Duration::from_secs(10)).await;
    server.kill();
    Some((server, app, first))
}

/// Redis killed (SIGKILL) while a request runs, and started again with
/// its data (an append-only file synced on every write) only after the
/// request's lease lapsed: its completion failed and is held in the
/// background. The retries that come as Redis returns never take the
/// lapsed lease over: they have the held outcome tried at once and get
/// `503` until Redis takes it, then its replay. The handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_back_after_the_lease_replays_the_outcome_held_in_the_background() {
    let Some((mut server, app, first)) = running_on_a_killed_redis().await else {
        return;
    };
    app.gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        app.layer.background_tasks(),
        1,
        "recording in the background"
    );
    // However long this takes, the lease (1 s, no renewal landing) has
    // lapsed after it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.restart();
    // A retry that ran the handler would not wait at the gate.
    app.gate.add_permits(1);
    let retry = poll_until(
        Duration::from_secs(10),
        async || call(&app.router, "/slow", "k", "{}").await,
        |reply| reply.status != StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code);
    assert!(retry.replayed, "a replay, not a takeover");
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// A temporary failure (503) answered while Redis is down (SIGKILL): the
/// release fails and is kept and retried. Once Redis is back with its
/// data, the client's retry (it was told it may retry) reaching this layer
/// has the release tried at once and runs the handler again, instead of
/// meeting `409` for the rest of the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_failed_is_retried_and_the_retry_runs() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(mut server) =
        RedisServer::spawn_with(&["--appendonly", "yes", "--appendfsync", "always"])
    else {
        return;
    };
    let app = app_of(
        IdempotencyLayer::new(RedisStore::from_url(&server.url()).expect("store")).timing(|t| {
            t.store_timeout(Duration::from_millis(300))
                .lease(Duration::from_secs(30))
        }),
    );
    let router = app.router.clone();
    let first = tokio::spawn(async move { call(&router, "/unavailable", "k", "{}").await });
    poll_until(
        Duration::from_secs(10),
        async || app.runs.load(Ordering::SeqCst),
        |runs| *runs == 1,
    )
    .await;
    server.kill();
    app.gate.add_permits(2);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.code, None, "the handler's own answer");
    assert_eq!(app.layer.background_tasks(), 1, "the release is retried");
    server.restart();
    let retry = poll_until(
        Duration::from_secs(20),
        async || call(&app.router, "/unavailable", "k", "{}").await,
        |reply| reply.code.as_deref() != Some("idempotency_store_unavailable"),
    )
    .await;
    assert_eq!(
        retry.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        retry.code
    );
    assert_eq!(retry.code, None, "the handler ran again, not a 409");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// Two layers on one Redis (an append-only file synced on every write),
/// lease 4 s. Layer A's handler answers while Redis is down (SIGKILL) and
/// Redis stays down past the lease: A holds the outcome. The first retry,
/// sent to layer B as Redis comes back, must not take the lapsed lease
/// over (the handler ran, A holds its answer): a lease counts as running
/// until a lease after Redis started, A records its outcome meanwhile, and
/// B replays it. B's handler never runs (it ran as attempt 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_layer_after_a_restart_replays_the_outcome_the_first_held() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let Some(mut server) =
        RedisServer::spawn_with(&["--appendonly", "yes", "--appendfsync", "always"])
    else {
        return;
    };
    // A has at least the lease less a second (Redis' uptime comes in
    // whole seconds) after the restart to record its outcome: 3 s, room
    // for a loaded machine to get A's next try in.
    let lease = Duration::from_secs(4);
    let layer = |server: &RedisServer| {
        IdempotencyLayer::new(RedisStore::from_url(&server.url()).expect("store"))
            .timing(|t| t.store_timeout(Duration::from_millis(300)).lease(lease))
    };
    let (a, b) = (app_of(layer(&server)), app_of(layer(&server)));
    b.gate.add_permits(10);
    let first = a.slow_running("k", Duration::from_secs(10)).await;
    server.kill();
    a.gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(a.layer.background_tasks(), 1, "A holds the outcome");
    // However long this takes, the lease has lapsed after it.
    tokio::time::sleep(lease + Duration::from_millis(1500)).await;
    server.restart();
    let retry = poll_until(
        Duration::from_secs(20),
        async || call(&b.router, "/slow", "k", "{}").await,
        |reply| {
            !matches!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
            )
        },
    )
    .await;
    assert_eq!(b.runs.load(Ordering::SeqCst), 0, "B never ran the handler");
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code);
    assert!(retry.replayed, "a replay of A's outcome");
    assert_eq!(retry.body, first.body);
    assert_eq!(a.runs.load(Ordering::SeqCst), 1);
}

/// Redis killed (SIGKILL) while a request runs, and started again with
/// its data only after the request's lease lapsed, the handler still
/// running: a retry is answered in progress, never let take the lapsed
/// lease over and run beside it; once the handler ends, its outcome is
/// replayed. The handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_back_while_the_handler_runs_past_its_lease_never_runs_it_twice() {
    let Some((mut server, app, first)) = running_on_a_killed_redis().await else {
        return;
    };
    // However long this takes, the lease (1 s, no renewal landing) has
    // lapsed after it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.restart();
    // A retry that ran the handler would wait at the gate: bounded, so
    // that it fails instead.
    let retry = poll_until(
        Duration::from_secs(10),
        async || {
            tokio::time::timeout(
                Duration::from_secs(10),
                call(&app.router, "/slow", "k", "{}"),
            )
            .await
            .expect("answered without running the handler")
        },
        |reply| reply.status != StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.code.as_deref(), Some("idempotency_in_progress"));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "not run beside it");
    app.gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = call(&app.router, "/slow", "k", "{}").await;
    assert!(replay.replayed, "{:?} {:?}", replay.status, replay.code);
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[tokio::test]
async fn script_flush_between_calls_is_survived() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let app = app(RedisStore::from_url(&server.url()).expect("store"));
    assert_eq!(
        call(&app.router, "/orders", "k", "{}").await.status,
        StatusCode::CREATED
    );
    assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    assert!(call(&app.router, "/orders", "k", "{}").await.replayed);
    assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    assert_eq!(
        call(&app.router, "/orders", "k2", "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// The first owner is still running when its lease lapses and a second
/// attempt takes over: the first one's completion is fenced and kept as
/// evidence, and the record holds the second one's result.
#[tokio::test]
async fn lease_taken_over_while_the_first_owner_runs() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&server.url()).expect("store");
    let scope = fresh_scope("takeover");
    let request = ReserveRequest {
        scope,
        fingerprint: fingerprint(7),
        lease: Duration::from_millis(300),
        retention: Duration::from_secs(30),
    };
    let (first, second, superseded) = lapsed_and_taken_over(&store, &request).await;
    assert_eq!(superseded.id, first.attempt);
    assert_eq!(second.generation, 2);
    assert_eq!(
        store
            .complete(&second, &response(201, b"second"))
            .await
            .expect("complete"),
        Completion::Recorded
    );
    match store
        .complete(&first, &response(201, b"first"))
        .await
        .expect("complete")
    {
        Completion::Fenced(Current::Completed(replay)) => {
            assert_eq!(replay.outcome, response(201, b"second"));
        }
        other => panic!("expected Fenced(Completed), got {other:?}"),
    }
    let record = store
        .get(request.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.outcome, Some(response(201, b"second")));
    assert!(matches!(
        record.attempt(first.attempt).expect("first attempt").late,
        Some(LateEvidence::Completed { status: 201, .. })
    ));
    // Stored binary-safe, readable as a record.
    assert_eq!(&*record.tenant, request.scope.tenant());
}

#[tokio::test]
async fn wait_for_replicas_refuses_a_reservation_no_replica_has() {
    let Some(primary) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&primary.url())
        .wait_for_replicas(1, Duration::from_millis(100))
        .build()
        .expect("store");
    let request = ReserveRequest {
        scope: fresh_scope("durable"),
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(5),
        retention: Duration::from_secs(30),
    };
    // No replica: the reservation is refused and released. The store
    // answered: the error is no outage, so fail-open never covers it.
    assert!(matches!(
        store.reserve(&request).await,
        Err(idem_core::StoreError::Refused(_))
    ));
    let record = store
        .get(request.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.state, idem_core::RecordState::Released);

    // With a replica attached and online, it goes through.
    let port = primary.port.to_string();
    let Some(_replica) = RedisServer::spawn_with(&["--replicaof", "127.0.0.1", &port]) else {
        return;
    };
    wait_until(
        Duration::from_secs(10),
        "the replica to come online",
        async || {
            primary
                .cli(&["INFO", "replication"])
                .contains("state=online")
        },
    )
    .await;
    let store = RedisStore::builder(&primary.url())
        .wait_for_replicas(1, Duration::from_secs(2))
        .build()
        .expect("store");
    let request = ReserveRequest {
        scope: fresh_scope("durable-2"),
        ..request
    };
    assert!(matches!(
        store.reserve(&request).await.expect("reserve"),
        Reservation::Acquired(_)
    ));
}

/// A write repeated after its reply was lost (the store retries once on a
/// broken connection) is recognised as the same write, not fenced.
#[tokio::test]
async fn repeated_writes_of_one_attempt_are_recognised() {
    use idem_redis::RecordFormat::{V1, V2, V3};
    for format in [V1, V2, V3] {
        repeated_writes_on(format).await;
    }
}

async fn repeated_writes_on(format: idem_redis::RecordFormat) {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .record_format(format)
        .build()
        .expect("store");
    let request = ReserveRequest {
        scope: fresh_scope("repeat"),
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(5),
        retention: Duration::from_secs(30),
    };
    let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve") else {
        panic!("expected Acquired");
    };
    let outcome = response(201, b"once");
    assert_eq!(
        store.complete(&lease, &outcome).await.expect("complete"),
        Completion::Recorded
    );
    assert_eq!(
        store.complete(&lease, &outcome).await.expect("complete"),
        Completion::Recorded
    );
    let record = store
        .get(request.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.attempts.len(), 1);
    assert_eq!(
        record.attempts[0].late, None,
        "a repeat is not late evidence"
    );

    let request = ReserveRequest {
        scope: fresh_scope("repeat-release"),
        ..request
    };
    let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve") else {
        panic!("expected Acquired");
    };
    assert_eq!(
        store.release(&lease).await.expect("release"),
        idem_core::Release::Released
    );
    assert_eq!(
        store.release(&lease).await.expect("release"),
        idem_core::Release::Released
    );
}

/// Record format 3's commands (the default), every one counted: a new key
/// is a native `SET` and the completion's script (its `GET` and `SET`
/// inside), a replay one native `SET` and nothing else (no script, no
/// clock), an in-progress answer a `SET` and a `PTTL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_request_on_string_records() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let app = app(RedisStore::from_url(&server.url()).expect("store"));
    // Warm up: connections made, scripts loaded (the read a conflict
    // makes among them).
    for lane in 0..8 {
        call(&app.router, "/orders", &format!("warm-{lane}"), "{}").await;
    }
    let warm = call(&app.router, "/orders", "warm-0", r#"{"other":1}"#).await;
    assert_eq!(warm.code.as_deref(), Some("idempotency_conflict"));
    let commands = |before: &std::collections::HashMap<String, (u64, f64)>| {
        let mut spent = idem_tests::redis_server::commands_between(before, &server.command_stats());
        spent.remove("info");
        spent
    };
    let map = |pairs: &[(&str, u64)]| -> std::collections::BTreeMap<String, u64> {
        pairs
            .iter()
            .map(|(name, n)| ((*name).to_owned(), *n))
            .collect()
    };

    let before = server.command_stats();
    let first = call(&app.router, "/orders", "k", r#"{"a":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        commands(&before),
        map(&[("set", 2), ("evalsha", 1), ("get", 1)]),
        "new key: a native SET, then the completion's script"
    );

    let before = server.command_stats();
    let replay = call(&app.router, "/orders", "k", r#"{"a":1}"#).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    assert_eq!(commands(&before), map(&[("set", 1)]), "replay: one SET");

    let slow = app.slow_running("s", Duration::from_secs(30)).await;
    let before = server.command_stats();
    let busy = call(&app.router, "/slow", "s", "{}").await;
    assert_eq!(busy.code.as_deref(), Some("idempotency_in_progress"));
    assert_eq!(
        commands(&before),
        map(&[("set", 1), ("pttl", 1)]),
        "in progress: the SET and the lease's remaining time"
    );
    app.gate.add_permits(1);
    assert_eq!(slow.await.expect("join").status, StatusCode::CREATED);

    // A conflict: the SET, again in the other fingerprint format (the
    // record may have been written in it), and one read of the record to
    // name it in the 422, which reads the string as it is (its clock and
    // remaining time) and writes nothing.
    let before = server.command_stats();
    let conflict = call(&app.router, "/orders", "k", r#"{"a":2}"#).await;
    assert_eq!(conflict.code.as_deref(), Some("idempotency_conflict"));
    let spent = commands(&before);
    assert_eq!(spent.get("set"), Some(&2), "{spent:?}");
    assert_eq!(spent.get("evalsha"), Some(&1), "{spent:?}");
    for write in ["hset", "del", "pexpire"] {
        assert_eq!(spent.get(write), None, "{spent:?}");
    }
    let replay = call(&app.router, "/orders", "k", r#"{"a":1}"#).await;
    assert!(replay.replayed);
}

/// A fleet-wide chore on Redis (`idem_tests::duty_is_held_by_one_holder_at_a_time`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duty_is_held_by_one_holder_at_a_time() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    idem_tests::duty_is_held_by_one_holder_at_a_time(
        RedisStore::from_url(&server.url()).expect("store"),
        RedisStore::from_url(&server.url()).expect("store"),
    )
    .await;
}

/// A release after a takeover (release.lua's path for a later attempt)
/// publishes to the record's waiters: one that marked the record before
/// the release is woken at once, not at its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_takeover_wakes_a_marked_waiter() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = Arc::new(RedisStore::from_url(&server.url()).expect("store"));
    let request = ReserveRequest {
        scope: fresh_scope("takeover-release-wakes"),
        fingerprint: fingerprint(7),
        lease: Duration::from_millis(300),
        retention: Duration::from_secs(30),
    };
    let (_, second, _) = lapsed_and_taken_over(&*store, &request).await;
    let bound = Duration::from_secs(60);
    let waiter = tokio::spawn({
        let (store, scope) = (Arc::clone(&store), *request.scope.hash());
        async move {
            let started = Instant::now();
            store.changed(&scope, bound).await;
            started.elapsed()
        }
    });
    wait_until(
        Duration::from_secs(30),
        "the waiter to mark the record",
        async || server.cli(&["EVAL", MARKED, "0"]).trim() == "1",
    )
    .await;
    let before = server.command_stats();
    assert_eq!(
        store.release(&second).await.expect("release"),
        idem_core::Release::Released
    );
    let waited = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter was woken")
        .expect("join");
    assert!(waited < Duration::from_secs(10), "woken after {waited:?}");
    let after = server.command_stats();
    assert_eq!(calls_between(&before, &after, "publish"), 1);
}

/// `keep_store_claimed` claims the store and keeps the claim alive past
/// its time to live while the layer lives (refreshed every quarter of the
/// retention, at least every second); once the layer is dropped, the
/// refreshes stop and the claim lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_keeps_its_store_claim_alive() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&server.url()).expect("store");
    let key = store.identity_key();
    let layer = IdempotencyLayer::new(store).timing(|t| {
        t.lease(Duration::from_millis(500))
            .retention(Duration::from_secs(2))
    });
    let claimed = layer.keep_store_claimed(false).await;
    assert!(
        matches!(claimed, Ok(idem_core::IdentityClaim::Held)),
        "{claimed:?}"
    );
    let ttl = || -> i64 {
        server
            .cli(&["PTTL", &key])
            .trim()
            .parse()
            .expect("PTTL answers a number")
    };
    // Two and a half claim lifetimes later, still claimed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(ttl() > 0, "the claim lapsed while the layer lived");
    drop(layer);
    wait_until(
        Duration::from_secs(10),
        "the claim to lapse once the layer is gone",
        async || ttl() == -2,
    )
    .await;
}

/// A whole answer: status, headers but `date`, body.
async fn whole(router: &Router, key: &str) -> (StatusCode, Vec<(String, Vec<u8>)>, Bytes) {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("x-tenant-id", "acme")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"a":1}"#))
        .expect("request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let mut headers: Vec<(String, Vec<u8>)> = response
        .headers()
        .iter()
        .filter(|(name, _)| *name != http::header::DATE)
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
        .collect();
    headers.sort();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, headers, body)
}

/// A storm of retries of a completed key: the first replay comes from
/// Redis, every later one from the replay cache without a command, byte
/// for byte the store's (status, every header, body); with the cache off,
/// each replay is a script call again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_storm_costs_redis_one_call_and_replays_the_stores_bytes() {
    a_replay_storm_costs_redis_one_call_on(idem_redis::RecordFormat::V2).await;
}

/// The same on record format 3 (the default), whose replay from Redis is a
/// native `SET`, not a script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_storm_costs_redis_one_command_on_string_records() {
    a_replay_storm_costs_redis_one_call_on(idem_redis::RecordFormat::V3).await;
}

async fn a_replay_storm_costs_redis_one_call_on(format: idem_redis::RecordFormat) {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = || {
        RedisStore::builder(&server.url())
            .record_format(format)
            .build()
            .expect("store")
    };
    // What a replay from Redis costs: a script call on format 2, a native
    // SET on format 3 (round trips, and how many of them were scripts).
    let strings = format == idem_redis::RecordFormat::V3;
    let replays = |n: u64| if strings { (n, 0) } else { (n, n) };
    let calls = |before: &std::collections::HashMap<String, (u64, f64)>| {
        let after = server.command_stats();
        let scripts = calls_between(before, &after, "evalsha");
        let native = if strings {
            calls_between(before, &after, "set")
        } else {
            0
        };
        (scripts + native, scripts)
    };
    let app = app(store());
    let first = call(&app.router, "/orders", "storm", r#"{"a":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let before = server.command_stats();
    let from_store = whole(&app.router, "storm").await;
    assert_eq!(calls(&before), replays(1));
    assert_eq!(from_store.2, first.body);
    let before = server.command_stats();
    let storm: Vec<_> = (0..50)
        .map(|_| {
            let router = app.router.clone();
            tokio::spawn(async move { whole(&router, "storm").await })
        })
        .collect();
    for replay in storm {
        assert_eq!(replay.await.expect("join"), from_store);
    }
    assert_eq!(round_trips_since(&server, &before), (0, 0), "no command");
    assert_eq!(calls(&before), (0, 0), "no command");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    // A changed payload still reaches Redis and conflicts.
    let conflict = call(&app.router, "/orders", "storm", r#"{"a":2}"#).await;
    assert_eq!(conflict.code.as_deref(), Some("idempotency_conflict"));

    let uncached = app_of(IdempotencyLayer::new(store()).replay_cache(0, Duration::ZERO));
    let before = server.command_stats();
    for _ in 0..3 {
        assert_eq!(whole(&uncached.router, "storm").await, from_store);
    }
    assert_eq!(calls(&before), replays(3));
}

/// Duplicates that wait together share one wait and one reservation: 40
/// duplicates of a running key (wait mode) cost Redis a few script calls
/// once it completes, not one each, and each is answered the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_share_one_reservation() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let app = app_of(
        IdempotencyLayer::new(RedisStore::from_url(&server.url()).expect("store"))
            .timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(20))))
            .replay_cache(0, Duration::ZERO),
    );
    let first = app.slow_running("together", Duration::from_secs(30)).await;
    let duplicates: Vec<_> = (0..40)
        .map(|_| {
            let router = app.router.clone();
            tokio::spawn(async move { call(&router, "/slow", "together", "{}").await })
        })
        .collect();
    wait_until(
        Duration::from_secs(30),
        "40 waiting duplicates",
        async || app.layer.duplicates_waiting() >= 40,
    )
    .await;
    let before = server.command_stats();
    app.gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    for duplicate in duplicates {
        let duplicate = duplicate.await.expect("join");
        assert!(duplicate.replayed, "{:?}", duplicate.code);
        assert_eq!(duplicate.body, first.body);
    }
    let (_, scripts) = round_trips_since(&server, &before);
    // The completion, then the one waiting reservation (and a few more
    // from duplicates whose wait woke between rounds): not 40.
    assert!(scripts <= 8, "{scripts} script calls for 40 duplicates");
}

/// The gateway's replay cache: on by default (a key's later replays cost
/// Redis nothing), sized and timed by its flags, off with
/// `--replay-cache-bytes 0` (every replay is a script call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_replay_cache_follows_its_flags() {
    use idem_tests::{TestServer, client, send, start_gateway, upstream::Upstream};
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let url = server.url();
    let secret = ["--tenant-secret", "the replay cache test's shared secret"];
    // Format 2: each replay from Redis is a script call (on format 3, the
    // default, a native SET: the replay storm tests count both).
    let format = ["--redis-record-format", "2"];
    let cached = start_gateway(
        &origin,
        &[&["--store", &url][..], &format, &secret].concat(),
    )
    .await;
    let uncached = start_gateway(
        &origin,
        &[
            &["--store", &url, "--replay-cache-bytes", "0"][..],
            &format,
            &secret,
        ]
        .concat(),
    )
    .await;
    let post = |gateway: std::net::SocketAddr| {
        Request::post(format!("http://{gateway}/orders"))
            .header("idempotency-key", "cached-1")
            .header("authorization", "Bearer alice")
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let first = send(&client(), post(cached.addr)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Replays after the first: the store's calls each gateway makes.
    for (gateway, scripts) in [(cached.addr, 1), (uncached.addr, 3)] {
        let before = server.command_stats();
        for _ in 0..3 {
            let replay = send(&client(), post(gateway)).await;
            assert!(replay.replayed());
            assert_eq!(replay.body, first.body);
        }
        let after = server.command_stats();
        assert_eq!(
            calls_between(&before, &after, "evalsha"),
            scripts,
            "{gateway}"
        );
    }
    assert_eq!(upstream.runs(), 1);
}
