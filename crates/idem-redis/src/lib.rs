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
//!   every key a script touches is in one cluster slot. Every value of a
//!   typical record fits Redis' compact hash encoding (64 bytes at the
//!   default `hash-max-listpack-value`): a hashed tenant (`auth:` and 64
//!   hex digits) is kept as its prefix and 32 bytes, times that other
//!   fields imply are not repeated, and a response whose headers or body
//!   exceed 64 bytes is kept, binary-safe, in a string key of its own
//!   beside the hash (`{prefix}{<scope hash>}:r`, same slot, same expiry).
//!   A gateway-shaped record with a 100-byte response takes about 850
//!   bytes of Redis memory. Records written by earlier versions (every
//!   field, the response inline) are read and replayed as they are. A key
//!   or a tenant longer than 64 bytes still works; its record is kept in
//!   Redis' larger hash encoding.
//! * **Packed records** ([`RedisStoreBuilder::pack_records`], off by
//!   default): a new key and its completion write 12 fields instead of 21,
//!   about 15 % fewer Redis instructions and 15 to 30 % fewer bytes per
//!   record. Every store of this version reads both layouts; turn packing
//!   on once no instance of an earlier version shares the Redis.
//! * **Compact headers** ([`RedisStoreBuilder::compact_headers`], off by
//!   default): a stored response's headers with one byte of length per
//!   name and value instead of four, so a typical API response's headers
//!   (`content-type`, `location`) fit the compact hash and the response
//!   stays in the record, without a key of its own. Every store of this
//!   version reads both forms; turn it on once no instance of an earlier
//!   version shares the Redis.
//! * **Waiting without polling.** With
//!   the layer's `InFlight::Wait` a duplicate waits for
//!   the running request's outcome. On a single node, the scripts that
//!   take a record out of `processing` publish on the record's channel
//!   (`…:c`); a waiter subscribes on the store's one subscriber connection,
//!   marks the record as waited on and reads its state in one script (so an
//!   outcome that came first is not missed), and then costs Redis nothing
//!   until the notification wakes it. Completions and releases of records
//!   nobody waits on publish nothing.
//!   On a cluster (where `PUBLISH` travels to every node), or when the
//!   subscriber connection cannot be had, waiters poll every 25 ms.
//! * **Server time.** Leases and retention are measured with Redis `TIME`
//!   inside the scripts, never the web server's clock; records expire with
//!   the key (`PEXPIREAT`, or `PEXPIRE` by the retention for a packed new
//!   key). A replay reads no clock in Redis (a record Redis hands a
//!   script is live by its own expiry): the age it reports is the web
//!   server's clock minus the stored completion time. A completion and a
//!   release write the attempt's end by their caller's clock (reading
//!   `TIME` was a fifth of a completion's cost), so skew between web
//!   servers shows in that age (a metric) and in the end times a record
//!   shows (an end before the start reads as the start), and nowhere
//!   else.
//! * **Round trips.** A new key costs two round trips (reserve, complete),
//!   plus one renewal per third of the lease for long handlers; a replay, a
//!   conflict or an in-progress answer costs one.
//! * **Pooled, multiplexed.** Connections come from a `deadpool-redis` pool
//!   (which creates them and checks them with `PING`) and are held in a few
//!   *lanes* ([`RedisStoreBuilder::lanes`], default 1): redis-rs multiplexes
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
//! without AOF. A record takes about 600 to 900 bytes (see above).
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

use std::time::Duration;

use idem_core::{
    Attempt, AttemptId, Cancellation, Completion, Current, Fleet, ForceRelease, Lease,
    OldestRecords, Outcome, OwnerToken, Record, RecordQuery, RecordState, RecordsAdmin, Release,
    Renewal, Reservation, ReserveRequest, ScopeHash, Store, StoreError,
};
use redis::Value;

/// How many record reads [`RecordsAdmin::list`](idem_core::RecordsAdmin::list) keeps in
/// flight at once.
const LIST_READS_AT_ONCE: usize = 32;

/// How many keys one call of the lapsed-records count asks `SCAN` for
/// (`count_lapsed.lua`): each call holds Redis for its page (about 5 µs a
/// key on a small machine, the `SCAN` included), so a call stays under a
/// millisecond.
const COUNT_LAPSED_PAGE: usize = 100;

mod builder;
mod cluster;
mod connection;
mod decode;
mod limits;
mod scripts;
mod watch;

