//! A response opted out of storage (the `idem-no-store` header, or the
//! `NoStore` extension): its client gets it without idem's header, the
//! key stays taken, a retry gets `idempotency_response_not_stored` and
//! runs nothing; a temporary failure still releases the key.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, extract::State, response::IntoResponse, routing::post};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_layer::{IdempotencyLayer, NO_STORE, NoStore, TenantFromHeader};
use idem_memory::MemoryStore;
use tower::ServiceExt;

async fn by_header(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [(NO_STORE, "1"), (http::header::CONTENT_TYPE, "text/plain")],
        format!("secret {n}"),
    )
}

async fn by_extension(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut response = (StatusCode::CREATED, format!("secret {n}")).into_response();
    response.extensions_mut().insert(NoStore);
    response
}

async fn failing(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::SERVICE_UNAVAILABLE, [(NO_STORE, "1")], "later")
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: bytes::Bytes,
}

async fn call(app: &Router, path: &str, key: Option<&str>) -> Answer {
    let mut request = Request::post(path).header("x-tenant", "acme");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).expect("request"))
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    }
}

fn code(answer: &Answer) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
    Some(json.get("code")?.as_str()?.to_owned())
}

#[tokio::test]
async fn an_opted_out_response_is_not_stored_and_the_key_stays_taken() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/header", post(by_header))
        .route("/extension", post(by_extension))
        .route("/failing", post(failing))
        .with_state(Arc::clone(&runs))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(TenantFromHeader::from_static("x-tenant")),
        );
    for path in ["/header", "/extension"] {
        let key = format!("key{path}");
        let first = call(&app, path, Some(&key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}");
        assert!(first.body.starts_with(b"secret"), "{path}");
        assert!(
            !first.headers.contains_key(NO_STORE),
            "{path}: the header reached the client"
        );
        let before = runs.load(Ordering::SeqCst);
        let retry = call(&app, path, Some(&key)).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{path}");
        assert_eq!(
            code(&retry).as_deref(),
            Some("idempotency_response_not_stored")
        );
        assert!(!retry.body.windows(6).any(|w| w == b"secret"), "{path}");
        assert_eq!(runs.load(Ordering::SeqCst), before, "{path}: ran again");
    }
    // A temporary failure releases the key as always: the retry runs.
    let failed = call(&app, "/failing", Some("key-failing")).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!failed.headers.contains_key(NO_STORE));
    let before = runs.load(Ordering::SeqCst);
    call(&app, "/failing", Some("key-failing")).await;
    assert_eq!(runs.load(Ordering::SeqCst), before + 1);
    // Without a key the header is removed all the same.
    let keyless = call(&app, "/header", None).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert!(!keyless.headers.contains_key(NO_STORE));
}
