//! Run with `cargo run --release -p axum-orders`.
//!
//! The service to copy: an orders API behind the idempotency layer.
//! `POST /orders` creates an order with a fresh id (201 + `Location`),
//! `GET /orders/{id}` reads it back (on PostgreSQL, `POST /payments` also
//! takes a payment `{"account": …, "cents": …}`: its ledger row, its
//! `charges` event for `outbox-relay` to publish and the completed record
//! commit together), and the records API lives at
//! `/_idempotency/records`, outside the keyed routes, with the layer told
//! where (`RecordsApi::path`) so its 409/422 answers link the record they met.
//! The tenant is the `x-tenant-id` header, which an authentication layer
//! in front would set; a keyed request without one is refused
//! (`401 idempotency_tenant_missing`), never run as somebody else's. On
//! Redis the store is made with `connect()`, which checks the server
//! before serving (unreachable, evicting or too old: the service exits);
//! its warnings (no append-only file, say) go to stderr through a
//! `tracing` subscriber, as every service using idem should install one.
//!
//! Environment: `IDEM_LISTEN` (default `127.0.0.1:3000`), `IDEM_STORE`
//! (`memory`, the default; a `redis://` or `redis+cluster://` URL; or a
//! `postgres://` URL, where the orders are rows of an `orders` table
//! written in the same transaction as the completed record;
//! `IDEM_TRANSACTION_POOLER=true` behind PgBouncer in transaction mode),
//! `IDEM_LEASE` (default `30s`) and `RUST_LOG` (default `info`). Built
//! with the `bench` feature, `IDEM_LAYER=off` serves the same app without
//! the layer (the baseline of `bench/load.sh`).

use std::time::Duration;

use axum::Router;
use idem_core::{Fleet, IdentityClaim, RecordsAdmin};
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use idem_postgres::PgStore;
use idem_redis::RedisStore;

fn exit(error: impl std::fmt::Display) -> ! {
    eprintln!("axum-orders: {error}");
    std::process::exit(2);
}

/// Where the records API is mounted.
const RECORDS: &str = "/_idempotency/records";

/// `routes` behind the layer on `store`, and the records API beside them,
/// once the store is claimed for the layer's scope hashing.
async fn protected<S: RecordsAdmin + Fleet>(routes: Router, store: S, lease: Duration) -> Router {
    let layer = IdempotencyLayer::new(store)
        .tenant(TenantFromHeader::from_static("x-tenant-id"))
        .records(|r| r.path(RECORDS))
        .timing(|t| t.lease(lease));
    claim_store(&layer).await;
    let records = layer.records_service();
    let routes = routes.layer(layer);
    #[cfg(feature = "test-hooks")]
    let routes = routes.layer(axum::middleware::from_fn(axum_orders::hooks::hold_after));
    // Added after the layer, so outside it.
    routes.route_service(RECORDS, records)
}

/// Claims the store at start and keeps it claimed while serving
/// (instances that hash scopes otherwise would run each other's retries
/// again: exit).
async fn claim_store<S: Fleet>(layer: &IdempotencyLayer<S>) {
    match layer.keep_store_claimed(false).await {
        Ok(IdentityClaim::Other(marker)) => exit(format!(
            "the store is claimed by instances that hash scopes otherwise ({marker}); \
             a retry moving between them would run again"
        )),
        Ok(_) => {}
        // Claimed at the next refresh.
        Err(error) => eprintln!("axum-orders: could not claim the store yet: {error}"),
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    // The layer and the stores report through `tracing`: without a
    // subscriber, their warnings are lost.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let listen = std::env::var("IDEM_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    // The benchmarks' baseline (feature `bench`): the app without the layer.
    let protect =
        !cfg!(feature = "bench") || std::env::var("IDEM_LAYER").map_or(true, |v| v != "off");
    let store = std::env::var("IDEM_STORE").unwrap_or_else(|_| "memory".to_owned());
    let lease = match std::env::var("IDEM_LEASE") {
        Ok(text) => humantime::parse_duration(&text)
            .unwrap_or_else(|error| exit(format!("IDEM_LEASE={text:?}: {error}"))),
        Err(_) => Duration::from_secs(30),
    };
    let app = if store.starts_with("postgres://") || store.starts_with("postgresql://") {
        // Behind a transaction pooler (PgBouncer), statements go unnamed.
        let pooled = std::env::var("IDEM_TRANSACTION_POOLER").is_ok_and(|v| v == "true");
        let pg = PgStore::builder()
            .url(&store)
            .transaction_pooler(pooled)
            .build()
            .unwrap_or_else(|error| exit(error));
        if let Err(error) = axum_orders::pg::migrate(&pg).await {
            exit(format!("could not create the tables: {error}"));
        }
        let routes = axum_orders::pg::orders(axum_orders::pg::AppState::new(pg.clone()));
        if protect {
            protected(routes, pg, lease).await
        } else {
            routes
        }
    } else if !protect {
        axum_orders::orders()
    } else if store == "memory" {
        protected(axum_orders::orders(), MemoryStore::new(), lease).await
    } else {
        // Checked before serving: reachable, keeping what it is told, new
        // enough for the record format.
        let redis = RedisStore::builder(&store)
            .connect()
            .await
            .unwrap_or_else(|error| exit(error));
        protected(axum_orders::orders(), redis, lease).await
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    let shown = store.split('@').next_back().unwrap_or(&store);
    let mode = if protect {
        format!("idempotency layer on, {shown} store")
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
