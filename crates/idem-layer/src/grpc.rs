//! Unary gRPC calls through the layer.
//!
//! A gRPC call is an HTTP/2 `POST` whose `content-type` is
//! `application/grpc` (or `application/grpc+proto`, ...): the layer reads
//! its key from the `idempotency-key` metadata entry (the same syntax as
//! the HTTP header), fingerprints the request message uncompressed, and
//! stores the answer with its trailers, so that a replay returns the
//! message, `grpc-status`, `grpc-message` and every trailing metadata
//! entry byte for byte, marked `idempotent-replayed: true`.
//!
//! # What is stored
//!
//! A gRPC failure travels as HTTP 200, so the layer decides by the call's
//! `grpc-status` (from the trailers, or from the head of a trailers-only
//! answer) and by who produced it, three ways: stored, released or
//! unknown, through [`Answers::classify_grpc`](crate::settings::Answers::classify_grpc).
//! [`default_grpc_verdict`](crate::classify::default_grpc_verdict) has
//! the table, per code and producer.
//!
//! # Refusals
//!
//! The layer's refusals reach a gRPC caller as gRPC statuses in a
//! trailers-only answer, never as a problem document: `grpc-status`, a
//! percent-encoded `grpc-message` (the problem's detail), the problem
//! code in `idem-problem`, and for the refusals worth retrying a
//! `grpc-retry-pushback-ms` beside `retry-after`. [`status_for`] is the
//! mapping.
//!
//! # Streams
//!
//! Only unary calls are protected; one policy covers streaming calls:
//! * a keyed call whose request carries more than one message (client or
//!   bidirectional streaming) is refused with `UNIMPLEMENTED` and
//!   `idem-problem: idempotency_stream_refused` before anything runs;
//! * an answer of more than one message (server streaming), or one whose
//!   status has not followed its first message within [`STREAM_GRACE`],
//!   is passed on as it comes and recorded as answered but not stored: a
//!   retry gets `ALREADY_EXISTS` with `idempotency_response_not_stored`,
//!   never a stream cut short, and nothing runs twice.
//!
//! A keyed request stream that never ends is refused when the layer's body
//! timeout passes. Streaming methods should be called without a key.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

use crate::{
    ResponseBody,
    problem::{Problem, ProblemCode},
};

pub use crate::classify::code;

/// The name of a gRPC status code (`UNAVAILABLE`), as the gRPC
/// specification spells it; `None` above 16.
pub fn status_name(status: u32) -> Option<&'static str> {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    NAMES.get(status as usize).copied()
}

/// The `grpc-status` trailer (or header, in a trailers-only answer).
pub const GRPC_STATUS: HeaderName = idem_core::protocol::GRPC_STATUS;
/// The `grpc-message` trailer: the status message, percent-encoded.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// The metadata entry that carries a refusal's problem code.
pub const IDEM_PROBLEM: HeaderName = HeaderName::from_static(idem_core::protocol::GRPC_PROBLEM);
/// The metadata entry that points to the record a refusal collided with
/// (when the layer knows where the records API is).
pub const IDEM_RECORD: HeaderName = HeaderName::from_static("idem-record");
/// gRPC's retry pushback: how long a client should wait before retrying.
pub const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");

/// How long an answer's status may lag its first message before the
/// answer is taken for a stream and passed on (see the module's docs). A
/// unary handler gives its status with its message; a stream's next
/// message may be long in coming, and its first is not held back longer.
pub const STREAM_GRACE: Duration = Duration::from_millis(100);

pub use idem_core::protocol::is_grpc;

/// The earlier two-way gRPC outcome predicate, for
/// [`grpc_should_store`](crate::settings::Answers::grpc_should_store):
/// which statuses are stored and which release the key, as
/// [`default_should_store`](crate::default_should_store) stores 4xx and
/// releases 5xx. The layer's default is now three-way:
/// [`default_grpc_verdict`](crate::classify::default_grpc_verdict), which
/// keeps a deadline, a cancellation, `UNKNOWN` and `DATA_LOSS` unknown
/// instead of releasing them.
///
/// | stored | released |
/// |---|---|
/// | `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`, `UNAUTHENTICATED` | `CANCELLED`, `UNKNOWN`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`, `UNAVAILABLE`, `DATA_LOSS`, and any code above 16 |
///
/// An answer without a `grpc-status` is a broken call and releases too.
pub fn default_grpc_should_store(status: u32) -> bool {
    crate::classify::grpc_terminal(status)
}

