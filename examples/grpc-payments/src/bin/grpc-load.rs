//! Load for `bench/grpc.sh`: `grpc-load ADDR SECONDS CONCURRENCY` sends
//! `Charge` calls, each with a fresh key, from CONCURRENCY tasks over one
//! HTTP/2 connection for SECONDS, and prints `calls N failed F seconds S`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use grpc_payments::{PaymentsClient, TENANT, proto::ChargeRequest};

fn usage() -> ! {
    eprintln!("usage: grpc-load ADDR SECONDS CONCURRENCY");
    std::process::exit(2);
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, seconds, concurrency] = args.as_slice() else {
        usage();
    };
    let (Ok(seconds), Ok(concurrency)) = (seconds.parse::<f64>(), concurrency.parse::<usize>())
    else {
        usage();
    };
    let channel = match tonic::transport::Endpoint::from_shared(format!("http://{addr}")) {
        Ok(endpoint) => match endpoint.connect().await {
            Ok(channel) => channel,
            Err(error) => {
                eprintln!("grpc-load: cannot connect to {addr}: {error}");
                std::process::exit(1);
            }
        },
        Err(error) => {
            eprintln!("grpc-load: {addr}: {error}");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (calls, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let mut client = PaymentsClient::new(channel.clone());
            let (stop, calls, failed) = (stop.clone(), calls.clone(), failed.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let mut request = tonic::Request::new(ChargeRequest {
                        account: "acct_bench".to_owned(),
                        amount_cents: 100,
                    });
                    let key = uuid::Uuid::new_v4().simple().to_string();
                    if let (Ok(key), Ok(tenant)) = (key.parse(), "bench".parse()) {
                        request.metadata_mut().insert("idempotency-key", key);
                        request.metadata_mut().insert(TENANT, tenant);
                    }
                    match client.charge(request).await {
                        Ok(_) => calls.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    println!(
        "calls {} failed {} seconds {:.3}",
        calls.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
}
