//! The layer in an axum app over real HTTP on loopback, on the memory store.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, extract::Path, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use idem_tests::{TestServer, client, send};

fn app(runs: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromHeader::new(
        http::HeaderName::from_static("x-tenant-id"),
    ));
    Router::new()
        .route(
            "/accounts/{id}/charges",
            post(move |Path(id): Path<String>, body: Bytes| {
                let runs = Arc::clone(&runs);
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        StatusCode::CREATED,
                        format!("charge {n} on {id}: {} bytes", body.len()),
                    )
                }
            }),
        )
        .route_service("/_idempotency/records", layer.records_service())
        .layer(layer)
}

fn charge(
    server: &TestServer,
    account: &str,
    key: &str,
    body: &'static str,
) -> Request<Full<Bytes>> {
    Request::post(server.url(&format!("/accounts/{account}/charges")))
        .header("idempotency-key", key)
        .header("x-tenant-id", "acme")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

#[tokio::test]
async fn replay_and_conflict_over_http_with_route_template_operation() {
    let runs = Arc::new(AtomicUsize::new(0));
    let server = TestServer::start(app(Arc::clone(&runs))).await;
    let client = client();

    let first = send(&client, charge(&server, "a1", "k-1", r#"{"amount":100}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(
        &client,
        charge(&server, "a1", "k-1", r#"{ "amount": 100 }"#),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let conflict = send(&client, charge(&server, "a1", "k-1", r#"{"amount":200}"#)).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The operation is the route template, so the same key on another
    // account is the same scope; the path is part of the fingerprint, so it
    // is a different request: 422, never the other account's replay.
    let other_account = send(&client, charge(&server, "a2", "k-1", r#"{"amount":100}"#)).await;
    assert_eq!(
        other_account.code().as_deref(),
        Some("idempotency_conflict")
    );

    let record = send(
        &client,
        Request::get(
            server.url("/_idempotency/records?method=POST&path=/accounts/{id}/charges&key=k-1"),
        )
        .header("x-tenant-id", "acme")
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await;
    assert_eq!(record.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(json["operation"], "POST /accounts/{id}/charges");
    assert_eq!(json["state"], "completed");
    assert_eq!(json["status"], 201);
}
