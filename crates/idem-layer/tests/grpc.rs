//! gRPC answers through the layer, at the level of HTTP frames: trailing
//! metadata stored and replayed byte for byte, outcomes judged by
//! `grpc-status`, answers that stream passed on as they come and never
//! replayed, compressed request messages fingerprinted uncompressed, and
//! the trailers of plain HTTP answers kept too.

use std::{
    convert::Infallible,
    io::Write,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use idem_layer::{IdempotencyLayer, TenantFromHeader, grpc};
use idem_memory::MemoryStore;
use tokio::sync::mpsc;
use tower::{Service, ServiceExt};

/// What the handler answers this time.
#[derive(Clone)]
enum Answer {
    /// One message, then these trailers.
    Unary {
        status: &'static str,
        trailers: Vec<(&'static str, &'static str)>,
    },
    /// A trailers-only answer: the status in the head.
    TrailersOnly { status: &'static str },
    /// Messages fed by the test, as they come.
    Stream,
    /// A plain HTTP answer with trailers.
    Http,
}

#[derive(Clone)]
struct Handler {
    answer: Arc<Mutex<Answer>>,
    runs: Arc<AtomicUsize>,
    senders: Arc<Mutex<Vec<mpsc::UnboundedSender<Frame<Bytes>>>>>,
}

impl Handler {
    fn new(answer: Answer) -> Self {
        Self {
            answer: Arc::new(Mutex::new(answer)),
            runs: Arc::default(),
            senders: Arc::default(),
        }
    }

    fn answer(&self, answer: Answer) {
        *self.answer.lock().expect("answer") = answer;
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn respond(&self) -> Response<Body> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let answer = self.answer.lock().expect("answer").clone();
        let grpc = Response::builder()
            .header("content-type", "application/grpc")
            .header("x-run", self.runs().to_string());
        match answer {
            Answer::Unary { status, trailers } => {
                let mut map = HeaderMap::new();
                map.insert("grpc-status", HeaderValue::from_static(status));
                for (name, value) in trailers {
                    map.append(name, HeaderValue::from_static(value));
                }
                let frames = vec![Frame::data(message(b"paid")), Frame::trailers(map)];
                let stream =
                    futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
                grpc.body(Body::new(http_body_util::StreamBody::new(stream)))
            }
            Answer::TrailersOnly { status } => grpc
                .header("grpc-status", status)
                .header("grpc-message", "refused")
                .body(Body::empty()),
            Answer::Stream => {
                let (sender, mut receiver) = mpsc::unbounded_channel();
                self.senders.lock().expect("senders").push(sender);
                let stream = futures_util::stream::poll_fn(move |cx| {
                    receiver.poll_recv(cx).map(|f| f.map(Ok::<_, Infallible>))
                });
                grpc.body(Body::new(http_body_util::StreamBody::new(stream)))
            }
            Answer::Http => {
                let mut map = HeaderMap::new();
                map.insert("x-checksum", HeaderValue::from_static("abc123"));
                let frames = vec![
                    Frame::data(Bytes::from_static(b"{\"ok\":true}")),
                    Frame::trailers(map),
                ];
                let stream =
                    futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .body(Body::new(http_body_util::StreamBody::new(stream)))
            }
        }
        .expect("response")
    }

    /// Sends `frame` on the open stream.
    fn send(&self, frame: Frame<Bytes>) {
        let senders = self.senders.lock().expect("senders");
        let sender = senders.last().expect("an open stream");
        let _ = sender.send(frame);
    }
}

/// One length-prefixed, uncompressed message.
fn message(bytes: &[u8]) -> Bytes {
    framed(false, bytes)
}

fn framed(compressed: bool, bytes: &[u8]) -> Bytes {
    let mut out = vec![u8::from(compressed)];
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
    Bytes::from(out)
}

type App = tower::util::BoxCloneService<
    Request<Body>,
    Response<idem_layer::ResponseBody<Body>>,
    Infallible,
>;

/// Where a test keeps the scope its keyed call ran under.
type Scope = Arc<Mutex<Option<idem_layer::ScopeHash>>>;

/// `handler` behind `layer`, noting each call's scope in `scope`.
fn layered<S: idem_core::Store>(
    layer: &IdempotencyLayer<S>,
    handler: &Handler,
    scope: &Scope,
) -> App {
    let (handler, scope) = (handler.clone(), scope.clone());
    let service = tower::service_fn(move |request: Request<Body>| {
        let context = request.extensions().get::<idem_layer::IdempotencyContext>();
        *scope.lock().expect("scope") = context.map(|c| c.scope);
        let handler = handler.clone();
        async move { Ok::<_, Infallible>(handler.respond()) }
    });
    tower::util::BoxCloneService::new(tower::Layer::layer(layer, service))
}

fn tenant_layer<S: idem_core::Store>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store).tenant(TenantFromHeader::from_static("x-tenant"))
}

