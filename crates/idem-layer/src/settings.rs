//! The layer's settings by concept: each group is a value of its own,
//! documented here in one place with the contract's defaults. The layer
//! changes a group as it holds it through one setter per group
//! ([`IdempotencyLayer::timing`](crate::IdempotencyLayer::timing),
//! [`fingerprints`](crate::IdempotencyLayer::fingerprints),
//! [`answers`](crate::IdempotencyLayer::answers),
//! [`problems`](crate::IdempotencyLayer::problems),
//! [`records`](crate::IdempotencyLayer::records)): a closure gets the
//! group (the defaults, or what an earlier call set) and answers it
//! changed, so setters of one group never undo each other.
//! [`sealing`](crate::IdempotencyLayer::sealing) is one choice, not a
//! group of settings: it takes a [`Sealing`] (or a [`Keyring`], which
//! seals) and replaces the layer's.
//!
//! ```
//! use std::time::Duration;
//!
//! use idem_layer::{IdempotencyLayer, InFlight, settings::Timing};
//! use idem_memory::MemoryStore;
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .timing(|t| {
//!         t.lease(Duration::from_secs(10))
//!             .retention(Duration::from_secs(3600))
//!             .in_flight(InFlight::Wait(Duration::from_secs(5)))
//!     })
//!     .fingerprints(|f| f.max_body(64 * 1024))
//!     .answers(|a| a.max_response(256 * 1024));
//! assert!(layer.validate().is_ok());
//!
//! // A group built beforehand replaces the layer's.
//! let timing = Timing::default().lease(Duration::from_secs(5));
//! let layer = layer.timing(|_| timing);
//! assert!(layer.validate().is_ok());
//! ```

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, StatusCode, header, request::Parts};
use idem_core::Fingerprint;

use crate::{
    classify::{Classifier, GrpcClassifier, HttpClassifier, Producer, Verdict},
    fingerprint::{FingerprintFn, FingerprintFormat},
    headers::HOP_BY_HOP,
    problem::ProblemHook,
    sealing::Keyring,
};

/// What to do with a duplicate that arrives while the first is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Answer `409 idempotency_in_progress` with `Retry-After` at once.
    Reject,
    /// Wait up to this long for the outcome and replay it; answer 409 when
    /// the bound passes.
    Wait(Duration),
}

/// What to do when the client disconnects while the handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDisconnect {
    /// Keep running the handler to completion, in a task of its own once
    /// the client is gone, and record its outcome, so a retry is replayed
    /// (the default: the lost-acknowledgement case). A request whose client
    /// goes away before its handler started (while its body arrives, its
    /// key is reserved, or it waits as a duplicate) is dropped: nothing of
    /// it runs on.
    Detach,
    /// Drop the handler and release the reservation, so a retry executes
    /// again.
    Release,
}

/// The headers never replayed: [`HOP_BY_HOP`], `Date`, `Set-Cookie`,
/// `Set-Cookie2` (RFC 2965's, which some clients still read) and
/// `Content-Length` (recomputed from the stored body).
pub fn default_replay_denylist() -> Vec<HeaderName> {
    let mut denied = HOP_BY_HOP.to_vec();
    denied.extend([
        header::DATE,
        header::SET_COOKIE,
        HeaderName::from_static("set-cookie2"),
        header::CONTENT_LENGTH,
    ]);
    denied
}

/// How long things last and may take.
///
/// | setting | default |
/// |---|---|
/// | [`lease`](Self::lease) | 30 s, renewed every third while the handler runs |
/// | [`retention`](Self::retention) | 24 h |
/// | [`store_timeout`](Self::store_timeout) | 1 s per store call |
/// | [`body_timeout`](Self::body_timeout) | 30 s to receive a keyed body (then 408) |
/// | [`in_flight`](Self::in_flight) | [`InFlight::Reject`] |
/// | [`unknown_outcome_wait`](Self::unknown_outcome_wait) | 60 s |
/// | [`on_disconnect`](Self::on_disconnect) | [`OnDisconnect::Detach`] |
#[derive(Debug, Clone)]
pub struct Timing {
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) body_timeout: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) unknown_wait: Duration,
    pub(crate) on_disconnect: OnDisconnect,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            store_timeout: Duration::from_secs(1),
            body_timeout: Duration::from_secs(30),
            in_flight: InFlight::Reject,
            unknown_wait: Duration::from_secs(60),
            on_disconnect: OnDisconnect::Detach,
        }
    }
}

