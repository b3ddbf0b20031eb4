//! Fetching a request's stored answer by its key alone, where the server
//! allows it (an idem layer with `output_by_key`, the gateway's
//! `--output-by-key`): for a client that lost an answer and no longer
//! holds the payload it sent.

use std::time::Duration;

use http::{Method, Request, Uri};

/// A `GET` that fetches the stored answer of the request `method path`
/// sent with `key`, from the records API at `records` (for example
/// `http://gateway:8080/_idempotency/records`), waiting at most `wait` for
/// an attempt still running. Send it with the caller's own credentials
/// (its tenant), through a [`Retry`](crate::Retry) service: an attempt in
/// progress or of unknown outcome (`409`) is asked again after its
/// `Retry-After`.
///
/// The answer is the stored response (status, headers and body, with
/// `Idempotent-Replayed: true`); `404 idempotency_record_not_found` when
/// there is none (never made, released by a failure, expired or erased);
/// `409 idempotency_outcome_unknown` while the attempt's outcome is
/// unknown; `403 idempotency_output_refused` where the server does not
/// allow it.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http_body_util::Full;
///
/// let records = "http://127.0.0.1:8080/_idempotency/records".parse().unwrap();
/// let request = idem_client::output_request::<Full<Bytes>>(
///     &records,
///     &http::Method::POST,
///     "/orders",
///     "order-7f3a",
///     Some(Duration::from_secs(10)),
/// )
/// .unwrap();
/// assert_eq!(
///     request.uri().query(),
///     Some("method=POST&path=%2Forders&key=order-7f3a&output=true&wait=10s")
/// );
/// ```
pub fn output_request<B: Default>(
    records: &Uri,
    method: &Method,
    path: &str,
    key: &str,
    wait: Option<Duration>,
) -> Result<Request<B>, http::Error> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query
        .append_pair("method", method.as_str())
        .append_pair("path", path)
        .append_pair("key", key)
        .append_pair("output", "true");
    if let Some(wait) = wait {
        query.append_pair("wait", &format!("{}s", wait.as_secs()));
    }
    let base = records.to_string();
    let base = base.split('?').next().unwrap_or_default();
    Request::get(format!("{base}?{}", query.finish())).body(B::default())
}
