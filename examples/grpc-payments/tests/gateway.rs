//! The gateway in front of a gRPC upstream (`--upstream-http2`): the bare
//! `Payments` service, without a layer of its own, gets the same
//! protection from the gateway as from the layer in process.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::{charge, charge_once_settled, charge_with_deadline, problem, replayed, wire_call};
use grpc_payments::{Payments, PaymentsClient, TENANT, proto::ChargeRequest};
use tonic::Code;

/// The bare service (the example's `bench` feature lets it charge without
/// a layer) on a loopback port.
async fn bare() -> (SocketAddr, Payments) {
    common::on_loopback(|listener, payments| async move {
        tonic::transport::Server::builder()
            .add_service(payments)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_protects_a_grpc_upstream() {
    let (upstream, payments) = bare().await;
    let config = idem_tests::gateway_config_for(
        &format!("http://{upstream}"),
        &["--upstream-http2", "--tenant-header", TENANT],
    );
    let (started, _stop, _task) = idem_gateway::start(config).await.expect("gateway");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", started.addr))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connect");
    let mut client = PaymentsClient::new(channel);

    let first = charge(&mut client, Some("gw-1"), 800)
        .await
        .expect("charged");
    let again = charge(&mut client, Some("gw-1"), 800)
        .await
        .expect("replayed");
    assert_eq!(again.get_ref(), first.get_ref());
    assert!(replayed(&again));
    assert_eq!(payments.runs(), 1);

    let conflict = charge(&mut client, Some("gw-1"), 801)
        .await
        .expect_err("conflict");
    assert_eq!(conflict.code(), Code::FailedPrecondition);
    assert_eq!(problem(&conflict), Some("idempotency_conflict"));
    assert_eq!(payments.runs(), 1);

    // UNAVAILABLE from the upstream releases the key; the retry runs.
    payments.bank_unavailable_for(1);
    let down = charge(&mut client, Some("gw-2"), 500)
        .await
        .expect_err("unavailable");
    assert_eq!(down.code(), Code::Unavailable);
    charge(&mut client, Some("gw-2"), 500)
        .await
        .expect("the retry runs");
    assert_eq!(payments.runs(), 3);
    assert_eq!(payments.ledger().charges().len(), 2);

    // On the wire: the replay's message and trailers are the first answer's.
    let message = prost::Message::encode_to_vec(&ChargeRequest {
        account: "acct_2".to_owned(),
        amount_cents: 300,
    });
    let wire_first = wire_call(started.addr, "gw-3", &message).await;
    let wire_replay = wire_call(started.addr, "gw-3", &message).await;
    assert_eq!(payments.runs(), 4);
    assert_eq!(wire_replay.body, wire_first.body);
    assert_eq!(
        wire_replay
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    let trailers = wire_first
        .trailers
        .expect("the upstream's trailers reach the caller");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    assert_eq!(wire_replay.trailers, Some(trailers));
}

/// A caller's deadline shorter than the charge: the gateway answers the
/// caller `DEADLINE_EXCEEDED` at the deadline itself, lets the upstream run
/// under its own bound (it never passes the caller's deadline on, where
/// the upstream's framework would answer at it while the handler charges),
/// and records the upstream's late answer: the retry replays the charge,
/// which ran once. (Before, the upstream's own `DEADLINE_EXCEEDED`
/// released the key and the retry charged again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_deadline_never_charges_twice_through_the_gateway() {
    let (upstream, payments) = bare().await;
    payments.hold_answers(Duration::from_secs(1));
    let config = idem_tests::gateway_config_for(
        &format!("http://{upstream}"),
        &["--upstream-http2", "--tenant-header", TENANT],
    );
    let (started, _stop, _task) = idem_gateway::start(config).await.expect("gateway");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", started.addr))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = PaymentsClient::new(channel);

    let cut = charge_with_deadline(&mut client, "gw-deadline", 700, Duration::from_millis(300))
        .await
        .expect_err("the caller's deadline passes first");
    assert!(
        matches!(cut.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{cut:?}"
    );
    let retried = charge_once_settled(&mut client, "gw-deadline", 700)
        .await
        .expect("the late answer was recorded and is replayed");
    assert!(replayed(&retried), "the retry is the recorded charge");
    assert_eq!(retried.get_ref().amount_cents, 700);
    assert_eq!(payments.runs(), 1, "the upstream charged once");
    assert_eq!(payments.ledger().charges().len(), 1);
}
