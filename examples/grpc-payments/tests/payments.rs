//! The `Payments` service behind the layer, driven by a real tonic client
//! over loopback on every store: a duplicate call replays the message,
//! status and metadata; concurrent duplicates run once; another message
//! conflicts; a status a retry may cure releases the key; a failure a
//! retry would only repeat is replayed; refusals are gRPC statuses with
//! the problem code in metadata; a streaming call is refused.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use grpc_payments::{
    CHARGE, Payments, PaymentsClient, TENANT, payments_layer,
    proto::{ChargeReply, ChargeRequest},
};
use idem_core::Store;
use idem_memory::MemoryStore;
use idem_postgres::PgStore;
use idem_redis::RedisStore;
mod common;

use common::{
    charge, charge_once_settled, charge_request, charge_with_deadline, problem, replayed, wire_call,
};
use idem_tests::{
    postgres_server::PgServer,
    redis_server::{RedisCluster, RedisServer},
};
use tonic::{Code, Request, transport::Channel};

/// The service on a loopback port, behind the layer on `store`.
async fn start<S: Store>(store: S) -> (SocketAddr, Payments) {
    common::on_loopback(|listener, payments| async move {
        grpc_payments::serve(listener, payments, payments_layer(store)).await
    })
    .await
}

async fn channel(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

async fn client(addr: SocketAddr) -> PaymentsClient<Channel> {
    PaymentsClient::new(channel(addr).await)
}

/// Every promise of the unary call on one store.
async fn charges_once<S: Store>(store: S) {
    let (addr, payments) = start(store).await;
    let mut client = client(addr).await;

    // A duplicate replays the message and the metadata, marked.
    let first = charge(&mut client, Some("order-1"), 1250)
        .await
        .expect("first charge");
    assert!(!replayed(&first));
    let again = charge(&mut client, Some("order-1"), 1250)
        .await
        .expect("replayed charge");
    assert!(replayed(&again), "{:?}", again.metadata());
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(
        again.metadata().get("x-charge-id"),
        first.metadata().get("x-charge-id")
    );
    assert_eq!(first.get_ref().attempt, 1);
    assert_eq!(payments.runs(), 1);
    assert_eq!(payments.ledger().charges().len(), 1);

    // Another message under the key: a conflict, nothing runs.
    let conflict = charge(&mut client, Some("order-1"), 9999)
        .await
        .expect_err("conflict");
    assert_eq!(conflict.code(), Code::FailedPrecondition);
    assert_eq!(problem(&conflict), Some("idempotency_conflict"));
    assert_eq!(payments.runs(), 1);

    // Concurrent duplicates: one runs; the others are told it is in
    // progress, with gRPC's retry pushback.
    // Long enough that every duplicate comes while the charge runs, even
    // on a loaded machine.
    payments.hold_answers(Duration::from_millis(1500));
    let calls = (0..8).map(|_| {
        let mut client = client.clone();
        async move { charge(&mut client, Some("order-2"), 500).await }
    });
    let answers = futures_join(calls).await;
    payments.hold_answers(Duration::ZERO);
    // One ran; a duplicate that came after it ended (a slow machine) got
    // its replay.
    let ran: Vec<_> = answers
        .iter()
        .filter_map(|a| a.as_ref().ok())
        .filter(|a| !replayed(a))
        .collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    for answer in &answers {
        match answer {
            Ok(reply) => assert_eq!(reply.get_ref(), ran[0].get_ref()),
            Err(refused) => {
                assert_eq!(refused.code(), Code::Aborted, "{refused:?}");
                assert_eq!(problem(refused), Some("idempotency_in_progress"));
                assert!(refused.metadata().get("grpc-retry-pushback-ms").is_some());
            }
        }
    }
    assert!(
        answers.iter().any(Result::is_err),
        "no duplicate came while the charge ran"
    );
    assert_eq!(payments.runs(), 2);
    let settled = charge(&mut client, Some("order-2"), 500)
        .await
        .expect("replay after the run");
    assert!(replayed(&settled));
    assert_eq!(settled.get_ref(), ran[0].get_ref());
    assert_eq!(payments.runs(), 2);
    assert_eq!(payments.ledger().charges().len(), 2);

    // The bank is down: UNAVAILABLE releases the key; the retry runs and
    // charges once.
    payments.bank_unavailable_for(1);
    let down = charge(&mut client, Some("order-3"), 700)
        .await
        .expect_err("unavailable");
    assert_eq!(down.code(), Code::Unavailable);
    assert_eq!(problem(&down), None, "the handler's own status");
    let retried = charge(&mut client, Some("order-3"), 700)
        .await
        .expect("the retry runs");
    assert!(!replayed(&retried));
    assert_eq!(payments.runs(), 4);
    let made = payments.ledger().charges();
    assert_eq!(made.iter().filter(|c| c.key == "order-3").count(), 1);

    // A failure a retry would only repeat is stored and replayed.
    let invalid = charge(&mut client, Some("order-4"), 0)
        .await
        .expect_err("invalid");
    assert_eq!(invalid.code(), Code::InvalidArgument);
    let again = charge(&mut client, Some("order-4"), 0)
        .await
        .expect_err("replayed invalid");
    assert_eq!(again.code(), Code::InvalidArgument);
    assert_eq!(again.message(), invalid.message());
    assert_eq!(
        again
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(payments.runs(), 5);

    // Refusals as gRPC statuses: no key (the layer requires one), an
    // invalid key.
    let missing = charge(&mut client, None, 100).await.expect_err("no key");
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(problem(&missing), Some("idempotency_key_missing"));
    let invalid_key = charge(&mut client, Some("a b"), 100)
        .await
        .expect_err("bad key");
    assert_eq!(invalid_key.code(), Code::InvalidArgument);
    assert_eq!(problem(&invalid_key), Some("idempotency_key_invalid"));
    assert_eq!(payments.runs(), 5);
    assert_eq!(payments.ledger().charges().len(), 3);
}

/// Runs `calls` at once.
async fn futures_join<F, T>(calls: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let tasks: Vec<_> = calls.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_once_in_memory() {
    charges_once(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_once_on_redis() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    charges_once(RedisStore::from_url(&server.url()).expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_once_on_redis_cluster() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    charges_once(RedisStore::from_url(&cluster.url()).expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_once_on_postgres() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    charges_once(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_the_first_answer_byte_for_byte_on_the_wire() {
    let (addr, payments) = start(MemoryStore::new()).await;
    let message = prost::Message::encode_to_vec(&ChargeRequest {
        account: "acct_9".to_owned(),
        amount_cents: 4200,
    });
    let first = wire_call(addr, "wire-1", &message).await;
    let replay = wire_call(addr, "wire-1", &message).await;
    assert_eq!(payments.runs(), 1);
    assert!(!first.body.is_empty());
    assert_eq!(replay.body, first.body, "the message, byte for byte");
    let trailers = first.trailers.expect("the first answer's trailers");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    assert_eq!(
        replay.trailers,
        Some(trailers),
        "every trailer, byte for byte"
    );
    assert_eq!(
        replay
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    for name in ["content-type", "x-charge-id"] {
        assert_eq!(replay.headers.get(name), first.headers.get(name), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_streaming_call_is_refused_before_it_runs() {
    let (addr, payments) = start(MemoryStore::new()).await;
    let channel = channel(addr).await;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let messages = tokio_stream::iter(vec![
        ChargeRequest {
            account: "a".to_owned(),
            amount_cents: 1,
        },
        ChargeRequest {
            account: "b".to_owned(),
            amount_cents: 2,
        },
    ]);
    let mut request = Request::new(messages);
    request
        .metadata_mut()
        .insert(TENANT, "acme".parse().expect("tenant"));
    request
        .metadata_mut()
        .insert("idempotency-key", "stream-1".parse().expect("key"));
    let refused = grpc
        .client_streaming::<_, ChargeRequest, ChargeReply, _>(
            request,
            http::uri::PathAndQuery::from_static(CHARGE),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unimplemented);
    assert_eq!(problem(&refused), Some("idempotency_stream_refused"));
    assert_eq!(payments.runs(), 0);
}

/// `idem-client`'s retry layer in front of a tonic channel: one key for
/// every attempt, and the statuses the layer released are retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_layer_keeps_one_key_across_a_tonic_calls_retries() {
    let (addr, payments) = start(MemoryStore::new()).await;
    let channel = channel(addr).await;
    let retrying = grpc_payments::retrying(
        channel,
        idem_client::RetryLayer::new()
            .max_attempts(4)
            .base_delay(Duration::from_millis(10)),
    );
    let mut client = PaymentsClient::new(retrying);
    payments.bank_unavailable_for(2);
    // No key of the caller's own: the retry layer makes one and keeps it.
    let started = Instant::now();
    let reply = client
        .charge(charge_request(None, 300))
        .await
        .expect("charged after two retries");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(payments.runs(), 3);
    let made = payments.ledger().charges();
    assert_eq!(made.len(), 1);
    assert_eq!(reply.get_ref().charge_id, made[0].id);
    // One key for the three attempts: the ledger's charge is under it,
    // and a failure a retry would only repeat is not retried.
    let invalid = client
        .charge(charge_request(Some("retry-invalid"), -5))
        .await
        .expect_err("invalid");
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert_eq!(payments.runs(), 4);
}

/// The layer inside a tonic server: tonic's own deadline drops the layer's
/// future at the caller's deadline, the handler goes on detached, and its
/// answer is recorded: the retry replays the charge, which ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_deadline_in_process_never_charges_twice() {
    let (addr, payments) = start(MemoryStore::new()).await;
    payments.hold_answers(Duration::from_secs(1));
    let mut client = client(addr).await;
    let cut = charge_with_deadline(&mut client, "deadline-1", 900, Duration::from_millis(300))
        .await
        .expect_err("the caller's deadline passes first");
    assert!(
        matches!(cut.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{cut:?}"
    );
    let retried = charge_once_settled(&mut client, "deadline-1", 900)
        .await
        .expect("the detached handler's answer is replayed");
    assert!(replayed(&retried));
    assert_eq!(retried.get_ref().amount_cents, 900);
    assert_eq!(payments.runs(), 1);
    assert_eq!(payments.ledger().charges().len(), 1);
}
