//! [`IdempotencyLayer`] and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use http::Method;
use idem_core::{RecordsAdmin, Store};
use tower::Layer;

use crate::{
    Idempotency, RecordsService,
    config::{Config, ConfigError},
    runtime::Runtime,
    settings::{Answers, Fingerprints, Problems, RecordsApi, Sealing, Timing},
    tenant::{Tenant, TenantExtractor, TenantFromExtension},
};

/// Tower layer that makes requests carrying an `Idempotency-Key` safe to
/// retry.
///
/// Built with consuming setters: a few of its own, and the groups of
/// [`settings`](crate::settings), each documented there with its defaults
/// (every default follows the contract):
///
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | `POST`, `PATCH` |
/// | [`require_key`](Self::require_key) | off: keyless requests pass through |
/// | [`tenant`](Self::tenant) | the [`Tenant`] request extension |
/// | [`allow_anonymous`](Self::allow_anonymous) | off: 401 without a tenant |
/// | [`scope_secret`](Self::scope_secret), [`scope_format`](Self::scope_format) | unkeyed SHA-256 |
/// | [`replay_cache`](Self::replay_cache) | 16 MiB, an entry at most 60 s (`0`: none) |
/// | [`fail_open`](Self::fail_open) | off: 503 when the store fails |
/// | [`timing`](Self::timing) | [`Timing`]: a 30 s lease, 24 h retention, 1 s per store call, duplicates refused |
/// | [`fingerprints`](Self::fingerprints) | [`Fingerprints`]: `content-type` and the body up to 1 MiB, SHA-256, unkeyed |
/// | [`answers`](Self::answers) | [`Answers`]: the default classifiers, responses up to 1 MiB stored |
/// | [`sealing`](Self::sealing) | [`Sealing::off`] |
/// | [`problems`](Self::problems) | [`Problems`]: RFC 9457 documents, `urn:idem:problem:` types |
/// | [`records`](Self::records) | [`RecordsApi`]: no admin credential, no output by key |
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
            .field("timing", &self.runtime.config.timing)
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
            scope_secret: None,
            scope_format: crate::ScopeFormat::Sha256,
            fail_open: false,
            store_guard: crate::config::StoreGuard::default(),
            replay_cache: (DEFAULT_REPLAY_CACHE_BYTES, DEFAULT_REPLAY_CACHE_BOUND),
            timing: Timing::default(),
            fingerprints: Fingerprints::default(),
            answers: Answers::default(),
            sealing: Sealing::default(),
            problems: Problems::default(),
            records: RecordsApi::default(),
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
    /// ([`Fingerprints::format`], and a digest of
    /// the fingerprint key, when fingerprints are keyed or read keyed).
    /// Layers whose markers differ find no record of each other, or answer
    /// a genuine retry `422`, on one store. The marker is a keyed hash and
    /// a digest: it never shows a secret. It does not cover the tenant
    /// extractor, which the layer cannot see into.
    pub fn store_identity(&self) -> String {
        let config = &self.runtime.config;
        // The fingerprint key as a digest under a label of its own.
        let key = config.fingerprints.key.map(|key| {
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
            config.fingerprints.format,
            if config.fingerprints.keyed {
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

/// When the store fails, and who may cut it off.
impl<S: Store> IdempotencyLayer<S> {
    /// With `true`, run the handler without protection when the store
    /// cannot be reached or times out (counted as `fail_open`), instead of
    /// `503 idempotency_store_unavailable` (default `false`).
    pub fn fail_open(self, open: bool) -> Self {
        self.with(|c| c.fail_open = open)
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
}

/// The groups of settings (see [`settings`](crate::settings)): each
/// group's setter changes its group as the layer holds it (the defaults,
/// or what an earlier call set), `layer.timing(|t| t.lease(lease))`;
/// `|_| group` gives a group built beforehand. [`sealing`](Self::sealing)
/// takes its one choice as a value.
impl<S: Store> IdempotencyLayer<S> {
    /// How long things last and may take: the lease, the retention, the
    /// store timeout, the body timeout, duplicates in flight, unknown
    /// outcomes and clients that leave ([`Timing`]).
    pub fn timing(self, change: impl FnOnce(Timing) -> Timing) -> Self {
        self.with(|c| c.timing = change(std::mem::take(&mut c.timing)))
    }

    /// When two requests are the same: the fingerprint and the request
    /// body it reads ([`Fingerprints`]).
    pub fn fingerprints(self, change: impl FnOnce(Fingerprints) -> Fingerprints) -> Self {
        self.with(|c| c.fingerprints = change(std::mem::take(&mut c.fingerprints)))
    }

    /// What is stored and replayed: how HTTP and gRPC answers are
    /// classified, how large a stored response may be, which headers are
    /// never stored ([`Answers`]).
    pub fn answers(self, change: impl FnOnce(Answers) -> Answers) -> Self {
        self.with(|c| c.answers = change(std::mem::take(&mut c.answers)))
    }

    /// Stored responses sealed at rest, replacing the layer's choice
    /// ([`Sealing`]; a [`Keyring`](crate::sealing::Keyring) seals).
    pub fn sealing(self, sealing: impl Into<Sealing>) -> Self {
        let sealing = sealing.into();
        self.with(|c| c.sealing = sealing)
    }

    /// How refusals are written: problem documents ([`Problems`]).
    pub fn problems(self, change: impl FnOnce(Problems) -> Problems) -> Self {
        self.with(|c| c.problems = change(std::mem::take(&mut c.problems)))
    }

    /// The records API's settings ([`RecordsApi`]).
    pub fn records(self, change: impl FnOnce(RecordsApi) -> RecordsApi) -> Self {
        self.with(|c| c.records = change(std::mem::take(&mut c.records)))
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
