//! [`IdempotencyLayer`] and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method, StatusCode, header, request::Parts};
use idem_core::{Fingerprint, RecordsAdmin, Store};
use tower::Layer;

use crate::{
    Idempotency, RecordsService,
    classify::{Producer, Verdict},
    config::{Config, ConfigError, InFlight, OnDisconnect, default_replay_denylist},
    fingerprint::FingerprintFn,
    problem::ProblemHook,
    runtime::Runtime,
    tenant::{Tenant, TenantExtractor, TenantFromExtension},
};

/// Tower layer that makes requests carrying an `Idempotency-Key` safe to
/// retry.
///
/// Built with consuming setters; every default follows the contract:
///
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | `POST`, `PATCH` |
/// | [`require_key`](Self::require_key) | off: keyless requests pass through |
/// | [`tenant`](Self::tenant) | the [`Tenant`] request extension |
/// | [`allow_anonymous`](Self::allow_anonymous) | off: 401 without a tenant |
/// | [`fingerprint_headers`](Self::fingerprint_headers) | `content-type` |
/// | [`fingerprint_format`](Self::fingerprint_format) | SHA-256 (both read) |
/// | [`scope_secret`](Self::scope_secret), [`scope_format`](Self::scope_format) | unkeyed SHA-256 |
/// | [`max_body`](Self::max_body) | 1 MiB (then 413) |
/// | [`body_timeout`](Self::body_timeout) | 30 s to receive a keyed body (then 408) |
/// | [`max_response`](Self::max_response) | 1 MiB (larger responses are not stored) |
/// | [`lease`](Self::lease) | 30 s, renewed every third |
/// | [`retention`](Self::retention) | 24 h |
/// | [`in_flight`](Self::in_flight) | [`InFlight::Reject`] |
/// | [`store_timeout`](Self::store_timeout) | 1 s per store call |
/// | [`fail_open`](Self::fail_open) | off: 503 when the store fails |
/// | [`on_disconnect`](Self::on_disconnect) | [`OnDisconnect::Detach`] |
/// | [`replay_cache`](Self::replay_cache) | 16 MiB, an entry at most 1 s (`0`: none) |
///
/// Call [`validate`](Self::validate) at start: it refuses a retention not
/// longer than the lease, a zero lease or store timeout, and durations
/// over [`MAX_DURATION`](crate::MAX_DURATION). Applying the layer never
/// panics; with a configuration `validate` refuses, the service logs the
/// error and answers every request of a protected method
/// `500 idempotency_misconfigured` without running the handler (never
/// unprotected), and [`run`](Self::run) answers
/// [`CommandError::Misconfigured`](crate::CommandError::Misconfigured).
pub struct IdempotencyLayer<S> {
    pub(crate) runtime: Runtime<S>,
}

impl<S> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        Self {
            runtime: self.runtime.clone(),
        }
    }
}

impl<S> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.runtime.config.methods)
            .field("require_key", &self.runtime.config.require_key)
            .field("lease", &self.runtime.config.lease)
            .field("retention", &self.runtime.config.retention)
            .field("in_flight", &self.runtime.config.in_flight)
            .finish_non_exhaustive()
    }
}

