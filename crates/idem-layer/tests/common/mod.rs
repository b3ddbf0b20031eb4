//! A counting inner service and request helpers for the layer's tests.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use idem_layer::{BoxError, IdempotencyContext, IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, Service, ServiceExt, util::BoxCloneSyncService};

pub const TENANT: &str = "x-tenant";

/// What the inner service has seen.
#[derive(Clone)]
pub struct Probe {
    /// How many times the handler ran.
    pub calls: Arc<AtomicUsize>,
    /// How many handler runs finished.
    pub finished: Arc<AtomicUsize>,
    /// `/slow` waits for a permit here.
    pub gate: Arc<Semaphore>,
    /// Notified whenever a handler starts.
    pub entered: Arc<Notify>,
}

impl Default for Probe {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            finished: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            entered: Arc::default(),
        }
    }
}

impl Probe {
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    pub fn open_gate(&self, permits: usize) {
        self.gate.add_permits(permits);
    }
}

pub type Inner = BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, BoxError>;

/// The inner service. Paths:
/// * `/orders`: 201, a fresh order number, `Location`, `Set-Cookie`, `Date`.
/// * `/status/N`: status N.
/// * `/slow`: waits for a gate permit, then 201.
/// * `/sleep/N`: sleeps N ms, then 201.
/// * `/panic`, `/error`: panics, or returns an error.
/// * `/big/N`: 200 with N bytes.
/// * `/ctx`: 200 with the idempotency context as text.
pub fn inner(probe: &Probe) -> Inner {
    let probe = probe.clone();
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Full<Bytes>>| {
        let probe = probe.clone();
        async move {
            let n = probe.calls.fetch_add(1, Ordering::SeqCst) + 1;
            probe.entered.notify_waiters();
            let path = request.uri().path().to_owned();
            let ctx = request.extensions().get::<IdempotencyContext>().cloned();
            let body = request
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let response = if path == "/orders" || path == "/slow" {
                if path == "/slow" {
                    probe
                        .gate
                        .acquire()
                        .await
                        .map_err(|e| Box::new(e) as BoxError)?
                        .forget();
                }
                Response::builder()
                    .status(201)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::LOCATION, format!("/orders/{n}"))
                    .header(header::SET_COOKIE, format!("session={n}"))
                    .header(header::DATE, "Sun, 29 Nov 2026 10:00:00 GMT")
                    .header("x-echo-len", body.len().to_string())
                    .body(Full::new(Bytes::from(format!("{{\"order\":{n}}}"))))
                    .map_err(|e| Box::new(e) as BoxError)?
            } else if let Some(code) = path.strip_prefix("/status/") {
                let status = code.parse::<u16>().map_err(|e| Box::new(e) as BoxError)?;
                Response::builder()
                    .status(status)
                    .body(Full::new(Bytes::from(format!("status {status} run {n}"))))
                    .map_err(|e| Box::new(e) as BoxError)?
            } else if let Some(ms) = path.strip_prefix("/sleep/") {
                let ms = ms.parse::<u64>().map_err(|e| Box::new(e) as BoxError)?;
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                Response::builder()
                    .status(201)
                    .body(Full::new(Bytes::from(format!("slept run {n}"))))
                    .map_err(|e| Box::new(e) as BoxError)?
            } else if path == "/panic" {
                panic!("handler panicked on purpose");
            } else if path == "/error" {
                probe.finished.fetch_add(1, Ordering::SeqCst);
                return Err("handler error".into());
            } else if let Some(len) = path.strip_prefix("/big/") {
                let len = len.parse::<usize>().map_err(|e| Box::new(e) as BoxError)?;
                Response::new(Full::new(Bytes::from(vec![b'x'; len])))
            } else if path == "/ctx" {
                let ctx = ctx.ok_or("no context")?;
                let text = format!(
                    "key={} tenant={} op={} generation={} superseded={}",
                    ctx.key.as_str(),
                    ctx.tenant,
                    ctx.operation,
                    ctx.generation,
                    ctx.superseded
                        .map(|a| a.generation.to_string())
                        .unwrap_or_default()
                );
                Response::new(Full::new(Bytes::from(text)))
            } else {
                Response::builder()
                    .status(404)
                    .body(Full::new(Bytes::new()))
                    .map_err(|e| Box::new(e) as BoxError)?
            };
            probe.finished.fetch_add(1, Ordering::SeqCst);
            Ok::<_, BoxError>(response)
        }
    }))
}

/// The layer as the tests configure it by default.
pub fn layer(store: &MemoryStore) -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(store.clone())
        .tenant(TenantFromHeader::new(HeaderName::from_static(TENANT)))
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// Checks a refusal: its status and problem `code`.
    pub fn assert_problem(&self, status: StatusCode, code: &str) {
        assert_eq!(self.status, status, "{:?}", self.code());
        assert_eq!(self.code().as_deref(), Some(code));
    }

    /// The problem `code` member, if the body is a problem document.
    pub fn code(&self) -> Option<String> {
        let value: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        value.get("code")?.as_str().map(str::to_owned)
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn content_type(&self) -> Option<&str> {
        self.header("content-type")
    }
}

