//! Bad days on a real Redis: replies lost after the server applied the
//! write, a clock that steps back, corrupt records with fail-open, and a
//! server that could evict records.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_core::{
    Cancellation, Fingerprint, IdempotencyKey, RecordState, Reservation, ReserveRequest, Scope,
    Store,
};
use idem_redis::RedisStore;
use idem_tests::{
    TestServer, client, cutter::ReplyCutter, lapsed_and_taken_over, redis_server::RedisServer,
    reserve_and_let_lapse, send, upstream::Upstream,
};

fn request(key: &str, lease: Duration) -> ReserveRequest {
    ReserveRequest {
        scope: Scope::new(
            "tenant",
            "POST /orders",
            IdempotencyKey::parse(key.as_bytes()).expect("key"),
        ),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease,
        retention: Duration::from_secs(3600),
    }
}

/// A store through a proxy that can cut a reply, with every lane warmed so
/// the cut hits the call under test, not a connection being set up.
async fn store_behind_cutter(redis: &RedisServer) -> (RedisStore, ReplyCutter) {
    let target = format!("127.0.0.1:{}", redis.port).parse().expect("addr");
    let cutter = ReplyCutter::start(target).await;
    let store = RedisStore::builder(&format!("redis://{}", cutter.addr))
        .lanes(2)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("store");
    warm(&store).await;
    (store, cutter)
}

/// Gives every lane a connection: a cut armed while a lane has none would
/// cut the new connection's handshake instead of the call under test.
async fn warm(store: &RedisStore) {
    for n in 0..8 {
        let nothing = request(&format!("warm-{n}"), Duration::from_secs(1));
        store.get(nothing.scope.hash()).await.expect("warm-up");
    }
}

/// A takeover whose reply was lost is retried on a new connection, and the
/// retry answers `TakenOver` with the superseded attempt, as the first
/// call would have, never `Acquired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_takeover_still_reports_the_superseded_attempt() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (store, cutter) = store_behind_cutter(&redis).await;
    let short = request("lost-takeover", Duration::from_millis(200));
    let first = reserve_and_let_lapse(&store, &short).await;
    cutter.cut_next_reply();
    match store.reserve(&short).await.expect("reserve after the cut") {
        Reservation::TakenOver { lease, superseded } => {
            assert_eq!(lease.generation, 2);
            assert_eq!(superseded.id, first.attempt);
            assert_eq!(superseded.generation, 1);
        }
        other => panic!("a lost takeover reply came back as {other:?}"),
    }
    assert_eq!(cutter.cuts(), 1, "the reply was cut");
}

/// A reservation whose reply was lost (the script ran, its connection
/// died) and whose one retry was refused (the server could not be
/// reached): the caller gets an error and runs nothing, and the
/// reservation is freed by its owner token once the server can be reached
/// again, on a fresh connection, so the retry runs at once instead of
/// meeting `InProgress` for the whole lease (it gave up when the
/// connection had dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_reply_was_lost_is_freed_when_the_server_is_back() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (store, cutter) = store_behind_cutter(&redis).await;
    let long = request("lost-reservation", Duration::from_secs(60));
    // The reservation script loaded (a `NOSCRIPT` answer would be cut
    // instead of the script's).
    let _ = store
        .reserve(&request("loaded", Duration::from_secs(1)))
        .await
        .expect("reserve");
    cutter.refuse_new_connections(true);
    cutter.cut_next_reply();
    let refused = store.reserve(&long).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(cutter.cuts(), 1, "the reply was cut");
    // The script ran: the record is processing under the given-up owner.
    let direct = RedisStore::from_url(&redis.url()).expect("store");
    let record = direct
        .get(long.scope.hash())
        .await
        .expect("get")
        .expect("the reservation landed");
    assert_eq!(record.state, RecordState::Processing);
    cutter.refuse_new_connections(false);
    let retry = idem_tests::poll_until(
        Duration::from_secs(20),
        async || direct.reserve(&long).await.expect("reserve"),
        |answer| !matches!(answer, Reservation::InProgress { .. }),
    )
    .await;
    match retry {
        Reservation::Acquired(lease) => assert_eq!(lease.generation, 2),
        other => panic!("the key stayed taken: {other:?}"),
    }
}

