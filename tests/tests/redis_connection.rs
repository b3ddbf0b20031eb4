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

    // A wrong password: every call fails as the store being unavailable,
    // and the server keeps nothing.
    let store = RedisStore::from_url(&format!("redis://:wrong@127.0.0.1:{port}/2")).expect("store");
    for _ in 0..2 {
        let refused = store.reserve(&request("auth", 1)).await;
        assert!(
            matches!(refused, Err(StoreError::Unavailable(_))),
            "{refused:?}"
        );
    }
    assert_eq!(dbsize("2"), 0);
}

/// A store connected to `server`, which is then killed: a reservation
/// (30 s lease) fails as unavailable, not as a timeout, since the closed
/// connection fails the call at once and so does the retry on a new one.
async fn store_whose_server_went_away(server: &mut RedisServer) -> RedisStore {
    let store = RedisStore::builder(&server.url())
        .timeout(Duration::from_secs(2))
        .build()
        .expect("store");
    let before = store.reserve(&request("before", 1)).await;
    assert!(matches!(before, Ok(Reservation::Acquired(_))), "{before:?}");
    server.kill();
    let down = store.reserve(&request("down", 1)).await;
    assert!(matches!(down, Err(StoreError::Unavailable(_))), "{down:?}");
    store
}

/// A connection whose server went away fails its calls as unavailable,
/// and the store connects again once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reconnected_to() {
    let Some(mut server) = RedisServer::spawn() else {
        return;
    };
    let store = store_whose_server_went_away(&mut server).await;
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
    let Some(mut server) = RedisServer::spawn() else {
        return;
    };
    // The given-up reservation's lease is 30 s: a task retrying until it
    // ends would outlast the wait below.
    let store = store_whose_server_went_away(&mut server).await;
    tokio::time::timeout(Duration::from_secs(10), store.settled())
        .await
        .expect("no task retries on the dropped connection");
    assert_eq!(store.background_tasks(), 0);
}
