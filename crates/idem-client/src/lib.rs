//! Safe retries on the calling side: a Tower middleware for outgoing HTTP
//! requests that keeps one `Idempotency-Key` across every attempt of a
//! business action, retries only what is safe, backs off with full jitter,
//! honours `Retry-After`, stops at a deadline, and shares a retry budget
//! between all clones so a failing dependency gets no retry storm.
//!
//! ```no_run
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use idem_client::{ReplayBody, RetryLayer};
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::ServiceBuilder;
//!
//! # fn _build() {
//! // The inner client sends `ReplayBody`s: buffered bodies can be resent.
//! let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody<Full<Bytes>>>();
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new().max_attempts(5).deadline(Duration::from_secs(10)))
//!     .service(http);
//! # let _: idem_client::Retry<_> = client;
//! # }
//! ```
//!
//! # What is retried
//!
//! Transport errors, attempt timeouts, `408`, `425`, `429`, `502`, `503`,
//! `504`, and `409` whose problem `code` is `idempotency_in_progress` (or
//! `idempotency_outcome_unknown`, which an answer fetched by its key says,
//! see [`output_request`]): only
//! for idempotent methods (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) or
//! requests that carry an `Idempotency-Key`. Never other 4xx answers: not
//! validation or permission errors, not `422 idempotency_conflict`, not
//! `410`. A request of [`RetryLayer::key_methods`] (default POST and PATCH)
//! without a key gets a fresh UUIDv4 key, kept for all its attempts.
//!
//! A gRPC answer (`application/grpc`, its status in its head) is retried
//! for `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED` and
//! `ABORTED` (but not a message over the layer's limit,
//! `request_body_too_large`), after `grpc-retry-pushback-ms` when it says
//! one; see [the guide](guide).
//!
//! # When it stops
//!
//! After [`max_attempts`](RetryLayer::max_attempts) (default 4), when the
//! next attempt would start after the [`deadline`](RetryLayer::deadline)
//! (default 30 s from the first), when the shared budget is spent, or when
//! the body could not be buffered for a resend (over
//! [`body_limit`](RetryLayer::body_limit), default 64 KiB, or of unknown
//! length): such a request is sent once. The final response is returned
//! as is, with a [`RetryInfo`] extension saying how many attempts were made
//! and why retrying stopped; a final transport error is an [`Error`] with
//! the same facts.
//!
//! # Delays
//!
//! Full jitter: before retry *n*, a random delay in
//! `[0, min(max_delay, base_delay * 2^(n-1))]`. A `Retry-After` header in
//! either RFC 9110 form (seconds or HTTP-date) replaces it; one that would
//! cross the deadline stops the retries instead; an unparseable one falls
//! back to backoff.
//!
//! # Limits at the provider's boundary
//!
//! [`RetryLayer::limits`] holds every request to its boundary's shared
//! rate, cooldown and retry budget, fairly across owners: see [`limits`].
//!
//! # Metrics
//!
//! `idem_client_attempts_total`, `idem_client_retries_total{reason}`,
//! `idem_client_budget_exhausted_total`, `idem_client_give_ups_total{reason}`,
//! and with limits `idem_client_limit_queue_depth{boundary}`,
//! `idem_client_limit_wait_seconds{boundary}`,
//! `idem_client_limit_cooldowns_total{boundary}`,
//! `idem_client_limit_refusals_total{boundary}`.

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

/// The crate's guide, shown in the rustdoc; its examples are compiled as
/// doctests.
pub mod guide {
    #![doc = include_str!("docs/guide.md")]
}

pub mod backoff;
mod body;
mod config;
mod error;
mod layer;
pub mod limits;
mod output;
mod service;

pub use body::{BoxError, ReplayBody};
pub use error::{Error, RetryInfo, StopReason};
pub use layer::{Retry, RetryLayer};
pub use limits::{Gate, Limit, Limits, LocalGate, OnGateError, SharedBudget, Turn};
pub use output::output_request;
