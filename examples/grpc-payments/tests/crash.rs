//! A crash between the charge and the answer, through the real
//! `grpc-payments` process on a private Redis, killed with SIGKILL: the
//! retry within the lease is told the call is in progress; the retry after
//! it runs as attempt 2, finds the charge in the ledger, and answers it.
//! The account is charged once.

use std::{process::Command, time::Duration};

use grpc_payments::{Ledger, PaymentsClient, TENANT, proto::ChargeRequest};
use idem_tests::{poll_until, process::Spawned, redis_server::RedisServer};
use tonic::{Code, Request};

/// Long enough for a debug build's handler; short enough that the retry
/// after the crash does not wait long.
const LEASE: &str = "2s";

fn start(redis: &str, ledger: &std::path::Path) -> Spawned {
    Spawned::start(
        Command::new(env!("CARGO_BIN_EXE_grpc-payments"))
            .env("IDEM_LISTEN", "127.0.0.1:0")
            .env("IDEM_STORE", redis)
            .env("IDEM_LEASE", LEASE)
            .env("PAYMENTS_LEDGER", ledger)
            .env("PAYMENTS_TEST_HOOKS", "1"),
    )
}

fn charge(crash: bool) -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        account: "acct_7".to_owned(),
        amount_cents: 9900,
    });
    let metadata = request.metadata_mut();
    metadata.insert(TENANT, "acme".parse().expect("tenant"));
    metadata.insert("idempotency-key", "crash-1".parse().expect("key"));
    if crash {
        metadata.insert("x-test-crash", "after-charge".parse().expect("hook"));
    }
    request
}

async fn connect(process: &Spawned) -> PaymentsClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", process.address()))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    PaymentsClient::new(channel)
}

/// Whether the answer is the layer's "in progress" (`ABORTED` with its
/// problem code), the only refusal a retry may meet here.
fn in_progress<T>(answer: &Result<T, tonic::Status>) -> bool {
    answer.as_ref().err().is_some_and(|status| {
        status.code() == Code::Aborted
            && status
                .metadata()
                .get("idem-problem")
                .is_some_and(|code| code == "idempotency_in_progress")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_after_a_crash_runs_as_attempt_two_and_charges_once() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("grpc-payments-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("dir");
    let ledger = dir.join("ledger.tsv");

    let mut first = start(&redis.url(), &ledger);
    let mut client = connect(&first).await;
    let call = tokio::spawn(async move { client.charge(charge(true)).await });
    first.wait_for_line("holding the answer");
    first.kill();
    let lost = call.await.expect("task").expect_err("the process died");
    assert_ne!(lost.code(), Code::Ok);
    let charged = Ledger::in_file(ledger.clone()).expect("ledger").charges();
    assert_eq!(charged.len(), 1, "charged before the crash");

    let second = start(&redis.url(), &ledger);
    let mut client = connect(&second).await;
    // Within the lease the record is the crashed attempt's: in progress.
    // After it, the retry takes over as attempt 2.
    let reply = poll_until(
        Duration::from_secs(30),
        async || client.charge(charge(false)).await,
        |answer| !in_progress(answer),
    )
    .await
    .expect("the retry after the lease is answered");
    assert_eq!(reply.get_ref().attempt, 2);
    assert_eq!(reply.get_ref().charge_id, charged[0].id);
    let after = Ledger::in_file(ledger.clone()).expect("ledger").charges();
    assert_eq!(after, charged, "charged once");
    // A later retry replays attempt 2's answer.
    let again = client.charge(charge(false)).await.expect("replay");
    assert_eq!(again.get_ref(), reply.get_ref());
    assert!(again.metadata().get("idempotent-replayed").is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
