//! Run with `cargo run -p charge-consumer` next to a `nats-server -js`;
//! see the library's docs for what it does and its environment.

#[tokio::main]
async fn main() {
    if let Err(error) = charge_consumer::run().await {
        eprintln!("charge-consumer: {error}");
        std::process::exit(1);
    }
}