impl Timing {
    /// The lease length, renewed every third while the handler runs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long records are kept. Must exceed the longest retry horizon
    /// of your clients, and the lease.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The timeout of every store call. A store that bounds its own calls
    /// within it ([`Store::call_bound`](idem_core::Store::call_bound):
    /// `idem-redis` does, with its own timeout) is trusted to end them,
    /// and the layer arms no second timer for them.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// How long a keyed request's body may take to arrive; beyond it:
    /// `408 request_body_timeout`, handler not run, nothing reserved.
    /// Protects against bodies that never end. Zero is a configuration
    /// error ([`ConfigError::Zero`](crate::ConfigError::Zero)).
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }

    /// How duplicates in flight are answered.
    pub fn in_flight(mut self, mode: InFlight) -> Self {
        self.in_flight = mode;
        self
    }

    /// How long the layer keeps waiting, in the background and renewing
    /// the lease, for the late answer of a request whose outcome is
    /// unknown. See [`UnknownOutcome`](crate::UnknownOutcome).
    pub fn unknown_outcome_wait(mut self, bound: Duration) -> Self {
        self.unknown_wait = bound;
        self
    }

    /// What a client disconnect does to the running handler.
    pub fn on_disconnect(mut self, mode: OnDisconnect) -> Self {
        self.on_disconnect = mode;
        self
    }
}

/// When two requests are the same: the fingerprint, and the request body
/// it reads.
///
/// | setting | default |
/// |---|---|
/// | [`headers`](Self::headers) | `content-type` |
/// | [`format`](Self::format) | SHA-256 (both formats read) |
/// | [`secret`](Self::secret) | unkeyed |
/// | [`function`](Self::function) | the default fingerprint |
/// | [`max_body`](Self::max_body) | 1 MiB (then 413) |
#[derive(Clone)]
pub struct Fingerprints {
    pub(crate) headers: Vec<HeaderName>,
    pub(crate) format: FingerprintFormat,
    /// The key of keyed fingerprints, when they are keyed or read keyed.
    pub(crate) key: Option<[u8; 32]>,
    /// Whether new records get keyed fingerprints (else the key only
    /// reads records keyed before).
    pub(crate) keyed: bool,
    pub(crate) function: Option<Arc<FingerprintFn>>,
    pub(crate) max_body: usize,
}

impl Default for Fingerprints {
    fn default() -> Self {
        Self {
            headers: vec![header::CONTENT_TYPE],
            format: FingerprintFormat::Sha256,
            key: None,
            keyed: false,
            function: None,
            max_body: 1024 * 1024,
        }
    }
}

impl fmt::Debug for Fingerprints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fingerprints")
            .field("headers", &self.headers)
            .field("format", &self.format)
            .field("keyed", &self.keyed)
            .field("reads_keyed", &self.key.is_some())
            .field("function", &self.function.is_some())
            .field("max_body", &self.max_body)
            .finish()
    }
}

impl Fingerprints {
    /// The headers included in the fingerprint.
    pub fn headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.headers = headers.into_iter().collect();
        self
    }

    /// The hash the default fingerprint writes new records with.
    /// Whatever it is set to, a request whose record was written in the
    /// other format still replays: a reservation that meets another
    /// fingerprint is tried once more in the other format before the layer
    /// answers `422` (one more store call, on conflicts only). Versions
    /// before this one read only SHA-256, so set
    /// [`Blake3`](FingerprintFormat::Blake3) once every instance sharing
    /// the store runs this version. A [`function`](Self::function)
    /// replaces both.
    pub fn format(mut self, format: FingerprintFormat) -> Self {
        self.format = format;
        self
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
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.key = Some(fingerprint_key(secret.as_ref()));
        self.keyed = true;
        self
    }

    /// Writes fingerprints unkeyed, and still reads records whose
    /// fingerprints were keyed with `secret` (see [`secret`](Self::secret)):
    /// how keying is turned off without a `422` for a retry of a record
    /// keyed before.
    pub fn secret_for_reading(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.key = Some(fingerprint_key(secret.as_ref()));
        self.keyed = false;
        self
    }

    /// Replaces the default fingerprint: `f(operation, request head, body)`.
    pub fn function(
        mut self,
        f: impl Fn(&str, &Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.function = Some(Arc::new(f));
        self
    }

    /// The fingerprint of a request of `operation` with this head, over
    /// `printed` (its body, or what the protocol fingerprints of it).
    pub(crate) fn of(&self, operation: &str, parts: &Parts, printed: &[u8]) -> Fingerprint {
        match &self.function {
            Some(f) => f(operation, parts, printed),
            None => self.format.of(
                self.key.as_ref().filter(|_| self.keyed),
                operation,
                parts,
                &self.headers,
                printed,
            ),
        }
    }

    /// The largest request body read for a keyed request; beyond it:
    /// `413 request_body_too_large`, handler not run.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }
}

