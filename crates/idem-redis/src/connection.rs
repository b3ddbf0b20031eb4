//! Pooled, multiplexed connections in lanes; bounded calls; scripts run
//! with one retry on a broken connection; reservations abandoned when
//! their caller gave up.

use std::time::Duration;

use idem_core::StoreError;
use redis::Value;

use crate::{RedisStore, errors::unavailable, keys::millis};
use crate::{
    invocation::{Answer, Invocation},
    pool::{Conn, Pool},
};

/// One lane: its connection, and since when its calls have failed.
#[derive(Default)]
pub(crate) struct Lane {
    pub(crate) conn: Option<Conn>,
    pub(crate) failing_since: Option<std::time::Instant>,
}

/// How long a cluster lane's calls must fail in a row before its
/// connection is replaced.
pub(crate) const CLUSTER_REPLACE_AFTER: Duration = Duration::from_secs(5);

/// The least time between two replacements of cluster lanes.
pub(crate) const CLUSTER_REPLACE_EVERY: Duration = Duration::from_secs(1);

/// Whether an error means the connection itself should be replaced.
pub(crate) fn connection_broken(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_unrecoverable_error()
        || error.is_timeout()
}

impl RedisStore {
    /// Runs one plain command on a lane's connection, within the timeout;
    /// a lane whose call failed is refilled on its next use.
    pub(crate) async fn command<T: redis::FromRedisValue>(
        &self,
        cmd: redis::Cmd,
    ) -> Result<T, StoreError> {
        let (lane, mut conn) = self.bounded(self.timeout, self.connection()).await?;
        let call = async {
            match &mut conn {
                Conn::Single(c) => cmd.query_async::<T>(c).await,
                Conn::Cluster(c) => cmd.query_async::<T>(c).await,
            }
        };
        let result = self
            .bounded(self.timeout, async { call.await.map_err(unavailable) })
            .await;
        match &result {
            Ok(_) => self.succeeded(lane),
            Err(_) => self.failed(lane),
        }
        result
    }

    /// A lane's call succeeded.
    pub(crate) fn succeeded(&self, lane: usize) {
        if let Pool::Cluster(_) = self.pool {
            self.lanes[lane].lock().failing_since = None;
        }
    }

    /// A lane's call failed or timed out. A single node's connection is
    /// replaced at once. A cluster connection heals itself (it reconnects
    /// to the failed node and follows a failover); it is replaced only
    /// after failing for [`CLUSTER_REPLACE_AFTER`], at most one lane per
    /// [`CLUSTER_REPLACE_EVERY`], so an outage never turns into a storm of
    /// reconnections to the healthy nodes.
    pub(crate) fn failed(&self, lane: usize) {
        let mut slot = self.lanes[lane].lock();
        if let Pool::Single(_) = self.pool {
            slot.conn = None;
            return;
        }
        let now = std::time::Instant::now();
        let since = *slot.failing_since.get_or_insert(now);
        if now.duration_since(since) < CLUSTER_REPLACE_AFTER {
            return;
        }
        let mut last = self.last_replacement.lock();
        if last.is_some_and(|at| now.duration_since(at) < CLUSTER_REPLACE_EVERY) {
            return;
        }
        *last = Some(now);
        slot.conn = None;
        slot.failing_since = None;
        tracing::warn!(lane, "a cluster connection kept failing; replacing it");
    }

    pub(crate) async fn bounded<T>(
        &self,
        bound: Duration,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(bound, call)
            .await
            .map_err(|_| StoreError::Timeout(bound))?
    }

    /// The bound on one store call: the timeout, plus the wait for
    /// replicas when the store waits for them.
    pub(crate) fn call_bound(&self) -> Duration {
        self.timeout
            .saturating_add(self.wait_replicas.map_or(Duration::ZERO, |w| w.1))
    }

