//! What sealing stored responses costs: a keyed request whose handler
//! answers 1 KB, through the layer on a memory store, with and without a
//! keyring. A new key seals the response once; a replay (the replay cache
//! off, so every replay reads the store) opens it once. The difference of
//! each pair is sealing's (or opening's) CPU per request.
//!
//! `cargo bench -p idem-layer --bench sealing -- new_key_1k_plain` (and
//! `new_key_1k_sealed`, `replay_1k_plain`, `replay_1k_sealed`): one
//! function per process, since every new key's record stays in memory
//! and slows what runs after it in the same process. Measured here: a
//! new key 3.39 µs plain and 4.13 µs sealed (sealing: about 0.7 µs); a
//! replay 1.56 µs and 2.63 µs (opening, with its copy: about 1 µs).

use std::{
    convert::Infallible,
    hint::black_box,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idem_layer::{IdempotencyLayer, sealing::Keyring};
use idem_memory::MemoryStore;
use tower::{Layer, ServiceExt};

/// A 1 KB answer, with the headers a typical API sends.
async fn handler(_: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .header("location", "/orders/42")
        .header("x-request-id", "5f0c2a1e-7b8d-4c5e-9f10-2a3b4c5d6e7f")
        .body(Full::new(Bytes::from(vec![b'x'; 1024])))
        .expect("response"))
}

fn request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
        .expect("request")
}

fn sealing(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let layer = |keyring: Option<Keyring>| {
        // Room for every record the benchmark makes (about 1.3 KB each).
        let store = MemoryStore::builder()
            .capacity(50_000_000)
            .max_bytes(16 << 30)
            .build();
        let mut layer = IdempotencyLayer::new(store)
            .allow_anonymous(true)
            .replay_cache(0, Duration::ZERO);
        if let Some(keyring) = keyring {
            layer = layer.sealing(keyring);
        }
        layer.layer(tower::service_fn(handler))
    };
    let plain = layer(None);
    let sealed = layer(Some(Keyring::derived(b"a deployment secret of 32 bytes!")));
    let counter = AtomicU64::new(0);
    let next_key = || format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));
    let mut group = c.benchmark_group("sealing");
    group.measurement_time(Duration::from_secs(3));
    for (name, service) in [("plain", &plain), ("sealed", &sealed)] {
        runtime.block_on(async {
            let first = service.clone().oneshot(request("replayed")).await;
            assert_eq!(first.expect("first").status(), 201);
        });
        group.bench_function(format!("replay_1k_{name}"), |b| {
            b.to_async(&runtime).iter(|| async {
                let response = service.clone().oneshot(request("replayed")).await;
                let response = response.expect("replay");
                assert!(response.headers().contains_key("idempotent-replayed"));
                black_box(response.into_body().collect().await.is_ok())
            });
        });
        group.bench_function(format!("new_key_1k_{name}"), |b| {
            b.to_async(&runtime).iter(|| async {
                let response = service.clone().oneshot(request(&next_key())).await;
                let response = response.expect("answer");
                assert_eq!(response.status(), 201);
                black_box(response.into_body().collect().await.is_ok())
            });
        });
    }
    group.finish();
}

criterion_group!(benches, sealing);
criterion_main!(benches);