fn app(handler: &Handler) -> App {
    layered(
        &tenant_layer(MemoryStore::new()),
        handler,
        &Scope::default(),
    )
}

fn call_request(key: &str, body: Bytes, grpc: bool) -> Request<Body> {
    let mut request = Request::post("/payments.v1.Payments/Charge")
        .header("x-tenant", "acme")
        .header("idempotency-key", key);
    if grpc {
        request = request.header("content-type", "application/grpc");
    }
    request.body(Body::from(body)).expect("request")
}

struct Got {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

async fn call(app: &mut App, request: Request<Body>) -> Got {
    let response = app
        .ready()
        .await
        .expect("ready")
        .call(request)
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("body");
    Got {
        status: parts.status,
        headers: parts.headers,
        trailers: collected.trailers().cloned(),
        body: collected.to_bytes(),
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test]
async fn trailing_metadata_is_replayed_byte_for_byte() {
    let handler = Handler::new(Answer::Unary {
        status: "0",
        trailers: vec![
            ("x-ledger-balance", "1250"),
            ("x-audit", "a"),
            ("x-audit", "b"),
        ],
    });
    let mut app = app(&handler);
    let first = call(&mut app, call_request("t-1", message(b"charge"), true)).await;
    let replay = call(&mut app, call_request("t-1", message(b"charge"), true)).await;
    assert_eq!(handler.runs(), 1);
    assert_eq!(first.status, StatusCode::OK);
    let trailers = first.trailers.expect("the first caller gets the trailers");
    assert_eq!(header(&trailers, "x-ledger-balance"), Some("1250"));
    let audit: Vec<_> = trailers.get_all("x-audit").iter().collect();
    assert_eq!(audit, ["a", "b"]);
    assert_eq!(replay.trailers, Some(trailers), "every trailer, in order");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.body, message(b"paid"));
    assert_eq!(header(&replay.headers, "idempotent-replayed"), Some("true"));
    assert_eq!(header(&replay.headers, "x-run"), Some("1"));
    assert_eq!(header(&replay.headers, "idem-trailer"), None, "kept apart");
}

#[tokio::test]
async fn a_status_a_retry_may_cure_releases_the_key_and_one_it_would_repeat_is_stored() {
    let handler = Handler::new(Answer::Unary {
        status: "14",
        trailers: vec![],
    });
    let mut app = app(&handler);
    // UNAVAILABLE in the trailers, after a message: released.
    let down = call(&mut app, call_request("r-1", message(b"x"), true)).await;
    assert_eq!(
        header(down.trailers.as_ref().expect("trailers"), "grpc-status"),
        Some("14")
    );
    handler.answer(Answer::Unary {
        status: "0",
        trailers: vec![],
    });
    let ran = call(&mut app, call_request("r-1", message(b"x"), true)).await;
    assert_eq!(handler.runs(), 2);
    assert_eq!(header(&ran.headers, "idempotent-replayed"), None);

    // A trailers-only FAILED_PRECONDITION: stored, replayed as it was.
    handler.answer(Answer::TrailersOnly { status: "9" });
    let refused = call(&mut app, call_request("r-2", message(b"y"), true)).await;
    let again = call(&mut app, call_request("r-2", message(b"y"), true)).await;
    assert_eq!(handler.runs(), 3);
    assert_eq!(header(&refused.headers, "grpc-status"), Some("9"));
    assert_eq!(header(&again.headers, "grpc-status"), Some("9"));
    assert_eq!(header(&again.headers, "grpc-message"), Some("refused"));
    assert_eq!(header(&again.headers, "idempotent-replayed"), Some("true"));
    assert!(again.body.is_empty() && again.trailers.is_none());

    // An answer without any status is a broken call: released.
    handler.answer(Answer::TrailersOnly { status: "nope" });
    call(&mut app, call_request("r-3", message(b"z"), true)).await;
    call(&mut app, call_request("r-3", message(b"z"), true)).await;
    assert_eq!(handler.runs(), 5);
}

#[tokio::test]
async fn the_grpc_predicate_is_configurable() {
    let handler = Handler::new(Answer::TrailersOnly { status: "9" });
    let layer =
        tenant_layer(MemoryStore::new()).answers(|a| a.grpc_should_store(|status| status == 0));
    let mut app = layered(&layer, &handler, &Scope::default());
    call(&mut app, call_request("p-1", message(b"x"), true)).await;
    call(&mut app, call_request("p-1", message(b"x"), true)).await;
    assert_eq!(handler.runs(), 2, "FAILED_PRECONDITION now releases");
}

fn grpc_end() -> Frame<Bytes> {
    let mut end = HeaderMap::new();
    end.insert("grpc-status", HeaderValue::from_static("0"));
    Frame::trailers(end)
}

#[tokio::test]
async fn an_answer_that_streams_is_passed_on_and_never_replayed() {
    let handler = Handler::new(Answer::Stream);
    let app = app(&handler);
    let mut first_app = app.clone();
    let response = tokio::spawn(async move {
        first_app
            .ready()
            .await
            .expect("ready")
            .call(call_request("s-1", message(b"watch"), true))
            .await
            .expect("infallible")
    });
    wait_for_sender(&handler).await;
    // The first message comes, and the status lags it: the caller gets it
    // while the stream is open (after the grace, not when a limit fills).
    handler.send(Frame::data(message(b"one")));
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("the answer is not held back")
        .expect("task");
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert_eq!(first.into_data().ok(), Some(message(b"one")));
    // Meanwhile a retry runs nothing, and is told the answer is not kept.
    let mut retry_app = app.clone();
    let retry = call(&mut retry_app, call_request("s-1", message(b"watch"), true)).await;
    assert_eq!(
        header(&retry.headers, "grpc-status"),
        Some("6"),
        "ALREADY_EXISTS"
    );
    assert_eq!(
        header(&retry.headers, "idem-problem"),
        Some("idempotency_response_not_stored")
    );
    assert_eq!(handler.runs(), 1);
    // The rest of the stream reaches the first caller whole.
    handler.send(Frame::data(message(b"two")));
    handler.send(grpc_end());
    handler.senders.lock().expect("senders").clear();
    let rest = body.collect().await.expect("rest");
    assert_eq!(
        header(rest.trailers().expect("trailers"), "grpc-status"),
        Some("0")
    );
    assert_eq!(rest.to_bytes(), message(b"two"));
}

#[tokio::test]
async fn two_messages_make_a_stream_at_once() {
    let handler = Handler::new(Answer::Stream);
    let app = app(&handler);
    let mut first_app = app.clone();
    let task = tokio::spawn(async move {
        call(&mut first_app, call_request("s-2", message(b"watch"), true)).await
    });
    wait_for_sender(&handler).await;
    let mut two = message(b"a").to_vec();
    two.extend_from_slice(&message(b"b"));
    handler.send(Frame::data(Bytes::from(two.clone())));
    handler.send(grpc_end());
    handler.senders.lock().expect("senders").clear();
    let got = task.await.expect("task");
    assert_eq!(got.body, Bytes::from(two), "the caller gets every message");
    let mut app = app;
    let retry = call(&mut app, call_request("s-2", message(b"watch"), true)).await;
    assert_eq!(
        header(&retry.headers, "idem-problem"),
        Some("idempotency_response_not_stored")
    );
    assert_eq!(handler.runs(), 1);
}

async fn wait_for_sender(handler: &Handler) {
    idem_core::conformance::wait_until(Duration::from_secs(10), "the stream opened", async || {
        !handler.senders.lock().expect("senders").is_empty()
    })
    .await;
}

#[tokio::test]
async fn a_compressed_message_is_the_same_request_as_the_plain_one() {
    let handler = Handler::new(Answer::Unary {
        status: "0",
        trailers: vec![],
    });
    let mut app = app(&handler);
    let plain = call(&mut app, call_request("z-1", message(b"charge 100"), true)).await;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(b"charge 100").expect("gzip");
    let gzipped = encoder.finish().expect("gzip");
    let mut request = call_request("z-1", framed(true, &gzipped), true);
    request
        .headers_mut()
        .insert("grpc-encoding", HeaderValue::from_static("gzip"));
    let replay = call(&mut app, request).await;
    assert_eq!(handler.runs(), 1);
    assert_eq!(header(&replay.headers, "idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, plain.body);
    // Another message, compressed: a conflict.
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(b"charge 999").expect("gzip");
    let mut request = call_request("z-1", framed(true, &encoder.finish().expect("gzip")), true);
    request
        .headers_mut()
        .insert("grpc-encoding", HeaderValue::from_static("gzip"));
    let conflict = call(&mut app, request).await;
    assert_eq!(header(&conflict.headers, "grpc-status"), Some("9"));
    assert_eq!(
        header(&conflict.headers, "idem-problem"),
        Some("idempotency_conflict")
    );
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn a_body_that_is_no_grpc_message_is_refused_before_it_runs() {
    let handler = Handler::new(Answer::Unary {
        status: "0",
        trailers: vec![],
    });
    let mut app = app(&handler);
    let cut = call(
        &mut app,
        call_request("m-1", Bytes::from_static(&[0, 0, 0, 0, 9, 1]), true),
    )
    .await;
    assert_eq!(cut.status, StatusCode::OK);
    assert_eq!(
        header(&cut.headers, "grpc-status"),
        Some("3"),
        "INVALID_ARGUMENT"
    );
    assert_eq!(
        header(&cut.headers, "idem-problem"),
        Some("request_body_invalid")
    );
    assert!(header(&cut.headers, "grpc-message").is_some_and(|m| m.contains("cut short")));
    assert_eq!(
        header(&cut.headers, "content-type"),
        Some("application/grpc")
    );
    assert_eq!(handler.runs(), 0);
}

#[tokio::test]
async fn plain_http_trailers_are_kept_too() {
    let handler = Handler::new(Answer::Http);
    let mut app = app(&handler);
    let first = call(
        &mut app,
        call_request("h-1", Bytes::from_static(b"{}"), false),
    )
    .await;
    let replay = call(
        &mut app,
        call_request("h-1", Bytes::from_static(b"{}"), false),
    )
    .await;
    assert_eq!(handler.runs(), 1);
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    let trailers = first.trailers.expect("trailers");
    assert_eq!(header(&trailers, "x-checksum"), Some("abc123"));
    assert_eq!(replay.trailers, Some(trailers));
    // An HTTP caller still gets problem documents.
    let conflict = call(
        &mut app,
        call_request("h-1", Bytes::from_static(b"{\"a\":1}"), false),
    )
    .await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test]
async fn a_cancelled_record_is_failed_precondition() {
    // The handler keeps the scope its call ran under, for the cancel.
    let store = MemoryStore::new();
    let scope = Scope::default();
    // The call runs while its answer has not come: its record is
    // processing when it is cancelled.
    let handler = Handler::new(Answer::Stream);
    let mut app = layered(&tenant_layer(store.clone()), &handler, &scope);
    let mut first_app = app.clone();
    let first = tokio::spawn(async move {
        call(&mut first_app, call_request("c-1", message(b"x"), true)).await
    });
    wait_for_sender(&handler).await;
    let scope = scope.lock().expect("scope").expect("the call ran keyed");
    let cancelled = idem_core::Store::cancel(&store, &scope)
        .await
        .expect("cancel");
    assert!(
        matches!(cancelled, idem_core::Cancellation::Cancelled(_)),
        "{cancelled:?}"
    );
    let cancelled = call(&mut app, call_request("c-1", message(b"x"), true)).await;
    handler.send(grpc_end());
    handler.senders.lock().expect("senders").clear();
    first.await.expect("the first call ends");
    assert_eq!(
        header(&cancelled.headers, "grpc-status"),
        Some("9"),
        "FAILED_PRECONDITION"
    );
    assert_eq!(
        header(&cancelled.headers, "idem-problem"),
        Some("idempotency_cancelled")
    );
    assert_eq!(handler.runs(), 1);
}

#[tokio::test]
async fn a_store_down_is_unavailable_with_the_pushback() {
    let handler = Handler::new(Answer::TrailersOnly { status: "0" });
    // Nothing listens on the store's port: UNAVAILABLE, with the pushback.
    let down = idem_redis::RedisStore::from_url("redis://127.0.0.1:1").expect("store");
    let mut app = layered(&tenant_layer(down), &handler, &Scope::default());
    let refused = call(&mut app, call_request("d-1", message(b"x"), true)).await;
    assert_eq!(refused.status, StatusCode::OK);
    assert_eq!(
        header(&refused.headers, "grpc-status"),
        Some("14"),
        "UNAVAILABLE"
    );
    assert_eq!(
        header(&refused.headers, "idem-problem"),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(
        header(&refused.headers, "grpc-retry-pushback-ms"),
        Some("1000")
    );
    assert_eq!(header(&refused.headers, "retry-after"), Some("1"));
    assert!(refused.body.is_empty() && refused.trailers.is_none());
    assert_eq!(handler.runs(), 0, "the handler never ran");
}

#[tokio::test]
async fn sealed_trailers_are_kept_sealed_and_replayed_whole() {
    let store = MemoryStore::new();
    let scope = Scope::default();
    let handler = Handler::new(Answer::Unary {
        status: "0",
        trailers: vec![("x-ledger-balance", "918273")],
    });
    // No replay cache: the replay is read from the store and opened.
    let layer = tenant_layer(store.clone())
        .sealing(idem_layer::sealing::Keyring::derived(
            b"a deployment secret",
        ))
        .replay_cache(0, Duration::from_secs(1));
    let mut app = layered(&layer, &handler, &scope);
    let first = call(&mut app, call_request("k-1", message(b"x"), true)).await;
    let scope = scope.lock().expect("scope").expect("the call ran keyed");
    let record = idem_core::Store::get(&store, &scope)
        .await
        .expect("read")
        .expect("a record");
    let Some(idem_core::Outcome::Stored(stored)) = &record.outcome else {
        panic!("a stored outcome: {record:?}");
    };
    let kept = format!("{:?}{:?}", stored.headers, stored.body);
    assert!(
        !kept.contains("918273") && !kept.contains("idem-trailer"),
        "{kept}"
    );
    let replay = call(&mut app, call_request("k-1", message(b"x"), true)).await;
    assert_eq!(handler.runs(), 1);
    assert_eq!(header(&replay.headers, "idempotent-replayed"), Some("true"));
    assert_eq!(replay.trailers, first.trailers);
    assert_eq!(
        header(
            replay.trailers.as_ref().expect("trailers"),
            "x-ledger-balance"
        ),
        Some("918273")
    );
}

#[tokio::test]
async fn an_answer_whose_end_lags_its_trailers_is_still_unary() {
    let handler = Handler::new(Answer::Stream);
    let app = app(&handler);
    let mut first_app = app.clone();
    let first = tokio::spawn(async move {
        call(&mut first_app, call_request("e-1", message(b"x"), true)).await
    });
    wait_for_sender(&handler).await;
    handler.send(Frame::data(message(b"paid")));
    handler.send(grpc_end());
    // The body ends well after its trailers (longer than the grace): the
    // trailers ended the answer, so it is not taken for a stream.
    tokio::time::sleep(grpc::STREAM_GRACE * 3).await;
    handler.senders.lock().expect("senders").clear();
    let first = first.await.expect("task");
    assert_eq!(
        header(first.trailers.as_ref().expect("trailers"), "grpc-status"),
        Some("0")
    );
    let mut app = app;
    let replay = call(&mut app, call_request("e-1", message(b"x"), true)).await;
    assert_eq!(header(&replay.headers, "idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, message(b"paid"));
    assert_eq!(replay.trailers, first.trailers);
    assert_eq!(handler.runs(), 1);
}

/// A service answering a unary call with `status`, counting its runs; its
/// answers marked as an upstream's when `remote`.
fn answering(
    layer: &IdempotencyLayer<MemoryStore>,
    status: &'static str,
    remote: bool,
    runs: &Arc<AtomicUsize>,
) -> App {
    answering_with(layer, http::StatusCode::OK, status, remote, runs)
}

/// [`answering`] with the answer's HTTP status.
fn answering_with(
    layer: &IdempotencyLayer<MemoryStore>,
    http_status: http::StatusCode,
    status: &'static str,
    remote: bool,
    runs: &Arc<AtomicUsize>,
) -> App {
    let runs = Arc::clone(runs);
    let service = tower::service_fn(move |_: Request<Body>| {
        runs.fetch_add(1, Ordering::SeqCst);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static(status));
        let frames = vec![Frame::data(message(b"paid")), Frame::trailers(trailers)];
        let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
        let mut response = Response::builder()
            .status(http_status)
            .header("content-type", "application/grpc")
            .body(Body::new(http_body_util::StreamBody::new(stream)))
            .expect("response");
        if remote {
            response
                .extensions_mut()
                .insert(idem_layer::classify::RemoteAnswer);
        }
        async move { Ok::<_, Infallible>(response) }
    });
    tower::util::BoxCloneService::new(tower::Layer::layer(layer, service))
}

/// Whether a retry of `key` is refused as in progress (the first attempt's
/// outcome unknown, its key kept) rather than run.
async fn kept_in_progress(app: &mut App, key: &str) -> bool {
    let retry = call(app, call_request(key, message(b"x"), true)).await;
    header(&retry.headers, "idem-problem") == Some("idempotency_in_progress")
        && header(&retry.headers, "grpc-status") == Some("10")
}

/// Every answer is classified three ways by its status and by who produced
/// it (docs/design.md, section 1): a handler's INTERNAL releases like its
/// HTTP 500, its DEADLINE_EXCEEDED is unknown (kept, never released at
/// once); an upstream's INTERNAL and an upstream's answer without a status
/// are unknown; a classifier overrides per status.
///
/// An upstream's HTTP 502 or 504 is an intermediary's answer (a proxy's
/// own timeout): unknown whatever `grpc-status` it carries (with
/// `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or `ABORTED` it released the key,
/// and the retry ran the call a second time); a handler's own 502 with
/// `UNAVAILABLE` still releases.
#[tokio::test]
async fn every_answer_is_classified_by_its_status_and_its_producer() {
    use idem_layer::classify::{Producer, Verdict, default_grpc_verdict};
    let layer = tenant_layer(MemoryStore::new());
    use http::StatusCode as Http;
    for (http_status, status, remote, unknown) in [
        (Http::OK, "13", false, false), // a handler's INTERNAL: released
        (Http::OK, "14", true, false),  // an upstream's UNAVAILABLE: released
        (Http::OK, "4", false, true),   // a handler's DEADLINE_EXCEEDED: unknown
        (Http::OK, "1", false, true),   // CANCELLED
        (Http::OK, "2", true, true),    // an upstream's UNKNOWN
        (Http::OK, "13", true, true),   // an upstream's INTERNAL
        (Http::OK, "15", false, true),  // DATA_LOSS
        (Http::OK, "nope", true, true), // an upstream's answer without a status
        (Http::GATEWAY_TIMEOUT, "14", true, true), // a proxy's 504: unknown
        (Http::GATEWAY_TIMEOUT, "8", true, true),
        (Http::BAD_GATEWAY, "10", true, true),
        (Http::BAD_GATEWAY, "14", false, false), // a handler's own 502: released
    ] {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut app = answering_with(&layer, http_status, status, remote, &runs);
        let key = format!("c-{}-{status}-{remote}", http_status.as_u16());
        let first = call(&mut app, call_request(&key, message(b"x"), true)).await;
        let trailers = first.trailers.expect("the first caller gets the answer");
        assert_eq!(header(&trailers, "grpc-status"), Some(status));
        if unknown {
            assert!(
                kept_in_progress(&mut app, &key).await,
                "{http_status} {status} ({remote}): kept"
            );
            assert_eq!(
                runs.load(Ordering::SeqCst),
                1,
                "{http_status} {status} ({remote}): not run again"
            );
        } else {
            call(&mut app, call_request(&key, message(b"x"), true)).await;
            assert_eq!(
                runs.load(Ordering::SeqCst),
                2,
                "{http_status} {status} ({remote}): released"
            );
        }
    }
    // A classifier of the user's: DEADLINE_EXCEEDED from a handler released.
    let released = tenant_layer(MemoryStore::new()).answers(|a| {
        a.classify_grpc(|status, producer| match (status, producer) {
            (Some(4), Producer::Handler) => Verdict::Released,
            _ => default_grpc_verdict(status, producer),
        })
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let mut app = answering(&released, "4", false, &runs);
    call(&mut app, call_request("c-own", message(b"x"), true)).await;
    call(&mut app, call_request("c-own", message(b"x"), true)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The earlier `bool` predicate still decides a handler's answers as it
/// did, and never releases an upstream's deadline.
#[tokio::test]
async fn the_bool_predicate_keeps_an_upstreams_deadline_unknown() {
    let layer =
        tenant_layer(MemoryStore::new()).answers(|a| a.grpc_should_store(|status| status == 0));
    let runs = Arc::new(AtomicUsize::new(0));
    let mut app = answering(&layer, "4", false, &runs);
    call(&mut app, call_request("b-1", message(b"x"), true)).await;
    call(&mut app, call_request("b-1", message(b"x"), true)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a handler's deadline releases, as before"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let mut app = answering(&layer, "4", true, &runs);
    call(&mut app, call_request("b-2", message(b"x"), true)).await;
    assert!(kept_in_progress(&mut app, "b-2").await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// "Nothing ran" in a gRPC answer's trailers (where a service puts its
/// metadata) releases the key like the header does, and the marker never
/// reaches the caller.
#[tokio::test]
async fn nothing_ran_in_the_trailers_releases_the_key() {
    let handler = Handler::new(Answer::Unary {
        status: "3",
        trailers: vec![("idem-nothing-ran", "1")],
    });
    let mut app = app(&handler);
    let first = call(&mut app, call_request("nr-1", message(b"x"), true)).await;
    let trailers = first.trailers.expect("trailers");
    assert_eq!(header(&trailers, "grpc-status"), Some("3"));
    assert_eq!(header(&trailers, "idem-nothing-ran"), None);
    call(&mut app, call_request("nr-1", message(b"x"), true)).await;
    assert_eq!(handler.runs(), 2, "released: the retry ran");
}

/// A gRPC refusal keeps the should-retry header as metadata, and every
/// retryable refusal carries its pushback.
#[tokio::test]
async fn grpc_refusals_carry_the_should_retry_header() {
    let layer = tenant_layer(MemoryStore::new())
        .problems(|p| p.should_retry_header(http::HeaderName::from_static("x-should-retry")));
    let handler = Handler::new(Answer::Stream);
    let mut app = layered(&layer, &handler, &Scope::default());
    let mut first_app = app.clone();
    let running = tokio::spawn(async move {
        call(&mut first_app, call_request("sr-1", message(b"x"), true)).await
    });
    while handler.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = call(&mut app, call_request("sr-1", message(b"x"), true)).await;
    assert_eq!(
        header(&busy.headers, "idem-problem"),
        Some("idempotency_in_progress")
    );
    assert_eq!(header(&busy.headers, "x-should-retry"), Some("true"));
    assert!(busy.headers.contains_key("grpc-retry-pushback-ms"));
    let conflict = call(&mut app, call_request("sr-1", message(b"y"), true)).await;
    assert_eq!(
        header(&conflict.headers, "idem-problem"),
        Some("idempotency_conflict")
    );
    assert_eq!(header(&conflict.headers, "x-should-retry"), Some("false"));
    handler.send(Frame::data(message(b"done")));
    handler.send(grpc_end());
    // The stream ends when its sender goes.
    handler.senders.lock().expect("senders").clear();
    let _ = running.await;
}
