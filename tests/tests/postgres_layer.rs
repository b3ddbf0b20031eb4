//! The layer on PostgreSQL with the handler's transaction: the order rows
//! and the outcome commit together or not at all, and an attempt that lost
//! its lease (cancelled, taken over) commits nothing.

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::{FromRef, State},
    routing::post,
};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    Completion, CompletionSlot, Current, Outcome, RecordState, Reservation, ReserveRequest, Store,
    StoredResponse,
    conformance::{fingerprint, fresh_scope},
};
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_postgres::{CommitError, IdemTransaction, PgStore};
use idem_tests::{pgbouncer::PgBouncer, postgres_server::PgServer};
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct AppState {
    store: PgStore,
    /// Permits for handlers that wait (`x-wait: 1`) after their insert.
    gate: Arc<Semaphore>,
    /// One permit per handler that reached its wait.
    waiting: Arc<Semaphore>,
}

impl FromRef<AppState> for PgStore {
    fn from_ref(state: &AppState) -> PgStore {
        state.store.clone()
    }
}

/// Inserts an order in the handler's transaction, hands it to the layer,
/// and answers 201 with the order's id; `x-status` picks another status,
/// `x-wait` waits for a permit between the insert and the commit;
/// `x-panic` panics and `x-error` answers 500 after the insert, without
/// handing the transaction over; `x-forget` answers without `commit()`
/// (the transaction dropped), `x-rollback` after an explicit `rollback()`.
async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    mut tx: IdemTransaction,
) -> (StatusCode, String) {
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (note) VALUES ('x') RETURNING id")
        // Unnamed: the app runs behind PgBouncer too.
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .expect("insert");
    if headers.contains_key("x-wait") {
        state.waiting.add_permits(1);
        state.gate.acquire().await.expect("gate").forget();
    }
    assert!(
        !headers.contains_key("x-panic"),
        "the handler panics after its insert"
    );
    if headers.contains_key("x-error") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "failed".to_owned());
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    if headers.contains_key("x-forget") {
        drop(tx);
    } else if headers.contains_key("x-rollback") {
        tx.rollback().await.expect("rollback");
    } else {
        tx.commit().await.expect("hand over");
    }
    (
        StatusCode::from_u16(status).expect("status"),
        format!("{{\"order\":{id}}}"),
    )
}

struct App {
    router: Router,
    store: PgStore,
    state: AppState,
}

async fn app() -> Option<App> {
    let server = PgServer::shared()?;
    let store = PgStore::from_url(&server.database()).expect("store");
    app_on(store).await
}

/// The app on a store reached through PgBouncer in transaction pooling
/// mode, set up for it (`transaction_pooler`), with fewer server
/// connections than the store's pool.
async fn app_behind_pgbouncer() -> Option<(App, PgBouncer)> {
    let server = PgServer::shared()?;
    let bouncer = PgBouncer::spawn(server, 4)?;
    let store = bouncer.store(server);
    Some((app_on(store).await?, bouncer))
}

async fn app_on(store: PgStore) -> Option<App> {
    store.migrate().await.expect("migrate");
    // In a transaction, unnamed: behind PgBouncer in transaction mode a
    // statement outside one may be prepared on one server connection and
    // run on another ("prepared statement does not exist").
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, note text)")
        .persistent(false)
        .execute(&mut *tx)
        .await
        .expect("orders table");
    tx.commit().await.expect("commit");
    let state = AppState {
        store: store.clone(),
        gate: Arc::new(Semaphore::new(0)),
        waiting: Arc::new(Semaphore::new(0)),
    };
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(TenantFromHeader::from_static("x-tenant-id"));
    let router = Router::new()
        .route("/orders", post(create))
        .with_state(state.clone())
        .layer(layer);
    Some(App {
        router,
        store,
        state,
    })
}

impl App {
    async fn orders(&self) -> i64 {
        self.read("SELECT count(*) FROM orders").await
    }

    /// One value read in a transaction of its own, unnamed: behind
    /// PgBouncer in transaction mode an unnamed statement outside a
    /// transaction may be parsed on one server connection and run on
    /// another (another client's statement, with this one's parameters).
    async fn read<T>(&self, sql: &'static str) -> T
    where
        T: Send + Unpin + for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let value = sqlx::query_scalar(sql)
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .expect(sql);
        tx.commit().await.expect("commit");
        value
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn code(&self) -> Option<String> {
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        Some(json.get("code")?.as_str()?.to_owned())
    }
}

async fn call(router: &Router, key: Option<&str>, extra: &[(&str, &str)]) -> Reply {
    let mut request = Request::post("/orders").header("x-tenant-id", "acme");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let response = router
        .clone()
        .oneshot(request.body(axum::body::Body::empty()).expect("request"))
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    }
}