pub use builder::{BuildError, RedisStoreBuilder};
#[allow(deprecated)]
pub use cluster::LIST_SCAN_LIMIT;
pub use cluster::{Health, failover_bound};
use connection::{Abandon, Invocation, Lane, Pool};
use decode::*;
use scripts::Scripts;

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
    /// Whether completions write headers in the compact form
    /// ([`RedisStoreBuilder::compact_headers`]).
    compact_headers: bool,
    timeout: Duration,
    wait_replicas: Option<(usize, Duration)>,
    /// Waiting duplicates woken by the scripts' notifications.
    watch: std::sync::Arc<watch::Watch>,
    /// Tasks freeing reservations whose calls were given up.
    given_up: tokio_util::task::TaskTracker,
}

/// The Lua source of one of the store's scripts (`"reserve"`,
/// `"complete"`, `"release"`, ...) as a single-node store loads it
/// (writing packed records when `packed`, see
/// [`RedisStoreBuilder::pack_records`]), for benchmarks that call the
/// scripts directly; `None` for an unknown name.
#[doc(hidden)]
pub fn script_source(name: &str, packed: bool) -> Option<String> {
    let body = scripts::body(name);
    let constants = scripts::Constants {
        notify: true,
        packed,
    };
    (!body.is_empty()).then(|| scripts::source(body, constants, "tenant"))
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

/// The Redis key of a scope's record under `prefix`, in the pieces it is
/// written from: the scope hash's hex (`hex`, its
/// [`ScopeHash::hex_bytes`]) inside a hash tag, so that every key of one
/// record lands in one cluster slot.
fn record_key_pieces<'a>(prefix: &'a str, hex: &'a [u8; 64]) -> [&'a [u8]; 4] {
    [prefix.as_bytes(), b"{", hex, b"}"]
}

