//! `idem-gateway`: a reverse proxy that puts the idem idempotency layer in
//! front of any HTTP upstream.
//!
//! The binary (`src/main.rs`) parses [`Config`] from flags and `IDEM_*`
//! environment variables and calls [`run`]; tests call [`start`] to run a
//! gateway in-process on a real listener.

mod demo;
mod jwt;
mod proxy;

use std::{future::Future, net::SocketAddr, sync::OnceLock, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    http::{HeaderName, Method, StatusCode, Uri},
    middleware::{self, Next},
    response::Response,
    routing::get,
};
use clap::{ArgAction, Parser};
use idem_core::{Fleet, RecordsAdmin, ScopeHash, Store};
use idem_layer::{
    IdempotencyLayer, InFlight, ProblemCode, Tenant, TenantFromAuthorization, TenantFromHeader,
};
use idem_memory::MemoryStore;
use idem_redis::RedisStore;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

pub use proxy::{Forwarded, IDEMPOTENCY_ATTEMPT, PeerAddr, Proxy, tls_config};

/// The gateway's configuration: every flag is also an `IDEM_*` variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "idem-gateway",
    version,
    about = "Idempotency-Key protection in front of any HTTP upstream"
)]
pub struct Config {
    /// Address to serve on.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Upstream base URL (http://host:port or https://host:port); without it, a built-in demo orders API is started.
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = parse_upstream)]
    pub upstream: Option<Uri>,
    /// PEM file of a private CA that an https:// upstream's certificate may chain to, besides the system's roots (or SSL_CERT_FILE).
    #[arg(long, env = "IDEM_UPSTREAM_CA")]
    pub upstream_ca: Option<std::path::PathBuf>,
    /// Record store: memory, redis://host:port[/db], redis+cluster://h1:p1,h2:p2,..., or postgres://user@host:port/db (the records table is created if missing)
    #[arg(long, env = "IDEM_STORE", default_value = "memory", value_parser = parse_store)]
    pub store: String,
    /// Take the tenant from this header (a plain account id set by a trusted proxy); without it, the tenant is a keyed hash of the normalized Authorization value, or of a verified JWT's claim.
    #[arg(long, env = "IDEM_TENANT_HEADER", value_parser = parse_header_name, conflicts_with = "tenant_jwt_keys")]
    pub tenant_header: Option<HeaderName>,
    /// Secret key of the tenant hash (HMAC-SHA256, at least 16 bytes), the same on every gateway sharing a store; without it or --tenant-secret-file, one is generated at start.
    #[arg(long, env = "IDEM_TENANT_SECRET", hide_env_values = true, value_parser = parse_secret, conflicts_with = "tenant_secret_file")]
    pub tenant_secret: Option<Secret>,
    /// File holding the tenant hash's secret key (trailing whitespace ignored, at least 16 bytes).
    #[arg(long, env = "IDEM_TENANT_SECRET_FILE")]
    pub tenant_secret_file: Option<std::path::PathBuf>,
    /// Take the tenant from a claim of a verified bearer JWT; the file holds the keys: a JWKS document, a PEM public key (RSA, EC, Ed25519) or an HMAC secret. A keyed request whose token fails verification gets 401.
    #[arg(long, env = "IDEM_TENANT_JWT_KEYS")]
    pub tenant_jwt_keys: Option<std::path::PathBuf>,
    /// The JWT claim that names the tenant.
    #[arg(long, env = "IDEM_TENANT_JWT_CLAIM", default_value = "sub")]
    pub tenant_jwt_claim: String,
    /// Clock skew allowed when checking a JWT's exp and nbf (humantime).
    #[arg(long, env = "IDEM_TENANT_JWT_LEEWAY", default_value = "30s", value_parser = parse_duration)]
    pub tenant_jwt_leeway: Duration,
    /// Keyed requests without a tenant share one anonymous tenant instead of getting 401.
    #[arg(long, env = "IDEM_ALLOW_ANONYMOUS", action = ArgAction::SetTrue)]
    pub allow_anonymous: bool,
    /// Requests of the keyed methods without an Idempotency-Key get 400.
    #[arg(long, env = "IDEM_REQUIRE_KEY", action = ArgAction::SetTrue)]
    pub require_key: bool,
    /// Comma-separated methods the layer applies to; others pass straight through.
    #[arg(long, env = "IDEM_METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = parse_method)]
    pub methods: Vec<Method>,
    /// How long records are kept (humantime: 2s, 5m, 24h); must exceed the lease.
    #[arg(long, env = "IDEM_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub retention: Duration,
    /// Lease length of a running request, renewed while it runs (humantime).
    #[arg(long, env = "IDEM_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Duplicates in flight: reject (409 at once) or wait:DURATION (wait for the outcome).
    #[arg(long, env = "IDEM_IN_FLIGHT", default_value = "reject", value_parser = parse_in_flight)]
    pub in_flight: InFlight,
    /// Largest keyed request body and largest stored response, in bytes.
    #[arg(long, env = "IDEM_MAX_BODY", default_value_t = 1_048_576)]
    pub max_body: usize,
    /// Forward requests unprotected when the store is down, instead of 503.
    #[arg(long, env = "IDEM_FAIL_OPEN", action = ArgAction::SetTrue)]
    pub fail_open: bool,
    /// Admin credential of the records API (at least 16 bytes): a request carrying it in x-idem-admin-token may list every tenant's records and act on another tenant's (tenant=).
    #[arg(long, env = "IDEM_RECORDS_ADMIN_TOKEN", hide_env_values = true, value_parser = parse_secret)]
    pub records_admin_token: Option<Secret>,
    /// Path under which the records API is served ({prefix}/records).
    #[arg(long, env = "IDEM_RECORDS_PREFIX", default_value = "/_idempotency", value_parser = parse_prefix)]
    pub records_prefix: String,
    /// How long to wait for the upstream's response head before answering 504, and the longest a keyed request's answer body may pause (humantime).
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// How long a client may take to send a request head (humantime).
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// How long a keyed request's body may take to arrive, then 408 (humantime).
    #[arg(long, env = "IDEM_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub body_timeout: Duration,
    /// Most live records the memory store holds; new keys beyond get 503 (released records do not count).
    #[arg(long, env = "IDEM_MEMORY_CAPACITY", default_value_t = 1_000_000)]
    pub memory_capacity: usize,
    /// Most live records one tenant may hold in the memory store, then 429 for its new keys (0: no quota; default: a tenth of the memory capacity).
    #[arg(long, env = "IDEM_MEMORY_TENANT_QUOTA")]
    pub memory_tenant_quota: Option<usize>,
    /// Most bytes the memory store's records may take, as it estimates them (bytes, or with KiB, MiB, GiB).
    #[arg(long, env = "IDEM_MEMORY_MAX_BYTES", default_value = "1GiB", value_parser = parse_size)]
    pub memory_max_bytes: usize,
    /// Timeout of every store call (humantime).
    #[arg(long, env = "IDEM_STORE_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// After an upstream timeout, how long to keep waiting for the upstream's late answer and record it (humantime).
    #[arg(long, env = "IDEM_UNKNOWN_OUTCOME_WAIT", default_value = "60s", value_parser = parse_duration)]
    pub unknown_outcome_wait: Duration,
    /// At shutdown, how long to wait for detached requests and pending completions after the connections closed (humantime).
    #[arg(long, env = "IDEM_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Accept a Redis whose maxmemory-policy can evict idem's records (they would be lost silently and retries would run again).
    #[arg(long, env = "IDEM_ALLOW_REDIS_EVICTION", action = ArgAction::SetTrue)]
    pub allow_redis_eviction: bool,
    /// After each reservation and completion on a single-node Redis, wait until this many replicas have it (0: do not wait). A reservation short of them is released and answered 503; a completion short of them is kept, logged and counted.
    #[arg(long, env = "IDEM_WAIT_FOR_REPLICAS", default_value_t = 0)]
    pub wait_for_replicas: usize,
    /// How long to wait for the replicas (humantime); a call that waits is bounded by the store timeout plus this.
    #[arg(long, env = "IDEM_REPLICA_TIMEOUT", default_value = "100ms", value_parser = parse_duration)]
    pub replica_timeout: Duration,
    /// Write new keys' records on Redis packed: fewer fields, about 15 % fewer Redis instructions per new key and its completion. Turn on once every gateway sharing the Redis runs this version (earlier versions cannot read packed records); turning it off is safe at any time.
    #[arg(long, env = "IDEM_REDIS_PACK_RECORDS", action = ArgAction::SetTrue)]
    pub redis_pack_records: bool,
    /// Write stored responses' headers on Redis in the compact form (one byte of length per name and value instead of four): a typical API response then stays in its record instead of a key of its own, one SET fewer per completion and one key fewer per record. Turn on once every gateway sharing the Redis runs this version (earlier versions cannot replay such records); turning it off is safe at any time.
    #[arg(long, env = "IDEM_REDIS_COMPACT_HEADERS", action = ArgAction::SetTrue)]
    pub redis_compact_headers: bool,
    /// Write request fingerprints with BLAKE3 instead of SHA-256: about an eighth of the hashing instructions on CPUs without SHA extensions. Every gateway of this version reads both formats, whatever it writes; earlier versions read only SHA-256 and answer 422 to a retry whose record is in BLAKE3, so turn it on once every gateway sharing the store runs this version. Always on with the memory store.
    #[arg(long, env = "IDEM_BLAKE3_FINGERPRINTS", action = ArgAction::SetTrue)]
    pub blake3_fingerprints: bool,
    /// Hash scopes (the records' identities in the store) with BLAKE3 instead of SHA-256: about a tenth of the hashing instructions on CPUs without SHA extensions. Always on with the memory store. On Redis or PostgreSQL it changes every record's identity, as --keyed-scopes does: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once (a gateway that hashes otherwise refuses to start on the store).
    #[arg(long, env = "IDEM_BLAKE3_SCOPES", action = ArgAction::SetTrue)]
    pub blake3_scopes: bool,
    /// Hash tenants (from Authorization or a JWT claim) with keyed BLAKE3 instead of HMAC-SHA256: one BLAKE3 compression instead of two SHA-256 ones for a short credential. Always on with the memory store. On Redis or PostgreSQL it changes every record's tenant, and so its identity, as --blake3-scopes does: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once (a gateway that hashes otherwise refuses to start on the store).
    #[arg(long, env = "IDEM_BLAKE3_TENANTS", action = ArgAction::SetTrue)]
    pub blake3_tenants: bool,
    /// Key scope hashes (the records' identities in the store) with a key derived from the tenant secret (HMAC-SHA256), so that nobody without it can compute where a record lives. Always on with the memory store. On Redis or PostgreSQL it changes every record's identity: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once. Needs --tenant-secret or --tenant-secret-file.
    #[arg(long, env = "IDEM_KEYED_SCOPES", action = ArgAction::SetTrue)]
    pub keyed_scopes: bool,
    /// Start even though the store (Redis or PostgreSQL) holds records of gateways that derive tenants or scopes differently (another tenant secret, tenant source, --blake3-tenants, --keyed-scopes or --blake3-scopes), and make this gateway's settings the store's. Retries of requests those gateways handled do not find their records here and run again; gateways with the old settings no longer start. Use it once, for the switch: left on, it takes the store over at every start.
    #[arg(long, env = "IDEM_REPLACE_STORE_IDENTITY", action = ArgAction::SetTrue)]
    pub replace_store_identity: bool,
    /// Headers that tell the upstream who the client is: x-forwarded (X-Forwarded-For, -Proto, -Host), forwarded (RFC 7239 Forwarded), or none.
    #[arg(long, env = "IDEM_FORWARDED", default_value = "x-forwarded", value_parser = parse_forwarded)]
    pub forwarded: proxy::Forwarded,
}

