//! The production store for idem: Redis or Redis Cluster, every state
//! transition one atomic Lua script.
//!
//! * **Atomic.** `reserve`, `renew`, `complete`, `release`, `cancel` and
//!   `get` are each one Lua script (`src/lua/*.lua`) run with `EVALSHA`
//!   (reloaded after `NOSCRIPT`, for example after a restart or
//!   `SCRIPT FLUSH`). Every write after `reserve` is a compare-and-set on the
//!   lease generation and owner token inside the script.
//! * **One hash per scope.** The record lives in one Redis hash under
//!   `{prefix}{<scope hash>}`: the SHA-256 scope hash inside a hash tag, so
//!   every key a script touches is in one cluster slot. Response bodies and
//!   headers are stored as binary-safe bulk strings.
//! * **Server time.** Leases and retention are measured with Redis `TIME`
//!   inside the scripts, never the web server's clock; records expire with
//!   `PEXPIREAT`.
//! * **Round trips.** A new key costs two round trips (reserve, complete),
//!   plus one renewal per third of the lease for long handlers; a replay, a
//!   conflict or an in-progress answer costs one.
//! * **Pooled, multiplexed.** Connections come from a `deadpool-redis` pool
//!   (which creates them and checks them with `PING`) and are held in a few
//!   *lanes* ([`RedisStoreBuilder::lanes`], default 4): redis-rs multiplexes
//!   concurrent calls on each lane's connection, so a call costs no extra
//!   round trip for checking a connection out. On a single node, a lane
//!   whose connection fails or times out is refilled from the pool on its
//!   next use. A cluster connection reconnects to a failed node by itself
//!   and follows the slots to a promoted replica, so one node's outage
//!   does not replace it (that would reconnect to every healthy node): a
//!   cluster lane is replaced only after its calls have failed for 5 s in a
//!   row, at most one lane a second.
//! * **Timeouts.** Every call, including waiting for a pooled connection, is
//!   bounded by [`RedisStoreBuilder::timeout`] (default 1 s): a paused or
//!   dead server becomes a [`StoreError`] within it.
//!
//! ```no_run
//! # async fn run() -> Result<(), idem_redis::BuildError> {
//! let single = idem_redis::RedisStore::from_url("redis://127.0.0.1:6379/0")?;
//! let cluster = idem_redis::RedisStore::from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")?;
//! # Ok(()) }
//! ```
//!
//! # Running Redis for idem
//!
//! A record lost is a retry executed twice. Run Redis with `appendonly yes`
//! (a Redis that keeps nothing on disk forgets every record on restart) and
//! `maxmemory-policy noeviction`: records carry a TTL, so every other
//! policy, `volatile-*` included, can evict live records under memory
//! pressure. [`RedisStore::server_safety`] reads both from `INFO`; the
//! gateway refuses an evicting policy unless told otherwise and warns
//! without AOF. A record takes about 2 KB.
//!
//! # Replication
//!
//! Redis replicates asynchronously: a reservation acknowledged by a primary
//! that fails before replicating it is lost, and a retry on the promoted
//! replica would execute again. [`RedisStoreBuilder::wait_for_replicas`]
//! sends `WAIT n timeout` after `reserve` and `complete` (single-node
//! deployments with replicas): a reservation that did not reach `n` replicas
//! in time is released and reported as a store failure (the layer answers
//! 503, the handler does not run); a completion that did not is kept and
//! logged. `WAIT` narrows the window but is not consensus: a failover can
//! still pick a replica that missed the write. It costs one more round trip
//! per call.

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use deadpool_redis::{Runtime, Timeouts};
use idem_core::{
    ATTEMPT_HISTORY, Attempt, AttemptId, AttemptOutcome, Cancellation, Completion, Current,
    Fingerprint, ForceRelease, LateEvidence, Lease, Outcome, OwnerToken, Record, RecordQuery,
    RecordState, Release, Renewal, Replay, Reservation, ReserveRequest, ScopeHash, Store,
    StoreError, StoredResponse,
};
use redis::{Script, ScriptInvocation, Value};

mod limits;

const COMMON: &str = include_str!("lua/common.lua");

/// The scripts, each prefixed with the shared functions.
#[derive(Debug)]
struct Scripts {
    reserve: Script,
    renew: Script,
    complete: Script,
    release: Script,
    cancel: Script,
    get: Script,
    abandon: Script,
    force_release: Script,
}

impl Scripts {
    fn new() -> Self {
        let script = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        Self {
            reserve: script(include_str!("lua/reserve.lua")),
            renew: script(include_str!("lua/renew.lua")),
            complete: script(include_str!("lua/complete.lua")),
            release: script(include_str!("lua/release.lua")),
            cancel: script(include_str!("lua/cancel.lua")),
            get: script(include_str!("lua/get.lua")),
            abandon: script(include_str!("lua/abandon.lua")),
            force_release: script(include_str!("lua/force_release.lua")),
        }
    }
}

/// The store could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The URL is not `redis://…`, `rediss://…`, `redis+cluster://h:p,…` or
    /// `rediss+cluster://h:p,…`.
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The connection pool could not be created.
    #[error("could not create the Redis pool: {0}")]
    Pool(String),
}

enum Pool {
    Single(deadpool_redis::Pool),
    Cluster(deadpool_redis::cluster::Pool),
}

/// A connection checked out of the pool for good, shared by cloning.
#[derive(Clone)]
enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// One lane: its connection, and since when its calls have failed.
#[derive(Default)]
struct Lane {
    conn: Option<Conn>,
    failing_since: Option<std::time::Instant>,
}

/// How long a cluster lane's calls must fail in a row before its
/// connection is replaced.
const CLUSTER_REPLACE_AFTER: Duration = Duration::from_secs(5);

/// The least time between two replacements of cluster lanes.
const CLUSTER_REPLACE_EVERY: Duration = Duration::from_secs(1);

/// Whether an error means the connection itself should be replaced.
fn connection_broken(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_unrecoverable_error()
        || error.is_timeout()
}

/// Builder for [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    pool_size: usize,
    lanes: usize,
    timeout: Duration,
    wait_replicas: Option<(usize, Duration)>,
}

