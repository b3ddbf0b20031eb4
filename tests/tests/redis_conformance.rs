//! The store conformance suite on a real redis-server, single node and a
//! 3-node cluster, on the server's real clock.

use std::{sync::Arc, time::Duration};

use idem_core::Store;
use idem_redis::RedisStore;
use idem_tests::{
    Alternating, RealClock,
    redis_server::{RedisCluster, RedisServer},
};

/// A harness on a fresh single server; `None` skips (no Redis, outside CI).
async fn single() -> Option<RealClock<RedisStore>> {
    let server = RedisServer::spawn()?;
    let store = RedisStore::from_url(&server.url()).expect("store");
    Some(RealClock::new(store, server))
}

mod single_node {
    use super::*;

    idem_core::conformance_tests!(single, records_admin);
}

/// A harness on a fresh single server whose store packs new records.
async fn single_packed() -> Option<RealClock<RedisStore>> {
    let server = RedisServer::spawn()?;
    let store = RedisStore::builder(&server.url())
        .record_format(idem_redis::RecordFormat::V2)
        .build()
        .expect("store");
    Some(RealClock::new(store, server))
}

mod single_node_packed {
    use super::*;

    idem_core::conformance_tests!(single_packed, records_admin);
}

/// A harness on a fresh single server whose store keeps new records as
/// one string (format 3).
async fn single_string() -> Option<RealClock<RedisStore>> {
    let server = RedisServer::spawn()?;
    let store = RedisStore::builder(&server.url())
        .record_format(idem_redis::RecordFormat::V3)
        .build()
        .expect("store");
    Some(RealClock::new(store, server))
}

mod single_node_string {
    use super::*;

    idem_core::conformance_tests!(single_string, records_admin);
}

/// Alternating stores on a fresh single server, the packing one first
/// when `packed_first`.
async fn alternating(packed_first: bool) -> Option<RealClock<Alternating>> {
    let formats = [packed_first, !packed_first].map(idem_tests::redis_server::format_of);
    alternating_formats(formats).await
}

/// Alternating stores on a fresh single server, writing these formats.
async fn alternating_formats(
    formats: [idem_redis::RecordFormat; 2],
) -> Option<RealClock<Alternating>> {
    let server = RedisServer::spawn()?;
    let stores = formats.map(|format| {
        RedisStore::builder(&server.url())
            .record_format(format)
            .build()
            .expect("store")
    });
    Some(RealClock::new(Alternating::new(stores), server))
}

mod packed_then_expanded {
    use super::*;

    idem_core::conformance_tests!(|| alternating(true), records_admin);
}

mod expanded_then_packed {
    use super::*;

    idem_core::conformance_tests!(|| alternating(false), records_admin);
}

/// A store writing format 3 beside one writing format 2 (the two steps of
/// a rolling upgrade to format 3, or back): each works on the other's
/// records, strings and hashes alike.
mod string_then_packed {
    use super::*;
    use idem_redis::RecordFormat::{V2, V3};

    idem_core::conformance_tests!(|| alternating_formats([V3, V2]), records_admin);
}

mod packed_then_string {
    use super::*;
    use idem_redis::RecordFormat::{V2, V3};

    idem_core::conformance_tests!(|| alternating_formats([V2, V3]), records_admin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_passes_the_whole_suite_and_spreads_records() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&cluster.url()).expect("store");
    // Records land on every node.
    for i in 0..60 {
        let scope = idem_core::conformance::fresh_scope(&format!("spread-{i}"));
        let request = idem_core::ReserveRequest {
            scope,
            fingerprint: idem_core::conformance::fingerprint(1),
            lease: Duration::from_secs(5),
            retention: Duration::from_secs(60),
        };
        assert!(matches!(
            store.reserve(&request).await.expect("reserve"),
            idem_core::Reservation::Acquired(_)
        ));
    }
    for node in &cluster.nodes {
        let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().expect("dbsize");
        assert!(keys > 0, "node {} holds no record", node.port);
    }
    idem_tests::claims_identity(|m, ttl, r| store.claim_identity(m, ttl, r)).await;
    let harness = Arc::new(RealClock::new(store, cluster));
    idem_core::conformance::run_all(harness).await;
}

/// A single node claimed: see `idem_tests::claims_identity`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_store_is_claimed_once() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&server.url()).expect("store");
    idem_tests::claims_identity(|m, ttl, r| store.claim_identity(m, ttl, r)).await;
    // The same marker with a shorter time left did not shorten the claim;
    // the replacing one set its own.
    let ttl: u64 = server
        .cli(&["PTTL", "idem:identity"])
        .trim()
        .parse()
        .expect("ttl");
    assert!(ttl > 30_000 && ttl <= 60_000, "{ttl} ms");
    store
        .claim_identity("v1:b", Duration::from_secs(1), false)
        .await
        .expect("claim");
    let ttl: u64 = server
        .cli(&["PTTL", "idem:identity"])
        .trim()
        .parse()
        .expect("ttl");
    assert!(ttl > 1_000, "a claim was shortened to {ttl} ms");
}

/// The whole suite on a cluster through a packing and an expanding store
/// taking turns (packed records on a cluster, where nothing publishes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_passes_the_whole_suite_with_either_layout() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let store = |packed: bool| {
        RedisStore::builder(&cluster.url())
            .record_format(idem_tests::redis_server::format_of(packed))
            .build()
            .expect("store")
    };
    let stores = [store(true), store(false)];
    let harness = Arc::new(RealClock::new(Alternating::new(stores), cluster));
    idem_core::conformance::run_all(harness).await;
}

/// The whole suite on a cluster through a store keeping new records as
/// strings (format 3) and one writing the expanded layout, taking turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_passes_the_whole_suite_with_string_records() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let store = |format| {
        RedisStore::builder(&cluster.url())
            .record_format(format)
            .build()
            .expect("store")
    };
    let stores = [
        store(idem_redis::RecordFormat::V3),
        store(idem_redis::RecordFormat::V1),
    ];
    let harness = Arc::new(RealClock::new(Alternating::new(stores), cluster));
    idem_core::conformance::run_all(harness).await;
}