/// A secret flag value; `Debug` never shows it.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// The secret's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The shortest secret accepted, in bytes.
const MIN_SECRET_BYTES: usize = 16;

fn parse_secret(value: &str) -> Result<Secret, String> {
    if value.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "the secret must be at least {MIN_SECRET_BYTES} bytes"
        ));
    }
    Ok(Secret(value.to_owned()))
}

/// A size in bytes: a number, optionally followed by KiB, MiB or GiB.
fn parse_size(value: &str) -> Result<usize, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown unit {other:?}: use KiB, MiB or GiB")),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("{value:?} is not a size"))
}

/// A humantime duration, at most [`idem_layer::MAX_DURATION`] (100 years).
fn parse_duration(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value).map_err(|e| e.to_string())?;
    if duration > idem_layer::MAX_DURATION {
        return Err("at most 100 years".to_owned());
    }
    Ok(duration)
}

fn parse_upstream(value: &str) -> Result<Uri, String> {
    let uri: Uri = value.parse().map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err("expected http://host:port or https://host:port".to_owned());
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err("the upstream URL takes no path or query".to_owned());
    }
    Ok(uri)
}

fn parse_store(value: &str) -> Result<String, String> {
    if value == "memory" {
        return Ok(value.to_owned());
    }
    if is_postgres(value) {
        return idem_postgres::PgStore::builder()
            .url(value)
            .sweep_every(None)
            .build()
            .map(|_| value.to_owned())
            .map_err(|e| e.to_string());
    }
    RedisStore::from_url(value)
        .map(|_| value.to_owned())
        .map_err(|e| e.to_string())
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn parse_forwarded(value: &str) -> Result<proxy::Forwarded, String> {
    match value {
        "x-forwarded" => Ok(proxy::Forwarded::XForwarded),
        "forwarded" => Ok(proxy::Forwarded::Rfc7239),
        "none" => Ok(proxy::Forwarded::None),
        _ => Err("expected x-forwarded, forwarded or none".to_owned()),
    }
}

fn parse_header_name(value: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(value.as_bytes()).map_err(|_| format!("{value:?} is not a header name"))
}

fn parse_method(value: &str) -> Result<Method, String> {
    Method::from_bytes(value.trim().to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("{value:?} is not a method"))
}

fn parse_in_flight(value: &str) -> Result<InFlight, String> {
    match value {
        "reject" => Ok(InFlight::Reject),
        _ => match value.strip_prefix("wait:") {
            Some(bound) => parse_duration(bound).map(InFlight::Wait),
            None => Err("expected reject or wait:DURATION".to_owned()),
        },
    }
}

fn parse_prefix(value: &str) -> Result<String, String> {
    if !value.starts_with('/') {
        return Err("the prefix must start with /".to_owned());
    }
    Ok(value.trim_end_matches('/').to_owned())
}

/// The gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The layer's configuration is invalid (for example retention not
    /// longer than the lease).
    #[error("{0}")]
    Config(#[from] idem_layer::ConfigError),
    /// The store URL could not be used.
    #[error("{0}")]
    Store(#[from] idem_redis::BuildError),
    /// A setting cannot be used: a file it names (the tenant secret, the
    /// JWT keys, the upstream's CA) could not be read or used, or it does
    /// not fit the store (`--wait-for-replicas` without Redis).
    #[error("{0}")]
    Setting(String),
    /// The PostgreSQL store could not be built or its table created.
    #[error("{0}")]
    Postgres(String),
    /// Binding or serving failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The store could lose records silently (a Redis eviction policy that
    /// can evict them), and that was not explicitly allowed.
    #[error("{0}")]
    UnsafeStore(String),
}

/// How often the gauge of lapsed records is refreshed, at most.
const LAPSED_EVERY: Duration = Duration::from_secs(5);

/// The gauge's sweep runs at most one part in this many of the time: a
/// sweep that took longer than `LAPSED_EVERY / LAPSED_IDLE_PARTS` (a Redis
/// store looks at every record key) waits this many times its own
/// length before the next.
const LAPSED_IDLE_PARTS: u32 = 50;

/// How long a count of the lapsed records may take (a Redis store reads
/// every record it holds to count them); a count that fails or takes
/// longer is logged and the gauge keeps its last value.
const LAPSED_COUNT_BOUND: Duration = Duration::from_secs(30);

/// The gauge of lapsed records counts no further than this.
const LAPSED_COUNTED: usize = 10_000;

/// The wait before the next sweep of lapsed records, after one that took
/// `took`.
fn lapsed_wait(took: Duration) -> Duration {
    LAPSED_EVERY.max(took.saturating_mul(LAPSED_IDLE_PARTS))
}

/// Latency buckets, in seconds: store calls take tens of microseconds,
/// requests up to the upstream timeout.
const LATENCY_BUCKETS: [f64; 18] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Replay-age buckets, in seconds: from a second to a day's retention.
const AGE_BUCKETS: [f64; 9] = [
    1.0, 10.0, 60.0, 600.0, 3_600.0, 21_600.0, 43_200.0, 86_400.0, 604_800.0,
];

/// The exporter with Prometheus histograms (buckets), not summaries:
/// histograms from several gateways can be summed, quantiles of summaries
/// cannot.
fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    // The bucket lists are constant and non-empty, so neither call fails;
    // if one did, the exporter would still work, with summaries.
    PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(idem_layer::metrics::REPLAY_AGE.to_owned()),
                &AGE_BUCKETS,
            )
        })
        .unwrap_or_else(|_| PrometheusBuilder::new())
}

