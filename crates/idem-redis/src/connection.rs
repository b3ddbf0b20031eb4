//! Pooled, multiplexed connections in lanes; bounded calls; scripts run
//! with one retry on a broken connection; reservations abandoned when
//! their caller gave up.

use std::time::Duration;

use crate::{
    RedisStore,
    errors::unavailable,
    keys::{millis, record_key_pieces},
};

use idem_core::{ScopeHash, StoreError};
use redis::{ErrorKind, Script, ServerErrorKind, ToRedisArgs, Value};

#[derive(Clone)]
pub(crate) enum Pool {
    Single(deadpool_redis::Pool),
    Cluster(deadpool_redis::cluster::Pool),
}

impl Pool {
    /// A connection taken from the pool for good.
    pub(crate) async fn fresh(&self) -> Result<Conn, StoreError> {
        Ok(match self {
            // Made without a reply timeout: the store bounds each call
            // itself (see the builder).
            Self::Single(pool) => Conn::Single(deadpool_redis::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
            Self::Cluster(pool) => Conn::Cluster(deadpool_redis::cluster::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
        })
    }
}

/// A connection checked out of the pool for good, shared by cloning.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// A script call, written as one `EVALSHA` command straight into the
/// command's buffer (redis-rs' `ScriptInvocation` keeps every key and
/// argument in an allocation of its own and copies them into the command
/// on each call). The script is loaded and the call repeated after
/// `NOSCRIPT` (a restarted server, `SCRIPT FLUSH`).
///
/// The command's buffers are reused: an ended call leaves them to its
/// thread's next calls (see [`SPARE_COMMANDS`]).
pub(crate) struct Invocation<'s> {
    script: &'s Script,
    cmd: redis::Cmd,
    /// The bytes of the call's keys and arguments (what follows `EVALSHA`,
    /// the script's hash and the number of keys).
    bytes: usize,
}

thread_local! {
    /// Emptied commands of ended calls, their buffers kept for this
    /// thread's next calls: a call's command would otherwise cost two
    /// allocations and their growth.
    static SPARE_COMMANDS: std::cell::RefCell<Vec<redis::Cmd>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// At most this many spare commands per thread.
const SPARE_COMMANDS_KEPT: usize = 32;

/// A command whose arguments took more bytes than this is not kept: its
/// buffer (at most twice its largest use) would hold a large body's
/// memory for good.
const SPARE_COMMAND_BYTES: usize = 8 * 1024;

impl<'s> Invocation<'s> {
    /// A call of `script` on `keys`; arguments follow with [`arg`](Self::arg).
    pub(crate) fn new(script: &'s Script, keys: &[&str]) -> Self {
        let mut invocation = Self::of(script, keys.len());
        for key in keys {
            invocation.arg(*key);
        }
        invocation
    }

    /// A call of `script` on one key, the record key of `scope` under
    /// `prefix` (see [`RedisStore::record_key`]), written without an
    /// allocation of its own.
    pub(crate) fn on_record(script: &'s Script, prefix: &str, scope: &ScopeHash) -> Self {
        let mut invocation = Self::of(script, 1);
        invocation.pieces(&record_key_pieces(prefix, &scope.hex_bytes()));
        invocation
    }

    /// The call's head: `EVALSHA <sha> <number of keys>`.
    fn of(script: &'s Script, keys: usize) -> Self {
        let mut cmd = SPARE_COMMANDS
            .with(|spare| spare.borrow_mut().pop())
            .unwrap_or_else(|| redis::Cmd::with_capacity(16, 256));
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        Self {
            script,
            cmd,
            bytes: 0,
        }
    }

    /// Appends an argument.
    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut Counting {
            cmd: &mut self.cmd,
            bytes: &mut self.bytes,
        });
        self
    }

    /// Appends one argument made of `pieces`, one after the other: joined
    /// on the stack when short (a record's key, a tenant), so the command
    /// takes them in one piece.
    pub(crate) fn pieces(&mut self, pieces: &[&[u8]]) -> &mut Self {
        let mut joined = [0u8; 256];
        let mut at = 0;
        for piece in pieces {
            match joined.get_mut(at..at + piece.len()) {
                Some(room) => room.copy_from_slice(piece),
                None => return self.written_pieces(pieces),
            }
            at += piece.len();
        }
        self.bytes += at;
        self.cmd.arg(&joined[..at]);
        self
    }

