//! The store conformance suite on a private PostgreSQL server, on the
//! database's real clock; the sweep; the schema file.

use std::time::Duration;

use idem_core::{Reservation, ReserveRequest, Store};
use idem_postgres::PgStore;
use idem_tests::{RealClock, postgres_server::PgServer};

/// A store on a fresh database of the shared server; `None` skips (no
/// PostgreSQL, outside CI).
async fn store() -> Option<PgStore> {
    let server = PgServer::shared()?;
    let store = PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    Some(store)
}

async fn harness() -> Option<RealClock<PgStore>> {
    Some(RealClock::new(store().await?, ()))
}

idem_core::conformance_tests!(harness, records_admin);

fn request(key: &str, lease: Duration, retention: Duration) -> ReserveRequest {
    ReserveRequest {
        scope: idem_core::conformance::fresh_scope(key),
        fingerprint: idem_core::conformance::fingerprint(1),
        lease,
        retention,
    }
}

/// The table claimed (see `idem_tests::claims_identity`): the replacing
/// claim set its own time, the same marker with a shorter time does not
/// shorten it, and a lapsed claim is anyone's.
#[tokio::test]
async fn the_table_is_claimed_once() {
    let Some(store) = store().await else { return };
    idem_tests::claims_identity(|m, ttl, r| store.claim_identity(m, ttl, r)).await;
    let left = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT expires_at_ms - (extract(epoch FROM clock_timestamp()) * 1000)::bigint \
             FROM idem_records_identity",
        )
        .fetch_one(store.pool())
        .await
        .expect("expiry")
    };
    assert!(
        left().await <= 60_000,
        "the replacing claim kept the old time"
    );
    store
        .claim_identity("v1:b", Duration::from_millis(1), false)
        .await
        .expect("claim");
    assert!(left().await > 1_000, "the claim was shortened");
    // A claim that lapsed (its gateways gone longer than the retention).
    store
        .claim_identity("v1:c", Duration::from_millis(1), true)
        .await
        .expect("claim");
    idem_tests::wait_until(Duration::from_secs(20), "the claim to lapse", async || {
        left().await < 0
    })
    .await;
    let claimed = store.claim_identity("v1:a", Duration::from_secs(60), false);
    assert_eq!(
        claimed.await.expect("claim"),
        idem_postgres::IdentityClaim::Held
    );
}

/// The sweep deletes expired records and only those; a record whose
/// attempt holds a live lease stays even when its expiry has passed.
#[tokio::test]
async fn the_sweep_deletes_expired_records_but_never_a_live_lease() {
    let Some(store) = store().await else { return };
    let short = Duration::from_millis(300);
    let long = Duration::from_secs(3600);
    for n in 0..5 {
        let reserved = store
            .reserve(&request(&format!("old-{n}"), short, short))
            .await
            .expect("reserve");
        assert!(matches!(reserved, Reservation::Acquired(_)));
    }
    let kept = request("kept", long, long);
    assert!(matches!(
        store.reserve(&kept).await.expect("reserve"),
        Reservation::Acquired(_)
    ));
    let live = request("live", long, long);
    assert!(matches!(
        store.reserve(&live).await.expect("reserve"),
        Reservation::Acquired(_)
    ));
    // A record whose expiry passed while its lease is live (written by
    // hand: the state machine never makes one) must survive the sweep.
    sqlx::query("UPDATE idem_records SET expires_at_ms = 0 WHERE scope = $1")
        .bind(live.scope.hash().as_bytes().to_vec())
        .execute(store.pool())
        .await
        .expect("update");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.sweep().await.expect("sweep"), 5);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(left, 2);
    assert_eq!(store.sweep().await.expect("sweep"), 0);
}

/// A sweep in batches deletes everything expired, batch after batch.
#[tokio::test]
async fn the_sweep_runs_batch_after_batch() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::builder()
        .url(server.database())
        .table("records_in_batches")
        .sweep_batch(7)
        .sweep_every(None)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    // Every DELETE statement on the table logs how many rows it took.
    for statement in [
        "CREATE TABLE IF NOT EXISTS sweep_statements (n serial PRIMARY KEY, deleted bigint)",
        "TRUNCATE sweep_statements",
        "CREATE OR REPLACE FUNCTION log_sweep_statement() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN INSERT INTO sweep_statements (deleted) SELECT count(*) FROM gone; \
         RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS sweep_statements ON records_in_batches",
        "CREATE TRIGGER sweep_statements AFTER DELETE ON records_in_batches \
         REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION log_sweep_statement()",
    ] {
        sqlx::query(statement)
            .execute(store.pool())
            .await
            .expect(statement);
    }
    let short = Duration::from_millis(200);
    for n in 0..30 {
        let _ = store
            .reserve(&request(&format!("k-{n}"), short, short))
            .await
            .expect("reserve");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.sweep().await.expect("sweep"), 30);
    // Batches of 7 until one deletes fewer: never one unbounded DELETE.
    let statements: Vec<i64> =
        sqlx::query_scalar("SELECT deleted FROM sweep_statements ORDER BY n")
            .fetch_all(store.pool())
            .await
            .expect("statements");
    assert_eq!(statements, [7, 7, 7, 7, 2]);
}

