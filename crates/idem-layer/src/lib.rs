//! Tower middleware that makes retried HTTP requests safe.
//!
//! A client that times out and retries must not charge twice. Add
//! [`IdempotencyLayer`] in front of your handlers and every request that
//! carries an `Idempotency-Key` header runs at most once per
//! (tenant, operation, key); duplicates get the stored response back,
//! byte for byte, with `Idempotent-Replayed: true`.
//!
//! ```
//! use axum::{Router, routing::post};
//! use idem_layer::{IdempotencyLayer, TenantFromHeader};
//! use idem_memory::MemoryStore;
//!
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             .tenant(TenantFromHeader::new(http::HeaderName::from_static("x-tenant-id"))),
//!     );
//! ```
//!
//! # What a keyed request gets
//!
//! | situation | answer |
//! |---|---|
//! | new key | the handler runs once; its outcome is stored |
//! | same key, same request, completed | replay of the stored response |
//! | same key, same request, still running | `409 idempotency_in_progress` + `Retry-After` (or wait, see [`InFlight`]) |
//! | same key, other payload | `422 idempotency_conflict` |
//! | cancelled through the records API | `410 idempotency_cancelled` |
//! | malformed or repeated key | `400 idempotency_key_invalid` |
//! | method equal to a protected one but for case (`post`) | `400 method_case_mismatch` |
//! | no tenant | `401 idempotency_tenant_missing` |
//! | body over the limit | `413 request_body_too_large`, handler not run |
//! | store down or slow | `503 idempotency_store_unavailable` + `Retry-After` |
//!
//! Handler outcomes 2xx, 3xx and 4xx (except 408, 425, 429) are stored.
//! 5xx, 408, 425, 429, errors and panics release the key so the client may
//! retry. A response carrying [`UnknownOutcome`] (a proxy's upstream
//! timeout: the action may have run) neither stores nor releases: the key
//! stays reserved and a late answer is recorded. Every refusal is
//! `application/problem+json` with a stable `code` (see [`ProblemCode`]).
//!
//! The operation is the method and axum's route template when there is
//! one, else the path in normal form ([`normalize_path`]: `//orders`,
//! `/./orders` and `/x/../orders` are `/orders`); the inner service then
//! gets the normalized path, so what runs is what was scoped.
//!
//! At shutdown, call [`IdempotencyLayer::drain`] after the server stopped:
//! it waits for handlers whose client left and outcomes still being
//! recorded.
//!
//! # Choices where the contract is silent
//!
//! * A response too large to store (over [`Answers::max_response`](crate::settings::Answers::max_response))
//!   reaches the first caller; later retries get
//!   `409 idempotency_response_not_stored`, and the handler is not run again.
//! * A handler that panics before it answers releases the key and answers
//!   `500 handler_failed`.
//! * A response whose body fails (errs or panics) after its head (an
//!   upstream that broke the connection mid-body) was answered: the
//!   handler ran. With a status
//!   the layer stores, the outcome is recorded without the response, as an
//!   oversized one is, and its client and every retry get
//!   `409 idempotency_response_not_stored`: nothing runs twice. With a
//!   status it does not store (a 5xx), or when the handler left a
//!   transaction (rolled back as it is dropped), the key is released and
//!   the answer is `500 handler_failed`. A late answer (see
//!   [`UnknownOutcome`]) whose body fails is recorded the same way.
//! * A request body that cannot be read answers `400 request_body_invalid`.
//! * Scope hashes are keyed (HMAC-SHA256, IDEM-01) once the layer has a
//!   [`scope_secret`](IdempotencyLayer::scope_secret); without one they are
//!   the unkeyed SHA-256 of earlier versions, so that an upgrade finds the
//!   records written before it.
//! * A released key (after a temporary failure) is free again for any
//!   payload: the next request starts a new attempt. Except after a
//!   takeover: when an attempt in the record's kept history was superseded
//!   while it ran (its outcome unknown, it may have acted), the release
//!   frees the key for the same request only. The record stays
//!   processing with its lease lapsed, so the retry takes it over at once
//!   and a changed request gets `422 idempotency_conflict`.
//! * If the outcome cannot be recorded because the store failed after the
//!   handler ran, the client still gets the real response, and recording is
//!   retried in the background, renewing the lease while it can. If the
//!   store stays down until the lease lapses, the tries go on (at most two
//!   a second) until the store answers or the record's retention passes:
//!   nothing has taken the record over, so the store still takes the
//!   completion, and a retry after the store is back finds the outcome
//!   instead of running again. The layer lists such outcomes by scope: a
//!   retry of one that reaches this layer has it tried at once and waits
//!   for that try (within twice the store timeout, at least 2 s), then
//!   replays it; if the store still does not take it, the retry gets
//!   `503 idempotency_store_unavailable`, fail-open or not (the action
//!   ran), and so does a waiting duplicate (in-flight wait mode) that
//!   reserves again as the store comes back. Any reservation the store
//!   answers has every pending outcome tried at once (at most every
//!   100 ms: a store that took reservations but refused completions would
//!   otherwise get a try of each per request), so a retry that
//!   reaches another instance finds the outcome recorded unless it is
//!   there within moments of the store's return.
//! * Likewise an attempt that still runs when its lease lapses because
//!   its renewals failed (the store was down): its renewals go on (backing
//!   off to two a second, and at once when the store answers one of the
//!   layer's reservations; the store renews a lapsed lease that nothing
//!   took over), and until its outcome is recorded or handed to the
//!   background, a retry of it that reaches this layer is answered
//!   `409 idempotency_in_progress` (or waits, in the in-flight wait mode),
//!   never let take the lease over and run beside it.
//! * A fenced attempt (taken over or cancelled while running) gets what the
//!   record says now, whether it succeeded or failed; if the record is
//!   vacant its own response.
//! * `409 idempotency_in_progress` carries `Retry-After: 1` or `2` (never
//!   more than the lease left, rounded down, and at least 1): most attempts
//!   end well within their lease, and a client's deadline should not be
//!   spent waiting for all of it.
//! * Fail-open covers a store that cannot be reached or timed out, never a
//!   store that answered (full, or a record it cannot decode).
//!
//! # Types a handler meets
//!
//! The idem-core types of [`IdempotencyContext`] are re-exported, so a
//! service depends on `idem-layer` alone:
//!
//! ```
//! use idem_layer::{Attempt, AttemptId, IdempotencyContext, IdempotencyKey, ScopeHash};
//!
//! fn describe(ctx: &IdempotencyContext) -> String {
//!     let key: &IdempotencyKey = &ctx.key;
//!     let attempt: AttemptId = ctx.attempt;
//!     let scope: ScopeHash = ctx.scope;
//!     let superseded: Option<&Attempt> = ctx.superseded.as_ref();
//!     format!("{key} attempt {attempt} in {scope}, took over: {}", superseded.is_some())
//! }
//! ```
//!
//! # Body types
//!
//! The inner service receives the request with its body rebuilt from the
//! buffered bytes (`ReqBody: From<Bytes>`: axum's `Body`, `Full<Bytes>`),
//! and returns a body that is `Unpin`. The layer answers with
//! [`ResponseBody`]. A server whose body cannot be made from bytes
//! (tonic's) takes [`IdempotencyLayer::for_any_body`] instead, which gives
//! the inner service axum's `Body`.

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

