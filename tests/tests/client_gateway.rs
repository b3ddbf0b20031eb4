//! The client and server halves together: `idem-client` retrying through
//! the gateway over real HTTP.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use idem_client::{ReplayBody, RetryInfo, RetryLayer};
use idem_tests::{TestServer, start_gateway, upstream::Upstream};
use tower::{Layer, ServiceExt};

fn retrying_client() -> idem_client::Retry<
    Client<hyper_util::client::legacy::connect::HttpConnector, ReplayBody<Full<Bytes>>>,
> {
    let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody<Full<Bytes>>>();
    RetryLayer::new()
        .deadline(Duration::from_secs(20))
        .max_attempts(10)
        .layer(http)
}

/// A duplicate sent while the first request still runs gets 409 with
/// `Retry-After`; the client honours it, retries with the same key, and
/// gets the replay. The upstream runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_during_the_first_attempt_waits_and_is_replayed() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let started = start_gateway(&server, &["--lease", "2s"]).await;
    let client = retrying_client();
    let request = || {
        Request::post(format!("http://{}/slow", started.addr))
            .header("idempotency-key", "pay-42")
            .header("authorization", "Bearer alice")
            .body(Full::new(Bytes::from_static(b"{\"amount\":42}")))
            .expect("request")
    };

    let first = tokio::spawn(client.clone().oneshot(request()));
    upstream.wait_runs(1).await;
    let (http, mut met_409) = idem_tests::client_counting_409s();
    let noticing = RetryLayer::new()
        .deadline(Duration::from_secs(20))
        .max_attempts(10)
        .layer(http);
    let duplicate = tokio::spawn(noticing.oneshot(request()));
    // The duplicate meets the running attempt at least once.
    met_409.wait_for(|n| *n >= 1).await.expect("a 409 was met");
    upstream.gate.add_permits(1);

    let first = first.await.expect("join").expect("response");
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.into_body().collect().await.expect("body").to_bytes();
    let duplicate = duplicate.await.expect("join").expect("response");
    assert_eq!(duplicate.status(), StatusCode::CREATED);
    assert!(duplicate.headers().contains_key("idempotent-replayed"));
    let info = duplicate
        .extensions()
        .get::<RetryInfo>()
        .cloned()
        .expect("info");
    assert!(
        info.attempts >= 2,
        "the duplicate was answered 409 first, then retried: {info:?}"
    );
    assert_eq!(info.key.as_deref(), Some("pay-42"));
    let duplicate_body = duplicate
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(duplicate_body, first_body);
    assert_eq!(upstream.runs(), 1);
}

/// A changed payload under the same key is a 422 that the client does
/// not retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_is_final() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let started = start_gateway(&server, &[]).await;
    let client = retrying_client();
    let request = |body: &'static str| {
        Request::post(format!("http://{}/orders", started.addr))
            .header("idempotency-key", "order-7")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request")
    };
    let created = client
        .clone()
        .oneshot(request("{\"qty\":1}"))
        .await
        .expect("response");
    assert_eq!(created.status(), StatusCode::CREATED);
    let conflict = client
        .clone()
        .oneshot(request("{\"qty\":2}"))
        .await
        .expect("response");
    assert_eq!(conflict.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        conflict.extensions().get::<RetryInfo>().map(|i| i.attempts),
        Some(1)
    );
    assert_eq!(upstream.runs(), 1);
}

/// A client that lost its answer fetches it by its key alone
/// (`idem_client::output_request`, a gateway with `--output-by-key`),
/// without the payload: while the first attempt still runs it meets
/// `409 idempotency_in_progress`, asks again after `Retry-After`, and gets
/// the upstream's answer once it is recorded. The upstream runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_fetched_by_its_key() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let started = start_gateway(&server, &["--output-by-key"]).await;
    let first = tokio::spawn(
        retrying_client().oneshot(
            Request::post(format!("http://{}/slow", started.addr))
                .header("idempotency-key", "lost-1")
                .header("authorization", "Bearer alice")
                .body(Full::new(Bytes::from_static(b"{\"amount\":42}")))
                .expect("request"),
        ),
    );
    upstream.wait_runs(1).await;
    let records = format!("http://{}/_idempotency/records", started.addr)
        .parse()
        .expect("uri");
    let mut fetch = idem_client::output_request::<Full<Bytes>>(
        &records,
        &http::Method::POST,
        "/slow",
        "lost-1",
        None,
    )
    .expect("request");
    fetch
        .headers_mut()
        .insert("authorization", "Bearer alice".parse().expect("value"));
    let (http, mut met_409) = idem_tests::client_counting_409s();
    let fetching = RetryLayer::new()
        .deadline(Duration::from_secs(20))
        .max_attempts(10)
        .layer(http);
    let fetched = tokio::spawn(fetching.oneshot(fetch));
    met_409.wait_for(|n| *n >= 1).await.expect("a 409 was met");
    upstream.gate.add_permits(1);
    let first = first.await.expect("join").expect("response");
    let first_body = first.into_body().collect().await.expect("body").to_bytes();
    let fetched = fetched.await.expect("join").expect("response");
    assert_eq!(fetched.status(), StatusCode::CREATED);
    assert!(fetched.headers().contains_key("idempotent-replayed"));
    let info = fetched
        .extensions()
        .get::<RetryInfo>()
        .cloned()
        .expect("info");
    assert!(info.attempts >= 2, "{info:?}");
    let body = fetched
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(body, first_body);
    assert_eq!(upstream.runs(), 1);
}
