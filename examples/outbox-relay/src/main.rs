//! Run with `cargo run --release -p outbox-relay` next to the service's
//! PostgreSQL and a `nats-server -js`; see the library's docs.

#[tokio::main]
async fn main() {
    if let Err(error) = outbox_relay::run(outbox_relay::Options::from_env(), |relay| relay).await {
        eprintln!("outbox-relay: {error}");
        std::process::exit(2);
    }
}
