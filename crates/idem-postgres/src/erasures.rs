//! Erasures heard by every process: an erasure deletes the record's row
//! and, in the same transaction, sends `NOTIFY` on `<table>:erased` with
//! the scope (delivered when it commits); one listening connection per
//! store (`LISTEN`, on a connection of its own beside the store's pool) hears it and tells
//! the store's [`ErasureFeed`], which the layer's replay cache reads.
//!
//! The listener proves its connection every
//! [`HEARTBEAT`](idem_core::erasures::HEARTBEAT) with a query on it; one
//! that fails or takes longer than [`WINDOW`](idem_core::erasures::WINDOW),
//! or a lost connection, is a loss: the feed turns unhealthy (the caches
//! drop their copies and keep none) until it has listened again. Behind a
//! transaction pooler a session cannot `LISTEN`: such a store has no feed,
//! and its caches keep copies at most a second.

use idem_core::{
    ErasureFeed, ScopeHash,
    erasures::{HEARTBEAT, Subscriber, WINDOW},
};
use sqlx::{PgPool, postgres::PgListener};

/// The channel erasures are sent on.
pub(crate) fn channel(table: &str) -> String {
    format!("{table}:erased")
}

/// A store's erasure listener, started on first use.
#[derive(Default)]
pub(crate) struct Erasures {
    subscriber: Subscriber,
}

impl Erasures {
    /// The feed, its listener started on the first call (inside a tokio
    /// runtime; `None` outside one).
    pub(crate) fn feed(&self, pool: &PgPool, table: &str) -> Option<ErasureFeed> {
        self.subscriber.feed(|| {
            // A pool of its own: the listener keeps its connection, which
            // must not be one of the store's.
            let own = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(WINDOW)
                .connect_lazy_with(pool.connect_options().as_ref().clone());
            let channel = channel(table);
            Some(move |feed: ErasureFeed| {
                let (pool, channel) = (own.clone(), channel.clone());
                async move {
                    if let Err(error) = listen_once(&pool, &channel, &feed).await {
                        tracing::debug!(%error, "the erasures listener ended");
                    }
                }
            })
        })
    }
}

/// `what` within [`WINDOW`].
async fn bounded<T>(what: impl Future<Output = Result<T, sqlx::Error>>) -> Result<T, sqlx::Error> {
    tokio::time::timeout(WINDOW, what)
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
}

/// One listening connection, until it is lost.
async fn listen_once(pool: &PgPool, channel: &str, feed: &ErasureFeed) -> Result<(), sqlx::Error> {
    let mut listener = bounded(PgListener::connect_with(pool)).await?;
    bounded(listener.listen(channel)).await?;
    let mut beat = tokio::time::interval(HEARTBEAT);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            heard = listener.try_recv() => {
                let Some(notification) = heard? else {
                    return Ok(());
                };
                match ScopeHash::from_hex(notification.payload()) {
                    Some(scope) => feed.erased(scope),
                    None => tracing::warn!("an unreadable erasure notification; ignored"),
                }
            }
            _ = beat.tick() => {
                // Notifications that came before the answer are read first
                // (the listener buffers them), so the proof covers them.
                bounded(sqlx::query("SELECT 1").execute(&mut listener)).await?;
                while let Some(notification) = listener.next_buffered() {
                    if let Some(scope) = ScopeHash::from_hex(notification.payload()) {
                        feed.erased(scope);
                    }
                }
                feed.heard();
            }
        }
    }
}
