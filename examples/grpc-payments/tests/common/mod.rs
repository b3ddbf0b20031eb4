//! What the example's tests share.

use std::net::SocketAddr;

use bytes::Bytes;
use grpc_payments::{
    CHARGE, PaymentsClient, TENANT,
    proto::{ChargeReply, ChargeRequest},
};
use http_body_util::{BodyExt, Full};
use tonic::{Request, Status, transport::Channel};

/// A new `Payments` served by `serve` on a loopback port, in a task of its
/// own.
pub(crate) async fn on_loopback<F, E>(
    serve: impl FnOnce(tokio::net::TcpListener, grpc_payments::Payments) -> F,
) -> (SocketAddr, grpc_payments::Payments)
where
    F: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let payments = grpc_payments::Payments::new(grpc_payments::Ledger::in_memory());
    tokio::spawn(serve(listener, payments.clone()));
    (addr, payments)
}

/// A raw HTTP/2 call: status, headers, body bytes and trailers as they
/// came off the wire.
pub(crate) struct Wire {
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<http::HeaderMap>,
}

/// One `Charge` call keyed `key` with `message` (encoded), over raw
/// HTTP/2.
pub(crate) async fn wire_call(addr: SocketAddr, key: &str, message: &[u8]) -> Wire {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    let request = http::Request::post(format!("http://{addr}{CHARGE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(TENANT, "acme")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(framed)))
        .expect("request");
    let response = client.request(request).await.expect("call");
    assert_eq!(response.status(), http::StatusCode::OK);
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("body");
    let trailers = collected.trailers().cloned();
    Wire {
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// A `Charge` of `amount_cents` by tenant `acme`, keyed `key`.
pub(crate) fn charge_request(key: Option<&str>, amount_cents: i64) -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        account: "acct_1".to_owned(),
        amount_cents,
    });
    request
        .metadata_mut()
        .insert(TENANT, "acme".parse().expect("tenant"));
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("key"));
    }
    request
}

/// Calls `Charge` ([`charge_request`]).
pub(crate) async fn charge(
    client: &mut PaymentsClient<Channel>,
    key: Option<&str>,
    amount_cents: i64,
) -> Result<tonic::Response<ChargeReply>, Status> {
    client.charge(charge_request(key, amount_cents)).await
}

/// The refusal's problem code (`idem-problem`).
pub(crate) fn problem(status: &Status) -> Option<&str> {
    status.metadata().get("idem-problem")?.to_str().ok()
}

/// Whether the answer is a replay (`idempotent-replayed: true`).
pub(crate) fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// A `Charge` whose caller gives up after `deadline` (`grpc-timeout`).
pub(crate) async fn charge_with_deadline(
    client: &mut PaymentsClient<Channel>,
    key: &str,
    amount_cents: i64,
    deadline: std::time::Duration,
) -> Result<tonic::Response<ChargeReply>, Status> {
    let mut request = charge_request(Some(key), amount_cents);
    request.set_timeout(deadline);
    client.charge(request).await
}

/// Retries `Charge` with `key` while another attempt of it is in progress
/// (`ABORTED`, `idempotency_in_progress`), 50 ms apart, for at most 30 s:
/// the first other answer.
pub(crate) async fn charge_once_settled(
    client: &mut PaymentsClient<Channel>,
    key: &str,
    amount_cents: i64,
) -> Result<tonic::Response<ChargeReply>, Status> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let answer = charge(client, Some(key), amount_cents).await;
        match &answer {
            Err(status)
                if status.code() == tonic::Code::Aborted
                    && problem(status) == Some("idempotency_in_progress")
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            _ => return answer,
        }
    }
}