/// The Prometheus recorder, installed once per process.
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (tests); then the
        // handle renders what this one sees: nothing.
        let _ = metrics::set_global_recorder(recorder);
        // The recorder stays for the process: the layer's metrics are
        // registered with it once, not looked up per request.
        idem_layer::metrics::register_handles();
        // Histogram samples are drained into their buckets on a scrape or
        // by upkeep; without upkeep, a gateway nobody scrapes would keep
        // every sample (about 27 bytes a keyed request).
        let upkeep = handle.clone();
        let _ = std::thread::Builder::new()
            .name("metrics-upkeep".to_owned())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(5));
                    upkeep.run_upkeep();
                }
            });
        handle
    })
}

/// What a running gateway reports about itself.
#[derive(Debug, Clone)]
pub struct Started {
    /// Where it serves.
    pub addr: SocketAddr,
    /// Where it forwards.
    pub upstream: Uri,
    /// Whether the upstream is the built-in demo.
    pub demo: bool,
}

/// Builds the gateway and serves on `listener` until `shutdown` resolves,
/// then lets in-flight requests finish. `on_start` is called once the
/// gateway is ready.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_start: impl FnOnce(&Started),
) -> Result<(), StartError> {
    let (upstream, demo) = match &config.upstream {
        Some(uri) => (uri.clone(), None),
        None => {
            let demo = demo::start().await?;
            (demo.uri.clone(), Some(demo))
        }
    };
    let tenants = Tenants::resolve(&config)?;
    // Settings of the Redis store alone.
    let on_redis = config.store != "memory" && !is_postgres(&config.store);
    for (set, flag) in [
        (config.wait_for_replicas > 0, "--wait-for-replicas"),
        (config.redis_pack_records, "--redis-pack-records"),
        (config.redis_compact_headers, "--redis-compact-headers"),
    ] {
        if set && !on_redis {
            return Err(StartError::Setting(format!("{flag} needs a Redis store")));
        }
    }
    if config.keyed_scopes && config.store != "memory" && tenants.generated {
        return Err(StartError::Setting(
            "--keyed-scopes needs --tenant-secret or --tenant-secret-file: a secret generated \
             at start changes at every start, and every record would be lost with it"
                .to_owned(),
        ));
    }
    let (router, drain) = store_router(&config, &tenants, upstream.clone()).await?;
    let started = Started {
        addr: listener.local_addr()?,
        upstream,
        demo: demo.is_some(),
    };
    on_start(&started);
    serve(listener, router, config.header_timeout, shutdown).await;
    // Connections are closed; what outlives its request (handlers whose
    // client left, completions being retried, late upstream answers) gets
    // up to the drain timeout to record its outcome.
    let left = drain(config.drain_timeout).await;
    if left == 0 {
        tracing::info!("shutdown: every outcome recorded");
    } else {
        tracing::warn!(
            "shutdown: {left} background task(s) still running after the drain timeout \
             (requests whose upstream has not answered, outcomes not yet recorded); \
             their records stay processing until their leases lapse"
        );
    }
    drop(demo);
    Ok(())
}

