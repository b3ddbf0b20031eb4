//! A reservation whose caller gave up before its answer: freed by its
//! owner token once the server answers.

use std::time::Duration;

use idem_core::ScopeHash;

use crate::RedisStore;
use crate::{invocation::Invocation, pool::Conn};

/// Frees a reservation whose call was given up after its script was sent:
/// on drop, while it still holds the connection the script went out on, it
/// sends the abandon script on that same connection, which the server runs
/// after the reservation (one connection's commands run in order), so a
/// reservation queued behind a paused server never leaves an owner that
/// nobody runs. Once that connection has dropped, the reservation either
/// ran or never will, and the abandon goes out on fresh connections, from
/// a detached task (a shutdown does not wait for it while the server is
/// down). It is retried, backing off to two tries a second, until the
/// server answers or `within` (the record's retention) passed: a lease
/// can run a lease past a restart of the server, so the lease alone does
/// not bound it. The script frees the record only while this attempt and
/// owner token hold it: a late abandon changes nothing else.
pub(crate) struct Abandon<'s> {
    /// The store: its abandon script, its key prefix and its tasks that
    /// free given-up reservations
    /// ([`Store::settled`](idem_core::Store::settled) waits for them).
    pub(crate) store: &'s RedisStore,
    /// The record's scope (its key is written only if the reservation is
    /// abandoned).
    pub(crate) scope: ScopeHash,
    pub(crate) attempt: uuid::Uuid,
    pub(crate) token: uuid::Uuid,
    pub(crate) conn: Option<Conn>,
    pub(crate) within: Duration,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (script, prefix, scope, within, pool) = (
            std::sync::Arc::clone(&self.store.scripts.abandon),
            self.store.prefix.clone(),
            self.scope,
            self.within,
            self.store.pool.clone(),
        );
        let (attempt, token) = (self.attempt, self.token);
        let task = async move {
            let deadline = tokio::time::Instant::now() + within;
            let abandon = async move |conn: &mut Conn| {
                let mut invocation = Invocation::on_record(&script, &prefix, &scope);
                invocation.uuid(&attempt).uuid(&token);
                let answer = invocation.invoke(conn).await?;
                crate::string_record::converting(answer, &invocation, conn).await
            };
            let mut pause = Duration::from_millis(100);
            let on_its_connection = async {
                loop {
                    match abandon(&mut conn).await {
                        Ok(_) => return true,
                        // A single server's multiplexed connection that
                        // dropped never carries a command again (it does
                        // not reconnect).
                        Err(error)
                            if matches!(conn, Conn::Single(_)) && error.is_connection_dropped() =>
                        {
                            tracing::debug!(%error, "the given-up reservation's connection is gone");
                            return false;
                        }
                        Err(error) => {
                            tracing::debug!(%error, "abandoning a given-up reservation failed; retrying");
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_millis(500));
                        }
                    }
                }
            };
            match tokio::time::timeout_at(deadline, on_its_connection).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(_) => {
                    tracing::warn!(
                        "a given-up reservation could not be freed within the record's retention"
                    );
                    return;
                }
            }
            // The reservation either ran before the connection dropped or
            // never will: the abandon goes out on fresh connections until
            // the server answers. Detached: what waits for the store's
            // background work (a shutdown) is not held while the server is
            // down; a process that ends meanwhile leaves the lease to lapse.
            tokio::spawn(async move {
                let fresh = async {
                    loop {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(500));
                        let Ok(mut conn) = pool.fresh().await else {
                            continue;
                        };
                        match abandon(&mut conn).await {
                            Ok(_) => return,
                            Err(error) => {
                                tracing::debug!(%error, "abandoning a given-up reservation failed; retrying");
                            }
                        }
                    }
                };
                if tokio::time::timeout_at(deadline, fresh).await.is_err() {
                    tracing::warn!(
                        "a given-up reservation could not be freed within the record's retention"
                    );
                }
            });
        };
        self.store.given_up.spawn_on(task, &runtime);
    }
}
