//! The protocol's vocabulary, shared by the server side (`idem-layer`, the
//! gateway) and the calling side (`idem-client`): header names (lower
//! case, as HTTP/2 sends them) and the problem `code`s a client acts on.

/// The request header that carries the idempotency key (an RFC 8941
/// sf-string or token).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header on a replayed outcome: `true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The header the gateway adds toward its upstream: the attempt's lease
/// generation (1 for the first attempt, higher after a takeover).
pub const IDEMPOTENCY_ATTEMPT: &str = "idempotency-attempt";

/// The media type of every refusal.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Problem `code`s a client acts on.
pub mod codes {
    /// 409: another attempt with this key is running; retry after
    /// `Retry-After`.
    pub const IN_PROGRESS: &str = "idempotency_in_progress";
    /// 422: the key was used with another payload; never retry.
    pub const CONFLICT: &str = "idempotency_conflict";
    /// 410: the request with this key was cancelled.
    pub const CANCELLED: &str = "idempotency_cancelled";
    /// 503: the store failed; retry after `Retry-After`.
    pub const STORE_UNAVAILABLE: &str = "idempotency_store_unavailable";
}

/// The metadata entry in which a gRPC caller gets a refusal's problem
/// `code` (the layer answers gRPC calls with gRPC statuses).
pub const GRPC_PROBLEM: &str = "idem-problem";

/// Whether `headers` describe a gRPC message: a `content-type` of
/// `application/grpc`, with or without a `+format` or parameters; not
/// gRPC-Web, whose trailers travel in its body.
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| {
            let value = value.as_bytes();
            value.len() >= GRPC.len()
                && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
                && matches!(value.get(GRPC.len()), None | Some(b'+' | b';' | b' '))
        })
}

/// The `grpc-status` in `headers` (a trailers block, or the head of a
/// trailers-only answer), when there is a readable one.
pub fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}