/// The background sweep runs on its own.
#[tokio::test]
async fn the_background_sweep_deletes_expired_records() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::builder()
        .url(server.database())
        .sweep_every(Some(Duration::from_millis(100)))
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let short = Duration::from_millis(200);
    let _ = store
        .reserve(&request("soon-gone", short, short))
        .await
        .expect("reserve");
    idem_tests::wait_until(Duration::from_secs(20), "the sweep", async || {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        left == 0
    })
    .await;
}

/// The schema file users apply by hand is what `migrate` runs, and
/// applying it twice is harmless; a bad table name is refused.
#[tokio::test]
async fn the_schema_file_applies_twice_and_bad_table_names_are_refused() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let database = url.rsplit('/').next().expect("database name").to_owned();
    server
        .psql(&database, idem_postgres::SCHEMA)
        .expect("schema");
    server
        .psql(&database, idem_postgres::SCHEMA)
        .expect("schema again");
    let store = PgStore::from_url(&url).expect("store");
    let reserved = store
        .reserve(&request(
            "by-hand",
            Duration::from_secs(5),
            Duration::from_secs(60),
        ))
        .await
        .expect("reserve on the hand-made table");
    assert!(matches!(reserved, Reservation::Acquired(_)));
    for bad in ["", "Records", "a-b", "a;drop table x", "public.records"] {
        assert!(
            matches!(
                PgStore::builder().url(&url).table(bad).build(),
                Err(idem_postgres::PgConfigError::Table(_))
            ),
            "{bad:?} was accepted"
        );
    }
}

/// Processes that start together on a fresh database all migrate it: one
/// creates the tables and the others find them. Two concurrent `CREATE
/// TABLE IF NOT EXISTS` both created, and one failed on a unique index of
/// the catalog (`pg_type_typname_nsp_index`), so one of two gateways
/// started together on a new database exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_that_start_together_all_migrate_a_fresh_database() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    for _ in 0..3 {
        let url = server.database();
        let stores: Vec<PgStore> = (0..4)
            .map(|_| PgStore::from_url(&url).expect("store"))
            .collect();
        let migrations = stores.iter().map(PgStore::migrate);
        for result in futures_util::future::join_all(migrations).await {
            result.expect("every process migrates");
        }
        let reserved = stores[3]
            .reserve(&request(
                "after-the-race",
                Duration::from_secs(5),
                Duration::from_secs(60),
            ))
            .await
            .expect("reserve");
        assert!(matches!(reserved, Reservation::Acquired(_)));
    }
}

/// An unreachable database is a store error, never a panic or a hang.
#[tokio::test]
async fn an_unreachable_database_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let store =
        PgStore::from_url(&format!("postgres://postgres@127.0.0.1:{port}/none")).expect("store");
    let error = store
        .reserve(&request(
            "nowhere",
            Duration::from_secs(5),
            Duration::from_secs(60),
        ))
        .await
        .expect_err("no database");
    assert!(
        matches!(error, idem_core::StoreError::Unavailable(_)),
        "{error:?}"
    );
    // The fleet's claims and the sweep likewise: the pool's wait ran out
    // without a connection, which is not a busy pool.
    let claim = store
        .claim_duty("chore", "me", Duration::from_secs(1))
        .await;
    assert!(
        matches!(claim, Err(idem_core::StoreError::Unavailable(_))),
        "{claim:?}"
    );
    let identity = store
        .claim_identity("v1:a", Duration::from_secs(1), false)
        .await;
    assert!(
        matches!(identity, Err(idem_core::StoreError::Unavailable(_))),
        "{identity:?}"
    );
    let swept = store.sweep().await;
    assert!(
        matches!(swept, Err(idem_core::StoreError::Unavailable(_))),
        "{swept:?}"
    );
}

/// A stored header name that is no header name (written by hand: the layer
/// stores only names a header map held) is left out of the replay, and the
/// other headers and the body are replayed.
#[tokio::test]
async fn a_stored_header_name_that_does_not_parse_is_left_out() {
    let Some(store) = store().await else { return };
    let hour = Duration::from_secs(3600);
    let request = request("bad-header-name", hour, hour);
    let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve") else {
        panic!("a new key is acquired");
    };
    let outcome = idem_core::conformance::response(201, b"{\"id\":1}");
    assert_eq!(
        store.complete(&lease, &outcome).await.expect("complete"),
        idem_core::Completion::Recorded
    );
    sqlx::query("UPDATE idem_records SET header_names[1] = 'bad name' WHERE scope = $1")
        .bind(request.scope.hash().as_bytes().to_vec())
        .execute(store.pool())
        .await
        .expect("update");
    let Reservation::Completed(replay) = store.reserve(&request).await.expect("replay") else {
        panic!("a completed key is replayed");
    };
    let idem_core::Outcome::Stored(stored) = replay.outcome else {
        panic!("the response was stored");
    };
    let names: Vec<&str> = stored
        .headers
        .iter()
        .map(|(name, _)| name.as_str())
        .collect();
    assert_eq!(names, ["location", "x-binary"]);
    assert_eq!(stored.body, b"{\"id\":1}"[..]);
}

/// A fleet-wide chore on PostgreSQL, two stores on one database
/// (`idem_tests::duty_is_held_by_one_holder_at_a_time`).
#[tokio::test]
async fn a_duty_is_held_by_one_holder_at_a_time() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let a = PgStore::from_url(&url).expect("store");
    a.migrate().await.expect("migrate");
    let b = PgStore::from_url(&url).expect("store");
    idem_tests::duty_is_held_by_one_holder_at_a_time(a, b).await;
}
