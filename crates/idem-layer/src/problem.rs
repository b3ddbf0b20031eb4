//! `application/problem+json` (RFC 9457) answers with stable codes.
//!
//! Every refusal of the layer carries a `code` member that clients can
//! match on; the `type` is `urn:idem:problem:<code>`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use idem_core::{StoreError, protocol::codes};

use crate::{
    ResponseBody,
    metrics::{self as m, Outcome as Counted},
};

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
    /// 409: the handler completed, but its response was not stored (larger
    /// than the storable limit, or its body failed after the head), so it
    /// cannot be replayed; the handler does not run again. 409 rather than
    /// a 5xx, so that generic retry policies do not retry it: retrying
    /// cannot help.
    ResponseNotStored,
    /// 500: the handler panicked, or its response body failed; the
    /// reservation was released.
    HandlerFailed,
    /// 404: the records API found no record for this tenant.
    RecordNotFound,
    /// 400: the records API query is missing a parameter.
    RecordQueryInvalid,
    /// 500: a handler asked for the [`IdempotencyContext`](crate::IdempotencyContext)
    /// of a keyed request the layer did not run for (the layer is not
    /// applied to the route, or the method is not protected).
    LayerMissing,
    /// 400: the method equals a protected method but for case (`post`
    /// where `POST` is protected). HTTP methods are case-sensitive, many
    /// frameworks are not; rather than let it through unprotected, the
    /// layer refuses it.
    MethodCaseMismatch,
    /// 429: the caller's tenant holds its quota of live records in the
    /// store; other tenants are not affected. `Retry-After` says when its
    /// earliest record expires.
    QuotaExceeded,
    /// 403: the records API request needs the admin credential (another
    /// tenant's records, or every tenant's).
    AdminRequired,
    /// 429: a records listing was asked for while another runs, or beyond
    /// the listings' share of the time (see [`records`](crate::records));
    /// `Retry-After` says when to list again.
    ListingBusy,
    /// 500: the layer was applied with a configuration
    /// [`IdempotencyLayer::validate`](crate::IdempotencyLayer::validate)
    /// refuses; requests of the protected methods are refused, never run
    /// unprotected. Call `validate` at start to fail there instead.
    Misconfigured,
    /// 406: the stored response carries a content coding the retry's
    /// `Accept-Encoding` does not accept, and the layer cannot decode it
    /// (only `gzip` and `deflate` are decoded, within the storable limit).
    /// The action ran; the retry never runs it again.
    ReplayNotAcceptable,
    /// 400 (gRPC `UNIMPLEMENTED`): a keyed gRPC call whose request carries
    /// more than one message, a streaming call; only unary calls are
    /// protected (see [`grpc`](crate::grpc)). Nothing ran.
    StreamRefused,
    /// 500: the handler began a transaction to commit with its outcome
    /// (`idem_postgres::IdemTransaction`), answered a success, and dropped
    /// the transaction without `commit()`: its writes rolled back, so the
    /// success is never recorded; the key is released.
    TransactionNotCommitted,
    /// 403: an answer fetched by its key alone (the records API's
    /// `output=true`) while that is off, by the anonymous tenant, or for
    /// another tenant.
    OutputRefused,
    /// 409: the record's attempt answered its caller that the outcome is
    /// unknown (a deadline, an upstream's `504`): it may have acted, and its
    /// late answer may still be recorded; `Retry-After` says when to ask
    /// again.
    OutcomeUnknown,
}

