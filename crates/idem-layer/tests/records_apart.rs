//! The records API served apart from the requests it describes: an
//! operator's service built from a layer of the same identity settings
//! over the same store, mounted alone, reads, lists and erases the records
//! another layer made, and a retry through that layer after an erasure
//! runs again.

mod common;

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, routing};
use common::{Answer, layer, method, order, send};
use http::{Method, StatusCode};
use idem_memory::MemoryStore;

const ADMIN: &str = "operators only";

/// The answer's JSON document.
fn json(answer: &Answer) -> serde_json::Value {
    serde_json::from_slice(&answer.body).unwrap_or_default()
}

#[tokio::test]
async fn a_records_api_mounted_alone_acts_on_the_records_another_layer_made() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders",
            routing::post(move || {
                let runs = Arc::clone(&counted);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "{\"id\":1}")
                }
            }),
        )
        .layer(layer(&store));
    // The operator's process: no route is protected, only the records API.
    let operator = layer(&store).records(|r| r.admin_token(ADMIN));
    let records = Router::new().route_service("/records", operator.records_service());
    let admin = |verb: Method, uri: &str| method(verb, uri).header("x-idem-admin-token", ADMIN);

    assert_eq!(
        send(&app, order("k-1", "{}")).await.status,
        StatusCode::CREATED
    );

    let one = method(Method::GET, "/records?method=POST&path=/orders&key=k-1").tenant("t1");
    let answer = send(&records, one.build()).await;
    let record = json(&answer);
    assert_eq!(answer.status, StatusCode::OK, "{record}");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["tenant"], "t1");
    assert_eq!(record["status"], 201);

    let listed = send(&records, admin(Method::GET, "/records?tenant=t1").build()).await;
    assert_eq!(listed.status, StatusCode::OK, "{}", json(&listed));
    assert_eq!(json(&listed)["records"].as_array().map(Vec::len), Some(1));

    // A retry is replayed until the operator erases the record; then it
    // runs again.
    let replay = send(&app, order("k-1", "{}")).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let erase = admin(
        Method::POST,
        "/records?method=POST&path=/orders&key=k-1&tenant=t1&action=erase",
    );
    let erased = send(&records, erase.build()).await;
    assert_eq!(erased.status, StatusCode::OK, "{}", json(&erased));
    assert_eq!(json(&erased)["result"], "erased");
    // The serving layer's replay cache hears of the erasure through the
    // store (the documented window, at most about a second): a retry is
    // replayed until it has, then runs once.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while runs.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the erased key never ran again"
        );
        let retry = send(&app, order("k-1", "{}")).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let replay = send(&app, order("k-1", "{}")).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