/// The memory store the flags describe, with its gauges kept up to date.
fn memory_store(config: &Config) -> MemoryStore {
    let quota = match config.memory_tenant_quota {
        Some(0) => None,
        Some(quota) => Some(quota),
        None => Some((config.memory_capacity / 10).max(1)),
    };
    let store = MemoryStore::builder()
        .capacity(config.memory_capacity)
        .max_bytes(config.memory_max_bytes)
        .tenant_quota(quota)
        .build();
    let watched = store.clone();
    tokio::spawn(async move {
        // Gauges of the memory store, every second.
        loop {
            metrics::gauge!("idem_store_records").set(watched.len() as f64);
            metrics::gauge!("idem_store_bytes").set(watched.bytes() as f64);
            metrics::gauge!("idem_store_full").set(f64::from(u8::from(watched.is_full())));
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    store
}

/// `/healthz` of a memory store: 503 while it is full (new keys get 503
/// until records expire: a balancer should send them elsewhere).
fn memory_health(store: &MemoryStore) -> Health {
    let store = store.clone();
    std::sync::Arc::new(move || {
        let full = store.is_full();
        Box::pin(async move {
            if full {
                Err("store full".to_owned())
            } else {
                Ok("ok".to_owned())
            }
        })
    })
}

/// `/healthz` of Redis: every slot served by a master that answers.
fn redis_health(store: &std::sync::Arc<RedisStore>) -> Health {
    let store = std::sync::Arc::clone(store);
    std::sync::Arc::new(move || {
        let store = std::sync::Arc::clone(&store);
        Box::pin(async move {
            match store.health().await {
                Ok(health) if health.is_ok() => Ok(health.to_string()),
                Ok(health) => Err(health.to_string()),
                Err(error) => Err(format!("store unavailable: {error}")),
            }
        })
    })
}

/// The store the flags name (checked and prepared), and the router on it.
async fn store_router(
    config: &Config,
    tenants: &Tenants,
    upstream: Uri,
) -> Result<(Router, Drain), StartError> {
    if config.store == "memory" {
        let store = memory_store(config);
        let health = memory_health(&store);
        return router(config, tenants, store, Some(health), upstream);
    }
    if is_postgres(&config.store) {
        let store = idem_postgres::PgStore::from_url(&config.store)
            .map_err(|error| StartError::Postgres(error.to_string()))?;
        store.migrate().await.map_err(|error| {
            StartError::Postgres(format!("could not create the records table: {error}"))
        })?;
        let place = format!("the table {}_identity", store.table());
        let store = std::sync::Arc::new(store);
        claim_store(&store, place, config, tenants).await?;
        return router(config, tenants, store, None, upstream);
    }
    let mut builder = RedisStore::builder(&config.store)
        .timeout(config.store_timeout)
        .pack_records(config.redis_pack_records)
        .compact_headers(config.redis_compact_headers);
    if config.wait_for_replicas > 0 {
        builder = builder.wait_for_replicas(config.wait_for_replicas, config.replica_timeout);
    }
    let store = std::sync::Arc::new(builder.build()?);
    check_redis(&store, config.allow_redis_eviction).await?;
    let place = format!("the Redis key {}", store.identity_key());
    claim_store(&store, place, config, tenants).await?;
    check_failover(&store, config.lease).await;
    let health = redis_health(&store);
    router(config, tenants, store, Some(health), upstream)
}

/// The identity of this gateway's records: a keyed hash of what derives
/// their tenants and scopes (the tenant source; the tenant secret where
/// it is used). Gateways whose identities differ find no record of each
/// other.
fn store_identity(config: &Config, tenants: &Tenants) -> String {
    let (source, hashed) = match (&config.tenant_header, &tenants.jwt) {
        (Some(name), _) => (format!("header {name}"), false),
        (None, Some(_)) => (format!("jwt {}", config.tenant_jwt_claim), true),
        (None, None) => ("authorization".to_owned(), true),
    };
    // HMAC-SHA256 tenants keep the marker of the gateways before BLAKE3.
    let source = if hashed && config.blake3_tenants {
        format!("{source} blake3")
    } else {
        source
    };
    let keyed = if config.keyed_scopes {
        "keyed"
    } else {
        "unkeyed"
    };
    // SHA-256 scopes keep the marker of the gateways before BLAKE3.
    let scopes = if config.blake3_scopes {
        format!("{keyed} blake3")
    } else {
        keyed.to_owned()
    };
    // A secret that derives nothing is left out: gateways may differ in it.
    let secret: &[u8] = if hashed || config.keyed_scopes {
        &tenants.secret
    } else {
        b""
    };
    let text = format!("idem-gateway identity v1\ntenants {source}\nscopes {scopes}");
    let digest = hmac_sha256(secret, text.as_bytes());
    let mut marker = "v1:".to_owned();
    idem_core::push_hex(&mut marker, &digest[..16]);
    marker
}

/// Claims the store for this gateway's identity at start, or refuses to
/// start when gateways that derive tenants or scopes differently hold it
/// (a retry moving between them would run again); then keeps the claim
/// alive as long as the retention. A store that cannot be asked at start
/// is logged and accepted, and claimed on the next refresh. `place` says
/// where the claim lives, for an operator.
async fn claim_store<S: Fleet>(
    store: &std::sync::Arc<S>,
    place: String,
    config: &Config,
    tenants: &Tenants,
) -> Result<(), StartError> {
    let marker = store_identity(config, tenants);
    let ttl = config.retention;
    match store
        .claim_identity(&marker, ttl, config.replace_store_identity)
        .await
    {
        Ok(idem_core::IdentityClaim::Other(_)) => {
            return Err(StartError::UnsafeStore(format!(
                "this store holds records of gateways that derive tenants or scopes differently \
                 (another tenant secret, tenant source, --blake3-tenants, --keyed-scopes or \
                 --blake3-scopes; {place} \
                 says so): a retry that moves between them and this gateway does not find its \
                 record and runs again. Start it with their settings, or pass \
                 --replace-store-identity to make this gateway's the store's"
            )));
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "could not claim the store's identity at start"),
    }
    let store = std::sync::Arc::clone(store);
    let every = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            match store.claim_identity(&marker, ttl, false).await {
                Ok(idem_core::IdentityClaim::Other(_)) => tracing::error!(
                    place,
                    "another gateway made this store its own with other tenant or scope \
                     settings (--replace-store-identity): requests that move between it and \
                     this gateway run again. Restart this gateway with its settings"
                ),
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "could not refresh the store's identity"),
            }
        }
    });
    Ok(())
}

