//! The orders API of the example: `POST /orders` creates an order with a
//! fresh id (201, `Location`, the order as JSON) and `GET /orders/{id}`
//! reads it back. Used by the `axum-orders` binary, and by `idem-gateway`
//! as its built-in demo upstream.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{StatusCode, header},
    response::IntoResponse,
    routing::{get, post},
};
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Orders {
    next_id: Arc<AtomicU64>,
    orders: Arc<Mutex<HashMap<u64, Value>>>,
}

async fn create(State(orders): State<Orders>, Json(request): Json<Value>) -> impl IntoResponse {
    let id = orders.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let order = json!({ "id": id, "order": request });
    if let Ok(mut map) = orders.orders.lock() {
        map.insert(id, order.clone());
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        Json(order),
    )
}

async fn read(State(orders): State<Orders>, Path(id): Path<u64>) -> impl IntoResponse {
    let order = orders
        .orders
        .lock()
        .ok()
        .and_then(|map| map.get(&id).cloned());
    match order {
        Some(order) => Json(order).into_response(),
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