/// The call's `grpc-status`: from the trailers, else from the head (a
/// trailers-only answer). `None` when neither has a readable one.
pub(crate) fn status(head: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<u32> {
    let holder = trailers
        .filter(|trailers| trailers.contains_key(GRPC_STATUS))
        .unwrap_or(head);
    idem_core::protocol::grpc_status(holder)
}

/// The gRPC status each refusal of the layer is sent with.
///
/// | problem `code` | gRPC status |
/// |---|---|
/// | `idempotency_key_missing`, `idempotency_key_invalid`, `request_body_invalid`, `method_case_mismatch`, `idempotency_record_query_invalid` | `INVALID_ARGUMENT` |
/// | `idempotency_tenant_missing` | `UNAUTHENTICATED` |
/// | `idempotency_admin_required` | `PERMISSION_DENIED` |
/// | `idempotency_in_progress` (with the retry hint) | `ABORTED` |
/// | `idempotency_conflict`, `idempotency_cancelled` | `FAILED_PRECONDITION` |
/// | `idempotency_response_not_stored`, `idempotency_replay_not_acceptable` | `ALREADY_EXISTS` |
/// | `request_body_too_large`, `idempotency_quota_exceeded`, `idempotency_listing_busy` | `RESOURCE_EXHAUSTED` |
/// | `request_body_timeout` | `DEADLINE_EXCEEDED` |
/// | `idempotency_store_unavailable` (with the retry hint) | `UNAVAILABLE` |
/// | `handler_failed`, `idempotency_layer_missing`, `idempotency_misconfigured`, `idempotency_transaction_not_committed` | `INTERNAL` |
/// | `idempotency_record_not_found` | `NOT_FOUND` |
/// | `idempotency_stream_refused` | `UNIMPLEMENTED` |
///
/// The statuses a generic gRPC retry policy retries (`ABORTED`,
/// `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED`) are the
/// refusals after which the same call may succeed; a conflict, a
/// cancelled record or an answer not stored never will.
pub fn status_for(code: ProblemCode) -> u32 {
    match code {
        ProblemCode::KeyMissing
        | ProblemCode::KeyInvalid
        | ProblemCode::BodyInvalid
        | ProblemCode::MethodCaseMismatch
        | ProblemCode::RecordQueryInvalid => code::INVALID_ARGUMENT,
        ProblemCode::TenantMissing => code::UNAUTHENTICATED,
        ProblemCode::AdminRequired | ProblemCode::OutputRefused => code::PERMISSION_DENIED,
        ProblemCode::InProgress | ProblemCode::OutcomeUnknown => code::ABORTED,
        ProblemCode::Conflict | ProblemCode::Cancelled => code::FAILED_PRECONDITION,
        ProblemCode::ResponseNotStored | ProblemCode::ReplayNotAcceptable => code::ALREADY_EXISTS,
        ProblemCode::BodyTooLarge | ProblemCode::QuotaExceeded | ProblemCode::ListingBusy => {
            code::RESOURCE_EXHAUSTED
        }
        ProblemCode::BodyTimeout => code::DEADLINE_EXCEEDED,
        ProblemCode::StoreUnavailable => code::UNAVAILABLE,
        ProblemCode::HandlerFailed
        | ProblemCode::LayerMissing
        | ProblemCode::Misconfigured
        | ProblemCode::TransactionNotCommitted => code::INTERNAL,
        ProblemCode::RecordNotFound => code::NOT_FOUND,
        ProblemCode::StreamRefused => code::UNIMPLEMENTED,
    }
}

/// A refusal of the layer (a response with a [`Problem`]) as a gRPC
/// caller gets it: a trailers-only answer (HTTP 200, no message) with the
/// status, the message, the code and the retry hint in its head. The
/// replay marker is kept; any other response passes unchanged.
pub(crate) fn refusal<B>(
    response: Response<ResponseBody<B>>,
    should_retry: Option<&HeaderName>,
) -> Response<ResponseBody<B>> {
    let Some(problem) = response.extensions().get::<Problem>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    let replayed = parts.headers.remove(crate::IDEMPOTENT_REPLAYED);
    // The should-retry header the layer adds, kept as metadata.
    let retry = should_retry.and_then(|name| Some((name.clone(), parts.headers.remove(name)?)));
    parts.status = StatusCode::OK;
    parts.headers.clear();
    let headers = &mut parts.headers;
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS, HeaderValue::from(status_for(problem.code)));
    if let Ok(message) = HeaderValue::from_maybe_shared(percent_encode(&problem.detail)) {
        headers.insert(GRPC_MESSAGE, message);
    }
    headers.insert(
        IDEM_PROBLEM,
        HeaderValue::from_static(problem.code.as_str()),
    );
    if let Some(href) = problem.record.as_ref().and_then(|r| r.href.as_deref())
        && let Ok(href) = HeaderValue::try_from(href)
    {
        headers.insert(IDEM_RECORD, href);
    }
    if let Some(secs) = problem.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        headers.insert(
            GRPC_RETRY_PUSHBACK,
            HeaderValue::from(secs.saturating_mul(1000)),
        );
    }
    if let Some(replayed) = replayed {
        headers.insert(crate::IDEMPOTENT_REPLAYED, replayed);
    }
    if let Some((name, value)) = retry {
        headers.insert(name, value);
    }
    Response::from_parts(parts, ResponseBody::full(Bytes::new()))
}

