//! The layer's behaviours, checked on any store: the state table through
//! HTTP, replay fidelity, conflicts, in-progress answers, releases,
//! cancellation and the records API. [`layer_tests!`](crate::layer_tests)
//! runs each as a test on a store; every check uses its own tenant, so
//! checks may share one store.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, extract::Path, routing::post};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    Fleet, RecordsAdmin, Reservation, ReserveRequest, Scope, ScopeFormat, ScopeHash, ScopeSecret,
    Store,
};
use idem_layer::{
    IdempotencyContext, IdempotencyLayer, TenantFromHeader, fingerprint::FingerprintFormat,
};
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// An app on `store`: `/orders` answers 201 with a run number, headers
/// and a binary body; `/fail` answers 503; `/panic` panics; `/big` answers
/// a body over the storable limit; `/slow` waits for a permit;
/// `/status/{n}` answers status n; `/ctx` answers the attempt's generation
/// and whether it took over from another.
pub struct App {
    router: Router,
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    tenant: String,
}

/// What came back.
#[derive(Debug)]
pub struct Answer {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Answer {
    fn code(&self) -> Option<String> {
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        Some(json.get("code")?.as_str()?.to_owned())
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// What the suite needs of a store: the core contract, records
/// administration (the records API is mounted) and the fleet's claims.
pub trait SuiteStore: Store + RecordsAdmin + Fleet {}

impl<T: Store + RecordsAdmin + Fleet> SuiteStore for T {}

impl App {
    /// The app on `store`, with a fresh tenant.
    pub fn new<S: SuiteStore>(store: S) -> Self {
        Self::with_layer(Self::layer(store))
    }

    /// The suite's layer on `store` (tenant from `x-tenant`, responses up
    /// to 1 KiB stored), to adjust before [`App::with_layer`].
    pub fn layer<S: SuiteStore>(store: S) -> IdempotencyLayer<S> {
        IdempotencyLayer::new(store)
            .tenant(TenantFromHeader::from_static("x-tenant"))
            .answers(|a| a.max_response(1024))
    }

    /// The app behind `layer`, with a fresh tenant.
    pub fn with_layer<S: SuiteStore>(layer: IdempotencyLayer<S>) -> Self {
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (r1, r2, r3, r4, r5, r6) = (
            Arc::clone(&runs),
            Arc::clone(&runs),
            Arc::clone(&runs),
            Arc::clone(&runs),
            Arc::clone(&runs),
            Arc::clone(&runs),
        );
        let g = Arc::clone(&gate);
        let router = Router::new()
            .route(
                "/orders",
                post(move || {
                    let n = r1.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        (
                            StatusCode::CREATED,
                            [
                                ("location", format!("/orders/{n}")),
                                ("x-run", n.to_string()),
                            ],
                            Bytes::from(vec![0u8, 0xff, b'\r', b'\n', n as u8]),
                        )
                    }
                }),
            )
            .route(
                "/fail",
                post(move || {
                    r2.fetch_add(1, Ordering::SeqCst);
                    async { StatusCode::SERVICE_UNAVAILABLE }
                }),
            )
            .route(
                "/panic",
                post(move || {
                    r3.fetch_add(1, Ordering::SeqCst);
                    async {
                        if true {
                            panic!("the handler panics");
                        }
                        StatusCode::OK
                    }
                }),
            )
            .route(
                "/big",
                post(|| async { (StatusCode::CREATED, vec![b'x'; 4096]) }),
            )
            .route(
                "/slow",
                post(move || {
                    let (runs, gate) = (Arc::clone(&r4), Arc::clone(&g));
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        if let Ok(permit) = gate.acquire().await {
                            permit.forget();
                        }
                        (StatusCode::CREATED, "slow done")
                    }
                }),
            )
            .route(
                "/status/{n}",
                post(move |Path(n): Path<u16>| {
                    let run = r5.fetch_add(1, Ordering::SeqCst) + 1;
                    let status = StatusCode::from_u16(n).unwrap_or(StatusCode::BAD_REQUEST);
                    async move { (status, format!("status {n} run {run}")) }
                }),
            )
            .route(
                "/ctx",
                post(
                    move |ctx: IdempotencyContext,
                          slot: Option<axum::Extension<idem_core::CompletionSlot>>| {
                        r6.fetch_add(1, Ordering::SeqCst);
                        let superseded = ctx.superseded.map(|a| a.generation);
                        async move {
                            format!(
                                "generation={} superseded={superseded:?} slot={}",
                                ctx.generation,
                                slot.is_some()
                            )
                        }
                    },
                ),
            );
        let router = router
            .route_service("/records", layer.records_service())
            .layer(layer);
        Self {
            router,
            runs,
            gate,
            tenant: format!("suite-{}", uuid::Uuid::new_v4()),
        }
    }