impl ProblemCode {
    /// Every code, in the order `docs/problems.md` lists them.
    pub const ALL: &'static [ProblemCode] = &[
        ProblemCode::KeyMissing,
        ProblemCode::KeyInvalid,
        ProblemCode::TenantMissing,
        ProblemCode::InProgress,
        ProblemCode::Cancelled,
        ProblemCode::BodyTooLarge,
        ProblemCode::BodyInvalid,
        ProblemCode::BodyTimeout,
        ProblemCode::Conflict,
        ProblemCode::StoreUnavailable,
        ProblemCode::ResponseNotStored,
        ProblemCode::HandlerFailed,
        ProblemCode::RecordNotFound,
        ProblemCode::RecordQueryInvalid,
        ProblemCode::MethodCaseMismatch,
        ProblemCode::LayerMissing,
        ProblemCode::QuotaExceeded,
        ProblemCode::AdminRequired,
        ProblemCode::ListingBusy,
        ProblemCode::Misconfigured,
        ProblemCode::ReplayNotAcceptable,
        ProblemCode::StreamRefused,
        ProblemCode::TransactionNotCommitted,
        ProblemCode::OutputRefused,
        ProblemCode::OutcomeUnknown,
    ];

    /// The `code` member.
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemCode::KeyMissing => "idempotency_key_missing",
            ProblemCode::KeyInvalid => "idempotency_key_invalid",
            ProblemCode::TenantMissing => "idempotency_tenant_missing",
            ProblemCode::InProgress => codes::IN_PROGRESS,
            ProblemCode::Cancelled => codes::CANCELLED,
            ProblemCode::BodyTooLarge => codes::BODY_TOO_LARGE,
            ProblemCode::BodyInvalid => "request_body_invalid",
            ProblemCode::BodyTimeout => "request_body_timeout",
            ProblemCode::Conflict => codes::CONFLICT,
            ProblemCode::StoreUnavailable => codes::STORE_UNAVAILABLE,
            ProblemCode::ResponseNotStored => "idempotency_response_not_stored",
            ProblemCode::HandlerFailed => "handler_failed",
            ProblemCode::RecordNotFound => "idempotency_record_not_found",
            ProblemCode::RecordQueryInvalid => "idempotency_record_query_invalid",
            ProblemCode::MethodCaseMismatch => "method_case_mismatch",
            ProblemCode::LayerMissing => "idempotency_layer_missing",
            ProblemCode::QuotaExceeded => "idempotency_quota_exceeded",
            ProblemCode::AdminRequired => "idempotency_admin_required",
            ProblemCode::ListingBusy => "idempotency_listing_busy",
            ProblemCode::Misconfigured => "idempotency_misconfigured",
            ProblemCode::ReplayNotAcceptable => "idempotency_replay_not_acceptable",
            ProblemCode::StreamRefused => "idempotency_stream_refused",
            ProblemCode::TransactionNotCommitted => "idempotency_transaction_not_committed",
            ProblemCode::OutputRefused => "idempotency_output_refused",
            ProblemCode::OutcomeUnknown => codes::OUTCOME_UNKNOWN,
        }
    }

    /// The HTTP status the code is sent with.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemCode::KeyMissing
            | ProblemCode::KeyInvalid
            | ProblemCode::BodyInvalid
            | ProblemCode::RecordQueryInvalid
            | ProblemCode::MethodCaseMismatch
            | ProblemCode::StreamRefused => StatusCode::BAD_REQUEST,
            ProblemCode::TenantMissing => StatusCode::UNAUTHORIZED,
            ProblemCode::InProgress
            | ProblemCode::ResponseNotStored
            | ProblemCode::OutcomeUnknown => StatusCode::CONFLICT,
            ProblemCode::Cancelled => StatusCode::GONE,
            ProblemCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemCode::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProblemCode::Conflict => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemCode::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemCode::HandlerFailed
            | ProblemCode::LayerMissing
            | ProblemCode::Misconfigured
            | ProblemCode::TransactionNotCommitted => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemCode::RecordNotFound => StatusCode::NOT_FOUND,
            ProblemCode::QuotaExceeded | ProblemCode::ListingBusy => StatusCode::TOO_MANY_REQUESTS,
            ProblemCode::AdminRequired | ProblemCode::OutputRefused => StatusCode::FORBIDDEN,
            ProblemCode::ReplayNotAcceptable => StatusCode::NOT_ACCEPTABLE,
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
            ProblemCode::LayerMissing => "The idempotency layer did not run for this request",
            ProblemCode::QuotaExceeded => "The caller holds its quota of idempotency records",
            ProblemCode::AdminRequired => "The records API admin credential is required",
            ProblemCode::ListingBusy => "Records are being listed; list again later",
            ProblemCode::Misconfigured => "The idempotency layer is misconfigured",
            ProblemCode::ReplayNotAcceptable => {
                "The stored response's content coding is not acceptable"
            }
            ProblemCode::StreamRefused => "Streaming calls are not protected",
            ProblemCode::TransactionNotCommitted => "The handler's transaction was not committed",
            ProblemCode::OutputRefused => "This answer cannot be fetched by its key",
            ProblemCode::OutcomeUnknown => "The outcome of this request is unknown",
        }
    }
}

/// The default base of a problem's `type`: `urn:idem:problem:<code>`.
pub const DEFAULT_TYPE_BASE: &str = "urn:idem:problem:";