/// A completed record whose response key is gone (evicted under
/// `allkeys-lru`, deleted) is never replayed as if whole (it was replayed
/// as an empty `201`): the retry is told the outcome was recorded without
/// its response (status kept), and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_missing_its_response_is_not_replayed_as_whole() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    for packed in [false, true] {
        let store = RedisStore::builder(&redis.url())
            .record_format(idem_tests::redis_server::format_of(packed))
            .build()
            .expect("store");
        let key = format!("evicted-{packed}");
        let request = request(&key, Duration::from_secs(30));
        let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve") else {
            panic!("a new key");
        };
        let body = vec![b'x'; 2000];
        let outcome = idem_core::Outcome::Stored(idem_core::StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: Bytes::from(body.clone()),
        });
        let _ = store.complete(&lease, &outcome).await.expect("complete");
        match store.reserve(&request).await.expect("replay") {
            Reservation::Completed(replay) => assert_eq!(replay.outcome, outcome),
            other => panic!("{other:?}"),
        }
        let keys = redis.cli(&["--scan", "--pattern", "*:r"]);
        let response_keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        assert_eq!(response_keys.len(), 1, "{keys}");
        redis.cli(&["DEL", response_keys[0]]);
        match store
            .reserve(&request)
            .await
            .expect("reserve after the loss")
        {
            Reservation::Completed(replay) => assert_eq!(
                replay.outcome,
                idem_core::Outcome::NotStored { status: 201 },
                "packed {packed}"
            ),
            other => panic!("{other:?}"),
        }
    }
}

/// A takeover whose caller gave up before its reply came (the call timed
/// out behind a paused server) is freed once the server answers, as the
/// takeover found the record: its lease lapsed, not released. The attempt
/// it superseded may have acted: a changed request still conflicts, and
/// the same request takes over. (Released, the record took any payload,
/// and the chaos soak saw a changed request run after a lost owner.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_takeover_is_not_released() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    // Format 2: the given-up call is the reserve script's takeover. (On
    // format 3 the first call is the native SET, which a record held by
    // another owner leaves as it is: see the test after these.)
    let store = RedisStore::builder(&redis.url())
        .record_format(idem_redis::RecordFormat::V2)
        .build()
        .expect("store");
    let short = request("abandoned-takeover", Duration::from_millis(200));
    reserve_and_let_lapse(&store, &short).await;
    give_up_a_reservation(&redis, &store, &short).await;
    let (lease, _) = still_bound(&store, &short).await;
    assert_eq!(lease.generation, 3);
}

/// On format 3, a reservation given up behind a paused server meets the
/// lapsed record with its native `SET`, which writes nothing there: the
/// record stays as it was, bound to its request (a changed request
/// conflicts) and taken over by the same one as the second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_reservation_of_a_lapsed_string_record_leaves_it_bound() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&redis.url())
        .record_format(idem_redis::RecordFormat::V3)
        .build()
        .expect("store");
    let short = request("abandoned-string", Duration::from_millis(200));
    reserve_and_let_lapse(&store, &short).await;
    give_up_a_reservation(&redis, &store, &short).await;
    let (lease, _) = still_bound(&store, &short).await;
    assert_eq!(lease.generation, 2);
}

/// Reserves `request` behind a paused server, gives up after 200 ms, and
/// waits until the store has freed what landed once the server is back.
async fn give_up_a_reservation(redis: &RedisServer, store: &RedisStore, request: &ReserveRequest) {
    redis.pause();
    let given_up = tokio::time::timeout(Duration::from_millis(200), store.reserve(request)).await;
    assert!(given_up.is_err(), "the reservation's caller gave up");
    redis.resume();
    tokio::time::timeout(Duration::from_secs(10), store.settled())
        .await
        .expect("the given-up reservation is freed");
}

