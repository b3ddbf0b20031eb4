//! A PostgreSQL [`Store`](idem_core::Store) for idem: the idempotency record lives in the
//! same database as the handler's data, and the handler's writes and the
//! outcome can commit in one transaction.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_postgres::PgStore;
//!
//! let store = PgStore::from_url("postgres://app@127.0.0.1/app")?;
//! store.migrate().await?; // or apply `sql/idem_records.sql` yourself
//! # Ok(()) }
//! ```
//!
//! # How records are kept
//!
//! One table (`idem_records` by default) holds one row per scope, indexed
//! by expiry. Time (lease lapse, retention) is the database's
//! `clock_timestamp()`, never the application's. Every write after the
//! reservation is fenced by generation and owner token in its `WHERE`.
//!
//! * A new key is one statement: an `INSERT … ON CONFLICT DO NOTHING` that
//!   also reads the row it collided with, so a replay, a conflict or a
//!   `409` is answered by the same round trip.
//! * Completion and renewal are one `UPDATE` each.
//! * Takeovers, releases, cancellations and fenced writes run the shared
//!   state machine ([`idem_core::machine`]) in a short transaction around
//!   `SELECT … FOR UPDATE` of the one row.
//! * A reservation runs on one connection it holds. Given up before its
//!   answer (the layer's store timeout, or the client went away), it
//!   leaves the connection to a task that, once the statement has run (a
//!   connection's statements run in order), releases the record if this
//!   reservation's owner token still holds it: a reservation held up behind
//!   a lock or a slow server never leaves an owner that nobody runs for a
//!   whole lease.
//! * PostgreSQL has no TTL: a background sweep deletes expired records in
//!   bounded batches (every minute by default, [`PgStoreBuilder::sweep_every`]),
//!   never one whose attempt still holds a live lease; [`PgStore::sweep`]
//!   runs one by hand.
//!
//! # Completion in the handler's transaction
//!
//! With the layer on a `PgStore`, a handler takes an [`IdemTransaction`]
//! (an axum extractor; the store must be in the router's state), writes its
//! rows in it and calls [`IdemTransaction::commit`]. Under the layer that
//! hands the transaction over: once the response is read, the layer writes
//! the outcome in the same transaction, fenced on the attempt's lease, and
//! one `COMMIT` makes the rows and the completed record durable, or
//! neither. An attempt that lost its lease (taken over, cancelled) commits
//! nothing. Without the layer (an unkeyed request) `commit` commits at once.
//!
//! # Events that leave with the write
//!
//! [`IdemTransaction::emit`] adds events to the transaction: they are
//! written to the outbox table (`<table>_outbox`) right before it commits,
//! after the fenced completion matched, so they commit with the handler's
//! writes and the record or not at all, and carry the record's scope and
//! the attempt's generation in their ids. The `relay` module (feature `relay`,
//! the `outbox-relay` binary in `examples/`) publishes them to NATS
//! JetStream in order, each once within the broker's duplicate window.
//! The guide's "Events that leave with the write" says what holds and how.

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

/// The crate's guide, shown in the rustdoc; its examples are compiled as
/// doctests.
pub mod guide {
    #![doc = include_str!("docs/guide.md")]
}

mod builder;
mod erasures;
mod given_up;
mod outbox;
#[cfg(feature = "relay")]
pub mod relay;
mod row;
mod sql;
mod store;
mod sweep;
mod tx;

use std::{fmt, sync::Arc, time::Duration};

use idem_core::{
    Lease, Outcome, OwnerToken, Record, Reservation, ReserveRequest, ScopeHash, StoreError, machine,
};
use sqlx::{PgPool, Row};

pub use builder::PgStoreBuilder;
pub use idem_core::IdentityClaim;
use sql::{NOW_MS, RESERVE_TRIES, Sql, claim_ms, failed, started_ms};
use sweep::{Sweeper, Sweeping};
pub use tx::{CommitError, EmitError, IdemTransaction};

