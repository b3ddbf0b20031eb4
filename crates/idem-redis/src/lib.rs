//! The production store for idem: Redis or Redis Cluster, every state
//! transition one atomic command or Lua script.
//!
//! * **Atomic.** A new key is one native `SET … NX PX … GET` (record
//!   format 3, the default: it also answers a replay and a conflict);
//!   `renew`, `complete`, `release`, `cancel` and `get`, and a reservation
//!   that meets a running attempt, are each one Lua script
//!   (`src/lua/*.lua`) run with `EVALSHA` (reloaded after `NOSCRIPT`, for
//!   example after a restart or `SCRIPT FLUSH`). Every write after the
//!   reservation is a compare-and-set on the lease generation and owner
//!   token inside a script.
//! * **One key per scope.** A new key's record is one string (format 3,
//!   `string_record.rs` in the sources): about 500 bytes of Redis memory
//!   for a typical API response, against 568 in format 2's hash. Any path
//!   that changes it otherwise than by completing it (a renewal, a
//!   release, a takeover, a cancel) turns it into format 2's hash first.
//!   Format 2 keeps the record in one Redis hash under
//!   `{prefix}{<scope hash>}`: the SHA-256 scope hash inside a hash tag, so
//!   every key a script touches is in one cluster slot. Every value of a
//!   typical record fits Redis' compact hash encoding (64 bytes at the
//!   default `hash-max-listpack-value`): a hashed tenant (`auth:` and 64
//!   hex digits) is kept as its prefix and 32 bytes, times that other
//!   fields imply are not repeated, and a response whose headers or body
//!   exceed 64 bytes is kept, binary-safe, in a string key of its own
//!   beside the hash (`{prefix}{<scope hash>}:r`, same slot, same expiry).
//!   A gateway-shaped record with a 100-byte response takes about 850
//!   bytes of Redis memory. A key
//!   or a tenant longer than 64 bytes still works; its record is kept in
//!   Redis' larger hash encoding.
//! * **A versioned record format** ([`format`](mod@format)): every field named once
//!   in Rust and substituted into the Lua sources; each record carries its
//!   format. Format 2 writes a new key and its completion in
//!   12 fields instead of 21 and a response's headers with one byte of
//!   length per name and value (a typical API response then stays inside
//!   the record): about 15 % fewer Redis instructions and 15 to 30 % fewer
//!   bytes than format 1. Format 3 (the default) keeps a new key's record as
//!   one string, reserved and replayed by one native `SET … NX PX … GET`
//!   and completed by a compare-and-set script; every other path turns it
//!   into the format 2 hash it stands for. Every store reads every format
//!   it knows and refuses a newer one; [`RedisStoreBuilder::record_format`]
//!   writes an older format during a rolling upgrade.
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
//!   inside the scripts (or, for a format 3 string record, by the key's
//!   remaining time, `PTTL`), never the web server's clock; records expire with
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
//!   conflict or an in-progress answer costs one (two for an in-progress
//!   answer on a format 3 string record: `SET … GET`, then `PTTL`).
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

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

/// The crate's guide, shown in the rustdoc; its examples are compiled as
/// doctests.
pub mod guide {
    #![doc = include_str!("docs/guide.md")]
}

use std::time::Duration;

use idem_core::{Record, ScopeHash, StoreError};

mod abandon;
mod admin;
mod builder;
mod cluster;
mod connection;
mod decode;
mod erasures;
mod errors;
mod fleet;
pub mod format;
mod invocation;
mod keys;
#[cfg(feature = "limits")]
mod limits;
mod pool;
mod safety;
mod scripts;
mod store;
mod string_record;
mod watch;

pub use builder::{BuildError, RedisStoreBuilder};
#[allow(deprecated)]
pub use cluster::LIST_SCAN_LIMIT;
pub use cluster::{Health, failover_bound};
use connection::Lane;
use decode::*;
pub use format::RecordFormat;
pub use idem_core::IdentityClaim;
use invocation::Invocation;
use keys::record_key_pieces;
use pool::Pool;
pub use safety::ServerSafety;
use scripts::Scripts;

/// A [`Store`](idem_core::Store) on Redis or Redis Cluster. See the [crate docs](crate).
pub struct RedisStore {
    pool: Pool,
    lanes: Box<[parking_lot::Mutex<Lane>]>,
    /// When a cluster lane was last replaced (replacements are rate
    /// limited).
    last_replacement: parking_lot::Mutex<Option<std::time::Instant>>,
    next_lane: std::sync::atomic::AtomicUsize,
    scripts: Scripts,
    #[cfg(feature = "limits")]
    limit_scripts: limits::LimitScripts,
    prefix: String,
    /// The format records are written in ([`RedisStoreBuilder::record_format`]).
    format: RecordFormat,
    timeout: Duration,
    wait_replicas: Option<(usize, Duration)>,
    /// Waiting duplicates woken by the scripts' notifications.
    watch: std::sync::Arc<watch::Watch>,
    /// Erasures heard from every process (`erasures.rs`).
    erasures: erasures::Erasures,
    /// Tasks freeing reservations whose calls were given up.
    given_up: tokio_util::task::TaskTracker,
    /// Whether each new connection's server is checked for its eviction
    /// policy, and whether eviction is allowed (`None`: not checked, a
    /// store from `build`; `connect` sets it).
    eviction_checked: Option<bool>,
}