/// The record of `request` is bound to it: a changed request conflicts,
/// and `request` takes it over (its lease and the superseded attempt).
async fn still_bound(
    store: &RedisStore,
    request: &ReserveRequest,
) -> (idem_core::Lease, idem_core::Attempt) {
    let mut changed = request.clone();
    changed.fingerprint = Fingerprint::from_bytes([9; 32]);
    let answer = store.reserve(&changed).await.expect("reserve");
    assert!(
        matches!(answer, Reservation::Conflict),
        "a changed request conflicts: {answer:?}"
    );
    match store.reserve(request).await.expect("reserve") {
        Reservation::TakenOver { lease, superseded } => (lease, superseded),
        other => panic!("the same request takes over: {other:?}"),
    }
}

/// The same for a later attempt of the chain: after a takeover's attempt
/// was released (the record stays processing, bound to its request), the
/// same request's next reservation is given up behind a paused server.
/// Freed, the record stays bound: a changed request still conflicts (the
/// first attempt may have acted), and the same request takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_reservation_after_a_released_takeover_keeps_the_binding() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    // Format 2: the given-up call is the reserve script's takeover. (On
    // format 3 the first call is the native SET, which a record held by
    // another owner leaves as it is: see the test after these.)
    let store = RedisStore::builder(&redis.url())
        .record_format(idem_redis::RecordFormat::V2)
        .build()
        .expect("store");
    let short = request("abandoned-after-release", Duration::from_millis(200));
    let (first, second, _) = lapsed_and_taken_over(&store, &short).await;
    assert_eq!(
        store.release(&second).await.expect("release"),
        idem_core::Release::Released
    );
    give_up_a_reservation(&redis, &store, &short).await;
    let record = store
        .get(short.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.generation, 3, "the given-up reservation landed");
    assert_eq!(record.state, idem_core::RecordState::Processing);
    assert_eq!(record.owner, None);
    let (lease, superseded) = still_bound(&store, &short).await;
    assert_eq!(lease.generation, 4);
    assert_eq!(superseded.id, first.attempt);
}

/// A new key's reservation, a completion and a release whose replies were
/// lost are retried on a new connection and answer as the first call would
/// have: the hot paths answer an integer and the retries a tagged table, and
/// both decode to the same outcome. The completed key then replays its
/// exact response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_hot_path_calls_answer_as_the_first_would_have() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (store, cutter) = store_behind_cutter(&redis).await;
    // Every script loaded first: a cut must lose a reply of a script that
    // ran, not a NOSCRIPT answer the store would follow with the script.
    for (n, release) in [(0, false), (1, true)] {
        let lease = match store
            .reserve(&request(&format!("load-{n}"), Duration::from_secs(30)))
            .await
        {
            Ok(Reservation::Acquired(lease)) => lease,
            other => panic!("unexpected {other:?}"),
        };
        if release {
            let released = store.release(&lease).await.expect("release");
            assert!(matches!(released, idem_core::Release::Released));
        } else {
            let outcome = idem_core::Outcome::NotStored { status: 500 };
            let completed = store.complete(&lease, &outcome).await.expect("complete");
            assert!(matches!(completed, idem_core::Completion::Recorded));
        }
    }
    warm(&store).await;
    let req = request("lost-hot-paths", Duration::from_secs(30));
    cutter.cut_next_reply();
    let lease = match store.reserve(&req).await.expect("reserve after the cut") {
        Reservation::Acquired(lease) => lease,
        other => panic!("a lost reservation reply came back as {other:?}"),
    };
    assert_eq!(lease.generation, 1);
    assert_eq!(cutter.cuts(), 1, "the reservation's reply was cut");
    let response = idem_core::StoredResponse {
        status: 201,
        headers: vec![(http::header::LOCATION, Bytes::from_static(b"/orders/7"))],
        body: Bytes::from_static(b"{\"id\":7}"),
    };
    // A broken connection replaces every lane's: refill them first.
    warm(&store).await;
    cutter.cut_next_reply();
    let completion = store
        .complete(&lease, &idem_core::Outcome::Stored(response.clone()))
        .await
        .expect("complete after the cut");
    assert!(
        matches!(completion, idem_core::Completion::Recorded),
        "a lost completion reply came back as {completion:?}"
    );
    assert_eq!(cutter.cuts(), 2, "the completion's reply was cut");
    match store.reserve(&req).await.expect("replay") {
        Reservation::Completed(replay) => {
            assert_eq!(replay.outcome, idem_core::Outcome::Stored(response));
        }
        other => panic!("the completed key answered {other:?}"),
    }

    let other = request("lost-release", Duration::from_secs(30));
    let lease = match store.reserve(&other).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("unexpected {other:?}"),
    };
    warm(&store).await;
    cutter.cut_next_reply();
    let release = store.release(&lease).await.expect("release after the cut");
    assert!(
        matches!(release, idem_core::Release::Released),
        "a lost release reply came back as {release:?}"
    );
    assert_eq!(cutter.cuts(), 3, "the release's reply was cut");
    assert!(matches!(
        store.reserve(&other).await.expect("reserve again"),
        Reservation::Acquired(lease) if lease.generation == 2
    ));
}