/// The order and the completed record commit together; the duplicate
/// replays the exact bytes and inserts nothing.
#[tokio::test]
async fn the_order_and_the_outcome_commit_together() {
    let Some(app) = app().await else { return };
    commit_together(&app).await;
}

/// The same behind PgBouncer in transaction pooling mode.
#[tokio::test]
async fn the_order_and_the_outcome_commit_together_behind_pgbouncer() {
    let Some((app, _bouncer)) = app_behind_pgbouncer().await else {
        return;
    };
    commit_together(&app).await;
}

/// The same rollbacks behind PgBouncer in transaction pooling mode.
#[tokio::test]
async fn a_handler_panic_or_error_rolls_the_order_back_behind_pgbouncer() {
    let Some((app, _bouncer)) = app_behind_pgbouncer().await else {
        return;
    };
    roll_back_on_panic_or_error(&app).await;
}

async fn commit_together(app: &App) {
    let first = call(&app.router, Some("k1"), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(app.orders().await, 1);
    let replay = call(&app.router, Some("k1"), &[]).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert_eq!(
        replay
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(app.orders().await, 1);
    let state: String = app.read("SELECT state FROM idem_records").await;
    assert_eq!(state, "completed");
}

/// A completion committed in the handler's transaction is sealed like any
/// other: the row holds no part of the response in clear, and the
/// duplicate replays it byte for byte.
#[tokio::test]
async fn a_transactional_completion_is_sealed_at_rest() {
    let Some(mut app) = app().await else { return };
    let layer = IdempotencyLayer::new(app.store.clone())
        .tenant(TenantFromHeader::from_static("x-tenant-id"))
        .sealing(idem_layer::sealing::Keyring::derived(
            b"a deployment secret of thirty-two bytes",
        ));
    app.router = Router::new()
        .route("/orders", post(create))
        .with_state(app.state.clone())
        .layer(layer);
    let first = call(&app.router, Some("sealed-1"), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.body.starts_with(b"{\"order\":"), "{:?}", first.body);
    let row: String = app.read("SELECT t::text FROM idem_records t").await;
    for clear in ["{\"order\"", "text/plain"] {
        assert!(!row.contains(clear), "{clear} in clear: {row}");
        assert!(
            !row.contains(&hex::encode(clear)),
            "{clear} in clear: {row}"
        );
    }
    assert!(
        row.contains(&hex::encode("idem-sealed")) || row.contains("idem-sealed"),
        "{row}"
    );
    let replay = call(&app.router, Some("sealed-1"), &[]).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert_eq!(app.orders().await, 1);
}

/// A response the layer does not record (a 5xx) rolls the order back and
/// releases the key: the retry runs again and leaves exactly one order.
#[tokio::test]
async fn a_temporary_failure_rolls_the_order_back() {
    let Some(app) = app().await else { return };
    let failed = call(&app.router, Some("k2"), &[("x-status", "503")]).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        app.orders().await,
        0,
        "the failed attempt's order was committed"
    );
    let retry = call(&app.router, Some("k2"), &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(app.orders().await, 1);
}

/// A handler that panics, or fails, after its insert: the insert rolls
/// back with the transaction, the record is released (no row of it left
/// processing), and the retry runs and leaves exactly one order.
#[tokio::test]
async fn a_handler_panic_or_error_rolls_the_order_back() {
    let Some(app) = app().await else { return };
    roll_back_on_panic_or_error(&app).await;
}

async fn roll_back_on_panic_or_error(app: &App) {
    for (key, failure) in [("k-panic", "x-panic"), ("k-error", "x-error")] {
        let failed = call(&app.router, Some(key), &[(failure, "1")]).await;
        assert_eq!(
            failed.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{failure}"
        );
        assert_eq!(app.orders().await, 0, "{failure}: the insert was committed");
        let processing: i64 = app
            .read("SELECT count(*) FROM idem_records WHERE state = 'processing'")
            .await;
        assert_eq!(processing, 0, "{failure}: the record was not released");
    }
    for key in ["k-panic", "k-error"] {
        let retry = call(&app.router, Some(key), &[]).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}");
        assert!(!retry.headers.contains_key("idempotent-replayed"));
    }
    assert_eq!(app.orders().await, 2, "one order per key");
}

/// A request the layer does not run for (no key) commits at once.
#[tokio::test]
async fn without_the_layer_commit_commits_at_once() {
    let Some(app) = app().await else { return };
    let reply = call(&app.router, None, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(app.orders().await, 1);
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
        .fetch_one(app.store.pool())
        .await
        .expect("count");
    assert_eq!(records, 0);
}

/// Cancelled while the handler runs: its transaction commits nothing and
/// its client gets 410.
#[tokio::test]
async fn a_cancelled_attempt_commits_nothing() {
    let Some(app) = app().await else { return };
    let router = app.router.clone();
    let running = tokio::spawn(async move { call(&router, Some("k3"), &[("x-wait", "1")]).await });
    tokio::time::timeout(Duration::from_secs(20), app.state.waiting.acquire())
        .await
        .expect("the handler reached its wait")
        .expect("waiting")
        .forget();
    let scope = idem_core::Scope::new(
        "acme",
        "POST /orders",
        idem_core::IdempotencyKey::parse(b"k3").expect("key"),
    );
    assert!(matches!(
        app.store.cancel(scope.hash()).await.expect("cancel"),
        idem_core::Cancellation::Cancelled(_)
    ));
    app.state.gate.add_permits(1);
    let reply = running.await.expect("task");
    assert_eq!(reply.status, StatusCode::GONE);
    assert_eq!(reply.code().as_deref(), Some("idempotency_cancelled"));
    assert_eq!(
        app.orders().await,
        0,
        "a cancelled attempt committed its order"
    );
}

/// A lease taken over while its owner still ran: the owner's deferred
/// completion is fenced, its rows roll back, the record keeps the new
/// attempt, and the superseded attempt's history says it gave its work up.
#[tokio::test]
async fn a_superseded_attempt_commits_nothing() {
    let Some(app) = app().await else { return };
    let store = &app.store;
    let scope = fresh_scope("taken");
    let request = ReserveRequest {
        scope: scope.clone(),
        fingerprint: fingerprint(1),
        lease: Duration::from_millis(300),
        retention: Duration::from_secs(60),
    };
    let Reservation::Acquired(first) = store.reserve(&request).await.expect("reserve") else {
        panic!("not acquired");
    };
    let slot = CompletionSlot::new();
    let mut tx = IdemTransaction::begin(store, Some(slot.clone()))
        .await
        .expect("begin");
    sqlx::query("INSERT INTO orders (note) VALUES ('superseded')")
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.commit().await.expect("hand over");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Reservation::TakenOver { lease: second, .. } =
        store.reserve(&request).await.expect("reserve")
    else {
        panic!("not taken over");
    };
    let outcome = Outcome::Stored(StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: Bytes::from_static(b"late"),
    });
    let deferred = slot.take().expect("the handed-over transaction");
    let answer = deferred.commit(first, outcome).await.expect("commit");
    assert!(
        matches!(answer, Completion::Fenced(Current::Processing { .. })),
        "{answer:?}"
    );
    assert_eq!(
        app.orders().await,
        0,
        "a superseded attempt committed its order"
    );
    let record = store.get(scope.hash()).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Processing);
    assert_eq!(record.generation, second.generation);
    assert!(record.attempts[0].late.is_some(), "no late evidence kept");
}