/// Warns when the lease could lapse during a cluster failover (where the
/// cluster's node timeout can be read).
async fn check_failover(store: &RedisStore, lease: Duration) {
    let Some(node_timeout) = store.cluster_node_timeout().await else {
        return;
    };
    let bound = idem_redis::failover_bound(node_timeout);
    if lease <= bound {
        tracing::warn!(
            lease = ?lease,
            node_timeout = ?node_timeout,
            failover_bound = ?bound,
            "the lease is shorter than this cluster's failover can take: a request running \
             while its master fails can lose its lease, and a retry may run while it still \
             acts. Set --lease above the failover bound (1.6 × cluster-node-timeout + 2 s)"
        );
    }
}

/// Refuses a Redis that can evict records unless allowed; warns when it
/// persists nothing. A server that cannot be asked (down at start, `INFO`
/// renamed) is logged and accepted: the store's own calls will tell.
async fn check_redis(store: &RedisStore, allow_eviction: bool) -> Result<(), StartError> {
    let safety = match store.server_safety().await {
        Ok(safety) => safety,
        Err(error) => {
            tracing::warn!(%error, "could not read the Redis eviction policy and persistence");
            return Ok(());
        }
    };
    let evicting = safety.evicting_policies();
    if !evicting.is_empty() {
        let message = format!(
            "Redis maxmemory-policy {} can evict idempotency records, and a retry of an evicted \
             key runs again; set maxmemory-policy noeviction, or pass --allow-redis-eviction",
            evicting.join(", ")
        );
        if !allow_eviction {
            return Err(StartError::UnsafeStore(message));
        }
        tracing::warn!("{message} (allowed by --allow-redis-eviction)");
    }
    if !safety.append_only {
        tracing::warn!(
            "Redis runs without appendonly: a restart can forget records, and retries of \
             forgotten keys run again; enable appendonly yes"
        );
    }
    Ok(())
}

/// Waits for a layer's background work at shutdown, up to a bound;
/// answers how much was left.
type Drain = Box<dyn Fn(Duration) -> futures_util::future::BoxFuture<'static, usize> + Send>;

/// Accepts connections until `shutdown`, then waits for in-flight requests.
/// A client must send its request head within `header_timeout` (no
/// slow-loris connections); heads are limited to hyper's defaults (100
/// headers, about 400 KiB; beyond that the answer is 431). HTTP/1.1, and
/// HTTP/2 with prior knowledge.
async fn serve(
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    use hyper_util::{
        rt::{TokioExecutor, TokioIo, TokioTimer},
        server::{conn::auto, graceful::GracefulShutdown},
        service::TowerToHyperService,
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(tower::ServiceExt::map_request(
            router.clone(),
            move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(proxy::PeerAddr(peer));
                request
            },
        ));
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Starts a gateway in the background on `127.0.0.1:0` (for tests):
/// returns what it reports, a trigger that shuts it down, and its task.
pub async fn start(
    config: Config,
) -> Result<
    (
        Started,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), StartError>>,
    ),
    StartError,
