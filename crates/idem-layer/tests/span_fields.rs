//! The layer's `idempotency` span (DEBUG) carries the scope hash, never
//! the raw key, the attempt and the outcome.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{Router, body::Body, extract::State, routing::post};
use http::{Request, StatusCode};
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_memory::MemoryStore;
use tower::ServiceExt;
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};
use tracing_subscriber::{Layer, layer::Context, prelude::*, registry::LookupSpan};

/// A span's fields by name, as text.
type FieldMap = BTreeMap<String, String>;

/// The fields of every `idempotency` span, by span id, as recorded.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<(u64, FieldMap)>>>);

struct Fields<'a>(&'a mut FieldMap);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() != "idempotency" {
            return;
        }
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.0.lock().expect("spans").push((id.into_u64(), fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut spans = self.0.lock().expect("spans");
        if let Some((_, fields)) = spans.iter_mut().find(|(span, _)| *span == id.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
}

async fn create(State(runs): State<Arc<AtomicUsize>>) -> (StatusCode, &'static str) {
    runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, "created")
}

#[tokio::test]
async fn the_span_names_the_scope_attempt_and_outcome_never_the_key() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(
            spans
                .clone()
                .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
        ),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/orders", post(create))
        .with_state(Arc::clone(&runs))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(TenantFromHeader::from_static("x-tenant")),
        );
    let key = "raw-key-0b7d41";
    for _ in 0..2 {
        let response = app
            .clone()
            .oneshot(
                Request::post("/orders")
                    .header("x-tenant", "acme")
                    .header("idempotency-key", key)
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let spans = spans.0.lock().expect("spans").clone();
    assert_eq!(spans.len(), 2, "{spans:?}");
    let (first, replay) = (&spans[0].1, &spans[1].1);
    for fields in [first, replay] {
        let scope = &fields["scope"];
        assert_eq!(scope.len(), 64, "{fields:?}");
        assert!(scope.bytes().all(|b| b.is_ascii_hexdigit()), "{fields:?}");
        assert_eq!(fields["operation"], "POST /orders");
        assert!(
            fields.values().all(|value| !value.contains(key)),
            "the raw key is recorded: {fields:?}"
        );
    }
    assert_eq!(first["scope"], replay["scope"]);
    assert_eq!(
        first.get("attempt").map(String::as_str),
        Some("1"),
        "{first:?}"
    );
    assert_eq!(
        first.get("outcome").map(String::as_str),
        Some("executed"),
        "{first:?}"
    );
    assert_eq!(
        replay.get("outcome").map(String::as_str),
        Some("replayed"),
        "{replay:?}"
    );
    assert_eq!(
        replay.get("attempt"),
        None,
        "a replay runs no attempt: {replay:?}"
    );
}
