//! Limits at the provider's boundary (`idem_client::Limits`), shared
//! through a private redis-server by independent clients: the rate holds
//! across them, a 429 holds every worker of its boundary back, one owner's
//! burst does not starve another, and a turn past the deadline fails at
//! once.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::{Path, State},
    http::StatusCode,
    response::IntoResponse,
    routing::any,
};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use idem_client::{
    Error, Limit, Limits, LocalGate, OnGateError, ReplayBody, RetryInfo, RetryLayer, SharedBudget,
    StopReason,
};
use idem_redis::RedisStore;
use idem_tests::{TestServer, redis_server::RedisServer};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};

/// Arrivals per boundary, and a one-time 429 for boundary `a`.
#[derive(Clone, Default)]
struct Provider {
    arrivals: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
    /// The `x-owner` of every arrival, in the order they arrived.
    owners: Arc<Mutex<Vec<String>>>,
    /// When set, the next request of boundary `a` gets 429 with
    /// `Retry-After: 2`, and the time is noted here.
    refuse_next_a: Arc<AtomicBool>,
    refused_at: Arc<Mutex<Option<Instant>>>,
    /// The first request of boundary `once503` gets 503 without
    /// `Retry-After`; whether it was sent.
    sent_503: Arc<AtomicBool>,
}

async fn call(
    State(provider): State<Provider>,
    Path(boundary): Path<String>,
    headers: http::HeaderMap,
) -> impl IntoResponse {
    let now = Instant::now();
    let owner = headers.get("x-owner").and_then(|v| v.to_str().ok());
    provider
        .owners
        .lock()
        .expect("owners")
        .push(owner.unwrap_or_default().to_owned());
    provider
        .arrivals
        .lock()
        .expect("arrivals")
        .entry(boundary.clone())
        .or_default()
        .push(now);
    if boundary == "down" {
        return (StatusCode::SERVICE_UNAVAILABLE, "down").into_response();
    }
    if boundary == "once503" && !provider.sent_503.swap(true, Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "briefly down").into_response();
    }
    if boundary == "a" && provider.refuse_next_a.swap(false, Ordering::SeqCst) {
        *provider.refused_at.lock().expect("refused") = Some(now);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "2")],
            "slow down",
        )
            .into_response();
    }
    (StatusCode::OK, "ok").into_response()
}

impl Provider {
    async fn start(&self) -> TestServer {
        TestServer::start(
            Router::new()
                .route("/{boundary}", any(call))
                .with_state(self.clone()),
        )
        .await
    }

    /// The owners of the arrivals so far, in the order they arrived.
    fn owners(&self) -> Vec<String> {
        self.owners.lock().expect("owners").clone()
    }

    fn arrivals(&self, boundary: &str) -> Vec<Instant> {
        self.arrivals
            .lock()
            .expect("arrivals")
            .get(boundary)
            .cloned()
            .unwrap_or_default()
    }
}