/// The key of keyed fingerprints, derived from a secret.
fn fingerprint_key(secret: &[u8]) -> [u8; 32] {
    let mut key = [0; 32];
    // 32 bytes is far below HKDF-SHA256's limit.
    let _ =
        hkdf::Hkdf::<sha2::Sha256>::new(None, secret).expand(b"idem fingerprint key v1", &mut key);
    key
}

/// What is stored and replayed, per protocol: how an answer's outcome is
/// classified (HTTP by status, gRPC by `grpc-status`), how large a
/// response is stored, and which headers never are.
///
/// | setting | default |
/// |---|---|
/// | [`classify_http`](Self::classify_http) | [`default_http_verdict`](crate::classify::default_http_verdict) |
/// | [`classify_grpc`](Self::classify_grpc) | [`default_grpc_verdict`](crate::classify::default_grpc_verdict) |
/// | [`max_response`](Self::max_response) | 1 MiB (larger responses are not stored) |
/// | [`replay_denylist`](Self::replay_denylist) | [`default_replay_denylist`] |
#[derive(Clone)]
pub struct Answers {
    pub(crate) classify: Classifier,
    pub(crate) max_response: usize,
    pub(crate) replay_denylist: Vec<HeaderName>,
}

impl Default for Answers {
    fn default() -> Self {
        Self {
            classify: Classifier::default(),
            max_response: 1024 * 1024,
            replay_denylist: default_replay_denylist(),
        }
    }
}

impl fmt::Debug for Answers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Answers")
            .field("max_response", &self.max_response)
            .field("replay_denylist", &self.replay_denylist)
            .finish_non_exhaustive()
    }
}

impl Answers {
    /// How HTTP answers are classified: stored, released or unknown, by
    /// status and by who produced them (see [`classify`](crate::classify)).
    pub fn classify_http(
        mut self,
        classifier: impl Fn(StatusCode, Producer) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        let classifier: HttpClassifier = Arc::new(classifier);
        self.classify.http = classifier;
        self
    }

    /// How gRPC answers are classified, by `grpc-status` (`None` when the
    /// answer has none) and by who produced them. A gRPC failure travels
    /// as HTTP 200, so gRPC answers are judged by this, not
    /// [`classify_http`](Self::classify_http).
    pub fn classify_grpc(
        mut self,
        classifier: impl Fn(Option<u32>, Producer) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        let classifier: GrpcClassifier = Arc::new(classifier);
        self.classify.grpc = classifier;
        self
    }

    /// Which handler statuses are stored and replayed; the others release
    /// the key. See [`default_should_store`](crate::default_should_store).
    ///
    /// The earlier, two-way form of [`classify_http`](Self::classify_http),
    /// kept as a migration path: it decides a handler's answers exactly as
    /// before; an upstream's `502` and `504` (an answer marked
    /// [`RemoteAnswer`](crate::classify::RemoteAnswer)) stay unknown.
    pub fn store_outcome_if(
        mut self,
        predicate: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.classify.http = Classifier::http_from_bool(Arc::new(predicate));
        self
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
        mut self,
        predicate: impl Fn(u32) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.classify.grpc = Classifier::grpc_from_bool(Arc::new(predicate));
        self
    }

