//! Reservations whose calls were given up before their answer: freed
//! by their owner token once the database answers.

use std::time::Duration;

use idem_core::{OwnerToken, ScopeHash, machine};

use crate::PgStore;

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
pub(crate) struct GivenUp {
    pub(crate) store: PgStore,
    pub(crate) conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    pub(crate) scope: ScopeHash,
    pub(crate) attempt: idem_core::AttemptId,
    pub(crate) token: OwnerToken,
    pub(crate) within: Duration,
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

/// A task tracker that is closed from the start, so that waiting on it
/// ends whenever it holds no task (it still tracks new ones).
pub(crate) fn closed_tracker() -> tokio_util::task::TaskTracker {
    let tracker = tokio_util::task::TaskTracker::new();
    tracker.close();
    tracker
}