impl RedisStoreBuilder {
    /// How many multiplexed connections calls are spread over (default 4).
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes.max(1);
        self
    }

    /// The key prefix (default `idem:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The most connections the pool holds (default 16; at least the
    /// number of lanes).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The bound on every store call, including waiting for a connection
    /// (default 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// After `reserve` and `complete`, wait until `replicas` replicas have
    /// the write, at most `timeout` (single-node deployments only; see the
    /// crate docs for what this buys).
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait_replicas = Some((replicas, timeout));
        self
    }

    /// Builds the store. Connections are made lazily, on first use.
    pub fn build(self) -> Result<RedisStore, BuildError> {
        let invalid = |reason: &str| BuildError::InvalidUrl {
            url: self.url.clone(),
            reason: reason.to_owned(),
        };
        let timeouts = Timeouts {
            wait: Some(self.timeout),
            create: Some(self.timeout),
            recycle: Some(self.timeout),
        };
        let pool_config = deadpool_redis::PoolConfig {
            max_size: self.pool_size,
            timeouts,
            ..Default::default()
        };
        let cluster = match (
            self.url.strip_prefix("redis+cluster://"),
            self.url.strip_prefix("rediss+cluster://"),
        ) {
            (Some(nodes), _) => Some(("redis", nodes)),
            (None, Some(nodes)) => Some(("rediss", nodes)),
            (None, None) => None,
        };
        let pool = if let Some((scheme, nodes)) = cluster {
            if self.wait_replicas.is_some() {
                return Err(invalid(
                    "waiting for replicas is supported on single-node deployments only",
                ));
            }
            let urls: Vec<String> = nodes
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(|n| format!("{scheme}://{n}"))
                .collect();
            if urls.is_empty() {
                return Err(invalid("no cluster nodes"));
            }
            let mut config = deadpool_redis::cluster::Config::from_urls(urls);
            config.pool = Some(pool_config);
            let pool = config
                .create_pool(Some(Runtime::Tokio1))
                .map_err(|e| BuildError::Pool(e.to_string()))?;
            Pool::Cluster(pool)
        } else if self.url.starts_with("redis://") || self.url.starts_with("rediss://") {
            let mut config = deadpool_redis::Config::from_url(self.url.clone());
            config.pool = Some(pool_config);
            let pool = config
                .create_pool(Some(Runtime::Tokio1))
                .map_err(|e| BuildError::Pool(e.to_string()))?;
            Pool::Single(pool)
        } else {
            return Err(invalid(
                "expected redis://, rediss://, redis+cluster:// or rediss+cluster://",
            ));
        };
        Ok(RedisStore {
            lanes: (0..self.lanes)
                .map(|_| parking_lot::Mutex::new(Lane::default()))
                .collect(),
            last_replacement: parking_lot::Mutex::new(None),
            next_lane: std::sync::atomic::AtomicUsize::new(0),
            pool,
            scripts: Scripts::new(),
            limit_scripts: limits::LimitScripts::new(),
            prefix: self.prefix,
            timeout: self.timeout,
            wait_replicas: self.wait_replicas,
        })
    }
}