/// One outcome commits with one transaction: a second hand-over is refused.
#[tokio::test]
async fn a_second_transaction_cannot_be_handed_over() {
    let Some(app) = app().await else { return };
    let slot = CompletionSlot::new();
    let first = IdemTransaction::begin(&app.store, Some(slot.clone()))
        .await
        .expect("begin");
    let second = IdemTransaction::begin(&app.store, Some(slot.clone()))
        .await
        .expect("begin");
    assert!(first.is_deferred());
    first.commit().await.expect("first hand-over");
    assert!(matches!(
        second.commit().await,
        Err(CommitError::AlreadyHandedOver)
    ));
}

/// The gateway on `--store postgres://…`: it creates the table, the
/// upstream runs once, the duplicate replays the same bytes.
#[tokio::test]
async fn the_gateway_runs_on_postgres() {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &["--store", &url]).await;
    let post = || {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", "gw-1")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(
                b"{\"sku\":\"book\"}",
            )))
            .expect("request")
    };
    let first = idem_tests::send(&idem_tests::client(), post()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let second = idem_tests::send(&idem_tests::client(), post()).await;
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(upstream.runs(), 1);
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_records WHERE state = 'completed'")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(completed, 1);
    // Its pool shows on /metrics from the start.
    let metrics = idem_tests::send(
        &idem_tests::client(),
        Request::get(format!("http://{}/metrics", gateway.addr))
            .body(http_body_util::Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    for name in [
        "idem_store_pool_connections{state=\"in_use\"}",
        "idem_store_pool_connections{state=\"idle\"}",
        "idem_store_pool_max 16",
        "idem_store_pool_timeouts_total",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    // The first gateway (a generated tenant secret) claimed the database:
    // one with another secret would see other tenants, and is refused.
    let config = idem_tests::gateway_config(
        origin.addr,
        &[
            "--store",
            &url,
            "--tenant-secret",
            "another secret, 00000002",
        ],
    );
    let refused = idem_gateway::start(config).await.map(|_| ());
    let error = refused.expect_err("another identity joined the store");
    assert!(
        error
            .to_string()
            .contains("the table idem_records_identity"),
        "{error}"
    );
}

/// `--allow-anonymous` on PostgreSQL: keyed requests without credentials
/// share the anonymous tenant (which starts with a NUL byte, so no header
/// names it), stored, replayed and listed like any other (they were
/// answered 503: PostgreSQL's `text` refused the NUL).
#[tokio::test]
async fn the_anonymous_tenant_works_on_postgres() {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &["--store", &url, "--allow-anonymous"]).await;
    let post = || {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", "anon-1")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let first = idem_tests::send(&idem_tests::client(), post()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let second = idem_tests::send(&idem_tests::client(), post()).await;
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(upstream.runs(), 1);
}

/// A PostgreSQL that answered with an error of its own (its table renamed
/// away: `relation does not exist`) was reached: the error is `Refused`,
/// and a fail-open layer answers 503 without running the handler; a server
/// that cannot be reached is `Unavailable`, which fail-open covers.
#[tokio::test]
async fn an_error_postgres_answered_never_fails_open() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let store = PgStore::from_url(&url).expect("store");
    store.migrate().await.expect("migrate");
    let (router, runs) = fail_open_orders(IdempotencyLayer::new(store.clone()));
    let order = || {
        Request::post("/orders")
            .header("idempotency-key", "refused-1")
            .header("x-tenant-id", "acme")
            .body(axum::body::Body::from("{}"))
            .expect("request")
    };
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    sqlx::query("ALTER TABLE idem_records RENAME TO idem_records_away")
        .execute(&pool)
        .await
        .expect("rename");
    let scope = fresh_scope("refused");
    let request = ReserveRequest {
        scope,
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let refused = store.reserve(&request).await;
    assert!(
        matches!(refused, Err(idem_core::StoreError::Refused(_))),
        "{refused:?}"
    );
    let answer = router.clone().oneshot(order()).await.expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "not run unprotected"
    );
    let unreachable = PgStore::from_url("postgres://postgres@127.0.0.1:1/none").expect("store");
    let answer = unreachable.reserve(&request).await;
    assert!(
        matches!(
            answer,
            Err(idem_core::StoreError::Unavailable(_) | idem_core::StoreError::Timeout(_))
        ),
        "{answer:?}"
    );
}

/// A layer on `store` with a one-minute lease and the given store
/// timeout, the router of a handler that answers 201 with how many times
/// it ran, and that count.
fn counting(
    store: &PgStore,
    store_timeout: Duration,
) -> (
    IdempotencyLayer<PgStore>,
    Router,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(TenantFromHeader::from_static("x-tenant-id"))
        .timing(|t| {
            t.store_timeout(store_timeout)
                .lease(Duration::from_secs(60))
        });
    let router = Router::new()
        .route(
            "/orders",
            post(move || {
                let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("{{\"order\":{n}}}")) }
            }),
        )
        .layer(layer.clone());
    (layer, router, runs)
}

