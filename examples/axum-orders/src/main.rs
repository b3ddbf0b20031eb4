//! Run with `cargo run --release -p axum-orders`.
//!
//! An orders API behind the idempotency layer, on the memory store:
//! `POST /orders` creates an order with a fresh id (201 + `Location`),
//! `GET /orders/{id}` reads it back, and the records API lives at
//! `/_idempotency/records`. The tenant is the `x-tenant-id` header;
//! requests without one share the anonymous tenant.
//!
//! Environment: `IDEM_LISTEN` (default `127.0.0.1:3000`), `IDEM_STORE`
//! (`memory`, the default, or a `redis://` or `redis+cluster://` URL), and
//! `IDEM_LAYER=off` to serve the same app without the layer (the baseline
//! of `bench/load.sh`).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{StatusCode, header},
    response::IntoResponse,
    routing::{get, post},
};
use idem_core::Store;
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use idem_redis::RedisStore;
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Orders {
    next_id: Arc<AtomicU64>,
    orders: Arc<Mutex<HashMap<u64, Value>>>,
}

async fn create(State(orders): State<Orders>, Json(request): Json<Value>) -> impl IntoResponse {
    let id = orders.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let order = json!({ "id": id, "order": request });
    if let Ok(mut map) = orders.orders.lock() {
        map.insert(id, order.clone());
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        Json(order),
    )
}

async fn read(State(orders): State<Orders>, Path(id): Path<u64>) -> impl IntoResponse {
    let order = orders
        .orders
        .lock()
        .ok()
        .and_then(|map| map.get(&id).cloned());
    match order {
        Some(order) => Json(order).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

fn routes() -> Router {
    Router::new()
        .route("/orders", post(create))
        .route("/orders/{id}", get(read))
        .with_state(Orders::default())
}

/// The orders routes behind the layer on `store`, with the records API.
fn protected_app<S: Store>(store: S) -> Router {
    let routes = routes();
    let layer = IdempotencyLayer::new(store)
        .tenant(TenantFromHeader::new(http::HeaderName::from_static(
            "x-tenant-id",
        )))
        .allow_anonymous();
    routes
        .route_service("/_idempotency/records", layer.records_service())
        .layer(layer)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listen = std::env::var("IDEM_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let protected = std::env::var("IDEM_LAYER").map_or(true, |v| v != "off");
    let store = std::env::var("IDEM_STORE").unwrap_or_else(|_| "memory".to_owned());
    let app = match (protected, store.as_str()) {
        (false, _) => routes(),
        (true, "memory") => protected_app(MemoryStore::new()),
        (true, url) => match RedisStore::from_url(url) {
            Ok(redis) => protected_app(redis),
            Err(error) => {
                eprintln!("axum-orders: {error}");
                std::process::exit(2);
            }
        },
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    let mode = if protected {
        format!("idempotency layer on, {store} store")
    } else {
        "idempotency layer OFF".to_owned()
    };
    println!("axum-orders listening on http://{addr} ({mode})");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}