/// A layer and what it runs on: made with [`new`](Self::new) on a store, then
/// set up with the setters below (each group one concept); checked with
/// [`validate`](Self::validate); drained at shutdown.
impl<S: Store> IdempotencyLayer<S> {
    /// A layer on `store` with the default configuration.
    pub fn new(store: S) -> Self {
        let config = Config {
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            tenant: Arc::new(TenantFromExtension::<Tenant>::new()),
            tenant_chosen: false,
            allow_anonymous: false,
            fingerprint_headers: vec![header::CONTENT_TYPE],
            fingerprint_fn: None,
            fingerprint_format: crate::fingerprint::FingerprintFormat::Sha256,
            fingerprint_key: None,
            fingerprint_keyed: false,
            max_body: 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            max_response: 1024 * 1024,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            in_flight: InFlight::Reject,
            classify: crate::classify::Classifier::default(),
            replay_denylist: default_replay_denylist(),
            fail_open: false,
            sealing: None,
            seal_new: false,
            store_timeout: Duration::from_secs(1),
            store_guard: crate::config::StoreGuard::default(),
            should_retry_header: None,
            error_member: false,
            on_disconnect: OnDisconnect::Detach,
            unknown_wait: Duration::from_secs(60),
            problem_type_base: None,
            records_path: None,
            problem_hook: None,
            admin_token: None,
            output_by_key: false,
            tenant_release: false,
            scope_secret: None,
            scope_format: crate::ScopeFormat::Sha256,
            replay_cache: (DEFAULT_REPLAY_CACHE_BYTES, DEFAULT_REPLAY_CACHE_BOUND),
        };
        Self {
            runtime: Runtime::new(store, config),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        self.runtime.configure(change);
        self
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.runtime.config.validate()
    }

    /// Says the server stopped taking requests: answers fetched by key
    /// (the records API's `output=true`) that wait for a running attempt
    /// stop waiting and answer at once (`409` with `Retry-After`), so they
    /// do not hold the shutdown. Call it when a graceful shutdown begins,
    /// before waiting for the connections to close; [`drain`](Self::drain)
    /// calls it too. Shared by every clone of the layer and its services.
    pub fn close(&self) {
        self.runtime.closing.cancel();
    }

    /// Waits, up to `bound`, for the work that outlives its requests:
    /// handlers still running after their client left, outcomes being
    /// recorded after a store error, late answers of unknown outcomes,
    /// and then the store's own ([`Store::settled`]: reservations given
    /// up before their answer being freed). Call it at shutdown, after the
    /// server stopped taking requests, so that no outcome is lost with the
    /// process. Answers how many of those tasks were still running when
    /// the bound passed (0: all finished); their records stay processing
    /// until their leases lapse. It [`close`](Self::close)s the layer
    /// first.
    pub async fn drain(&self, bound: Duration) -> usize {
        self.close();
        let (tasks, store) = (&self.runtime.tasks, &*self.runtime.store);
        tasks.close();
        let finished = tokio::time::timeout(bound, async {
            tasks.wait().await;
            store.settled().await;
        })
        .await;
        tasks.reopen();
        match finished {
            Ok(()) => 0,
            Err(_) => tasks.len() + store.background_tasks(),
        }
    }

    /// How many tasks of the layer outlive their requests right now.
    pub fn background_tasks(&self) -> usize {
        self.runtime.tasks.len()
    }

    /// How many duplicates wait right now for an attempt of their key to
    /// end (in wait mode): on the store, or on the reservation of their
    /// key in flight here, which waits on the store once for them all.
    pub fn duplicates_waiting(&self) -> usize {
        self.runtime.flights.waiting()
    }

    /// The store as the layer calls it (see [`stores`](crate::stores)):
    /// every call bounded by the store timeout and timed, and stored
    /// responses sealed and opened with the layer's keyring. The records
    /// API and the gateway's operator page go through it; so does a test
    /// that reads what the layer stored. The store as given is
    /// `store().inner().inner()`.
    pub fn store(&self) -> &Arc<crate::stores::LayerStore<S>> {
        &self.runtime.store
    }

    /// The marker of how this layer derives its records' identities: its
    /// scope hashing ([`scope_format`](Self::scope_format) and, keyed by
    /// it, the [`scope_secret`](Self::scope_secret)) and its fingerprints
    /// ([`fingerprint_format`](Self::fingerprint_format), and a digest of
    /// the fingerprint key, when fingerprints are keyed or read keyed).
    /// Layers whose markers differ find no record of each other, or answer
    /// a genuine retry `422`, on one store. The marker is a keyed hash and
    /// a digest: it never shows a secret. It does not cover the tenant
    /// extractor, which the layer cannot see into.
    pub fn store_identity(&self) -> String {
        let config = &self.runtime.config;
        // The fingerprint key as a digest under a label of its own.
        let key = config.fingerprint_key.map(|key| {
            let mut hex = String::with_capacity(64);
            idem_core::push_hex(&mut hex, &key);
            let digest =
                crate::ScopeFormat::Sha256.hash(None, "idem-layer fingerprint key", &hex, "");
            let mut short = String::with_capacity(32);
            idem_core::push_hex(&mut short, &digest.as_bytes()[..16]);
            short
        });
        let fingerprints = format!(
            "{:?} {} {}",
            config.fingerprint_format,
            if config.fingerprint_keyed {
                "keyed"
            } else {
                "read-keyed"
            },
            key.as_deref().unwrap_or("unkeyed"),
        );
        let digest = crate::ScopeFormat::Sha256.hash(
            config.scope_secret.as_ref(),
            "idem-layer identity v2",
            config.scope_format.name(),
            &fingerprints,
        );
        let mut marker = "layer-v2:".to_owned();
        idem_core::push_hex(&mut marker, &digest.as_bytes()[..16]);
        marker
    }

    /// The marker layers before fingerprints were part of it claimed: a
    /// store that holds this layer's own is upgraded at
    /// [`claim_store`](Self::claim_store).
    pub(crate) fn legacy_store_identity(&self) -> String {
        let config = &self.runtime.config;
        // A scope hash of fixed parts: keyed by the secret when there is
        // one, so the marker tells secrets apart without showing them.
        let digest = crate::ScopeFormat::Sha256.hash(
            config.scope_secret.as_ref(),
            "idem-layer identity v1",
            config.scope_format.name(),
            "",
        );
        let mut marker = "layer-v1:".to_owned();
        idem_core::push_hex(&mut marker, &digest.as_bytes()[..16]);
        marker
    }
}

/// Which requests it protects: the methods, and whether a key is required.
impl<S: Store> IdempotencyLayer<S> {
    /// The methods the layer applies to; others pass through with no store
    /// call.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// With `true`, answer `400 idempotency_key_missing` to keyless
    /// requests of the configured methods (default `false`: they pass
    /// through unprotected).
    pub fn require_key(self, required: bool) -> Self {
        self.with(|c| c.require_key = required)
    }
}

/// Whose records: the tenant of a request, and how scopes are hashed.
impl<S: Store> IdempotencyLayer<S> {
    /// Where the tenant comes from. See [`crate::tenant`].
    pub fn tenant(self, extractor: impl TenantExtractor) -> Self {
        let extractor: Arc<dyn TenantExtractor> = Arc::new(extractor);
        self.with(|c| {
            c.tenant = extractor;
            c.tenant_chosen = true;
        })
    }

