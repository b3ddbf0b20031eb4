//! Checks for your own service behind the layer, the way idem checks
//! itself: a duplicate replays byte for byte, concurrent duplicates run
//! once, a changed payload conflicts, a failure releases the key.
//!
//! Each check sends real requests through your service (a router with the
//! layer applied, called in process) and answers `Err` with what it saw
//! when the promise does not hold. `request(key)` makes the request under
//! test with that key; each check uses keys of its own.
//!
//! ```
//! use axum::{Router, routing::post};
//! use idem_layer::{IdempotencyLayer, TenantFromHeader, testing::Checks};
//! use idem_memory::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
//! let app = Router::new()
//!     .route("/orders", post(move || {
//!         let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
//!         async move { (http::StatusCode::CREATED, format!("order {n}")) }
//!     }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromHeader::from_static("x-tenant")));
//! let checks = Checks::new(app, |key: &str| {
//!     http::Request::post("/orders")
//!         .header("x-tenant", "acme")
//!         .header("idempotency-key", key)
//!         .header("content-type", "application/json")
//!         .body(http_body_util::Full::new(bytes::Bytes::from_static(br#"{"sku":"book"}"#)))
//!         .unwrap()
//! });
//! checks.duplicates_replay("check-1").await.unwrap();
//! checks.concurrent_duplicates_run_once("check-2", 8).await.unwrap();
//! # }
//! ```

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};

use crate::{IDEMPOTENT_REPLAYED, default_replay_denylist};

/// A service and the request to check it with.
pub struct Checks<S, F> {
    service: S,
    request: F,
}

/// One answer, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    /// Whether it is a replay (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v.as_bytes() == b"true")
    }

    /// The problem `code`, for a problem answer.
    pub fn code(&self) -> Option<String> {
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        Some(json.get("code")?.as_str()?.to_owned())
    }
}

impl<S, F, B> Checks<S, F>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: Body + Send,
    B::Data: Send,
    B::Error: std::fmt::Debug,
    F: Fn(&str) -> Request<Full<Bytes>>,
{
    /// Checks `service` with the requests `request(key)` makes.
    pub fn new(service: S, request: F) -> Self {
        Self { service, request }
    }

    /// Sends `request` through the service and reads the answer whole.
    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Answer, String> {
        let response = self
            .service
            .clone()
            .oneshot(request)
            .await
            .map_err(|error| format!("the service failed: {error:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|error| format!("the body failed: {error:?}"))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// The request under `key` twice: the second is a replay with the
    /// first's status, body bytes and headers (but those a replay leaves
    /// out by default: [`default_replay_denylist`], `Date` and
    /// `Set-Cookie` among them).
    pub async fn duplicates_replay(&self, key: &str) -> Result<(), String> {
        let first = self.send((self.request)(key)).await?;
        if first.replayed() {
            return Err(format!("the first request of {key:?} was a replay"));
        }
        let again = self.send((self.request)(key)).await?;
        if !again.replayed() {
            return Err(format!(
                "the duplicate was not a replay: {} {:?}",
                again.status, again.body
            ));
        }
        if (again.status, &again.body) != (first.status, &first.body) {
            return Err(format!(
                "the replay differs: {} {:?} after {} {:?}",
                again.status, again.body, first.status, first.body
            ));
        }
        let left_out = default_replay_denylist();
        for (name, value) in &first.headers {
            if !left_out.contains(name) && again.headers.get(name) != Some(value) {
                return Err(format!("the replay lacks the header {name}: {value:?}"));
            }
        }
        Ok(())
    }

    /// `copies` copies of the request under `key` at once: exactly one
    /// runs (the one answer that is no replay and no `409`), and every
    /// other success is a replay of its bytes.
    pub async fn concurrent_duplicates_run_once(
        &self,
        key: &str,
        copies: usize,
    ) -> Result<(), String> {
        let sends = (0..copies).map(|_| self.send((self.request)(key)));
        let answers = futures_util::future::join_all(sends).await;
        let answers: Vec<Answer> = answers.into_iter().collect::<Result<_, _>>()?;
        let ran: Vec<&Answer> = answers
            .iter()
            .filter(|a| !a.replayed() && a.status != StatusCode::CONFLICT)
            .collect();
        let [ran] = ran.as_slice() else {
            return Err(format!(
                "{} of {copies} concurrent duplicates ran: {:?}",
                ran.len(),
                ran.iter().map(|a| (a.status, &a.body)).collect::<Vec<_>>()
            ));
        };
        for answer in &answers {
            let busy = answer.status == StatusCode::CONFLICT
                && answer.code().as_deref() == Some("idempotency_in_progress");
            let same = answer.replayed() && answer.body == ran.body;
            if !(busy || same || std::ptr::eq(answer, *ran)) {
                return Err(format!(
                    "a duplicate got {} {:?}, neither the run's bytes nor 409 in progress",
                    answer.status, answer.body
                ));
            }
        }
        Ok(())
    }

    /// The request under `key`, then `changed` (the same key with another
    /// payload): `422 idempotency_conflict`, and the first's record stands
    /// (the request again replays).
    pub async fn changed_payload_conflicts(
        &self,
        key: &str,
        changed: Request<Full<Bytes>>,
    ) -> Result<(), String> {
        let first = self.send((self.request)(key)).await?;
        let conflict = self.send(changed).await?;
        if conflict.status != StatusCode::UNPROCESSABLE_ENTITY
            || conflict.code().as_deref() != Some("idempotency_conflict")
        {
            return Err(format!(
                "a changed payload got {} {:?}, not 422 idempotency_conflict",
                conflict.status,
                conflict.code()
            ));
        }
        let again = self.send((self.request)(key)).await?;
        if !again.replayed() || again.body != first.body {
            return Err(
                "the conflict changed the record: the request no longer replays".to_owned(),
            );
        }
        Ok(())
    }

    /// `failing` (a request whose handler fails temporarily: a 5xx) and
    /// then the request under the same key: the failure is not replayed,
    /// the retry runs.
    pub async fn failure_releases(
        &self,
        key: &str,
        failing: Request<Full<Bytes>>,
    ) -> Result<(), String> {
        let failed = self.send(failing).await?;
        if !failed.status.is_server_error() {
            return Err(format!("the failing request answered {}", failed.status));
        }
        let retry = self.send((self.request)(key)).await?;
        if retry.replayed()
            || retry.status == StatusCode::CONFLICT
            || retry.status.is_server_error()
        {
            return Err(format!(
                "the retry after a failure did not run: {} {:?}",
                retry.status, retry.body
            ));
        }
        Ok(())
    }
}
