//! The gateway's flags (each also an `IDEM_*` variable) and their parsers.

use crate::proxy;

use std::{net::SocketAddr, time::Duration};

use axum::http::{HeaderName, Method, Uri};
use clap::{ArgAction, Parser};
use idem_layer::InFlight;
use idem_redis::RedisStore;

/// The gateway's configuration: every flag is also an `IDEM_*` variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "idem-gateway",
    version,
    about = "Idempotency-Key protection in front of any HTTP upstream",
    after_help = "-h shows the flags a first run needs; --help shows every flag, by group."
)]
pub struct Config {
    /// Address to serve on.
    #[arg(
        long,
        env = "IDEM_LISTEN",
        default_value = "127.0.0.1:8080",
        help_heading = "Upstream"
    )]
    pub listen: SocketAddr,
    /// Upstream base URL (http://host:port or https://host:port); without it, a built-in demo orders API is started.
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = parse_upstream, help_heading = "Upstream")]
    pub upstream: Option<Uri>,
    /// Speak HTTP/2 to the upstream (cleartext with prior knowledge for http://, ALPN for https://): a gRPC upstream needs it. Clients may speak HTTP/1.1 or HTTP/2 to the gateway either way.
    #[arg(long, env = "IDEM_UPSTREAM_HTTP2", action = ArgAction::SetTrue, help_heading = "Upstream", hide_short_help = true)]
    pub upstream_http2: bool,
    /// PEM file of a private CA that an https:// upstream's certificate may chain to, besides the system's roots (or SSL_CERT_FILE).
    #[arg(
        long,
        env = "IDEM_UPSTREAM_CA",
        help_heading = "Upstream",
        hide_short_help = true
    )]
    pub upstream_ca: Option<std::path::PathBuf>,
    /// Record store: memory, redis://host:port[/db], redis+cluster://h1:p1,h2:p2,..., or postgres://user@host:port/db (the records table is created if missing)
    #[arg(long, env = "IDEM_STORE", default_value = "memory", value_parser = parse_store, help_heading = "Store")]
    pub store: String,
    /// Take the tenant from this header (a plain account id set by a trusted proxy); without it, the tenant is a keyed hash of the normalized Authorization value, or of a verified JWT's claim.
    #[arg(long, env = "IDEM_TENANT_HEADER", value_parser = parse_header_name, conflicts_with = "tenant_jwt_keys", help_heading = "Tenants and secrets", hide_short_help = true)]
    pub tenant_header: Option<HeaderName>,
    /// Secret key of the tenant hash (HMAC-SHA256, at least 16 bytes), the same on every gateway sharing a store; without it or --tenant-secret-file, one is generated at start.
    #[arg(long, env = "IDEM_TENANT_SECRET", hide_env_values = true, value_parser = parse_secret, conflicts_with = "tenant_secret_file", help_heading = "Tenants and secrets")]
    pub tenant_secret: Option<Secret>,
    /// File holding the tenant hash's secret key (trailing whitespace ignored, at least 16 bytes).
    #[arg(
        long,
        env = "IDEM_TENANT_SECRET_FILE",
        help_heading = "Tenants and secrets",
        hide_short_help = true
    )]
    pub tenant_secret_file: Option<std::path::PathBuf>,
    /// Take the tenant from a claim of a verified bearer JWT; the file holds the keys: a JWKS document, a PEM public key (RSA, EC, Ed25519) or an HMAC secret. A keyed request whose token fails verification gets 401.
    #[arg(
        long,
        env = "IDEM_TENANT_JWT_KEYS",
        help_heading = "Tenants and secrets",
        hide_short_help = true
    )]
    pub tenant_jwt_keys: Option<std::path::PathBuf>,
    /// The JWT claim that names the tenant.
    #[arg(
        long,
        env = "IDEM_TENANT_JWT_CLAIM",
        default_value = "sub",
        help_heading = "Tenants and secrets",
        hide_short_help = true
    )]
    pub tenant_jwt_claim: String,
    /// Clock skew allowed when checking a JWT's exp and nbf (humantime).
    #[arg(long, env = "IDEM_TENANT_JWT_LEEWAY", default_value = "30s", value_parser = parse_duration, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub tenant_jwt_leeway: Duration,
    /// Keyed requests without a tenant share one anonymous tenant instead of getting 401.
    #[arg(long, env = "IDEM_ALLOW_ANONYMOUS", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub allow_anonymous: bool,
    /// Requests of the keyed methods without an Idempotency-Key get 400.
    #[arg(long, env = "IDEM_REQUIRE_KEY", action = ArgAction::SetTrue, help_heading = "Lease and waiting", hide_short_help = true)]
    pub require_key: bool,
    /// Comma-separated methods the layer applies to; others pass straight through.
    #[arg(long, env = "IDEM_METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = parse_method, help_heading = "Lease and waiting", hide_short_help = true)]
    pub methods: Vec<Method>,
    /// How long records are kept (humantime: 2s, 5m, 24h); must exceed the lease.
    #[arg(long, env = "IDEM_RETENTION", default_value = "24h", value_parser = parse_duration, help_heading = "Lease and waiting", hide_short_help = true)]
    pub retention: Duration,
    /// Lease length of a running request, renewed while it runs (humantime).
    #[arg(long, env = "IDEM_LEASE", default_value = "30s", value_parser = parse_duration, help_heading = "Lease and waiting", hide_short_help = true)]
    pub lease: Duration,
    /// Duplicates in flight: reject (409 at once) or wait:DURATION (wait for the outcome).
    #[arg(long, env = "IDEM_IN_FLIGHT", default_value = "reject", value_parser = parse_in_flight, help_heading = "Lease and waiting", hide_short_help = true)]
    pub in_flight: InFlight,
    /// Largest keyed request body and largest stored response, in bytes.
    #[arg(
        long,
        env = "IDEM_MAX_BODY",
        default_value_t = 1_048_576,
        help_heading = "Upstream",
        hide_short_help = true
    )]
    pub max_body: usize,
    /// Forward requests unprotected when the store is down, instead of 503.
    #[arg(long, env = "IDEM_FAIL_OPEN", action = ArgAction::SetTrue, help_heading = "Store", hide_short_help = true)]
    pub fail_open: bool,
    /// Admin credential of the records API (at least 16 bytes): a request carrying it in x-idem-admin-token may list every tenant's records and act on another tenant's (tenant=).
    #[arg(long, env = "IDEM_RECORDS_ADMIN_TOKEN", hide_env_values = true, value_parser = parse_secret, help_heading = "Records and operators")]
    pub records_admin_token: Option<Secret>,
    /// A caller may fetch its own stored answer by its key alone, without the payload (a GET on the records prefix with method, path, key and output=true, and wait=10s to wait for a running attempt). Off by default: turn it on only where keys are random and a tenant is one principal; anonymous callers are always refused.
    #[arg(long, env = "IDEM_OUTPUT_BY_KEY", action = ArgAction::SetTrue, help_heading = "Records and operators", hide_short_help = true)]
    pub output_by_key: bool,
    /// The operator page is served over plain HTTP (a loopback or a trusted network): its session cookie is sent without `Secure`. By default the cookie is `Secure`, so a browser sends it only over HTTPS (put the page behind TLS).
    #[arg(long, env = "IDEM_OPERATOR_PLAIN_HTTP", action = ArgAction::SetTrue, help_heading = "Records and operators", hide_short_help = true)]
    pub operator_plain_http: bool,
    /// Path under which the records API is served ({prefix}/records).
    #[arg(long, env = "IDEM_RECORDS_PREFIX", default_value = "/_idempotency", value_parser = parse_prefix, help_heading = "Records and operators", hide_short_help = true)]
    pub records_prefix: String,
    /// How long to wait for the upstream's response head before answering 504, and the longest a keyed request's answer body may pause (humantime).
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = parse_wait, help_heading = "Upstream", hide_short_help = true)]
    pub upstream_timeout: Duration,
    /// How long a client may take to send a request head (humantime).
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_wait, help_heading = "Upstream", hide_short_help = true)]
    pub header_timeout: Duration,
    /// How long a keyed request's body may take to arrive, then 408 (humantime).
    #[arg(long, env = "IDEM_BODY_TIMEOUT", default_value = "30s", value_parser = parse_wait, help_heading = "Upstream", hide_short_help = true)]
    pub body_timeout: Duration,
    /// Most live records the memory store holds; new keys beyond get 503 (released records do not count).
    #[arg(
        long,
        env = "IDEM_MEMORY_CAPACITY",
        default_value_t = 1_000_000,
        help_heading = "Store",
        hide_short_help = true
    )]
    pub memory_capacity: usize,
    /// Most live records one tenant may hold in the memory store, then 429 for its new keys (0: no quota; default: a tenth of the memory capacity).
    #[arg(
        long,
        env = "IDEM_MEMORY_TENANT_QUOTA",
        help_heading = "Store",
        hide_short_help = true
    )]
    pub memory_tenant_quota: Option<usize>,
    /// Most bytes the memory store's records may take, as it estimates them (bytes, or with KiB, MiB, GiB).
    #[arg(long, env = "IDEM_MEMORY_MAX_BYTES", default_value = "1GiB", value_parser = parse_size, help_heading = "Store", hide_short_help = true)]
    pub memory_max_bytes: usize,
    /// Timeout of every store call (humantime).
    #[arg(long, env = "IDEM_STORE_TIMEOUT", default_value = "1s", value_parser = parse_duration, help_heading = "Store", hide_short_help = true)]
    pub store_timeout: Duration,
    /// Bytes of completed records kept in this process to answer retries without a store call (bytes, or with KiB, MiB, GiB; 0 for none). A record erased through another gateway stops being replayed here within about a second (the store's push channel; without one, copies live at most 1 s).
    #[arg(long, env = "IDEM_REPLAY_CACHE_BYTES", default_value = "16MiB", value_parser = parse_size, help_heading = "Store", hide_short_help = true)]
    pub replay_cache_bytes: usize,
    /// The longest the replay cache keeps a record, never past the record's expiry (humantime); at most 1 s on a store without a push channel (Redis Cluster, PostgreSQL behind a transaction pooler).
    #[arg(long, env = "IDEM_REPLAY_CACHE_TTL", default_value = "60s", value_parser = parse_duration, help_heading = "Store", hide_short_help = true)]
    pub replay_cache_ttl: Duration,
    /// After an upstream timeout, how long to keep waiting for the upstream's late answer and record it (humantime).
    #[arg(long, env = "IDEM_UNKNOWN_OUTCOME_WAIT", default_value = "60s", value_parser = parse_duration, help_heading = "Lease and waiting", hide_short_help = true)]
    pub unknown_outcome_wait: Duration,
    /// At shutdown, how long to wait for detached requests and pending completions after the connections closed (humantime).
    #[arg(long, env = "IDEM_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration, help_heading = "Lease and waiting", hide_short_help = true)]
    pub drain_timeout: Duration,
    /// Accept a Redis whose maxmemory-policy can evict idem's records (they would be lost silently and retries would run again).
    #[arg(long, env = "IDEM_ALLOW_REDIS_EVICTION", action = ArgAction::SetTrue, help_heading = "Store", hide_short_help = true)]
    pub allow_redis_eviction: bool,
    /// After each reservation and completion on a single-node Redis, wait until this many replicas have it (0: do not wait). A reservation short of them is released and answered 503; a completion short of them is kept, logged and counted.
    #[arg(
        long,
        env = "IDEM_WAIT_FOR_REPLICAS",
        default_value_t = 0,
        help_heading = "Store",
        hide_short_help = true
    )]
    pub wait_for_replicas: usize,
    /// How long to wait for the replicas (humantime); a call that waits is bounded by the store timeout plus this.
    #[arg(long, env = "IDEM_REPLICA_TIMEOUT", default_value = "100ms", value_parser = parse_duration, help_heading = "Store", hide_short_help = true)]
    pub replica_timeout: Duration,
    /// The format of the records written on Redis: 3 (the default: a new key's record as one string, reserved and replayed by one native command, completed by a small compare-and-set script; gateways of earlier versions cannot read it: roll this version out with --redis-record-format 2, then drop the flag), 2 (a new key's record as a packed hash) or 1. Every gateway reads every format it knows; write a format only once every gateway sharing the store runs a version that reads it (deploy writing the format the gateways not yet upgraded read, then switch once every gateway runs this version). Format 2 needs no such step: every gateway that writes format 1 reads it.
    #[arg(long, env = "IDEM_REDIS_RECORD_FORMAT", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=3), help_heading = "Store", hide_short_help = true)]
    pub redis_record_format: u32,
    /// Write request fingerprints with BLAKE3 instead of SHA-256: about an eighth of the hashing instructions on CPUs without SHA extensions. Every gateway of this version reads both formats, whatever it writes; earlier versions read only SHA-256 and answer 422 to a retry whose record is in BLAKE3, so turn it on once every gateway sharing the store runs this version. Always on with the memory store.
    #[arg(long, env = "IDEM_BLAKE3_FINGERPRINTS", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub blake3_fingerprints: bool,
    /// Hash scopes (the records' identities in the store) with BLAKE3 instead of SHA-256: about a tenth of the hashing instructions on CPUs without SHA extensions. Always on with the memory store. On Redis or PostgreSQL it changes every record's identity, as --keyed-scopes does: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once (a gateway that hashes otherwise refuses to start on the store).
    #[arg(long, env = "IDEM_BLAKE3_SCOPES", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub blake3_scopes: bool,
    /// Hash tenants (from Authorization or a JWT claim) with keyed BLAKE3 instead of HMAC-SHA256: one BLAKE3 compression instead of two SHA-256 ones for a short credential. Always on with the memory store. On Redis or PostgreSQL it changes every record's tenant, and so its identity, as --blake3-scopes does: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once (a gateway that hashes otherwise refuses to start on the store).
    #[arg(long, env = "IDEM_BLAKE3_TENANTS", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub blake3_tenants: bool,
    /// Key scope hashes (the records' identities in the store) with a key derived from the tenant secret (HMAC-SHA256), so that nobody without it can compute where a record lives. Always on with the memory store. On Redis or PostgreSQL it changes every record's identity: turn it on in a new deployment, or once no retry of a request made before the switch can come, on every gateway sharing the store at once. Needs --tenant-secret or --tenant-secret-file.
    #[arg(long, env = "IDEM_KEYED_SCOPES", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub keyed_scopes: bool,
    /// Start even though the store (Redis or PostgreSQL) holds records of gateways that derive tenants or scopes differently (another tenant secret, tenant source, --blake3-tenants, --keyed-scopes or --blake3-scopes), and make this gateway's settings the store's. Retries of requests those gateways handled do not find their records here and run again; gateways with the old settings no longer start. Use it once, for the switch: left on, it takes the store over at every start.
    #[arg(long, env = "IDEM_REPLACE_STORE_IDENTITY", action = ArgAction::SetTrue, help_heading = "Store", hide_short_help = true)]
    pub replace_store_identity: bool,
    /// The base of the `type` of idem's problem answers (`https://docs.example.com/problems/`: the type is the base followed by the code); a web address is also sent as `Link: <type>; rel="describedby"`. Default: `urn:idem:problem:`.
    #[arg(long, env = "IDEM_PROBLEM_TYPE_BASE", value_parser = parse_problem_type_base, help_heading = "Records and operators", hide_short_help = true)]
    pub problem_type_base: Option<String>,
    /// A header, such as Stripe-Should-Retry or x-should-retry, added to every refusal (the layer's and the gateway's own) with `true` where a retry may succeed (in progress, store unavailable, the upstream unreachable or slow) and `false` where it never will (a conflict, a response not stored, a request to correct): what common SDKs read instead of Retry-After.
    #[arg(long, env = "IDEM_SHOULD_RETRY_HEADER", value_parser = parse_header_name, help_heading = "Records and operators", hide_short_help = true)]
    pub should_retry_header: Option<HeaderName>,
    /// Refusals also carry the member common SDKs (Stripe's among them) read beside RFC 9457's: "error": {"type": "idempotency_error", "code", "message"}.
    #[arg(long, env = "IDEM_PROBLEM_ERROR_MEMBER", action = ArgAction::SetTrue, help_heading = "Records and operators", hide_short_help = true)]
    pub problem_error_member: bool,
    /// Write fingerprints unkeyed (plain SHA-256 or BLAKE3 of the request): by default they are keyed with a key derived from the tenant secret, so whoever reads the store cannot confirm a guess of a short request body. Keyed or not, records written either way are read.
    #[arg(long, env = "IDEM_UNKEYED_FINGERPRINTS", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub unkeyed_fingerprints: bool,
    /// Store responses in clear instead of sealed at rest (by default every stored response's headers and body are encrypted with a key derived from the tenant secret).
    #[arg(long, env = "IDEM_NO_SEALING", action = ArgAction::SetTrue, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub no_sealing: bool,
    /// A sealing key ID:HEX (a number, then 64 hex digits), repeatable or comma-separated: the one with the highest id seals new records, every one (and the key derived from the tenant secret, id 0) opens the records sealed before. Add a key to rotate; remove an old one once its records expired.
    #[arg(long, env = "IDEM_SEALING_KEYS", value_delimiter = ',', value_parser = parse_sealing_key, hide_env_values = true, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub sealing_key: Vec<SealingKey>,
    /// Keys that open stored responses but seal none (ID:HEX, comma-separated): the first step of a rolling key rotation. Add the new key here on every gateway first, then move it to --sealing-key one gateway at a time: every gateway opens what any of them seals at every step.
    #[arg(long, env = "IDEM_SEALING_OPENING_KEYS", value_delimiter = ',', value_parser = parse_sealing_key, hide_env_values = true, help_heading = "Tenants and secrets", hide_short_help = true)]
    pub sealing_opening_keys: Vec<SealingKey>,
    /// Export the gateway's span of each request over OTLP/HTTP (protobuf) to this collector (its base URL, such as http://collector:4318; spans go to /v1/traces). Without it, the trace context is passed to the upstream and nothing is exported.
    #[arg(long, env = "IDEM_OTLP_ENDPOINT", value_parser = parse_otlp_endpoint, help_heading = "Observability", hide_short_help = true)]
    pub otlp_endpoint: Option<Uri>,
    /// Headers that tell the upstream who the client is: x-forwarded (X-Forwarded-For, -Proto, -Host), forwarded (RFC 7239 Forwarded), or none.
    #[arg(long, env = "IDEM_FORWARDED", default_value = "x-forwarded", value_parser = parse_forwarded, help_heading = "Upstream", hide_short_help = true)]
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
pub(crate) const MIN_SECRET_BYTES: usize = 16;