    /// With `true`, keyed requests without a tenant share one anonymous
    /// tenant instead of getting `401 idempotency_tenant_missing` (default
    /// `false`).
    pub fn allow_anonymous(self, allowed: bool) -> Self {
        self.with(|c| c.allow_anonymous = allowed)
    }

    /// Keys every scope hash (the record's identity in the store) with
    /// `secret`, HMAC-SHA256 as IDEM-01 asks: without the secret, nobody can
    /// compute where a scope's record lives, aim keys at one shard or
    /// table bucket, or test a guessed tenant against the store. Give every
    /// instance sharing a store the same secret (like a database password).
    ///
    /// Default: unkeyed (SHA-256), the form of every earlier version. The
    /// two forms give every scope a different identity, so switching an
    /// existing deployment makes the records written before the switch
    /// unreachable: a retry of a request made before it runs again. Switch
    /// in a new deployment, or when no retry of an
    /// earlier request can come any more; never with instances of both
    /// kinds on one store. A memory store lives in its process only, so it
    /// can take a new secret at every start.
    ///
    /// ```
    /// use idem_layer::{IdempotencyLayer, ScopeSecret};
    /// use idem_memory::MemoryStore;
    ///
    /// let secret = ScopeSecret::new(b"32 random bytes from your vault..").expect("16 bytes or more");
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope_secret(secret);
    /// ```
    pub fn scope_secret(self, secret: idem_core::ScopeSecret) -> Self {
        self.with(|c| c.scope_secret = Some(secret))
    }