/// The boundary is the first path segment; the owner the `x-owner` header.
fn limits(gate: impl idem_client::Gate, limit: Limit) -> Limits {
    Limits::new(gate, limit, |parts: &http::request::Parts| {
        Some(parts.uri.path().trim_start_matches('/').to_owned())
    })
    .owner(|parts: &http::request::Parts| {
        parts
            .headers
            .get("x-owner")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    })
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, ReplayBody<Full<Bytes>>>;

fn client(layer: RetryLayer) -> idem_client::Retry<Http> {
    ServiceBuilder::new()
        .layer(layer)
        .service(Client::builder(TokioExecutor::new()).build_http())
}

async fn send(
    client: &idem_client::Retry<Http>,
    url: String,
    owner: &str,
) -> Result<(StatusCode, RetryInfo), Error<hyper_util::client::legacy::Error>> {
    let request = Request::get(url)
        .header("x-owner", owner)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let request = request.map(|b| b);
    let mut client = client.clone();
    let response = ServiceExt::ready(&mut client)
        .await?
        .call(request.map(|b| b))
        .await?;
    let info = response
        .extensions()
        .get::<RetryInfo>()
        .cloned()
        .expect("retry info");
    Ok((response.status(), info))
}

/// Arrivals in the busiest window of one second, wherever it starts (a
/// window opens at every arrival): a limiter that lets 13 through at the
/// end of one second and 13 at the start of the next shows 26.
fn busiest_second(arrivals: &[Instant]) -> usize {
    let mut sorted = arrivals.to_vec();
    sorted.sort();
    sorted
        .iter()
        .enumerate()
        .map(|(i, start)| {
            sorted[i..]
                .iter()
                .take_while(|at| at.duration_since(*start) < Duration::from_secs(1))
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// Three independent clients (each its own Redis connection and queue),
/// six workers each, against one boundary limited to 10/s with bursts of
/// 3: no second sees more than 13 arrivals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_holds_across_independent_clients() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let limit = Limit::new(10.0, 3);
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::from_url(&redis.url()).expect("store");
        let client = client(RetryLayer::new().limits(limits(store, limit)));
        for _ in 0..6 {
            let (client, stop, url) = (client.clone(), Arc::clone(&stop), server.url("/acme"));
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let (status, _) = send(&client, url.clone(), "").await.expect("sent");
                    assert_eq!(status, StatusCode::OK);
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.expect("worker");
    }
    let arrivals = provider.arrivals("acme");
    assert!(
        arrivals.len() >= 20,
        "only {} requests went",
        arrivals.len()
    );
    let busiest = busiest_second(&arrivals);
    assert!(
        busiest <= 13,
        "{busiest} arrivals in one second, over 10/s with bursts of 3"
    );
}

/// A 429 with `Retry-After: 2` to one worker holds every worker of that
/// boundary, in every client, back for 2 s; another boundary goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_cools_the_boundary_down_for_every_worker() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let limit = Limit::new(50.0, 5);
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::from_url(&redis.url()).expect("store");
        let client = client(RetryLayer::new().limits(limits(store, limit)));
        for boundary in ["/a", "/a", "/b"] {
            let (client, stop, url) = (client.clone(), Arc::clone(&stop), server.url(boundary));
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let _ = send(&client, url.clone(), "").await;
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    provider.refuse_next_a.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.expect("worker");
    }
    let refused = provider
        .refused_at
        .lock()
        .expect("refused")
        .expect("a 429 was sent");
    // Requests already on the wire when the 429 was sent may still land
    // just after it; none may be sent in the cooldown.
    let quiet_from = refused + Duration::from_millis(200);
    let quiet_until = refused + Duration::from_secs(2);
    let during = |at: &Instant| *at >= quiet_from && *at < quiet_until;
    let a_during = provider
        .arrivals("a")
        .iter()
        .filter(|at| during(at))
        .count();
    assert_eq!(a_during, 0, "boundary a got requests during its cooldown");
    let b_during = provider
        .arrivals("b")
        .iter()
        .filter(|at| during(at))
        .count();
    assert!(
        b_during > 10,
        "boundary b was held back too ({b_during} requests)"
    );
    let a_after = provider
        .arrivals("a")
        .iter()
        .filter(|at| **at >= quiet_until)
        .count();
    assert!(a_after > 0, "boundary a never resumed");
}

/// A 503 without `Retry-After` cools the boundary down for the backoff
/// (here 1.5 s): another client on the same gate sends nothing to it
/// before then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_without_retry_after_cools_the_boundary_down_for_the_backoff() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let backoff = Duration::from_millis(1500);
    let one_try = |store| {
        client(
            RetryLayer::new()
                .max_attempts(1)
                .base_delay(backoff)
                .max_delay(backoff)
                .limits(limits(store, Limit::new(1_000.0, 10))),
        )
    };
    let first = one_try(RedisStore::from_url(&redis.url()).expect("store"));
    let (status, _) = send(&first, server.url("/once503"), "")
        .await
        .expect("answered");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let refused = provider.arrivals("once503")[0];
    let second = one_try(RedisStore::from_url(&redis.url()).expect("store"));
    let (status, _) = send(&second, server.url("/once503"), "")
        .await
        .expect("answered");
    assert_eq!(status, StatusCode::OK);
    let arrivals = provider.arrivals("once503");
    assert_eq!(arrivals.len(), 2);
    let held = arrivals[1].duration_since(refused);
    assert!(
        held >= backoff - Duration::from_millis(100),
        "the next request arrived {held:?} after the 503, inside the cooldown"
    );
}

/// A paused Redis gate (it takes the connection and never answers) is an
/// `Error::Gate` within the gate's timeout, never a request that hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_gate_answers_within_its_timeout() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let gate = RedisStore::builder(&redis.url())
        .timeout(Duration::from_millis(200))
        .build()
        .expect("store");
    let held = client(RetryLayer::new().limits(limits(gate, Limit::new(10.0, 2))));
    // A first request connects while Redis answers.
    let (status, _) = send(&held, server.url("/p"), "").await.expect("sent");
    assert_eq!(status, StatusCode::OK);
    redis.pause();
    let answer =
        tokio::time::timeout(Duration::from_secs(10), send(&held, server.url("/p"), "")).await;
    redis.resume();
    let answer = answer.expect("answered while Redis was paused");
    assert!(matches!(answer, Err(Error::Gate { .. })), "{answer:?}");
    assert_eq!(
        provider.arrivals("p").len(),
        1,
        "nothing sent past the gate"
    );
}

