//! The records API served apart from the requests it describes: an
//! operator's service built from a layer of the same identity settings
//! over the same store, mounted alone, reads, lists and erases the records
//! another layer made, and a retry through that layer after an erasure
//! runs again.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, routing::post};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use tower::ServiceExt;

const ADMIN: &str = "operators only";

fn tenant() -> TenantFromHeader {
    TenantFromHeader::new(http::HeaderName::from_static("x-tenant"))
}

/// A records API request with the admin credential.
fn admin(method: http::Method, uri: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-idem-admin-token", ADMIN)
        .body(Body::empty())
        .expect("request")
}

async fn call(router: &Router, request: Request<Body>) -> (StatusCode, serde_json::Value) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

#[tokio::test]
async fn a_records_api_mounted_alone_acts_on_the_records_another_layer_made() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let runs = Arc::clone(&counted);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "{\"id\":1}")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).tenant(tenant()));
    // The operator's process: no route is protected, only the records API.
    let operator = IdempotencyLayer::new(store)
        .tenant(tenant())
        .records(|r| r.admin_token(ADMIN));
    let records = Router::new().route_service("/records", operator.records_service());

    let order = || {
        Request::post("/orders")
            .header("x-tenant", "acme")
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .expect("request")
    };
    let (status, _) = call(&app, order()).await;
    assert_eq!(status, StatusCode::CREATED);

    let one = Request::get("/records?method=POST&path=/orders&key=k-1")
        .header("x-tenant", "acme")
        .body(Body::empty())
        .expect("request");
    let (status, record) = call(&records, one).await;
    assert_eq!(status, StatusCode::OK, "{record}");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["tenant"], "acme");
    assert_eq!(record["status"], 201);

    let list = admin(http::Method::GET, "/records?tenant=acme");
    let (status, listed) = call(&records, list).await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert_eq!(listed["records"].as_array().map(Vec::len), Some(1));

    // A retry is replayed until the operator erases the record; then it
    // runs again.
    let (status, _) = call(&app, order()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let erase = admin(
        http::Method::POST,
        "/records?method=POST&path=/orders&key=k-1&tenant=acme&action=erase",
    );
    let (status, erased) = call(&records, erase).await;
    assert_eq!(status, StatusCode::OK, "{erased}");
    assert_eq!(erased["result"], "erased");
    // The serving layer's replay cache hears of the erasure through the
    // store (the documented window, at most about a second): a retry is
    // replayed until it has, then runs once.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while runs.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the erased key never ran again"
        );
        let (status, _) = call(&app, order()).await;
        assert_eq!(status, StatusCode::CREATED);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (status, _) = call(&app, order()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