/// An RFC 9457 problem document with a `code` member, as every idem
/// component writes it (`type` is `urn:idem:problem:<code>`). For codes of
/// other components too, such as the gateway's `upstream_unreachable`.
pub fn problem_document(status: StatusCode, code: &str, title: &str, detail: &str) -> Bytes {
    document(DEFAULT_TYPE_BASE, status, code, title, detail, None)
}

fn document(
    type_base: &str,
    status: StatusCode,
    code: &str,
    title: &str,
    detail: &str,
    record: Option<&RecordRef>,
) -> Bytes {
    let mut body = serde_json::json!({
        "type": format!("{type_base}{code}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
        "code": code,
    });
    if let (Some(record), Some(members)) = (record, body.as_object_mut()) {
        members.insert("record".to_owned(), serde_json::json!(record));
    }
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// A refusal of the layer, as a [problem hook](crate::settings::Problems::hook)
/// sees it. Also in the extensions of every problem response.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The stable code.
    pub code: ProblemCode,
    /// The status it is sent with.
    pub status: StatusCode,
    /// A short, fixed title.
    pub title: &'static str,
    /// What happened, for the caller; never internals such as a store's
    /// error text, which go to the logs.
    pub detail: String,
    /// The `Retry-After` in seconds, when there is one.
    pub retry_after: Option<u64>,
    /// The record a conflict or a request in progress collided with (422
    /// and 409), written as the document's `record` member.
    pub record: Option<RecordRef>,
}

/// The record a key collided with, as a `422` or `409` answer points to it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RecordRef {
    /// The record in the records API, as the caller's own tenant reads it
    /// (when the layer knows where the API is:
    /// [`RecordsApi::path`](crate::settings::RecordsApi::path)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub href: Option<String>,
    /// Its state: `processing`, `completed`, `cancelled` or `released`.
    pub state: &'static str,
    /// When its key was first seen (RFC 3339, UTC), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_seen: Option<String>,
}

impl Problem {
    /// The problem document with `type` = `type_base` + code.
    pub fn document(&self, type_base: &str) -> Bytes {
        document(
            type_base,
            self.status,
            self.code.as_str(),
            self.title,
            &self.detail,
            self.record.as_ref(),
        )
    }
}

/// `document` (a problem document's bytes) with the compatibility member
/// common SDKs read beside RFC 9457's: `"error": {"type", "code",
/// "message"}` (the type `idempotency_error`, the problem's `code`, its
/// `detail`). A document that does not parse is kept as it is.
pub fn with_error_member(document: &[u8]) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(document) else {
        return Bytes::copy_from_slice(document);
    };
    if let Some(members) = value.as_object_mut() {
        let code = members.get("code").cloned().unwrap_or_default();
        let message = members.get("detail").cloned().unwrap_or_default();
        members.insert(
            "error".to_owned(),
            serde_json::json!({ "type": "idempotency_error", "code": code, "message": message }),
        );
    }
    Bytes::from(value.to_string())
}

/// Replaces a problem response: given the problem, answer the response to
/// send instead (its body as bytes), or `None` to keep idem's own.
pub type ProblemHook = dyn Fn(&Problem) -> Option<Response<Bytes>> + Send + Sync;

/// Checks that `base` is an absolute URI (RFC 3986: a scheme, `:`, then
/// only URI characters, every `%` followed by two hex digits), as a
/// problem type base must be. Nothing else is accepted: no space, no `<`,
/// `>` or `"`, no control or non-ASCII byte, so no value can end the
/// `Link` target it is sent in or add one of its own.
///
/// ```
/// use idem_layer::problem::check_type_base;
/// assert!(check_type_base("https://docs.example.com/problems/").is_ok());
/// assert!(check_type_base("urn:idem:problem:").is_ok());
/// assert!(check_type_base("/problems/").is_err());
/// assert!(check_type_base("https://a/>; rel=\"x\", <https://b/").is_err());
/// ```
pub fn check_type_base(base: &str) -> Result<(), &'static str> {
    let refuse = Err;
    let Some((scheme, _)) = base.split_once(':') else {
        return refuse("it has no scheme");
    };
    let mut letters = scheme.bytes();
    if !letters.next().is_some_and(|b| b.is_ascii_alphabetic())
        || !letters.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
    {
        return refuse("its scheme is not a letter followed by letters, digits, +, - or .");
    }
    let bytes = base.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let uri_char = b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=%".contains(&b);
        if !uri_char {
            return refuse(
                "it holds a character a URI cannot (a space, <, >, \", a control or non-ASCII byte)",
            );
        }
        if b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        {
            return refuse("a % is not followed by two hex digits");
        }
    }
    Ok(())
}

