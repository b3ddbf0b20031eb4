//! `application/problem+json` (RFC 9457) answers with stable codes.
//!
//! Every refusal of the layer carries a `code` member that clients can
//! match on; the `type` is `urn:idem:problem:<code>`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::ResponseBody;

/// The stable problem codes of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemCode {
    /// 400: the layer requires a key and the request has none.
    KeyMissing,
    /// 400: the key is malformed, too long, or repeated.
    KeyInvalid,
    /// 401: a keyed request whose tenant cannot be determined.
    TenantMissing,
    /// 409: another attempt with this key is running.
    InProgress,
    /// 410: the record was cancelled.
    Cancelled,
    /// 413: the request body exceeds the limit.
    BodyTooLarge,
    /// 400: the request body could not be read.
    BodyInvalid,
    /// 408: the request body did not arrive within the body timeout.
    BodyTimeout,
    /// 422: the key was used with another payload.
    Conflict,
    /// 503: the store failed or timed out (or is full).
    StoreUnavailable,
    /// 409: the handler completed, but its response was larger than the
    /// storable limit, so it cannot be replayed. 409 rather than a 5xx, so
    /// that generic retry policies do not retry it: retrying cannot help.
    ResponseNotStored,
    /// 500: the handler panicked, or its response body failed; the
    /// reservation was released.
    HandlerFailed,
    /// 404: the records API found no record for this tenant.
    RecordNotFound,
    /// 400: the records API query is missing a parameter.
    RecordQueryInvalid,
    /// 400: the method equals a protected method but for case (`post`
    /// where `POST` is protected). HTTP methods are case-sensitive, many
    /// frameworks are not; rather than let it through unprotected, the
    /// layer refuses it.
    MethodCaseMismatch,
}

impl ProblemCode {
    /// The `code` member.
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemCode::KeyMissing => "idempotency_key_missing",
            ProblemCode::KeyInvalid => "idempotency_key_invalid",
            ProblemCode::TenantMissing => "idempotency_tenant_missing",
            ProblemCode::InProgress => "idempotency_in_progress",
            ProblemCode::Cancelled => "idempotency_cancelled",
            ProblemCode::BodyTooLarge => "request_body_too_large",
            ProblemCode::BodyInvalid => "request_body_invalid",
            ProblemCode::BodyTimeout => "request_body_timeout",
            ProblemCode::Conflict => "idempotency_conflict",
            ProblemCode::StoreUnavailable => "idempotency_store_unavailable",
            ProblemCode::ResponseNotStored => "idempotency_response_not_stored",
            ProblemCode::HandlerFailed => "handler_failed",
            ProblemCode::RecordNotFound => "idempotency_record_not_found",
            ProblemCode::RecordQueryInvalid => "idempotency_record_query_invalid",
            ProblemCode::MethodCaseMismatch => "method_case_mismatch",
        }
    }

    /// The HTTP status the code is sent with.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemCode::KeyMissing
            | ProblemCode::KeyInvalid
            | ProblemCode::BodyInvalid
            | ProblemCode::RecordQueryInvalid
            | ProblemCode::MethodCaseMismatch => StatusCode::BAD_REQUEST,
            ProblemCode::TenantMissing => StatusCode::UNAUTHORIZED,
            ProblemCode::InProgress | ProblemCode::ResponseNotStored => StatusCode::CONFLICT,
            ProblemCode::Cancelled => StatusCode::GONE,
            ProblemCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemCode::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProblemCode::Conflict => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemCode::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemCode::HandlerFailed => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemCode::RecordNotFound => StatusCode::NOT_FOUND,
        }
    }

    fn title(self) -> &'static str {
        match self {
            ProblemCode::KeyMissing => "Idempotency-Key header required",
            ProblemCode::KeyInvalid => "Invalid Idempotency-Key",
            ProblemCode::TenantMissing => "Caller not identified",
            ProblemCode::InProgress => "A request with this key is in progress",
            ProblemCode::Cancelled => "The request with this key was cancelled",
            ProblemCode::BodyTooLarge => "Request body too large",
            ProblemCode::BodyInvalid => "Request body could not be read",
            ProblemCode::BodyTimeout => "Request body too slow",
            ProblemCode::Conflict => "Idempotency-Key reused with a different request",
            ProblemCode::StoreUnavailable => "Idempotency store unavailable",
            ProblemCode::ResponseNotStored => "Response was not stored",
            ProblemCode::HandlerFailed => "The handler failed",
            ProblemCode::RecordNotFound => "No record for this key",
            ProblemCode::RecordQueryInvalid => "Invalid records query",
            ProblemCode::MethodCaseMismatch => "Method differs from a protected method by case",
        }
    }
}

/// An RFC 9457 problem document with a `code` member, as every idem
/// component writes it (`type` is `urn:idem:problem:<code>`). For codes of
/// other components too, such as the gateway's `upstream_unreachable`.
pub fn problem_document(status: StatusCode, code: &str, title: &str, detail: &str) -> Bytes {
    let body = serde_json::json!({
        "type": format!("urn:idem:problem:{code}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
        "code": code,
    });
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The `content-type` of problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Builds a problem response. `retry_after` adds a `Retry-After` header in
/// whole seconds (at least 1). The code is also put in the response
/// extensions, for logging.
pub(crate) fn problem<B>(
    code: ProblemCode,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<ResponseBody<B>> {
    let bytes = problem_document(code.status(), code.as_str(), code.title(), detail);
    let mut response = Response::new(ResponseBody::full(bytes));
    *response.status_mut() = code.status();
    response.extensions_mut().insert(code);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(wait) = retry_after {
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(wait)),
        );
    }
    response
}

/// Whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}
