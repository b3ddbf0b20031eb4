//! The outbox relay's throughput and lag (the figures in bench/README.md,
//! "The outbox relay"), on a private PostgreSQL (`fsync` off, as every
//! test server here) and a private `nats-server -js`:
//!
//! 1. **Drain.** `EVENTS` events (default 50,000) committed with the relay
//!    stopped (transactions of 100 `emit`s), then one relay publishes them
//!    all (`Relay::publish_once` until the outbox is empty, 512 a batch):
//!    events per second, publish to JetStream acknowledged and marked.
//! 2. **Lag.** Producers commit one event per transaction at `RATE` per
//!    second (default 2,500) for `SECONDS` (default 10) while a relay runs
//!    (`Relay::run`, woken by `NOTIFY`); a plain NATS subscriber receives
//!    each event. From the moment the producer's `commit` returned to the
//!    moment the subscriber has the message: p50, p99 and the maximum; and
//!    the relay's own lag (its mark's time minus the event's write, on the
//!    database's clock).
//!
//! `cargo bench -p idem-tests --bench outbox_relay` (or
//! `bench/outbox.sh`). Needs PostgreSQL's binaries and `nats-server`;
//! prints, asserts nothing.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use idem_postgres::{IdemTransaction, PgStore, relay::Relay};
use idem_tests::{nats_server::NatsServer, postgres_server::PgServer};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let events = setting("EVENTS", 50_000);
    let rate = setting("RATE", 2_500);
    let seconds = setting("SECONDS", 10);
    let server = PgServer::private().expect("PostgreSQL's binaries");
    let nats = NatsServer::spawn().expect("nats-server");
    let store = PgStore::builder()
        .url(server.database())
        .max_connections(16)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let client = async_nats::connect(nats.url()).await.expect("nats");
    let jetstream = async_nats::jetstream::new(client.clone());
    jetstream
        .create_stream(async_nats::jetstream::stream::Config {
            name: "BENCH".to_owned(),
            subjects: vec!["bench.>".to_owned()],
            ..Default::default()
        })
        .await
        .expect("stream");

    // 1. Drain.
    let filled = Instant::now();
    let mut n = 0;
    while n < events {
        let mut tx = IdemTransaction::begin(&store, None).await.expect("begin");
        for _ in 0..100.min(events - n) {
            tx.emit("bench.drain", format!("{n}")).expect("emit");
            n += 1;
        }
        tx.commit().await.expect("commit");
    }
    println!(
        "drain: {events} events committed in {:.1} s (transactions of 100)",
        filled.elapsed().as_secs_f64()
    );
    let relay = Relay::new(&store, jetstream.clone());
    let started = Instant::now();
    let mut published = 0;
    loop {
        match relay.publish_once().await.expect("publish") {
            0 => break,
            batch => published += batch,
        }
    }
    let took = started.elapsed();
    println!(
        "drain: {published} events published and marked in {:.2} s: {:.0} events per second",
        took.as_secs_f64(),
        published as f64 / took.as_secs_f64()
    );

    // 2. Lag at a steady rate.
    let committed: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let received: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let mut subscriber = client.subscribe("bench.lag").await.expect("subscribe");
    client.flush().await.expect("flush");
    let heard = received.clone();
    let listening = tokio::spawn(async move {
        while let Some(message) = subscriber.next().await {
            let at = Instant::now();
            if let Ok(n) = std::str::from_utf8(&message.payload).unwrap_or("").parse() {
                heard.lock().expect("lock").insert(n, at);
            }
        }
    });
    let running = tokio::spawn(Relay::new(&store, jetstream.clone()).run(std::future::pending()));
    let total = rate * seconds;
    let producers = 8;
    let period = Duration::from_secs_f64(producers as f64 / rate as f64);
    let started = Instant::now();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let (store, committed) = (store.clone(), committed.clone());
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                let mut n = p;
                while n < total {
                    ticks.tick().await;
                    let mut tx = IdemTransaction::begin(&store, None).await.expect("begin");
                    tx.emit("bench.lag", format!("{n}")).expect("emit");
                    tx.commit().await.expect("commit");
                    committed.lock().expect("lock").insert(n, Instant::now());
                    n += producers;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("producer");
    }
    let produced = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (received.lock().expect("lock").len() as u64) < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.abort();
    listening.abort();
    let committed = committed.lock().expect("lock").clone();
    let received = received.lock().expect("lock").clone();
    let mut lags: Vec<Duration> = committed
        .iter()
        .filter_map(|(n, at)| Some(received.get(n)?.saturating_duration_since(*at)))
        .collect();
    lags.sort();
    println!(
        "lag: {total} events at {:.0} per second ({rate} asked), {} received",
        total as f64 / produced.as_secs_f64(),
        lags.len()
    );
    println!(
        "lag from commit to receipt: p50 {}, p99 {}, max {}",
        ms(quantile(&lags, 0.5)),
        ms(quantile(&lags, 0.99)),
        ms(lags.last().copied().unwrap_or_default())
    );
    let mut tx = store.pool().begin().await.expect("begin");
    let (p50, p99, max): (f64, f64, i64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY published_at_ms - created_at_ms), \
           percentile_cont(0.99) WITHIN GROUP (ORDER BY published_at_ms - created_at_ms), \
           max(published_at_ms - created_at_ms) \
         FROM idem_records_outbox WHERE subject = 'bench.lag'",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("lag");
    tx.commit().await.expect("commit");
    println!(
        "the relay's own lag (database clock): p50 {p50:.1} ms, p99 {p99:.1} ms, max {max} ms"
    );
}