> {
    let listener = TcpListener::bind(config.listen).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, is_ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(run(
        config,
        listener,
        async {
            let _ = stopped.await;
        },
        move |started| {
            let _ = ready.send(started.clone());
        },
    ));
    match is_ready.await {
        Ok(started) => Ok((started, stop, task)),
        Err(_) => match task.await {
            Ok(Err(error)) => Err(error),
            _ => Err(StartError::Io(std::io::Error::other(
                "the gateway stopped before it started",
            ))),
        },
    }
}

/// A store's own health check for `/healthz`: `Ok` with what it found
/// (200), or `Err` with what is wrong (503). Without one, a read of an
/// empty scope proves the store answers.
type Health = std::sync::Arc<
    dyn Fn() -> futures_util::future::BoxFuture<'static, Result<String, String>> + Send + Sync,
>;

/// Where tenants come from, with the secret their hashes are keyed with.
struct Tenants {
    secret: Vec<u8>,
    /// Whether the secret was generated at start (none was configured).
    generated: bool,
    jwt: Option<jwt::JwtTenants>,
}

impl Tenants {
    /// Reads the secret (flag, file, or generated) and the JWT keys.
    fn resolve(config: &Config) -> Result<Self, StartError> {
        let (secret, generated) = match (&config.tenant_secret, &config.tenant_secret_file) {
            (Some(secret), _) => (secret.as_bytes().to_vec(), false),
            (None, Some(path)) => {
                let bytes = std::fs::read(path).map_err(|error| {
                    StartError::Setting(format!(
                        "cannot read the tenant secret file {}: {error}",
                        path.display()
                    ))
                })?;
                let secret = bytes.trim_ascii_end().to_vec();
                if secret.len() < MIN_SECRET_BYTES {
                    return Err(StartError::Setting(format!(
                        "the tenant secret file {} holds fewer than {MIN_SECRET_BYTES} bytes",
                        path.display()
                    )));
                }
                (secret, false)
            }
            (None, None) => (rand::random::<[u8; 32]>().to_vec(), true),
        };
        let jwt = match &config.tenant_jwt_keys {
            Some(path) => Some(
                jwt::JwtTenants::from_file(
                    path,
                    &config.tenant_jwt_claim,
                    config.tenant_jwt_leeway,
                )
                .map_err(StartError::Setting)?,
            ),
            None => None,
        };
        Ok(Self {
            secret,
            generated,
            jwt,
        })
    }
}

/// The key of a gateway's scope hashes (`--keyed-scopes`): HMAC-SHA256 of a
/// fixed label under the tenant secret, so that one secret serves both
/// and neither hash can be computed from the other.
pub fn scope_secret(tenant_secret: &[u8]) -> idem_layer::ScopeSecret {
    idem_layer::ScopeSecret::from_bytes(&hmac_sha256(
        tenant_secret,
        b"idem-gateway scope secret v1",
    ))
}

/// HMAC-SHA256 of `message` under `key`.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    match <Hmac<sha2::Sha256> as Mac>::new_from_slice(key) {
        Ok(mut mac) => {
            mac.update(message);
            mac.finalize().into_bytes().into()
        }
        // HMAC takes keys of every length: not reached.
        Err(_) => <sha2::Sha256 as sha2::Digest>::digest(message).into(),
    }
}

/// Says what a generated tenant secret means for this store.
fn generated_secret_warning(store: &str) {
    if store == "memory" {
        tracing::info!(
            "no --tenant-secret-file: tenant hashes are keyed with a secret generated at start \
             (the memory store's records live in this process only, so nothing else needs it)"
        );
    } else {
        tracing::warn!(
            "no --tenant-secret-file: tenant hashes are keyed with a secret generated at start. \
             Another gateway on this store, or this one after a restart, would derive other \
             tenants, and a retry that reaches it would run again: on Redis it refuses to start \
             while this gateway's records live. Give every gateway the same --tenant-secret-file"
        );
    }
}

/// How the gateway hashes tenants from credentials (`--blake3-tenants`;
/// always BLAKE3 with the memory store, whose records live in this
/// process only).
fn tenant_hash(config: &Config) -> idem_layer::TenantHash {
    if config.blake3_tenants || config.store == "memory" {
        idem_layer::TenantHash::Blake3
    } else {
        idem_layer::TenantHash::HmacSha256
    }
}

/// The idempotency layer the flags describe.
fn layer<S: Store>(
    config: &Config,
    tenants: &Tenants,
    store: S,
) -> Result<IdempotencyLayer<S>, StartError> {
    // A store that bounds its own calls (Redis: its timeout, plus the wait
    // for replicas when it waits for them) gives the layer that bound: the
    // store timeout alone would cut a reservation's `WAIT` short and answer
    // 503 for a write that reached its replicas.
    let store_timeout = store.call_bound().unwrap_or(config.store_timeout);
    let mut layer = IdempotencyLayer::new(store)
        .unknown_outcome_wait(config.unknown_outcome_wait)
        .methods(config.methods.clone())
        .lease(config.lease)
        .retention(config.retention)
        .in_flight(config.in_flight)
        .max_body(config.max_body)
        .body_timeout(config.body_timeout)
        .max_response(config.max_body)
        .store_timeout(store_timeout)
        .allow_anonymous(config.allow_anonymous)
        .require_key(config.require_key)
        .fail_open(config.fail_open);
    layer = match (&config.tenant_header, &tenants.jwt) {
        (Some(name), _) => layer.tenant(TenantFromHeader::new(name.clone())),
        (None, Some(_)) => layer.tenant(idem_layer::TenantFromExtension::<Tenant>::new()),
        (None, None) => layer.tenant(TenantFromAuthorization::keyed_as(
            tenant_hash(config),
            tenants.secret.clone(),
        )),
    };
    if let Some(token) = &config.records_admin_token {
        layer = layer.records_admin_token(token.as_bytes());
    }
    // The memory store's records live in this process only: keying their
    // scopes changes no stored identity.
    if config.keyed_scopes || config.store == "memory" {
        layer = layer.scope_secret(scope_secret(&tenants.secret));
    }
    if config.blake3_scopes || config.store == "memory" {
        layer = layer.scope_format(idem_core::ScopeFormat::Blake3);
    }
    if config.blake3_fingerprints || config.store == "memory" {
        layer = layer.fingerprint_format(idem_layer::fingerprint::FingerprintFormat::Blake3);
    }
    layer.validate()?;
    Ok(layer)
}

