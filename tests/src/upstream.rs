//! A counting upstream for gateway tests: it records every request it
//! executes, with the idempotency headers it saw.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode, header},
    response::IntoResponse,
    routing::post,
};
use tokio::sync::{Notify, Semaphore};

/// What one execution saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The path.
    pub path: String,
    /// The `Idempotency-Key` it received.
    pub key: Option<String>,
    /// The `Idempotency-Attempt` it received.
    pub attempt: Option<String>,
    /// The `x-idem-admin-token` it received (a gateway never forwards it).
    pub admin_token: Option<String>,
    /// The W3C `traceparent` it received.
    pub traceparent: Option<String>,
    /// The W3C `tracestate` it received.
    pub tracestate: Option<String>,
}

/// The upstream's shared state.
#[derive(Clone)]
pub struct Upstream {
    /// Every execution, in order.
    pub seen: Arc<Mutex<Vec<Seen>>>,
    runs: Arc<AtomicUsize>,
    /// `/slow` waits for a permit.
    pub gate: Arc<Semaphore>,
    /// Notified when a `/slow` request arrives.
    pub entered: Arc<Notify>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            seen: Arc::default(),
            runs: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            entered: Arc::default(),
        }
    }
}

impl Upstream {
    /// How many requests it executed.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits until it has executed `n` requests; fails the test after 30 s.
    pub async fn wait_runs(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let entered = self.entered.notified();
            if self.runs() >= n {
                return;
            }
            let waited = tokio::time::timeout_at(deadline, entered).await;
            assert!(
                waited.is_ok(),
                "the upstream ran {} of {n} requests in 30 s",
                self.runs()
            );
        }
    }

    fn record(&self, path: String, headers: &HeaderMap) -> usize {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let seen = Seen {
            path,
            key: text("idempotency-key"),
            attempt: text("idempotency-attempt"),
            admin_token: text("x-idem-admin-token"),
            traceparent: text("traceparent"),
            tracestate: text("tracestate"),
        };
        if let Ok(mut all) = self.seen.lock() {
            all.push(seen);
        }
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        self.entered.notify_waiters();
        n
    }

    /// The routes:
    /// * `POST /orders`: 201, `Location`, `Set-Cookie`, a body naming the run.
    /// * `POST /status/{code}`: that status.
    /// * `POST /slow`: waits for a gate permit, then 201.
    /// * `POST /no-store`: 201 with `idem-no-store: 1` (not to be stored).
    /// * `POST /nothing-ran`: 400 with `idem-nothing-ran: 1` (refused before
    ///   it ran).
    /// * `POST /echo`: 201 whose body is the request's body, with
    ///   `x-order-ref: REFMARK-<run>`.
    /// * any other request: 201, a body naming the path as received and
    ///   the run.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/orders", post(orders))
            .route("/no-store", post(no_store))
            .route("/nothing-ran", post(nothing_ran))
            .route("/echo", post(echo))
            .route("/status/{code}", post(status))
            .route("/slow", post(slow))
            .fallback(any_path)
            .with_state(self.clone())
    }
}

async fn orders(
    State(up): State<Upstream>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> impl IntoResponse {
    let n = up.record("/orders".to_owned(), &headers);
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/orders/{n}")),
            (header::SET_COOKIE, format!("session={n}")),
            (header::CONTENT_TYPE, "application/json".to_owned()),
        ],
        format!("{{\"id\":{n},\"bytes\":{}}}", body.len()),
    )
}

async fn echo(
    State(up): State<Upstream>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> impl IntoResponse {
    let n = up.record("/echo".to_owned(), &headers);
    (
        StatusCode::CREATED,
        [
            ("x-order-ref", format!("REFMARK-{n}")),
            ("content-type", "application/json".to_owned()),
        ],
        body,
    )
}

async fn status(
    State(up): State<Upstream>,
    Path(code): Path<u16>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let n = up.record(format!("/status/{code}"), &headers);
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        format!("status {code} run {n}"),
    )
}

async fn no_store(State(up): State<Upstream>, headers: HeaderMap) -> impl IntoResponse {
    let n = up.record("/no-store".to_owned(), &headers);
    (
        StatusCode::CREATED,
        [("idem-no-store", "1")],
        format!("one-time secret {n}"),
    )
}

async fn nothing_ran(State(up): State<Upstream>, headers: HeaderMap) -> impl IntoResponse {
    up.record("/nothing-ran".to_owned(), &headers);
    (
        StatusCode::BAD_REQUEST,
        [("idem-nothing-ran", "1")],
        "the order did not validate",
    )
}

async fn slow(State(up): State<Upstream>, headers: HeaderMap) -> impl IntoResponse {
    let n = up.record("/slow".to_owned(), &headers);
    if let Ok(permit) = up.gate.acquire().await {
        permit.forget();
    }
    (StatusCode::CREATED, format!("slow run {n}"))
}

async fn any_path(
    State(up): State<Upstream>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> impl IntoResponse {
    let path = uri.path().to_owned();
    let n = up.record(path.clone(), &headers);
    (StatusCode::CREATED, format!("{path} run {n}"))
}