/// A claim's time to live in whole milliseconds, at least one (`PX`).
fn px(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The store could not do its call; the driver's error stays the source.
/// An error the server answered with (out of memory under `noeviction`, a
/// permission, a script error) is [`StoreError::Refused`], which fail-open
/// never covers; one of a server that could not be reached, is loading or
/// failing over is [`StoreError::Unavailable`].
fn unavailable(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    let error = error.into();
    let answered = error
        .downcast_ref::<redis::RedisError>()
        .is_some_and(answered_by_the_server);
    if answered {
        StoreError::Refused(error)
    } else {
        StoreError::Unavailable(error)
    }
}

/// Whether the server was reached and answered with an error of its own.
fn answered_by_the_server(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if error.is_io_error() || error.is_connection_dropped() || error.is_timeout() {
        return false;
    }
    match error.kind() {
        ErrorKind::Server(kind) => !matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ),
        ErrorKind::Extension | ErrorKind::AuthenticationFailed => true,
        _ => false,
    }
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
            lanes: 1,
            timeout: Duration::from_secs(1),
            wait_replicas: None,
            packed: false,
            compact_headers: false,
        }
    }

    /// The Redis key of a scope's record: the scope hash inside a hash tag.
    pub fn record_key(&self, scope: &ScopeHash) -> String {
        let hex = scope.hex_bytes();
        record_key_pieces(&self.prefix, &hex)
            .iter()
            .map(|piece| String::from_utf8_lossy(piece))
            .collect()
    }

    /// The live record of `scope`; with `only_processing`, only if it is
    /// processing (another is read no further than its state); with
    /// `tenant` (as the `tenant` and the `tenant_bin` fields hold it, see
    /// `get.lua`), only if it is that tenant's.
    async fn read(
        &self,
        scope: &ScopeHash,
        only_processing: bool,
        tenant: Option<(&str, &[u8])>,
    ) -> Result<Option<Record>, StoreError> {
        let mut invocation = Invocation::on_record(&self.scripts.get, &self.prefix, scope);
        if only_processing || tenant.is_some() {
            invocation.arg(if only_processing { "processing" } else { "" });
        }
        if let Some((text, binary)) = tenant {
            invocation.arg(text).arg(binary);
        }
        let pairs = items(self.run(invocation, false).await?.0)?;
        if pairs.is_empty() {
            return Ok(None);
        }
        decode_record(*scope, &pairs).map(Some)
    }

    /// The Redis key of the store's identity marker (see
    /// [`claim_identity`](Self::claim_identity)); no record key looks like
    /// it.
    pub fn identity_key(&self) -> String {
        format!("{}identity", self.prefix)
    }

    /// Claims the store for `marker`, a short text naming how the
    /// instances sharing it derive tenants and scopes (see
    /// [`IdentityClaim`]), in the key [`identity_key`](Self::identity_key).
    ///
    /// An unclaimed store, or one claimed with the same marker, is
    /// claimed for `ttl` (the retention: as long as the newest record may
    /// live), extended and never shortened. With `replace`, the marker
    /// takes the store whatever it held.
    pub async fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> Result<IdentityClaim, StoreError> {
        let key = self.identity_key();
        if replace {
            let mut set = redis::cmd("SET");
            set.arg(&key).arg(marker).arg("PX").arg(px(ttl));
            self.command::<Value>(set).await?;
            return Ok(IdentityClaim::Held);
        }
        // Extended, never shortened.
        Ok(match self.claim_key(&key, marker, ttl, &["GT"]).await? {
            None => IdentityClaim::Held,
            Some(other) => IdentityClaim::Other(other),
        })
    }

    /// Claims `key` for `holder` for `ttl`: a free key is taken
    /// (`SET NX GET`), one `holder` holds is given `ttl` from now again
    /// (`PEXPIRE`, with `extend_flags`). Answers the other holder, if
    /// another holds it.
    async fn claim_key(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        extend_flags: &[&str],
    ) -> Result<Option<String>, StoreError> {
        let millis = px(ttl);
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(holder)
            .arg("PX")
            .arg(millis)
            .arg("NX")
            .arg("GET");
        let held: Option<String> = self.command(set).await?;
        match held {
            Some(held) if held == holder => {
                // Should the claim lapse between the two commands and
                // another holder take it, this lengthens theirs: they
                // hold it a little longer.
                let mut extend = redis::cmd("PEXPIRE");
                extend.arg(key).arg(millis).arg(extend_flags);
                self.command::<Value>(extend).await?;
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// The key that holds who does the fleet-wide chore `duty`.
    pub fn duty_key(&self, duty: &str) -> String {
        format!("{}duty:{duty}", self.prefix)
    }

    /// Claims the chore `duty` for `holder` for `ttl` in
    /// [`duty_key`](Self::duty_key) (see [`Fleet::claim_duty`]): taken
    /// when no one holds it, extended to `ttl` from now when `holder` does.
    pub async fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.duty_key(duty);
        Ok(self.claim_key(&key, holder, ttl, &[]).await?.is_none())
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
}

pub use idem_core::IdentityClaim;

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

// ===== impl Store =====

/// The reserve script's answer; `lease` makes the lease of a generation.
/// A new key's hot path answers the integer 1 (acquired, generation 1), a
/// replay one string, every other path a table led by its kind.
fn decode_reservation(
    reply: Value,
    lease: impl Fn(u64) -> Lease,
) -> Result<Reservation, StoreError> {
    if hot_path(&reply) {
        return Ok(Reservation::Acquired(lease(1)));
    }
    if let Value::BulkString(raw) = reply {
        return Ok(Reservation::Completed(decode_replay(raw)?));
    }
    let reply = items(reply)?;
    let field = |i: usize| reply.get(i).ok_or_else(|| corrupt("short reply"));
    Ok(match decode::tag(reply.first())? {
        "acquired" => Reservation::Acquired(lease(int(field(1)?)?)),
        "taken_over" => {
            let superseded: Attempt = serde_json::from_slice(&bytes(field(2)?)?)
                .map_err(|e| corrupt(format!("superseded attempt: {e}")))?;
            Reservation::TakenOver {
                lease: lease(int(field(1)?)?),
                superseded,
            }
        }
        "in_progress" => Reservation::InProgress {
            retry_after: Duration::from_millis(int(field(1)?)?),
        },
        "conflict" => Reservation::Conflict,
        _ => match decode_current(reply)? {
            Current::Completed(replay) => Reservation::Completed(replay),
            Current::Cancelled => Reservation::Cancelled,
            other => return Err(corrupt(format!("unexpected reservation reply {other:?}"))),
        },
    })
}

impl Store for RedisStore {
    /// Each call is bounded by the store's timeout (plus the wait for
    /// replicas, when it waits for them): see [`RedisStoreBuilder::timeout`].
    fn call_bound(&self) -> Option<Duration> {
        Some(RedisStore::call_bound(self))
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        self.given_up.wait()
    }

    fn background_tasks(&self) -> usize {
        self.given_up.len()
    }

    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let scope = request.scope.hash();
        // If this call is given up (it times out, or its caller's timeout
        // drops it) after the script was sent, the guard frees the
        // reservation by its owner token once the server answers. The
        // attempt's id and token live in the guard alone while the call
        // is out (a future holds what is live across an await: a copy
        // would make every reservation's future larger).
        let mut guard = Abandon {
            store: self,
            scope: *scope,
            attempt: AttemptId::new().0,
            token: OwnerToken::new().0,
            conn: None,
            within: request.retention,
        };
        let invocation = {
            let tenant = TenantForm::of_shared(request.scope.shared_tenant());
            let script = if tenant.field() == "tenant_bin" {
                &self.scripts.reserve_bin
            } else {
                &self.scripts.reserve
            };
            let mut invocation = Invocation::on_record(script, &self.prefix, scope);
            invocation
                .arg(&request.fingerprint.hex_bytes()[..])
                .uuid(&guard.attempt)
                .uuid(&guard.token)
                .arg(millis(request.lease))
                .arg(millis(request.retention))
                .pieces(&tenant.pieces())
                .arg(request.scope.operation())
                .arg(request.scope.key().as_str());
            invocation
        };
        let (reply, acked) = self
            .run_on(
                invocation,
                self.wait_replicas.is_some(),
                Some(&mut guard.conn),
            )
            .await?;
        let (attempt, token) = (AttemptId(guard.attempt), OwnerToken(guard.token));
        let lease = |generation: u64| Lease {
            scope: *scope,
            attempt,
            generation,
            token,
            ttl: request.lease,
        };
        let reservation = decode_reservation(reply, lease)?;
        if let (
            Reservation::Acquired(lease) | Reservation::TakenOver { lease, .. },
            Some((acked, wanted)),
        ) = (&reservation, self.short_of_replicas(acked))
        {
            // The handler must not run on a reservation a failover could lose.
            // (Boxed: this rare path's future would otherwise make every
            // reservation's future as large as itself plus a release's.)
            let _ = Box::pin(self.release(lease)).await;
            return Err(StoreError::unavailable(format!(
                "the reservation reached {acked} of {wanted} replicas in time"
            )));
        }
        // Answered and decoded: the caller owns what it reserved.
        guard.conn = None;
        Ok(reservation)
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        let mut invocation = Invocation::on_record(&self.scripts.renew, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        invocation.arg(millis(lease.ttl));
        let reply = items(self.run(invocation, false).await?.0)?;
        if decode::tag(reply.first())? == "renewed" {
            return Ok(Renewal::Renewed);
        }
        Ok(Renewal::Fenced(decode_current(reply)?))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        let mut invocation =
            Invocation::on_record(&self.scripts.complete, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        invocation.uuid(&lease.attempt.0);
        // '<status>:<stored>': one argument, as a packed record keeps them.
        match outcome {
            Outcome::Stored(response) => {
                invocation
                    .write_arg(|out| write!(out, "{}:1", response.status))
                    .write_arg(|out| write_headers(out, &response.headers, self.compact_headers))
                    .arg(response.body.as_ref());
            }
            Outcome::NotStored { status } => {
                invocation
                    .write_arg(|out| write!(out, "{status}:0"))
                    .arg("")
                    .arg("");
            }
        }
        // The attempt's end by this process' clock (see complete.lua).
        invocation.arg(unix_ms());
        let (reply, acked) = self.run(invocation, self.wait_replicas.is_some()).await?;
        // Recorded now, or by this very call if its reply was lost and it
        // was retried (fence.lua).
        let recorded = hot_path(&reply) || led_by(&reply, "recorded");
        if recorded {
            if let Some((acked, wanted)) = self.short_of_replicas(acked) {
                tracing::warn!(
                    acked,
                    wanted,
                    "the completion reached fewer replicas than requested"
                );
            }
            return Ok(Completion::Recorded);
        }
        Ok(Completion::Fenced(decode_current(items(reply)?)?))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        let mut invocation =
            Invocation::on_record(&self.scripts.release, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        invocation.uuid(&lease.attempt.0).arg(unix_ms());
        let reply = self.run(invocation, false).await?.0;
        if hot_path(&reply) || led_by(&reply, "released") {
            return Ok(Release::Released);
        }
        Ok(Release::Fenced(decode_current(items(reply)?)?))
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        let mut invocation = Invocation::on_record(&self.scripts.cancel, &self.prefix, scope);
        // The id lets a retried call recognise its own earlier cancel.
        invocation.uuid(&uuid::Uuid::new_v4());
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

    /// Waits for the record's notification (see the crate docs on
    /// waiting); polls on a cluster.
    async fn changed(&self, scope: &ScopeHash, timeout: Duration) {
        let key = self.record_key(scope);
        let channel = format!("{key}:c");
        // Read once subscribed: marks the record as waited on (so that the
        // scripts ending its attempt publish) and answers its state.
        let state = async {
            let invocation = Invocation::new(&self.scripts.watch, &[&key]);
            match self.run(invocation, false).await {
                Ok((Value::BulkString(state), _)) => String::from_utf8(state).ok(),
                _ => None,
            }
        };
        self.watch.changed(&channel, timeout, state).await;
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        self.read(scope, false, None).await
    }
}

impl RecordsAdmin for RedisStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let clock: Vec<u64> = self.command(redis::cmd("TIME")).await?;
        let now_ms = match clock.as_slice() {
            [secs, micros] => secs * 1000 + micros / 1000,
            _ => return Err(corrupt("TIME answered oddly")),
        };
        use futures_util::TryStreamExt;
        // A query that only processing records can match reads the others'
        // state alone (most records are completed).
        let only_processing = query.lapsed || query.state == Some(RecordState::Processing);
        // A tenant's listing reads other tenants' records no further than
        // their tenant: as the 'tenant' field holds it (every record before
        // the binary form, and every tenant without one), and as
        // 'tenant_bin' does.
        let binary = query
            .tenant
            .as_deref()
            .map(|tenant| match encode_tenant(tenant) {
                ("tenant_bin", binary) => binary,
                _ => Vec::new(),
            });
        let tenant = query.tenant.as_deref().zip(binary.as_deref());
        // The reads share the connection, LIST_READS_AT_ONCE in flight:
        // Redis takes them in batches instead of one round trip each.
        // Only the oldest matches so far are kept: a listing holds no more
        // than its answer and a page of keys, however many records it
        // reads.
        let found = self
            .record_scopes()
            .map_ok(|page| futures_util::stream::iter(page.into_iter().map(Ok)))
            .try_flatten()
            .map_ok(|scope| async move { self.read(&scope, only_processing, tenant).await })
            .try_buffer_unordered(LIST_READS_AT_ONCE)
            .try_fold(OldestRecords::new(query.limit), |mut found, record| {
                if let Some(record) = record.filter(|record| query.matches(record, now_ms)) {
                    found.offer(record);
                }
                std::future::ready(Ok(found))
            })
            .await?;
        Ok(found.into_oldest_first())
    }

    /// Counted inside Redis on a single node: `SCAN` pages of record keys,
    /// each read by `count_lapsed.lua` where it lives, so a record's fields
    /// never cross the network and the count costs Redis about a third of
    /// reading each record out (see the README's lapsed-records gauge). A
    /// key `SCAN` names twice (a table Redis resized during the count) is
    /// counted twice. On a cluster (whose scripts may touch only the keys
    /// they name) the lapsed records are listed and counted.
    async fn count_lapsed(&self, limit: usize) -> Result<usize, StoreError> {
        if matches!(self.pool, Pool::Cluster(_)) {
            let listed = self.list(&RecordQuery::stuck(limit)).await?;
            return Ok(listed.len());
        }
        let pattern = self.record_pattern();
        let key_length: usize = record_key_pieces(&self.prefix, &[0; 64])
            .iter()
            .map(|piece| piece.len())
            .sum();
        let (mut cursor, mut count) = (0u64, 0usize);
        loop {
            let mut invocation = Invocation::new(&self.scripts.count_lapsed, &[]);
            invocation
                .arg(cursor)
                .arg(&pattern)
                .arg(COUNT_LAPSED_PAGE)
                .arg(key_length);
            let reply = items(self.run(invocation, false).await?.0)?;
            let [next, lapsed] = reply.as_slice() else {
                return Err(corrupt("lapsed count answered oddly"));
            };
            count = count.saturating_add(usize::try_from(int(lapsed)?).unwrap_or(usize::MAX));
            cursor = int(next)?;
            if cursor == 0 || count >= limit {
                return Ok(count.min(limit));
            }
        }
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        let invocation = Invocation::on_record(&self.scripts.force_release, &self.prefix, scope);
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
}

impl Fleet for RedisStore {
    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        RedisStore::claim_identity(self, marker, ttl, replace)
    }

    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        RedisStore::claim_duty(self, duty, holder, ttl)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use idem_core::HeaderName;

    use super::*;

    #[test]
    fn headers_round_trip_binary() {
        let name = HeaderName::from_static;
        let headers = vec![
            (
                idem_core::HeaderName::from_static("location"),
                Bytes::from_static(b"/orders/1"),
            ),
            (name("x-bin"), Bytes::from_static(b"\x00\xff\r\n")),
            (name("empty"), Bytes::new()),
        ];
        assert_eq!(
            decode_headers(&encode_headers(&headers)).expect("decode"),
            headers
        );
        assert!(decode_headers(b"\x00\x00\x00\x09abc").is_err());
    }

    /// The compact form: one byte of length for a name or value shorter
    /// than 255 bytes, 255 and four bytes for a longer one; led by its
    /// marker, which the four-byte form never begins with. A truncated
    /// compact field is refused.
    #[test]
    fn compact_headers_round_trip_and_are_shorter() {
        let long = Bytes::from(vec![b'v'; 300]);
        let headers = vec![
            (
                HeaderName::from_static("content-type"),
                Bytes::from_static(b"application/json"),
            ),
            (
                HeaderName::from_static("location"),
                Bytes::from_static(b"/orders/100001"),
            ),
            (HeaderName::from_static("x-long"), long),
            (HeaderName::from_static("empty"), Bytes::new()),
        ];
        let compact = encode_headers_as(&headers, true);
        assert_eq!(compact[0], decode::COMPACT_HEADERS);
        assert_eq!(compact[1..14], *b"\x0ccontent-type");
        assert_eq!(decode_headers(&compact).expect("decode"), headers);
        // 300 bytes: 255, then the length in four bytes.
        let at = compact
            .windows(7)
            .position(|w| w == b"\x06x-long")
            .expect("x-long")
            + 7;
        assert_eq!(compact[at..at + 5], [255, 0, 0, 1, 44]);
        let four_byte = encode_headers(&headers);
        assert_eq!(four_byte[0], 0);
        assert_eq!(four_byte.len() - compact.len(), 8 * 3 - 1 - 4);
        // The two headers of a typical API response: 55 bytes, not 66.
        assert_eq!(encode_headers_as(&headers[..2], true).len(), 55);
        assert_eq!(encode_headers(&headers[..2]).len(), 66);
        assert!(encode_headers_as(&[], true).is_empty());
        for cut in 1..compact.len() {
            if let Ok(decoded) = decode_headers(&compact[..cut]) {
                // Cut between two headers: a prefix of them.
                assert_eq!(decoded[..], headers[..decoded.len()], "cut at {cut}");
            }
        }
        assert!(decode_headers(b"\x01\x05abc").is_err());
        assert!(decode_headers(b"\x01\xff\x00\x00").is_err());
    }

    /// A stored name that is no header name is left out of the replay;
    /// the fields around it are kept.
    #[test]
    fn a_name_that_does_not_parse_is_skipped() {
        let mut raw = Vec::new();
        for part in [&b"bad name"[..], b"1", b"x-good", b"2"] {
            raw.extend_from_slice(&u32::try_from(part.len()).expect("short").to_be_bytes());
            raw.extend_from_slice(part);
        }
        assert_eq!(
            decode_headers(&raw).expect("decode"),
            vec![(HeaderName::from_static("x-good"), Bytes::from_static(b"2"))]
        );
    }

    /// A completed reply carries the completion time; the age is this
    /// process' clock minus it, never negative when the clocks disagree.
    #[test]
    fn replay_age_is_measured_from_the_completion_time() {
        let completed = |at_ms: u64| {
            vec![
                Value::BulkString(b"completed".to_vec()),
                Value::BulkString(format!("201:1:{at_ms}").into_bytes()),
                Value::BulkString(Vec::new()),
                Value::BulkString(b"{}".to_vec()),
            ]
        };
        let age = |reply| match decode_current(reply).expect("decode") {
            Current::Completed(replay) => replay.age,
            other => panic!("expected a replay, got {other:?}"),
        };
        let now = unix_ms();
        let old = age(completed(now - 5_000));
        assert!(
            old >= Duration::from_secs(5) && old < Duration::from_secs(60),
            "{old:?}"
        );
        assert_eq!(age(completed(now + 60_000)), Duration::ZERO);
        assert!(
            decode_current(vec![
                Value::BulkString(b"completed".to_vec()),
                Value::BulkString(b"201:1:soon".to_vec()),
                Value::BulkString(Vec::new()),
                Value::BulkString(Vec::new()),
            ])
            .is_err()
        );
    }

    #[test]
    fn record_keys_share_one_hash_tag() {
        let store = RedisStore::from_url("redis://127.0.0.1:1").expect("store");
        let key = store.record_key(&ScopeHash::from_bytes([0xab; 32]));
        assert_eq!(key, format!("idem:{{{}}}", "ab".repeat(32)));
    }

    /// A store call's future is moved whole at least once (into the
    /// layer's box), so what sits off the hot path (taking a connection
    /// from the pool, loading a script, `WAIT`, a cluster's query) is
    /// boxed instead of sizing every call: with the pool's future inline a
    /// reservation's future was 8 KB. At most 1,024 bytes: glibc serves
    /// allocations up to 1,032 bytes from its per-thread cache, and larger
    /// ones through its slower general path (a reservation's future was
    /// 1,512 bytes while it kept its attempt id and token twice and a
    /// release's future inline for the rare short-of-replicas path).
    #[test]
    fn store_call_futures_stay_small() {
        let store = RedisStore::from_url("redis://127.0.0.1:1").expect("store");
        let scope = idem_core::Scope::new(
            "tenant",
            "POST /orders",
            idem_core::IdempotencyKey::parse(b"k").expect("key"),
        );
        let request = ReserveRequest {
            scope,
            fingerprint: idem_core::Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
        };
        let lease = Lease {
            scope: *request.scope.hash(),
            attempt: AttemptId::new(),
            generation: 1,
            token: OwnerToken::new(),
            ttl: Duration::from_secs(30),
        };
        let outcome = Outcome::NotStored { status: 201 };
        let sizes = [
            std::mem::size_of_val(&store.reserve(&request)),
            std::mem::size_of_val(&store.complete(&lease, &outcome)),
            std::mem::size_of_val(&store.release(&lease)),
            std::mem::size_of_val(&store.renew(&lease)),
        ];
        assert!(sizes.iter().all(|&size| size <= 1024), "{sizes:?}");
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
                (
                    idem_core::HeaderName::from_static("location"),
                    Bytes::from_static(b"/orders/1"),
                ),
                (
                    idem_core::HeaderName::from_static("content-type"),
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

        /// The same record in the compact layout: no created, updated,
        /// completed or cur_status, a hashed tenant as bytes.
        fn compact_record() -> Vec<(&'static str, Vec<u8>)> {
            let dropped = ["created", "updated", "completed", "cur_status"];
            let mut fields: Vec<_> = valid_record()
                .into_iter()
                .filter(|(name, _)| !dropped.contains(name))
                .collect();
            fields.push(("created", b"1700000000000".to_vec()));
            fields
        }

        #[test]
        fn compact_and_older_records_decode_alike() {
            let scope = ScopeHash::from_bytes([1; 32]);
            let older = decode_record(scope, &pairs(&valid_record())).expect("older layout");
            let compact = decode_record(scope, &pairs(&compact_record())).expect("compact layout");
            assert_eq!(older, compact);
            assert_eq!(compact.completed_at_ms, Some(1_700_000_003_000));
            assert_eq!(compact.updated_at_ms, 1_700_000_003_000);
            assert_eq!(compact.created_at_ms, 1_700_000_000_000);
            // A first attempt's record: creation is its start.
            let mut first: Vec<_> = compact_record()
                .into_iter()
                .filter(|(name, _)| *name != "created" && *name != "hist")
                .collect();
            first.retain(|(name, _)| *name != "gen");
            first.push(("gen", b"1".to_vec()));
            let first = decode_record(scope, &pairs(&first)).expect("first attempt");
            assert_eq!(first.created_at_ms, 1_700_000_001_000);
        }

        #[test]
        fn hashed_tenants_are_kept_as_bytes() {
            let hashed = format!("auth:{}", "0f".repeat(32));
            let (field, value) = encode_tenant(&hashed);
            assert_eq!((field, value.len()), ("tenant_bin", 37));
            let mut fields: Vec<_> = compact_record()
                .into_iter()
                .filter(|(name, _)| *name != "tenant")
                .collect();
            fields.push((field, value));
            let record =
                decode_record(ScopeHash::from_bytes([1; 32]), &pairs(&fields)).expect("decodes");
            assert_eq!(&*record.tenant, hashed.as_str());
            // Anything else is kept as it is: upper-case hex, short hashes,
            // a bare hash.
            // Each byte next to a digit range ('/', ':', '`', 'g', 'F'),
            // and a byte past ASCII, spoils a hash wherever it is.
            let spoiled = ["/", ":", "`", "g", "F", "\u{e9}"]
                .into_iter()
                .flat_map(|bad| {
                    [0, 31, 63].map(|at| {
                        let mut hex: Vec<String> =
                            "0f".repeat(32).chars().map(String::from).collect();
                        hex[at] = bad.to_owned();
                        format!("auth:{}", hex.concat())
                    })
                });
            for other in [
                format!("auth:{}", "0F".repeat(32)),
                format!("auth:{}", "0f".repeat(31)),
                "0f".repeat(32),
                "t1".to_owned(),
            ]
            .into_iter()
            .chain(spoiled)
            {
                let (field, value) = encode_tenant(&other);
                if field == "tenant_bin" {
                    assert_eq!(other, "0f".repeat(32));
                    assert_eq!(value.len(), 32);
                } else {
                    assert_eq!(value, other.as_bytes());
                }
            }
        }

        /// A shared tenant encodes as its text does, whether its hash is
        /// decoded or reused: switching between tenants, hashed or not,
        /// and between copies of one text.
        #[test]
        fn shared_tenants_encode_as_their_text_does() {
            let texts = [
                format!("auth:{}", "0f".repeat(32)),
                format!("auth:{}", "a1".repeat(32)),
                format!("jwt:{}", "0f".repeat(32)),
                "t1".to_owned(),
                "0f".repeat(32),
                format!("auth:{}", "0F".repeat(32)),
            ];
            let shared: Vec<std::sync::Arc<str>> = texts
                .iter()
                .map(|t| std::sync::Arc::from(t.as_str()))
                .collect();
            let copies: Vec<std::sync::Arc<str>> = texts
                .iter()
                .map(|t| std::sync::Arc::from(t.as_str()))
                .collect();
            let order = [0, 0, 1, 0, 2, 2, 3, 0, 4, 5, 5, 1, 3, 3, 4, 0];
            for (step, &i) in order.iter().enumerate() {
                for tenant in [&shared[i], &copies[i], &shared[i]] {
                    let form = TenantForm::of_shared(tenant);
                    let expected = TenantForm::of(&texts[i]);
                    assert_eq!(form.field(), expected.field(), "step {step}");
                    assert_eq!(form.pieces(), expected.pieces(), "step {step}");
                }
            }
        }

        /// A completion writes its end by its caller's clock and the start
        /// is Redis': an end before the start (the caller's clock behind
        /// Redis') is read as the start, never as a negative duration.
        #[test]
        fn an_end_before_the_start_is_read_as_the_start() {
            let mut fields: Vec<(&str, Vec<u8>)> = valid_record()
                .into_iter()
                .filter(|(name, _)| !matches!(*name, "completed" | "updated" | "created"))
                .collect();
            for (name, value) in &mut fields {
                if *name == "cur_end" {
                    *value = b"1700000000400".to_vec();
                }
            }
            let record =
                decode_record(ScopeHash::from_bytes([1; 32]), &pairs(&fields)).expect("record");
            let current = record.attempts.last().expect("the current attempt");
            assert_eq!(current.started_at_ms, 1_700_000_001_000);
            assert_eq!(current.ended_at_ms, Some(1_700_000_001_000));
            assert_eq!(record.completed_at_ms, Some(1_700_000_001_000));
            assert_eq!(record.updated_at_ms, 1_700_000_001_000);
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
                let headers: Vec<(HeaderName, Bytes)> = headers
                    .into_iter()
                    .map(|(n, v)| (HeaderName::from_bytes(n.as_bytes()).expect("a token"), Bytes::from(v)))
                    .collect();
                prop_assert_eq!(&decode_headers(&encode_headers(&headers)).expect("decode"), &headers);
                prop_assert_eq!(&decode_headers(&encode_headers_as(&headers, true)).expect("decode"), &headers);
            }

            /// A replay's answer, cut anywhere or with any prefix, is
            /// decoded or refused as corrupt, never a panic.
            #[test]
            fn replay_decode_never_panics(raw in prop::collection::vec(any::<u8>(), 0..80), cut in any::<usize>()) {
                let mut answer = b"201:1:1700000000000:9:".to_vec();
                answer.extend_from_slice(&raw);
                let _ = decode_replay(raw);
                answer.truncate(cut % (answer.len() + 1));
                let _ = decode_replay(answer);
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
                        "tenant_bin", "created", "updated", "split",
                    ]), value()),
                    0..30,
                )
            ) {
                let pairs: Vec<Value> = fields
                    .into_iter()
                    .flat_map(|(name, value)| [Value::BulkString(name.as_bytes().to_vec()), value])
                    .collect();
                let _ = decode_record(ScopeHash::from_bytes([1; 32]), &pairs);
                let _ = decode_current(pairs);
            }
        }
    }

    /// A replay's one-string answer gives the exact headers and body, a
    /// response key cut short gives what it holds, and a malformed answer
    /// is corrupt.
    #[test]
    fn replays_decode_from_one_string() {
        let headers = encode_headers(&[(
            HeaderName::from_static("location"),
            Bytes::from_static(b"/o/1"),
        )]);
        let answer = |len: usize, rest: &[u8]| {
            let mut raw = format!("201:1:1700000000000:{len}:").into_bytes();
            raw.extend_from_slice(rest);
            raw
        };
        let whole = [&headers[..], b"{\"id\":1}"].concat();
        let replay = decode_replay(answer(headers.len(), &whole)).expect("replay");
        let Outcome::Stored(response) = replay.outcome else {
            panic!("a stored response")
        };
        assert_eq!(response.status, 201);
        assert_eq!(
            response.headers,
            [(
                HeaderName::from_static("location"),
                Bytes::from_static(b"/o/1")
            )]
        );
        assert_eq!(&response.body[..], b"{\"id\":1}");
        // Not stored: the status alone.
        let replay = decode_replay(b"409:0:1700000000000:0:".to_vec()).expect("replay");
        assert!(matches!(replay.outcome, Outcome::NotStored { status: 409 }));
        // Headers longer than what is there: all of it is headers.
        let cut = decode_replay(answer(headers.len() + 50, &headers)).expect("replay");
        let Outcome::Stored(response) = cut.outcome else {
            panic!("a stored response")
        };
        assert!(response.body.is_empty());
        for bad in [
            &b""[..],
            b"201",
            b"201:1:",
            b"201:1:17:",
            b"x:1:17:0:",
            b"201:1:17:z:",
        ] {
            assert!(decode_replay(bad.to_vec()).is_err(), "{bad:?}");
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
