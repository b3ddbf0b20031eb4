//! What the handler learns about its idempotent execution.

use idem_core::{Attempt, AttemptId, Fingerprint, IdempotencyKey, ScopeHash};

/// Put in the request extensions of every request the layer executes.
///
/// On a takeover, [`superseded`](Self::superseded) names the attempt whose
/// lease lapsed: it may or may not have acted. Reconcile with the external
/// system (using the key and the generation) before repeating the action.
///
/// With axum: `Extension(ctx): Extension<IdempotencyContext>`.
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// The tenant the record is scoped to.
    pub tenant: String,
    /// The operation (`"POST /orders"`).
    pub operation: String,
    /// The scope hash (safe to log).
    pub scope: ScopeHash,
    /// The request fingerprint.
    pub fingerprint: Fingerprint,
    /// This attempt's id.
    pub attempt: AttemptId,
    /// This attempt's lease generation (1 for the first attempt).
    pub generation: u64,
    /// The attempt this one took over from, whose outcome is unknown.
    pub superseded: Option<Attempt>,
}
