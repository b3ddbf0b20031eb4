//! The store's builder: URL, table, pool, sweep.

use std::{sync::Arc, time::Duration};

use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};

use crate::{
    Inner, PgConfigError, PgStore,
    given_up::closed_tracker,
    sql::{Sql, valid_table},
    sweep::{Sweeper, Sweeping},
};

/// Builds a [`PgStore`].
#[derive(Debug)]
pub struct PgStoreBuilder {
    pub(crate) url: Option<String>,
    pub(crate) pool: Option<PgPool>,
    pub(crate) table: String,
    pub(crate) max_connections: u32,
    pub(crate) sweep_every: Option<Duration>,
    pub(crate) sweep_batch: u32,
    pub(crate) pooled: bool,
    pub(crate) pool_timeout: Duration,
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
    /// holds an [`IdemTransaction`](crate::IdemTransaction) holds one connection while it runs.
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// How long a store call waits for a connection of the pool when
    /// every one is in use (default 500 ms; connecting by URL). Then the
    /// call fails as [`StoreError::Busy`](idem_core::StoreError::Busy): the
    /// layer answers `503` with `Retry-After: 1`, and fail-open does not
    /// run the request unprotected (the database is up, only busy). Keep
    /// it below the layer's store timeout (1 s by default): a call the
    /// layer times out first is a timeout, which fail-open covers.
    pub fn pool_timeout(mut self, timeout: Duration) -> Self {
        self.pool_timeout = timeout;
        self
    }

    /// Whether the store reaches PostgreSQL through a pooler in
    /// transaction mode, such as PgBouncer with `pool_mode = transaction`
    /// (default `false`). There each transaction may run on another server
    /// connection, so nothing may outlive one: the store then prepares its
    /// statements unnamed (no statement cache) and runs each inside a
    /// transaction of its own (the extended protocol's two steps, parse and
    /// execute, on one server connection), which costs a `BEGIN` and a
    /// `COMMIT` per call. An [`IdemTransaction`](crate::IdemTransaction) is
    /// one transaction either way; statements a handler runs in it should
    /// be unnamed too (`.persistent(false)`).
    pub fn transaction_pooler(mut self, pooled: bool) -> Self {
        self.pooled = pooled;
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
                    .acquire_timeout(self.pool_timeout)
                    .connect_lazy_with(
                        options
                            .application_name("idem")
                            .statement_cache_capacity(if self.pooled { 0 } else { 100 }),
                    )
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
                    pooled: self.pooled,
                };
                Sweeper::new(runtime.spawn(sweeping.every(every)))
            });
        Ok(PgStore {
            inner: Arc::new(Inner {
                pool,
                sql,
                sweep_batch,
                pooled: self.pooled,
                _sweeper: sweeper,
                given_up: closed_tracker(),
                erasures: Default::default(),
            }),
        })
    }
}