/// Sends one request through a service and reads the whole answer. The
/// future does not borrow the service.
pub fn send<S, B>(
    service: &S,
    request: Request<Full<Bytes>>,
) -> impl std::future::Future<Output = Answer> + use<S, B>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(request);
    async move {
        let response = response.await.expect("service error");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// A records API call from tenant `t1`.
pub async fn records_call<S: idem_core::RecordsAdmin>(
    records: &idem_layer::RecordsService<S>,
    method: http::Method,
    uri: &str,
) -> Answer {
    send(records, self::method(method, uri).tenant("t1").build()).await
}

/// A request builder: `post("/orders").key("k").tenant("t").json("{}")`.
pub struct Req(http::request::Builder, Bytes);

pub fn post(path: &str) -> Req {
    Req(Request::post(path), Bytes::new())
}

pub fn method(method: http::Method, path: &str) -> Req {
    Req(Request::builder().method(method).uri(path), Bytes::new())
}

impl Req {
    pub fn key(self, key: &str) -> Self {
        Req(self.0.header("idempotency-key", key), self.1)
    }

    pub fn tenant(self, tenant: &str) -> Self {
        Req(self.0.header(TENANT, tenant), self.1)
    }

    pub fn header(self, name: &str, value: &str) -> Self {
        Req(self.0.header(name, value), self.1)
    }

    pub fn json(self, body: &str) -> Self {
        Req(
            self.0.header("content-type", "application/json"),
            Bytes::copy_from_slice(body.as_bytes()),
        )
    }

    pub fn body(self, body: impl Into<Bytes>) -> Self {
        Req(self.0, body.into())
    }

    pub fn build(self) -> Request<Full<Bytes>> {
        self.0.body(Full::new(self.1)).expect("valid request")
    }
}

/// The standard keyed order request of tenant `t1`.
/// A keyed POST of `path` from tenant `t1`, without a body.
pub fn keyed(path: &str, key: &str) -> Request<Full<Bytes>> {
    post(path).key(key).tenant("t1").build()
}

/// A keyed POST of `path` with a JSON body, from `tenant`.
pub fn keyed_json(path: &str, key: &str, tenant: &str, json: &str) -> Request<Full<Bytes>> {
    post(path).key(key).tenant(tenant).json(json).build()
}

pub fn order(key: &str, body: &str) -> Request<Full<Bytes>> {
    post("/orders").key(key).tenant("t1").json(body).build()
}

/// A memory store, a probe, and the default layer's service over them.
pub fn fresh() -> (
    MemoryStore,
    Probe,
    idem_layer::Idempotency<Inner, MemoryStore>,
) {
    fresh_with(|layer| layer)
}

/// [`fresh`], with the layer configured by `configure`.
pub fn fresh_with(
    configure: impl FnOnce(IdempotencyLayer<MemoryStore>) -> IdempotencyLayer<MemoryStore>,
) -> (
    MemoryStore,
    Probe,
    idem_layer::Idempotency<Inner, MemoryStore>,
) {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let svc = service(&configure(layer(&store)), &probe);
    (store, probe, svc)
}

pub fn service(
    layer: &IdempotencyLayer<MemoryStore>,
    probe: &Probe,
) -> idem_layer::Idempotency<Inner, MemoryStore> {
    layer.layer(inner(probe))
}

#[allow(unused_imports)] // not every test file waits
pub use idem_core::conformance::{poll_until, wait_until};

/// Waits until the handler has started `n` times; fails after 10 s (of
/// the runtime's clock: at once, with time paused, when nothing else can
/// happen), so a regression fails the test instead of hanging it.
pub async fn wait_calls(probe: &Probe, n: usize) {
    let started = async {
        loop {
            let entered = probe.entered.notified();
            if probe.calls() >= n {
                return;
            }
            entered.await;
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(10), started)
        .await
        .is_err()
    {
        panic!(
            "the handler started {} times, not {n}, within 10 s",
            probe.calls()
        );
    }
}

/// What a [`metrics_util::debugging::DebuggingRecorder`] snapshot holds.
pub type Snapshot = [(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    metrics_util::debugging::DebugValue,
)];

/// How many keyed requests the snapshot counts with `outcome`.
pub fn outcome_count(snapshot: &Snapshot, outcome: &str) -> u64 {
    counter_total(snapshot, "idem_requests_total", "outcome", outcome)
}

/// The sum of the snapshot's counters named `name` whose label `label` is
/// `value`.
pub fn counter_total(snapshot: &Snapshot, name: &str, label: &str, value: &str) -> u64 {
    snapshot
        .iter()
        .filter(|(key, ..)| {
            key.kind() == metrics_util::MetricKind::Counter
                && key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == label && l.value() == value)
        })
        .map(|(.., value)| match value {
            metrics_util::debugging::DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

/// How many samples the snapshot's histograms named `name` hold (with a
/// label of value `label`, when given).
pub fn histogram_samples(snapshot: &Snapshot, name: &str, label: Option<&str>) -> usize {
    snapshot
        .iter()
        .filter(|(key, ..)| {
            key.key().name() == name
                && label.is_none_or(|label| key.key().labels().any(|l| l.value() == label))
        })
        .map(|(.., value)| match value {
            metrics_util::debugging::DebugValue::Histogram(values) => values.len(),
            _ => 0,
        })
        .sum()
}