    /// [`pieces`](Self::pieces) written through the command's writer.
    #[cold]
    fn written_pieces(&mut self, pieces: &[&[u8]]) -> &mut Self {
        self.write_arg(|out| {
            for piece in pieces {
                out.write_all(piece)?;
            }
            Ok(())
        })
    }

    /// Appends one argument that `write` writes (into the command's
    /// buffer: writing cannot fail).
    pub(crate) fn write_arg(
        &mut self,
        write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
    ) -> &mut Self {
        use redis::RedisWrite;
        let mut out = Counted {
            inner: self.cmd.writer_for_next_arg(),
            bytes: &mut self.bytes,
        };
        let _ = write(&mut out);
        drop(out);
        self
    }

    /// Appends a UUID in its hyphenated lower-case text (what `to_string`
    /// gives), written from a stack buffer.
    pub(crate) fn uuid(&mut self, id: &uuid::Uuid) -> &mut Self {
        let mut buffer = uuid::Uuid::encode_buffer();
        let text: &str = id.hyphenated().encode_lower(&mut buffer);
        self.arg(text)
    }

    /// Runs the call on `conn`.
    ///
    /// The calls off the hot path (loading the script, a cluster's query)
    /// are boxed: a future is as large as its largest state, and every
    /// store call's future is moved whole at least once.
    pub(crate) async fn invoke(&self, conn: &mut Conn) -> redis::RedisResult<Value> {
        match self.query(conn).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                Box::pin(async {
                    match conn {
                        Conn::Single(c) => self.script.load_async(c).await?,
                        Conn::Cluster(c) => self.script.load_async(c).await?,
                    };
                    self.query(conn).await
                })
                .await
            }
            other => other,
        }
    }

    async fn query(&self, conn: &mut Conn) -> redis::RedisResult<Value> {
        match conn {
            Conn::Single(c) => self.cmd.query_async(c).await,
            Conn::Cluster(c) => Box::pin(self.cmd.query_async(c)).await,
        }
    }
}

/// A command's writer that counts the bytes of the arguments written
/// through it (kept in [`Invocation::bytes`] as they are written, instead
/// of summed over every argument when the call ends).
struct Counting<'c> {
    cmd: &'c mut redis::Cmd,
    bytes: &'c mut usize,
}

impl redis::RedisWrite for Counting<'_> {
    fn write_arg(&mut self, arg: &[u8]) {
        *self.bytes += arg.len();
        self.cmd.write_arg(arg);
    }

    fn write_arg_fmt(&mut self, arg: impl std::fmt::Display) {
        use std::io::Write;
        let mut out = self.writer_for_next_arg();
        let _ = write!(out, "{arg}");
    }

    fn writer_for_next_arg(&mut self) -> impl std::io::Write + '_ {
        Counted {
            inner: self.cmd.writer_for_next_arg(),
            bytes: &mut *self.bytes,
        }
    }

    fn reserve_space_for_args(&mut self, additional: impl IntoIterator<Item = usize>) {
        self.cmd.reserve_space_for_args(additional);
    }
}

/// An argument's writer that adds what it writes to a count.
struct Counted<'b, W> {
    inner: W,
    bytes: &'b mut usize,
}

