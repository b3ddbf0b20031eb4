//! A PostgreSQL [`Store`] for idem: the idempotency record lives in the
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

mod row;
mod tx;

use std::{fmt, sync::Arc, time::Duration};

use idem_core::{
    Cancellation, Completion, Fleet, ForceRelease, Lease, Outcome, OwnerToken, Record, RecordQuery,
    RecordsAdmin, Release, Renewal, Reservation, ReserveRequest, ScopeHash, Store, StoreError,
    machine,
};
use sqlx::{
    PgPool, Row,
    postgres::{PgConnectOptions, PgPoolOptions},
};

pub use idem_core::IdentityClaim;
pub use tx::{CommitError, IdemTransaction};

/// The SQL that creates the records table, its index, its identity table
/// (`idem_records_identity`) and its duties table (`idem_records_duties`,
/// see [`PgStore::claim_duty`]), for the default table name
/// `idem_records` (what [`PgStore::migrate`] runs).
pub const SCHEMA: &str = include_str!("../sql/idem_records.sql");

/// The database's clock, in milliseconds since the epoch.
const NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// When the server started, in the same milliseconds: after a restart a
/// lease counts as running until at least a lease after it
/// (`machine::lease_after_start`).
const STARTED_MS: &str = "(extract(epoch FROM pg_postmaster_start_time()) * 1000)::bigint";

/// How many times a reservation retries when its row vanished (swept)
/// between two statements.
const RESERVE_TRIES: usize = 5;

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

/// The statements, with the table name in place.
struct Sql {
    table: String,
    reserve: String,
    complete: String,
    renew: String,
    lock: String,
    read: String,
    update: String,
    delete: String,
    sweep: String,
    list: String,
}

impl Sql {
    fn new(table: &str) -> Self {
        let fence = "r.scope = $1 AND r.state = 'processing' AND r.generation = $2 \
                     AND r.owner = $3 AND r.expires_at_ms > t.now";
        let selected = row::SELECTED;
        Self {
            table: table.to_owned(),
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
                       AND a->'outcome'->>'kind' = 'running' \
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
                 ORDER BY r.created_at_ms, r.key LIMIT $5"
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
fn started_ms(row: &sqlx::postgres::PgRow) -> Result<u64, StoreError> {
    let started: i64 = row.try_get("started_ms").map_err(failed)?;
    Ok(u64::try_from(started).unwrap_or(0))
}

fn valid_table(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() <= 50
}

/// Frees a reservation whose caller gave up before its answer (the call
/// timed out, or the client went away): on drop, while it still holds the
/// connection the reservation's statements went out on, it releases the
/// record if this reservation's owner token still holds it, on that same
/// connection, which runs it after them (a connection's statements run in
/// order; an unfinished transaction is rolled back first). So a reservation
/// held up behind a lock or a slow server never leaves an owner that nobody
/// runs for a whole lease. Bounded by the lease, after which a takeover
/// frees the key anyway. A given-up takeover is freed as it found the
/// record, its lease lapsed, not released (`machine::abandon`): the attempt
/// it superseded may have acted, so a changed request still conflicts.
struct GivenUp {
    store: PgStore,
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    scope: ScopeHash,
    attempt: idem_core::AttemptId,
    token: OwnerToken,
    within: Duration,
}

impl Drop for GivenUp {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, scope, attempt, token) =
            (self.store.clone(), self.scope, self.attempt, self.token);
        let within = self.within;
        let tasks = self.store.inner.given_up.clone();
        tasks.spawn_on(async move {
            let free = store.locked_on(&mut conn, &scope, |slot, now_ms| {
                machine::abandon(slot, attempt, token, now_ms)
            });
            match tokio::time::timeout(within, free).await {
                Ok(Ok(Ok(true))) => tracing::info!("a given-up reservation was freed"),
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, "a given-up reservation could not be freed; its lease will lapse");
                }
                Err(_) => {
                    tracing::warn!("a given-up reservation could not be freed in time; its lease will lapse");
                }
            }
        }, &runtime);
    }
}