/// The `Link` that documents a problem of `code` under the type base
/// `base`: `<{base}{code}>; rel="describedby"`, for a base that is a web
/// address (`http` or `https`, the scheme in any case) and an absolute URI
/// ([`check_type_base`]), which can neither end the link's target nor add
/// one; `None` otherwise.
pub fn describedby_link(base: &str, code: &str) -> Option<HeaderValue> {
    let web = ["http://", "https://"].iter().any(|scheme| {
        base.get(..scheme.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(scheme))
    });
    let plain_code = code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    if !web || !plain_code || check_type_base(base).is_err() {
        return None;
    }
    HeaderValue::try_from(format!("<{base}{code}>; rel=\"describedby\"")).ok()
}

/// Whether a client should retry after a refusal of `code`, as the
/// should-retry header says it (`Problems::should_retry_header`):
/// `true` where the same request may succeed later (in progress, the
/// store unavailable or busy, a listing or quota to wait for, a body too
/// slow, a handler failure that released the key); `false` where it never
/// will (a conflict, a response not stored, a cancelled record, a request
/// to correct, a refusal of the deployment's).
pub fn should_retry(code: ProblemCode) -> bool {
    matches!(
        code,
        ProblemCode::InProgress
            | ProblemCode::StoreUnavailable
            | ProblemCode::ListingBusy
            | ProblemCode::QuotaExceeded
            | ProblemCode::BodyTimeout
            | ProblemCode::HandlerFailed
            | ProblemCode::TransactionNotCommitted
            | ProblemCode::OutcomeUnknown
    )
}

/// Applies the configured type base and problem hook to a problem answer
/// of the layer; other responses pass unchanged.
pub(crate) fn shape<B>(
    type_base: Option<&str>,
    hook: Option<&ProblemHook>,
    should_retry_header: Option<&http::HeaderName>,
    error_member: bool,
    mut response: Response<ResponseBody<B>>,
) -> Response<ResponseBody<B>> {
    let Some(problem) = response.extensions().get::<Problem>().cloned() else {
        return response;
    };
    if let Some(name) = should_retry_header {
        let retry = if should_retry(problem.code) {
            "true"
        } else {
            "false"
        };
        response
            .headers_mut()
            .insert(name.clone(), HeaderValue::from_static(retry));
    }
    if let Some(replacement) = hook.and_then(|hook| hook(&problem)) {
        let (mut parts, body) = replacement.into_parts();
        parts.extensions.insert(problem.code);
        parts.extensions.insert(problem);
        return Response::from_parts(parts, ResponseBody::full(body));
    }
    if type_base.is_some() || error_member {
        let base = type_base.unwrap_or(DEFAULT_TYPE_BASE);
        let mut document = problem.document(base);
        if error_member {
            document = with_error_member(&document);
        }
        *response.body_mut() = ResponseBody::full(document);
        if let Some(link) = describedby_link(base, problem.code.as_str()) {
            response.headers_mut().insert(header::LINK, link);
        }
    }
    response
}

/// The `content-type` of problem documents.
pub const PROBLEM_JSON: &str = idem_core::protocol::PROBLEM_JSON;

