//! Every store against idem-core's state machine, by generated sequences
//! of calls from several owners (`idem_core::differential`): the memory
//! store, Redis record formats 1, 2 and 3 and a fleet mixing 2 and 3, a
//! Redis Cluster, PostgreSQL directly and behind PgBouncer. Each test
//! runs `CASES` sequences (`IDEM_DIFFERENTIAL_CASES` for the deep mode),
//! on the servers' real clocks with short leases.

use std::time::Duration;

use idem_core::{RecordsAdmin, differential};
use idem_memory::MemoryStore;
use idem_postgres::PgStore;
use idem_redis::{RecordFormat, RedisStore};
use idem_tests::{
    pgbouncer::PgBouncer,
    postgres_server::PgServer,
    redis_server::{RedisCluster, RedisServer},
};

/// Sequences per store in an ordinary run.
const CASES: u64 = 12;

/// A lease short enough for lapses to be waited for, long enough that
/// ordinary calls never come near its end.
const LEASE: Duration = Duration::from_millis(400);

/// Seeds of each store's sequences start here; another store starts
/// elsewhere, so the stores together cover more sequences.
async fn check<S: RecordsAdmin>(store: &S, first_seed: u64) {
    differential::check(store, LEASE, first_seed, differential::cases(CASES)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_runs_the_machine() {
    check(&MemoryStore::new(), 0).await;
}

fn redis_store(server: &RedisServer, format: RecordFormat) -> RedisStore {
    RedisStore::builder(&server.url())
        .record_format(format)
        .build()
        .expect("store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_format_1_runs_the_machine() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    check(&redis_store(&server, RecordFormat::V1), 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_format_2_runs_the_machine() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    check(&redis_store(&server, RecordFormat::V2), 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_format_3_runs_the_machine() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    check(&redis_store(&server, RecordFormat::V3), 3000).await;
}

/// A fleet mid-upgrade: calls alternate between a store writing format 3
/// and one writing format 2 on the same Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_fleet_of_formats_2_and_3_runs_the_machine() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let fleet = idem_tests::Alternating::new([
        redis_store(&server, RecordFormat::V3),
        redis_store(&server, RecordFormat::V2),
    ]);
    check(&fleet, 4000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_runs_the_machine() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let store = RedisStore::from_url(&cluster.url()).expect("store");
    check(&store, 5000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_runs_the_machine() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    check(&store, 6000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_behind_pgbouncer_runs_the_machine() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(bouncer) = PgBouncer::spawn(server, 4) else {
        return;
    };
    let store = bouncer.store(server);
    store.migrate().await.expect("migrate");
    check(&store, 7000).await;
}
