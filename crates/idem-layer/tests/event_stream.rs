//! A keyed request whose answer is a stream of events
//! (`text/event-stream`): its client gets each event as it comes, never
//! held back until the storable limit fills; the answer is not stored, so
//! a retry gets `409 idempotency_response_not_stored` (never a stream cut
//! short) and nothing runs twice. A status the layer does not store
//! releases the key as usual.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, extract::State, response::Response, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use tokio::sync::mpsc;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Events {
    runs: Arc<AtomicUsize>,
    /// Where the test sends the events of the stream the handler opened.
    senders: Arc<Mutex<Vec<mpsc::UnboundedSender<Bytes>>>>,
}

/// Opens a stream of events fed by the test; `/failing` answers 503 with
/// the same content type.
async fn open_stream(State(events): State<Events>, request: Request<Body>) -> Response {
    events.runs.fetch_add(1, Ordering::SeqCst);
    let status = if request.uri().path() == "/failing" {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let (sender, mut receiver) = mpsc::unbounded_channel::<Bytes>();
    events.senders.lock().expect("senders").push(sender);
    let stream = futures_util::stream::poll_fn(move |cx| {
        receiver
            .poll_recv(cx)
            .map(|event| event.map(Ok::<_, std::convert::Infallible>))
    });
    Response::builder()
        .status(status)
        .header("content-type", "text/event-stream; charset=utf-8")
        .body(Body::from_stream(stream))
        .expect("response")
}

async fn call(app: &Router, path: &str, key: &str) -> Response {
    app.clone()
        .oneshot(
            Request::post(path)
                .header("x-tenant", "acme")
                .header("idempotency-key", key)
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("infallible")
}

async fn code(response: Response) -> Option<String> {
    let body = response.into_body().collect().await.ok()?.to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).ok()?;
    Some(json.get("code")?.as_str()?.to_owned())
}

#[tokio::test]
async fn an_event_stream_is_passed_on_as_it_comes_and_never_replayed() {
    let events = Events::default();
    let app = Router::new()
        .route("/events", post(open_stream))
        .route("/failing", post(open_stream))
        .with_state(events.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(TenantFromHeader::from_static("x-tenant")),
        );
    // The head comes before any event: the layer does not wait for the
    // stream to end (or for the limit to fill).
    let response = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        call(&app, "/events", "stream-1"),
    )
    .await
    .expect("the stream's head is not held back");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let sender = events.senders.lock().expect("senders")[0].clone();
    sender
        .send(Bytes::from_static(b"data: one\n\n"))
        .expect("send");
    // The first event arrives while the stream is still open.
    let first = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
        .await
        .expect("the first event is not held back")
        .expect("a frame")
        .expect("data");
    assert_eq!(first.into_data().expect("data"), "data: one\n\n");
    // Meanwhile a retry neither runs nor waits for the stream.
    let retry = call(&app, "/events", "stream-1").await;
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert_eq!(
        code(retry).await.as_deref(),
        Some("idempotency_response_not_stored")
    );
    sender
        .send(Bytes::from_static(b"data: two\n\n"))
        .expect("send");
    drop(sender);
    events.senders.lock().expect("senders").clear();
    let rest = body.collect().await.expect("the rest").to_bytes();
    assert_eq!(rest, "data: two\n\n");
    let after = call(&app, "/events", "stream-1").await;
    assert_eq!(after.status(), StatusCode::CONFLICT);
    assert_eq!(
        events.runs.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );

    // A status the layer does not store releases the key: the retry runs.
    let failed = call(&app, "/failing", "stream-2").await;
    assert_eq!(failed.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(failed);
    events.senders.lock().expect("senders").clear();
    let again = call(&app, "/failing", "stream-2").await;
    assert_eq!(again.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(events.runs.load(Ordering::SeqCst), 3);
}
