//! What a busy records table costs PostgreSQL, measured on a private
//! server (the figures in crates/idem-postgres/src/docs/guide.md, "Sizing"):
//!
//! 1. `ROWS` expired records (default 1,000,000; gateway-shaped: a hashed
//!    tenant, two headers, a 100-byte body) written in one statement, and
//!    the table's and its indexes' sizes;
//! 2. the store's sweep deleting them (`PgStore::sweep`, 1,000 rows per
//!    statement): its time and rows per second, and the sizes it leaves
//!    (dead rows until a vacuum);
//! 3. a plain `VACUUM` (what autovacuum runs): its time and the sizes;
//! 4. as many live records again: whether they reuse the space the vacuum
//!    freed (the table and its indexes should not double);
//! 5. `REINDEX TABLE CONCURRENTLY`: its time and what it gives back.
//!
//! `cargo bench -p idem-tests --bench pg_sizing` (`ROWS=200000` for a
//! quicker run). Needs PostgreSQL's binaries; prints, asserts nothing.

use std::time::{Duration, Instant};

use idem_postgres::PgStore;
use idem_tests::postgres_server::PgServer;

/// The table's, its primary key's and its expiry index's sizes, and its
/// dead rows (after an `ANALYZE`), as one line.
fn sizes(server: &PgServer, database: &str) -> String {
    server
        .psql(database, "ANALYZE idem_records")
        .expect("analyze");
    let query = "SELECT pg_size_pretty(pg_relation_size('idem_records')) || ' table, ' || \
                 pg_size_pretty(pg_relation_size('idem_records_pkey')) || ' primary key, ' || \
                 pg_size_pretty(pg_relation_size('idem_records_expires_at')) || ' expiry index, ' || \
                 (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'idem_records') || \
                 ' dead rows'";
    server.psql(database, query).expect("sizes")
}

/// Writes `rows` gateway-shaped records numbered from `from`, expired or
/// live; the time it took.
fn fill(server: &PgServer, database: &str, from: u64, rows: u64, expired: bool) -> Duration {
    let expires = if expired {
        "now_ms - 1000"
    } else {
        "now_ms + 86400000"
    };
    let statement = format!(
        "WITH t AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms) \
         INSERT INTO idem_records SELECT \
           decode(md5(i::text) || md5((i + 1)::text), 'hex'), \
           'auth:' || md5('tenant') || md5('tenant'), 'POST /payments', 'key-' || i, \
           decode(md5((i * 7)::text) || md5((i * 7 + 1)::text), 'hex'), 'completed', 1, NULL, \
           30000, 86400000, now_ms, now_ms, now_ms, now_ms, {expires}, 201, true, \
           ARRAY['content-type', 'location'], \
           ARRAY[convert_to('application/json', 'UTF8'), convert_to('/payments/' || i, 'UTF8')], \
           convert_to(repeat('x', 100), 'UTF8'), '[]'::jsonb \
         FROM t, generate_series({from}, {last}) AS i",
        last = from + rows - 1,
    );
    let started = Instant::now();
    server.psql(database, &statement).expect("fill");
    started.elapsed()
}

fn per_second(rows: u64, took: Duration) -> f64 {
    rows as f64 / took.as_secs_f64().max(1e-9)
}

fn main() {
    let rows: u64 = std::env::var("ROWS")
        .ok()
        .and_then(|rows| rows.parse().ok())
        .unwrap_or(1_000_000);
    let Some(server) = PgServer::private() else {
        eprintln!("PostgreSQL is not installed");
        return;
    };
    let url = server.database();
    let database = url.rsplit('/').next().expect("a database name").to_owned();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let _inside = runtime.enter();
    let store = PgStore::builder()
        .url(url)
        .sweep_every(None)
        .build()
        .expect("store");
    runtime.block_on(store.migrate()).expect("migrate");

    let took = fill(&server, &database, 0, rows, true);
    println!(
        "written: {rows} expired records in {took:.2?} ({:.0} rows/s, one statement)",
        per_second(rows, took)
    );
    println!("  {}", sizes(&server, &database));

    let started = Instant::now();
    let swept = runtime.block_on(store.sweep()).expect("sweep");
    let took = started.elapsed();
    println!(
        "swept: {swept} records in {took:.2?} ({:.0} rows/s, 1,000 per statement)",
        per_second(swept, took)
    );
    println!("  {}", sizes(&server, &database));

    let started = Instant::now();
    server
        .psql(&database, "VACUUM idem_records")
        .expect("vacuum");
    println!("vacuumed in {:.2?}", started.elapsed());
    println!("  {}", sizes(&server, &database));

    let took = fill(&server, &database, rows, rows, false);
    println!(
        "written again: {rows} live records in {took:.2?} ({:.0} rows/s)",
        per_second(rows, took)
    );
    println!("  {}", sizes(&server, &database));

    let started = Instant::now();
    server
        .psql(&database, "REINDEX TABLE CONCURRENTLY idem_records")
        .expect("reindex");
    println!("reindexed (concurrently) in {:.2?}", started.elapsed());
    println!("  {}", sizes(&server, &database));
}