/// A cancel whose reply was lost is retried and still answers `Cancelled`
/// (the call did cancel), not `AlreadyCancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_cancel_reports_its_own_cancellation() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (store, cutter) = store_behind_cutter(&redis).await;
    let req = request("lost-cancel", Duration::from_secs(30));
    assert!(matches!(
        store.reserve(&req).await.expect("reserve"),
        Reservation::Acquired(_)
    ));
    // The cancel script loaded first (a cancel of an absent key): a cut
    // must lose the reply of a cancel that ran, not a NOSCRIPT answer.
    let absent = request("never-reserved", Duration::from_secs(30));
    assert!(matches!(
        store.cancel(absent.scope.hash()).await.expect("cancel"),
        Cancellation::NotFound
    ));
    cutter.cut_next_reply();
    let cancel = store.cancel(req.scope.hash()).await.expect("cancel");
    assert!(
        matches!(cancel, Cancellation::Cancelled(_)),
        "a lost cancel reply came back as {cancel:?}"
    );
    assert_eq!(cutter.cuts(), 1);
    // A second, separate cancel is told it came late.
    assert!(matches!(
        store.cancel(req.scope.hash()).await.expect("cancel"),
        Cancellation::AlreadyCancelled(_)
    ));
}

fn post(gateway: std::net::SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{gateway}/orders"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
        .expect("request")
}

