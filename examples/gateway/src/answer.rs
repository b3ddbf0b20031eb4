//! The gateway's own answers: problem documents that carry their `code`
//! for the request's log line.

use axum::{body::Body, http::StatusCode, response::Response};

/// The problem `code` of an answer the gateway gave itself (a refused
/// `Connection`, an unverified token, an unreachable upstream): what its
/// log line names as the request's outcome.
#[derive(Clone, Copy)]
pub(crate) struct GatewayCode(pub(crate) &'static str);

/// A response body for the gateway's own answers.
pub(crate) fn problem(
    status: StatusCode,
    code: &'static str,
    title: &str,
    detail: &str,
) -> Response<Body> {
    let mut response = Response::new(Body::from(idem_layer::problem_document(
        status, code, title, detail,
    )));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(idem_layer::PROBLEM_JSON),
    );
    // Every refusal a retry may cure says when to retry.
    if RETRYABLE.contains(&code) {
        response.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    response.extensions_mut().insert(GatewayCode(code));
    response
}

/// The gateway's refusals a retry may cure: the upstream could not be
/// reached, did not answer in time, or its answer was lost or invalid
/// (the key is released, or kept while a late answer may come).
const RETRYABLE: [&str; 5] = [
    "upstream_unreachable",
    "upstream_timeout",
    "upstream_answer_lost",
    "upstream_answer_invalid",
    "deadline_exceeded",
];

/// The gateway's own problem answer (one carrying [`GatewayCode`]) with
/// `should_retry` (`--should-retry-header`) set, and its `type` under
/// `base` (`--problem-type-base`) with, for a web address, the `Link` that
/// documents it, as the layer's answers have them; any other response as
/// it is.
pub(crate) async fn shaped(
    mut response: Response<Body>,
    base: Option<&str>,
    should_retry: Option<&http::HeaderName>,
    error_member: bool,
) -> Response<Body> {
    let Some(GatewayCode(code)) = response.extensions().get::<GatewayCode>().copied() else {
        return response;
    };
    if let Some(name) = should_retry {
        let retry = if RETRYABLE.contains(&code) {
            "true"
        } else {
            "false"
        };
        response
            .headers_mut()
            .insert(name.clone(), http::HeaderValue::from_static(retry));
    }
    if base.is_none() && !error_member {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 64 * 1024).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let mut document: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(document) => document,
        Err(_) => return Response::from_parts(parts, Body::from(bytes)),
    };
    if let Some(base) = base {
        if let Some(members) = document.as_object_mut() {
            members.insert(
                "type".to_owned(),
                serde_json::json!(format!("{base}{code}")),
            );
        }
        if let Some(link) = idem_layer::problem::describedby_link(base, code) {
            parts.headers.insert(http::header::LINK, link);
        }
    }
    let mut bytes = bytes::Bytes::from(document.to_string());
    if error_member {
        bytes = idem_layer::problem::with_error_member(&bytes);
    }
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(bytes))
}

/// The address of the client a request came from (put in the request
/// extensions by the gateway's server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub std::net::SocketAddr);
