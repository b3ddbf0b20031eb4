//! The test kit for app authors passes on a service behind the layer and
//! fails, saying why, on one without it (or with a predicate that stores
//! failures): its checks can fail.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use axum::{Router, http::StatusCode, routing::post};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use idem_layer::{IdempotencyLayer, TenantFromHeader, testing::Checks};
use idem_memory::MemoryStore;

/// `/orders` answers a fresh order id each run (after a pause, so
/// concurrent copies overlap) with a session cookie; `/orders` with
/// `x-fail` answers 503.
fn orders() -> Router {
    let counter = Arc::new(AtomicU64::new(0));
    Router::new().route(
        "/orders",
        post(move |headers: http::HeaderMap| {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                if headers.contains_key("x-fail") {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        [("set-cookie", "s=1")],
                        "down".to_owned(),
                    );
                }
                // A cookie, which a replay leaves out: the replay check
                // does not count it as a difference.
                (
                    StatusCode::CREATED,
                    [("set-cookie", "s=1")],
                    format!("order {n}"),
                )
            }
        }),
    )
}

fn layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromHeader::from_static("x-tenant"))
}

fn order(key: &str, sku: &'static str, fail: bool) -> Request<Full<Bytes>> {
    let mut request = Request::post("/orders")
        .header("x-tenant", "acme")
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if fail {
        request = request.header("x-fail", "1");
    }
    request
        .body(Full::new(Bytes::from(format!(r#"{{"sku":"{sku}"}}"#))))
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_pass_behind_the_layer() {
    let checks = Checks::new(orders().layer(layer()), |key: &str| {
        order(key, "book", false)
    });
    checks.duplicates_replay("k1").await.expect("replays");
    checks
        .concurrent_duplicates_run_once("k2", 8)
        .await
        .expect("runs once");
    checks
        .changed_payload_conflicts("k3", order("k3", "pen", false))
        .await
        .expect("conflicts");
    checks
        .failure_releases("k4", order("k4", "book", true))
        .await
        .expect("releases");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_fail_without_the_layer() {
    let checks = Checks::new(orders(), |key: &str| order(key, "book", false));
    let replay = checks.duplicates_replay("k1").await.expect_err("no replay");
    assert!(replay.contains("not a replay"), "{replay}");
    let concurrent = checks
        .concurrent_duplicates_run_once("k2", 8)
        .await
        .expect_err("every copy ran");
    assert!(
        concurrent.contains("8 of 8 concurrent duplicates ran"),
        "{concurrent}"
    );
    let conflict = checks
        .changed_payload_conflicts("k3", order("k3", "pen", false))
        .await
        .expect_err("no conflict");
    assert!(
        conflict.contains("not 422 idempotency_conflict"),
        "{conflict}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_check_fails_when_failures_are_stored() {
    let storing = layer().answers(|a| a.store_outcome_if(|_| true));
    let checks = Checks::new(orders().layer(storing), |key: &str| {
        order(key, "book", false)
    });
    let failure = checks
        .failure_releases("k4", order("k4", "book", true))
        .await
        .expect_err("the failure was stored and replayed");
    assert!(failure.contains("did not run"), "{failure}");
}
