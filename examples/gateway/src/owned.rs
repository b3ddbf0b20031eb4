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
//! may decode twice; IIS's `%uXXXX` too), the path cut at a decoded NUL,
//! `?` or `#`, overlong UTF-8 read as the ASCII it encodes, `\` read as
//! `/`, `;parameters` dropped from each segment, Windows' readings of a
//! segment applied (trailing dots and spaces, `::$DATA`, a `~1` short
//! name), empty and all-dot segments dropped, `..` applied, and letters
//! folded as a case-insensitive server compares them (Unicode case, so
//! `ı` reads as `i`; fullwidth forms as ASCII). Everything under the
//! records prefix, `/healthz` and `/metrics` is owned. The reading is deliberately broad: a path the gateway owns under
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

/// The operator page's session cookie: the gateway's own credential,
/// never forwarded (crate::proxy strips it).
pub(crate) const COOKIE: &str = "idem_operator";

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
    // A server that stops at a NUL, or splits the query off after
    // decoding, reads no further.
    if let Some(end) = bytes.iter().position(|&b| matches!(b, 0 | b'?' | b'#')) {
        bytes.truncate(end);
    }
    let text = fold(&String::from_utf8_lossy(&without_overlongs(&bytes))).replace('\\', "/");
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        match windows_name(segment.split(';').next().unwrap_or_default()) {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            // Three dots or more: some servers read them as one or two.
            dots if dots.bytes().all(|b| b == b'.') => {}
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
    Some(out)
}

/// A segment as Windows reads a file name: trailing dots and spaces
/// dropped, an alternate stream (`::$DATA`) and a short name's `~1` cut.
fn windows_name(segment: &str) -> &str {
    let segment = segment.split("::").next().unwrap_or_default();
    let segment = match segment.rsplit_once('~') {
        Some((name, digits))
            if !name.is_empty()
                && !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit()) =>
        {
            name
        }
        _ => segment,
    };
    let trimmed = segment.trim_end_matches(['.', ' ']);
    // A segment of dots keeps them: `.` and `..` are read as such.
    if trimmed.is_empty() { segment } else { trimmed }
}

/// Letters folded as a case-insensitive server may compare them: each
/// character's upper case, lowered (so `ı` and `ſ` read as `i` and `s`),
/// fullwidth forms read as the ASCII they stand for.
fn fold(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let c = match u32::from(c) {
            // Fullwidth ASCII (U+FF01 to U+FF5E).
            code @ 0xFF01..=0xFF5E => char::from_u32(code - 0xFEE0).unwrap_or(c),
            _ => c,
        };
        for upper in c.to_uppercase() {
            out.extend(upper.to_lowercase());
        }
    }
    out
}

/// Overlong UTF-8 forms of ASCII (`C0 AF` for `/`) read as the ASCII they
/// encode, as a lenient decoder reads them.
fn without_overlongs(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let next = |k: usize| bytes.get(i + k).copied().filter(|c| c & 0xC0 == 0x80);
        if matches!(b, 0xC0 | 0xC1)
            && let Some(c1) = next(1)
        {
            out.push(((b & 0x1F) << 6) | (c1 & 0x3F));
            i += 2;
        } else if b == 0xE0
            && let (Some(c1), Some(c2)) = (next(1), next(2))
            && c1 < 0xA0
        {
            let code = (u32::from(c1 & 0x3F) << 6) | u32::from(c2 & 0x3F);
            out.push(u8::try_from(code).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    out
}

/// One round of percent-decoding (and of `%uXXXX`, as IIS decodes it); an
/// escape that is not one stays as it is.
pub(crate) fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let at = |k: usize| bytes.get(i + k).copied().and_then(hex);
            if let (Some(high), Some(low)) = (at(1), at(2)) {
                out.push(u8::try_from(high << 4 | low).unwrap_or(b'?'));
                i += 3;
                continue;
            }
            if matches!(bytes.get(i + 1), Some(b'u' | b'U'))
                && let (Some(a), Some(b), Some(c), Some(d)) = (at(2), at(3), at(4), at(5))
            {
                let unit = a << 12 | b << 8 | c << 4 | d;
                let mut buffer = [0; 4];
                let c = char::from_u32(unit).unwrap_or('?');
                out.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
                i += 6;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
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
        // The common case costs one scan: a path of lower-case letters,
        // digits, `/`, `-` and `_` only, no `//`, reads as itself.
        let plain = path.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'/' | b'-' | b'_')
        }) && !path.contains("//");
        if plain {
            return self.owns_canonical(path.trim_end_matches('/'));
        }
        match canonical(path) {
            Some(read) => self.owns_canonical(&read),
            None => true,
        }
    }

    fn owns_canonical(&self, path: &str) -> bool {
        let under = |prefix: &str| {
            path.strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        };
        under("/healthz") || under("/metrics") || under(&self.prefix)
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
mod properties {
    use proptest::prelude::*;

    use super::{OwnedPaths, canonical};

    proptest! {
        /// Any path, any bytes in it, is read without a panic, and a path
        /// the fast reading takes as the upstream's reads so in full too.
        #[test]
        fn any_path_is_read(path in "\\PC{0,60}") {
            let owned = OwnedPaths::new("/_idempotency");
            let _ = canonical(&path);
            let _ = owned.owns(&path);
        }

        /// Every byte of an owned path escaped, once or twice, is owned.
        #[test]
        fn an_owned_path_escaped_is_owned(twice in any::<bool>(), rest in "[a-z/]{0,12}") {
            let owned = OwnedPaths::new("/_idempotency");
            let path = format!("/_idempotency/{rest}");
            let mut escaped: String = path.bytes().map(|b| format!("%{b:02X}")).collect();
            if twice {
                escaped = escaped.replace('%', "%25");
            }
            prop_assert!(owned.owns(&escaped), "{escaped}");
        }
    }
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
            "/metrics/x",
            "/%u005Fidempotency/records",
            "/%u0068ealthz",
            "/_idempotency%00/records",
            "/healthz%00",
            "/metrics%00.css",
            "/_idempotency%3F/records",
            "/healthz%23",
            "/_idempotency%253F",
            "/_%C4%B1dempotency/records",
            "/metric%C5%BF",
            "/healthz.",
            "/_idempotency./records",
            "/_idempotency%2E/records",
            "/healthz::$DATA",
            "/_idempotency~1/records",
            "/x%C0%AF..%C0%AFhealthz",
            "/x%E0%80%AF..%E0%80%AFmetrics",
            "/.../healthz",
            "/....//healthz",
            "/%EF%BC%BFidempotency/records",
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
            "/orders/~1",
            "/orders/a.b",
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
            "/", "//", "ops", "/a/../b", "/a//b", "/a/./b", "/%61", "/a;b", "/a\\b", "/a?b",
            "/a#b", "/A B", "/ä", "/a.", "/a~1",
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