    /// The hash function of scope hashes (default
    /// [`ScopeFormat::Sha256`](crate::ScopeFormat)). BLAKE3 takes about
    /// a tenth of SHA-256's instructions on CPUs without SHA extensions,
    /// keyed or not. Like [`scope_secret`](Self::scope_secret), it gives
    /// every scope another identity: choose it when a deployment starts
    /// (or for a memory store, at any start), on every instance sharing
    /// the store; switching an existing deployment makes the records
    /// written before the switch unreachable, and a retry of an earlier
    /// request runs again.
    pub fn scope_format(self, format: crate::ScopeFormat) -> Self {
        self.with(|c| c.scope_format = format)
    }
}

/// When two requests are the same: the fingerprint, and the request body it reads.
impl<S: Store> IdempotencyLayer<S> {
    /// The headers included in the fingerprint (default `content-type`).
    pub fn fingerprint_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let headers = headers.into_iter().collect();
        self.with(|c| c.fingerprint_headers = headers)
    }

    /// The hash the default fingerprint writes new records with (default
    /// [`FingerprintFormat::Sha256`](crate::fingerprint::FingerprintFormat)).
    /// Whatever it is set to, a request whose record was written in the
    /// other format still replays: a reservation that meets another
    /// fingerprint is tried once more in the other format before the layer
    /// answers `422` (one more store call, on conflicts only). Versions
    /// before this one read only SHA-256, so set
    /// [`Blake3`](crate::fingerprint::FingerprintFormat::Blake3) once
    /// every instance sharing the store runs this version. A
    /// [`fingerprint_fn`](Self::fingerprint_fn) replaces both.
    pub fn fingerprint_format(self, format: crate::fingerprint::FingerprintFormat) -> Self {
        self.with(|c| c.fingerprint_format = format)
    }

    /// Keys the default fingerprint with a key derived from `secret`
    /// (HKDF-SHA256 under a label of its own; HMAC-SHA256 over the
    /// SHA-256 fingerprint, BLAKE3's keyed hash over a BLAKE3 one): a
    /// record's fingerprint no longer lets whoever reads the store confirm
    /// a guess of a short request body by hashing it. Records written
    /// before (unkeyed) still replay: a reservation that meets another
    /// fingerprint is tried unkeyed, then in the other format, before the
    /// layer answers `422` (store calls on conflicts only). Instances of
    /// a version before this one do not key theirs: a retry of a keyed
    /// record that reaches one gets `422` (never a second run), so key
    /// fingerprints once every instance sharing the store runs this
    /// version. Use a secret of at least 32 random bytes, the same on
    /// every instance.
    pub fn fingerprint_secret(self, secret: impl AsRef<[u8]>) -> Self {
        let key = fingerprint_key(secret.as_ref());
        self.with(|c| {
            c.fingerprint_key = Some(key);
            c.fingerprint_keyed = true;
        })
    }

    /// Writes fingerprints unkeyed, and still reads records whose
    /// fingerprints were keyed with `secret` (see
    /// [`fingerprint_secret`](Self::fingerprint_secret)): how keying is
    /// turned off without a `422` for a retry of a record keyed before.
    pub fn fingerprint_secret_for_reading(self, secret: impl AsRef<[u8]>) -> Self {
        let key = fingerprint_key(secret.as_ref());
        self.with(|c| {
            c.fingerprint_key = Some(key);
            c.fingerprint_keyed = false;
        })
    }

