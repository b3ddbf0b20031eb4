//! The outbox relay as a process: publishes the events a service's
//! handlers committed with [`IdemTransaction::emit`](idem_postgres::IdemTransaction::emit)
//! to NATS JetStream ([`idem_postgres::relay`] does the work), and serves
//! its metrics for Prometheus.
//!
//! ```text
//! DATABASE_URL=postgres://app@127.0.0.1/app NATS_URL=nats://127.0.0.1:4222 \
//!   OUTBOX_STREAM=CHARGES OUTBOX_SUBJECTS=charges cargo run --release -p outbox-relay
//! ```
//!
//! Every option is a flag or its environment variable (`--help` lists
//! them). With `OUTBOX_STREAM`, the stream is created when missing, taking
//! `OUTBOX_SUBJECTS`, with the duplicate window `OUTBOX_DUPLICATE_WINDOW`
//! (default 2 min): exactly once holds within it, and beyond it the
//! consumer deduplicates by event id. Behind a transaction pooler
//! (`IDEM_TRANSACTION_POOLER=true`), give `OUTBOX_LISTEN_URL`, a direct
//! connection on which the relay `LISTEN`s; without one it polls.
//!
//! The banner line on stdout names the metrics address (`http://…`,
//! `GET /metrics`); the alert rules and the dashboard panels for these
//! metrics are `deploy/prometheus/idem-outbox.rules.yml` and
//! `deploy/grafana/idem-outbox.json`.

use std::time::Duration;

use axum::{Router, routing::get};
use clap::Parser;
use idem_postgres::{PgStore, relay::Relay};
use metrics_exporter_prometheus::PrometheusBuilder;

/// Why the relay could not start.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The relay's settings.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "outbox-relay",
    about = "Publishes idem's PostgreSQL outbox to NATS JetStream"
)]
pub struct Options {
    /// The service's database (through a pooler is fine).
    #[arg(long, env = "DATABASE_URL")]
    pub database: String,
    /// The database is behind a transaction pooler (PgBouncer).
    #[arg(long, env = "IDEM_TRANSACTION_POOLER", default_value_t = false)]
    pub transaction_pooler: bool,
    /// A direct connection to LISTEN on (needed behind a pooler to be
    /// woken at once; otherwise the relay polls).
    #[arg(long, env = "OUTBOX_LISTEN_URL")]
    pub listen_url: Option<String>,
    /// The records table whose outbox (`<table>_outbox`) is relayed.
    #[arg(long, env = "IDEM_TABLE", default_value = "idem_records")]
    pub table: String,
    /// The NATS server.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats: String,
    /// A JetStream stream to create when missing.
    #[arg(long, env = "OUTBOX_STREAM")]
    pub stream: Option<String>,
    /// The subjects the created stream takes (comma-separated).
    #[arg(
        long,
        env = "OUTBOX_SUBJECTS",
        value_delimiter = ',',
        default_value = "events.>"
    )]
    pub subjects: Vec<String>,
    /// The created stream's duplicate window.
    #[arg(long, env = "OUTBOX_DUPLICATE_WINDOW", default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Where `/metrics` is served.
    #[arg(long, env = "OUTBOX_METRICS", default_value = "127.0.0.1:9187")]
    pub metrics: String,
    /// Events per batch.
    #[arg(long, env = "OUTBOX_BATCH", default_value_t = 512)]
    pub batch: u32,
    /// How long published events are kept before the sweep.
    #[arg(long, env = "OUTBOX_KEEP_PUBLISHED", default_value = "1h", value_parser = humantime::parse_duration)]
    pub keep_published: Duration,
}

impl Options {
    /// The options from the command line and the environment (exits with
    /// a usage message when they are wrong).
    pub fn from_env() -> Self {
        Self::parse()
    }

    /// The options from the environment alone, whatever the process's
    /// arguments (exits with a usage message when they are wrong).
    pub fn from_vars() -> Self {
        Self::parse_from(["outbox-relay"])
    }
}

/// Latency buckets of the lag histogram, in seconds.
const LAG_BUCKETS: [f64; 14] = [
    0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 120.0,
];

/// Runs the relay with `options` until SIGINT or SIGTERM; `configure`
/// adjusts the relay before it starts (the binary passes it through).
pub async fn run(options: Options, configure: impl FnOnce(Relay) -> Relay) -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init()
        .ok();
    let recorder = PrometheusBuilder::new()
        .set_buckets(&LAG_BUCKETS)?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    idem_postgres::relay::register();

    if options.duplicate_window.is_zero() {
        return Err("OUTBOX_DUPLICATE_WINDOW must be longer than zero \
                    (the broker would take its default, two minutes)"
            .into());
    }
    let store = PgStore::builder()
        .url(options.database.clone())
        .table(&options.table)
        .transaction_pooler(options.transaction_pooler)
        .max_connections(4)
        .sweep_every(None)
        .build()
        .map_err(|error| format!("DATABASE_URL: {error}"))?;
    let client = async_nats::connect(&options.nats)
        .await
        .map_err(|error| format!("NATS_URL {}: {error}", options.nats))?;
    let jetstream = async_nats::jetstream::new(client);
    if let Some(stream) = &options.stream {
        jetstream
            .get_or_create_stream(async_nats::jetstream::stream::Config {
                name: stream.clone(),
                subjects: options.subjects.clone(),
                duplicate_window: options.duplicate_window,
                ..Default::default()
            })
            .await?;
    }
    let mut relay = Relay::new(&store, jetstream)
        .batch(options.batch)
        .keep_published(options.keep_published);
    if let Some(url) = &options.listen_url {
        relay = relay
            .listen_on(url)
            .map_err(|error| format!("OUTBOX_LISTEN_URL: {error}"))?;
    }
    let relay = configure(relay);
    outbox_found(&relay, &options.table).await?;

    let addr = serve_metrics(&options.metrics, handle).await?;
    println!(
        "outbox-relay metrics on http://{addr} (GET /metrics); relaying {}_outbox to {}",
        options.table, options.nats
    );
    relay.run(shutdown()).await?;
    eprintln!("outbox-relay: stopped");
    Ok(())
}

/// Serves `/metrics` on `address` from `handle`, its histograms kept up
/// every 5 s; the address it listens on.
async fn serve_metrics(
    address: &str,
    handle: metrics_exporter_prometheus::PrometheusHandle,
) -> Result<std::net::SocketAddr, Error> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|error| format!("OUTBOX_METRICS {address}: {error}"))?;
    let addr = listener.local_addr()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticks.tick().await;
            upkeep.run_upkeep();
        }
    });
    let app = Router::new().route("/metrics", get(move || std::future::ready(handle.render())));
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            eprintln!("outbox-relay: the metrics server stopped: {error}");
        }
    });
    Ok(addr)
}

/// Checks that the outbox is there: a relay on the wrong database would
/// fail every batch for good.
async fn outbox_found(relay: &Relay, table: &str) -> Result<(), Error> {
    match relay.backlog().await {
        Ok(_) => Ok(()),
        Err(idem_postgres::relay::RelayError::Database(sqlx::Error::Database(error)))
            if error.code().as_deref() == Some("42P01") =>
        {
            Err(format!(
                "DATABASE_URL has no {table}_outbox table ({error}); create it with \
                 PgStore::migrate or sql/idem_records.sql"
            )
            .into())
        }
        Err(error) => Err(format!("DATABASE_URL: cannot read the outbox: {error}").into()),
    }
}

/// SIGINT or SIGTERM.
async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return interrupt.await.unwrap_or(());
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