/// A reservation whose caller gave up before its answer (here the store
/// timeout, behind a table lock) is freed once the statement has run,
/// on the connection it went out on: the retry runs at once instead of
/// meeting `409` for a whole lease, and the handler runs once for the key.
/// The layer's drain (a shutdown) waits for that freeing.
#[tokio::test]
async fn a_given_up_reservation_is_freed_once_it_lands() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    // One connection: the reservation below goes out on the connection
    // whose statement cache already holds it, so its insert waits for the
    // lock at execution (a first, unprepared one would wait in its parse,
    // and never run once given up).
    let store = PgStore::builder()
        .url(url.clone())
        .max_connections(1)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let (layer, router, runs) = counting(&store, Duration::from_millis(300));
    let warm = call(&router, Some("warm-up"), &[]).await;
    assert_eq!(warm.status, StatusCode::CREATED);
    // Another session holds the table: the reservation's insert waits.
    let mut locker = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("locker");
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query("LOCK TABLE idem_records IN EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .expect("lock");
    let refused = call(&router, Some("given-up"), &[]).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    // A shutdown's drain waits for the store's freeing of it: still
    // running while the insert waits for the lock.
    assert_eq!(layer.drain(Duration::from_millis(200)).await, 1);
    // The lock goes; the waiting insert lands and takes the key for an
    // attempt nobody runs, and the store frees it before the drain ends.
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");
    assert_eq!(layer.drain(Duration::from_secs(10)).await, 0);
    assert_eq!(store.background_tasks(), 0);
    let retry = call(&router, Some("given-up"), &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code());
    assert!(!retry.headers.contains_key("idempotent-replayed"));
    assert_eq!(retry.body, "{\"order\":2}");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A takeover whose caller gave up while its commit ran (here a deferred
/// trigger holds that commit past the store timeout) lands, and is freed
/// as it found the record: processing, its lease lapsed, held by nobody.
/// The attempt it superseded (its owner died; it may have acted) keeps
/// the key bound to its request: a changed request conflicts instead of
/// running, and the same request takes the record over at once instead
/// of meeting `409` for a whole lease.
#[tokio::test]
async fn a_given_up_takeover_is_freed_and_keeps_the_payload() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    // A takeover's commit (the update to generation 2) takes 3 s, well
    // past the store timeout (1 s, well past the statements before it).
    for statement in [
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER slow_takeover AFTER UPDATE ON idem_records \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
         WHEN (NEW.generation = 2 AND NEW.owner IS NOT NULL) EXECUTE FUNCTION slow_commit()",
    ] {
        sqlx::query(statement)
            .execute(store.pool())
            .await
            .expect("trigger");
    }
    let (layer, router, runs) = counting(&store, Duration::from_secs(1));
    // The first attempt of the request `call` sends: reserved with a short
    // lease by an owner that died, after it may have acted.
    let key = "given-up-takeover";
    let parts = Request::post("/orders")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    let scope = idem_core::Scope::new(
        "acme",
        "POST /orders",
        idem_core::IdempotencyKey::parse(key.as_bytes()).expect("key"),
    );
    let request = ReserveRequest {
        scope: scope.clone(),
        fingerprint: idem_layer::fingerprint::fingerprint(
            "POST /orders",
            &parts,
            &[http::header::CONTENT_TYPE],
            b"",
        ),
        lease: Duration::from_millis(200),
        retention: Duration::from_secs(3600),
    };
    let Reservation::Acquired(first) = store.reserve(&request).await.expect("reserve") else {
        panic!("a new key is acquired");
    };
    // The lease is measured by the database's clock: let it lapse.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let given_up = call(&router, Some(key), &[]).await;
    assert_eq!(given_up.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        given_up.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The commit lands; the store then frees the takeover it made.
    assert_eq!(layer.drain(Duration::from_secs(20)).await, 0);
    assert_eq!(store.background_tasks(), 0);
    let record = store.get(scope.hash()).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Processing);
    assert_eq!(record.generation, 2, "the takeover landed");
    assert_eq!(record.owner, None, "and was freed");
    assert_eq!(record.attempts[0].id, first.attempt);
    assert_eq!(
        record.attempts[0].outcome,
        idem_core::AttemptOutcome::Superseded
    );
    // A changed request (another content type) does not run after an
    // attempt that may have acted.
    let changed = call(&router, Some(key), &[("content-type", "application/json")]).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The same request takes it over at once and runs.
    let retry = call(&router, Some(key), &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code());
    assert_eq!(retry.body, "{\"order\":1}");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    let record = store.get(scope.hash()).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.generation, 3);
}

