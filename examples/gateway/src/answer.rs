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
    response.extensions_mut().insert(GatewayCode(code));
    response
}
