//! The built-in demo upstream: a tiny orders API on an ephemeral loopback
//! port, so the gateway works out of the box.

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
    http::{StatusCode, Uri, header},
    response::IntoResponse,
    routing::{get, post},
};
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Orders {
    next_id: Arc<AtomicU64>,
    orders: Arc<Mutex<HashMap<u64, Value>>>,
}

async fn create(State(orders): State<Orders>, body: axum::body::Bytes) -> impl IntoResponse {
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
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
    match orders
        .orders
        .lock()
        .ok()
        .and_then(|map| map.get(&id).cloned())
    {
        Some(order) => Json(order).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The running demo upstream; stops when dropped.
pub(crate) struct Demo {
    pub(crate) uri: Uri,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) async fn start() -> std::io::Result<Demo> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = Router::new()
        .route("/orders", post(create))
        .route("/orders/{id}", get(read))
        .with_state(Orders::default());
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "demo upstream stopped");
        }
    });
    let uri = format!("http://{addr}")
        .parse()
        .map_err(std::io::Error::other)?;
    Ok(Demo { uri, task })
}
