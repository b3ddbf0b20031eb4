//! The retry middleware against real HTTP servers on loopback.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use axum::{
    Router, body::Bytes, extract::State, http::HeaderMap, response::IntoResponse, routing::any,
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use idem_client::{ReplayBody, Retry, RetryInfo, RetryLayer, StopReason};
use tower::{Layer, Service, ServiceExt};

/// One scripted answer: status and headers.
type Scripted = (u16, Vec<(&'static str, String)>, &'static str);

/// When a request arrived (tokio's clock), its key and its body length.
type Arrival = (tokio::time::Instant, Option<String>, usize);

#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Scripted>>>,
    /// (arrival on tokio's clock, Idempotency-Key, body length) per request.
    seen: Arc<Mutex<Vec<Arrival>>>,
}

impl Script {
    fn new(answers: Vec<Scripted>) -> Self {
        Self {
            answers: Arc::new(Mutex::new(answers.into())),
            seen: Arc::default(),
        }
    }

    fn hits(&self) -> usize {
        self.seen.lock().expect("seen").len()
    }

    fn gaps(&self) -> Vec<Duration> {
        let seen = self.seen.lock().expect("seen");
        seen.windows(2).map(|w| w[1].0 - w[0].0).collect()
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.seen
            .lock()
            .expect("seen")
            .iter()
            .map(|s| s.1.clone())
            .collect()
    }
}

async fn scripted(
    State(script): State<Script>,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    script
        .seen
        .lock()
        .expect("seen")
        .push((tokio::time::Instant::now(), key, body.len()));
    let (status, headers, body) = script
        .answers
        .lock()
        .expect("answers")
        .pop_front()
        .unwrap_or((200, vec![], "done"));
    let mut response = Response::new(axum::body::Body::from(body));
    *response.status_mut() = StatusCode::from_u16(status).expect("status");
    for (name, value) in headers {
        response
            .headers_mut()
            .insert(name, value.parse().expect("header value"));
    }
    response
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    format!("http://{addr}")
}

/// The whole body of a response.
async fn body_of<B>(response: http::Response<B>) -> Bytes
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
}

/// A server that always answers `503 busy`, with this `Retry-After` if any.
async fn busy_server(retry_after: Option<&str>) -> (Script, String) {
    let headers = retry_after
        .map(|value| vec![("retry-after", value.to_owned())])
        .unwrap_or_default();
    scripted_server(vec![(503, headers, "busy")]).await
}

async fn scripted_server(answers: Vec<Scripted>) -> (Script, String) {
    let script = Script::new(answers);
    let url = serve(
        Router::new()
            .route("/", any(scripted))
            .with_state(script.clone()),
    )
    .await;
    (script, url)
}

type Http = Client<HttpConnector, ReplayBody<Full<Bytes>>>;

fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

