//! The paths the gateway owns (everything under the records prefix,
//! `/healthz`, `/metrics`), decided on the path as an upstream could
//! read it, so no other spelling of them is ever forwarded.
//!
//! The gateway's routes match one exact spelling each. A request whose path
//! matched none of them reaches [`RefuseOwned`] before the layer and the
//! proxy: if any reading of its path names a gateway-owned path, it is
//! answered `404 gateway_path_reserved` and never forwarded. "Any reading"
//! is [`canonical`]: percent-escapes decoded again and again (reserved ones
//! such as `%2F` included, since an upstream or a framework in front of it
//! may decode twice), `\` read as `/`, `;parameters` dropped from each
//! segment, empty and `.` segments dropped, `..` applied, and ASCII case
//! folded. The reading is deliberately broad: a path the gateway owns under
//! any server's rules is the gateway's, and an upstream path that only
//! differs from one by those rules was never the upstream's to serve.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
};

use axum::{
    body::Body,
    extract::Request,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use futures_util::future::{Either, Ready, ready};

/// How many rounds of percent-decoding [`canonical`] applies at most; a
/// path still changing after them is read as owned (refused).
const DECODE_ROUNDS: usize = 8;

/// The one reading of a request path that decides ownership: see the
/// module's documentation. `None` when the path still decodes further
/// after [`DECODE_ROUNDS`] rounds (the caller treats it as owned).
pub(crate) fn canonical(path: &str) -> Option<String> {
    let mut bytes = path.as_bytes().to_vec();
    let mut rounds = 0;
    loop {
        let decoded: Vec<u8> = percent_decode(&bytes);
        if decoded == bytes {
            break;
        }
        rounds += 1;
        if rounds > DECODE_ROUNDS {
            return None;
        }
        bytes = decoded;
    }
    let text = String::from_utf8_lossy(&bytes).replace('\\', "/");
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        let segment = segment.split(';').next().unwrap_or_default();
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(text.len() + 1);
    for segment in segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() {
        out.push('/');
    }
    out.make_ascii_lowercase();
    Some(out)
}

/// One round of percent-decoding; an escape that is not two hex digits
/// stays as it is.
fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).and_then(|d| u8::try_from(d).ok());
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(high), Some(low)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(high << 4 | low);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// The gateway-owned paths of one configuration.
#[derive(Debug, Clone)]
pub(crate) struct OwnedPaths {
    /// The records prefix as [`canonical`] reads it.
    prefix: String,
}

impl OwnedPaths {
    /// The paths a gateway with this records prefix owns.
    pub(crate) fn new(records_prefix: &str) -> Self {
        Self {
            prefix: canonical(records_prefix).unwrap_or_else(|| records_prefix.to_owned()),
        }
    }

    /// Whether any reading of `path` names a gateway-owned path.
    pub(crate) fn owns(&self, path: &str) -> bool {
        // The common case costs one scan: a path with none of the
        // characters that change a reading, and no prefix of an owned one,
        // is the upstream's.
        let plain = !path
            .bytes()
            .any(|b| matches!(b, b'%' | b'\\' | b';' | b'.') || b.is_ascii_uppercase())
            && !path.contains("//");
        if plain {
            return self.owns_canonical(path.trim_end_matches('/'));
        }
        match canonical(path) {
            Some(read) => self.owns_canonical(&read),
            None => true,
        }
    }

    fn owns_canonical(&self, path: &str) -> bool {
        path == "/healthz"
            || path == "/metrics"
            || path
                .strip_prefix(self.prefix.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }
}

/// In front of the layer and the proxy: a request for a gateway-owned
/// path that no gateway route matched is refused, never forwarded.
#[derive(Clone)]
pub(crate) struct RefuseOwned<S> {
    owned: Arc<OwnedPaths>,
    inner: S,
}

impl<S> RefuseOwned<S> {
    pub(crate) fn new(owned: OwnedPaths, inner: S) -> Self {
        Self {
            owned: Arc::new(owned),
            inner,
        }
    }
}

impl<S> tower::Service<Request<Body>> for RefuseOwned<S>
where
    S: tower::Service<Request<Body>, Error = Infallible>,
    S::Response: IntoResponse,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<
        futures_util::future::Map<
            S::Future,
            fn(Result<S::Response, Infallible>) -> Result<Response, Infallible>,
        >,
        Ready<Result<Response, Infallible>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        use futures_util::FutureExt;
        if self.owned.owns(request.uri().path()) {
            return Either::Right(ready(Ok(refused())));
        }
        let into: fn(Result<S::Response, Infallible>) -> Result<Response, Infallible> =
            |answer| answer.map(IntoResponse::into_response);
        Either::Left(self.inner.call(request).map(into))
    }
}

fn refused() -> Response {
    crate::answer::problem(
        StatusCode::NOT_FOUND,
        "gateway_path_reserved",
        "Not found",
        "this path is the gateway's own (its records prefix, /healthz or /metrics) and is \
         never forwarded; the gateway serves only the exact paths it documents",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reading_is_decided_alike() {
        let owned = OwnedPaths::new("/_idempotency");
        for path in [
            "/_idempotency",
            "/_idempotency/",
            "/_idempotency/records",
            "//_idempotency//records",
            "/_idempotency/./records",
            "/x/../_idempotency/records",
            "/%5Fidempotency/records",
            "/_idempotency%2Frecords",
            "/_idempotency%252Frecords",
            "/_IDEMPOTENCY/Records",
            "/_idempotency;v=1/records",
            "\\_idempotency\\operator",
            "/_idempotency/operator/sign-in",
            "/healthz/",
            "/%68ealthz",
            "/metrics",
        ] {
            assert!(owned.owns(path), "{path} is the gateway's");
        }
        for path in [
            "/",
            "/orders",
            "/orders/_idempotency",
            "/_idempotency-other",
            "/_idempotencyx/records",
            "/healthzz",
            "/metrics.json",
            "/orders%2F1",
        ] {
            assert!(!owned.owns(path), "{path} is the upstream's");
        }
    }

    #[test]
    fn a_records_prefix_must_read_as_itself() {
        use crate::config::parse_prefix;
        assert_eq!(parse_prefix("/ops/idem/").as_deref(), Ok("/ops/idem"));
        assert_eq!(parse_prefix("/Ops").as_deref(), Ok("/Ops"));
        for refused in [
            "/", "//", "ops", "/a/../b", "/a//b", "/a/./b", "/%61", "/a;b", "/a\\b",
        ] {
            assert!(parse_prefix(refused).is_err(), "{refused} is refused");
        }
    }

    #[test]
    fn a_path_that_keeps_decoding_is_refused() {
        let mut path = "/orders".to_owned();
        for _ in 0..=DECODE_ROUNDS + 1 {
            path = path.replace('%', "%25").replace('/', "%2F");
        }
        assert_eq!(canonical(&path), None);
        assert!(OwnedPaths::new("/_idempotency").owns(&path));
    }
}
