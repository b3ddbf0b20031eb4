//! The orders API of the example: `POST /orders` creates an order with a
//! fresh id (201, `Location`, the order as JSON) and `GET /orders/{id}`
//! reads it back. Used by the `axum-orders` binary, and by `idem-gateway`
//! as its built-in demo upstream.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use axum::{
    Router,
    body::Bytes,
    extract::{Path, State},
    http::{StatusCode, header},
    response::IntoResponse,
    routing::{get, post},
};
use serde_json::{Value, json};

/// How many maps the orders are spread over. One map of every
/// order would, each time it grows, rehash all of them under its lock:
/// near a million orders that held every request for about 300 ms (the
/// stalls the gateway benchmarks saw, `bench/HISTORY.md`). A shard grows
/// alone and holds a sixty-fourth of them.
const SHARDS: usize = 64;

#[derive(Clone)]
struct Orders {
    next_id: Arc<AtomicU64>,
    /// Each order's JSON as it was answered, by id, in the shard of its id.
    shards: Arc<[Mutex<HashMap<u64, Bytes>>]>,
    /// What picks an id's shard (see [`Orders::shard`]).
    spread: RandomState,
}

impl Default for Orders {
    fn default() -> Self {
        Self {
            next_id: Arc::default(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            spread: RandomState::new(),
        }
    }
}

impl Orders {
    /// The map of order `id`: chosen by a hash of the id, not by the id
    /// itself. Ids are sequential, so `id % 64` would fill the maps in
    /// exact step and all of them would grow within 64 orders of each
    /// other; hashed, their sizes differ by a few dozen near a million
    /// orders, and their growths spread over thousands of orders.
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Bytes>> {
        // The remainder is below SHARDS, so it fits a usize.
        &self.shards[(self.spread.hash_one(id) % SHARDS as u64) as usize]
    }
}

/// An order's JSON as an answer.
fn order_json(order: Bytes) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], order)
}

/// A body that does not parse is refused without spending the key
/// ([`Validated`](idem_layer::Validated)): the corrected retry runs.
async fn create(
    State(orders): State<Orders>,
    idem_layer::Validated(axum::Json(request)): idem_layer::Validated<axum::Json<Value>>,
) -> impl IntoResponse {
    let id = orders.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let order = Bytes::from(json!({ "id": id, "order": request }).to_string());
    if let Ok(mut shard) = orders.shard(id).lock() {
        shard.insert(id, order.clone());
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        order_json(order),
    )
}

