//! W3C trace context: the gateway continues the caller's trace (or starts
//! one) and hands the upstream a `traceparent` whose parent is the
//! gateway's own span.
//!
//! A `traceparent` is `version-traceid-parentid-flags` in lower-case hex
//! (`00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`). One the
//! gateway cannot read (a wrong length, upper case, an all-zero id, the
//! forbidden version `ff`) is dropped with its `tracestate`, and a trace
//! is started, as the W3C recommendation says; a later version is read
//! for its first four fields.
//!
//! With `--otlp-endpoint`, the gateway also exports its span of each
//! request over OTLP/HTTP (protobuf): the request's method and path, the
//! status, the idempotency outcome and, for a request that reached the
//! upstream, the scope hash and the attempt (never the raw key). A trace
//! the caller did not sample is not exported. Without it, nothing is
//! recorded: the gateway only passes the trace on.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use axum::{extract::Request, response::Response};
use http::{HeaderMap, HeaderValue};
use opentelemetry::{
    KeyValue,
    trace::{
        Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
        Tracer as _, TracerProvider as _,
    },
};
use rand::Rng;

use crate::StartError;

/// The header that carries the trace and the parent span.
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The header of vendors' trace state, passed on with the trace.
pub(crate) const TRACESTATE: &str = "tracestate";

/// The gateway's hop of a trace: the trace, the caller's span (if the
/// caller sent one) and the gateway's own span, which the upstream gets
/// as its parent.
#[derive(Debug, Clone)]
pub(crate) struct Hop {
    /// The trace's id.
    pub(crate) trace_id: [u8; 16],
    /// The caller's span, when it sent a `traceparent`.
    pub(crate) parent_id: Option<[u8; 8]>,
    /// The gateway's span for this request.
    pub(crate) span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub(crate) flags: u8,
    /// What the proxy notes for the exported span (the scope hash and
    /// the attempt of a keyed request); only when spans are exported.
    pub(crate) noted: Option<Arc<OnceLock<(String, u64)>>>,
}

/// A caller's `traceparent`: trace id, parent id and flags.
fn parse(value: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    // version "-" trace-id "-" parent-id "-" flags: 55 bytes for version
    // 00, which ends there; a later version may add fields after a "-".
    if value.len() < 55 || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let version = hex_byte(&value[0..2])?;
    if version == 0xff || (version == 0 && value.len() != 55) {
        return None;
    }
    if version != 0 && value.len() > 55 && value[55] != b'-' {
        return None;
    }
    let mut trace_id = [0; 16];
    for (i, byte) in trace_id.iter_mut().enumerate() {
        *byte = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent_id = [0; 8];
    for (i, byte) in parent_id.iter_mut().enumerate() {
        *byte = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&value[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some((trace_id, parent_id, flags))
}

/// The caller's `traceparent`, if it sent exactly one the gateway reads.
fn caller(headers: &HeaderMap) -> Option<([u8; 16], [u8; 8], u8)> {
    let mut values = headers.get_all(TRACEPARENT).iter();
    match (values.next(), values.next()) {
        (Some(one), None) => parse(one.as_bytes()),
        // None, or several: none to continue.
        _ => None,
    }
}

/// Two lower-case hex digits.
fn hex_byte(digits: &[u8]) -> Option<u8> {
    let digit = |d: u8| match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    };
    Some(digit(digits[0])? << 4 | digit(digits[1])?)
}

/// A random id that is not all zeros (which the W3C format forbids).
fn random_id<const N: usize>() -> [u8; N] {
    let mut rng = rand::rng();
    loop {
        let id: [u8; N] = rng.random();
        if id != [0; N] {
            return id;
        }
    }
}

impl Hop {
    /// The hop of a request with these headers: the caller's trace
    /// continued, or a new one. `sampled` marks a new trace as sampled
    /// (the gateway exports its spans); a continued trace keeps the
    /// caller's flags.
    pub(crate) fn of(headers: &HeaderMap, sampled: bool) -> Self {
        match caller(headers) {
            Some((trace_id, parent_id, flags)) => Self {
                trace_id,
                parent_id: Some(parent_id),
                span_id: random_id(),
                flags,
                noted: None,
            },
            None => Self {
                trace_id: random_id(),
                parent_id: None,
                span_id: random_id(),
                flags: u8::from(sampled),
                noted: None,
            },
        }
    }

    /// Notes the scope hash and the attempt of the request for the
    /// exported span (the proxy calls it; a no-op when nothing is
    /// exported).
    pub(crate) fn note(&self, scope: impl FnOnce() -> String, attempt: u64) {
        if let Some(noted) = &self.noted {
            let _ = noted.set((scope(), attempt));
        }
    }

    /// The `traceparent` the upstream gets: this trace, the gateway's
    /// span as the parent.
    pub(crate) fn traceparent(&self) -> HeaderValue {
        // Written in place: no string is built per request.
        let mut text = [0u8; 55];
        text[..3].copy_from_slice(b"00-");
        let _ = hex::encode_to_slice(self.trace_id, &mut text[3..35]);
        text[35] = b'-';
        let _ = hex::encode_to_slice(self.span_id, &mut text[36..52]);
        text[52] = b'-';
        let _ = hex::encode_to_slice([self.flags], &mut text[53..55]);
        // Hex digits and dashes are a valid header value: the fallback is
        // never taken.
        HeaderValue::from_bytes(&text).unwrap_or_else(|_| {
            HeaderValue::from_static("00-00000000000000000000000000000001-0000000000000001-00")
        })
    }

    /// Sets the upstream's trace headers: its `traceparent`, and the
    /// caller's `tracestate` only when the caller's trace is continued.
    pub(crate) fn write(&self, headers: &mut HeaderMap) {
        headers.insert(TRACEPARENT, self.traceparent());
        if self.parent_id.is_none() {
            headers.remove(TRACESTATE);
        }
    }
}

/// The gateway's span exporter (`--otlp-endpoint`).
#[derive(Clone)]
pub(crate) struct Spans {
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::SdkTracer,
}

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spans")
    }
}

