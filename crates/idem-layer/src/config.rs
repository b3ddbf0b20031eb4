//! The layer's settings: what may be configured, the defaults the
//! contract sets, and what a configuration may not be.

use std::{sync::Arc, time::Duration};

use http::{HeaderName, Method, header};

use crate::{
    fingerprint::FingerprintFn, headers::HOP_BY_HOP, problem::ProblemHook, tenant::TenantExtractor,
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

/// A configuration the layer refuses to start with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The retention must outlast the lease, or a record could vanish while
    /// its attempt still runs.
    #[error("retention ({retention:?}) must be longer than the lease ({lease:?})")]
    RetentionNotLongerThanLease {
        /// The configured retention.
        retention: Duration,
        /// The configured lease.
        lease: Duration,
    },
    /// A zero lease, store timeout or limit.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// A duration beyond [`MAX_DURATION`]: no clock arithmetic on it could
    /// be trusted.
    #[error("{0} must be at most 100 years")]
    TooLong(&'static str),
    /// The problem type base is not an absolute URI
    /// ([`check_type_base`](crate::problem::check_type_base)).
    #[error("the problem type base {0:?} is not an absolute URI: {1}")]
    ProblemTypeBase(String, &'static str),
}

/// The longest duration any setting accepts (100 years). Longer values are
/// refused at start, so that no deadline computed from them can overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) tenant: Arc<dyn TenantExtractor>,
    /// Whether [`tenant`](crate::IdempotencyLayer::tenant) chose the
    /// source (else it is the default: the `Tenant` request extension).
    pub(crate) tenant_chosen: bool,
    pub(crate) allow_anonymous: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) fingerprint_fn: Option<Arc<FingerprintFn>>,
    pub(crate) fingerprint_format: crate::fingerprint::FingerprintFormat,
    /// The key of keyed fingerprints, when they are keyed or read keyed.
    pub(crate) fingerprint_key: Option<[u8; 32]>,
    /// Whether new records get keyed fingerprints (else the key only
    /// reads records keyed before).
    pub(crate) fingerprint_keyed: bool,
    pub(crate) max_body: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) max_response: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) in_flight: InFlight,
    /// How answers are classified: stored, released or unknown.
    pub(crate) classify: crate::classify::Classifier,
    pub(crate) replay_denylist: Vec<HeaderName>,
    pub(crate) fail_open: bool,
    /// Seals stored responses at rest (see [`sealing`](crate::sealing)).
    pub(crate) sealing: Option<crate::sealing::Keyring>,
    /// Whether new responses are sealed (else the keyring only opens).
    pub(crate) seal_new: bool,
    pub(crate) store_timeout: Duration,
    /// Thrown when the store belongs to instances that derive record
    /// identities otherwise (found after a start the store was down for).
    pub(crate) store_guard: crate::config::StoreGuard,
    /// The header that tells a client whether to retry after a refusal
    /// (`Stripe-Should-Retry`, say), if one is set.
    pub(crate) should_retry_header: Option<HeaderName>,
    /// Whether refusals carry the `error` member SDKs read.
    pub(crate) error_member: bool,
    pub(crate) on_disconnect: OnDisconnect,
    pub(crate) unknown_wait: Duration,
    pub(crate) problem_type_base: Option<Arc<str>>,
    /// Where the records API is mounted, for links to a record.
    pub(crate) records_path: Option<Arc<str>>,
    pub(crate) problem_hook: Option<Arc<ProblemHook>>,
    /// SHA-256 of the records API's admin credential, if one is set.
    pub(crate) admin_token: Option<[u8; 32]>,
    /// Whether a caller may fetch its own stored answer by its key alone
    /// ([`IdempotencyLayer::output_by_key`](crate::IdempotencyLayer::output_by_key)).
    pub(crate) output_by_key: bool,
    /// Whether a tenant may release its own processing records without
    /// the admin credential ([`IdempotencyLayer::tenant_release`](crate::IdempotencyLayer::tenant_release)).
    pub(crate) tenant_release: bool,
    /// The key of scope hashes; none: unkeyed.
    pub(crate) scope_secret: Option<idem_core::ScopeSecret>,
    pub(crate) scope_format: idem_core::ScopeFormat,
    /// The replay cache's bytes and bound on an entry's life
    /// ([`IdempotencyLayer::replay_cache`](crate::IdempotencyLayer::replay_cache)).
    pub(crate) replay_cache: (usize, Duration),
}

impl Config {
    /// Whether problem answers are shaped (a type base or a hook is set).
    pub(crate) fn shapes_problems(&self) -> bool {
        self.problem_type_base.is_some()
            || self.problem_hook.is_some()
            || self.should_retry_header.is_some()
            || self.error_member
    }

    /// A problem answer with the configured type base and hook applied.
    pub(crate) fn shape<B>(
        &self,
        response: http::Response<crate::ResponseBody<B>>,
    ) -> http::Response<crate::ResponseBody<B>> {
        if !self.shapes_problems() {
            return response;
        }
        crate::problem::shape(
            self.problem_type_base.as_deref(),
            self.problem_hook.as_deref(),
            self.should_retry_header.as_ref(),
            self.error_member,
            response,
        )
    }
}

impl Config {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let wait = match self.in_flight {
            InFlight::Wait(bound) => bound,
            InFlight::Reject => Duration::ZERO,
        };
        for (name, value) in [
            ("the lease", self.lease),
            ("the retention", self.retention),
            ("the store timeout", self.store_timeout),
            ("the body timeout", self.body_timeout),
            ("the in-flight wait", wait),
            ("the unknown-outcome wait", self.unknown_wait),
        ] {
            if value > MAX_DURATION {
                return Err(ConfigError::TooLong(name));
            }
        }
        if self.lease.is_zero() {
            return Err(ConfigError::Zero("the lease"));
        }
        if self.store_timeout.is_zero() {
            return Err(ConfigError::Zero("the store timeout"));
        }
        if self.retention <= self.lease {
            return Err(ConfigError::RetentionNotLongerThanLease {
                retention: self.retention,
                lease: self.lease,
            });
        }
        if let Some(base) = &self.problem_type_base {
            crate::problem::check_type_base(base)
                .map_err(|why| ConfigError::ProblemTypeBase(base.to_string(), why))?;
        }
        Ok(())
    }
}

/// The headers never replayed: [`HOP_BY_HOP`], `Date`, `Set-Cookie` and
/// `Content-Length` (recomputed from the stored body).
pub fn default_replay_denylist() -> Vec<HeaderName> {
    let mut denied = HOP_BY_HOP.to_vec();
    denied.extend([header::DATE, header::SET_COOKIE, header::CONTENT_LENGTH]);
    denied
}

/// A switch a layer consults before every protected request
/// ([`IdempotencyLayer::store_guard`](crate::IdempotencyLayer::store_guard)): once thrown, the layer answers
/// `503 idempotency_store_unavailable` and runs nothing, because the store
/// belongs to instances that derive record identities otherwise.
#[derive(Debug, Clone, Default)]
pub struct StoreGuard(Arc<std::sync::atomic::AtomicBool>);

impl StoreGuard {
    /// Throws the switch.
    pub fn refuse(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the switch is thrown.
    pub fn refused(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}