async fn read(State(orders): State<Orders>, Path(id): Path<u64>) -> impl IntoResponse {
    let order = orders
        .shard(id)
        .lock()
        .ok()
        .and_then(|shard| shard.get(&id).cloned());
    match order {
        Some(order) => order_json(order).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The orders routes, with fresh in-memory state.
pub fn orders() -> Router {
    Router::new()
        .route("/orders", post(create))
        .route("/orders/{id}", get(read))
        .with_state(Orders::default())
}

/// The orders API on PostgreSQL: each order is a row of the `orders` table,
/// inserted in the handler's [`IdemTransaction`](idem_postgres::IdemTransaction), so that under the layer
/// the order and the completed idempotency record commit together.
pub mod pg {
    use axum::{
        Json, Router,
        extract::{FromRef, Path, State},
        http::{HeaderMap, StatusCode, header},
        response::{IntoResponse, Response},
        routing::{get, post},
    };
    use idem_postgres::{IdemTransaction, PgStore};
    use serde_json::{Value, json};

    /// The application's own state, as a real service has one: the
    /// database pool its reads use, and the idem store. The
    /// `IdemTransaction` extractor finds the store through
    /// `FromRef<AppState>`.
    #[derive(Clone)]
    pub struct AppState {
        /// The pool of the application's own queries.
        pub db: sqlx::PgPool,
        /// The idem store the layer and `IdemTransaction` use.
        pub store: PgStore,
    }

    impl AppState {
        /// The state of a service whose records and orders share one
        /// database (and the store's pool).
        pub fn new(store: PgStore) -> Self {
            Self {
                db: store.pool().clone(),
                store,
            }
        }
    }

    impl FromRef<AppState> for PgStore {
        fn from_ref(state: &AppState) -> Self {
            state.store.clone()
        }
    }

    /// Creates the records table (with its outbox), the `orders` table
    /// and the `payments` ledger if missing.
    pub async fn migrate(store: &PgStore) -> Result<(), idem_core::StoreError> {
        store.migrate().await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, body jsonb NOT NULL); \
             CREATE TABLE IF NOT EXISTS payments (id bigserial PRIMARY KEY, \
               account text NOT NULL, cents bigint NOT NULL)",
        )
        .execute(store.pool())
        .await
        .map_err(idem_core::StoreError::unavailable)?;
        Ok(())
    }

    /// A database error: logged, answered 503 (the layer releases the key
    /// and the transaction rolls back).
    fn failed(error: impl std::fmt::Display) -> Response {
        eprintln!("axum-orders: database error: {error}");
        (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
    }

    async fn create(
        // Read by the crash points only (feature `test-hooks`).
        #[cfg_attr(not(feature = "test-hooks"), allow(unused_variables))] headers: HeaderMap,
        mut tx: IdemTransaction,
        idem_layer::Validated(Json(request)): idem_layer::Validated<Json<Value>>,
    ) -> Response {
        // Unnamed (`persistent(false)`): the service runs behind
        // PgBouncer in transaction mode too, where a named statement of
        // one client collides with another's on a shared server connection.
        let inserted: Result<i64, _> =
            sqlx::query_scalar("INSERT INTO orders (body) VALUES ($1::text::jsonb) RETURNING id")
                .persistent(false)
                .bind(request.to_string())
                .fetch_one(&mut *tx)
                .await;
        let id = match inserted {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        #[cfg(feature = "test-hooks")]
        if super::hooks::hold(&headers, "before-commit") {
            super::hooks::hold_forever("before commit").await;
        }
        if let Err(error) = tx.commit().await {
            return failed(error);
        }
        let order = json!({ "id": id, "order": request });
        (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/orders/{id}"))],
            Json(order),
        )
            .into_response()
    }

    /// The longest account name a payment takes.
    const MAX_ACCOUNT: usize = 256;

    /// A payment as the client sends it.
    #[derive(Debug, serde::Deserialize)]
    struct Payment {
        account: String,
        cents: i64,
    }

    /// Takes a payment: its ledger row and its `charges` event (for the
    /// outbox relay to publish; the charge consumer charges it) commit
    /// with the completed record, or none of them does.
    async fn pay(
        #[cfg_attr(not(feature = "test-hooks"), allow(unused_variables))] headers: HeaderMap,
        mut tx: IdemTransaction,
        idem_layer::Validated(Json(payment)): idem_layer::Validated<Json<Payment>>,
    ) -> Response {
        // Its event must fit the broker's max_payload with room to spare.
        if payment.account.is_empty() || payment.account.len() > MAX_ACCOUNT {
            let refusal = json!({ "error": format!("account must be 1 to {MAX_ACCOUNT} bytes") });
            return (StatusCode::UNPROCESSABLE_ENTITY, Json(refusal)).into_response();
        }
        let inserted: Result<i64, _> = sqlx::query_scalar(
            "INSERT INTO payments (account, cents) VALUES ($1, $2) RETURNING id",
        )
        .persistent(false)
        .bind(&payment.account)
        .bind(payment.cents)
        .fetch_one(&mut *tx)
        .await;
        let id = match inserted {
            Ok(id) => id,
            Err(error) => return failed(error),
        };
        let event = json!({ "id": format!("pay-{id}"), "account": payment.account, "cents": payment.cents });
        if let Err(error) = tx.emit("charges", event.to_string()) {
            return failed(error);
        }
        #[cfg(feature = "test-hooks")]
        if super::hooks::hold(&headers, "before-commit") {
            super::hooks::hold_forever("before commit").await;
        }
        if let Err(error) = tx.commit().await {
            return failed(error);
        }
        let body = json!({ "id": id, "account": payment.account, "cents": payment.cents });
        (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/payments/{id}"))],
            Json(body),
        )
            .into_response()
    }

    async fn read(State(state): State<AppState>, Path(id): Path<i64>) -> Response {
        let found: Result<Option<String>, _> =
            sqlx::query_scalar("SELECT body::text FROM orders WHERE id = $1")
                .persistent(false)
                .bind(id)
                .fetch_optional(&state.db)
                .await;
        match found {
            Ok(Some(body)) => {
                let order: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                Json(json!({ "id": id, "order": order })).into_response()
            }
            Ok(None) => StatusCode::NOT_FOUND.into_response(),
            Err(error) => failed(error),
        }
    }

    /// The orders and payments routes on `state` (the layer is added by
    /// the caller).
    pub fn orders(state: AppState) -> Router {
        Router::new()
            .route("/orders", post(create))
            .route("/orders/{id}", get(read))
            .route("/payments", post(pay))
            .with_state(state)
    }
}

/// Crash points for the example's process tests (feature `test-hooks`),
/// active only with `ORDERS_TEST_HOOKS=1`: a request with `x-test-hold: before-commit` holds
/// after its insert, before handing its transaction over;
/// `x-test-hold: after-commit` is held (by [`hold_after`](hooks::hold_after),
/// outside the idempotency layer) once the layer has committed. Each prints
/// one line on stderr when it starts holding, so a test can kill the
/// process at that point.
#[cfg(feature = "test-hooks")]
pub mod hooks {
    use axum::{extract::Request, http::HeaderMap, middleware::Next, response::Response};

    fn enabled() -> bool {
        std::env::var("ORDERS_TEST_HOOKS").is_ok_and(|v| v == "1")
    }

    /// Whether the request asks to be held at `point` (hooks enabled).
    pub fn hold(headers: &HeaderMap, point: &str) -> bool {
        enabled()
            && headers
                .get("x-test-hold")
                .is_some_and(|value| value.as_bytes() == point.as_bytes())
    }

    /// Says where it holds, then never returns.
    pub async fn hold_forever(point: &str) {
        eprintln!("axum-orders: holding {point}");
        std::future::pending::<()>().await;
    }

    /// Middleware outside the layer: holds requests marked `after-commit`
    /// once their response (and its commit) is done.
    pub async fn hold_after(request: Request, next: Next) -> Response {
        let held = hold(request.headers(), "after-commit");
        let response = next.run(request).await;
        if held {
            hold_forever("after commit").await;
        }
        response
    }
}