/// The exporter's HTTP client: hyper on the gateway's runtime. The
/// batch processor exports from a thread of its own, outside any
/// runtime; each export is spawned onto the runtime the gateway started
/// on, and the thread waits for it.
#[derive(Debug)]
struct OnRuntime {
    runtime: tokio::runtime::Handle,
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<bytes::Bytes>,
    >,
}

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        use http_body_util::BodyExt;
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            tokio::time::timeout(EXPORT_TIMEOUT, async move {
                let response = client
                    .request(request.map(http_body_util::Full::new))
                    .await?;
                let (parts, body) = response.into_parts();
                let body = http_body_util::Limited::new(body, 1 << 20)
                    .collect()
                    .await?;
                Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(
                    parts,
                    body.to_bytes(),
                ))
            })
            .await
            .map_err(|_| -> opentelemetry_http::HttpError { "the export timed out".into() })?
        });
        sent.await?
    }
}

impl Spans {
    /// An exporter to the OTLP/HTTP collector at `endpoint` (its base
    /// URL: spans go to `{endpoint}/v1/traces`), batched, sent about
    /// every second; an `https` collector is verified with `tls`. Call on
    /// the runtime the exports should run on.
    pub(crate) fn start(
        endpoint: &http::Uri,
        tls: rustls::ClientConfig,
    ) -> Result<Self, StartError> {
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
        let base = endpoint.to_string();
        let url = format!("{}/v1/traces", base.trim_end_matches('/'));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        let client = OnRuntime {
            runtime: tokio::runtime::Handle::current(),
            client: hyper_util::client::legacy::Client::builder(
                hyper_util::rt::TokioExecutor::new(),
            )
            .build(connector),
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|error| StartError::Setting(format!("--otlp-endpoint: {error}")))?;
        let batches = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                opentelemetry_sdk::trace::BatchConfigBuilder::default()
                    .with_scheduled_delay(Duration::from_secs(1))
                    .build(),
            )
            .build();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_resource(
                opentelemetry_sdk::Resource::builder_empty()
                    .with_service_name("idem-gateway")
                    .build(),
            )
            .build();
        let tracer = provider.tracer("idem-gateway");
        Ok(Self { provider, tracer })
    }

    /// Sends what is left and stops (at shutdown); blocks, so it runs
    /// off the runtime's threads.
    pub(crate) async fn shutdown(self) {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
}