    /// How many times a handler ran.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits (at most 20 s) until a handler has started.
    pub async fn wait_until_running(&self) {
        crate::wait_until(Duration::from_secs(20), "a handler to start", async || {
            self.runs() > 0
        })
        .await;
    }

    async fn call(&self, request: Request<axum::body::Body>) -> Answer {
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("infallible");
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    /// A keyed POST of `path` with this JSON body.
    pub async fn post(&self, path: &str, key: &str, body: &'static str) -> Answer {
        let request = Request::post(path)
            .header("idempotency-key", key)
            .header("x-tenant", &self.tenant)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .expect("request");
        self.call(request).await
    }

    /// A records API call.
    pub async fn records(&self, method: &str, query: &str) -> Answer {
        self.records_as(method, query, &[("x-tenant", &self.tenant)])
            .await
    }

    /// A records API call with these headers (and no others).
    pub async fn records_as(&self, method: &str, query: &str, headers: &[(&str, &str)]) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("/records{query}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(axum::body::Body::empty()).expect("request");
        self.call(request).await
    }
}

/// A new key runs once; its duplicate replays status, headers and binary
/// body exactly, marked replayed.
pub async fn replays_exactly<S: SuiteStore>(store: S) {
    let app = App::new(store);
    let first = app.post("/orders", "k", "{\"a\":1}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = app.post("/orders", "k", "{ \"a\" : 1 }").await;
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers.get("location"), first.headers.get("location"));
    assert_eq!(again.headers.get("x-run"), first.headers.get("x-run"));
    assert_eq!(app.runs(), 1);
}

/// The same key with another payload is `422 idempotency_conflict`.
pub async fn another_payload_conflicts<S: SuiteStore>(store: S) {
    let app = App::new(store);
    assert_eq!(
        app.post("/orders", "k", "{\"a\":1}").await.status,
        StatusCode::CREATED
    );
    let other = app.post("/orders", "k", "{\"a\":2}").await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(app.runs(), 1);
}

/// A duplicate while the first runs is `409 idempotency_in_progress` with
/// `Retry-After`; once done it replays.
pub async fn duplicates_in_flight_get_409<S: SuiteStore>(store: S) {
    let app = Arc::new(App::new(store));
    let running = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post("/slow", "k", "{}").await })
    };
    app.wait_until_running().await;
    let busy = app.post("/slow", "k", "{}").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    assert!(busy.headers.contains_key("retry-after"));
    app.gate.add_permits(1);
    let first = running.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.post("/slow", "k", "{}").await;
    assert!(replay.replayed());
    assert_eq!(app.runs(), 1);
}