/// A claim's time to live in whole milliseconds, at least one, and small
/// enough to add to the clock.
fn claim_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis())
        .unwrap_or(i64::MAX / 2)
        .max(1)
}

/// A task tracker that is closed from the start, so that waiting on it
/// ends whenever it holds no task (it still tracks new ones).
fn closed_tracker() -> tokio_util::task::TaskTracker {
    let tracker = tokio_util::task::TaskTracker::new();
    tracker.close();
    tracker
}

/// Aborts the sweep task when the store's last handle is dropped.
struct Sweeper(tokio::task::JoinHandle<()>);

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Inner {
    pool: PgPool,
    sql: Sql,
    sweep_batch: i64,
    _sweeper: Option<Sweeper>,
    /// Tasks freeing reservations whose calls were given up.
    given_up: tokio_util::task::TaskTracker,
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

/// Builds a [`PgStore`].
#[derive(Debug)]
pub struct PgStoreBuilder {
    url: Option<String>,
    pool: Option<PgPool>,
    table: String,
    max_connections: u32,
    sweep_every: Option<Duration>,
    sweep_batch: u32,
}

impl PgStoreBuilder {
    /// Connects to this URL (`postgres://user:password@host:port/db`,
    /// lazily: the first store call opens the first connection).
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// Uses this pool (the application's own, say) instead of a URL.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The records table (default `idem_records`): a plain lower-case
    /// identifier, resolved through the connection's `search_path`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The pool size when connecting by URL (default 16). A handler that
    /// holds an [`IdemTransaction`] holds one connection while it runs.
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// How often the background sweep deletes expired records (default
    /// every 60 s; `None` for no background sweep, for example when a job
    /// calls [`PgStore::sweep`]). The sweep starts when the store is built
    /// inside a tokio runtime.
    pub fn sweep_every(mut self, every: Option<Duration>) -> Self {
        self.sweep_every = every.filter(|every| !every.is_zero());
        self
    }

    /// How many records one sweep statement deletes at most (default
    /// 1,000); a sweep runs statements until one deletes fewer.
    pub fn sweep_batch(mut self, batch: u32) -> Self {
        self.sweep_batch = batch.max(1);
        self
    }

    /// Builds the store.
    pub fn build(self) -> Result<PgStore, PgConfigError> {
        if !valid_table(&self.table) {
            return Err(PgConfigError::Table(self.table));
        }
        let pool = match (self.pool, self.url) {
            (Some(pool), _) => pool,
            (None, Some(url)) => {
                let options: PgConnectOptions = url.parse().map_err(PgConfigError::Url)?;
                PgPoolOptions::new()
                    .max_connections(self.max_connections)
                    .acquire_timeout(Duration::from_secs(5))
                    .connect_lazy_with(options.application_name("idem"))
            }
            (None, None) => return Err(PgConfigError::NoDatabase),
        };
        let sql = Sql::new(&self.table);
        let sweep_batch = i64::from(self.sweep_batch);
        let sweeper = self
            .sweep_every
            .zip(tokio::runtime::Handle::try_current().ok())
            .map(|(every, runtime)| {
                let sweeping = Sweeping {
                    pool: pool.clone(),
                    sql: sql.sweep.clone(),
                    batch: sweep_batch,
                };
                Sweeper(runtime.spawn(sweeping.every(every)))
            });
        Ok(PgStore {
            inner: Arc::new(Inner {
                pool,
                sql,
                sweep_batch,
                _sweeper: sweeper,
                given_up: closed_tracker(),
            }),
        })
    }
}

/// What the background sweep needs (not the store, so that the task does
/// not keep the store alive).
struct Sweeping {
    pool: PgPool,
    sql: String,
    batch: i64,
}

impl Sweeping {
    async fn every(self, every: Duration) {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            match self.run().await {
                Ok(0) => {}
                Ok(deleted) => tracing::debug!(deleted, "swept expired idempotency records"),
                Err(error) => tracing::warn!(%error, "sweeping expired idempotency records failed"),
            }
        }
    }

    /// Deletes expired records, a bounded batch per statement, until a
    /// statement deletes fewer than a batch.
    async fn run(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = sqlx::query(&self.sql)
                .bind(self.batch)
                .execute(&self.pool)
                .await
                .map_err(failed)?
                .rows_affected();
            total += deleted;
            if deleted < u64::try_from(self.batch).unwrap_or(u64::MAX) {
                return Ok(total);
            }
        }
    }
}