/// A [`Store`] on Redis or Redis Cluster. See the [crate docs](crate).
pub struct RedisStore {
    pool: Pool,
    lanes: Box<[parking_lot::Mutex<Lane>]>,
    /// When a cluster lane was last replaced (replacements are rate
    /// limited).
    last_replacement: parking_lot::Mutex<Option<std::time::Instant>>,
    next_lane: std::sync::atomic::AtomicUsize,
    scripts: Scripts,
    limit_scripts: limits::LimitScripts,
    prefix: String,
    timeout: Duration,
    wait_replicas: Option<(usize, Duration)>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &matches!(self.pool, Pool::Cluster(_)))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn unavailable(error: impl std::fmt::Display) -> StoreError {
    StoreError::unavailable(error.to_string())
}

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl RedisStore {
    /// A store for `redis://host:port[/db]` (or `rediss://` for TLS) or
    /// `redis+cluster://h1:p1,h2:p2,...` (or `rediss+cluster://`), with
    /// default settings. TLS verifies the server's certificate against the
    /// system's roots, or the PEM file named by `SSL_CERT_FILE` (a private
    /// CA).
    pub fn from_url(url: &str) -> Result<Self, BuildError> {
        Self::builder(url).build()
    }

    /// A builder for `url` (see [`from_url`](Self::from_url)).
    pub fn builder(url: &str) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.to_owned(),
            prefix: "idem:".to_owned(),
            pool_size: 16,
            lanes: 4,
            timeout: Duration::from_secs(1),
            wait_replicas: None,
        }
    }

    /// The Redis key of a scope's record: the scope hash inside a hash tag.
    pub fn record_key(&self, scope: &ScopeHash) -> String {
        format!("{}{{{}}}", self.prefix, scope.to_hex())
    }

    /// Checks that the server answers (`PING`), within the timeout.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.command(redis::cmd("PING")).await
    }

    /// Reads what the server (every node of a cluster that answers) says
    /// about keeping records: its `maxmemory-policy` and persistence, from
    /// `INFO`. See [`ServerSafety`].
    pub async fn server_safety(&self) -> Result<ServerSafety, StoreError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("memory").arg("persistence");
        let info: Value = self.command(cmd).await?;
        let mut text = String::new();
        collect_text(&info, &mut text);
        Ok(ServerSafety::from_info(&text))
    }

    /// Whether every hash slot is served by a node that answers: on a
    /// cluster, the slot map (`CLUSTER SLOTS`, from any node that answers)
    /// and a `PING` to each master it names; on a single node, a `PING`.
    /// Each call is bounded by the store timeout.
    pub async fn health(&self) -> Result<Health, StoreError> {
        let (lane, conn) = self.bounded(self.timeout, self.connection()).await?;
        let Conn::Cluster(mut conn) = conn else {
            self.ping().await?;
            return Ok(Health {
                slots_served: SLOTS,
                masters_answering: 1,
                masters: 1,
            });
        };
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let mut slots = None;
        for _ in 0..3 {
            let asked = conn.route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            );
            match self
                .bounded(self.timeout, async { asked.await.map_err(unavailable) })
                .await
            {
                Ok(value) => {
                    slots = Some(value);
                    break;
                }
                Err(error) => tracing::debug!(%error, "CLUSTER SLOTS failed; asking another node"),
            }
        }
        let Some(slots) = slots else {
            self.failed(lane);
            return Err(unavailable("no cluster node answered CLUSTER SLOTS"));
        };
        let ranges = slot_ranges(&slots)?;
        let mut masters: Vec<Address> = ranges.iter().map(|r| r.2.clone()).collect();
        masters.sort();
        masters.dedup();
        let mut answering = Vec::new();
        for (host, port) in &masters {
            let ping = conn.route_command(
                redis::cmd("PING"),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                }),
            );
            if self
                .bounded(self.timeout, async { ping.await.map_err(unavailable) })
                .await
                .is_ok()
            {
                answering.push((host.clone(), *port));
            }
        }
        let slots_served = ranges
            .iter()
            .filter(|(_, _, master)| answering.contains(master))
            .map(|(start, end, _)| end.saturating_sub(*start) + 1)
            .sum();
        Ok(Health {
            slots_served,
            masters_answering: answering.len(),
            masters: masters.len(),
        })
    }

    /// The keys of every record (`SCAN` of each node; on a cluster, of
    /// each master), at most [`LIST_SCAN_LIMIT`].
    async fn record_keys(&self) -> Result<Vec<String>, StoreError> {
        let pattern = format!("{}{{*", self.prefix);
        let scan = |cursor: u64| {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000);
            cmd
        };
        let mut keys = Vec::new();
        let (lane, conn) = self.bounded(self.timeout, self.connection()).await?;
        let nodes: Vec<Option<Address>> = match &conn {
            Conn::Single(_) => vec![None],
            Conn::Cluster(_) => {
                let health_nodes = {
                    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                    let Conn::Cluster(mut cluster) = conn.clone() else {
                        unreachable!("matched a cluster connection")
                    };
                    let asked = cluster.route_command(
                        redis::cmd("CLUSTER").arg("SLOTS").clone(),
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                    );
                    let slots = self
                        .bounded(self.timeout, async { asked.await.map_err(unavailable) })
                        .await?;
                    let mut masters: Vec<Address> =
                        slot_ranges(&slots)?.into_iter().map(|r| r.2).collect();
                    masters.sort();
                    masters.dedup();
                    masters
                };
                health_nodes.into_iter().map(Some).collect()
            }
        };
        for node in nodes {
            let mut cursor = 0u64;
            loop {
                let asked = async {
                    match (&conn, &node) {
                        (Conn::Single(c), _) => {
                            scan(cursor)
                                .query_async::<(u64, Vec<String>)>(&mut c.clone())
                                .await
                        }
                        (Conn::Cluster(c), Some((host, port))) => {
                            use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                            let value = c
                                .clone()
                                .route_command(
                                    scan(cursor),
                                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                        host: host.clone(),
                                        port: *port,
                                    }),
                                )
                                .await?;
                            redis::from_redis_value(value).map_err(redis::RedisError::from)
                        }
                        (Conn::Cluster(_), None) => Ok((0, Vec::new())),
                    }
                };
                let (next, batch) = match self
                    .bounded(self.timeout, async { asked.await.map_err(unavailable) })
                    .await
                {
                    Ok(page) => page,
                    Err(error) => {
                        self.failed(lane);
                        return Err(error);
                    }
                };
                keys.extend(batch);
                if next == 0 || keys.len() >= LIST_SCAN_LIMIT {
                    break;
                }
                cursor = next;
            }
        }
        keys.truncate(LIST_SCAN_LIMIT);
        Ok(keys)
    }

    /// A cluster's `cluster-node-timeout` (`CONFIG GET`, from any node);
    /// `None` on a single node or where `CONFIG` is not allowed.
    pub async fn cluster_node_timeout(&self) -> Option<Duration> {
        if let Pool::Single(_) = self.pool {
            return None;
        }
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("cluster-node-timeout");
        let reply: Value = self.command(cmd).await.ok()?;
        let mut text = String::new();
        collect_text(&reply, &mut text);
        text.split_whitespace()
            .filter_map(|word| word.parse::<u64>().ok())
            .next()
            .map(Duration::from_millis)
    }

    /// Runs one plain command on a lane's connection, within the timeout;
    /// a lane whose call failed is refilled on its next use.
    async fn command<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Result<T, StoreError> {
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
    fn succeeded(&self, lane: usize) {
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
    fn failed(&self, lane: usize) {
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

    async fn bounded<T>(
        &self,
        bound: Duration,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(bound, call)
            .await
            .map_err(|_| StoreError::Timeout(bound))?
    }

    /// A lane's connection, taking one from the pool if the lane is empty.
    async fn connection(&self) -> Result<(usize, Conn), StoreError> {
        use std::sync::atomic::Ordering;
        let lane = self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        if let Some(conn) = self.lanes[lane].lock().conn.clone() {
            return Ok((lane, conn));
        }
        let conn = match &self.pool {
            Pool::Single(pool) => Conn::Single(deadpool_redis::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
            Pool::Cluster(pool) => Conn::Cluster(deadpool_redis::cluster::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
        };
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
    async fn run(
        &self,
        invocation: ScriptInvocation<'_>,
        wait: bool,
    ) -> Result<(Value, Option<usize>), StoreError> {
        self.run_on(invocation, wait, &mut None).await
    }

    /// [`run`](Self::run), telling in `used` the connection the script was
    /// last sent on (as soon as it is sent).
    async fn run_on(
        &self,
        invocation: ScriptInvocation<'_>,
        wait: bool,
        used: &mut Option<Conn>,
    ) -> Result<(Value, Option<usize>), StoreError> {
        let bound = self.timeout + self.wait_replicas.map_or(Duration::ZERO, |w| w.1);
        let mut lane = None;
        let call = async {
            let mut retried = false;
            loop {
                let (index, mut conn) = self.connection().await?;
                lane = Some(index);
                *used = Some(conn.clone());
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

    async fn invoke(
        &self,
        invocation: &ScriptInvocation<'_>,
        conn: &mut Conn,
        wait: bool,
    ) -> redis::RedisResult<(Value, Option<usize>)> {
        let value: Value = match conn {
            Conn::Single(c) => invocation.invoke_async(c).await?,
            Conn::Cluster(c) => invocation.invoke_async(c).await?,
        };
        let acked = match (wait, self.wait_replicas, conn) {
            (true, Some((replicas, timeout)), Conn::Single(c)) => Some(
                redis::cmd("WAIT")
                    .arg(replicas)
                    .arg(millis(timeout))
                    .query_async::<usize>(c)
                    .await?,
            ),
            _ => None,
        };
        Ok((value, acked))
    }

    fn short_of_replicas(&self, acked: Option<usize>) -> Option<(usize, usize)> {
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
/// nobody runs. Retried until the server answers, for at most a lease
/// (after which a takeover frees the key anyway).
struct Abandon {
    script: Script,
    key: String,
    attempt: String,
    token: String,
    conn: Option<Conn>,
    within: Duration,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (script, key, attempt, token, within) = (
            self.script.clone(),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.attempt),
            std::mem::take(&mut self.token),
            self.within,
        );
        runtime.spawn(async move {
            let abandon = async {
                loop {
                    let mut invocation = script.prepare_invoke();
                    invocation.key(&key).arg(&attempt).arg(&token);
                    let sent: redis::RedisResult<Value> = match &mut conn {
                        Conn::Single(c) => invocation.invoke_async(c).await,
                        Conn::Cluster(c) => invocation.invoke_async(c).await,
                    };
                    match sent {
                        Ok(_) => return,
                        Err(error) => {
                            tracing::debug!(%error, "abandoning a given-up reservation failed; retrying");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            };
            if tokio::time::timeout(within, abandon).await.is_err() {
                tracing::warn!("a given-up reservation could not be freed; its lease will lapse");
            }
        });
    }
}

/// A scope hash from its 64 hex characters.
fn scope_from_hex(hex: &str) -> Option<ScopeHash> {
    let fingerprint = idem_core::Fingerprint::from_hex(hex)?;
    Some(ScopeHash::from_bytes(*fingerprint.as_bytes()))
}

/// The most record keys [`Store::list`] reads (it scans, then reads each
/// record: an operator's tool, not a hot path).
pub const LIST_SCAN_LIMIT: usize = 100_000;

/// The hash slots of Redis Cluster.
const SLOTS: u32 = 16_384;

/// How long a Redis Cluster may take to promote a replica after its master
/// dies, for a `cluster-node-timeout`: the master is marked failed after
/// the node timeout (once a majority agrees), then a replica waits 0.5 to
/// 1 s plus a second per rank before it is elected. Measured: 18 to 23 s for
/// the default 15 s. This bound is 1.6 × the node timeout + 2 s (26 s for
/// 15 s). A lease shorter than it can lapse while a failover is still
/// under way, so a running request's renewals fail, its lease is lost and a
/// retry on the promoted replica takes over while the first attempt may
/// still act: size the lease above it.
pub fn failover_bound(node_timeout: Duration) -> Duration {
    node_timeout.mul_f64(1.6) + Duration::from_secs(2)
}

/// Whether every hash slot is served by a node that answers (see
/// [`RedisStore::health`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Hash slots whose master answered (all 16,384 on a healthy cluster
    /// or a single node).
    pub slots_served: u32,
    /// Masters that answered a `PING`.
    pub masters_answering: usize,
    /// Masters the slot map names.
    pub masters: usize,
}

impl Health {
    /// Every slot is served and every master answers.
    pub fn is_ok(&self) -> bool {
        self.slots_served == SLOTS && self.masters_answering == self.masters
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{SLOTS} slots served, {}/{} masters answering",
            self.slots_served, self.masters_answering, self.masters
        )
    }
}

/// A node's address: host and port.
type Address = (String, u16);

/// The slot ranges of a `CLUSTER SLOTS` reply (first slot, last slot), with
/// each range's master.
fn slot_ranges(reply: &Value) -> Result<Vec<(u32, u32, Address)>, StoreError> {
    let Value::Array(ranges) = reply else {
        return Err(corrupt("CLUSTER SLOTS did not answer an array"));
    };
    let number = |value: &Value| match value {
        Value::Int(n) => u32::try_from(*n).ok(),
        _ => None,
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(parts) = range else {
                return Err(corrupt("a CLUSTER SLOTS range is not an array"));
            };
            let (Some(start), Some(end), Some(Value::Array(master))) = (
                parts.first().and_then(number),
                parts.get(1).and_then(number),
                parts.get(2),
            ) else {
                return Err(corrupt("a CLUSTER SLOTS range is malformed"));
            };
            let host = master.first().map(text).transpose()?.unwrap_or_default();
            let port = master
                .get(1)
                .and_then(|p| match p {
                    Value::Int(n) => u16::try_from(*n).ok(),
                    _ => None,
                })
                .ok_or_else(|| corrupt("a CLUSTER SLOTS master has no port"))?;
            Ok((start, end, (host, port)))
        })
        .collect()
}

/// What a Redis server says about keeping idem's records.
///
/// idem's records carry a TTL (their retention), so every eviction policy
/// but `noeviction` can remove a live record under memory pressure,
/// including the `volatile-*` ones; a removed record lets a retry execute
/// again, silently. Without persistence (no AOF, no RDB snapshots) a
/// restart forgets every record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSafety {
    /// Every `maxmemory_policy` the nodes reported (one per node).
    pub eviction_policies: Vec<String>,
    /// Whether every node that reported runs with `appendonly yes`.
    pub append_only: bool,
}

impl ServerSafety {
    fn from_info(info: &str) -> Self {
        let mut eviction_policies = Vec::new();
        let mut aof = Vec::new();
        for line in info.lines() {
            let line = line.trim();
            if let Some(policy) = line.strip_prefix("maxmemory_policy:") {
                eviction_policies.push(policy.to_owned());
            } else if let Some(enabled) = line.strip_prefix("aof_enabled:") {
                aof.push(enabled == "1");
            }
        }
        Self {
            eviction_policies,
            append_only: !aof.is_empty() && aof.iter().all(|on| *on),
        }
    }

    /// The policies that can evict idem's records (anything but
    /// `noeviction`); empty when the server is safe.
    pub fn evicting_policies(&self) -> Vec<&str> {
        self.eviction_policies
            .iter()
            .map(String::as_str)
            .filter(|policy| *policy != "noeviction")
            .collect()
    }
}

/// Every text in a reply, one after another (a cluster answers `INFO` per
/// node).
fn collect_text(value: &Value, out: &mut String) {
    match value {
        Value::BulkString(bytes) => {
            out.push_str(&String::from_utf8_lossy(bytes));
            out.push('\n');
        }
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => {
            out.push_str(text);
            out.push('\n');
        }
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|item| collect_text(item, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(key, item)| {
            collect_text(key, out);
            collect_text(item, out);
        }),
        _ => {}
    }
}

// ===== reply decoding =====

fn items(value: Value) -> Result<Vec<Value>, StoreError> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(corrupt(format!("unexpected script reply {other:?}"))),
    }
}

fn text(value: &Value) -> Result<String, StoreError> {
    match value {
        Value::BulkString(bytes) => {
            String::from_utf8(bytes.clone()).map_err(|_| corrupt("non-UTF-8 text"))
        }
        Value::SimpleString(s) => Ok(s.clone()),
        Value::Int(n) => Ok(n.to_string()),
        other => Err(corrupt(format!("expected text, got {other:?}"))),
    }
}

fn int(value: &Value) -> Result<u64, StoreError> {
    match value {
        Value::Int(n) => u64::try_from(*n).map_err(|_| corrupt("negative number")),
        other => text(other)?
            .parse()
            .map_err(|_| corrupt(format!("expected a number, got {other:?}"))),
    }
}

fn bytes(value: &Value) -> Result<Bytes, StoreError> {
    match value {
        Value::BulkString(bytes) => Ok(Bytes::copy_from_slice(bytes)),
        Value::Nil => Ok(Bytes::new()),
        other => Err(corrupt(format!("expected bytes, got {other:?}"))),
    }
}

fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        for part in [name.as_bytes(), value.as_ref()] {
            out.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

fn decode_headers(mut raw: &[u8]) -> Result<Vec<(String, Bytes)>, StoreError> {
    fn take<'a>(raw: &mut &'a [u8]) -> Result<&'a [u8], StoreError> {
        let (len, rest) = raw
            .split_first_chunk::<4>()
            .ok_or_else(|| corrupt("truncated headers"))?;
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len {
            return Err(corrupt("truncated headers"));
        }
        let (part, rest) = rest.split_at(len);
        *raw = rest;
        Ok(part)
    }
    let mut headers = Vec::new();
    while !raw.is_empty() {
        let name =
            String::from_utf8(take(&mut raw)?.to_vec()).map_err(|_| corrupt("header name"))?;
        let value = Bytes::copy_from_slice(take(&mut raw)?);
        headers.push((name, value));
    }
    Ok(headers)
}

fn outcome(status: u64, stored: &str, headers: &[u8], body: Bytes) -> Result<Outcome, StoreError> {
    let status = u16::try_from(status).map_err(|_| corrupt("status"))?;
    Ok(if stored == "1" {
        Outcome::Stored(StoredResponse {
            status,
            headers: decode_headers(headers)?,
            body,
        })
    } else {
        Outcome::NotStored { status }
    })
}

/// Decodes the `current(state)` reply shape of the scripts.
fn decode_current(reply: &[Value]) -> Result<Current, StoreError> {
    let tag = text(reply.first().ok_or_else(|| corrupt("empty reply"))?)?;
    let at = |i: usize| {
        reply
            .get(i)
            .ok_or_else(|| corrupt(format!("short reply to {tag}")))
    };
    match tag.as_str() {
        "vacant" => Ok(Current::Vacant),
        "cancelled" => Ok(Current::Cancelled),
        "processing" => Ok(Current::Processing {
            retry_after: Duration::from_millis(int(at(1)?)?),
        }),
        "completed" => {
            let outcome = outcome(
                int(at(1)?)?,
                &text(at(2)?)?,
                &bytes(at(3)?)?,
                bytes(at(4)?)?,
            )?;
            Ok(Current::Completed(Replay {
                outcome,
                age: Duration::from_millis(int(at(5)?)?),
            }))
        }
        other => Err(corrupt(format!("unexpected reply {other}"))),
    }
}

/// `completed:201:<ms>` or `released::<ms>`, as the scripts write it.
fn decode_late(raw: &str) -> Result<Option<LateEvidence>, StoreError> {
    if raw.is_empty() {
        return Ok(None);
    }
    let mut parts = raw.splitn(3, ':');
    let (kind, status, at) = (parts.next(), parts.next(), parts.next());
    let at_ms = at
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| corrupt("late evidence time"))?;
    match (kind, status) {
        (Some("completed"), Some(status)) => Ok(Some(LateEvidence::Completed {
            status: status
                .parse()
                .map_err(|_| corrupt("late evidence status"))?,
            at_ms,
        })),
        (Some("released"), _) => Ok(Some(LateEvidence::Released { at_ms })),
        _ => Err(corrupt(format!("late evidence {raw:?}"))),
    }
}

/// The newest attempt, kept in the `cur_*` fields.
fn current_attempt(
    fields: &HashMap<String, &Value>,
    generation: u64,
) -> Result<Attempt, StoreError> {
    let get = |name: &str| {
        fields
            .get(name)
            .map(|v| text(v))
            .transpose()
            .map(Option::unwrap_or_default)
    };
    let number = |raw: String| {
        raw.parse::<u64>()
            .map_err(|_| corrupt(format!("attempt field {raw:?}")))
    };
    let ended = get("cur_end")?;
    let outcome = match get("cur_outcome")?.as_str() {
        "running" => AttemptOutcome::Running,
        "completed" => AttemptOutcome::Completed {
            status: get("cur_status")?
                .parse()
                .map_err(|_| corrupt("attempt status"))?,
        },
        "released" => AttemptOutcome::Released,
        "superseded" => AttemptOutcome::Superseded,
        "cancelled" => AttemptOutcome::Cancelled,
        "released_by_operator" => AttemptOutcome::ReleasedByOperator,
        other => return Err(corrupt(format!("attempt outcome {other:?}"))),
    };
    Ok(Attempt {
        id: AttemptId(uuid::Uuid::parse_str(&get("cur_id")?).map_err(|_| corrupt("attempt id"))?),
        generation,
        started_at_ms: number(get("cur_start")?)?,
        ended_at_ms: if ended.is_empty() {
            None
        } else {
            Some(number(ended)?)
        },
        outcome,
        late: decode_late(&get("cur_late")?)?,
    })
}

fn decode_record(scope: ScopeHash, pairs: &[Value]) -> Result<Record, StoreError> {
    let mut fields: HashMap<String, &Value> = HashMap::new();
    for pair in pairs.chunks(2) {
        if let [name, value] = pair {
            fields.insert(text(name)?, value);
        }
    }
    let field = |name: &str| {
        fields
            .get(name)
            .copied()
            .ok_or_else(|| corrupt(format!("record lacks {name}")))
    };
    let opt_int = |name: &str| fields.get(name).map(|v| int(v)).transpose();
    let state = match text(field("state")?)?.as_str() {
        "processing" => RecordState::Processing,
        "completed" => RecordState::Completed,
        "cancelled" => RecordState::Cancelled,
        "released" => RecordState::Released,
        other => return Err(corrupt(format!("unknown state {other}"))),
    };
    let owner = match fields.get("owner").map(|v| text(v)).transpose()? {
        Some(token) if !token.is_empty() => Some(OwnerToken(
            uuid::Uuid::parse_str(&token).map_err(|_| corrupt("owner token"))?,
        )),
        _ => None,
    };
    let outcome = match (state, fields.get("status")) {
        (RecordState::Completed, Some(status)) => Some(outcome(
            int(status)?,
            &text(field("stored")?)?,
            &bytes(field("headers")?)?,
            bytes(field("body")?)?,
        )?),
        _ => None,
    };
    let mut attempts: Vec<Attempt> = match fields.get("hist").map(|v| bytes(v)).transpose()? {
        Some(raw) if !raw.is_empty() => {
            serde_json::from_slice(&raw).map_err(|e| corrupt(format!("attempt history: {e}")))?
        }
        _ => Vec::new(),
    };
    if fields.contains_key("cur_id") {
        attempts.push(current_attempt(&fields, int(field("gen")?)?)?);
    }
    Ok(Record {
        scope,
        tenant: text(field("tenant")?)?,
        operation: text(field("op")?)?,
        key: text(field("key")?)?,
        fingerprint: Fingerprint::from_hex(&text(field("fp")?)?)
            .ok_or_else(|| corrupt("fingerprint"))?,
        state,
        generation: int(field("gen")?)?,
        owner,
        lease_expires_at_ms: opt_int("lease_until")?.unwrap_or(0),
        lease_ms: opt_int("lease_ms")?.unwrap_or(0),
        retention_ms: opt_int("retention_ms")?.unwrap_or(0),
        created_at_ms: opt_int("created")?.unwrap_or(0),
        updated_at_ms: opt_int("updated")?.unwrap_or(0),
        completed_at_ms: opt_int("completed")?,
        expires_at_ms: opt_int("expires")?.unwrap_or(0),
        outcome,
        attempts,
    })
}

fn lease_args<'a>(invocation: &mut ScriptInvocation<'a>, lease: &Lease) {
    invocation
        .arg(lease.generation)
        .arg(lease.token.0.to_string());
}

// ===== impl Store =====

impl Store for RedisStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let scope = request.scope.hash();
        let attempt = AttemptId::new();
        let token = OwnerToken::new();
        let mut invocation = self.scripts.reserve.prepare_invoke();
        invocation
            .key(self.record_key(scope))
            .arg(request.fingerprint.to_hex())
            .arg(attempt.to_string())
            .arg(token.0.to_string())
            .arg(millis(request.lease))
            .arg(millis(request.retention))
            .arg(request.scope.tenant())
            .arg(request.scope.operation())
            .arg(request.scope.key().as_str())
            .arg(ATTEMPT_HISTORY);
        // If this call is given up (it times out, or its caller's timeout
        // drops it) after the script was sent, the guard frees the
        // reservation by its owner token once the server answers.
        let mut guard = Abandon {
            script: self.scripts.abandon.clone(),
            key: self.record_key(scope),
            attempt: attempt.to_string(),
            token: token.0.to_string(),
            conn: None,
            within: request.lease,
        };
        let (reply, acked) = self
            .run_on(invocation, self.wait_replicas.is_some(), &mut guard.conn)
            .await?;
        let reply = items(reply)?;
        let tag = text(reply.first().ok_or_else(|| corrupt("empty reply"))?)?;
        let lease = |generation: u64| Lease {
            scope: *scope,
            attempt,
            generation,
            token,
            ttl: request.lease,
        };
        let reservation = match tag.as_str() {
            "acquired" => Reservation::Acquired(lease(int(reply
                .get(1)
                .ok_or_else(|| corrupt("short reply"))?)?)),
            "taken_over" => {
                let generation = int(reply.get(1).ok_or_else(|| corrupt("short reply"))?)?;
                let superseded: Attempt = serde_json::from_slice(&bytes(
                    reply.get(2).ok_or_else(|| corrupt("short reply"))?,
                )?)
                .map_err(|e| corrupt(format!("superseded attempt: {e}")))?;
                Reservation::TakenOver {
                    lease: lease(generation),
                    superseded,
                }
            }
            "in_progress" => Reservation::InProgress {
                retry_after: Duration::from_millis(int(reply
                    .get(1)
                    .ok_or_else(|| corrupt("short reply"))?)?),
            },
            "conflict" => Reservation::Conflict,
            _ => match decode_current(&reply)? {
                Current::Completed(replay) => Reservation::Completed(replay),
                Current::Cancelled => Reservation::Cancelled,
                other => return Err(corrupt(format!("unexpected reservation reply {other:?}"))),
            },
        };
        if let (
            Reservation::Acquired(lease) | Reservation::TakenOver { lease, .. },
            Some((acked, wanted)),
        ) = (&reservation, self.short_of_replicas(acked))
        {
            // The handler must not run on a reservation a failover could lose.
            let _ = self.release(lease).await;
            return Err(StoreError::unavailable(format!(
                "the reservation reached {acked} of {wanted} replicas in time"
            )));
        }
        // Answered and decoded: the caller owns what it reserved.
        guard.conn = None;
        Ok(reservation)
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        let mut invocation = self.scripts.renew.prepare_invoke();
        invocation.key(self.record_key(&lease.scope));
        lease_args(&mut invocation, lease);
        invocation.arg(millis(lease.ttl));
        let reply = items(self.run(invocation, false).await?.0)?;
        if reply.first().map(text).transpose()?.as_deref() == Some("renewed") {
            return Ok(Renewal::Renewed);
        }
        Ok(Renewal::Fenced(decode_current(&reply)?))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        let mut invocation = self.scripts.complete.prepare_invoke();
        invocation.key(self.record_key(&lease.scope));
        lease_args(&mut invocation, lease);
        invocation
            .arg(lease.attempt.to_string())
            .arg(outcome.status());
        match outcome {
            Outcome::Stored(response) => {
                invocation
                    .arg("1")
                    .arg(encode_headers(&response.headers))
                    .arg(response.body.as_ref());
            }
            Outcome::NotStored { .. } => {
                invocation.arg("0").arg("").arg("");
            }
        }
        let (reply, acked) = self.run(invocation, self.wait_replicas.is_some()).await?;
        let reply = items(reply)?;
        if reply.first().map(text).transpose()?.as_deref() == Some("recorded") {
            if let Some((acked, wanted)) = self.short_of_replicas(acked) {
                tracing::warn!(
                    acked,
                    wanted,
                    "the completion reached fewer replicas than requested"
                );
            }
            return Ok(Completion::Recorded);
        }
        Ok(Completion::Fenced(decode_current(&reply)?))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        let mut invocation = self.scripts.release.prepare_invoke();
        invocation.key(self.record_key(&lease.scope));
        lease_args(&mut invocation, lease);
        invocation.arg(lease.attempt.to_string());
        let reply = items(self.run(invocation, false).await?.0)?;
        if reply.first().map(text).transpose()?.as_deref() == Some("released") {
            return Ok(Release::Released);
        }
        Ok(Release::Fenced(decode_current(&reply)?))
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        let mut invocation = self.scripts.cancel.prepare_invoke();
        // The id lets a retried call recognise its own earlier cancel.
        invocation
            .key(self.record_key(scope))
            .arg(uuid::Uuid::new_v4().to_string());
        let reply = items(self.run(invocation, false).await?.0)?;
        let tag = text(reply.first().ok_or_else(|| corrupt("empty reply"))?)?;
        let record = || match reply.get(1) {
            Some(Value::Array(pairs)) => decode_record(*scope, pairs),
            _ => Err(corrupt("cancel reply without the record")),
        };
        Ok(match tag.as_str() {
            "not_found" => Cancellation::NotFound,
            "cancelled" => Cancellation::Cancelled(record()?),
            "already_completed" => Cancellation::AlreadyCompleted(record()?),
            "already_cancelled" => Cancellation::AlreadyCancelled(record()?),
            other => return Err(corrupt(format!("unexpected cancel reply {other}"))),
        })
    }

    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let clock: Vec<u64> = self.command(redis::cmd("TIME")).await?;
        let now_ms = match clock.as_slice() {
            [secs, micros] => secs * 1000 + micros / 1000,
            _ => return Err(corrupt("TIME answered oddly")),
        };
        let mut found = Vec::new();
        for key in self.record_keys().await? {
            let Some(scope) = key
                .strip_prefix(&self.prefix)
                .and_then(|rest| rest.strip_prefix('{'))
                .and_then(|rest| rest.strip_suffix('}'))
                .and_then(scope_from_hex)
            else {
                continue;
            };
            if let Some(record) = self.get(&scope).await?
                && query.matches(&record, now_ms)
            {
                found.push(record);
            }
        }
        found.sort_by(|a, b| (a.created_at_ms, &a.key).cmp(&(b.created_at_ms, &b.key)));
        found.truncate(query.limit);
        Ok(found)
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        let mut invocation = self.scripts.force_release.prepare_invoke();
        invocation.key(self.record_key(scope));
        let reply = items(self.run(invocation, false).await?.0)?;
        let Some((kind, pairs)) = reply.split_first() else {
            return Err(corrupt("empty force-release reply"));
        };
        Ok(match text(kind)?.as_str() {
            "released" => ForceRelease::Released(decode_record(*scope, pairs)?),
            "not_processing" => ForceRelease::NotProcessing(decode_record(*scope, pairs)?),
            _ => ForceRelease::NotFound,
        })
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        let mut invocation = self.scripts.get.prepare_invoke();
        invocation.key(self.record_key(scope));
        let pairs = items(self.run(invocation, false).await?.0)?;
        if pairs.is_empty() {
            return Ok(None);
        }
        decode_record(*scope, &pairs).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_binary() {
        let headers = vec![
            ("location".to_owned(), Bytes::from_static(b"/orders/1")),
            ("x-bin".to_owned(), Bytes::from_static(b"\x00\xff\r\n")),
            ("empty".to_owned(), Bytes::new()),
        ];
        assert_eq!(
            decode_headers(&encode_headers(&headers)).expect("decode"),
            headers
        );
        assert!(decode_headers(b"\x00\x00\x00\x09abc").is_err());
    }

    #[test]
    fn record_keys_share_one_hash_tag() {
        let store = RedisStore::from_url("redis://127.0.0.1:1").expect("store");
        let key = store.record_key(&ScopeHash::from_bytes([0xab; 32]));
        assert_eq!(key, format!("idem:{{{}}}", "ab".repeat(32)));
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        fn value() -> impl Strategy<Value = Value> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::BulkString),
                any::<i64>().prop_map(Value::Int),
                Just(Value::Nil),
            ]
        }

        /// A completed record with a second attempt and a history, as the
        /// scripts write it: every field the decoder reads is present.
        fn valid_record() -> Vec<(&'static str, Vec<u8>)> {
            let headers = encode_headers(&[
                ("location".to_owned(), Bytes::from_static(b"/orders/1")),
                (
                    "content-type".to_owned(),
                    Bytes::from_static(b"application/json"),
                ),
            ]);
            let hist = br#"[{"id":"0190a0f2-5b1c-7c3e-9f00-000000000001","generation":1,"started_at_ms":1700000000000,"ended_at_ms":1700000001000,"outcome":{"kind":"superseded"},"late":{"kind":"completed","status":201,"at_ms":1700000002000}}]"#;
            vec![
                ("tenant", b"t1".to_vec()),
                ("op", b"POST /orders".to_vec()),
                ("key", b"k".to_vec()),
                ("created", b"1700000000000".to_vec()),
                ("fp", "ab".repeat(32).into_bytes()),
                ("state", b"completed".to_vec()),
                ("gen", b"2".to_vec()),
                ("owner", b"".to_vec()),
                ("lease_until", b"1700000031000".to_vec()),
                ("lease_ms", b"30000".to_vec()),
                ("retention_ms", b"86400000".to_vec()),
                ("updated", b"1700000003000".to_vec()),
                ("expires", b"1700086400000".to_vec()),
                ("status", b"201".to_vec()),
                ("stored", b"1".to_vec()),
                ("headers", headers),
                ("body", b"{\"id\":1}".to_vec()),
                ("completed", b"1700000003000".to_vec()),
                ("cur_id", b"0190a0f2-5b1c-7c3e-9f00-000000000002".to_vec()),
                ("cur_start", b"1700000001000".to_vec()),
                ("cur_end", b"1700000003000".to_vec()),
                ("cur_outcome", b"completed".to_vec()),
                ("cur_status", b"201".to_vec()),
                ("cur_late", b"".to_vec()),
                ("hist", hist.to_vec()),
            ]
        }

        fn pairs(fields: &[(&str, Vec<u8>)]) -> Vec<Value> {
            fields
                .iter()
                .flat_map(|(name, value)| {
                    [
                        Value::BulkString(name.as_bytes().to_vec()),
                        Value::BulkString(value.clone()),
                    ]
                })
                .collect()
        }

        #[test]
        fn the_valid_record_decodes() {
            let record = decode_record(ScopeHash::from_bytes([1; 32]), &pairs(&valid_record()))
                .expect("the base of the mutation test is a valid record");
            assert_eq!(record.attempts.len(), 2);
            assert_eq!(record.generation, 2);
        }

        /// What a mutation does to one field of a valid record.
        #[derive(Debug, Clone)]
        enum Mutation {
            Remove,
            Replace(Vec<u8>),
            Truncate(usize),
            FlipByte(usize, u8),
        }

        fn mutation() -> impl Strategy<Value = Mutation> {
            prop_oneof![
                Just(Mutation::Remove),
                prop::collection::vec(any::<u8>(), 0..24).prop_map(Mutation::Replace),
                prop_oneof![
                    Just(b"-1".to_vec()),
                    Just(b"99999999999999999999999".to_vec()),
                    Just(b"processing".to_vec()),
                    Just(b"released".to_vec()),
                    Just(b"[]".to_vec()),
                    Just(b"{}".to_vec()),
                    Just(b"null".to_vec()),
                ]
                .prop_map(Mutation::Replace),
                any::<usize>().prop_map(Mutation::Truncate),
                (any::<usize>(), any::<u8>()).prop_map(|(at, to)| Mutation::FlipByte(at, to)),
            ]
        }

        proptest! {
            /// Mutations of a valid record (a field removed, replaced,
            /// truncated or with one byte changed, several at once) get
            /// past the first checks into every part of the decoder, and
            /// are decoded or refused as corrupt, never a panic.
            #[test]
            fn mutated_records_never_panic(
                mutations in prop::collection::vec((0usize..25, mutation()), 1..4)
            ) {
                let mut fields = valid_record();
                for (index, mutation) in mutations {
                    let index = index % fields.len();
                    match mutation {
                        Mutation::Remove => {
                            fields.remove(index);
                        }
                        Mutation::Replace(value) => fields[index].1 = value,
                        Mutation::Truncate(at) => {
                            let len = fields[index].1.len();
                            fields[index].1.truncate(at % (len + 1));
                        }
                        Mutation::FlipByte(at, to) => {
                            let value = &mut fields[index].1;
                            if !value.is_empty() {
                                let at = at % value.len();
                                value[at] = to;
                            }
                        }
                    }
                    if fields.is_empty() {
                        break;
                    }
                }
                let _ = decode_record(ScopeHash::from_bytes([1; 32]), &pairs(&fields));
            }

            #[test]
            fn headers_decode_never_panics(raw in prop::collection::vec(any::<u8>(), 0..200)) {
                let _ = decode_headers(&raw);
            }

            #[test]
            fn headers_round_trip(headers in prop::collection::vec(("[a-z-]{1,20}", prop::collection::vec(any::<u8>(), 0..50)), 0..10)) {
                let headers: Vec<(String, Bytes)> = headers.into_iter().map(|(n, v)| (n, Bytes::from(v))).collect();
                prop_assert_eq!(decode_headers(&encode_headers(&headers)).expect("decode"), headers);
            }

            #[test]
            fn late_evidence_decode_never_panics(raw in ".{0,40}") {
                let _ = decode_late(&raw);
            }

            /// A record hash with arbitrary fields is decoded or refused as
            /// corrupt, never a panic.
            #[test]
            fn record_decode_never_panics(
                fields in prop::collection::vec(
                    (prop::sample::select(vec![
                        "tenant", "op", "key", "fp", "state", "gen", "owner", "lease_until", "status",
                        "stored", "headers", "body", "completed", "expires", "hist", "cur_id",
                        "cur_start", "cur_end", "cur_outcome", "cur_status", "cur_late", "junk",
                    ]), value()),
                    0..30,
                )
            ) {
                let pairs: Vec<Value> = fields
                    .into_iter()
                    .flat_map(|(name, value)| [Value::BulkString(name.as_bytes().to_vec()), value])
                    .collect();
                let _ = decode_record(ScopeHash::from_bytes([1; 32]), &pairs);
                let _ = decode_current(&pairs);
            }
        }
    }

    #[test]
    fn urls_are_checked() {
        assert!(RedisStore::from_url("http://x").is_err());
        assert!(RedisStore::from_url("redis+cluster://").is_err());
        assert!(RedisStore::from_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").is_ok());
        assert!(
            RedisStore::builder("redis+cluster://h:1")
                .wait_for_replicas(1, Duration::from_millis(5))
                .build()
                .is_err()
        );
    }
}
