//! The Redis store against a private redis-server: a new key (reserve +
//! complete) and a replay, from one client and from 64 concurrent tasks,
//! next to a baseline that sends the same two EVALSHA calls directly over
//! one multiplexed connection. Prints the Redis time per new key from
//! `INFO commandstats`. Run with `cargo bench -p idem-tests --bench redis_store`.

use std::{
    hint::black_box,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use criterion::{Criterion, criterion_group, criterion_main};
use idem_core::{Reservation, Store, conformance::fingerprint};
use idem_redis::RedisStore;
use idem_tests::bench::{outcome, request};
use idem_tests::redis_server::RedisServer;

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> String {
    format!("key-{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

async fn new_key(store: &RedisStore) {
    let Reservation::Acquired(lease) = store
        .reserve(&request(&fresh_key()))
        .await
        .expect("reserve")
    else {
        panic!("expected a fresh reservation");
    };
    let completion = store.complete(&lease, &outcome()).await.expect("complete");
    assert_eq!(completion, idem_core::Completion::Recorded);
}

/// The same two scripts, called directly: what the store adds is the rest.
async fn direct(
    conn: &mut redis::aio::MultiplexedConnection,
    reserve: &redis::Script,
    complete: &redis::Script,
) {
    let key = fresh_key();
    let scope = *request(&key).scope.hash();
    let record = format!("idem:{{{}}}", scope.to_hex());
    let attempt = uuid::Uuid::now_v7().to_string();
    let token = uuid::Uuid::new_v4().to_string();
    let reply: redis::Value = reserve
        .key(&record)
        .arg(fingerprint(1).to_hex())
        .arg(&attempt)
        .arg(&token)
        .arg(30_000)
        .arg(600_000)
        .arg("bench")
        .arg("POST /orders")
        .arg(&key)
        .invoke_async(conn)
        .await
        .expect("reserve");
    black_box(reply);
    let reply: redis::Value = complete
        .key(&record)
        .arg(1)
        .arg(&token)
        .arg(&attempt)
        .arg("201:1")
        .arg(b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json".as_slice())
        .arg(b"{\"id\":42,\"status\":\"created\"}".as_slice())
        .invoke_async(conn)
        .await
        .expect("complete");
    black_box(reply);
}

/// Runs `iterations` calls of `call` over 64 tasks; answers the time as if
/// they had run one after another (criterion's per-iteration time).
async fn concurrently<F, Fut>(iterations: u64, call: F) -> Duration
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let call = Arc::new(call);
    let per_task = iterations.div_ceil(64);
    let started = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let call = Arc::clone(&call);
            tokio::spawn(async move {
                for _ in 0..per_task {
                    call().await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    started
        .elapsed()
        .mul_f64(iterations as f64 / (per_task * 64) as f64)
}

fn redis_store(c: &mut Criterion) {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store = Arc::new(RedisStore::from_url(&server.url()).expect("store"));
    let client = redis::Client::open(server.url()).expect("client");
    let mut conn = runtime
        .block_on(client.get_multiplexed_async_connection())
        .expect("connection");
    let script = |name: &str| {
        redis::Script::new(
            &idem_redis::script_source(name, idem_redis::RecordFormat::default())
                .expect("a script of the store"),
        )
    };
    let (reserve, complete) = (script("reserve"), script("complete"));
    runtime.block_on(async {
        new_key(&store).await;
        direct(&mut conn, &reserve, &complete).await;
    });

    let mut group = c.benchmark_group("redis_store");
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("baseline_direct_evalsha_new_key", |b| {
        b.to_async(&runtime).iter(|| {
            let mut conn = conn.clone();
            let (reserve, complete) = (&reserve, &complete);
            async move { direct(&mut conn, reserve, complete).await }
        });
    });
    group.bench_function("store_new_key", |b| {
        b.to_async(&runtime).iter(|| new_key(&store));
    });
    let replayed = request("replayed");
    runtime.block_on(async {
        if let Reservation::Acquired(lease) = store.reserve(&replayed).await.expect("reserve") {
            let _ = store.complete(&lease, &outcome()).await.expect("complete");
        }
    });
    group.bench_function("store_replay", |b| {
        b.to_async(&runtime).iter(|| async {
            assert!(matches!(
                store.reserve(&replayed).await.expect("reserve"),
                Reservation::Completed(_)
            ));
        });
    });
    // 64 concurrent tasks; the time reported is per new key.
    group.bench_function("store_new_key_64_concurrent", |b| {
        b.to_async(&runtime).iter_custom(|iterations| {
            let store = Arc::clone(&store);
            concurrently(iterations, move || {
                let store = Arc::clone(&store);
                async move { new_key(&store).await }
            })
        });
    });
    group.bench_function("baseline_direct_64_concurrent", |b| {
        b.to_async(&runtime).iter_custom(|iterations| {
            let (conn, reserve, complete) = (conn.clone(), reserve.clone(), complete.clone());
            concurrently(iterations, move || {
                let mut conn = conn.clone();
                let (reserve, complete) = (reserve.clone(), complete.clone());
                async move { direct(&mut conn, &reserve, &complete).await }
            })
        });
    });
    group.finish();

    // Redis time per new key, measured on 2,000 keys with nothing else running.
    let before = server.command_stats();
    runtime.block_on(async {
        for _ in 0..2_000 {
            new_key(&store).await;
        }
    });
    let after = server.command_stats();
    let (calls, usec) = after.get("evalsha").copied().unwrap_or_default();
    let (calls_before, usec_before) = before.get("evalsha").copied().unwrap_or_default();
    let total = usec * calls as f64 - usec_before * calls_before as f64;
    println!(
        "redis time per new key: {:.1} us ({} EVALSHA for 2000 keys)",
        total / 2_000.0,
        calls - calls_before
    );
}

criterion_group!(benches, redis_store);
criterion_main!(benches);