    /// The largest response stored for replay. A larger response reaches
    /// the first caller; retries get `409 idempotency_response_not_stored`
    /// and the handler is not run again.
    pub fn max_response(mut self, bytes: usize) -> Self {
        self.max_response = bytes;
        self
    }

    /// Response headers never stored nor replayed.
    pub fn replay_denylist(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_denylist = headers.into_iter().collect();
        self
    }
}

/// Stored responses sealed at rest (see [`sealing`](crate::sealing)): off
/// by default.
///
/// * [`Sealing::seal`] (also what a [`Keyring`] converts into): every
///   response the layer stores is sealed with the keyring's current key,
///   and sealed records open with any of its keys; the store holds the
///   status and a ciphertext, never the response's headers or body.
///   Records stored without sealing still replay.
/// * [`Sealing::open_only`]: sealed records open with the keyring's keys,
///   and new responses are stored in clear: how sealing is turned off
///   without losing the records sealed before.
///
/// A sealed record that does not open is never replayed (503); without a
/// keyring, neither is any sealed record.
///
/// ```
/// use idem_layer::{IdempotencyLayer, sealing::Keyring};
/// use idem_memory::MemoryStore;
///
/// let keyring = Keyring::derived(b"the deployment secret from your vault");
/// let layer = IdempotencyLayer::new(MemoryStore::new()).sealing(keyring);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Sealing {
    pub(crate) keyring: Option<Keyring>,
    /// Whether new responses are sealed (else the keyring only opens).
    pub(crate) seal_new: bool,
}

impl Sealing {
    /// Responses kept as they are, and no sealed record opened (the
    /// default).
    pub fn off() -> Self {
        Self::default()
    }

    /// New responses sealed with `keyring`, sealed records opened with it.
    pub fn seal(keyring: Keyring) -> Self {
        Self {
            keyring: Some(keyring),
            seal_new: true,
        }
    }

    /// New responses stored in clear, sealed records opened with
    /// `keyring`.
    pub fn open_only(keyring: Keyring) -> Self {
        Self {
            keyring: Some(keyring),
            seal_new: false,
        }
    }
}

impl From<Keyring> for Sealing {
    /// [`Sealing::seal`].
    fn from(keyring: Keyring) -> Self {
        Self::seal(keyring)
    }
}

/// How refusals are written: the problem documents of the layer and of
/// its records API. All off by default: `type` is `urn:idem:problem:<code>`
/// and the document is RFC 9457's with idem's `code`.
#[derive(Clone, Default)]
pub struct Problems {
    pub(crate) type_base: Option<Arc<str>>,
    pub(crate) hook: Option<Arc<ProblemHook>>,
    /// The header that tells a client whether to retry after a refusal
    /// (`Stripe-Should-Retry`, say), if one is set.
    pub(crate) should_retry_header: Option<HeaderName>,
    /// Whether refusals carry the `error` member SDKs read.
    pub(crate) error_member: bool,
}

impl fmt::Debug for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Problems")
            .field("type_base", &self.type_base)
            .field("hook", &self.hook.is_some())
            .field("should_retry_header", &self.should_retry_header)
            .field("error_member", &self.error_member)
            .finish()
    }
}

impl Problems {
    /// Whether any of these changes a problem answer.
    pub(crate) fn shape(&self) -> bool {
        self.type_base.is_some()
            || self.hook.is_some()
            || self.should_retry_header.is_some()
            || self.error_member
    }

    /// The base of every problem's `type`: with
    /// `"https://docs.example.com/errors/"` a conflict's `type` is
    /// `https://docs.example.com/errors/idempotency_conflict`, so that
    /// errors link to documentation, as the IETF draft asks. It must be an
    /// absolute URI ([`check_type_base`](crate::problem::check_type_base));
    /// [`validate`](crate::IdempotencyLayer::validate) refuses another.
    pub fn type_base(mut self, base: impl Into<String>) -> Self {
        self.type_base = Some(Arc::from(base.into()));
        self
    }

