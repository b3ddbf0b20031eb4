//! inproc: drives an axum router in-process (no sockets) N times, so that
//! `valgrind --tool=callgrind` can count instructions per request: a figure
//! that does not move with the machine's load.
//!
//! usage: inproc MODE N [new|replay]
//!   MODE: bare | memory (crates.io `idempotent`) | idem-memory | redis | idem-redis
//!   (the Redis modes take the server from REDIS_URL; only this process's
//!   instructions are counted, not Redis's)
//!   new:    a fresh Idempotency-Key per request (reserve, run, complete)
//!   replay: one key, first request executes, the rest replay
//!
//! Run twice with different N and subtract, so start-up cost cancels out:
//!   valgrind --tool=callgrind --callgrind-out-file=/dev/null inproc idem-memory 1000 new

// The layers' formats from the environment, shared with the server binary.
#[path = "../formats.rs"]
mod formats;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;

async fn create_order(body: Bytes) -> impl IntoResponse {
    let json = format!("{{\"id\":\"1\",\"len\":{}}}", body.len());
    (StatusCode::CREATED, [(header::CONTENT_TYPE, "application/json")], json)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("bare");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let replay = args.get(3).map(String::as_str) == Some("replay");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let router = Router::new().route("/orders", post(create_order));
        let app = match mode {
            "bare" => router,
            "memory" => {
                let store = idempotent::memory::MemoryStore::builder().try_build().unwrap();
                router.layer(idempotent::middleware::IdempotencyLayer::new(store).require_key(true))
            }
            "redis" => {
                let url = std::env::var("REDIS_URL").expect("REDIS_URL");
                let store = idempotent::valkey::ValkeyStore::with_url(url)
                    .prefix("peerbench")
                    .try_build()
                    .await
                    .unwrap();
                router.layer(idempotent::middleware::IdempotencyLayer::new(store).require_key(true))
            }
            "idem-redis" => {
                let url = std::env::var("REDIS_URL").expect("REDIS_URL");
                let store = idem_redis::RedisStore::from_url(&url).unwrap();
                router.layer(
                    idem_layer::IdempotencyLayer::new(store)
                        .tenant(formats::idem_tenant())
                    .fingerprints(|f| f.format(formats::idem_fingerprint()))
                    .scope_format(formats::idem_scope())
                        .require_key(true),
                )
            }
            "idem-memory" => router.layer(
                idem_layer::IdempotencyLayer::new(idem_memory::MemoryStore::new())
                    .tenant(formats::idem_tenant())
                    .fingerprints(|f| f.format(formats::idem_fingerprint()))
                    .scope_format(formats::idem_scope())
                    .require_key(true),
            ),
            other => panic!("unknown mode {other}"),
        };
        let body = r#"{"amount":100,"currency":"eur","items":[1,2,3]}"#;
        let mut ok = 0usize;
        // Keys unique to this run, so a Redis that outlives it holds none of them.
        let run = std::process::id();
        for i in 0..n {
            let key = if replay {
                format!("replay-key-{run}")
            } else {
                format!("key-{run}-{i}")
            };
            let req = Request::post("/orders")
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::AUTHORIZATION, "Bearer bench")
                .header("idempotency-key", key)
                .body(Body::from(body))
                .unwrap();
            let res = app.clone().oneshot(req).await.unwrap();
            if res.status() == StatusCode::CREATED {
                ok += 1;
            }
            let _ = res.into_body().collect().await.unwrap().to_bytes();
        }
        eprintln!("{mode}: {ok}/{n} answered 201");
    });
}