/// `grpc-message` encoding: bytes outside printable ASCII, and `%`, as
/// `%XX`.
fn percent_encode(message: &str) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len());
    for &byte in message.as_bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.put_u8(byte);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.put_slice(&[
                b'%',
                HEX[usize::from(byte >> 4)],
                HEX[usize::from(byte & 0xf)],
            ]);
        }
    }
    out.freeze()
}

/// A gRPC request body the layer will not fingerprint.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// More than one message: a streaming call.
    Stream,
    /// Not a sequence of length-prefixed messages, or a compressed one
    /// that does not decompress within the limit.
    Malformed(String),
}

/// The length-prefixed messages of a gRPC body: each message's
/// compressed flag and bytes.
fn messages(body: &Bytes) -> Result<Vec<(bool, Bytes)>, Unreadable> {
    let mut out = Vec::with_capacity(1);
    let mut at = 0usize;
    while at < body.len() {
        let Some(head) = body.get(at..at + 5) else {
            return Err(Unreadable::Malformed(
                "a gRPC message's prefix is cut short".to_owned(),
            ));
        };
        let compressed = match head[0] {
            0 => false,
            1 => true,
            flag => {
                return Err(Unreadable::Malformed(format!(
                    "a gRPC message's compressed flag is {flag}, neither 0 nor 1"
                )));
            }
        };
        let length = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let start = at + 5;
        let end = start
            .checked_add(length)
            .filter(|end| *end <= body.len())
            .ok_or_else(|| Unreadable::Malformed("a gRPC message is cut short".to_owned()))?;
        out.push((compressed, body.slice(start..end)));
        at = end;
    }
    Ok(out)
}

/// What a keyed gRPC request's fingerprint covers: the request message
/// uncompressed, framed as if it were sent uncompressed. `None` when that
/// is the body as it came (an uncompressed message, the usual case).
/// Compressed messages are decompressed for `gzip` and `deflate`, within
/// `limit`; another coding is fingerprinted as it came (a retry that
/// compresses it otherwise is then a conflict).
pub(crate) fn fingerprinted(
    headers: &HeaderMap,
    body: &Bytes,
    limit: usize,
) -> Result<Option<Bytes>, Unreadable> {
    let messages = messages(body)?;
    if messages.len() > 1 {
        return Err(Unreadable::Stream);
    }
    let Some((true, message)) = messages.into_iter().next() else {
        return Ok(None);
    };
    let coding = headers
        .get(GRPC_ENCODING)
        .map(HeaderValue::as_bytes)
        .unwrap_or_default();
    let plain = if coding.eq_ignore_ascii_case(b"gzip") {
        decompress(flate2::read::GzDecoder::new(&message[..]), limit)?
    } else if coding.eq_ignore_ascii_case(b"deflate") {
        decompress(flate2::read::ZlibDecoder::new(&message[..]), limit)?
    } else {
        return Ok(None);
    };
    let mut framed = BytesMut::with_capacity(plain.len() + 5);
    framed.put_u8(0);
    framed.put_u32(u32::try_from(plain.len()).unwrap_or(u32::MAX));
    framed.put_slice(&plain);
    Ok(Some(framed.freeze()))
}

fn decompress(reader: impl std::io::Read, limit: usize) -> Result<Vec<u8>, Unreadable> {
    use std::io::Read;
    let mut plain = Vec::new();
    let read = reader
        .take(limit as u64 + 1)
        .read_to_end(&mut plain)
        .map_err(|error| {
            Unreadable::Malformed(format!(
                "the compressed gRPC message does not decode: {error}"
            ))
        })?;
    if read > limit {
        return Err(Unreadable::Malformed(format!(
            "the gRPC message exceeds the limit of {limit} bytes uncompressed"
        )));
    }
    Ok(plain)
}