/// The SQL that creates the records table, its index, its identity table
/// (`idem_records_identity`) and its duties table (`idem_records_duties`,
/// see [`PgStore::claim_duty`]), for the default table name
/// `idem_records` (what [`PgStore::migrate`] runs).
pub const SCHEMA: &str = include_str!("../sql/idem_records.sql");

/// A configuration the store cannot use.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgConfigError {
    /// The connection URL could not be parsed.
    #[error("invalid PostgreSQL URL: {0}")]
    Url(#[source] sqlx::Error),
    /// The table name is not a plain lower-case SQL identifier.
    #[error(
        "invalid table name {0:?}: use a lower-case SQL identifier of at most 50 characters \
         (letters, digits, _)"
    )]
    Table(String),
    /// Neither a URL nor a pool was given.
    #[error("no PostgreSQL URL or pool was given")]
    NoDatabase,
}

struct Inner {
    pool: PgPool,
    sql: Sql,
    sweep_batch: i64,
    /// Behind a pooler in transaction mode (see
    /// [`PgStoreBuilder::transaction_pooler`]).
    pooled: bool,
    _sweeper: Option<Sweeper>,
    /// Tasks freeing reservations whose calls were given up.
    given_up: tokio_util::task::TaskTracker,
    /// Erasures heard from every process (`erasures.rs`).
    erasures: erasures::Erasures,
}

/// The PostgreSQL store. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.sql.table)
            .finish_non_exhaustive()
    }
}

/// Runs `$query` with `$run` (`fetch_one`, `execute`, ...) on the pool, or,
/// behind a pooler in transaction mode, unnamed inside a transaction of its
/// own (see [`PgStoreBuilder::transaction_pooler`]); a `sqlx::Error` on
/// failure.
macro_rules! on_pool {
    ($inner:expr, $query:expr, $run:ident) => {{
        let inner = &$inner;
        if inner.pooled {
            async {
                let mut tx = inner.pool.begin().await?;
                let out = $query.persistent(false).$run(&mut *tx).await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>(out)
            }
            .await
        } else {
            $query.$run(&inner.pool).await
        }
    }};
}
pub(crate) use on_pool;