/// Two layers on one PostgreSQL server, lease 4 s. Layer A's handler
/// answers while the server is down (stopped as a crash would) and stays
/// down past the lease: A holds the outcome. The first retry, sent to
/// layer B once the server is back, must not take the lapsed lease over: a
/// lease counts as running until a lease after the postmaster's start, A
/// records its outcome meanwhile, and B replays it. B's handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_layer_after_a_restart_replays_the_outcome_the_first_held() {
    let Some(server) = PgServer::private() else {
        return;
    };
    let url = server.database();
    let lease = Duration::from_secs(4);
    let slow_app = |store: PgStore| {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (counted, gated) = (Arc::clone(&runs), Arc::clone(&gate));
        let layer = IdempotencyLayer::new(store)
            .timing(|t| t.store_timeout(Duration::from_millis(300)).lease(lease))
            .tenant(TenantFromHeader::from_static("x-tenant-id"));
        let router = Router::new()
            .route(
                "/slow",
                post(move || {
                    let (runs, gate) = (Arc::clone(&counted), Arc::clone(&gated));
                    async move {
                        let n = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                        gate.acquire().await.expect("gate").forget();
                        (StatusCode::CREATED, format!("slow {n}"))
                    }
                }),
            )
            .layer(layer.clone());
        (router, runs, gate, layer)
    };
    let store = || PgStore::from_url(&url).expect("store");
    store().migrate().await.expect("migrate");
    let (a, a_runs, a_gate, a_layer) = slow_app(store());
    let (b, b_runs, b_gate, _) = slow_app(store());
    b_gate.add_permits(10);
    let slow = |router: &Router| {
        let router = router.clone();
        async move {
            let request = Request::post("/slow")
                .header("idempotency-key", "k")
                .header("x-tenant-id", "acme")
                .body(axum::body::Body::empty())
                .expect("request");
            let response = router.oneshot(request).await.expect("infallible");
            let (parts, body) = response.into_parts();
            Reply {
                status: parts.status,
                headers: parts.headers,
                body: body.collect().await.expect("body").to_bytes(),
            }
        }
    };
    let first = tokio::spawn(slow(&a));
    idem_tests::wait_until(Duration::from_secs(10), "A's handler runs", async || {
        a_runs.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    server.crash();
    a_gate.add_permits(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(a_layer.background_tasks(), 1, "A holds the outcome");
    // However long this takes, the lease has lapsed after it.
    tokio::time::sleep(lease + Duration::from_millis(1500)).await;
    server.start_again();
    let retry = idem_tests::poll_until(
        Duration::from_secs(20),
        async || slow(&b).await,
        |reply| {
            !matches!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
            )
        },
    )
    .await;
    assert_eq!(
        b_runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "B never ran the handler"
    );
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code());
    assert!(retry.headers.contains_key("idempotent-replayed"));
    assert_eq!(retry.body, first.body);
    assert_eq!(a_runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// Every connection of the pool in use (a handler holds the only one in
/// its transaction): another keyed request waits the pool timeout, then
/// gets 503 with `Retry-After`, fail-open or not (the database is up and
/// busy), and runs nothing; once the connection is back it runs.
#[tokio::test]
async fn a_busy_pool_is_a_503_never_a_run_unprotected() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::builder()
        .url(server.database())
        .max_connections(1)
        .pool_timeout(Duration::from_millis(200))
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let app = app_on(store.clone()).await.expect("app");
    let router = Router::new()
        .route("/orders", post(create))
        .with_state(app.state.clone())
        .layer(
            IdempotencyLayer::new(store)
                .tenant(TenantFromHeader::from_static("x-tenant-id"))
                .fail_open(true),
        );
    let holder = {
        let router = router.clone();
        tokio::spawn(async move { call(&router, Some("holds"), &[("x-wait", "1")]).await })
    };
    // The handler holds the pool's one connection in its transaction.
    app.state.waiting.acquire().await.expect("waiting").forget();
    let started = std::time::Instant::now();
    let busy = call(&router, Some("waits"), &[]).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        busy.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(
        busy.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "waited past the store timeout: {:?}",
        started.elapsed()
    );
    app.state.gate.add_permits(1);
    assert_eq!(holder.await.expect("join").status, StatusCode::CREATED);
    let retry = call(&router, Some("waits"), &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    // The holder's order and the retry's: the busy answer ran nothing.
    assert_eq!(app.orders().await, 2);
}

/// A database that cannot be reached is not a busy pool: the pool's wait
/// runs out without a connection, and fail-open covers it (the request
/// runs unprotected, counted), where a busy pool's never does.
#[tokio::test]
async fn an_unreachable_database_fails_open_when_asked() {
    let Some(_server) = PgServer::shared() else {
        return;
    };
    let port = idem_tests::redis_server::free_port();
    let store = PgStore::builder()
        .url(format!("postgres://postgres@127.0.0.1:{port}/nothing"))
        .pool_timeout(Duration::from_millis(200))
        .build()
        .expect("store");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let router = |open: bool| {
        let runs = Arc::clone(&runs);
        Router::new()
            .route(
                "/orders",
                post(move || {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async { StatusCode::CREATED }
                }),
            )
            .layer(
                IdempotencyLayer::new(store.clone())
                    .tenant(TenantFromHeader::from_static("x-tenant-id"))
                    .fail_open(open),
            )
    };
    let closed = call(&router(false), Some("down"), &[]).await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    let open = call(&router(true), Some("down"), &[]).await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A database that answers it has too many connections (SQLSTATE 53300,
/// here a role over its connection limit) is up and serving others: busy,
/// never an outage, so a layer with fail-open answers 503 and never runs
/// the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_connections_is_busy_and_never_fails_open() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    PgStore::from_url(&url)
        .expect("store")
        .migrate()
        .await
        .expect("migrate");
    let role = format!("limited_{}", uuid::Uuid::new_v4().simple());
    server
        .psql(
            "postgres",
            &format!("CREATE ROLE {role} LOGIN CONNECTION LIMIT 0"),
        )
        .expect("role");
    let limited = url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let store = PgStore::from_url(&limited).expect("store");
    let request = ReserveRequest {
        scope: fresh_scope("too-many"),
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let busy = store.reserve(&request).await;
    assert!(
        matches!(busy, Err(idem_core::StoreError::Busy { .. })),
        "{busy:?}"
    );
    let (router, runs) = fail_open_orders(IdempotencyLayer::new(store));
    let answer = router
        .oneshot(
            Request::post("/orders")
                .header("idempotency-key", "too-many-1")
                .header("x-tenant-id", "acme")
                .body(axum::body::Body::from("{}"))
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// A handler that answers a success and forgets `tx.commit()` (the
/// transaction dropped, its insert rolled back): the success is never
/// recorded; the caller gets `500 idempotency_transaction_not_committed`,
/// the key is released and the retry runs, leaving one order. An explicit
/// `rollback()` followed by a 2xx is the handler's own decision: recorded
/// and replayed. A 4xx with a dropped transaction is a refusal whose
/// writes rightly rolled back: recorded and replayed.
#[tokio::test]
async fn a_forgotten_commit_never_records_a_success() {
    let Some(app) = app().await else { return };
    let forgot = call(&app.router, Some("forgot-1"), &[("x-forget", "1")]).await;
    assert_eq!(forgot.status, StatusCode::INTERNAL_SERVER_ERROR);
    let problem: serde_json::Value = serde_json::from_slice(&forgot.body).expect("json");
    assert_eq!(problem["code"], "idempotency_transaction_not_committed");
    assert_eq!(app.orders().await, 0);
    let processing: i64 = app
        .read("SELECT count(*) FROM idem_records WHERE state = 'processing'")
        .await;
    assert_eq!(processing, 0, "the key was released");
    let retry = call(&app.router, Some("forgot-1"), &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.headers.contains_key("idempotent-replayed"));
    assert_eq!(app.orders().await, 1);

    // An explicit rollback, then 200: recorded as the handler said.
    let rolled = call(
        &app.router,
        Some("rolled-1"),
        &[("x-rollback", "1"), ("x-status", "200")],
    )
    .await;
    assert_eq!(rolled.status, StatusCode::OK);
    let again = call(
        &app.router,
        Some("rolled-1"),
        &[("x-rollback", "1"), ("x-status", "200")],
    )
    .await;
    assert_eq!(again.status, StatusCode::OK);
    assert!(again.headers.contains_key("idempotent-replayed"));
    // A 422 with the transaction dropped: a refusal, recorded.
    let refused = call(
        &app.router,
        Some("refused-1"),
        &[("x-forget", "1"), ("x-status", "422")],
    )
    .await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    let replayed = call(
        &app.router,
        Some("refused-1"),
        &[("x-forget", "1"), ("x-status", "422")],
    )
    .await;
    assert!(replayed.headers.contains_key("idempotent-replayed"));
    assert_eq!(app.orders().await, 1, "neither kept an order");
}

/// Behind a transaction pooler that queues calls while the database is
/// busy, a store call that runs out of time waited in the queue: busy,
/// not an outage. A layer that fails open answers 503 and never runs the
/// handler (it ran unprotected before: the timeout read as unreachable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_behind_a_busy_pooler_never_fails_open() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(bouncer) = PgBouncer::spawn(server, 1) else {
        return;
    };
    let database = bouncer.url(&server.database());
    let store = PgStore::builder()
        .url(database.clone())
        .transaction_pooler(true)
        .max_connections(4)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    // The pooler's one server connection, held by a long transaction.
    let holder = sqlx::PgPool::connect(&database).await.expect("connect");
    let (held, hold) = tokio::sync::oneshot::channel::<()>();
    let busy = tokio::spawn(async move {
        let mut tx = holder.begin().await.expect("begin");
        let _ = held.send(());
        let _ = sqlx::query("SELECT pg_sleep(4)")
            .persistent(false)
            .execute(&mut *tx)
            .await;
        let _ = tx.rollback().await;
    });
    hold.await.expect("held");
    let (router, runs) = fail_open_orders(
        IdempotencyLayer::new(store).timing(|t| t.store_timeout(Duration::from_millis(300))),
    );
    let answer = router
        .oneshot(
            Request::post("/orders")
                .header("idempotency-key", "queued-1")
                .header("x-tenant-id", "acme")
                .body(axum::body::Body::from("{}"))
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "never run unprotected"
    );
    let _ = busy.await;
}

/// A database that cannot begin the handler's transaction: the extractor
/// answers `503 idempotency_store_unavailable` with `Retry-After` and
/// idem's problem type, as every other refusal has it (it was
/// `about:blank`).
#[tokio::test]
async fn a_transaction_that_cannot_begin_is_idems_own_503() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a port");
    let store = PgStore::builder()
        .url(format!("postgres://postgres@{closed}/nothing"))
        .build()
        .expect("store");
    let router = Router::new()
        .route(
            "/orders",
            post(|_tx: IdemTransaction| async { StatusCode::CREATED }),
        )
        .with_state(store);
    let answer = router
        .oneshot(
            Request::post("/orders")
                .body(axum::body::Body::empty())
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answer.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let body = answer.into_body().collect().await.expect("body").to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(problem["code"], "idempotency_store_unavailable");
    assert_eq!(
        problem["type"],
        "urn:idem:problem:idempotency_store_unavailable"
    );
}

/// Two more answers of the database, never covered by fail-open: a row the
/// store cannot read (its history spoiled), and a record that keeps
/// vanishing between the insert that found it and the lock that reads it
/// (here a completed record hidden from the store's role by row-level
/// security, as a sweep racing every try would hide it), which is busy. A fail-open layer
/// answers 503 to both and never runs the handler again.
#[tokio::test]
async fn a_corrupt_row_and_a_vanishing_record_never_fail_open() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let database = url.rsplit('/').next().expect("a database").to_owned();
    let store = PgStore::from_url(&url).expect("store");
    store.migrate().await.expect("migrate");
    let (router, runs) = fail_open_orders(IdempotencyLayer::new(store.clone()));
    let order = |key: &str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .header("x-tenant-id", "acme")
            .body(axum::body::Body::from("{}"))
            .expect("request")
    };
    for key in ["spoiled", "hidden"] {
        let answer = router.clone().oneshot(order(key)).await.expect("answer");
        assert_eq!(answer.status(), StatusCode::CREATED);
    }
    let ran = || runs.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(ran(), 2);
    server
        .psql(
            &database,
            "UPDATE idem_records SET attempts = '\"not a history\"'::jsonb WHERE key = 'spoiled'",
        )
        .expect("spoil");
    let answer = router
        .clone()
        .oneshot(order("spoiled"))
        .await
        .expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ran(), 2, "a corrupt row is not run unprotected");

    let role = format!("hides_{database}");
    server
        .psql(
            &database,
            &format!(
                "CREATE ROLE {role} LOGIN; \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}; \
                 ALTER TABLE idem_records ENABLE ROW LEVEL SECURITY; \
                 CREATE POLICY none_seen ON idem_records FOR SELECT TO {role} \
                   USING (state = 'processing'); \
                 CREATE POLICY inserts ON idem_records FOR INSERT TO {role} WITH CHECK (true);"
            ),
        )
        .expect("a role that sees no record");
    let hidden_url = url.replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(hidden_url, url, "{url}");
    let hiding = PgStore::from_url(&hidden_url).expect("store");
    let request = ReserveRequest {
        scope: fresh_scope("hidden-direct"),
        fingerprint: fingerprint(1),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let Ok(Reservation::Acquired(lease)) = store.reserve(&request).await else {
        panic!("a new key");
    };
    let done = Outcome::Stored(StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    });
    assert_eq!(
        store.complete(&lease, &done).await.expect("complete"),
        Completion::Recorded
    );
    let busy = hiding.reserve(&request).await;
    assert!(
        matches!(busy, Err(idem_core::StoreError::Busy { .. })),
        "{busy:?}"
    );
    let (hidden_router, hidden_runs) = fail_open_orders(IdempotencyLayer::new(hiding));
    let answer = hidden_router
        .oneshot(order("hidden"))
        .await
        .expect("answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        hidden_runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a vanishing record is not run unprotected"
    );
}

/// `POST /orders` answering 201, behind `layer` with tenants from
/// `x-tenant-id` and fail-open on; and how many times the handler ran.
fn fail_open_orders(
    layer: IdempotencyLayer<PgStore>,
) -> (Router, Arc<std::sync::atomic::AtomicUsize>) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let router = Router::new()
        .route(
            "/orders",
            post(move || {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { StatusCode::CREATED }
            }),
        )
        .layer(
            layer
                .tenant(TenantFromHeader::from_static("x-tenant-id"))
                .fail_open(true),
        );
    (router, runs)
}