/// Where a gRPC answer's messages end, read as its bytes come: how many
/// messages have begun, and whether the bytes so far end exactly where a
/// message ends.
#[derive(Debug, Default)]
pub(crate) struct Framing {
    /// Bytes seen so far.
    seen: u64,
    /// Where the message being read ends (its prefix's end while the
    /// prefix itself is being read), from the start of the body.
    next_end: u64,
    /// The bytes of a prefix read so far.
    prefix: [u8; 5],
    prefix_len: usize,
    /// Messages begun.
    pub(crate) begun: u32,
}

impl Framing {
    /// Takes a chunk of the body.
    pub(crate) fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            if self.seen < self.next_end {
                // Inside a message: skip what is left of it.
                let take = (self.next_end - self.seen).min(chunk.len() as u64);
                self.seen += take;
                chunk = &chunk[take as usize..];
                continue;
            }
            // At a prefix.
            if self.prefix_len == 0 {
                self.begun += 1;
            }
            let take = (5 - self.prefix_len).min(chunk.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&chunk[..take]);
            self.prefix_len += take;
            self.seen += take as u64;
            chunk = &chunk[take..];
            if self.prefix_len == 5 {
                let p = self.prefix;
                let length = u32::from_be_bytes([p[1], p[2], p[3], p[4]]);
                self.next_end = self.seen + u64::from(length);
                self.prefix_len = 0;
            }
        }
    }

    /// Whether the bytes so far end where a message ends.
    pub(crate) fn at_boundary(&self) -> bool {
        self.prefix_len == 0 && self.seen == self.next_end
    }
}

#[cfg(test)]
mod framing_properties {
    use proptest::prelude::*;

    use super::Framing;