/// One owner's 1,000 queued requests do not starve another owner's 10:
/// served round robin, the 10 arrive among the first of the burst, not
/// behind it. Counted in the order the provider saw the requests, so a
/// slow machine changes nothing: first in, first out would put all the
/// queued burst before the 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owners_burst_does_not_starve_another() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let store = RedisStore::from_url(&redis.url()).expect("store");
    let client = client(RetryLayer::new().limits(limits(store, Limit::new(200.0, 1))));
    let mut burst = Vec::new();
    for _ in 0..1_000 {
        let (client, url) = (client.clone(), server.url("/shared"));
        burst.push(tokio::spawn(async move { send(&client, url, "big").await }));
    }
    // The burst is queued once it is being served: each request joins the
    // queue on its first poll, and the queue serves 200 a second.
    idem_tests::wait_until(
        Duration::from_secs(30),
        "the burst to be served",
        async || provider.owners().len() >= 3,
    )
    .await;
    let small: Vec<_> = (0..10)
        .map(|_| {
            let (client, url) = (client.clone(), server.url("/shared"));
            tokio::spawn(async move { send(&client, url, "small").await })
        })
        .collect();
    for request in small {
        let (status, info) = request.await.expect("task").expect("sent");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(info.boundary.as_deref(), Some("shared"));
    }
    let owners = provider.owners();
    burst.iter().for_each(tokio::task::JoinHandle::abort);
    let last_small = owners
        .iter()
        .rposition(|owner| owner == "small")
        .expect("the small owner's requests arrived");
    let big_before = owners[..last_small]
        .iter()
        .filter(|owner| *owner == "big")
        .count();
    // Round robin: the 10 alternate with the burst, so about 10 of it
    // (plus the few served before the 10 queued) come first.
    assert!(
        big_before <= 40,
        "{big_before} of the burst were served before the small owner's last request"
    );
}