    /// Replaces the default fingerprint: `f(operation, request head, body)`.
    pub fn fingerprint_fn(
        self,
        f: impl Fn(&str, &Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        let f: Arc<FingerprintFn> = Arc::new(f);
        self.with(|c| c.fingerprint_fn = Some(f))
    }

    /// The largest request body read for a keyed request (default 1 MiB);
    /// beyond it: `413 request_body_too_large`, handler not run.
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// How long a keyed request's body may take to arrive (default 30 s);
    /// beyond it: `408 request_body_timeout`, handler not run, nothing
    /// reserved. Protects against bodies that never end.
    pub fn body_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.body_timeout = timeout)
    }
}

/// How long: the lease, the retention, duplicates in flight, unknown outcomes and
/// clients that leave.
impl<S: Store> IdempotencyLayer<S> {
    /// The lease length (default 30 s), renewed every third while the
    /// handler runs.
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = lease)
    }

    /// How long records are kept (default 24 h). Must exceed the longest
    /// retry horizon of your clients, and the lease.
    pub fn retention(self, retention: Duration) -> Self {
        self.with(|c| c.retention = retention)
    }

    /// How duplicates in flight are answered.
    pub fn in_flight(self, mode: InFlight) -> Self {
        self.with(|c| c.in_flight = mode)
    }

    /// How long the layer keeps waiting, in the background and renewing
    /// the lease, for the late answer of a request whose outcome is unknown
    /// (default 60 s). See [`UnknownOutcome`](crate::UnknownOutcome).
    pub fn unknown_outcome_wait(self, bound: Duration) -> Self {
        self.with(|c| c.unknown_wait = bound)
    }

    /// What a client disconnect does to the running handler.
    pub fn on_disconnect(self, mode: OnDisconnect) -> Self {
        self.with(|c| c.on_disconnect = mode)
    }
}

/// What is stored and replayed: which outcomes, how large, which headers.
impl<S: Store> IdempotencyLayer<S> {
    /// Adds a header to every refusal that tells a client whether to retry
    /// (`true` or `false`, see [`should_retry`](crate::problem::should_retry)),
    /// under the name common SDKs read (`Stripe-Should-Retry`,
    /// `x-should-retry`). Off by default.
    pub fn should_retry_header(self, name: HeaderName) -> Self {
        self.with(|c| c.should_retry_header = Some(name))
    }

    /// With `true`, every refusal's problem document also carries the
    /// member common SDKs read (Stripe's among them), beside RFC 9457's:
    /// `"error": {"type": "idempotency_error", "code": …, "message": …}`
    /// (see [`with_error_member`](crate::problem::with_error_member)). Off
    /// by default.
    pub fn error_member(self, on: bool) -> Self {
        self.with(|c| c.error_member = on)
    }

    /// The switch that makes this layer refuse every protected request
    /// (`503 idempotency_store_unavailable`, nothing run) once thrown: give
    /// the one [`keep_claimed_guarded`](crate::keep_claimed_guarded) throws
    /// when the store, unreachable at start, turns out to belong to
    /// instances that derive record identities otherwise
    /// ([`keep_store_claimed`](Self::keep_store_claimed) uses the layer's
    /// own).
    pub fn store_guard(self, guard: crate::config::StoreGuard) -> Self {
        self.with(|c| c.store_guard = guard)
    }

    /// How HTTP answers are classified: stored, released or unknown, by
    /// status and by who produced them (see [`classify`](crate::classify)).
    /// The default is [`default_http_verdict`](crate::classify::default_http_verdict).
    pub fn classify_http(
        self,
        classifier: impl Fn(StatusCode, Producer) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        let classifier: crate::classify::HttpClassifier = Arc::new(classifier);
        self.with(|c| c.classify.http = classifier)
    }

