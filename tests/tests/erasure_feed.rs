//! The stores' push channels for erasures (`docs/design.md`, section 3):
//! an erasure through one store is heard by another on the same server,
//! a lost subscription turns the feed unhealthy and begins a new epoch once
//! it is back, and a store without a channel (a cluster, a pooler) has no
//! feed.

use std::time::Duration;

use idem_core::{
    ErasureFeed, Outcome, RecordsAdmin, Reservation, ReserveRequest, Store, StoredResponse,
    conformance::{fingerprint, fresh_scope, wait_until},
};
use idem_postgres::PgStore;
use idem_redis::RedisStore;
use idem_tests::{
    postgres_server::PgServer,
    redis_server::{RedisCluster, RedisServer},
};

const WITHIN: Duration = Duration::from_secs(15);

/// A completed record on `store`, erased through `eraser`; `feed` (of a
/// third store on the same server) hears its scope.
async fn an_erasure_is_heard<S: RecordsAdmin, E: RecordsAdmin>(
    store: &S,
    eraser: &E,
    feed: &ErasureFeed,
) {
    wait_until(WITHIN, "the feed to be healthy", async || {
        feed.healthy().is_some()
    })
    .await;
    let mut heard = feed.subscribe();
    let scope = fresh_scope("erased");
    let request = ReserveRequest {
        scope: scope.clone(),
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve") else {
        panic!("a new key");
    };
    let outcome = Outcome::Stored(StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"{}"),
    });
    let _ = store.complete(&lease, &outcome).await.expect("complete");
    assert!(matches!(
        eraser.erase(scope.hash()).await.expect("erase"),
        idem_core::Erasure::Erased(_)
    ));
    let scope_heard = tokio::time::timeout(WITHIN, heard.recv())
        .await
        .expect("heard within the bound")
        .expect("a scope");
    assert_eq!(&scope_heard, scope.hash());
    assert!(feed.erased_within(Duration::from_secs(60)));
}

/// Waits until `feed` lost its channel and is healthy again in a new epoch.
async fn recovers(feed: &ErasureFeed, before: u64, lose: impl Fn()) {
    let mut lost = false;
    wait_until(WITHIN, "the feed to lose its channel", async || {
        lose();
        lost = feed.healthy().is_none_or(|epoch| epoch != before);
        lost
    })
    .await;
    wait_until(WITHIN, "the feed to be healthy again", async || {
        feed.healthy().is_some_and(|epoch| epoch != before)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_erasure_reaches_every_store_and_a_lost_subscriber_is_noticed() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&redis.url()).expect("store");
    let eraser = RedisStore::from_url(&redis.url()).expect("store");
    let listener = RedisStore::from_url(&redis.url()).expect("store");
    let feed = listener.erasures().expect("a single node has a feed");
    an_erasure_is_heard(&store, &eraser, &feed).await;
    let before = feed.healthy().expect("healthy");
    recovers(&feed, before, || {
        let _ = redis.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    })
    .await;
    // And it hears erasures again.
    an_erasure_is_heard(&store, &eraser, &feed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_has_no_feed() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&cluster.url()).expect("store");
    assert!(store.erasures().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_erasure_reaches_every_store_and_a_lost_listener_is_noticed() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let store = PgStore::from_url(&url).expect("store");
    store.migrate().await.expect("migrate");
    let eraser = PgStore::from_url(&url).expect("store");
    let listener = PgStore::from_url(&url).expect("store");
    let feed = listener.erasures().expect("a direct connection has a feed");
    an_erasure_is_heard(&store, &eraser, &feed).await;
    let before = feed.healthy().expect("healthy");
    let database = url.rsplit('/').next().expect("a database").to_owned();
    recovers(&feed, before, || {
        let _ = server.psql(
            &database,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE query LIKE 'LISTEN%' OR query = 'SELECT 1'",
        );
    })
    .await;
    an_erasure_is_heard(&store, &eraser, &feed).await;
}

#[tokio::test]
async fn postgres_behind_a_transaction_pooler_has_no_feed() {
    let store = PgStore::builder()
        .url("postgres://idem@127.0.0.1:1/idem")
        .transaction_pooler(true)
        .build()
        .expect("store");
    assert!(store.erasures().is_none());
}