    proptest! {
        /// Any bytes, cut anywhere, are framed without a panic.
        #[test]
        fn any_bytes_are_framed(bytes in proptest::collection::vec(any::<u8>(), 0..200), cut in any::<usize>()) {
            let mut framing = Framing::default();
            let at = cut % (bytes.len() + 1);
            framing.feed(&bytes[..at]);
            framing.feed(&bytes[at..]);
            let _ = framing.at_boundary();
        }

        /// Messages, however their bytes are cut, are counted one by one
        /// and end at a boundary.
        #[test]
        fn messages_are_counted_however_they_are_cut(
            messages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut body = Vec::new();
            for message in &messages {
                body.push(0);
                body.extend_from_slice(&u32::try_from(message.len()).expect("short").to_be_bytes());
                body.extend_from_slice(message);
            }
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
            points.push(0);
            points.push(body.len());
            points.sort_unstable();
            let mut framing = Framing::default();
            for pair in points.windows(2) {
                framing.feed(&body[pair[0]..pair[1]]);
            }
            prop_assert_eq!(framing.begun as usize, messages.len());
            prop_assert!(framing.at_boundary());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(compressed: bool, message: &[u8]) -> Vec<u8> {
        let mut out = vec![u8::from(compressed)];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn grpc_content_types() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC",
            "application/grpc; charset=x",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(yes));
            assert!(is_grpc(&headers), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(no));
            assert!(!is_grpc(&headers), "{no}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn one_uncompressed_message_is_fingerprinted_as_it_came() {
        let body = Bytes::from(frame(false, b"charge 100"));
        assert_eq!(fingerprinted(&HeaderMap::new(), &body, 1024), Ok(None));
        assert_eq!(
            fingerprinted(&HeaderMap::new(), &Bytes::new(), 1024),
            Ok(None)
        );
    }

    #[test]
    fn a_compressed_message_is_fingerprinted_uncompressed() {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(b"charge 100").expect("write");
        let gzipped = encoder.finish().expect("gzip");
        let mut headers = HeaderMap::new();
        headers.insert(GRPC_ENCODING, HeaderValue::from_static("gzip"));
        let body = Bytes::from(frame(true, &gzipped));
        assert_eq!(
            fingerprinted(&headers, &body, 1024),
            Ok(Some(Bytes::from(frame(false, b"charge 100"))))
        );
        // Over the limit once decompressed: refused, not truncated.
        assert!(matches!(
            fingerprinted(&headers, &body, 4),
            Err(Unreadable::Malformed(_))
        ));
    }

    #[test]
    fn two_messages_are_a_stream_and_a_cut_one_is_malformed() {
        let mut two = frame(false, b"a");
        two.extend(frame(false, b"b"));
        assert_eq!(
            fingerprinted(&HeaderMap::new(), &Bytes::from(two), 1024),
            Err(Unreadable::Stream)
        );
        let cut = Bytes::from(frame(false, b"abc")[..6].to_vec());
        assert!(matches!(
            fingerprinted(&HeaderMap::new(), &cut, 1024),
            Err(Unreadable::Malformed(_))
        ));
        let flag = Bytes::from(vec![7, 0, 0, 0, 0]);
        assert!(matches!(
            fingerprinted(&HeaderMap::new(), &flag, 1024),
            Err(Unreadable::Malformed(_))
        ));
    }

    #[test]
    fn framing_counts_messages_across_any_split() {
        let mut body = frame(false, b"first");
        body.extend(frame(false, b""));
        body.extend(frame(false, b"third"));
        for split in 1..body.len() {
            let mut framing = Framing::default();
            let mut boundaries = Vec::new();
            for chunk in body.chunks(split) {
                framing.feed(chunk);
                boundaries.push(framing.at_boundary());
            }
            assert_eq!(framing.begun, 3, "split {split}");
            assert!(framing.at_boundary(), "split {split}");
        }
        let mut framing = Framing::default();
        framing.feed(&frame(false, b"first")[..7]);
        assert_eq!(framing.begun, 1);
        assert!(!framing.at_boundary());
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(
            percent_encode("a 100% é"),
            Bytes::from_static(b"a 100%25 %C3%A9")
        );
    }

    #[test]
    fn every_problem_has_a_status_and_only_cures_are_retryable() {
        for code in ProblemCode::ALL {
            let status = status_for(*code);
            let retryable = matches!(
                status,
                code::ABORTED
                    | code::UNAVAILABLE
                    | code::RESOURCE_EXHAUSTED
                    | code::DEADLINE_EXCEEDED
            );
            if matches!(
                code,
                ProblemCode::Conflict | ProblemCode::Cancelled | ProblemCode::ResponseNotStored
            ) {
                assert!(!retryable, "{code:?}");
            }
        }
        assert_eq!(status_for(ProblemCode::InProgress), code::ABORTED);
        assert_eq!(status_for(ProblemCode::StoreUnavailable), code::UNAVAILABLE);
    }

    #[test]
    fn the_default_predicate_stores_what_a_retry_repeats() {
        let stored: Vec<u32> = (0..20).filter(|c| default_grpc_should_store(*c)).collect();
        assert_eq!(stored, vec![0, 3, 5, 6, 7, 9, 11, 12, 16]);
    }
}

/// The layer for a server whose request body the layer cannot rebuild:
/// tonic's. The layer hands its inner service a request rebuilt from the
/// buffered bytes, so it asks the body type to be made from `Bytes`
/// (axum's `Body`, `Full<Bytes>`); tonic's `Body` is not. This layer takes
/// any request body, gives the service behind it axum's `Body` (which
/// tonic's services, like axum's, accept), and is otherwise the layer it
/// was made from. Made by [`IdempotencyLayer::for_any_body`](crate::IdempotencyLayer::for_any_body):
///
/// ```text
/// tonic::transport::Server::builder()
///     .layer(layer.for_any_body())
///     .add_service(payments)
/// ```
#[cfg(feature = "axum")]
pub struct AnyBodyLayer<S> {
    layer: crate::IdempotencyLayer<S>,
}

#[cfg(feature = "axum")]
impl<S> Clone for AnyBodyLayer<S> {
    fn clone(&self) -> Self {
        Self {
            layer: self.layer.clone(),
        }
    }
}

#[cfg(feature = "axum")]
impl<S> std::fmt::Debug for AnyBodyLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyBodyLayer")
            .field("layer", &self.layer)
            .finish()
    }
}

#[cfg(feature = "axum")]
impl<S: idem_core::Store> crate::IdempotencyLayer<S> {
    /// This layer for a server that hands it a request body it cannot
    /// rebuild after buffering (tonic's): see [`AnyBodyLayer`].
    pub fn for_any_body(self) -> AnyBodyLayer<S> {
        AnyBodyLayer { layer: self }
    }
}

#[cfg(feature = "axum")]
impl<S: idem_core::Store, I> tower::Layer<I> for AnyBodyLayer<S> {
    type Service = AnyBody<crate::Idempotency<I, S>>;

    fn layer(&self, inner: I) -> Self::Service {
        AnyBody(self.layer.layer(inner))
    }
}

/// The service [`AnyBodyLayer`] makes: a request of any body type goes
/// on with axum's `Body`, wrapping it without reading it.
#[cfg(feature = "axum")]
#[derive(Clone, Debug)]
pub struct AnyBody<T>(T);

#[cfg(feature = "axum")]
impl<T, B> tower::Service<http::Request<B>> for AnyBody<T>
where
    T: tower::Service<http::Request<axum::body::Body>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<crate::BoxError>,
{
    type Response = T::Response;
    type Error = T::Error;
    type Future = T::Future;

    #[inline]
    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        self.0.call(request.map(axum::body::Body::new))
    }
}