    /// Replaces problem answers (of the layer and of its records API):
    /// `hook` gets each [`Problem`](crate::Problem) and answers the
    /// response to send instead, or `None` to keep idem's own. Whatever it
    /// answers, the outcome stays the same: a refused request was not
    /// executed.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::Response;
    /// use idem_layer::{IdempotencyLayer, Problem, settings::Problems};
    /// use idem_memory::MemoryStore;
    ///
    /// let problems = Problems::default().hook(|problem: &Problem| {
    ///     let body = format!("{{\"error\":\"{}\"}}", problem.code.as_str());
    ///     Response::builder()
    ///         .status(problem.status)
    ///         .header("content-type", "application/json")
    ///         .body(Bytes::from(body))
    ///         .ok()
    /// });
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).problems(|_| problems);
    /// ```
    pub fn hook(
        mut self,
        hook: impl Fn(&crate::Problem) -> Option<http::Response<bytes::Bytes>> + Send + Sync + 'static,
    ) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Adds a header to every refusal that tells a client whether to retry
    /// (`true` or `false`, see [`should_retry`](crate::problem::should_retry)),
    /// under the name common SDKs read (`Stripe-Should-Retry`,
    /// `x-should-retry`).
    pub fn should_retry_header(mut self, name: HeaderName) -> Self {
        self.should_retry_header = Some(name);
        self
    }

    /// With `true`, every refusal's problem document also carries the
    /// member common SDKs read (Stripe's among them), beside RFC 9457's:
    /// `"error": {"type": "idempotency_error", "code": …, "message": …}`
    /// (see [`with_error_member`](crate::problem::with_error_member)).
    pub fn error_member(mut self, on: bool) -> Self {
        self.error_member = on;
        self
    }
}

/// The [records API](crate::records): where it is mounted, who may act
/// on every tenant's records, and what a tenant may do with its own. All
/// off by default.
#[derive(Clone, Default)]
pub struct RecordsApi {
    /// Where the records API is mounted, for links to a record.
    pub(crate) path: Option<Arc<str>>,
    /// SHA-256 of the admin credential, if one is set.
    pub(crate) admin_token: Option<[u8; 32]>,
    pub(crate) output_by_key: bool,
    pub(crate) tenant_release: bool,
}

impl fmt::Debug for RecordsApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordsApi")
            .field("path", &self.path)
            .field("admin_token", &self.admin_token.is_some())
            .field("output_by_key", &self.output_by_key)
            .field("tenant_release", &self.tenant_release)
            .finish()
    }
}

impl RecordsApi {
    /// Where the records API is mounted (`/_idempotency/records`, say): a
    /// `422` or `409` then links the record its key collided with, in its
    /// `record.href`, as the caller reads it there (its own tenant), and
    /// the layer never applies itself to a request of that path. Without
    /// it the answer still says the record's state (and for a `422` when
    /// it was first seen).
    pub fn path(mut self, path: impl Into<String>) -> Self {
        self.path = Some(Arc::from(path.into()));
        self
    }

    /// An admin credential: a request whose `x-idem-admin-token` header
    /// carries it may list every tenant's records and act on another
    /// tenant's (`tenant=`). Keep it as secret as a database password.
    pub fn admin_token(mut self, token: impl AsRef<[u8]>) -> Self {
        use sha2::Digest;
        self.admin_token = Some(sha2::Sha256::digest(token.as_ref()).into());
        self
    }

    /// Lets a caller fetch the stored answer of its own record by its key
    /// alone, without resending the payload: `GET` with `output=true` (see
    /// [`records`](crate::records)).
    ///
    /// Off, the payload's fingerprint works as a capability: only a caller
    /// holding the payload gets the answer. On, anyone who can act as the
    /// tenant and knows the key gets it. Turn it on only where keys are
    /// random and never shown to others in the tenant, and a tenant is one
    /// principal (a user or a service's own credential, not a header value
    /// several callers share). The anonymous tenant is always refused, and
    /// so is `tenant=` (the admin credential reads records, not answers).
    pub fn output_by_key(mut self, on: bool) -> Self {
        self.output_by_key = on;
        self
    }

    /// Lets a tenant release its own processing records
    /// (`action=release`) without the admin credential. A release frees
    /// the key while the attempt that held it may still run, so a retry
    /// may run beside it: an operator's act, once the owner is known to be
    /// gone. Turn it on only where a tenant is trusted to judge that for
    /// its own records.
    pub fn tenant_release(mut self, allowed: bool) -> Self {
        self.tenant_release = allowed;
        self
    }
}