fn post(url: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(format!("{url}/"))
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

async fn send(
    client: &Retry<Http>,
    request: Request<Full<Bytes>>,
) -> (StatusCode, RetryInfo, Bytes) {
    let response = client.clone().oneshot(request).await.expect("a response");
    let info = response
        .extensions()
        .get::<RetryInfo>()
        .cloned()
        .expect("retry info");
    let status = response.status();
    let body = body_of(response).await;
    (status, info, body)
}

fn problem(code: &str) -> &'static str {
    Box::leak(format!("{{\"code\":\"{code}\",\"status\":409}}").into_boxed_str())
}

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_is_the_exact_delay() {
    let (script, url) = busy_server(Some("3")).await;
    let client = RetryLayer::new().layer(http());
    let (status, info, body) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "done");
    assert_eq!(info.attempts, 2);
    assert_eq!(script.gaps(), vec![Duration::from_secs(3)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_http_date_is_honoured() {
    // The date is read against the wall clock, which runs on while tokio's
    // test clock is paused: measure how much of it passes.
    let wall = std::time::Instant::now();
    let at = SystemTime::now() + Duration::from_secs(5);
    let date = httpdate::fmt_http_date(at);
    let (script, url) =
        scripted_server(vec![(429, vec![("retry-after", date)], "slow down")]).await;
    let client = RetryLayer::new().layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info.attempts, 2);
    // The date has one-second resolution, and the wall clock moved on
    // while the request went out: the wait is at most 5 s and short of it
    // by less than a second plus the wall time that passed.
    let passed = wall.elapsed();
    let gap = script.gaps()[0];
    assert!(
        gap <= Duration::from_secs(5) && gap + passed > Duration::from_secs(4),
        "{gap:?} after {passed:?} of wall time"
    );
}

#[tokio::test(start_paused = true)]
async fn unparseable_retry_after_falls_back_to_backoff() {
    let (script, url) = busy_server(Some("soon")).await;
    let client = RetryLayer::new()
        .base_delay(Duration::from_millis(200))
        .layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info.attempts, 2);
    assert!(
        script.gaps()[0] <= Duration::from_millis(200),
        "full jitter stays under the first ceiling"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_cuts_retries_short() {
    let busy = || (503, vec![("retry-after", "2".to_owned())], "busy");
    let (script, url) = scripted_server(vec![busy(), busy(), busy(), busy(), busy(), busy()]).await;
    let client = RetryLayer::new()
        .max_attempts(10)
        .deadline(Duration::from_secs(5))
        .layer(http());
    let started = tokio::time::Instant::now();
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the last answer is returned"
    );
    assert_eq!(info.stopped, Some(StopReason::Deadline));
    assert_eq!(
        script.hits(),
        3,
        "attempts at 0 s, 2 s and 4 s; 6 s would cross the deadline"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn max_attempts_bounds_retries() {
    let busy = || (502, vec![], "bad gateway");
    let (script, url) = scripted_server(vec![busy(), busy(), busy(), busy(), busy()]).await;
    let client = RetryLayer::new().max_attempts(3).layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(info.stopped, Some(StopReason::MaxAttempts));
    assert_eq!(script.hits(), 3);
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_never_retried() {
    for (status, body) in [
        (400, "bad request"),
        (403, "forbidden"),
        (410, "{\"code\":\"idempotency_cancelled\"}"),
        (422, "{\"code\":\"idempotency_conflict\"}"),
        (409, problem("idempotency_response_not_stored")),
    ] {
        let (script, url) = scripted_server(vec![(status, vec![], body)]).await;
        let client = RetryLayer::new().layer(http());
        let (got, info, bytes) = send(&client, post(&url, "{}")).await;
        assert_eq!(got.as_u16(), status);
        assert_eq!(bytes, body, "the body reaches the caller intact");
        assert_eq!(
            info,
            RetryInfo {
                attempts: 1,
                stopped: None,
                key: info.key.clone(),
                boundary: None,
                held: std::time::Duration::ZERO,
            }
        );
        assert_eq!(script.hits(), 1, "{status} is not retried");
    }
}

#[tokio::test(start_paused = true)]
async fn in_progress_409_is_retried_with_the_same_key() {
    let in_progress = (
        409,
        vec![("retry-after", "1".to_owned())],
        problem("idempotency_in_progress"),
    );
    let busy = (503, vec![], "busy");
    let (script, url) = scripted_server(vec![in_progress, busy]).await;
    let client = RetryLayer::new().layer(http());
    let (status, info, _) = send(&client, post(&url, "{\"a\":1}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info.attempts, 3);
    let keys = script.keys();
    let key = info.key.expect("a generated key");
    assert_eq!(
        keys,
        vec![Some(key.clone()), Some(key.clone()), Some(key)],
        "one key for every attempt"
    );
    assert_eq!(script.gaps()[0], Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_caller_key_is_kept() {
    let (script, url) = busy_server(None).await;
    let client = RetryLayer::new().layer(http());
    let mut request = post(&url, "{}");
    request
        .headers_mut()
        .insert("idempotency-key", "order-77".parse().expect("value"));
    let (_, info, _) = send(&client, request).await;
    assert_eq!(info.key.as_deref(), Some("order-77"));
    assert_eq!(
        script.keys(),
        vec![Some("order-77".to_owned()), Some("order-77".to_owned())]
    );
}

#[tokio::test(start_paused = true)]
async fn unsafe_requests_without_a_key_are_sent_once() {
    let (script, url) = busy_server(None).await;
    let client = RetryLayer::new().key_methods([]).layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(info.stopped, Some(StopReason::UnsafeMethod));
    assert_eq!(script.hits(), 1);
    // A GET is idempotent: retried without a key.
    let (script, url) = busy_server(None).await;
    let request = Request::builder()
        .method(Method::GET)
        .uri(format!("{url}/"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let (status, info, _) = send(&client, request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info.key, None);
    assert_eq!(script.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn large_bodies_are_sent_once() {
    let (script, url) = busy_server(None).await;
    let client = RetryLayer::new().body_limit(16).layer(http());
    let body = "{\"this body is longer than sixteen bytes\":1}";
    let (status, info, _) = send(&client, post(&url, body)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(info.stopped, Some(StopReason::BodyNotReplayable));
    assert_eq!(script.hits(), 1);
    assert_eq!(
        script.seen.lock().expect("seen")[0].2,
        body.len(),
        "the whole body was sent"
    );
}

#[tokio::test(start_paused = true)]
async fn the_budget_stops_a_retry_storm() {
    let answers = (0..400).map(|_| (503, vec![], "down")).collect();
    let (script, url) = scripted_server(answers).await;
    // Retries may be 10 % of recent requests, with no per-second allowance.
    let layer = RetryLayer::new()
        .max_attempts(4)
        .budget(Duration::from_secs(60), 0, 0.1);
    let mut exhausted = 0;
    for _ in 0..50 {
        let client = layer.layer(http());
        let (_, info, _) = send(&client, post(&url, "{}")).await;
        exhausted += usize::from(info.stopped == Some(StopReason::BudgetExhausted));
    }
    let retries = script.hits() - 50;
    assert!(retries <= 10, "{retries} retries for 50 requests");
    assert!(
        exhausted >= 40,
        "most requests found the budget spent ({exhausted})"
    );
    // Without a budget the same storm would be 4 attempts each.
}

/// The server executes, the response is lost on the way back, the client
/// retries with the same key, and the layer replays instead of executing
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_response_is_replayed_not_re_executed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/",
            any(move || {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("charged once, run {n}")) }
            }),
        )
        .layer(
            idem_layer::IdempotencyLayer::new(idem_memory::MemoryStore::new())
                .allow_anonymous(true),
        );
    let url = serve(app).await;

    /// Drops the first response after the server produced it.
    #[derive(Clone)]
    struct LoseFirst {
        inner: Http,
        lost: Arc<AtomicUsize>,
    }
    impl Service<Request<ReplayBody<Full<Bytes>>>> for LoseFirst {
        type Response = <Http as Service<Request<ReplayBody<Full<Bytes>>>>>::Response;
        type Error = std::io::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, request: Request<ReplayBody<Full<Bytes>>>) -> Self::Future {
            let (inner, lost) = (self.inner.clone(), Arc::clone(&self.lost));
            Box::pin(async move {
                let response = inner
                    .oneshot(request)
                    .await
                    .map_err(std::io::Error::other)?;
                if lost.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "response lost",
                    ));
                }
                Ok(response)
            })
        }
    }

    let client = RetryLayer::new()
        .base_delay(Duration::from_millis(10))
        .layer(LoseFirst {
            inner: http(),
            lost: Arc::default(),
        });
    let response = client
        .oneshot(post(&url, "{\"amount\":100}"))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        response.extensions().get::<RetryInfo>().map(|i| i.attempts),
        Some(2)
    );
    assert!(
        response.headers().contains_key("idempotent-replayed"),
        "the retry was replayed"
    );
    let body = body_of(response).await;
    assert_eq!(body, "charged once, run 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the charge ran once");
}

#[tokio::test]
async fn transport_errors_are_retried_then_reported() {
    // Nothing listens on this port.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    let client = RetryLayer::new()
        .max_attempts(3)
        .base_delay(Duration::from_millis(1))
        .layer(http());
    let error = client
        .oneshot(post(&url, "{}"))
        .await
        .expect_err("no server");
    let info = error.info().expect("attempts were made");
    assert_eq!(info.attempts, 3);
    assert_eq!(info.stopped, Some(StopReason::MaxAttempts));
    assert!(error.to_string().contains("3 attempt"), "{error}");
}

mod properties {
    use std::time::{Duration, SystemTime};

    use idem_client::backoff::{ceiling, full_jitter, parse_retry_after};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn delay_seconds_parse(seconds in any::<u32>(), pad in "[ \\t]{0,2}") {
            let value = format!("{pad}{seconds}{pad}");
            prop_assert_eq!(parse_retry_after(value.as_bytes(), SystemTime::now()), Some(Duration::from_secs(u64::from(seconds))));
        }

        #[test]
        fn http_dates_parse_relative_to_now(ahead in 0u64..100_000) {
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let date = httpdate::fmt_http_date(now + Duration::from_secs(ahead));
            prop_assert_eq!(parse_retry_after(date.as_bytes(), now), Some(Duration::from_secs(ahead)));
        }

        #[test]
        fn past_dates_are_no_delay(behind in 1u64..100_000) {
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let date = httpdate::fmt_http_date(now - Duration::from_secs(behind));
            prop_assert_eq!(parse_retry_after(date.as_bytes(), now), Some(Duration::ZERO));
        }

        #[test]
        fn anything_else_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
            let parsed = parse_retry_after(&bytes, SystemTime::now());
            let blank_or_negative = std::str::from_utf8(&bytes)
                .is_ok_and(|text| text.trim().is_empty() || text.trim().starts_with('-'));
            if blank_or_negative {
                prop_assert_eq!(parsed, None);
            }
        }

        #[test]
        fn backoff_stays_within_its_bounds(base_ms in 1u64..1_000, max_ms in 1u64..60_000, retry in 1u32..64) {
            let (base, max) = (Duration::from_millis(base_ms), Duration::from_millis(max_ms));
            let ceiling_now = ceiling(base, max, retry);
            prop_assert!(ceiling_now <= max);
            prop_assert!(ceiling(base, max, retry + 1) >= ceiling_now, "ceilings never shrink");
            prop_assert!(full_jitter(base, max, retry) <= ceiling_now);
            if retry == 1 {
                prop_assert_eq!(ceiling_now, base.min(max));
            }
        }
    }
}

/// A `Retry-After` beyond what any clock can add stops at the deadline
/// with the answer in hand; it never panics.
#[tokio::test(start_paused = true)]
async fn an_absurd_retry_after_stops_at_the_deadline() {
    let (script, url) = busy_server(Some("99999999999999999999")).await;
    let client = RetryLayer::new().layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(info.stopped, Some(StopReason::Deadline));
    assert_eq!(script.hits(), 1);
    // A deadline no clock can hold is no deadline, not a panic.
    let (script, url) = busy_server(Some("1")).await;
    let client = RetryLayer::new()
        .deadline(Duration::from_secs(u64::MAX))
        .layer(http());
    let (status, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info.attempts, 2);
    assert_eq!(script.hits(), 2);
}

/// A 409 whose body exceeds what the client reads to find a problem code
/// is not an error: it reaches the caller whole and is not retried.
#[tokio::test(start_paused = true)]
async fn a_large_409_body_reaches_the_caller_whole() {
    let big: &'static str = Box::leak("x".repeat(200 * 1024).into_boxed_str());
    let (script, url) = scripted_server(vec![(409, vec![], big)]).await;
    let client = RetryLayer::new().layer(http());
    let (status, info, body) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body.len(), big.len());
    assert_eq!(body, big);
    assert_eq!(info.attempts, 1);
    assert_eq!(script.hits(), 1);
}

/// 408, 425, 429, 502, 503 and 504 are temporary: retried with the same
/// key. 500 is the server's own failure: answered, not retried.
#[tokio::test(start_paused = true)]
async fn temporary_statuses_are_retried_and_500_is_not() {
    for status in [408, 425, 429, 502, 503, 504] {
        let (script, url) = scripted_server(vec![(status, vec![], "later")]).await;
        let client = RetryLayer::new().layer(http());
        let (got, info, body) = send(&client, post(&url, "{}")).await;
        assert_eq!(got, StatusCode::OK, "{status} is retried");
        assert_eq!(body, "done");
        assert_eq!(info.attempts, 2);
        let keys = script.keys();
        assert!(keys[0].is_some() && keys[0] == keys[1], "{status}: one key");
    }
    let (script, url) = scripted_server(vec![(500, vec![], "broken")]).await;
    let client = RetryLayer::new().layer(http());
    let (got, info, _) = send(&client, post(&url, "{}")).await;
    assert_eq!(got, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(info.attempts, 1);
    assert_eq!(script.hits(), 1);
}

/// An attempt that outlasts the attempt timeout is retried with the same
/// key; the answer of the retry is returned.
#[tokio::test]
async fn an_attempt_timeout_is_retried_with_the_same_key() {
    let calls = Arc::new(AtomicUsize::new(0));
    let keys: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let (c, k) = (Arc::clone(&calls), Arc::clone(&keys));
    let url = serve(Router::new().route(
        "/",
        any(move |headers: HeaderMap| {
            let (calls, keys) = (Arc::clone(&c), Arc::clone(&k));
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                keys.lock().expect("keys").push(
                    headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                );
                if n == 0 {
                    // The first attempt hangs past the attempt timeout.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                "done"
            }
        }),
    ))
    .await;
    let client = RetryLayer::new()
        .attempt_timeout(Duration::from_millis(200))
        .base_delay(Duration::from_millis(10))
        .layer(http());
    let (status, info, body) = send(&client, post(&url, "{}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "done");
    assert_eq!(info.attempts, 2);
    let keys = keys.lock().expect("keys").clone();
    assert_eq!(keys.len(), 2);
    assert!(keys[0].is_some() && keys[0] == keys[1]);
}

/// gRPC answers (`application/grpc`, the status in the head) are retried
/// with the same key for the statuses after which the same call may
/// succeed; a `RESOURCE_EXHAUSTED` the layer gives a message over its
/// limit (`idem-problem: request_body_too_large`) is final, as its HTTP
/// `413` is, and so is a status a retry would only repeat.
#[tokio::test(start_paused = true)]
async fn grpc_statuses_are_retried_unless_a_retry_cannot_cure_them() {
    let grpc = |status: &str, problem: Option<&str>| {
        let mut headers = vec![
            ("content-type", "application/grpc".to_owned()),
            ("grpc-status", status.to_owned()),
        ];
        if let Some(code) = problem {
            headers.push(("idem-problem", code.to_owned()));
        }
        (200, headers, "")
    };
    let retried = [
        grpc("14", None),
        grpc("4", None),
        grpc("8", None),
        grpc("8", Some("idempotency_quota_exceeded")),
        grpc("10", Some("idempotency_in_progress")),
        grpc("10", None),
    ];
    for answer in retried {
        let what = format!("{:?}", answer.1);
        let (script, url) = scripted_server(vec![answer]).await;
        let client = RetryLayer::new().layer(http());
        let (_, info, body) = send(&client, post(&url, "{}")).await;
        assert_eq!(info.attempts, 2, "{what} is retried");
        assert_eq!(body, "done", "{what}: the retry's answer");
        let keys = script.keys();
        assert!(keys[0].is_some() && keys[0] == keys[1], "{what}: one key");
    }
    let final_answers = [
        grpc("8", Some("request_body_too_large")),
        grpc("3", None),
        grpc("6", Some("idempotency_conflict")),
    ];
    for answer in final_answers {
        let what = format!("{:?}", answer.1);
        let (script, url) = scripted_server(vec![answer]).await;
        let client = RetryLayer::new().layer(http());
        let (got, info, _) = send(&client, post(&url, "{}")).await;
        assert_eq!(got, StatusCode::OK, "{what}: the answer as it came");
        assert_eq!(info.attempts, 1, "{what} is final");
        assert_eq!(script.hits(), 1, "{what}: sent once");
    }
}