/// A gateway with fail-open on `redis` (and `extra` flags), one order it
/// completed, and the Redis key of that order's record.
async fn gateway_with_one_record(
    redis: &RedisServer,
    key: &str,
    extra: &[&str],
) -> (
    Upstream,
    TestServer,
    std::net::SocketAddr,
    idem_tests::Reply,
    String,
) {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let url = redis.url();
    let flags = [&["--store", &url, "--fail-open"][..], extra].concat();
    let gateway = idem_tests::start_gateway(&server, &flags).await;
    let first = send(&client(), post(gateway.addr, key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let keys = redis.cli(&["--scan", "--pattern", "idem:{*}"]);
    assert!(keys.lines().any(|found| found.ends_with('}')), "{keys}");
    let record = redis.record_with_key(key).expect("the order's record");
    (upstream, server, gateway.addr, first, record)
}

/// The record's completion time lies ahead of Redis's clock, as after the
/// clock stepped back (failover to a node behind, NTP): the record is
/// still replayed, not refused as corrupt (which fail-open would have
/// turned into a second execution on every retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_that_steps_back_still_replays() {
    // Each record format, on a Redis of its own: 2 keeps the end in d
    // ('<status>:<stored>:<end>'), 1 in cur_end.
    for (key, format) in [("clock-2", "2"), ("clock-1", "1")] {
        let Some(redis) = RedisServer::spawn() else {
            return;
        };
        let (upstream, _server, gateway, first, record) =
            gateway_with_one_record(&redis, key, &["--redis-record-format", format]).await;
        // Move the completion (the attempt's end) an hour into Redis's future.
        let field = if format == "2" { "d" } else { "cur_end" };
        let stored = redis.cli(&["HGET", &record, field]).trim().to_owned();
        let (prefix, completed) = stored.rsplit_once(':').unwrap_or(("", &stored));
        let ahead = completed.parse::<u64>().expect("ms") + 3_600_000;
        let ahead = if prefix.is_empty() {
            ahead.to_string()
        } else {
            format!("{prefix}:{ahead}")
        };
        redis.cli(&["HSET", &record, field, &ahead]);
        for _ in 0..3 {
            let replay = send(&client(), post(gateway, key)).await;
            assert_eq!(replay.status, StatusCode::CREATED, "format {format}");
            assert!(replay.replayed());
            assert_eq!(replay.body, first.body);
        }
        assert_eq!(upstream.runs(), 1);
    }
}

/// A record the store answers with but cannot decode is a 503 even with
/// fail-open: the store answered, and the key may hold an outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_never_covers_a_corrupt_record() {
    // Each record format, on a Redis of its own: 2 keeps the status in d,
    // 1 in status.
    for (key, format, field, spoiled) in [
        ("corrupt-2", "2", "d", "not-a-number:1:1700000000000"),
        ("corrupt-1", "1", "status", "not-a-number"),
    ] {
        let Some(redis) = RedisServer::spawn() else {
            return;
        };
        let (upstream, _server, gateway, _, record) =
            gateway_with_one_record(&redis, key, &["--redis-record-format", format]).await;
        redis.cli(&["HSET", &record, field, spoiled]);
        for _ in 0..3 {
            let answer = send(&client(), post(gateway, key)).await;
            assert_eq!(
                answer.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "format {format}"
            );
            assert_eq!(
                answer.code().as_deref(),
                Some("idempotency_store_unavailable")
            );
        }
        assert_eq!(upstream.runs(), 1, "never run again unprotected");
    }
}

/// A record key that holds another type (a list someone pushed there)
/// answers a type error: the store answered, so a `--fail-open` gateway
/// answers 503 and never runs the request unprotected, on record format 3
/// (whose native `SET … GET` meets it first) as on format 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_never_covers_a_record_of_another_type() {
    for format in ["3", "2"] {
        let Some(redis) = RedisServer::spawn() else {
            return;
        };
        let key = format!("typed-{format}");
        let (upstream, _server, gateway, _, record) =
            gateway_with_one_record(&redis, &key, &["--redis-record-format", format]).await;
        redis.cli(&["DEL", &record]);
        redis.cli(&["RPUSH", &record, "not", "a", "record"]);
        for _ in 0..3 {
            let answer = send(&client(), post(gateway, &key)).await;
            assert_eq!(
                answer.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "format {format}: {answer:?}"
            );
            assert_eq!(
                answer.code().as_deref(),
                Some("idempotency_store_unavailable")
            );
        }
        assert_eq!(upstream.runs(), 1, "format {format}: never run unprotected");
        assert_eq!(
            redis.cli(&["TYPE", &record]).trim(),
            "list",
            "left as it was"
        );
    }
}