pub(crate) fn parse_secret(value: &str) -> Result<Secret, String> {
    if value.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "the secret must be at least {MIN_SECRET_BYTES} bytes"
        ));
    }
    Ok(Secret(value.to_owned()))
}

/// A size in bytes: a number, optionally followed by KiB, MiB or GiB.
pub(crate) fn parse_size(value: &str) -> Result<usize, String> {
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
pub(crate) fn parse_duration(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value).map_err(|e| e.to_string())?;
    if duration > idem_layer::MAX_DURATION {
        return Err("at most 100 years".to_owned());
    }
    Ok(duration)
}

/// A duration that bounds a wait every request makes (the upstream's
/// answer, a request's head or body): zero would refuse every request, so
/// it is refused at start.
pub(crate) fn parse_wait(value: &str) -> Result<Duration, String> {
    let duration = parse_duration(value)?;
    if duration.is_zero() {
        return Err("must be longer than zero".to_owned());
    }
    Ok(duration)
}

pub(crate) fn parse_upstream(value: &str) -> Result<Uri, String> {
    let uri: Uri = value.parse().map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err("expected http://host:port or https://host:port".to_owned());
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err("the upstream URL takes no path or query".to_owned());
    }
    Ok(uri)
}

/// A sealing key from `--sealing-key`: its id and its 32 bytes.
#[derive(Clone)]
pub struct SealingKey {
    /// The key's id (1 and up; 0 is the key derived from the tenant secret).
    pub id: u32,
    /// The key.
    pub key: [u8; 32],
}

