//! The store conformance suite on a real redis-server, single node and a
//! 3-node cluster, on the server's real clock.

use std::{sync::Arc, time::Duration};

use idem_core::{RecordsAdmin, Store};
use idem_redis::RedisStore;
use idem_tests::{
    RealClock,
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

/// Two stores on one Redis, one packing new records and one not, taking
/// the calls in turn: a record one layout's store wrote is read, completed,
/// renewed, released, cancelled and listed by the other's (a rolling
/// deploy that turns packing on, or off).
struct Alternating {
    stores: [RedisStore; 2],
    next: std::sync::atomic::AtomicUsize,
}

impl Alternating {
    fn pick(&self) -> &RedisStore {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.stores[turn % 2]
    }
}

impl Store for Alternating {
    async fn reserve(
        &self,
        request: &idem_core::ReserveRequest,
    ) -> Result<idem_core::Reservation, idem_core::StoreError> {
        self.pick().reserve(request).await
    }

    async fn renew(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Renewal, idem_core::StoreError> {
        self.pick().renew(lease).await
    }

    async fn mark_unknown(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Renewal, idem_core::StoreError> {
        self.pick().mark_unknown(lease).await
    }

    async fn complete(
        &self,
        lease: &idem_core::Lease,
        outcome: &idem_core::Outcome,
    ) -> Result<idem_core::Completion, idem_core::StoreError> {
        self.pick().complete(lease, outcome).await
    }

    async fn release(
        &self,
        lease: &idem_core::Lease,
    ) -> Result<idem_core::Release, idem_core::StoreError> {
        self.pick().release(lease).await
    }

    async fn cancel(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::Cancellation, idem_core::StoreError> {
        self.pick().cancel(scope).await
    }

    async fn get(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<Option<idem_core::Record>, idem_core::StoreError> {
        self.pick().get(scope).await
    }
}

impl RecordsAdmin for Alternating {
    async fn list(
        &self,
        query: &idem_core::RecordQuery,
    ) -> Result<Vec<idem_core::Record>, idem_core::StoreError> {
        self.pick().list(query).await
    }

    async fn force_release(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::ForceRelease, idem_core::StoreError> {
        self.pick().force_release(scope).await
    }

    async fn erase(
        &self,
        scope: &idem_core::ScopeHash,
    ) -> Result<idem_core::Erasure, idem_core::StoreError> {
        self.pick().erase(scope).await
    }
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
    let next = std::sync::atomic::AtomicUsize::new(0);
    Some(RealClock::new(Alternating { stores, next }, server))
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
    let next = std::sync::atomic::AtomicUsize::new(0);
    let harness = Arc::new(RealClock::new(Alternating { stores, next }, cluster));
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
    let next = std::sync::atomic::AtomicUsize::new(0);
    let harness = Arc::new(RealClock::new(Alternating { stores, next }, cluster));
    idem_core::conformance::run_all(harness).await;
}