/// The Lua source of one of the store's scripts (`"reserve"`,
/// `"complete"`, `"release"`, ...) as a single-node store loads it
/// (writing `format`, see [`RedisStoreBuilder::record_format`]), for
/// benchmarks that call the scripts directly; `None` for an unknown name.
#[doc(hidden)]
pub fn script_source(name: &str, format: RecordFormat) -> Option<String> {
    let body = scripts::body(name);
    let constants = scripts::Constants {
        notify: true,
        format,
    };
    (!body.is_empty()).then(|| scripts::source(body, constants, format::TENANT))
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
            format: RecordFormat::default(),
            allow_eviction: false,
            check_lazily: false,
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

    /// The record format this store writes (see
    /// [`RedisStoreBuilder::record_format`]).
    pub fn record_format(&self) -> RecordFormat {
        self.format
    }

    /// Checks that the server answers (`PING`), within the timeout.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.command(redis::cmd("PING")).await
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use idem_core::{
        AttemptId, Current, HeaderName, Lease, Outcome, OwnerToken, ReserveRequest, Store,
    };
    use redis::Value;

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
                ("expires", b"1700086400000".to_vec()),
                ("status", b"201".to_vec()),
                ("stored", b"1".to_vec()),
                ("headers", headers),
                ("body", b"{\"id\":1}".to_vec()),
                ("cur_id", b"0190a0f2-5b1c-7c3e-9f00-000000000002".to_vec()),
                ("cur_start", b"1700000001000".to_vec()),
                ("cur_end", b"1700000003000".to_vec()),
                ("cur_outcome", b"completed".to_vec()),
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

        /// Times are derived, not kept (decode.rs, `times`); a record's
        /// format is checked: format 2 reads as format 1 does, a newer
        /// one is refused, never misread.
        #[test]
        fn records_decode_with_derived_times_and_known_formats_only() {
            let scope = ScopeHash::from_bytes([1; 32]);
            let record = decode_record(scope, &pairs(&valid_record())).expect("decodes");
            assert_eq!(record.completed_at_ms, Some(1_700_000_003_000));
            assert_eq!(record.updated_at_ms, 1_700_000_003_000);
            assert_eq!(record.created_at_ms, 1_700_000_000_000);
            // A first attempt's record: creation is its start.
            let mut first: Vec<_> = valid_record()
                .into_iter()
                .filter(|(name, _)| *name != "created" && *name != "hist")
                .collect();
            first.retain(|(name, _)| *name != "gen");
            first.push(("gen", b"1".to_vec()));
            let first = decode_record(scope, &pairs(&first)).expect("first attempt");
            assert_eq!(first.created_at_ms, 1_700_000_001_000);
            let with_version = |version: &str| {
                let mut fields = valid_record();
                fields.push(("v", version.as_bytes().to_vec()));
                decode_record(scope, &pairs(&fields))
            };
            assert_eq!(with_version("2").expect("format 2"), record);
            for newer in ["4", "99999999999"] {
                match with_version(newer) {
                    Err(StoreError::Refused(error)) => {
                        assert!(error.to_string().contains("newer"), "{error}");
                    }
                    other => panic!("format {newer}: {other:?}"),
                }
            }
        }

        #[test]
        fn hashed_tenants_are_kept_as_bytes() {
            let hashed = format!("auth:{}", "0f".repeat(32));
            let (field, value) = encode_tenant(&hashed);
            assert_eq!((field, value.len()), ("tenant_bin", 37));
            let mut fields: Vec<_> = valid_record()
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
                let mut answer = b"201:1:1700000000000:1700086400000::9:".to_vec();
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
        let attempt = uuid::Uuid::now_v7();
        let answer = |len: usize, rest: &[u8]| {
            let expires = unix_ms() + 60_000;
            let mut raw = format!("201:1:1700000000000:{expires}:{attempt}:{len}:").into_bytes();
            raw.extend_from_slice(rest);
            raw
        };
        let whole = [&headers[..], b"{\"id\":1}"].concat();
        let replay = decode_replay(answer(headers.len(), &whole)).expect("replay");
        assert_eq!(replay.attempt, Some(idem_core::AttemptId(attempt)));
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
        let expires_in = replay.expires_in.expect("an expiry");
        assert!(
            expires_in > Duration::from_secs(50) && expires_in <= Duration::from_secs(60),
            "{expires_in:?}"
        );
        // Not stored: the status alone; an expiry of 0 is unknown.
        let replay = decode_replay(b"409:0:1700000000000:0::0:".to_vec()).expect("replay");
        assert!(matches!(replay.outcome, Outcome::NotStored { status: 409 }));
        assert_eq!(replay.expires_in, None);
        // A packed record's n: it expires at its start plus its retention.
        let start = unix_ms();
        let packed = format!("201:1:{start}:p{start}:30000:60000::0:");
        let replay = decode_replay(packed.into_bytes()).expect("replay");
        let expires_in = replay.expires_in.expect("an expiry");
        assert!(
            expires_in > Duration::from_secs(50) && expires_in <= Duration::from_secs(60),
            "{expires_in:?}"
        );
        assert!(decode_replay(b"201:1:17:p17:0:".to_vec()).is_err());
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
            b"201:1:17:0:",
            b"x:1:17:0:0:",
            b"201:1:17:0:z:",
            b"201:1:17:0::",
            b"201:1:17:0:not-an-attempt:0:",
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