/// A temporary failure (503) releases the key: the retry runs again; a
/// panic is `500 handler_failed` and releases it too.
pub async fn failures_release_the_key<S: SuiteStore>(store: S) {
    let app = App::new(store);
    assert_eq!(
        app.post("/fail", "f", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        app.post("/fail", "f", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(app.runs(), 2, "a released key runs again");
    let panicked = app.post("/panic", "p", "{}").await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(panicked.code().as_deref(), Some("handler_failed"));
    let _ = app.post("/panic", "p", "{}").await;
    assert_eq!(app.runs(), 4);
}

/// A response over the storable limit reaches its client whole; retries
/// get `409 idempotency_response_not_stored` and do not run it again.
pub async fn oversized_responses_are_not_replayed<S: SuiteStore>(store: S) {
    let app = App::new(store);
    let first = app.post("/big", "b", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 4096);
    let again = app.post("/big", "b", "{}").await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(
        again.code().as_deref(),
        Some("idempotency_response_not_stored")
    );
}

/// Cancelled through the records API while running: the retry gets 410,
/// the running attempt's client gets 410 too (its completion is fenced).
pub async fn cancel_fences_the_running_attempt<S: SuiteStore>(store: S) {
    let app = Arc::new(App::new(store));
    let running = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post("/slow", "c", "{}").await })
    };
    app.wait_until_running().await;
    let cancel = app.records("DELETE", "?method=POST&path=/slow&key=c").await;
    assert_eq!(cancel.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&cancel.body).expect("json");
    assert_eq!(json["result"], "cancelled");
    app.gate.add_permits(1);
    let first = running.await.expect("join");
    assert_eq!(first.status, StatusCode::GONE);
    let retry = app.post("/slow", "c", "{}").await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.code().as_deref(), Some("idempotency_cancelled"));
    assert_eq!(app.runs(), 1);
}