impl std::fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealingKey({}, <redacted>)", self.id)
    }
}

pub(crate) fn parse_sealing_key(value: &str) -> Result<SealingKey, String> {
    let (id, key) = value
        .split_once(':')
        .ok_or("expected ID:HEX, such as 1:<64 hex digits>")?;
    let id: u32 = id
        .trim()
        .parse()
        .map_err(|_| "the id is a number from 1 up".to_owned())?;
    if id == 0 {
        return Err(
            "id 0 is the key derived from the tenant secret; give ids from 1 up".to_owned(),
        );
    }
    let bytes = hex::decode(key.trim()).map_err(|_| "the key is 64 hex digits".to_owned())?;
    let key: [u8; 32] = bytes
        .try_into()
        .map_err(|_| "the key is 64 hex digits (32 bytes)".to_owned())?;
    Ok(SealingKey { id, key })
}

pub(crate) fn parse_otlp_endpoint(value: &str) -> Result<Uri, String> {
    let uri: Uri = value.parse().map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err("expected http://host:port or https://host:port".to_owned());
    }
    if uri.query().is_some() {
        return Err("the collector's URL takes no query".to_owned());
    }
    Ok(uri)
}

pub(crate) fn parse_store(value: &str) -> Result<String, String> {
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

pub(crate) fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

pub(crate) fn parse_forwarded(value: &str) -> Result<proxy::Forwarded, String> {
    match value {
        "x-forwarded" => Ok(proxy::Forwarded::XForwarded),
        "forwarded" => Ok(proxy::Forwarded::Rfc7239),
        "none" => Ok(proxy::Forwarded::None),
        _ => Err("expected x-forwarded, forwarded or none".to_owned()),
    }
}

pub(crate) fn parse_header_name(value: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(value.as_bytes()).map_err(|_| format!("{value:?} is not a header name"))
}

pub(crate) fn parse_method(value: &str) -> Result<Method, String> {
    Method::from_bytes(value.trim().to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("{value:?} is not a method"))
}

pub(crate) fn parse_in_flight(value: &str) -> Result<InFlight, String> {
    match value {
        "reject" => Ok(InFlight::Reject),
        _ => match value.strip_prefix("wait:") {
            Some(bound) => parse_duration(bound).map(InFlight::Wait),
            None => Err("expected reject or wait:DURATION".to_owned()),
        },
    }
}

pub(crate) fn parse_problem_type_base(value: &str) -> Result<String, String> {
    idem_layer::problem::check_type_base(value)
        .map_err(|why| format!("{value:?} is not an absolute URI: {why}"))?;
    Ok(value.to_owned())
}

pub(crate) fn parse_prefix(value: &str) -> Result<String, String> {
    if !value.starts_with('/') {
        return Err("the prefix must start with /".to_owned());
    }
    let prefix = value.trim_end_matches('/');
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"/-._~!$&'()*+,=:@".contains(&b);
    if !prefix.bytes().all(plain) {
        return Err(
            "the prefix may hold letters, digits and - . _ ~ ! $ & ' ( ) * + , = : @ only (no %, ;, ?, #, \\, spaces or non-ASCII)"
                .to_owned(),
        );
    }
    if prefix.is_empty() {
        return Err("the prefix needs a segment: / would make every path the gateway's".to_owned());
    }
    // The prefix is matched as the gateway reads every request path
    // (crate::owned): it must read as itself.
    if crate::owned::canonical(prefix).as_deref() != Some(prefix.to_lowercase().as_str()) {
        return Err(
            "the prefix must be plain segments: no %-escapes, `.` or empty segments, `\\` or `;`"
                .to_owned(),
        );
    }
    Ok(prefix.to_owned())
}