/// A Redis that answered with an error of its own (`OOM command not
/// allowed` under `noeviction`) was reached: the error is `Refused`, never
/// covered by fail-open. Through a `--fail-open` gateway, a new key is
/// not run unprotected (it was), a completed one still replays (a replay
/// only reads); a Redis that cannot be reached still fails open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_redis_answered_never_fails_open() {
    let Some(mut redis) = RedisServer::spawn() else {
        return;
    };
    let (upstream, _server, gateway, _, _) = gateway_with_one_record(&redis, "oom-1", &[]).await;
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let store = RedisStore::from_url(&redis.url()).expect("store");
    let refused = store
        .reserve(&request("oom-store", Duration::from_secs(30)))
        .await;
    assert!(
        matches!(refused, Err(idem_core::StoreError::Refused(_))),
        "{refused:?}"
    );
    // A replay only reads: Redis still answers it.
    let replay = send(&client(), post(gateway, "oom-1")).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    let answer = send(&client(), post(gateway, "oom-2")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answer.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(upstream.runs(), 1, "never run unprotected");
    redis.kill();
    let unreachable = store
        .reserve(&request("gone", Duration::from_secs(30)))
        .await;
    assert!(
        matches!(
            unreachable,
            Err(idem_core::StoreError::Unavailable(_) | idem_core::StoreError::Timeout(_))
        ),
        "{unreachable:?}"
    );
    let open = send(&client(), post(gateway, "oom-3")).await;
    assert_eq!(open.status, StatusCode::CREATED, "fail-open: Redis is down");
    assert_eq!(upstream.runs(), 2);
}

/// A Redis that can evict records is refused at start unless allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_refused_unless_allowed() {
    let Some(lru) = RedisServer::spawn_with(&["--maxmemory-policy", "allkeys-lru"]) else {
        return;
    };
    let Some(safe) = RedisServer::spawn_with(&["--appendonly", "yes"]) else {
        return;
    };
    let upstream = TestServer::start(Upstream::default().router()).await;
    let url = lru.url();
    let refused = idem_gateway::start(idem_tests::gateway_config(
        upstream.addr,
        &["--store", &url],
    ))
    .await;
    match refused {
        Err(idem_gateway::StartError::UnsafeStore(message)) => {
            assert!(message.contains("allkeys-lru"), "{message}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("an allkeys-lru Redis was accepted"),
    }
    let allowed = idem_gateway::start(idem_tests::gateway_config(
        upstream.addr,
        &["--store", &url, "--allow-redis-eviction"],
    ))
    .await;
    assert!(allowed.is_ok(), "allowed explicitly");

    let store = RedisStore::from_url(&lru.url()).expect("store");
    let safety = store.server_safety().await.expect("INFO");
    assert_eq!(safety.evicting_policies(), vec!["allkeys-lru"]);
    assert!(!safety.append_only);
    let store = RedisStore::from_url(&safe.url()).expect("store");
    let safety = store.server_safety().await.expect("INFO");
    assert!(safety.evicting_policies().is_empty());
    assert!(safety.append_only);
}

/// The record vanishes while the upstream runs (a failover lost the
/// unreplicated reservation): the completion finds no record, makes it
/// again from the outcome, and the retry replays instead of running again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_lost_under_a_running_request_is_made_again_from_its_outcome() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let url = redis.url();
    let gateway = idem_tests::start_gateway(&server, &["--store", &url]).await;
    let slow = |key: &str| {
        Request::post(format!("http://{}/slow", gateway.addr))
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let first = tokio::spawn(send(&client(), slow("lost-1")));
    upstream.wait_runs(1).await;
    let keys = redis.cli(&["--scan", "--pattern", "idem:{*}"]);
    let record = keys.lines().next().expect("one record").trim().to_owned();
    assert_eq!(redis.cli(&["DEL", &record]).trim(), "1");
    upstream.gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&client(), slow("lost-1")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(
        upstream.runs(),
        1,
        "the lost record let the action run twice"
    );
}

/// The same, when the first completion also met a store outage: the
/// background completion finds no record once Redis is back, and makes it
/// again from the outcome rather than dropping it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_completion_on_a_lost_record_makes_it_again() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let url = redis.url();
    let gateway =
        idem_tests::start_gateway(&server, &["--store", &url, "--store-timeout", "1s"]).await;
    let slow = || {
        Request::post(format!("http://{}/slow", gateway.addr))
            .header("idempotency-key", "lost-2")
            .header("authorization", "Bearer alice")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let first = tokio::spawn(send(&client(), slow()));
    upstream.wait_runs(1).await;
    let keys = redis.cli(&["--scan", "--pattern", "idem:{*}"]);
    let record = keys.lines().next().expect("one record").trim().to_owned();
    assert_eq!(redis.cli(&["DEL", &record]).trim(), "1");
    redis.pause();
    upstream.gate.add_permits(1);
    // The client gets its answer although the completion timed out.
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    redis.resume();
    // The background completion makes the record again.
    idem_tests::wait_until(
        Duration::from_secs(20),
        "the record to be made again",
        async || redis.record_state(&record) == "completed",
    )
    .await;
    let replay = send(&client(), slow()).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);
}