/// The README's example, compiled as a doctest so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// Guides to the layer, shown in the rustdoc; their examples are compiled as
/// doctests.
pub mod guide {
    #![doc = include_str!("docs/layer.md")]

    /// Commands without HTTP.
    pub mod commands {
        #![doc = include_str!("docs/commands.md")]
    }

    /// Unary gRPC calls, and streams.
    pub mod grpc {
        #![doc = include_str!("docs/grpc.md")]
    }
}

mod answer;
mod attempt;
mod body;
mod claim;
pub mod classify;
pub mod command;
mod config;
mod context;
mod disconnect;
mod encoding;
mod engine;
pub mod fingerprint;
mod found;
pub mod grpc;
mod headers;
mod layer;
mod listing;
pub mod metrics;
mod path;
mod pending;
pub mod problem;
mod protocol;
mod recent;
pub mod records;
mod runtime;
pub mod sealing;
mod service;
pub mod settings;
pub mod stores;
mod storm;
pub mod tenant;
pub mod testing;
mod unknown;

pub use body::{BoxError, ResponseBody};
pub use claim::{keep_claimed, keep_claimed_guarded};
pub use classify::default_should_store;
pub use command::{ActionError, Command, CommandContext, CommandError, Done};
pub use config::StoreGuard;
pub use config::{ConfigError, MAX_DURATION};
pub use context::IdempotencyContext;
pub use disconnect::ResponseFuture;
#[cfg(feature = "axum")]
pub use headers::Validated;
pub use headers::{
    ADMIN_TOKEN, HOP_BY_HOP, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, NO_STORE, NOTHING_RAN, NoStore,
    NothingRan,
};
/// The idem-core types a handler meets, re-exported so that a service
/// needs no direct idem-core dependency.
pub use idem_core::{
    Attempt, AttemptId, AttemptOutcome, Fingerprint, IdempotencyKey, KeyError, ScopeFormat,
    ScopeHash, ScopeSecret,
};
pub use layer::{DEFAULT_REPLAY_CACHE_BOUND, DEFAULT_REPLAY_CACHE_BYTES, IdempotencyLayer};
pub use path::normalize_path;
pub use pending::Recording;
pub use problem::{
    DEFAULT_TYPE_BASE, PROBLEM_JSON, Problem, ProblemCode, ProblemHook, problem_document,
};
pub use records::RecordsService;
pub use service::Idempotency;
pub use settings::{InFlight, OnDisconnect, default_replay_denylist};
pub use tenant::{
    Tenant, TenantExtractor, TenantFromAuthorization, TenantFromExtension, TenantFromHeader,
    TenantFromKeyedAuthorization, TenantHash, TenantHasher,
};
pub use unknown::{LateResponse, UnknownOutcome};
