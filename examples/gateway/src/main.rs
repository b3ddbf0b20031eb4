//! Run with `cargo run --release -p idem-gateway` (add `-- --help` for the flags).

use clap::Parser;
use idem_gateway::{Config, Started};
use tracing_subscriber::EnvFilter;

fn print_banner(config: &Config, started: &Started) {
    let addr = started.addr;
    println!("idem-gateway listening on http://{addr}");
    println!(
        "  upstream: {}{}",
        started.upstream,
        if started.demo {
            " (built-in demo orders API)"
        } else {
            ""
        }
    );
    println!("  store:    {}", config.store);
    match &config.records_admin_token {
        Some(_) => println!(
            "  operator: http://{addr}{}/operator (sign in with the records admin token)",
            config.records_prefix
        ),
        None => println!("  operator: off (set --records-admin-token to serve the operator page)"),
    }
    if started.demo {
        let tenant = match &config.tenant_header {
            Some(name) => format!("-H '{name}: demo'"),
            None => "-H 'Authorization: Bearer demo'".to_owned(),
        };
        println!("Try it:");
        println!(
            "  curl -i -X POST http://{addr}/orders {tenant} -H 'Idempotency-Key: order-1' -H 'content-type: application/json' -d '{{\"sku\":\"book\",\"qty\":1}}'   # run it twice: the second is replayed"
        );
        println!(
            "  curl -i -X POST http://{addr}/orders {tenant} -H 'Idempotency-Key: order-1' -H 'content-type: application/json' -d '{{\"sku\":\"book\",\"qty\":2}}'   # same key, new payload: 422"
        );
    }
}

async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: letting in-flight requests finish");
}

/// mimalloc: its per-thread heaps free memory allocated on another worker
/// thread without taking a lock, where glibc's arenas contend. Built
/// without transparent huge pages (`no_thp`): a memory store grows with
/// every new key, and each fresh 2 MiB huge page is zeroed whole by the
/// page fault of the request that first touches it (sampled on a VM:
/// about 200 µs for that request, 3 to 4 µs per request on average
/// against under 1 µs with 4 KiB pages; `bench/HISTORY.md`).
/// Where the kernel uses huge pages unasked (its setting is `always`),
/// `MIMALLOC_ALLOW_THP=0` in the environment turns them off.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    // Logs go to stderr; stdout carries the banner only. Colours only on
    // a terminal: a file or a log pipeline gets plain text.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let config = Config::parse();
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("idem-gateway: cannot listen on {}: {error}", config.listen);
            std::process::exit(2);
        }
    };
    let banner_config = config.clone();
    let result = idem_gateway::run(config, listener, shutdown_signal(), |started| {
        print_banner(&banner_config, started);
    })
    .await;
    if let Err(error) = result {
        eprintln!("idem-gateway: {error}");
        std::process::exit(2);
    }
}
