//! The store conformance suite on a real redis-server, single node and a
//! 3-node cluster, on the server's real clock.

use std::{sync::Arc, time::Duration};

use idem_core::Store;
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

    idem_core::conformance_tests!(single);
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
    let harness = Arc::new(RealClock::new(store, cluster));
    idem_core::conformance::run_all(harness).await;
}