/// Builds a problem response. `retry_after` adds a `Retry-After` header in
/// whole seconds (at least 1). The code is also put in the response
/// extensions, for logging.
pub(crate) fn problem<B>(
    code: ProblemCode,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<ResponseBody<B>> {
    problem_about(code, detail, retry_after, None)
}

/// [`problem`] pointing to the record the request collided with.
pub(crate) fn problem_about<B>(
    code: ProblemCode,
    detail: &str,
    retry_after: Option<Duration>,
    record: Option<RecordRef>,
) -> Response<ResponseBody<B>> {
    let bytes = document(
        DEFAULT_TYPE_BASE,
        code.status(),
        code.as_str(),
        code.title(),
        detail,
        record.as_ref(),
    );
    let mut response = Response::new(ResponseBody::full(bytes));
    *response.status_mut() = code.status();
    // Every refusal a retry may cure says when to retry.
    let retry_after = retry_after
        .or_else(|| should_retry(code).then_some(Duration::from_secs(1)))
        .map(retry_after_secs);
    response.extensions_mut().insert(code);
    response.extensions_mut().insert(Problem {
        code,
        status: code.status(),
        title: code.title(),
        detail: detail.to_owned(),
        retry_after,
        record,
    });
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(secs) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// Whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

pub(crate) fn store_unavailable<B>(error: &StoreError) -> Response<ResponseBody<B>> {
    // A tenant at its quota is not a store in trouble: counted apart, so
    // that an alert on store errors does not fire for one busy tenant.
    m::count(match error {
        StoreError::QuotaExceeded { .. } => Counted::QuotaExceeded,
        _ => Counted::StoreError,
    });
    unavailable_problem(error)
}

/// `503 idempotency_store_unavailable` for a failed store call, of the
/// layer and of the records API alike; the error itself is logged.
pub(crate) fn unavailable_problem<B>(error: &StoreError) -> Response<ResponseBody<B>> {
    tracing::warn!(%error, "idempotency store call failed");
    // What went wrong inside is for the logs (above), not for the caller.
    let (code, detail, retry_after) = match error {
        StoreError::Full { retry_after, .. } => (
            ProblemCode::StoreUnavailable,
            "the idempotency store is full; retry after records expire",
            *retry_after,
        ),
        StoreError::Busy { retry_after } => (
            ProblemCode::StoreUnavailable,
            "every connection to the idempotency store is in use; retry shortly",
            *retry_after,
        ),
        StoreError::QuotaExceeded { retry_after, .. } => (
            ProblemCode::QuotaExceeded,
            "the caller holds its quota of idempotency records; retry after its oldest expire",
            *retry_after,
        ),
        _ => (
            ProblemCode::StoreUnavailable,
            "the idempotency store is unavailable; retry shortly",
            Duration::from_secs(1),
        ),
    };
    problem(code, detail, Some(retry_after))
}

#[cfg(test)]
mod tests {
    use super::ProblemCode;

    /// A web address of any scheme case is linked; anything else, or a
    /// base that is no absolute URI, is not.
    #[test]
    fn a_describedby_link_only_for_a_web_address() {
        for base in [
            "https://d.example/p/",
            "HTTPS://d.example/p/",
            "Http://d.example/",
        ] {
            let link =
                crate::problem::describedby_link(base, "idempotency_conflict").expect("a link");
            assert_eq!(
                link.to_str().ok(),
                Some(format!("<{base}idempotency_conflict>; rel=\"describedby\"").as_str())
            );
        }
        for base in [
            "urn:idem:problem:",
            "/p/",
            "https://d.example/>, <https://e/",
        ] {
            assert!(
                crate::problem::describedby_link(base, "idempotency_conflict").is_none(),
                "{base}"
            );
        }
    }

    /// `ALL` holds every code once: a code added to the enum and not to
    /// `ALL` fails to compile here (the match is exhaustive).
    #[test]
    fn all_holds_every_code_once() {
        let position = |code: ProblemCode| match code {
            ProblemCode::KeyMissing => 0,
            ProblemCode::KeyInvalid => 1,
            ProblemCode::TenantMissing => 2,
            ProblemCode::InProgress => 3,
            ProblemCode::Cancelled => 4,
            ProblemCode::BodyTooLarge => 5,
            ProblemCode::BodyInvalid => 6,
            ProblemCode::BodyTimeout => 7,
            ProblemCode::Conflict => 8,
            ProblemCode::StoreUnavailable => 9,
            ProblemCode::ResponseNotStored => 10,
            ProblemCode::HandlerFailed => 11,
            ProblemCode::RecordNotFound => 12,
            ProblemCode::RecordQueryInvalid => 13,
            ProblemCode::MethodCaseMismatch => 14,
            ProblemCode::LayerMissing => 15,
            ProblemCode::QuotaExceeded => 16,
            ProblemCode::AdminRequired => 17,
            ProblemCode::ListingBusy => 18,
            ProblemCode::Misconfigured => 19,
            ProblemCode::ReplayNotAcceptable => 20,
            ProblemCode::StreamRefused => 21,
            ProblemCode::TransactionNotCommitted => 22,
            ProblemCode::OutputRefused => 23,
            ProblemCode::OutcomeUnknown => 24,
        };
        assert_eq!(ProblemCode::ALL.len(), 25);
        for (i, code) in ProblemCode::ALL.iter().enumerate() {
            assert_eq!(position(*code), i, "{code:?}");
        }
    }
}