    /// A lane's connection, taking one from the pool if the lane is empty.
    pub(crate) async fn connection(&self) -> Result<(usize, Conn), StoreError> {
        use std::sync::atomic::Ordering;
        let lane = self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        if let Some(conn) = self.lanes[lane].lock().conn.clone() {
            return Ok((lane, conn));
        }
        // Taking a connection from the pool is off the hot path and its
        // future is large: boxed, so it does not size every call's future.
        Box::pin(self.new_connection(lane)).await
    }

    /// Takes a connection from the pool into `lane`.
    async fn new_connection(&self, lane: usize) -> Result<(usize, Conn), StoreError> {
        let mut conn = self.pool.fresh().await?;
        // Every new connection may meet another server (a restart, a
        // failover): it is checked before any call goes out on it.
        self.check_connection(&mut conn).await?;
        let mut slot = self.lanes[lane].lock();
        Ok((lane, slot.conn.get_or_insert(conn).clone()))
    }

    /// Runs one script; with `wait`, also `WAIT` on the same connection and
    /// answers how many replicas acknowledged.
    ///
    /// A call whose connection broke is retried once on a fresh connection,
    /// within the same time bound. Retrying is safe: every script recognises
    /// a repeat of its own attempt's write (same attempt id and token) and
    /// answers as the first time did.
    pub(crate) async fn run(
        &self,
        invocation: Invocation<'_>,
        wait: bool,
    ) -> Result<(Value, Option<usize>), StoreError> {
        let (answer, acked) = self.run_on(invocation, wait, None).await?;
        Ok((answer.into_reply()?, acked))
    }

    /// [`run`](Self::run), telling in `used`, when given, the connection
    /// the script was last sent on (as soon as it is sent).
    pub(crate) async fn run_on(
        &self,
        invocation: Invocation<'_>,
        wait: bool,
        mut used: Option<&mut Option<Conn>>,
    ) -> Result<(Answer, Option<usize>), StoreError> {
        let bound = self.call_bound();
        let mut lane = None;
        let call = async {
            let mut retried = false;
            loop {
                let (index, mut conn) = self.connection().await?;
                lane = Some(index);
                if let Some(used) = used.as_deref_mut() {
                    *used = Some(conn.clone());
                }
                match self.invoke(&invocation, &mut conn, wait).await {
                    Err(error) if connection_broken(&error) => {
                        if matches!(self.pool, Pool::Single(_)) {
                            // The server most likely went away: every
                            // lane's connection is suspect, so all are
                            // replaced.
                            self.lanes
                                .iter()
                                .for_each(|lane| drop(lane.lock().conn.take()));
                        } else {
                            self.failed(index);
                        }
                        if retried {
                            return Err(unavailable(error));
                        }
                        retried = true;
                    }
                    other => {
                        if other.is_ok() {
                            self.succeeded(index);
                        }
                        return other.map_err(unavailable);
                    }
                }
            }
        };
        match tokio::time::timeout(bound, call).await {
            Ok(result) => result,
            Err(_) => {
                if let Some(index) = lane {
                    self.failed(index);
                }
                Err(StoreError::Timeout(bound))
            }
        }
    }

    pub(crate) async fn invoke(
        &self,
        invocation: &Invocation<'_>,
        conn: &mut Conn,
        wait: bool,
    ) -> redis::RedisResult<(Answer, Option<usize>)> {
        let answer = invocation.invoke(conn).await?;
        let value = crate::string_record::converting(answer, invocation, conn).await?;
        let acked = match (wait, self.wait_replicas, conn) {
            (true, Some((replicas, timeout)), Conn::Single(c)) => Some(
                Box::pin(
                    redis::cmd("WAIT")
                        .arg(replicas)
                        .arg(millis(timeout))
                        .query_async::<usize>(c),
                )
                .await?,
            ),
            _ => None,
        };
        Ok((value, acked))
    }

    pub(crate) fn short_of_replicas(&self, acked: Option<usize>) -> Option<(usize, usize)> {
        let (wanted, _) = self.wait_replicas?;
        let acked = acked?;
        (acked < wanted).then_some((acked, wanted))
    }
}
