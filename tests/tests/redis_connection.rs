//! A single node's connection (`redis://`), on a real redis-server: its
//! handshake (password, user, database from the URL), replies routed to
//! their callers when many calls share the lane's one connection, replies
//! too large for one read, and a server that went away.

use std::time::Duration;

use futures_util::future::join_all;
use idem_core::{
    Outcome, Reservation, ReserveRequest, Store, StoreError, StoredResponse,
    conformance::{fingerprint, fresh_scope},
};
use idem_redis::RedisStore;
use idem_tests::{poll_until, redis_server::RedisServer};

fn request(key: &str, n: u8) -> ReserveRequest {
    ReserveRequest {
        scope: fresh_scope(key),
        fingerprint: fingerprint(n),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    }
}

fn body_of(i: usize) -> Vec<u8> {
    // Every 25th response is 3 MB: a reply far larger than one read,
    // arriving between small ones.
    let len = if i.is_multiple_of(25) {
        3 << 20
    } else {
        20 + i % 7
    };
    (0..len).map(|at| (at * 31 + i) as u8).collect()
}

fn outcome_of(i: usize) -> Outcome {
    Outcome::Stored(StoredResponse {
        status: 201,
        headers: vec![(
            http::header::LOCATION,
            bytes::Bytes::from(format!("/orders/{i}")),
        )],
        body: bytes::Bytes::from(body_of(i)),
    })
}