/// Gives the request its [`Hop`] (the proxy passes it to the upstream)
/// and, with `spans`, exports the gateway's span of it once answered.
/// `outcome` says how the response was answered (given whether the
/// request was keyed).
pub(crate) async fn traced<F: Future<Output = Response>>(
    spans: Option<&Spans>,
    mut request: Request,
    next: impl FnOnce(Request) -> F,
    outcome: impl FnOnce(bool, &Response) -> &'static str,
) -> Response {
    let Some(spans) = spans else {
        let hop = Hop::of(request.headers(), false);
        request.extensions_mut().insert(hop);
        return next(request).await;
    };
    let caller = caller(request.headers());
    let parent = match caller {
        Some((trace_id, parent_id, flags)) => opentelemetry::Context::new()
            .with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(trace_id),
                SpanId::from_bytes(parent_id),
                TraceFlags::new(flags),
                true,
                TraceState::default(),
            )),
        None => opentelemetry::Context::new(),
    };
    let method = request.method().as_str().to_owned();
    let path = request.uri().path().to_owned();
    let builder = spans
        .tracer
        .span_builder(format!("{method} {path}"))
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("http.request.method", method),
            KeyValue::new("url.path", path),
        ]);
    let mut span = spans.tracer.build_with_context(builder, &parent);
    let context = span.span_context().clone();
    let noted = Arc::new(OnceLock::new());
    request.extensions_mut().insert(Hop {
        trace_id: context.trace_id().to_bytes(),
        parent_id: caller.map(|(_, parent_id, _)| parent_id),
        span_id: context.span_id().to_bytes(),
        flags: context.trace_flags().to_u8(),
        noted: Some(Arc::clone(&noted)),
    });
    let keyed = request.headers().contains_key(idem_layer::IDEMPOTENCY_KEY);
    let response = next(request).await;
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(response.status().as_u16()),
    ));
    span.set_attribute(KeyValue::new("idem.outcome", outcome(keyed, &response)));
    if let Some((scope, attempt)) = noted.get() {
        span.set_attribute(KeyValue::new("idem.scope", scope.clone()));
        span.set_attribute(KeyValue::new(
            "idem.attempt",
            i64::try_from(*attempt).unwrap_or(i64::MAX),
        ));
    }
    if response.status().is_server_error() {
        span.set_status(opentelemetry::trace::Status::error(
            response.status().to_string(),
        ));
    }
    span.end();
    response
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::parse;

    proptest! {
        /// Any `traceparent` value is read or refused, never a panic.
        #[test]
        fn any_traceparent_is_read_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = parse(&bytes);
        }

        /// A version 00 `traceparent` of non-zero ids reads back to its ids
        /// and flags; a later version with more fields reads its first.
        #[test]
        fn a_traceparent_reads_back(trace in any::<[u8; 16]>(), parent in any::<[u8; 8]>(), flags in any::<u8>(), extra in "(-[0-9a-f]{1,8})?") {
            prop_assume!(trace != [0; 16] && parent != [0; 8]);
            let text = format!("00-{}-{}-{:02x}", hex::encode(trace), hex::encode(parent), flags);
            prop_assert_eq!(parse(text.as_bytes()), Some((trace, parent, flags)));
            let later = format!("01{}{extra}", &text[2..]);
            prop_assert_eq!(parse(later.as_bytes()), Some((trace, parent, flags)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_callers_trace_is_continued_with_the_gateways_span_as_parent() {
        let hop = Hop::of(&headers(&[(TRACEPARENT, CALLER)]), false);
        assert_eq!(
            hex::encode(hop.trace_id),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(
            hop.parent_id.map(hex::encode).as_deref(),
            Some("00f067aa0ba902b7")
        );
        assert_eq!(hop.flags, 1);
        assert_ne!(hop.span_id, [0; 8]);
        let sent = hop.traceparent();
        let sent = sent.to_str().expect("ascii");
        assert_eq!(sent.len(), 55);
        assert!(
            sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{sent}"
        );
        assert!(sent.ends_with("-01"), "{sent}");
        assert!(
            !sent.contains("00f067aa0ba902b7"),
            "the gateway's own span: {sent}"
        );
        let mut upstream = headers(&[(TRACESTATE, "congo=t61rcWkgMzE")]);
        hop.write(&mut upstream);
        assert_eq!(upstream[TRACESTATE], "congo=t61rcWkgMzE");
        // Each request is a span of its own.
        assert_ne!(
            Hop::of(&headers(&[(TRACEPARENT, CALLER)]), false).span_id,
            hop.span_id
        );
    }

    #[test]
    fn an_unreadable_traceparent_starts_a_trace_and_drops_its_tracestate() {
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "",
        ] {
            let hop = Hop::of(&headers(&[(TRACEPARENT, bad), (TRACESTATE, "a=b")]), false);
            assert_eq!(hop.parent_id, None, "{bad:?}");
            assert_ne!(
                hex::encode(hop.trace_id),
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
            assert_eq!(hop.flags, 0);
            let mut upstream = headers(&[(TRACESTATE, "a=b")]);
            hop.write(&mut upstream);
            assert!(upstream.get(TRACESTATE).is_none(), "{bad:?}");
        }
        // Two values: which one to continue is unknown.
        let two = headers(&[(TRACEPARENT, CALLER), (TRACEPARENT, CALLER)]);
        assert_eq!(Hop::of(&two, false).parent_id, None);
    }

    #[test]
    fn a_later_version_is_read_for_its_first_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        let hop = Hop::of(&headers(&[(TRACEPARENT, later)]), false);
        assert_eq!(
            hop.parent_id.map(hex::encode).as_deref(),
            Some("00f067aa0ba902b7")
        );
        assert!(
            hop.traceparent()
                .to_str()
                .expect("ascii")
                .starts_with("00-4bf9")
        );
    }

    #[test]
    fn a_new_trace_is_sampled_when_the_gateway_exports() {
        assert_eq!(Hop::of(&HeaderMap::new(), true).flags, 1);
        let a = Hop::of(&HeaderMap::new(), false);
        let b = Hop::of(&HeaderMap::new(), false);
        assert_ne!(a.trace_id, b.trace_id);
        assert_eq!(a.traceparent().len(), 55);
    }
}