/// The chore of counting lapsed records, which one gateway of a fleet
/// sharing a store does ([`Fleet::claim_duty`](idem_core::Fleet::claim_duty)).
const LAPSED_DUTY: &str = "lapsed-records";

/// How long a gateway's claim on [`LAPSED_DUTY`] lasts past its next
/// round: a gateway that stopped hands the chore on after this.
const LAPSED_CLAIM_SLACK: Duration = Duration::from_secs(15);

/// Keeps `idem_records_lapsed` (processing records past their lease, with
/// no retry yet: stuck, for an operator) up to date. Of the gateways
/// sharing a store, the one that holds the chore counts them (a Redis
/// store looks at every record key to find them) and the others show
/// 0, so the gauge's sum or maximum over a fleet is the store's count.
fn watch_lapsed<S: RecordsAdmin + Fleet>(store: std::sync::Arc<S>) {
    tokio::spawn(async move {
        let holder = idem_core::OwnerToken::new().0.to_string();
        let bound = Duration::from_secs(10);
        let mut wait = LAPSED_EVERY;
        loop {
            let claim = store.claim_duty(LAPSED_DUTY, &holder, wait + LAPSED_CLAIM_SLACK);
            wait = match tokio::time::timeout(bound, claim).await {
                Ok(Ok(true)) => {
                    let wait = count_lapsed(&*store).await;
                    if wait > LAPSED_EVERY {
                        // A long sweep waits longer: keep the chore for it.
                        let ttl = wait.saturating_add(LAPSED_CLAIM_SLACK);
                        let _ = tokio::time::timeout(
                            bound,
                            store.claim_duty(LAPSED_DUTY, &holder, ttl),
                        )
                        .await;
                    }
                    wait
                }
                Ok(Ok(false)) => {
                    metrics::gauge!("idem_records_lapsed").set(0.0);
                    LAPSED_EVERY
                }
                // The claim failed (a store down, or a PostgreSQL schema
                // from before the duties table): count as every gateway
                // did before; a store that is down fails the count too,
                // and the gauge keeps its value.
                _ => count_lapsed(&*store).await,
            };
            tokio::time::sleep(wait).await;
        }
    });
}

/// Counts the lapsed records into `idem_records_lapsed` (unless the
/// store fails within [`LAPSED_COUNT_BOUND`]); the wait before the next
/// count.
async fn count_lapsed<S: RecordsAdmin>(store: &S) -> Duration {
    let bound = LAPSED_COUNT_BOUND;
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(bound, store.count_lapsed(LAPSED_COUNTED)).await {
        Ok(Ok(lapsed)) => metrics::gauge!("idem_records_lapsed").set(lapsed as f64),
        Ok(Err(error)) => tracing::warn!(
            %error,
            "could not count the lapsed records; idem_records_lapsed keeps its last value"
        ),
        Err(_) => tracing::warn!(
            ?bound,
            "counting the lapsed records took too long; idem_records_lapsed keeps its last value"
        ),
    }
    lapsed_wait(started.elapsed())
}

/// `/healthz`: the store's own check if it has one, else a read of an
/// empty scope; 200 or 503 with one line.
async fn health_answer<S: Store>(
    health: Option<Health>,
    store: std::sync::Arc<S>,
    timeout: Duration,
) -> (StatusCode, String) {
    let checked = match health {
        Some(check) => tokio::time::timeout(timeout * 4, check())
            .await
            .unwrap_or_else(|_| Err("health check timed out".to_owned())),
        None => {
            // Any read proves the store answers; this scope holds nothing.
            let nothing = ScopeHash::from_bytes([0; 32]);
            match tokio::time::timeout(timeout, store.get(&nothing)).await {
                Ok(Ok(_)) => Ok("ok".to_owned()),
                _ => Err("store unavailable".to_owned()),
            }
        }
    };
    match checked {
        Ok(text) => (StatusCode::OK, format!("{text}\n")),
        Err(text) => (StatusCode::SERVICE_UNAVAILABLE, format!("{text}\n")),
    }
}

fn router<S: RecordsAdmin + Fleet>(
    config: &Config,
    tenants: &Tenants,
    store: S,
    health: Option<Health>,
    upstream: Uri,
) -> Result<(Router, Drain), StartError> {
    let layer = layer(config, tenants, store)?;
    if tenants.generated && config.tenant_header.is_none() {
        generated_secret_warning(&config.store);
    }
    watch_lapsed(std::sync::Arc::clone(layer.store()));
    let health_store = std::sync::Arc::clone(layer.store());
    let timeout = config.store_timeout;
    let tls = proxy::tls_config(config.upstream_ca.as_deref()).map_err(StartError::Setting)?;
    let proxy = Proxy::new(upstream, config.upstream_timeout, tls).forwarded(config.forwarded);
    let protected = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(proxy);
    let metrics = prometheus().clone();
    let draining = layer.clone();
    let drain: Drain = Box::new(move |bound| {
        let layer = draining.clone();
        Box::pin(async move { layer.drain(bound).await })
    });
    let protected_headers: Vec<HeaderName> = [
        http::header::AUTHORIZATION,
        idem_layer::IDEMPOTENCY_KEY,
        proxy::IDEMPOTENCY_ATTEMPT,
    ]
    .into_iter()
    .chain(config.tenant_header.clone())
    .collect();
    let records_path = format!("{}/records", config.records_prefix);
    let jwt = tenants.jwt.clone().map(|jwt| JwtState {
        jwt,
        tenants: idem_layer::TenantHasher::new(tenant_hash(config), &tenants.secret),
        methods: std::sync::Arc::new(config.methods.clone()),
        records_path: std::sync::Arc::from(records_path.as_str()),
    });
    let router = Router::new()
        .route(
            "/healthz",
            get(move || {
                health_answer(
                    health.clone(),
                    std::sync::Arc::clone(&health_store),
                    timeout,
                )
            }),
        )
        .route("/metrics", get(move || async move { metrics.render() }))
        .route_service(&records_path, layer.records_service())
        .fallback_service(protected)
        .layer(middleware::from_fn_with_state(
            Front {
                guard: ConnectionGuard(std::sync::Arc::new(protected_headers)),
                jwt,
            },
            front,
        ));
    Ok((router, drain))
}