/// Reserves, completes and replays `n` keys, all calls of a step at once
/// over the store's one connection: each caller gets its own reply.
async fn every_caller_gets_its_own_reply(store: &RedisStore, n: usize) {
    let requests: Vec<ReserveRequest> = (0..n)
        .map(|i| request(&format!("many-{i}"), (i % 250) as u8))
        .collect();
    let reserved = join_all(requests.iter().map(|r| store.reserve(r))).await;
    let leases: Vec<_> = reserved
        .into_iter()
        .enumerate()
        .map(|(i, reservation)| match reservation {
            Ok(Reservation::Acquired(lease)) => {
                assert_eq!(lease.scope, *requests[i].scope.hash(), "call {i}");
                lease
            }
            other => panic!("call {i}: {other:?}"),
        })
        .collect();
    let outcomes: Vec<Outcome> = (0..n).map(outcome_of).collect();
    let completed = join_all(
        leases
            .iter()
            .zip(&outcomes)
            .map(|(lease, outcome)| store.complete(lease, outcome)),
    )
    .await;
    for (i, completion) in completed.into_iter().enumerate() {
        assert!(
            matches!(completion, Ok(idem_core::Completion::Recorded)),
            "complete {i}: {completion:?}"
        );
    }
    let replayed = join_all(requests.iter().map(|r| store.reserve(r))).await;
    for (i, reservation) in replayed.into_iter().enumerate() {
        match reservation {
            Ok(Reservation::Completed(replay)) => {
                assert!(replay.outcome == outcomes[i], "replay {i} is another's");
            }
            other => panic!("replay {i}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_and_large_replies_reach_their_callers() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::builder(&server.url())
        .timeout(Duration::from_secs(20))
        .build()
        .expect("store");
    every_caller_gets_its_own_reply(&store, 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_user_and_database_from_the_url_are_used() {
    let Some(server) = RedisServer::spawn_with(&["--requirepass", "s3cret"]) else {
        return;
    };
    let url = server.url();
    let port = url.rsplit(':').next().expect("a port");
    let dbsize = |db: &str| -> u64 {
        let out = server.cli(&["--no-auth-warning", "-a", "s3cret", "-n", db, "DBSIZE"]);
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("DBSIZE: {out:?}"))
    };
    for (url, db) in [
        (format!("redis://:s3cret@127.0.0.1:{port}/3"), "3"),
        (format!("redis://default:s3cret@127.0.0.1:{port}/5"), "5"),
    ] {
        let store = RedisStore::from_url(&url).expect("store");
        let reserved = store.reserve(&request("auth", 1)).await;
        assert!(
            matches!(reserved, Ok(Reservation::Acquired(_))),
            "{url}: {reserved:?}"
        );
        assert_eq!(dbsize(db), 1, "{url}: the record is in database {db}");
    }
    assert_eq!(dbsize("0"), 0, "nothing was written to database 0");

    // A wrong password: every call is refused (the server answered, so
    // fail-open never covers it), and the server keeps nothing.
    let store = RedisStore::from_url(&format!("redis://:wrong@127.0.0.1:{port}/2")).expect("store");
    for _ in 0..2 {
        let refused = store.reserve(&request("auth", 1)).await;
        assert!(
            matches!(refused, Err(StoreError::Refused(_))),
            "{refused:?}"
        );
    }
    assert_eq!(dbsize("2"), 0);
}

/// A store connected to a server, which is then killed: a reservation
/// (30 s lease) fails as unavailable, not as a timeout, since the closed
/// connection fails the call at once and so does the retry on a new one.
/// The store's timeout is far longer than that takes even on a loaded
/// machine, so a timeout means a call that hung, never a slow one.
///
/// The killed server's port is free for any process to take, and the
/// suite's other tests take free ports all the time: a listener that took
/// it before the call (one that never answers would hang the call) is not
/// the dead server this is about, so the scene is set again on a new
/// server, a few times. `None` outside CI without Redis.
async fn store_whose_server_went_away() -> Option<(RedisServer, RedisStore)> {
    for _ in 0..3 {
        let mut server = RedisServer::spawn()?;
        let store = RedisStore::builder(&server.url())
            .timeout(Duration::from_secs(20))
            .build()
            .expect("store");
        let before = store.reserve(&request("before", 1)).await;
        assert!(matches!(before, Ok(Reservation::Acquired(_))), "{before:?}");
        server.kill();
        if std::net::TcpStream::connect(("127.0.0.1", server.port)).is_ok() {
            continue;
        }
        let down = store.reserve(&request("down", 1)).await;
        assert!(matches!(down, Err(StoreError::Unavailable(_))), "{down:?}");
        return Some((server, store));
    }
    panic!("the killed server's port was taken by another listener three times in a row");
}

/// A connection whose server went away fails its calls as unavailable,
/// and the store connects again once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reconnected_to() {
    let Some((mut server, store)) = store_whose_server_went_away().await else {
        return;
    };
    server.restart();
    let after = poll_until(
        Duration::from_secs(20),
        async || store.reserve(&request("after", 1)).await,
        |after| matches!(after, Ok(Reservation::Acquired(_))),
    )
    .await;
    assert!(
        matches!(after, Ok(Reservation::Acquired(_))),
        "not reconnected: {after:?}"
    );
}

/// A reservation given up on a connection that dropped (its server was
/// killed) leaves no task retrying on that connection, which can never
/// carry the abandon script: what waits for the store's background work
/// (a gateway's shutdown) is not held for the reservation's lease while
/// the server is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_given_up_on_a_dropped_connection_holds_nothing() {
    // The given-up reservation's lease is 30 s: a task retrying until it
    // ends would outlast the wait below.
    let Some((_server, store)) = store_whose_server_went_away().await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(10), store.settled())
        .await
        .expect("no task retries on the dropped connection");
    assert_eq!(store.background_tasks(), 0);
}

/// `connect()` checks the server it reaches: one it cannot reach is
/// `BuildError::Unreachable` (it succeeded before, against nothing), one
/// too old for record format 3 is `BuildError::Unsafe` (a real Redis whose
/// replies report a 6.x version through a proxy). With `check_lazily`, a
/// store made while Redis is down checks it on its first connection; and
/// every new connection is checked, so a failover onto a server too old
/// for format 3 has its calls refused, never run on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_checks_the_server_it_reaches() {
    use idem_redis::{BuildError, RecordFormat};
    use idem_tests::cutter::ReplyCutter;
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let real = redis
        .info_field("server", "redis_version")
        .expect("version")
        .trim()
        .to_owned();
    let old = format!("6{}", &real[1..]);
    let nothing = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    match RedisStore::builder(&format!("redis://127.0.0.1:{nothing}"))
        .timeout(Duration::from_millis(500))
        .connect()
        .await
    {
        Err(BuildError::Unreachable(_)) => {}
        other => panic!("connected to nothing: {other:?}"),
    }

    let server = ([127, 0, 0, 1], redis.port).into();
    let older = ReplyCutter::start(server).await;
    older.report_version(&real, &old);
    let url = format!("redis://{}", older.addr);
    match RedisStore::builder(&url).connect().await {
        Err(BuildError::Unsafe(refusal)) => assert!(refusal.contains(&old), "{refusal}"),
        other => panic!("format 3 on Redis {old}: {other:?}"),
    }
    let v2 = RedisStore::builder(&url)
        .record_format(RecordFormat::V2)
        .connect()
        .await
        .expect("format 2 runs on it");
    assert!(matches!(
        v2.reserve(&request("v2-on-old", 1)).await,
        Ok(Reservation::Acquired(_))
    ));

    // Down at start: accepted lazily, checked on the first connection.
    let lazy = ReplyCutter::start(server).await;
    lazy.refuse_new_connections(true);
    let store = RedisStore::builder(&format!("redis://{}", lazy.addr))
        .timeout(Duration::from_millis(500))
        .check_lazily(true)
        .connect()
        .await
        .expect("accepted while down");
    assert!(store.reserve(&request("lazy-1", 1)).await.is_err());
    lazy.report_version(&real, &old);
    lazy.refuse_new_connections(false);
    let refused = store.reserve(&request("lazy-2", 1)).await;
    assert!(
        matches!(&refused, Err(idem_core::StoreError::Refused(why)) if why.to_string().contains(&old)),
        "{refused:?}"
    );

    // A failover onto an older server: the next connection is checked.
    let moving = ReplyCutter::start(server).await;
    let store = RedisStore::builder(&format!("redis://{}", moving.addr))
        .connect()
        .await
        .expect("a current server");
    assert!(matches!(
        store.reserve(&request("before", 1)).await,
        Ok(Reservation::Acquired(_))
    ));
    moving.report_version(&real, &old);
    moving.move_to(server);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match store.reserve(&request("after", 1)).await {
            Err(idem_core::StoreError::Refused(why)) => {
                assert!(why.to_string().contains(&old), "{why}");
                break;
            }
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("ran on Redis {old}: {other:?}"),
        }
    }
}