/// A library user gets the gateway's guard: `RedisStoreBuilder::connect`
/// refuses a server whose eviction policy can remove records (by the same
/// rule and message), accepts it when allowed, and accepts a safe one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_refuses_an_evicting_redis_unless_allowed() {
    let Some(lru) = RedisServer::spawn_with(&["--maxmemory-policy", "volatile-lru"]) else {
        return;
    };
    let Some(safe) = RedisServer::spawn_with(&["--appendonly", "yes"]) else {
        return;
    };
    match RedisStore::builder(&lru.url()).connect().await {
        Err(idem_redis::BuildError::Unsafe(message)) => {
            assert!(message.contains("volatile-lru"), "{message}");
            assert!(message.contains("allow_eviction"), "{message}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a volatile-lru Redis was accepted"),
    }
    let allowed = RedisStore::builder(&lru.url())
        .allow_eviction(true)
        .connect()
        .await
        .expect("allowed explicitly");
    allowed.ping().await.expect("usable");
    let store = RedisStore::builder(&safe.url())
        .connect()
        .await
        .expect("a safe server is accepted");
    store.ping().await.expect("usable");
    // The verdict itself: refused, allowed with a warning, safe.
    let unsafe_safety = allowed.server_safety().await.expect("INFO");
    assert!(unsafe_safety.verdict(false).is_err());
    assert_eq!(unsafe_safety.verdict(true).map(|w| w.len()), Ok(2));
    let safe_safety = store.server_safety().await.expect("INFO");
    assert_eq!(safe_safety.verdict(false), Ok(Vec::new()));
}

/// Refusals at connection time are answers of the server, never an outage:
/// a password missing (`NOAUTH`) or wrong (`WRONGPASS`) is
/// `StoreError::Refused` (the pool wrapped it, which hid its class), so a
/// layer with fail-open answers 503 and never runs the handler. (A server
/// at its client limit writes its error and closes at once: the client
/// meets a broken pipe before it can read the error, which no client can
/// tell from an outage.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_time_refusals_never_fail_open() {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };
    use tower::{Layer, ServiceExt};
    let Some(locked) = RedisServer::spawn_with(&["--requirepass", "the-password"]) else {
        return;
    };
    let port = locked.port;
    for (what, url) in [
        ("NOAUTH", format!("redis://127.0.0.1:{port}")),
        (
            "WRONGPASS",
            format!("redis://:not-the-password@127.0.0.1:{port}"),
        ),
    ] {
        let store = RedisStore::from_url(&url).expect("store");
        let refused = store
            .reserve(&request("refused", Duration::from_secs(30)))
            .await;
        assert!(
            matches!(refused, Err(idem_core::StoreError::Refused(_))),
            "{what}: {refused:?}"
        );
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let service = idem_layer::IdempotencyLayer::new(store)
            .allow_anonymous(true)
            .fail_open(true)
            .layer(tower::service_fn(move |_: Request<Full<Bytes>>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                }
            }));
        let answer = service
            .oneshot(
                Request::post("/orders")
                    .header("idempotency-key", "k-1")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("request"),
            )
            .await
            .expect("answer");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "{what}");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "{what}: never run unprotected"
        );
    }
}
