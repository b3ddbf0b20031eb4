//! Run with `cargo run -p grpc-payments`.
//!
//! The `payments.v1.Payments` gRPC service behind the idempotency layer.
//! Environment: `IDEM_LISTEN` (default `127.0.0.1:50051`), `IDEM_STORE`
//! (`memory`, the default; a `redis://` or `redis+cluster://` URL; or a
//! `postgres://` URL), `IDEM_LEASE` (default `30s`) and `PAYMENTS_LEDGER`
//! (a file the charges are appended to; in memory without it). Built with
//! the `bench` feature, `IDEM_LAYER=off` serves the service without the
//! layer (the baseline of `bench/grpc.sh`).

use std::time::Duration;

use grpc_payments::{Ledger, Payments, payments_layer, serve};
use idem_memory::MemoryStore;
use idem_postgres::PgStore;
use idem_redis::RedisStore;

fn exit(error: impl std::fmt::Display) -> ! {
    eprintln!("grpc-payments: {error}");
    std::process::exit(2);
}

#[tokio::main]
async fn main() {
    let listen = std::env::var("IDEM_LISTEN").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let store = std::env::var("IDEM_STORE").unwrap_or_else(|_| "memory".to_owned());
    let lease = match std::env::var("IDEM_LEASE") {
        Ok(text) => humantime::parse_duration(&text)
            .unwrap_or_else(|error| exit(format!("IDEM_LEASE={text:?}: {error}"))),
        Err(_) => Duration::from_secs(30),
    };
    let ledger = match std::env::var_os("PAYMENTS_LEDGER") {
        Some(path) => Ledger::in_file(path.into()).unwrap_or_else(|error| exit(error)),
        None => Ledger::in_memory(),
    };
    let payments = Payments::new(ledger);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .unwrap_or_else(|error| exit(format!("cannot listen on {listen}: {error}")));
    let addr = listener.local_addr().unwrap_or_else(|error| exit(error));
    let shown = store.split('@').next_back().unwrap_or(&store).to_owned();
    println!("grpc-payments listening on http://{addr} (idempotency layer on, {shown} store)");
    #[cfg(feature = "bench")]
    if std::env::var("IDEM_LAYER").is_ok_and(|v| v == "off") {
        let served = tonic::transport::Server::builder()
            .add_service(payments)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
        if let Err(error) = served {
            exit(error);
        }
        return;
    }
    let served = if store == "memory" {
        serve(
            listener,
            payments,
            payments_layer(MemoryStore::new()).timing(|t| t.lease(lease)),
        )
        .await
    } else if store.starts_with("postgres://") || store.starts_with("postgresql://") {
        let pg = PgStore::from_url(&store).unwrap_or_else(|error| exit(error));
        if let Err(error) = pg.migrate().await {
            exit(format!("could not create the records table: {error}"));
        }
        serve(
            listener,
            payments,
            payments_layer(pg).timing(|t| t.lease(lease)),
        )
        .await
    } else {
        let redis = RedisStore::from_url(&store).unwrap_or_else(|error| exit(error));
        serve(
            listener,
            payments,
            payments_layer(redis).timing(|t| t.lease(lease)),
        )
        .await
    };
    if let Err(error) = served {
        exit(error);
    }
}
