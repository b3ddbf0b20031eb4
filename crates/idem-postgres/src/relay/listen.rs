//! The relay's wake-up: `LISTEN` on a connection of its own, on again
//! after a lost connection.

use std::{sync::Arc, time::Duration};

use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgListener, PgPoolOptions},
};
use tokio::sync::Notify;

/// Listens on `channel` and wakes the relay on each notification; on a
/// lost connection, listens again after a pause (the relay polls
/// meanwhile).
pub(super) async fn listen(options: PgConnectOptions, channel: String, wake: Arc<Notify>) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    loop {
        if let Err(error) = listen_once(&pool, &channel, &wake).await {
            tracing::debug!(%error, "the outbox listener lost its connection; listening again");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One listening connection, until it fails.
async fn listen_once(pool: &PgPool, channel: &str, wake: &Notify) -> Result<(), sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    // Events committed before the listener was up are found by the next
    // batch; wake once so that it runs now.
    wake.notify_one();
    loop {
        listener.recv().await?;
        wake.notify_one();
    }
}
