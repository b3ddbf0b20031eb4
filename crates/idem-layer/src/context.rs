//! What the handler learns about its idempotent execution.

use std::sync::Arc;

use idem_core::{Attempt, AttemptId, Fingerprint, IdempotencyKey, ScopeHash};

/// Put in the request extensions of every request the layer executes.
///
/// On a takeover, [`superseded`](Self::superseded) names the attempt whose
/// lease lapsed: it may or may not have acted. Reconcile with the external
/// system (using the key and the generation) before repeating the action.
///
/// With axum, take it as an extractor (`ctx: IdempotencyContext`, or
/// `Option<IdempotencyContext>` on routes that accept unkeyed requests).
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// The tenant the record is scoped to (shared with the record).
    pub tenant: Arc<str>,
    /// The operation (`"POST /orders"`, shared as the tenant is).
    pub operation: Arc<str>,
    /// The scope hash (safe to log).
    pub scope: ScopeHash,
    /// The request fingerprint.
    pub fingerprint: Fingerprint,
    /// This attempt's id.
    pub attempt: AttemptId,
    /// This attempt's lease generation (1 for the first attempt).
    pub generation: u64,
    /// On a takeover, the attempt whose outcome is unknown: the one whose
    /// lease lapsed, or, when a release after an earlier takeover left the
    /// key to this same request, the newest attempt superseded before.
    pub superseded: Option<Attempt>,
}

/// The axum extractor: `ctx: IdempotencyContext` in a handler behind the
/// layer.
///
/// * A keyed request the layer ran: the context.
/// * A request without `Idempotency-Key`: `400 idempotency_key_missing`
///   (the route needs a key; the layer lets unkeyed requests through unless
///   [`require_key`](crate::IdempotencyLayer::require_key) is set).
/// * A keyed request the layer did not run for (not applied to the route,
///   or the method is not protected): `500 idempotency_layer_missing`.
///
/// Routes that also take unkeyed requests use `Option<IdempotencyContext>`:
/// `None` when the layer did not run. Prefer either over
/// `Extension<IdempotencyContext>`, which answers an opaque
/// `500 Missing request extension` for every unkeyed request.
///
/// ```
/// use axum::{Router, routing::post};
/// use idem_layer::{IdempotencyContext, IdempotencyLayer, TenantFromHeader};
/// use idem_memory::MemoryStore;
///
/// async fn pay(ctx: IdempotencyContext) -> String {
///     format!("attempt {} of key {}", ctx.generation, ctx.key)
/// }
///
/// async fn note(ctx: Option<IdempotencyContext>) -> &'static str {
///     if ctx.is_some() { "keyed" } else { "unkeyed" }
/// }
///
/// let app: Router = Router::new()
///     .route("/payments", post(pay))
///     .route("/notes", post(note))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromHeader::from_static("x-tenant")));
/// ```
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyContext {
    type Rejection = axum::response::Response;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        use crate::problem::{ProblemCode, problem};
        if let Some(ctx) = parts.extensions.get::<IdempotencyContext>() {
            return Ok(ctx.clone());
        }
        let (code, detail) = if parts.headers.contains_key(crate::IDEMPOTENCY_KEY) {
            (
                ProblemCode::LayerMissing,
                "the handler needs the idempotency layer, which did not run for this request",
            )
        } else {
            (
                ProblemCode::KeyMissing,
                "this route needs an Idempotency-Key header",
            )
        };
        Err(problem::<axum::body::Body>(code, detail, None).map(axum::body::Body::new))
    }
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyContext>().cloned())
    }
}
