//! The settings a layer holds (a few of its own and the groups of
//! [`settings`](crate::settings)), and what a configuration may not be.

use std::{sync::Arc, time::Duration};

use http::{Method, request::Parts};

use crate::{
    settings::{Answers, Fingerprints, InFlight, Problems, RecordsApi, Sealing, Timing},
    tenant::TenantExtractor,
};

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
    /// A zero lease, store timeout, body timeout or limit.
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

/// Every setting of a layer: a few of its own, and the groups of
/// [`settings`](crate::settings).
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) tenant: Arc<dyn TenantExtractor>,
    /// Whether [`tenant`](crate::IdempotencyLayer::tenant) chose the
    /// source (else it is the default: the `Tenant` request extension).
    pub(crate) tenant_chosen: bool,
    pub(crate) allow_anonymous: bool,
    /// The key of scope hashes; none: unkeyed.
    pub(crate) scope_secret: Option<idem_core::ScopeSecret>,
    pub(crate) scope_format: idem_core::ScopeFormat,
    pub(crate) fail_open: bool,
    /// Thrown when the store belongs to instances that derive record
    /// identities otherwise (found after a start the store was down for).
    pub(crate) store_guard: crate::config::StoreGuard,
    /// The replay cache's bytes and bound on an entry's life
    /// ([`IdempotencyLayer::replay_cache`](crate::IdempotencyLayer::replay_cache)).
    pub(crate) replay_cache: (usize, Duration),
    pub(crate) timing: Timing,
    pub(crate) fingerprints: Fingerprints,
    pub(crate) answers: Answers,
    pub(crate) sealing: Sealing,
    pub(crate) problems: Problems,
    pub(crate) records: RecordsApi,
}

impl Config {
    /// Whether problem answers are shaped (a type base or a hook is set).
    pub(crate) fn shapes_problems(&self) -> bool {
        self.problems.shape()
    }

    /// A problem answer with the configured type base and hook applied.
    pub(crate) fn shape<B>(
        &self,
        response: http::Response<crate::ResponseBody<B>>,
    ) -> http::Response<crate::ResponseBody<B>> {
        if !self.shapes_problems() {
            return response;
        }
        let problems = &self.problems;
        crate::problem::shape(
            problems.type_base.as_deref(),
            problems.hook.as_deref(),
            problems.should_retry_header.as_ref(),
            problems.error_member,
            response,
        )
    }
}

impl Config {
    /// The caller's tenant: the extractor's, or the anonymous tenant when
    /// allowed; `None` when the caller is not identified.
    /// Why a request has no tenant: with no source chosen, that the
    /// default one (the `Tenant` request extension) was not set, which is
    /// what a layer built without [`tenant`](crate::IdempotencyLayer::tenant)
    /// answers to every keyed request unless a middleware sets it.
    pub(crate) fn tenant_missing_detail(&self) -> &'static str {
        if self.tenant_chosen {
            "a request with an Idempotency-Key must come from an identified caller"
        } else {
            "no tenant: the layer's tenant source is its default, the `Tenant` request \
             extension, and nothing set it on this request (an authentication middleware in \
             front of the layer sets it; or choose a source with `IdempotencyLayer::tenant`, \
             such as a header or `Authorization`, or allow anonymous callers)"
        }
    }

    pub(crate) fn tenant_of(&self, parts: &Parts) -> Option<Arc<str>> {
        // A caller named twice is not identified, nor anonymous.
        if self.tenant.ambiguous(parts) {
            return None;
        }
        match self.tenant.shared_tenant(parts) {
            Some(tenant) => Some(tenant),
            None if self.allow_anonymous => Some(crate::tenant::ANONYMOUS_TENANT.into()),
            None => None,
        }
    }
}

impl Config {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let timing = &self.timing;
        let wait = match timing.in_flight {
            InFlight::Wait(bound) => bound,
            InFlight::Reject => Duration::ZERO,
        };
        for (name, value) in [
            ("the lease", timing.lease),
            ("the retention", timing.retention),
            ("the store timeout", timing.store_timeout),
            ("the body timeout", timing.body_timeout),
            ("the in-flight wait", wait),
            ("the unknown-outcome wait", timing.unknown_wait),
        ] {
            if value > MAX_DURATION {
                return Err(ConfigError::TooLong(name));
            }
        }
        if timing.lease.is_zero() {
            return Err(ConfigError::Zero("the lease"));
        }
        if timing.store_timeout.is_zero() {
            return Err(ConfigError::Zero("the store timeout"));
        }
        // A keyed body that has not all arrived would be refused at once.
        if timing.body_timeout.is_zero() {
            return Err(ConfigError::Zero("the body timeout"));
        }
        if timing.retention <= timing.lease {
            return Err(ConfigError::RetentionNotLongerThanLease {
                retention: timing.retention,
                lease: timing.lease,
            });
        }
        if let Some(base) = &self.problems.type_base {
            crate::problem::check_type_base(base)
                .map_err(|why| ConfigError::ProblemTypeBase(base.to_string(), why))?;
        }
        Ok(())
    }
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
