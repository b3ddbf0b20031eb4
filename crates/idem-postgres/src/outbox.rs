//! Events that leave with the write: the transactional outbox.
//!
//! A handler adds events to its [`IdemTransaction`](crate::IdemTransaction)
//! with [`emit`](crate::IdemTransaction::emit). They are written to the
//! outbox table (`<table>_outbox`, created by
//! [`PgStore::migrate`](crate::PgStore::migrate)) in that same transaction,
//! right before it commits:
//!
//! * under the layer, after the fenced completion of the record matched
//!   the attempt's lease, so the events, the handler's writes and the
//!   completed record commit with one `COMMIT`, or none of them does (a
//!   fenced attempt's events never leave);
//! * without the layer (an unkeyed request), when the handler commits.
//!
//! Each event's id, the message id the relay publishes it with, is derived
//! from the record's scope, the attempt's generation and id, and the
//! event's position (`<scope hex>-<generation>-<attempt>-<position>`), so
//! a re-publish of the same row carries the same id, and a key reused
//! after its record expired (generation 1 again) never repeats one. Without the layer the id is
//! `tx-<uuid>-<position>`, the UUID drawn once per transaction.
//!
//! The same statement sends `NOTIFY` on `<table>:outbox`, delivered when
//! the transaction commits, so a listening relay wakes at once.

use bytes::Bytes;
use idem_core::Lease;
use sqlx::PgConnection;

/// One event a handler emitted, waiting for its transaction's commit.
#[derive(Debug, Clone)]
pub(crate) struct Emitted {
    pub(crate) subject: String,
    pub(crate) payload: Bytes,
}

/// The outbox table of the records table `table`.
pub(crate) fn table(table: &str) -> String {
    format!("{table}_outbox")
}

/// The channel a commit with events notifies.
pub(crate) fn channel(table: &str) -> String {
    format!("{table}:outbox")
}

/// The prefix of the ids of the events an attempt emits: the record's
/// scope, the attempt's generation and the attempt's id (the position
/// follows). The attempt's id keeps ids unique over time: a key reused
/// after its record expired or was erased starts at generation 1 again.
fn id_prefix(lease: &Lease) -> String {
    format!(
        "{}-{}-{}",
        lease.scope.to_hex(),
        lease.generation,
        lease.attempt.0.simple()
    )
}

/// The prefix of the ids of events emitted outside the layer.
fn unkeyed_prefix() -> String {
    format!("tx-{}", uuid::Uuid::new_v4().simple())
}

/// The statement that writes a transaction's events (one row each, in
/// order) and notifies the relay, in one round trip; `now` is the
/// database's clock in milliseconds (`sql::NOW_MS`).
pub(crate) fn insert_sql(records: &str, now: &str) -> String {
    let outbox = table(records);
    let channel = channel(records);
    format!(
        "WITH ins AS (INSERT INTO {outbox} \
           (id, scope, generation, attempt, position, subject, payload, created_at_ms) \
           SELECT $1 || '-' || e.position, $2, $3, $4, e.position, e.subject, e.payload, \
             {now} \
           FROM unnest($5::text[], $6::bytea[]) WITH ORDINALITY AS e(subject, payload, position) \
           ORDER BY e.position RETURNING 1) \
         SELECT count(*) AS written, pg_notify('{channel}', '') FROM ins"
    )
}

/// Writes `events` in the transaction `conn` is in: `attempt` is the
/// lease whose scope, generation and attempt id they carry (`None`
/// outside the layer). A transaction without events costs nothing here.
pub(crate) async fn write(
    conn: &mut PgConnection,
    sql: &str,
    pooled: bool,
    attempt: Option<&Lease>,
    events: &[Emitted],
) -> Result<(), sqlx::Error> {
    if events.is_empty() {
        return Ok(());
    }
    let prefix = attempt.map_or_else(unkeyed_prefix, id_prefix);
    let subjects: Vec<&str> = events.iter().map(|e| e.subject.as_str()).collect();
    let payloads: Vec<&[u8]> = events.iter().map(|e| e.payload.as_ref()).collect();
    let scope = attempt.map(|lease| lease.scope.as_bytes().to_vec());
    let generation = attempt.map(|lease| crate::row::ms(lease.generation));
    let id = attempt.map(|lease| lease.attempt.0);
    sqlx::query(sql)
        .persistent(!pooled)
        .bind(&prefix)
        .bind(scope)
        .bind(generation)
        .bind(id)
        .bind(subjects)
        .bind(payloads)
        .execute(conn)
        .await?;
    Ok(())
}