/// With output by key on, a caller fetches its own stored answer by its
/// key alone (sealed at rest, opened): exact status, headers and body,
/// marked replayed, the handler not run again; a running attempt is waited
/// for within `wait`; a released record, an erased one, an unknown key and
/// another tenant's key are `404`; `tenant=`, the anonymous tenant and a
/// layer with it off are `403 idempotency_output_refused`.
pub async fn an_answer_is_fetched_by_its_key<S: SuiteStore>(store: S) {
    let store = Arc::new(store);
    let keyring = || idem_layer::sealing::Keyring::new(1, [7; 32]);
    let app = Arc::new(App::with_layer(
        App::layer(Arc::clone(&store))
            .sealing(keyring())
            .records(|r| r.admin_token("the admin").output_by_key(true)),
    ));
    let output = |key: &str| format!("?method=POST&path=/orders&key={key}&output=true");
    let first = app.post("/orders", "out-1", "{\"amount\":5}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let fetched = app.records("GET", &output("out-1")).await;
    assert_eq!(fetched.status, StatusCode::CREATED, "{fetched:?}");
    assert!(fetched.replayed());
    assert_eq!(fetched.body, first.body);
    for name in ["location", "x-run"] {
        assert_eq!(fetched.headers.get(name), first.headers.get(name), "{name}");
    }
    assert_eq!(app.runs(), 1, "fetching runs nothing");

    let missing = app.records("GET", &output("never")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(
        missing.code().as_deref(),
        Some("idempotency_record_not_found")
    );
    let other = app
        .records_as("GET", &output("out-1"), &[("x-tenant", "another tenant")])
        .await;
    assert_eq!(
        other.status,
        StatusCode::NOT_FOUND,
        "never another tenant's"
    );
    let refused = |answer: &Answer| {
        assert_eq!(answer.status, StatusCode::FORBIDDEN, "{answer:?}");
        assert_eq!(answer.code().as_deref(), Some("idempotency_output_refused"));
    };
    let admin = app
        .records_as(
            "GET",
            &format!("{}&tenant={}", output("out-1"), app.tenant),
            &[("x-idem-admin-token", "the admin")],
        )
        .await;
    refused(&admin);
    refused(&app.records_as("GET", &output("out-1"), &[]).await);

    // A running attempt: not yet, then waited for.
    let running = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post("/slow", "out-slow", "{}").await })
    };
    crate::wait_until(
        Duration::from_secs(20),
        "the slow handler to start",
        async || app.runs() == 2,
    )
    .await;
    let slow = |wait: &str| {
        let app = Arc::clone(&app);
        let query = format!("?method=POST&path=/slow&key=out-slow&output=true{wait}");
        async move { app.records("GET", &query).await }
    };
    let busy = slow("").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    let waiting = tokio::spawn(slow("&wait=30s"));
    app.gate.add_permits(1);
    assert_eq!(running.await.expect("join").status, StatusCode::CREATED);
    let waited = waiting.await.expect("join");
    assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
    assert_eq!(&waited.body[..], b"slow done");

    // Released by a failure: nothing to fetch, the request may be sent again.
    assert_eq!(
        app.post("/fail", "out-fail", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let released = app
        .records("GET", "?method=POST&path=/fail&key=out-fail&output=true")
        .await;
    assert_eq!(released.status, StatusCode::NOT_FOUND);
    let detail = String::from_utf8_lossy(&released.body).into_owned();
    assert!(detail.contains("released"), "{detail}");

    // Erased: gone.
    let erase = format!(
        "?method=POST&path=/orders&key=out-1&tenant={}&action=erase",
        app.tenant
    );
    let erased = app
        .records_as("POST", &erase, &[("x-idem-admin-token", "the admin")])
        .await;
    assert_eq!(erased.status, StatusCode::OK, "{erased:?}");
    assert_eq!(
        app.records("GET", &output("out-1")).await.status,
        StatusCode::NOT_FOUND
    );

    // Off by default.
    let off = App::with_layer(App::layer(Arc::clone(&store)).sealing(keyring()));
    assert_eq!(
        off.post("/orders", "out-off", "{}").await.status,
        StatusCode::CREATED
    );
    refused(&off.records("GET", &output("out-off")).await);
}

/// The records API shows the caller's record with its attempts, lists it,
/// and another tenant sees nothing.
pub async fn records_api_shows_and_lists<S: SuiteStore>(store: S) {
    let app = App::new(store);
    assert_eq!(
        app.post("/orders", "r", "{}").await.status,
        StatusCode::CREATED
    );
    let one = app.records("GET", "?method=POST&path=/orders&key=r").await;
    assert_eq!(one.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&one.body).expect("json");
    assert_eq!(json["state"], "completed");
    assert_eq!(json["status"], 201);
    assert_eq!(json["attempts"][0]["outcome"]["kind"], "completed");
    let list = app.records("GET", "?state=completed").await;
    let json: serde_json::Value = serde_json::from_slice(&list.body).expect("json");
    assert_eq!(json["records"].as_array().map(Vec::len), Some(1), "{json}");
    let stranger = App {
        tenant: "someone-else".to_owned(),
        ..app
    };
    let hidden = stranger
        .records("GET", "?method=POST&path=/orders&key=r")
        .await;
    assert_eq!(hidden.status, StatusCode::NOT_FOUND);
}

/// The same key with another payload is a conflict in every state the
/// record can be in: completed, processing and cancelled; the conflict
/// changes nothing. A released key is free again for any payload.
pub async fn another_payload_conflicts_in_every_state<S: SuiteStore>(store: S) {
    let app = Arc::new(App::new(store));
    let running = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post("/slow", "s", "{\"a\":1}").await })
    };
    app.wait_until_running().await;
    let processing = app.post("/slow", "s", "{\"a\":2}").await;
    assert_eq!(processing.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(processing.code().as_deref(), Some("idempotency_conflict"));
    let cancel = app.records("DELETE", "?method=POST&path=/slow&key=s").await;
    assert_eq!(cancel.status, StatusCode::OK);
    let cancelled = app.post("/slow", "s", "{\"a\":2}").await;
    assert_eq!(cancelled.code().as_deref(), Some("idempotency_conflict"));
    let same = app.post("/slow", "s", "{\"a\":1}").await;
    assert_eq!(same.code().as_deref(), Some("idempotency_cancelled"));
    app.gate.add_permits(1);
    assert_eq!(running.await.expect("join").status, StatusCode::GONE);
    assert_eq!(app.runs(), 1);

    assert_eq!(
        app.post("/fail", "f", "{\"a\":1}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        app.post("/fail", "f", "{\"a\":2}").await.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a released key takes another payload"
    );
    assert_eq!(app.runs(), 3);
}

/// The outcome table: 2xx, 3xx and 4xx (but 408, 425, 429) are stored
/// and replayed with their bodies; 5xx, 408, 425 and 429 release the key
/// and run again.
pub async fn outcomes_are_stored_or_released_by_status<S: SuiteStore>(store: S) {
    let app = App::new(store);
    let mut runs = 0;
    for status in [200u16, 201, 204, 302, 400, 404, 409] {
        // One key per status: the operation is the route template.
        let (path, key) = (format!("/status/{status}"), format!("k{status}"));
        let first = app.post(&path, &key, "{}").await;
        runs += 1;
        assert_eq!(first.status.as_u16(), status);
        let again = app.post(&path, &key, "{}").await;
        assert!(again.replayed(), "{status} is replayed");
        assert_eq!(again.status.as_u16(), status);
        assert_eq!(again.body, first.body, "{status} replays its body");
        assert_eq!(app.runs(), runs, "{status} runs once");
    }
    for status in [500u16, 503, 408, 425, 429] {
        let (path, key) = (format!("/status/{status}"), format!("k{status}"));
        let first = app.post(&path, &key, "{}").await;
        let again = app.post(&path, &key, "{}").await;
        runs += 2;
        assert!(!again.replayed(), "{status} is not replayed");
        assert_eq!(again.body, format!("status {status} run {runs}"));
        assert_ne!(again.body, first.body);
        assert_eq!(app.runs(), runs, "{status} runs again");
    }
}

/// A dead owner's lease (reserved in the store directly, never renewed)
/// answers 409 until it lapses; then the next request takes it over with
/// the next generation, learns whom it superseded, and is replayed after.
pub async fn lapsed_lease_is_taken_over<S: SuiteStore>(store: S) {
    let lease = Duration::from_secs(1);
    let layer = App::layer(store).timing(|t| t.lease(lease));
    let store = Arc::clone(layer.store());
    let app = App::with_layer(layer);
    let request = Request::post("/ctx")
        .header("content-type", "application/json")
        .body(())
        .expect("request");
    let (parts, ()) = request.into_parts();
    let fingerprint = idem_layer::fingerprint::fingerprint(
        "POST /ctx",
        &parts,
        &[http::header::CONTENT_TYPE],
        b"{}",
    );
    let reserve = ReserveRequest {
        scope: Scope::new(app.tenant.clone(), "POST /ctx", "t".parse().expect("key")),
        fingerprint,
        lease,
        retention: Duration::from_secs(3600),
    };
    let reserved_at = tokio::time::Instant::now();
    let dead = match store.reserve(&reserve).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("not acquired: {other:?}"),
    };
    let busy = app.post("/ctx", "t", "{}").await;
    // Only an answer that came back within the lease must be 409: on a
    // stalled machine the lease may lapse before the duplicate arrives.
    if reserved_at.elapsed() < lease {
        assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    }
    let taken = crate::poll_until(
        Duration::from_secs(20),
        async || app.post("/ctx", "t", "{}").await,
        |answer| answer.status != StatusCode::CONFLICT,
    )
    .await;
    assert_eq!(taken.status, StatusCode::OK);
    assert_eq!(
        std::str::from_utf8(&taken.body).expect("utf8"),
        format!(
            "generation={} superseded=Some({}) slot={}",
            dead.generation + 1,
            dead.generation,
            // A completion slot only where a handler's transaction can
            // complete the record.
            store.completes_in_transactions()
        )
    );
    let replay = app.post("/ctx", "t", "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, taken.body);
    assert_eq!(app.runs(), 1);
}

/// A layer with a scope secret stores its records under the keyed hash of
/// the scope (IDEM-01) and under no unkeyed one; it replays them, and so
/// does another layer with the same secret, through HTTP and the records
/// API. A layer without the secret, or with another, on the same store
/// does not find them: its request runs again, which is why every
/// instance sharing a store must hash alike.
pub async fn keyed_scopes_are_their_own_records<S: SuiteStore>(store: S) {
    let store = Arc::new(store);
    let secret = || ScopeSecret::new(&[0x5c; 32]).expect("secret");
    let keyed = |store: &Arc<S>| App::layer(Arc::clone(store)).scope_secret(secret());
    let app = App::with_layer(keyed(&store));
    let first = app.post("/orders", "keyed", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.post("/orders", "keyed", "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs(), 1);

    let keyed_hash = ScopeHash::keyed(&secret(), &app.tenant, "POST /orders", "keyed");
    let record = store.get(&keyed_hash).await.expect("get");
    assert_eq!(record.map(|r| r.scope), Some(keyed_hash));
    let unkeyed_hash = ScopeHash::of(&app.tenant, "POST /orders", "keyed");
    assert!(store.get(&unkeyed_hash).await.expect("get").is_none());
    let shown = app
        .records("GET", "?method=POST&path=/orders&key=keyed")
        .await;
    assert_eq!(shown.status, StatusCode::OK);

    // Another instance with the same secret replays.
    let same = App {
        tenant: app.tenant.clone(),
        ..App::with_layer(keyed(&store))
    };
    let replayed = same.post("/orders", "keyed", "{}").await;
    assert!(replayed.replayed());
    assert_eq!(replayed.body, first.body);
    assert_eq!(same.runs(), 0);

    // An unkeyed instance, and one with another secret, see other scopes.
    let other = ScopeSecret::new(&[0x36; 32]).expect("secret");
    for layer in [
        App::layer(Arc::clone(&store)),
        App::layer(Arc::clone(&store)).scope_secret(other),
    ] {
        let stranger = App {
            tenant: app.tenant.clone(),
            ..App::with_layer(layer)
        };
        let ran = stranger.post("/orders", "keyed", "{}").await;
        assert_eq!(ran.status, StatusCode::CREATED);
        assert!(!ran.replayed());
        assert_eq!(stranger.runs(), 1);
    }
    assert!(store.get(&unkeyed_hash).await.expect("get").is_some());
}

/// A layer with BLAKE3 scopes, keyed or not, stores its records under the
/// BLAKE3 hash of the scope and under no SHA-256 one; it and another layer
/// hashing alike replay them, through HTTP and the records API. A layer
/// with SHA-256 scopes on the same store does not find them and runs the
/// request again: the format is chosen when a deployment starts.
pub async fn blake3_scopes_are_their_own_records<S: SuiteStore>(store: S) {
    let store = Arc::new(store);
    let secret = || ScopeSecret::new(&[0x6a; 32]).expect("secret");
    for keyed in [false, true] {
        let layer = |store: &Arc<S>| {
            let layer = App::layer(Arc::clone(store)).scope_format(ScopeFormat::Blake3);
            if keyed {
                layer.scope_secret(secret())
            } else {
                layer
            }
        };
        let app = App::with_layer(layer(&store));
        let first = app.post("/orders", "b3", "{}").await;
        assert_eq!(first.status, StatusCode::CREATED);
        let replay = app.post("/orders", "b3", "{}").await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
        assert_eq!(app.runs(), 1);

        let blake3 = match keyed {
            false => ScopeHash::blake3(&app.tenant, "POST /orders", "b3"),
            true => ScopeHash::blake3_keyed(&secret(), &app.tenant, "POST /orders", "b3"),
        };
        let record = store.get(&blake3).await.expect("get");
        assert_eq!(record.map(|r| r.scope), Some(blake3), "keyed: {keyed}");
        let sha = ScopeFormat::Sha256.hash(
            keyed.then(secret).as_ref(),
            &app.tenant,
            "POST /orders",
            "b3",
        );
        assert!(store.get(&sha).await.expect("get").is_none());
        let shown = app.records("GET", "?method=POST&path=/orders&key=b3").await;
        assert_eq!(shown.status, StatusCode::OK, "keyed: {keyed}");

        let same = App {
            tenant: app.tenant.clone(),
            ..App::with_layer(layer(&store))
        };
        let replayed = same.post("/orders", "b3", "{}").await;
        assert!(replayed.replayed());
        assert_eq!(replayed.body, first.body);
        assert_eq!(same.runs(), 0);

        let mut other = App::layer(Arc::clone(&store));
        if keyed {
            other = other.scope_secret(secret());
        }
        let stranger = App {
            tenant: app.tenant.clone(),
            ..App::with_layer(other)
        };
        let ran = stranger.post("/orders", "b3", "{}").await;
        assert_eq!(ran.status, StatusCode::CREATED);
        assert!(!ran.replayed());
        assert_eq!(stranger.runs(), 1);
        assert!(store.get(&sha).await.expect("get").is_some());
    }
}

/// Layers claim a store for how they hash scopes: layers with the same
/// secret and format hold it together, one with another secret, another
/// format or no secret is told who holds it (on a store `shared` between
/// processes; a memory store holds every claim, since no other process
/// can find its records), and `replace` takes it over. Markers tell
/// settings apart without showing the secret.
pub async fn layers_claim_the_store_by_how_they_hash_scopes<S: SuiteStore>(store: S, shared: bool) {
    use idem_core::IdentityClaim;
    let store = Arc::new(store);
    let secret = |byte: u8| ScopeSecret::new(&[byte; 32]).expect("secret");
    let keyed = |byte: u8| App::layer(Arc::clone(&store)).scope_secret(secret(byte));
    let first = keyed(1);
    let same = keyed(1);
    let others = [
        keyed(2),
        keyed(1).scope_format(ScopeFormat::Blake3),
        App::layer(Arc::clone(&store)),
    ];
    assert_eq!(first.store_identity(), same.store_identity());
    let mut markers: Vec<String> = others.iter().map(|l| l.store_identity()).collect();
    markers.push(first.store_identity());
    let mut distinct = markers.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), markers.len(), "{markers:?}");
    assert!(markers.iter().all(|m| !m.contains(&"01".repeat(16))));

    assert_eq!(
        first.claim_store(false).await.expect("claim"),
        IdentityClaim::Held
    );
    assert_eq!(
        same.claim_store(false).await.expect("claim"),
        IdentityClaim::Held
    );
    for other in &others {
        let claim = other.claim_store(false).await.expect("claim");
        if shared {
            assert_eq!(claim, IdentityClaim::Other(first.store_identity()));
        } else {
            assert_eq!(claim, IdentityClaim::Held);
        }
    }
    // A take-over: the old settings are then the stranger.
    let taking = &others[1];
    assert_eq!(
        taking.claim_store(true).await.expect("claim"),
        IdentityClaim::Held
    );
    let old = first.claim_store(false).await.expect("claim");
    if shared {
        assert_eq!(old, IdentityClaim::Other(taking.store_identity()));
    } else {
        assert_eq!(old, IdentityClaim::Held);
    }
}

/// The fingerprint `App::post` gives `POST /orders` with `body`, in `format`.
pub fn orders_fingerprint(format: FingerprintFormat, body: &str) -> idem_core::Fingerprint {
    let (parts, ()) = Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts();
    format.fingerprint(
        "POST /orders",
        &parts,
        &[http::header::CONTENT_TYPE],
        body.as_bytes(),
    )
}

/// Layers read records in either fingerprint format whatever they write:
/// a SHA-256 record replays to a BLAKE3 layer and a BLAKE3 record to a
/// SHA-256 one (the handler runs once), a record in flight in one format
/// answers 409 to a retry in the other, and another payload is still a
/// conflict in both directions. Each layer writes its own format.
pub async fn fingerprint_formats_read_each_other<S: SuiteStore>(store: S) {
    let store = Arc::new(store);
    let sha = App::with_layer(App::layer(Arc::clone(&store)));
    let blake = App {
        tenant: sha.tenant.clone(),
        ..App::with_layer(
            App::layer(Arc::clone(&store)).fingerprints(|f| f.format(FingerprintFormat::Blake3)),
        )
    };
    let record = async |key: &str| {
        let hash = ScopeHash::of(&sha.tenant, "POST /orders", key);
        store.get(&hash).await.expect("get").expect("record")
    };
    for (writer, reader, format, key) in [
        (&sha, &blake, FingerprintFormat::Sha256, "fmt-sha"),
        (&blake, &sha, FingerprintFormat::Blake3, "fmt-blake"),
    ] {
        let first = writer.post("/orders", key, r#"{"a":1,"b":[2]}"#).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}");
        assert_eq!(
            record(key).await.fingerprint,
            orders_fingerprint(format, r#"{"a":1,"b":[2]}"#),
            "{key}: written in the writer's format"
        );
        // The same payload spelled otherwise: a retry, replayed.
        let retry = reader
            .post("/orders", key, r#"{ "b": [2], "a": 1.0 }"#)
            .await;
        assert!(retry.replayed(), "{key}: {retry:?}");
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers.get("x-run"), first.headers.get("x-run"));
        let changed = reader.post("/orders", key, r#"{"a":2,"b":[2]}"#).await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY, "{key}");
        assert_eq!(changed.code().as_deref(), Some("idempotency_conflict"));
    }
    assert_eq!(sha.runs(), 1);
    assert_eq!(blake.runs(), 1);

    // A SHA-256 reservation in flight: a BLAKE3 retry waits its turn (409),
    // it does not conflict.
    let reserve = ReserveRequest {
        scope: Scope::new(
            sha.tenant.clone(),
            "POST /orders",
            "fmt-busy".parse().expect("key"),
        ),
        fingerprint: orders_fingerprint(FingerprintFormat::Sha256, "{}"),
        lease: Duration::from_secs(600),
        retention: Duration::from_secs(3600),
    };
    let lease = match store.reserve(&reserve).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("not acquired: {other:?}"),
    };
    let busy = blake.post("/orders", "fmt-busy", "{}").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    let other = blake.post("/orders", "fmt-busy", r#"{"a":1}"#).await;
    assert_eq!(other.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(blake.runs(), 1);
    assert_eq!(
        store.release(&lease).await.expect("release"),
        idem_core::Release::Released
    );
}

/// Expands to one test per layer check, on the store the closure makes,
/// with whatever must live as long as the test (its server); `None` skips
/// (a server not installed, outside CI).
#[macro_export]
macro_rules! layer_tests {
    ($make:expr) => {
        $crate::layer_tests!(@each $make;
            replays_exactly,
            another_payload_conflicts,
            another_payload_conflicts_in_every_state,
            outcomes_are_stored_or_released_by_status,
            lapsed_lease_is_taken_over,
            duplicates_in_flight_get_409,
            failures_release_the_key,
            oversized_responses_are_not_replayed,
            cancel_fences_the_running_attempt,
            records_api_shows_and_lists,
            an_answer_is_fetched_by_its_key,
            keyed_scopes_are_their_own_records,
            fingerprint_formats_read_each_other,
            blake3_scopes_are_their_own_records
        );
    };
    (@each $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, _keep)) = ($make)().await else { return };
                $crate::layer_suite::$name(store).await;
            }
        )*
    };
}
