//! The sweep of expired records, a bounded batch per statement.

use std::time::Duration;

use idem_core::StoreError;

use crate::sql::failed;
use sqlx::PgPool;

/// The sweep task, aborted when the store's last handle is dropped.
pub(crate) type Sweeper = tokio_util::task::AbortOnDropHandle<()>;

/// What the background sweep needs (not the store, so that the task does
/// not keep the store alive).
pub(crate) struct Sweeping {
    pub(crate) pool: PgPool,
    /// Behind a pooler in transaction mode (`PgStoreBuilder::transaction_pooler`).
    pub(crate) pooled: bool,
    pub(crate) sql: String,
    pub(crate) batch: i64,
}

impl Sweeping {
    pub(crate) async fn every(self, every: Duration) {
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
    pub(crate) async fn run(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let statement = sqlx::query(&self.sql).bind(self.batch);
            let deleted = crate::on_pool!(self, statement, execute)
                .map_err(failed)?
                .rows_affected();
            total += deleted;
            if deleted < u64::try_from(self.batch).unwrap_or(u64::MAX) {
                return Ok(total);
            }
        }
    }
}