/// What the gateway does in front of every route, in this order: the log
/// line ([`log_request`]), the `Connection` check
/// ([`refuse_connection_naming`]) and the JWT tenant ([`tenant_from_jwt`]).
/// One middleware, not three: each layer of axum's middleware clones and
/// boxes the services behind it on every request.
#[derive(Clone)]
struct Front {
    guard: ConnectionGuard,
    jwt: Option<JwtState>,
}

async fn front(State(front): State<Front>, request: Request, next: Next) -> Response {
    log_request(request, |request| async move {
        refuse_connection_naming(&front.guard, request, |request| {
            tenant_from_jwt(front.jwt.as_ref(), request, next)
        })
        .await
    })
    .await
}

/// What the JWT tenant middleware needs.
#[derive(Clone)]
struct JwtState {
    jwt: jwt::JwtTenants,
    tenants: idem_layer::TenantHasher,
    methods: std::sync::Arc<Vec<Method>>,
    records_path: std::sync::Arc<str>,
}

/// With `--tenant-jwt-keys`: a request that needs a tenant (a keyed request
/// of a protected method, or the records API) and carries a bearer token
/// gets the keyed hash of the verified claim as its tenant; a token that
/// fails verification is `401 idempotency_tenant_invalid`, never a tenant
/// of its own. Without `Authorization` the layer decides (401 or the
/// anonymous tenant).
async fn tenant_from_jwt(state: Option<&JwtState>, mut request: Request, next: Next) -> Response {
    let Some(state) = state else {
        return next.run(request).await;
    };
    let method = request.method().as_str();
    let needs_tenant = request.uri().path() == &*state.records_path
        || (request.headers().contains_key(idem_layer::IDEMPOTENCY_KEY)
            && state
                .methods
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method)));
    let verified = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .filter(|_| needs_tenant)
        .map(|authorization| state.jwt.claim(authorization.as_bytes()));
    if let Some(verified) = verified {
        match verified {
            Ok(claim) => {
                let tenant = state.tenants.tenant("jwt:", claim.as_bytes());
                request.extensions_mut().insert(Tenant(tenant));
            }
            Err(why) => {
                tracing::info!(why, "refused a bearer token");
                return problem(
                    StatusCode::UNAUTHORIZED,
                    "idempotency_tenant_invalid",
                    "Caller's token could not be verified",
                    &format!("the bearer token could not be verified: {why}"),
                );
            }
        }
    }
    next.run(request).await
}

/// Headers a `Connection` field must not name.
#[derive(Clone)]
struct ConnectionGuard(std::sync::Arc<Vec<HeaderName>>);

/// A `Connection` field makes the headers it names hop-by-hop, so the
/// gateway would strip them after the layer used them: the upstream would
/// get an anonymous, keyless request. Such a request is refused with
/// `400 connection_header_invalid`.
async fn refuse_connection_naming<F: Future<Output = Response>>(
    guard: &ConnectionGuard,
    request: Request,
    next: impl FnOnce(Request) -> F,
) -> Response {
    let names_protected =
        proxy::connection_names(request.headers()).any(|name| guard.0.contains(&name));
    if names_protected {
        return problem(
            StatusCode::BAD_REQUEST,
            "connection_header_invalid",
            "Connection header names an end-to-end header",
            "the Connection header may not name Authorization, Idempotency-Key, \
             Idempotency-Attempt or the tenant header",
        );
    }
    next(request).await
}

/// One log line per request: method, path, status, idempotency outcome and
/// latency. Never the raw key.
async fn log_request<F: Future<Output = Response>>(
    request: Request,
    next: impl FnOnce(Request) -> F,
) -> Response {
    // With the line filtered out (`RUST_LOG=warn`, say), nothing is
    // gathered for it: no clock read, no copy of the path.
    if !tracing::enabled!(tracing::Level::INFO) {
        return next(request).await;
    }
    let started = std::time::Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let keyed = request.headers().contains_key(idem_layer::IDEMPOTENCY_KEY);
    let response = next(request).await;
    let outcome = if let Some(code) = response.extensions().get::<ProblemCode>() {
        code.as_str()
    } else if let Some(GatewayCode(code)) = response.extensions().get::<GatewayCode>() {
        code
    } else if response
        .headers()
        .contains_key(idem_layer::IDEMPOTENT_REPLAYED)
    {
        "replayed"
    } else if keyed {
        "executed"
    } else {
        "passthrough"
    };
    tracing::info!(
        %method,
        path,
        status = response.status().as_u16(),
        outcome,
        latency_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
    response
}

/// The problem `code` of an answer the gateway gave itself (a refused
/// `Connection`, an unverified token, an unreachable upstream): what its
/// log line names as the request's outcome.
#[derive(Clone, Copy)]
struct GatewayCode(&'static str);

/// A response body for the gateway's own answers.
pub(crate) fn problem(
    status: StatusCode,
    code: &'static str,
    title: &str,
    detail: &str,
) -> Response<Body> {
    let mut response = Response::new(Body::from(idem_layer::problem_document(
        status, code, title, detail,
    )));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(idem_layer::PROBLEM_JSON),
    );
    response.extensions_mut().insert(GatewayCode(code));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sweep_of_lapsed_records_waits_fifty_times_its_length() {
        assert_eq!(lapsed_wait(Duration::ZERO), LAPSED_EVERY);
        assert_eq!(lapsed_wait(Duration::from_millis(100)), LAPSED_EVERY);
        assert_eq!(
            lapsed_wait(Duration::from_secs(2)),
            Duration::from_secs(100)
        );
        assert_eq!(lapsed_wait(Duration::MAX), Duration::MAX);
    }
}
