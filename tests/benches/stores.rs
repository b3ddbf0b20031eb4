//! The three stores side by side, in one run: new keys (reserve + complete)
//! and replays from 64 concurrent tasks, with the round trips each costs as
//! the servers count them (Redis: commands from `INFO commandstats`;
//! PostgreSQL: transactions from `pg_stat_database`, every statement outside
//! a transaction being one). Private servers on loopback.
//!
//! Bytes per record: the process's RSS growth for memory, `used_memory`
//! growth for Redis, the table and its indexes for PostgreSQL, over the
//! records the run leaves (a small JSON response each).
//!
//! Run with `cargo bench -p idem-tests --bench stores`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use idem_core::{Reservation, Store};
use idem_memory::MemoryStore;
use idem_postgres::PgStore;
use idem_redis::RedisStore;
use idem_tests::bench::{outcome, request};
use idem_tests::{postgres_server::PgServer, redis_server::RedisServer};

const TASKS: u64 = 64;
const PER_TASK: u64 = 300;

static COUNTER: AtomicU64 = AtomicU64::new(0);

async fn new_key<S: Store>(store: &S, key: &str) {
    let Ok(Reservation::Acquired(lease)) = store.reserve(&request(key)).await else {
        panic!("not acquired");
    };
    let _ = store.complete(&lease, &outcome()).await.expect("complete");
}

async fn replay<S: Store>(store: &S, key: &str) {
    let Ok(Reservation::Completed(_)) = store.reserve(&request(key)).await else {
        panic!("not replayed");
    };
}

/// Runs `TASKS × PER_TASK` operations; operations per second.
async fn run<S: Store>(store: &Arc<S>, replaying: bool) -> f64 {
    let run = COUNTER.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let store = Arc::clone(store);
            tokio::spawn(async move {
                for n in 0..PER_TASK {
                    if replaying {
                        replay(&store, &format!("seed-{task}-{n}")).await;
                    } else {
                        new_key(&store, &format!("k{run}-{task}-{n}")).await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    (TASKS * PER_TASK) as f64 / started.elapsed().as_secs_f64()
}

async fn seed<S: Store>(store: &S) {
    for task in 0..TASKS {
        for n in 0..PER_TASK {
            new_key(store, &format!("seed-{task}-{n}")).await;
        }
    }
}

fn redis_commands(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        // Round trips: the scripts, not the commands they run inside.
        .filter(|line| line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:"))
        .filter_map(|line| {
            let calls = line.split("calls=").nth(1)?.split(',').next()?;
            calls.parse::<u64>().ok()
        })
        .sum()
}

/// Transactions counted so far; the store's pool is closed first, since a
/// backend reports its counts for sure when it exits.
async fn pg_transactions(server: &PgServer, database: &str, store: Arc<PgStore>) -> u64 {
    store.pool().close().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    server
        .psql(
            "postgres",
            &format!("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{database}'"),
        )
        .expect("stats")
        .parse()
        .expect("a number")
}

fn line(
    name: &str,
    new_keys: f64,
    replays: f64,
    trips: Option<(f64, f64)>,
    unit: &str,
    bytes: f64,
) {
    let trips = trips.map_or_else(
        || "—".to_owned(),
        |(n, r)| format!("{n:.2} / {r:.2} {unit}"),
    );
    println!("| {name} | {new_keys:.0} | {replays:.0} | {trips} | {bytes:.0} |");
}

/// This process's resident memory, in bytes.
fn rss() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0
}

/// Redis's `used_memory`.
fn redis_used_memory(server: &RedisServer) -> f64 {
    server
        .info_field("memory", "used_memory")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0.0)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        println!(
            "| store | new keys/s | replays/s | round trips per new key / replay | bytes per record |"
        );
        println!("|---|---|---|---|---|");
        let total = (TASKS * PER_TASK) as f64;
        // Seeded records and those of the new-key run: two rounds.
        let records = 2.0 * total;

        let rss_before = rss();
        let memory = Arc::new(MemoryStore::new());
        seed(&memory).await;
        let new_keys = run(&memory, false).await;
        let replays = run(&memory, true).await;
        let per_record = (rss() - rss_before) / records;
        line("memory (RSS)", new_keys, replays, None, "", per_record);
        drop(memory);

        if let Some(server) = RedisServer::spawn() {
            let redis = Arc::new(RedisStore::from_url(&server.url()).expect("redis"));
            let used_before = redis_used_memory(&server);
            seed(&redis).await;
            let before = redis_commands(&server);
            let new_keys = run(&redis, false).await;
            let middle = redis_commands(&server);
            let replays = run(&redis, true).await;
            let after = redis_commands(&server);
            let trips = (
                (middle - before) as f64 / total,
                (after - middle) as f64 / total,
            );
            let per_record = (redis_used_memory(&server) - used_before) / records;
            line("Redis (used_memory)", new_keys, replays, Some(trips), "commands", per_record);
        }

        if let Some(server) = PgServer::shared() {
            let url = server.database();
            let database = url.rsplit('/').next().expect("name").to_owned();
            let pg = || {
                Arc::new(
                    PgStore::builder()
                        .url(&url)
                        .max_connections(64)
                        .build()
                        .expect("pg"),
                )
            };
            let seeding = pg();
            seeding.migrate().await.expect("migrate");
            seed(&seeding).await;
            let before = pg_transactions(server, &database, seeding).await;
            let store = pg();
            let new_keys = run(&store, false).await;
            let middle = pg_transactions(server, &database, store).await;
            let store = pg();
            let replays = run(&store, true).await;
            let after = pg_transactions(server, &database, store).await;
            let trips = (
                (middle - before) as f64 / total,
                (after - middle) as f64 / total,
            );
            let size: f64 = server
                .psql(
                    &database,
                    "SELECT pg_total_relation_size('idem_records')::float8 / count(*) FROM idem_records",
                )
                .expect("size")
                .parse()
                .unwrap_or(0.0);
            line("PostgreSQL (table + index)", new_keys, replays, Some(trips), "transactions", size);
        }
    });
}
