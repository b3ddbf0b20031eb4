//! The SQL of the store: its statements for one table name, and the
//! database's clock and start.

use std::time::Duration;

use idem_core::StoreError;

use crate::row;
use sqlx::Row;

/// The database's clock, in milliseconds since the epoch.
pub(crate) const NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// When the server started, in the same milliseconds: after a restart a
/// lease counts as running until at least a lease after it
/// (`machine::lease_after_start`).
pub(crate) const STARTED_MS: &str =
    "(extract(epoch FROM pg_postmaster_start_time()) * 1000)::bigint";

/// How many times a reservation retries when its row vanished (swept)
/// between two statements.
pub(crate) const RESERVE_TRIES: usize = 5;

/// The statements, with the table name in place.
pub(crate) struct Sql {
    pub(crate) table: String,
    pub(crate) reserve: String,
    pub(crate) complete: String,
    pub(crate) renew: String,
    pub(crate) lock: String,
    pub(crate) read: String,
    pub(crate) update: String,
    pub(crate) delete: String,
    pub(crate) sweep: String,
    pub(crate) list: String,
    /// The channel erasures are sent on (`erasures.rs`).
    pub(crate) erased: String,
    /// The statement writing a transaction's events (`outbox.rs`).
    pub(crate) emit: String,
}

impl Sql {
    pub(crate) fn new(table: &str) -> Self {
        let fence = "r.scope = $1 AND r.state = 'processing' AND r.generation = $2 \
                     AND r.owner = $3 AND r.expires_at_ms > t.now";
        let selected = row::SELECTED;
        Self {
            table: table.to_owned(),
            erased: crate::erasures::channel(table),
            emit: crate::outbox::insert_sql(table, NOW_MS),
            reserve: format!(
                "WITH t AS (SELECT {NOW_MS} AS now), \
                 ins AS (INSERT INTO {table} (scope, tenant, operation, key, fingerprint, state, \
                   generation, owner, lease_ms, retention_ms, lease_expires_at_ms, created_at_ms, \
                   updated_at_ms, expires_at_ms, attempts) \
                   SELECT $1, $2, $3, $4, $5, 'processing', 1, $6, $7::bigint, $8::bigint, \
                   t.now + $7::bigint, t.now, t.now, t.now + $8::bigint, \
                   jsonb_build_array(jsonb_build_object('id', $9::uuid, 'generation', 1, \
                     'started_at_ms', t.now, 'ended_at_ms', NULL, \
                     'outcome', jsonb_build_object('kind', 'running'), 'late', NULL)) \
                   FROM t ON CONFLICT (scope) DO NOTHING RETURNING 1) \
                 SELECT t.now AS now_ms, {STARTED_MS} AS started_ms, \
                   (SELECT count(*) FROM ins) AS inserted, {selected} \
                 FROM t LEFT JOIN {table} r ON r.scope = $1"
            ),
            complete: format!(
                "WITH t AS (SELECT {NOW_MS} AS now) \
                 UPDATE {table} r SET state = 'completed', owner = NULL, status = $4, \
                   stored = $5, header_names = $6, header_values = $7, body = $8, \
                   completed_at_ms = t.now, updated_at_ms = t.now, \
                   attempts = COALESCE((SELECT jsonb_agg(CASE \
                     WHEN (a->>'generation')::bigint = r.generation \
                       AND a->'outcome'->>'kind' IN ('running', 'unknown') \
                     THEN a || jsonb_build_object('ended_at_ms', t.now, 'outcome', \
                       jsonb_build_object('kind', 'completed', 'status', $4::integer)) \
                     ELSE a END ORDER BY i) \
                     FROM jsonb_array_elements(r.attempts) WITH ORDINALITY AS x(a, i)), '[]') \
                 FROM t WHERE {fence} RETURNING 1"
            ),
            renew: format!(
                "WITH t AS (SELECT {NOW_MS} AS now) \
                 UPDATE {table} r SET lease_ms = $4, lease_expires_at_ms = t.now + $4, \
                   expires_at_ms = GREATEST(r.expires_at_ms, t.now + $4) \
                 FROM t WHERE {fence} RETURNING 1"
            ),
            lock: format!(
                "SELECT {NOW_MS} AS now_ms, {STARTED_MS} AS started_ms, {selected} \
                 FROM {table} r WHERE r.scope = $1 FOR UPDATE"
            ),
            read: format!(
                "SELECT {NOW_MS} AS now_ms, {selected} FROM {table} r WHERE r.scope = $1"
            ),
            update: format!(
                "UPDATE {table} SET ({columns}) = ({values}) WHERE scope = $1 AND generation = $22",
                columns = row::COLUMNS,
                values = row::placeholders(),
            ),
            delete: format!("DELETE FROM {table} WHERE scope = $1"),
            list: format!(
                "WITH t AS (SELECT {NOW_MS} AS now) \
                 SELECT t.now AS now_ms, {selected} FROM {table} r, t \
                 WHERE r.expires_at_ms > t.now \
                   AND ($1::text IS NULL OR r.tenant = $1) \
                   AND ($2::text IS NULL OR r.state = $2) \
                   AND r.created_at_ms <= t.now - $3 \
                   AND (NOT $4 OR (r.state = 'processing' AND r.lease_expires_at_ms <= t.now)) \
                   AND ($6::bigint IS NULL OR (r.created_at_ms, r.key, r.scope) > ($6, $7, $8)) \
                 ORDER BY r.created_at_ms, r.key, r.scope LIMIT $5"
            ),
            sweep: format!(
                "WITH t AS (SELECT {NOW_MS} AS now) \
                 DELETE FROM {table} WHERE scope IN (SELECT e.scope FROM {table} e, t \
                   WHERE e.expires_at_ms <= t.now \
                     AND NOT (e.state = 'processing' AND e.lease_expires_at_ms > t.now) \
                   ORDER BY e.expires_at_ms LIMIT $1 FOR UPDATE OF e SKIP LOCKED)"
            ),
        }
    }
}