    /// How gRPC answers are classified, by `grpc-status` (`None` when the
    /// answer has none) and by who produced them. A gRPC failure travels
    /// as HTTP 200, so gRPC answers are judged by this, not
    /// [`classify_http`](Self::classify_http). The default is
    /// [`default_grpc_verdict`](crate::classify::default_grpc_verdict).
    pub fn classify_grpc(
        self,
        classifier: impl Fn(Option<u32>, Producer) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        let classifier: crate::classify::GrpcClassifier = Arc::new(classifier);
        self.with(|c| c.classify.grpc = classifier)
    }

    /// Which handler statuses are stored and replayed; the others release
    /// the key. See [`default_should_store`](crate::default_should_store).
    ///
    /// The earlier, two-way form of [`classify_http`](Self::classify_http),
    /// kept as a migration path: it decides a handler's answers exactly as
    /// before; an upstream's `502` and `504` (an answer marked
    /// [`RemoteAnswer`](crate::classify::RemoteAnswer)) stay unknown.
    pub fn store_outcome_if(
        self,
        predicate: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        let classifier = crate::classify::Classifier::http_from_bool(Arc::new(predicate));
        self.with(|c| c.classify.http = classifier)
    }

    /// Which gRPC statuses (`grpc-status`, as a number) of a gRPC answer
    /// are stored and replayed; the others release the key.
    ///
    /// The earlier, two-way form of [`classify_grpc`](Self::classify_grpc),
    /// kept as a migration path: a handler's answers are decided exactly as
    /// before (one without `grpc-status` releases); an upstream's
    /// deadline, cancellation, `UNKNOWN`, `INTERNAL`, `DATA_LOSS` or
    /// missing status stays unknown. See
    /// [`default_grpc_should_store`](crate::grpc::default_grpc_should_store).
    pub fn grpc_should_store(
        self,
        predicate: impl Fn(u32) -> bool + Send + Sync + 'static,
    ) -> Self {
        let classifier = crate::classify::Classifier::grpc_from_bool(Arc::new(predicate));
        self.with(|c| c.classify.grpc = classifier)
    }

    /// The largest response stored for replay (default 1 MiB). A larger
    /// response reaches the first caller; retries get
    /// `409 idempotency_response_not_stored` and the handler is not run
    /// again.
    pub fn max_response(self, bytes: usize) -> Self {
        self.with(|c| c.max_response = bytes)
    }

    /// Response headers never stored nor replayed. See
    /// [`default_replay_denylist`].
    pub fn replay_denylist(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let headers = headers.into_iter().collect();
        self.with(|c| c.replay_denylist = headers)
    }
}

/// The replay cache's default size: 16 MiB.
pub const DEFAULT_REPLAY_CACHE_BYTES: usize = 16 << 20;
/// The longest a replay cache's entry lives by default: a minute, where the
/// store has a push channel that tells every process of an erasure (the
/// memory store, a single Redis node, PostgreSQL reached directly; see
/// [`Store::erasures`](idem_core::Store::erasures)). Where it has none, or
/// while it is unhealthy, copies live at most a second, or none are kept
/// (`docs/design.md`, section 3).
pub const DEFAULT_REPLAY_CACHE_BOUND: Duration = Duration::from_secs(60);

/// Storms of retries: the replay cache.
impl<S: Store> IdempotencyLayer<S> {
    /// Keeps the completed records this process is answered with, up to
    /// `bytes` of responses, each for at most `bound` and never past the
    /// record's expiry (default 16 MiB and 60 s; `0` turns it off): a
    /// retry of a completed key is then replayed without a store call, as
    /// the store would replay it (a completed record does not change until
    /// it expires), and a request with another payload still goes to the
    /// store (422). A store that does not say when its records expire gets
    /// nothing kept. A record erased through another process stops being
    /// replayed here within about a second where the store has a push
    /// channel ([`Store::erasures`](idem_core::Store::erasures)); copies are
    /// kept only while that channel is healthy, and all are dropped when
    /// it is lost. Where the store has none (Redis Cluster, PostgreSQL
    /// behind a transaction pooler), `bound` is capped to 1 s, the longest
    /// such an erasure goes unseen. A record the store lost stays
    /// replayable for as long, which is the safe side. Duplicates of one
    /// key that arrive together share one reservation, cache or not
    /// (`idem_store_calls_saved_total` counts both).
    pub fn replay_cache(self, bytes: usize, bound: Duration) -> Self {
        self.with(|c| c.replay_cache = (bytes, bound))
    }
}