impl PgStore {
    /// A builder with the defaults.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder {
            url: None,
            pool: None,
            table: "idem_records".to_owned(),
            max_connections: 16,
            pooled: false,
            pool_timeout: Duration::from_millis(500),
            sweep_every: Some(Duration::from_secs(60)),
            sweep_batch: 1_000,
        }
    }

    /// A store on this URL with the defaults.
    pub fn from_url(url: &str) -> Result<Self, PgConfigError> {
        Self::builder().url(url).build()
    }

    /// A store on the application's pool with the defaults.
    pub fn from_pool(pool: PgPool) -> Self {
        PgStore::builder()
            .pool(pool)
            .build()
            .unwrap_or_else(|_| unreachable!("the default table name is valid"))
    }

    /// Whether the store runs behind a transaction pooler.
    pub(crate) fn pooled(&self) -> bool {
        self.inner.pooled
    }

    /// The pool the store uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The records table's name.
    pub fn table(&self) -> &str {
        &self.inner.sql.table
    }

    /// Creates the records table and its index if they do not exist
    /// ([`SCHEMA`] with the configured table name). Processes that start
    /// together may all call it: the statements run as one transaction
    /// under a transaction-scoped advisory lock named after the table, so
    /// one creates and the others find the tables there (two concurrent
    /// `CREATE TABLE IF NOT EXISTS` would otherwise both create, and one
    /// fail on a unique index of the catalog). The lock ends with the
    /// transaction, so it holds behind a transaction pooler too.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let schema = [sql::MIGRATE_LOCK, SCHEMA]
            .concat()
            .replace("idem_records", self.table());
        sqlx::raw_sql(&schema)
            .execute(self.pool())
            .await
            .map_err(failed)?;
        Ok(())
    }

    /// Claims the fleet-wide chore `duty` for `holder` for `ttl` (see
    /// [`Fleet::claim_duty`](idem_core::Fleet::claim_duty)): taken when no one holds it or its claim
    /// lapsed, extended to `ttl` from now when `holder` holds it. The
    /// claims live in the duties table [`migrate`](Self::migrate) creates
    /// (`<table>_duties`).
    pub async fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.classified(async {
            let table = format!("{}_duties", self.table());
            let claim = format!(
                "INSERT INTO {table} AS held (name, holder, expires_at_ms) \
                 VALUES ($1, $2, {NOW_MS} + $3) \
                 ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, \
                   expires_at_ms = EXCLUDED.expires_at_ms \
                 WHERE held.holder = EXCLUDED.holder OR held.expires_at_ms <= {NOW_MS} \
                 RETURNING holder"
            );
            let millis = claim_ms(ttl);
            let query = sqlx::query_scalar(&claim)
                .bind(duty)
                .bind(holder)
                .bind(millis);
            let claimed: Option<String> =
                on_pool!(self.inner, query, fetch_optional).map_err(failed)?;
            Ok(claimed.is_some())
        })
        .await
    }

    /// Claims the table for `marker`, a short text naming how the
    /// instances sharing it derive tenants and scopes (see
    /// [`IdentityClaim`]).
    ///
    /// An unclaimed table, one whose claim lapsed, or one claimed with the
    /// same marker is claimed for `ttl` (the retention: as long as the
    /// newest record may live), extended and never shortened. With
    /// `replace`, the marker takes the table whatever it held. The claim
    /// lives in the identity table [`migrate`](Self::migrate) creates
    /// (`<table>_identity`).
    pub async fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> Result<IdentityClaim, StoreError> {
        self.classified(async {
            let table = format!("{}_identity", self.table());
            let claim = format!(
                "INSERT INTO {table} AS held (id, marker, expires_at_ms) \
                 VALUES (true, $1, {NOW_MS} + $2) \
                 ON CONFLICT (id) DO UPDATE SET marker = EXCLUDED.marker, \
                   expires_at_ms = CASE WHEN held.marker = EXCLUDED.marker \
                     THEN GREATEST(held.expires_at_ms, EXCLUDED.expires_at_ms) \
                     ELSE EXCLUDED.expires_at_ms END \
                 WHERE $3 OR held.marker = EXCLUDED.marker OR held.expires_at_ms <= {NOW_MS} \
                 RETURNING marker"
            );
            let millis = claim_ms(ttl);
            let query = sqlx::query_scalar(&claim)
                .bind(marker)
                .bind(millis)
                .bind(replace);
            let claimed: Option<String> =
                on_pool!(self.inner, query, fetch_optional).map_err(failed)?;
            if claimed.is_some() {
                return Ok(IdentityClaim::Held);
            }
            let read = format!("SELECT marker FROM {table}");
            let query = sqlx::query_scalar(&read);
            let held: Option<String> =
                on_pool!(self.inner, query, fetch_optional).map_err(failed)?;
            Ok(match held {
                Some(other) if other != marker => IdentityClaim::Other(other),
                // A twin claimed it with the same marker meanwhile (nothing
                // deletes the row, so it is there).
                _ => IdentityClaim::Held,
            })
        })
        .await
    }

    /// Deletes every expired record (in batches) and answers how many. A
    /// record whose attempt still holds a live lease is never deleted.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        self.classified(async {
            Sweeping {
                pool: self.inner.pool.clone(),
                sql: self.inner.sql.sweep.clone(),
                batch: self.inner.sweep_batch,
                pooled: self.inner.pooled,
            }
            .run()
            .await
        })
        .await
    }

    /// The fenced completion `UPDATE` of `lease` with `outcome`, to run on
    /// any executor (the pool, or a handler's transaction).
    fn complete_query<'q>(
        &'q self,
        lease: &Lease,
        outcome: &Outcome,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let (status, stored, names, values, body) = row::outcome_columns(outcome);
        sqlx::query(&self.inner.sql.complete)
            .persistent(!self.inner.pooled)
            .bind(lease.scope.as_bytes().to_vec())
            .bind(row::ms(lease.generation))
            .bind(lease.token.0)
            .bind(status)
            .bind(stored)
            .bind(names)
            .bind(values)
            .bind(body)
    }

    /// A reservation's statements, on the connection its guard holds.
    async fn reserve_on(
        &self,
        conn: &mut sqlx::PgConnection,
        request: &ReserveRequest,
        attempt: idem_core::AttemptId,
        token: OwnerToken,
    ) -> Result<Reservation, StoreError> {
        let scope = *request.scope.hash();
        let lease_ms = row::ms(u64::try_from(request.lease.as_millis()).unwrap_or(u64::MAX));
        let retention_ms =
            row::ms(u64::try_from(request.retention.as_millis()).unwrap_or(u64::MAX));
        for _ in 0..RESERVE_TRIES {
            let query = sqlx::query(&self.inner.sql.reserve)
                .bind(scope.as_bytes().to_vec())
                .bind(row::stored_tenant(request.scope.tenant()))
                .bind(request.scope.operation())
                .bind(request.scope.key().as_str())
                .bind(request.fingerprint.as_bytes().to_vec())
                .bind(token.0)
                .bind(lease_ms)
                .bind(retention_ms)
                .bind(attempt.0);
            let found = if self.inner.pooled {
                let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(failed)?;
                let found = query
                    .persistent(false)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(failed)?;
                tx.commit().await.map_err(failed)?;
                found
            } else {
                query.fetch_one(&mut *conn).await.map_err(failed)?
            };
            let inserted: i64 = found.try_get("inserted").map_err(failed)?;
            if inserted == 1 {
                return Ok(Reservation::Acquired(Lease {
                    scope,
                    attempt,
                    generation: 1,
                    token,
                    ttl: request.lease,
                }));
            }
            let existing: Option<Vec<u8>> = found.try_get("scope").map_err(failed)?;
            if existing.is_some() {
                // Answers that change nothing (a replay, a conflict, a live
                // lease, a cancellation) come from the row just read.
                let now: i64 = found.try_get("now_ms").map_err(failed)?;
                let mut slot = Some(row::decode(&found)?);
                machine::lease_after_start(&mut slot, started_ms(&found)?);
                let now_ms = u64::try_from(now).unwrap_or(0);
                match machine::reserve(&mut slot, request, now_ms, attempt, token) {
                    Reservation::Acquired(_) | Reservation::TakenOver { .. } => {}
                    unchanged => return Ok(unchanged),
                }
            }
            let locked = self
                .locked_on(conn, &scope, |slot, now_ms| {
                    machine::reserve(slot, request, now_ms, attempt, token)
                })
                .await?;
            if let Ok(reservation) = locked {
                return Ok(reservation);
            }
        }
        // The database answered every time: busy (a sweep racing the
        // reservation), never an outage that fail-open could cover.
        tracing::warn!("the record kept vanishing between reading and locking it");
        Err(StoreError::Busy {
            retry_after: std::time::Duration::from_secs(1),
        })
    }

    /// Runs one transition of the state machine on the locked row of
    /// `scope` and writes the record back if it changed; `Err(apply)`,
    /// untouched, when there is no row (a reservation then tries its insert
    /// again rather than race another inserter).
    async fn locked<T, F>(&self, scope: &ScopeHash, apply: F) -> Result<Result<T, F>, StoreError>
    where
        F: FnOnce(&mut Option<Record>, u64) -> T,
    {
        let mut conn = self.inner.pool.acquire().await.map_err(failed)?;
        self.locked_on(&mut conn, scope, apply).await
    }

    /// [`locked`](Self::locked) on a connection the caller holds.
    async fn locked_on<T, F>(
        &self,
        conn: &mut sqlx::PgConnection,
        scope: &ScopeHash,
        apply: F,
    ) -> Result<Result<T, F>, StoreError>
    where
        F: FnOnce(&mut Option<Record>, u64) -> T,
    {
        let mut tx = sqlx::Connection::begin(conn).await.map_err(failed)?;
        let found = sqlx::query(&self.inner.sql.lock)
            .persistent(!self.inner.pooled)
            .bind(scope.as_bytes().to_vec())
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
        let Some(found) = found else {
            return Ok(Err(apply));
        };
        let now: i64 = found.try_get("now_ms").map_err(failed)?;
        let before = row::decode(&found)?;
        let mut slot = Some(before.clone());
        machine::lease_after_start(&mut slot, started_ms(&found)?);
        let answer = apply(&mut slot, u64::try_from(now).unwrap_or(0));
        match &slot {
            Some(record) if *record == before => {}
            Some(record) => {
                let update = sqlx::query(&self.inner.sql.update).persistent(!self.inner.pooled);
                row::bind_record(update, record)?
                    .bind(row::ms(before.generation))
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
            None => {
                sqlx::query(&self.inner.sql.delete)
                    .persistent(!self.inner.pooled)
                    .bind(scope.as_bytes().to_vec())
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
                // Every process's replay cache forgets it, once this
                // commits (`erasures.rs`).
                sqlx::query("SELECT pg_notify($1, $2)")
                    .persistent(!self.inner.pooled)
                    .bind(&self.inner.sql.erased)
                    .bind(scope.to_hex())
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
        }
        tx.commit().await.map_err(failed)?;
        Ok(Ok(answer))
    }

    /// A transition that never creates a record (all but a reservation):
    /// on the locked row, or on an empty slot when there is none (nothing
    /// to write then, and no clock to read).
    async fn transition<T>(
        &self,
        scope: &ScopeHash,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> Result<T, StoreError> {
        Ok(match self.locked(scope, apply).await? {
            Ok(answer) => answer,
            Err(apply) => apply(&mut None, 0),
        })
    }

    /// `call`'s answer, with a pool's wait that ran out told apart (every
    /// call of the store that returns its errors goes through here): busy
    /// ([`StoreError::Busy`], never failed open) when every connection the
    /// pool may open is open, or unavailable when it could not open one (a
    /// database that cannot be reached makes the wait run out too).
    pub(crate) async fn classified<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match call.await {
            // The pool's wait ran out (`failed`): the only timeout the
            // store's calls answer.
            Err(StoreError::Timeout(_)) => {
                let pool = &self.inner.pool;
                if pool.size() < pool.options().get_max_connections() {
                    Err(self.why_no_connection().await)
                } else {
                    tracing::warn!("every connection of the idempotency store's pool is in use");
                    metrics::counter!("idem_store_pool_timeouts_total").increment(1);
                    Err(StoreError::Busy {
                        retry_after: sql::BUSY_RETRY_AFTER,
                    })
                }
            }
            answer => answer,
        }
    }

    /// Why the pool could not open a connection: one connection is tried
    /// directly (bounded by the pool's own wait), whose error the pool
    /// hides. A database that answered (too many connections: busy; a
    /// refused login or a missing database: refused) is never an outage,
    /// so fail-open never covers it; one that could not be reached is
    /// unavailable.
    async fn why_no_connection(&self) -> StoreError {
        use sqlx::Connection;
        let unreachable = || {
            StoreError::unavailable(
                "could not open a connection to PostgreSQL within the pool timeout",
            )
        };
        let options = self.inner.pool.connect_options();
        let bound = self.inner.pool.options().get_acquire_timeout();
        match tokio::time::timeout(bound, sqlx::PgConnection::connect_with(&options)).await {
            Ok(Err(error @ sqlx::Error::Database(_))) => failed(error),
            Ok(Ok(connection)) => {
                // It opens now: the pool's wait was the outage, gone since.
                let _ = connection.close().await;
                unreachable()
            }
            _ => unreachable(),
        }
    }

    /// A fenced one-statement write: whether the row was written.
    async fn fenced_write(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<bool, StoreError> {
        let done = on_pool!(self.inner, query, execute)
            .map_err(failed)?
            .rows_affected();
        Ok(done == 1)
    }
}
