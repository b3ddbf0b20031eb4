//! The in-memory orders API through the real `axum-orders` process over
//! loopback: every created order reads back with the exact bytes it was
//! created with, whichever of the maps its id falls in.

use std::process::Command;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{client, process::Spawned, send};

/// More orders than the API has maps, so that every map holds some and
/// most hold two or three.
const ORDERS: u64 = 150;

fn start(layer: &str) -> (Spawned, String) {
    let process = Spawned::start(
        Command::new(env!("CARGO_BIN_EXE_axum-orders"))
            .env("IDEM_LISTEN", "127.0.0.1:0")
            .env("IDEM_LAYER", layer),
    );
    // The baseline runs without the layer (the `bench` feature, which this
    // package's tests turn on), the other with it.
    let mode = if layer == "off" {
        "idempotency layer OFF"
    } else {
        "idempotency layer on"
    };
    assert!(process.banner.contains(mode), "{}", process.banner);
    let addr = process.address();
    (process, addr)
}

fn get(addr: &str, id: u64) -> Request<Full<Bytes>> {
    Request::get(format!("http://{addr}/orders/{id}"))
        .body(Full::default())
        .expect("request")
}

/// Orders created with and without the layer read back byte for byte;
/// ids that were never given are 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_reads_back_as_it_was_created() {
    for layer in ["off", "on"] {
        let (_process, addr) = start(layer);
        let client = client();
        let mut created = Vec::new();
        for n in 1..=ORDERS {
            let body = format!("{{\"sku\":\"book-{n}\",\"qty\":{n}}}");
            let request = Request::post(format!("http://{addr}/orders"))
                .header("x-tenant-id", "acme")
                .header("idempotency-key", format!("order-{n}"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("request");
            let reply = send(&client, request).await;
            assert_eq!(reply.status, StatusCode::CREATED, "{layer}: {reply:?}");
            assert_eq!(
                reply.body,
                format!("{{\"id\":{n},\"order\":{{\"qty\":{n},\"sku\":\"book-{n}\"}}}}"),
                "{layer}"
            );
            assert_eq!(
                reply.header("location"),
                Some(format!("/orders/{n}").as_str()),
                "{layer}"
            );
            created.push(reply.body);
        }
        for (id, body) in (1..).zip(&created) {
            let reply = send(&client, get(&addr, id)).await;
            assert_eq!(reply.status, StatusCode::OK, "{layer}: order {id}");
            assert_eq!(&reply.body, body, "{layer}: order {id}");
            assert_eq!(
                reply.header("content-type"),
                Some("application/json"),
                "{layer}: order {id}"
            );
        }
        for id in [0, ORDERS + 1, u64::MAX] {
            let reply = send(&client, get(&addr, id)).await;
            assert_eq!(reply.status, StatusCode::NOT_FOUND, "{layer}: order {id}");
        }
    }
}

/// The service as it is meant to be copied: a keyed request without a
/// tenant is refused and runs nothing; a body that does not parse leaves
/// the key to the corrected retry; the records API sits beside the
/// keyed routes, and a conflict links the record it met, which the caller
/// reads there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_to_copy_refuses_anonymous_keys_and_links_its_records() {
    let (_process, addr) = start("on");
    let client = client();
    let order = |tenant: Option<&str>, body: &'static str| {
        let mut request = Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", "order-1")
            .header("content-type", "application/json");
        if let Some(tenant) = tenant {
            request = request.header("x-tenant-id", tenant);
        }
        request
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request")
    };
    let anonymous = send(&client, order(None, r#"{"sku":"book"}"#)).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED, "{anonymous:?}");
    assert_eq!(
        anonymous.code().as_deref(),
        Some("idempotency_tenant_missing")
    );
    assert_eq!(
        send(&client, get(&addr, 1)).await.status,
        StatusCode::NOT_FOUND
    );

    // A body that does not parse spends nothing: the corrected retry with
    // the same key runs.
    let malformed = send(&client, order(Some("acme"), r#"{"sku":"#)).await;
    assert!(malformed.status.is_client_error(), "{malformed:?}");
    assert_eq!(
        send(&client, get(&addr, 1)).await.status,
        StatusCode::NOT_FOUND
    );
    let created = send(&client, order(Some("acme"), r#"{"sku":"book"}"#)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    assert!(!created.replayed(), "{created:?}");
    let conflict = send(&client, order(Some("acme"), r#"{"sku":"pen"}"#)).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem: serde_json::Value = serde_json::from_slice(&conflict.body).expect("json");
    let href = problem["record"]["href"]
        .as_str()
        .expect("a link to the record");
    assert!(href.starts_with("/_idempotency/records?"), "{href}");
    let record = Request::get(format!("http://{addr}{href}"))
        .header("x-tenant-id", "acme")
        .body(Full::default())
        .expect("request");
    let record = send(&client, record).await;
    assert_eq!(record.status, StatusCode::OK, "{record:?}");
    let record: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(record["state"], "completed", "{record}");
}

/// The orders API behind the layer passes idem's checks for app authors
/// (`idem_layer::testing`): a duplicate replays byte for byte, eight
/// concurrent duplicates create one order, a changed order under a used key
/// conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_api_passes_the_checks_for_app_authors() {
    use idem_layer::{IdempotencyLayer, TenantFromHeader, testing::Checks};
    let layer = IdempotencyLayer::new(idem_memory::MemoryStore::new())
        .tenant(TenantFromHeader::from_static("x-tenant-id"));
    let app = axum_orders::orders().layer(layer);
    let order = |key: &str, sku: &str| {
        http::Request::post("/orders")
            .header("x-tenant-id", "acme")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(format!(
                r#"{{"sku":"{sku}","qty":1}}"#
            ))))
            .expect("request")
    };
    let checks = Checks::new(app, |key: &str| order(key, "book"));
    checks.duplicates_replay("kit-1").await.expect("replays");
    checks
        .concurrent_duplicates_run_once("kit-2", 8)
        .await
        .expect("one order");
    checks
        .changed_payload_conflicts("kit-3", order("kit-3", "pen"))
        .await
        .expect("conflicts");
}

/// On Redis the service checks the server before it serves: one it cannot
/// reach stops it at start (exit 2, saying why) instead of answering every
/// request 503 later.
#[test]
fn a_redis_it_cannot_reach_stops_it_at_start() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let output = Command::new(env!("CARGO_BIN_EXE_axum-orders"))
        .env("IDEM_LISTEN", "127.0.0.1:0")
        .env("IDEM_STORE", format!("redis://127.0.0.1:{closed}"))
        .output()
        .expect("run axum-orders");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("axum-orders:"), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).is_empty());
}