/// A driver error as a store error: a row that cannot be decoded is
/// corrupt, anything else is the database being unavailable.
/// A driver error in the store's terms: a server that could not be
/// reached, shut down or is starting (SQLSTATE classes 08 and 57P, too
/// many connections) is unavailable; any other answer the server gave (a
/// missing table, a permission, a value it refuses) is refused, which
/// fail-open never covers; a row that does not decode is corrupt.
fn failed(error: sqlx::Error) -> StoreError {
    match error {
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => {
            StoreError::Corrupt(error.to_string())
        }
        sqlx::Error::Database(ref database) => {
            let code = database.code().unwrap_or_default();
            if code.starts_with("08") || code.starts_with("57P") || code == "53300" {
                StoreError::unavailable(error)
            } else {
                StoreError::refused(error)
            }
        }
        sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::RowNotFound => StoreError::refused(error),
        other => StoreError::unavailable(other),
    }
}

impl PgStore {
    /// A builder with the defaults.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder {
            url: None,
            pool: None,
            table: "idem_records".to_owned(),
            max_connections: 16,
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

    /// The pool the store uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The records table's name.
    pub fn table(&self) -> &str {
        &self.inner.sql.table
    }

    /// Creates the records table and its index if they do not exist
    /// ([`SCHEMA`] with the configured table name).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let schema = SCHEMA.replace("idem_records", self.table());
        sqlx::raw_sql(&schema)
            .execute(self.pool())
            .await
            .map_err(failed)?;
        Ok(())
    }

    /// Claims the fleet-wide chore `duty` for `holder` for `ttl` (see
    /// [`Fleet::claim_duty`]): taken when no one holds it or its claim
    /// lapsed, extended to `ttl` from now when `holder` holds it. The
    /// claims live in the duties table [`migrate`](Self::migrate) creates
    /// (`<table>_duties`).
    pub async fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
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
        let claimed: Option<String> = sqlx::query_scalar(&claim)
            .bind(duty)
            .bind(holder)
            .bind(millis)
            .fetch_optional(self.pool())
            .await
            .map_err(failed)?;
        Ok(claimed.is_some())
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
        let claimed: Option<String> = sqlx::query_scalar(&claim)
            .bind(marker)
            .bind(millis)
            .bind(replace)
            .fetch_optional(self.pool())
            .await
            .map_err(failed)?;
        if claimed.is_some() {
            return Ok(IdentityClaim::Held);
        }
        let held: Option<String> = sqlx::query_scalar(&format!("SELECT marker FROM {table}"))
            .fetch_optional(self.pool())
            .await
            .map_err(failed)?;
        Ok(match held {
            Some(other) if other != marker => IdentityClaim::Other(other),
            // A twin claimed it with the same marker meanwhile (nothing
            // deletes the row, so it is there).
            _ => IdentityClaim::Held,
        })
    }

    /// Deletes every expired record (in batches) and answers how many. A
    /// record whose attempt still holds a live lease is never deleted.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        Sweeping {
            pool: self.inner.pool.clone(),
            sql: self.inner.sql.sweep.clone(),
            batch: self.inner.sweep_batch,
        }
        .run()
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
            let found = sqlx::query(&self.inner.sql.reserve)
                .bind(scope.as_bytes().to_vec())
                .bind(row::stored_tenant(request.scope.tenant()))
                .bind(request.scope.operation())
                .bind(request.scope.key().as_str())
                .bind(request.fingerprint.as_bytes().to_vec())
                .bind(token.0)
                .bind(lease_ms)
                .bind(retention_ms)
                .bind(attempt.0)
                .fetch_one(&mut *conn)
                .await
                .map_err(failed)?;
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
        Err(StoreError::unavailable(
            "the record kept vanishing between reading and locking it",
        ))
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
                row::bind_record(sqlx::query(&self.inner.sql.update), record)?
                    .bind(row::ms(before.generation))
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
            None => {
                sqlx::query(&self.inner.sql.delete)
                    .bind(scope.as_bytes().to_vec())
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

    /// A fenced one-statement write: whether the row was written.
    async fn fenced_write(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<bool, StoreError> {
        let done = query
            .execute(&self.inner.pool)
            .await
            .map_err(failed)?
            .rows_affected();
        Ok(done == 1)
    }
}

impl Store for PgStore {
    /// A handler's transaction on this database completes the record
    /// ([`IdemTransaction`]).
    fn completes_in_transactions(&self) -> bool {
        true
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        self.inner.given_up.wait()
    }

    fn background_tasks(&self) -> usize {
        self.inner.given_up.len()
    }

    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let attempt = idem_core::AttemptId::new();
        let token = OwnerToken::new();
        let conn = self.inner.pool.acquire().await.map_err(failed)?;
        // From here a statement may reach the server: given up (dropped)
        // before its answer, the guard frees what it may have reserved.
        let mut guard = GivenUp {
            store: self.clone(),
            conn: None,
            scope: *request.scope.hash(),
            attempt,
            token,
            within: request.lease,
        };
        let conn = guard.conn.insert(conn);
        let answer = self.reserve_on(conn, request, attempt, token).await;
        // Answered: the caller owns what it reserved. An error leaves the
        // guard armed: whatever landed before it is freed.
        if answer.is_ok() {
            guard.conn = None;
        }
        answer
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        let ttl = row::ms(u64::try_from(lease.ttl.as_millis()).unwrap_or(u64::MAX));
        let query = sqlx::query(&self.inner.sql.renew)
            .bind(lease.scope.as_bytes().to_vec())
            .bind(row::ms(lease.generation))
            .bind(lease.token.0)
            .bind(ttl);
        if self.fenced_write(query).await? {
            return Ok(Renewal::Renewed);
        }
        self.transition(&lease.scope, |slot, now_ms| {
            machine::renew(slot, lease, now_ms)
        })
        .await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        if self
            .fenced_write(self.complete_query(lease, outcome))
            .await?
        {
            return Ok(Completion::Recorded);
        }
        self.transition(&lease.scope, |slot, now_ms| {
            machine::complete(slot, lease, outcome, now_ms)
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        self.transition(&lease.scope, |slot, now_ms| {
            machine::release(slot, lease, now_ms)
        })
        .await
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        self.transition(scope, machine::cancel).await
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        let found = sqlx::query(&self.inner.sql.read)
            .bind(scope.as_bytes().to_vec())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(failed)?;
        let Some(found) = found else {
            return Ok(None);
        };
        let now: i64 = found.try_get("now_ms").map_err(failed)?;
        let record = row::decode(&found)?;
        Ok((!record.is_expired(u64::try_from(now).unwrap_or(0))).then_some(record))
    }
}

impl RecordsAdmin for PgStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let older = query.older_than.map_or(0, |age| {
            row::ms(u64::try_from(age.as_millis()).unwrap_or(u64::MAX))
        });
        let rows = sqlx::query(&self.inner.sql.list)
            .bind(query.tenant.as_deref().map(row::stored_tenant))
            .bind(query.state.map(|state| state.as_str()))
            .bind(older)
            .bind(query.lapsed)
            .bind(i64::try_from(query.limit).unwrap_or(i64::MAX))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(failed)?;
        rows.iter().map(row::decode).collect()
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        self.transition(scope, machine::force_release).await
    }
}

impl Fleet for PgStore {
    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        PgStore::claim_identity(self, marker, ttl, replace)
    }

    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        PgStore::claim_duty(self, duty, holder, ttl)
    }
}