impl<W: std::io::Write> std::io::Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        *self.bytes += written;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl Drop for Invocation<'_> {
    fn drop(&mut self) {
        if self.bytes > SPARE_COMMAND_BYTES {
            return;
        }
        let mut cmd = std::mem::take(&mut self.cmd);
        cmd.clear();
        // A thread being torn down keeps nothing.
        let _ = SPARE_COMMANDS.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_COMMANDS_KEPT {
                spare.push(cmd);
            }
        });
    }
}

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
        let conn = self.pool.fresh().await?;
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
        self.run_on(invocation, wait, None).await
    }

    /// [`run`](Self::run), telling in `used`, when given, the connection
    /// the script was last sent on (as soon as it is sent).
    pub(crate) async fn run_on(
        &self,
        invocation: Invocation<'_>,
        wait: bool,
        mut used: Option<&mut Option<Conn>>,
    ) -> Result<(Value, Option<usize>), StoreError> {
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
    ) -> redis::RedisResult<(Value, Option<usize>)> {
        let value = invocation.invoke(conn).await?;
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
                invocation.invoke(conn).await
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spare() -> usize {
        SPARE_COMMANDS.with(|spare| spare.borrow().len())
    }

    fn args(invocation: &Invocation<'_>) -> Vec<Vec<u8>> {
        invocation
            .cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(arg) => arg.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// An ended call's command is kept, emptied, for the thread's next
    /// call; one that held a large argument is not.
    #[test]
    fn ended_commands_are_reused_emptied_unless_large() {
        let script = Script::new("return 1");
        let before = spare();
        let mut first = Invocation::new(&script, &["k1"]);
        first.arg("value").pieces(&[b"a", b"b"]);
        assert_eq!(
            args(&first)[3..],
            [b"k1".to_vec(), b"value".to_vec(), b"ab".to_vec()]
        );
        drop(first);
        assert_eq!(spare(), before + 1);
        // The next call takes it and starts from nothing.
        let scope = ScopeHash::from_bytes([0xab; 32]);
        let second = Invocation::on_record(&script, "p:", &scope);
        assert_eq!(spare(), before);
        let written = args(&second);
        assert_eq!(written.len(), 4, "{written:?}");
        assert_eq!(written[0], b"EVALSHA");
        assert_eq!(written[2], b"1");
        assert_eq!(
            written[3],
            format!("p:{{{}}}", "ab".repeat(32)).into_bytes()
        );
        drop(second);
        assert_eq!(spare(), before + 1);
        // A call that carried a large body leaves nothing behind, however
        // its arguments were written: one large argument, several that
        // add up, long pieces, a writer, an integer past the rest.
        let half = SPARE_COMMAND_BYTES / 2;
        let big = vec![b'x'; SPARE_COMMAND_BYTES + 1];
        let writes: [&dyn Fn(&mut Invocation<'_>); 6] = [
            &|call| {
                call.arg(&big[..]);
            },
            &|call| {
                call.arg(&big[..half]).arg(&big[..half]).arg("1");
            },
            &|call| {
                call.pieces(&[&big[..half], &big[..half + 1]]);
            },
            &|call| {
                call.write_arg(|out| out.write_all(&big));
            },
            &|call| {
                call.arg(&big[..SPARE_COMMAND_BYTES - 1]).arg(7u8);
            },
            &|call| {
                call.arg(&big[..SPARE_COMMAND_BYTES - 100])
                    .pieces(&[&big[..100], b"y"]);
            },
        ];
        for (case, write) in writes.iter().enumerate() {
            let mut large = Invocation::new(&script, &["k"]);
            write(&mut large);
            let taken = spare();
            drop(large);
            assert_eq!(spare(), taken, "case {case}");
        }
        // At the bound (the key's byte counted) it is kept.
        let mut bound = Invocation::new(&script, &["k"]);
        bound.arg(&big[..SPARE_COMMAND_BYTES - 2]).arg(7u8);
        let taken = spare();
        drop(bound);
        assert_eq!(spare(), taken + 1);
    }

    /// Pieces make one argument whatever their length: short ones joined
    /// on the stack, up to and past its size, and long ones written
    /// through the command's writer.
    #[test]
    fn pieces_make_one_argument_at_every_length() {
        let script = Script::new("return 1");
        for total in [0, 1, 100, 255, 256, 257, 300, 4096] {
            let text: Vec<u8> = (0..total).map(|n| b'a' + (n % 26) as u8).collect();
            let third = total / 3;
            let pieces = [&text[..third], &text[third..2 * third], &text[2 * third..]];
            let mut invocation = Invocation::new(&script, &["k"]);
            invocation.pieces(&pieces).arg("after");
            let written = args(&invocation);
            assert_eq!(written[4], text, "{total}");
            assert_eq!(written[5], b"after", "{total}");
        }
    }
}