/// When the store fails: its timeout, and fail-open.
impl<S: Store> IdempotencyLayer<S> {
    /// The timeout of every store call (default 1 s). A store that bounds
    /// its own calls within it ([`Store::call_bound`](idem_core::Store::call_bound):
    /// `idem-redis` does, with its own timeout) is trusted to end them,
    /// and the layer arms no second timer for them.
    pub fn store_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.store_timeout = timeout)
    }

    /// With `true`, run the handler without protection when the store
    /// cannot be reached or times out (counted as `fail_open`), instead of
    /// `503 idempotency_store_unavailable` (default `false`).
    pub fn fail_open(self, open: bool) -> Self {
        self.with(|c| c.fail_open = open)
    }

    /// Seals every response this layer stores with `keyring` (the
    /// current key), and opens sealed records with any of its keys: the
    /// store holds the status and a ciphertext, never the response's
    /// headers or body. Records stored without sealing still replay. A
    /// sealed record that does not open is never replayed (503). See
    /// [`sealing`](crate::sealing).
    ///
    /// ```
    /// use idem_layer::{IdempotencyLayer, sealing::Keyring};
    /// use idem_memory::MemoryStore;
    ///
    /// let keyring = Keyring::derived(b"the deployment secret from your vault");
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).sealing(keyring);
    /// ```
    pub fn sealing(self, keyring: crate::sealing::Keyring) -> Self {
        self.with(|c| {
            c.sealing = Some(keyring);
            c.seal_new = true;
        })
    }

    /// Opens records sealed with `keyring`'s keys, and stores new
    /// responses in clear: how sealing is turned off without losing the
    /// records sealed before. Without a keyring, a sealed record is never
    /// replayed (503).
    pub fn unsealing(self, keyring: crate::sealing::Keyring) -> Self {
        self.with(|c| {
            c.sealing = Some(keyring);
            c.seal_new = false;
        })
    }
}

/// Answers and operators: problem documents and the records API's admin credential.
impl<S: Store> IdempotencyLayer<S> {
    /// The base of every problem's `type` (default `urn:idem:problem:`):
    /// with `"https://docs.example.com/errors/"` a conflict's `type` is
    /// `https://docs.example.com/errors/idempotency_conflict`, so that
    /// errors link to documentation, as the IETF draft asks.
    pub fn problem_type_base(self, base: impl Into<String>) -> Self {
        let base: Arc<str> = Arc::from(base.into());
        self.with(|c| c.problem_type_base = Some(base))
    }

