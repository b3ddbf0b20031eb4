//! The layer's overhead per request on the memory store: the bare inner
//! service against the layer, for a new key and for a replay, with a 1 KiB
//! JSON body. Run with `cargo bench -p idem-layer --bench layer_overhead`.

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
use idem_layer::IdempotencyLayer;
use idem_memory::MemoryStore;
use tower::{Layer, ServiceExt};

fn body() -> Bytes {
    let mut json = String::from("{\"items\":[");
    let mut i = 0;
    while json.len() < 1000 {
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!("{{\"sku\":\"item-{i}\",\"qty\":{i}}}"));
        i += 1;
    }
    json.push_str("]}");
    Bytes::from(json)
}

fn request(key: &str, body: &Bytes) -> Request<Full<Bytes>> {
    request_as(key, body, "application/json")
}

fn request_as(key: &str, body: &Bytes, content_type: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", content_type)
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .expect("request")
}

/// Reads a layered response's body whole; whether it could.
async fn read<B: http_body::Body, E: std::fmt::Debug>(response: Result<Response<B>, E>) -> bool {
    response
        .expect("layered")
        .into_body()
        .collect()
        .await
        .is_ok()
}

async fn handler(request: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok(Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!(
            "{{\"id\":42,\"bytes\":{}}}",
            body.len()
        ))))
        .expect("response"))
}

fn layer_overhead(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = body();
    let bare = tower::service_fn(handler);
    let layered = IdempotencyLayer::new(MemoryStore::builder().capacity(50_000_000).build())
        .allow_anonymous(true)
        .layer(tower::service_fn(handler));
    let counter = AtomicU64::new(0);
    let next_key = || format!("key-{}", counter.fetch_add(1, Ordering::Relaxed));

    let mut group = c.benchmark_group("layer_overhead");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function("bare", |b| {
        b.to_async(&runtime).iter(|| async {
            let response = bare.oneshot(request(&next_key(), &body)).await;
            black_box(response.expect("bare").into_body().collect().await.is_ok())
        });
    });
    group.bench_function("new_key", |b| {
        b.to_async(&runtime).iter(|| async {
            let response = layered.clone().oneshot(request(&next_key(), &body)).await;
            black_box(read(response).await)
        });
    });
    runtime.block_on(async {
        let first = layered
            .clone()
            .oneshot(request("replayed", &body))
            .await
            .expect("first");
        assert_eq!(first.status(), 201);
    });
    // The same body declared as bytes: what the layer costs besides JSON.
    group.bench_function("new_key_octets", |b| {
        b.to_async(&runtime).iter(|| async {
            let request = request_as(&next_key(), &body, "application/octet-stream");
            let response = layered.clone().oneshot(request).await;
            black_box(read(response).await)
        });
    });
    group.bench_function("replay", |b| {
        b.to_async(&runtime).iter(|| async {
            let response = layered.clone().oneshot(request("replayed", &body)).await;
            let response = response.expect("replay");
            assert!(response.headers().contains_key("idempotent-replayed"));
            black_box(response.into_body().collect().await.is_ok())
        });
    });
    runtime.block_on(async {
        let request = request_as("replayed-octets", &body, "application/octet-stream");
        let first = layered.clone().oneshot(request).await.expect("first");
        assert_eq!(first.status(), 201);
    });
    group.bench_function("replay_octets", |b| {
        b.to_async(&runtime).iter(|| async {
            let request = request_as("replayed-octets", &body, "application/octet-stream");
            let response = layered.clone().oneshot(request).await.expect("replay");
            assert!(response.headers().contains_key("idempotent-replayed"));
            black_box(response.into_body().collect().await.is_ok())
        });
    });
    group.bench_function("parse_json_1k", |b| {
        b.iter(|| black_box(serde_json::from_slice::<serde_json::Value>(black_box(&body)).is_ok()));
    });
    group.bench_function("fingerprint_1k", |b| {
        let (parts, _) = request("k", &body).into_parts();
        let headers = [http::header::CONTENT_TYPE];
        b.iter(|| {
            black_box(idem_layer::fingerprint::fingerprint(
                "POST /orders",
                &parts,
                &headers,
                black_box(&body),
            ))
        });
    });
    group.bench_function("canonical_json_1k", |b| {
        b.iter(|| black_box(idem_layer::fingerprint::canonical_json(black_box(&body))));
    });
    group.finish();
}

criterion_group!(benches, layer_overhead);
criterion_main!(benches);
