//! peerbench: axum server with one POST /orders route, optionally wrapped in the
//! `idempotent` crate's Tower layer (memory store or Valkey/Redis store).
//!
//! usage: peerbench PORT bare
//!        peerbench PORT memory
//!        peerbench PORT redis redis://127.0.0.1:6391
//!        peerbench PORT idem-memory
//!        peerbench PORT idem-redis redis://127.0.0.1:6391
//!
//! The idem-* modes wrap the same router in idem's layer (tenant = hash of
//! Authorization, as idem's gateway does), so both layers are measured in one run.
//!
//! GET /count (a safe method, so the layer passes it through untouched) returns how many
//! times the /orders handler has actually executed; used only for the correctness check.

mod formats;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use bytes::Bytes;
use idempotent::memory::MemoryStore;
use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;

#[derive(Clone, Default)]
struct AppState {
    runs: Arc<AtomicU64>,
    spin: Option<std::time::Duration>,
}

async fn create_order(State(state): State<AppState>, body: Bytes) -> impl IntoResponse {
    let id = state.runs.fetch_add(1, Ordering::Relaxed) + 1;
    // SPIN_NS: the handler busies its thread this long, to see what a
    // server that spends more CPU per request pays in the kernel here.
    if let Some(spin) = state.spin {
        let until = std::time::Instant::now() + spin;
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
    }
    let json = format!("{{\"id\":\"{id}\",\"len\":{}}}", body.len());
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        json,
    )
}

async fn count(State(state): State<AppState>) -> String {
    state.runs.load(Ordering::Relaxed).to_string()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: {} PORT bare|memory|redis [URL]", args[0]);
        std::process::exit(2);
    }
    let port: u16 = args[1].parse()?;
    let mode = args[2].as_str();

    let state = AppState {
        spin: std::env::var("SPIN_NS")
            .ok()
            .and_then(|ns| ns.parse().ok())
            .map(std::time::Duration::from_nanos),
        ..AppState::default()
    };
    let router = Router::new()
        .route("/orders", post(create_order))
        .route("/count", get(count))
        .with_state(state);

    // require_key(true): a POST without Idempotency-Key gets 400; no scope hook (single caller).
    let app = match mode {
        "bare" => router,
        "memory" => {
            let store = MemoryStore::builder().try_build()?;
            router.layer(IdempotencyLayer::new(store).require_key(true))
        }
        "redis" => {
            let url = args
                .get(3)
                .cloned()
                .unwrap_or_else(|| "redis://127.0.0.1:6391".to_owned());
            let store = ValkeyStore::with_url(url)
                .prefix("peerbench")
                .try_build()
                .await?;
            store.ping().await?;
            router.layer(IdempotencyLayer::new(store).require_key(true))
        }
        "idem-memory" => router.layer(
            idem_layer::IdempotencyLayer::new(idem_memory::MemoryStore::new())
                .tenant(formats::idem_tenant())
                .fingerprints(|f| f.format(formats::idem_fingerprint()))
                .scope_format(formats::idem_scope())
                .require_key(true),
        ),
        "idem-redis" => {
            let url = args
                .get(3)
                .cloned()
                .unwrap_or_else(|| "redis://127.0.0.1:6391".to_owned());
            // IDEM_LANES: the store's number of connections (default 1);
            // IDEM_RECORD_FORMAT=1 or 2: the store writes that record
            // format (record_format; format 3 is the default).
            let mut builder = idem_redis::RedisStore::builder(&url);
            if let Some(lanes) = std::env::var("IDEM_LANES")
                .ok()
                .and_then(|n| n.parse().ok())
            {
                builder = builder.lanes(lanes);
            }
            if let Some(format) = std::env::var("IDEM_RECORD_FORMAT")
                .ok()
                .and_then(|v| v.parse().ok())
                .and_then(idem_redis::RecordFormat::from_number)
            {
                builder = builder.record_format(format);
            }
            let store = builder.build()?;
            store.ping().await?;
            let mut layer = idem_layer::IdempotencyLayer::new(store)
                .tenant(formats::idem_tenant())
                .fingerprints(|f| f.format(formats::idem_fingerprint()))
                .scope_format(formats::idem_scope())
                .require_key(true);
            // IDEM_REPLAY_CACHE=0: no replay cache (on by default).
            if std::env::var("IDEM_REPLAY_CACHE").is_ok_and(|v| v == "0") {
                layer = layer.replay_cache(0, std::time::Duration::ZERO);
            }
            // IDEM_SEALING=1: responses sealed at rest (off by default in
            // the layer; the gateway's default with a shared secret).
            if std::env::var("IDEM_SEALING").is_ok_and(|v| v == "1") {
                layer = layer.sealing(idem_layer::sealing::Keyring::derived(
                    b"the peer bench's sealing secret",
                ));
            }
            router.layer(layer)
        }
        other => {
            eprintln!("unknown mode {other}");
            std::process::exit(2);
        }
    };

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    eprintln!("peerbench listening on 127.0.0.1:{port} mode={mode}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