    /// Replaces problem answers (of the layer and of its records API):
    /// `hook` gets each [`Problem`](crate::Problem) and answers the response
    /// to send instead, or `None` to keep idem's own. Whatever it answers,
    /// the outcome stays the same: a refused request was not executed.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::Response;
    /// use idem_layer::{IdempotencyLayer, Problem};
    /// use idem_memory::MemoryStore;
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).problem_hook(|problem: &Problem| {
    ///     let body = format!("{{\"error\":\"{}\"}}", problem.code.as_str());
    ///     Response::builder()
    ///         .status(problem.status)
    ///         .header("content-type", "application/json")
    ///         .body(Bytes::from(body))
    ///         .ok()
    /// });
    /// ```
    pub fn problem_hook(
        self,
        hook: impl Fn(&crate::Problem) -> Option<http::Response<bytes::Bytes>> + Send + Sync + 'static,
    ) -> Self {
        let hook: Arc<ProblemHook> = Arc::new(hook);
        self.with(|c| c.problem_hook = Some(hook))
    }

    /// Where the [records API](crate::records) is mounted
    /// (`/_idempotency/records`, say): a `422` or `409` then links the
    /// record its key collided with, in its `record.href`, as the caller
    /// reads it there (its own tenant). Without it the answer still says
    /// the record's state (and for a `422` when it was first seen).
    pub fn records_path(self, path: impl Into<String>) -> Self {
        let path: Arc<str> = Arc::from(path.into());
        self.with(|c| c.records_path = Some(path))
    }

    /// An admin credential for the records API: a request whose
    /// `x-idem-admin-token` header carries it may list every tenant's
    /// records and act on another tenant's (`tenant=`). Keep it as secret
    /// as a database password.
    pub fn records_admin_token(self, token: impl AsRef<[u8]>) -> Self {
        use sha2::Digest;
        let digest: [u8; 32] = sha2::Sha256::digest(token.as_ref()).into();
        self.with(|c| c.admin_token = Some(digest))
    }

    /// Lets a caller fetch the stored answer of its own record by its key
    /// alone, without resending the payload (off by default): `GET` on the
    /// records API with `output=true` (see [`records`](crate::records)).
    ///
    /// Off, the payload's fingerprint works as a capability: only a caller
    /// holding the payload gets the answer. On, anyone who can act as the
    /// tenant and knows the key gets it. Turn it on only where keys are
    /// random and never shown to others in the tenant, and a tenant is one
    /// principal (a user or a service's own credential, not a header value
    /// several callers share). The anonymous tenant is always refused, and
    /// so is `tenant=` (the admin credential reads records, not answers).
    pub fn output_by_key(self, on: bool) -> Self {
        self.with(|c| c.output_by_key = on)
    }

    /// Lets a tenant release its own processing records through the
    /// records API (`action=release`) without the admin credential (off by
    /// default). A release frees the key while the attempt that held it
    /// may still run, so a retry may run beside it: an operator's act,
    /// once the owner is known to be gone. Turn it on only where a tenant
    /// is trusted to judge that for its own records.
    pub fn tenant_release(self, allowed: bool) -> Self {
        self.with(|c| c.tenant_release = allowed)
    }
}

impl<S: RecordsAdmin> IdempotencyLayer<S> {
    /// The records API (GET and DELETE) on the same store and tenant
    /// extractor. Mount it at a path of your choice, for example
    /// `Router::route_service("/_idempotency/records", layer.records_service())`.
    pub fn records_service(&self) -> RecordsService<S> {
        RecordsService::new(self.runtime.clone())
    }
}

impl<S: Store, I> Layer<I> for IdempotencyLayer<S> {
    type Service = Idempotency<I, S>;

    fn layer(&self, inner: I) -> Self::Service {
        // Validated (and an invalid configuration logged) once, not at
        // every application: a router may apply the layer per request.
        let valid = *self
            .runtime
            .valid
            .get_or_init(|| match self.runtime.config.validate() {
                Ok(()) => true,
                Err(error) => {
                    tracing::error!(
                        %error,
                        "invalid idempotency layer configuration; requests of protected methods are refused"
                    );
                    false
                }
            });
        Idempotency::new(inner, self.runtime.clone(), !valid)
    }
}

/// The key of keyed fingerprints that `secret` gives (HKDF-SHA256 under a
/// label of its own).
fn fingerprint_key(secret: &[u8]) -> [u8; 32] {
    let mut key = [0; 32];
    // 32 bytes is far below HKDF-SHA256's limit.
    let _ =
        hkdf::Hkdf::<sha2::Sha256>::new(None, secret).expand(b"idem fingerprint key v1", &mut key);
    key
}