/// The server's start, as a row of the reserve or lock statement holds it.
pub(crate) fn started_ms(row: &sqlx::postgres::PgRow) -> Result<u64, StoreError> {
    let started: i64 = row.try_get("started_ms").map_err(failed)?;
    Ok(u64::try_from(started).unwrap_or(0))
}

pub(crate) fn valid_table(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() <= 50
}

/// Taken by [`PgStore::migrate`](crate::PgStore::migrate) before the
/// schema, in the same transaction (the table's name substituted like the
/// schema's).
pub(crate) const MIGRATE_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtext('idem migrate idem_records'));\n";

/// The `Retry-After` of a call that found every connection in use.
pub(crate) const BUSY_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// A driver error as a store error: a row that cannot be decoded is
/// corrupt, anything else is the database being unavailable.
/// A driver error in the store's terms: a server that could not be
/// reached, shut down or is starting (SQLSTATE classes 08 and 57P) is
/// unavailable; one that answered it has too many connections (53300) is
/// busy (up and serving others: never failed open); any other answer the
/// server gave (a missing table, a permission, a value it refuses) is
/// refused, which fail-open never covers; a row that does not decode is
/// corrupt.
pub(crate) fn failed(error: sqlx::Error) -> StoreError {
    match error {
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
            StoreError::Corrupt(error.to_string())
        }
        sqlx::Error::Database(ref database) => {
            let code = database.code().unwrap_or_default();
            if code == "53300" {
                StoreError::Busy {
                    retry_after: BUSY_RETRY_AFTER,
                }
            } else if code.starts_with("08") || code.starts_with("57P") {
                StoreError::unavailable(error)
            } else {
                StoreError::refused(error)
            }
        }
        sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::RowNotFound => StoreError::refused(error),
        // The pool's wait ran out (PgStoreBuilder::pool_timeout), its only
        // timeout here: busy, or, when the pool could not open a
        // connection, unavailable (PgStore::classified tells them apart;
        // every other busy answer, the database's own, stays busy).
        sqlx::Error::PoolTimedOut => StoreError::Timeout(Duration::ZERO),
        other => StoreError::unavailable(other),
    }
}

/// A claim's time to live in whole milliseconds, at least one, and small
/// enough to add to the clock.
pub(crate) fn claim_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis())
        .unwrap_or(i64::MAX / 2)
        .max(1)
}
