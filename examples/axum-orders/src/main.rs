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

use axum::Router;
use idem_core::Store;
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use idem_redis::RedisStore;

/// The orders routes behind the layer on `store`, with the records API.
fn protected_app<S: Store>(store: S) -> Router {
    let routes = axum_orders::orders();
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
        (false, _) => axum_orders::orders(),
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