/// A request whose turn would come after its deadline fails at once with
/// `Error::Limited`; one that waited says how long in `RetryInfo::held`.
/// Turns 2.5 s apart and a 1 s deadline: every bound below holds with
/// more than a second to spare on a slow machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_past_the_deadline_fails_at_once() {
    let provider = Provider::default();
    let server = provider.start().await;
    let gate = LocalGate::new();
    let limits = limits(gate.clone(), Limit::new(0.4, 1));
    let patient = client(RetryLayer::new().limits(limits.clone()));
    let deadline = Duration::from_secs(1);
    let hasty = client(RetryLayer::new().limits(limits).deadline(deadline));
    let (status, info) = send(&patient, server.url("/slow"), "")
        .await
        .expect("first");
    assert_eq!(status, StatusCode::OK);
    // Held for a turn, it would have waited 2.5 s.
    assert!(
        info.held < deadline,
        "the first request was held {:?}",
        info.held
    );
    // The next turn is 2.5 s away: too late for a 1 s deadline.
    let started = Instant::now();
    match send(&hasty, server.url("/slow"), "").await {
        Err(Error::Limited { boundary, wait, .. }) => {
            assert_eq!(boundary, "slow");
            assert!(wait > deadline, "{wait:?}");
        }
        other => panic!("expected Limited, got {other:?}"),
    }
    // Waiting out its deadline first would take the whole second.
    assert!(
        started.elapsed() < deadline,
        "it waited {:?}",
        started.elapsed()
    );
    // A patient request waits its turn and says so.
    let (status, info) = send(&patient, server.url("/slow"), "")
        .await
        .expect("waited");
    assert_eq!(status, StatusCode::OK);
    assert!(info.held >= Duration::from_millis(100), "{:?}", info.held);
    let arrivals = provider.arrivals("slow");
    assert_eq!(arrivals.len(), 2);
    assert!(
        arrivals[1] - arrivals[0] >= Duration::from_millis(2400),
        "turns {:?} apart",
        arrivals[1] - arrivals[0]
    );
}

/// An unreachable gate holds requests back, or falls back to a local
/// limit, as chosen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_gate_holds_back_or_falls_back_as_chosen() {
    let provider = Provider::default();
    let server = provider.start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("redis://127.0.0.1:{closed}");
    let gate = || {
        RedisStore::builder(&url)
            .timeout(Duration::from_millis(200))
            .build()
            .expect("store")
    };
    let holding = client(RetryLayer::new().limits(limits(gate(), Limit::new(10.0, 2))));
    assert!(matches!(
        send(&holding, server.url("/x"), "").await,
        Err(Error::Gate { .. })
    ));
    let falling_back = client(
        RetryLayer::new()
            .limits(limits(gate(), Limit::new(10.0, 2)).on_gate_error(OnGateError::FallBackLocal)),
    );
    // The local limit holds: 6 requests at 10/s with bursts of 2 take at
    // least (6 - 2) / 10 s between the first arrival and the last (without
    // a limiter they would arrive within milliseconds).
    for _ in 0..6 {
        let (status, _) = send(&falling_back, server.url("/x"), "")
            .await
            .expect("sent");
        assert_eq!(status, StatusCode::OK);
    }
    let arrivals = provider.arrivals("x");
    assert_eq!(arrivals.len(), 6);
    let spread = arrivals[5].duration_since(arrivals[0]);
    assert!(
        spread >= Duration::from_millis(350),
        "6 requests within {spread:?}: the local limit did not hold"
    );
}

/// The retry budget of a boundary is shared: two clients on one Redis,
/// allowed 2 retries a window between them, send 2 first attempts and 2
/// retries in all to a provider that keeps answering 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_is_shared_across_clients() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let provider = Provider::default();
    let server = provider.start().await;
    let budget = SharedBudget {
        window: Duration::from_secs(60),
        min_retries: 2,
        percent: 0.0,
    };
    let mut stopped = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::from_url(&redis.url()).expect("store");
        let client = client(
            RetryLayer::new()
                .max_attempts(10)
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_millis(50))
                .limits(limits(store, Limit::new(1_000.0, 10)).shared_budget(budget)),
        );
        let (status, info) = send(&client, server.url("/down"), "")
            .await
            .expect("answered");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        stopped.push(info.stopped);
    }
    assert_eq!(
        provider.arrivals("down").len(),
        4,
        "2 first attempts + 2 shared retries"
    );
    assert!(
        stopped
            .iter()
            .all(|s| *s == Some(StopReason::BudgetExhausted)),
        "{stopped:?}"
    );
}
