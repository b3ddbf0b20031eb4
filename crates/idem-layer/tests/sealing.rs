//! Responses sealed at rest, through the layer on a real store: the store
//! holds the status and a ciphertext, a retry gets the response byte for
//! byte, a rotation keeps older records replaying, and a record sealed
//! under a key the layer lacks is never replayed, nor run again.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, extract::State, response::IntoResponse, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::{Outcome, RecordQuery, RecordsAdmin};
use idem_layer::{IdempotencyLayer, TenantFromHeader, sealing::Keyring};
use idem_memory::MemoryStore;
use tower::ServiceExt;

async fn create(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [
            ("x-card", "4242-CARDMARK"),
            ("content-type", "application/json"),
        ],
        format!("{{\"sku\":\"BODYMARK\",\"run\":{n}}}"),
    )
}

fn app(store: &MemoryStore, sealing: Option<Keyring>, runs: &Arc<AtomicUsize>) -> Router {
    let mut layer =
        IdempotencyLayer::new(store.clone()).tenant(TenantFromHeader::from_static("x-tenant"));
    if let Some(keyring) = sealing {
        layer = layer.sealing(keyring);
    }
    Router::new()
        .route("/orders", post(create))
        .with_state(Arc::clone(runs))
        .layer(layer)
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

async fn post_order(app: &Router, key: &str) -> Answer {
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
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    }
}

fn code(answer: &Answer) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
    Some(json.get("code")?.as_str()?.to_owned())
}

/// The stored response of the only record of `operation`'s key `key`.
async fn stored(store: &MemoryStore, key: &str) -> idem_core::StoredResponse {
    let records = store
        .list(&RecordQuery {
            limit: 100,
            ..RecordQuery::default()
        })
        .await
        .expect("list");
    let record = records
        .into_iter()
        .find(|record| &*record.key == key)
        .expect("the record");
    match record.outcome {
        Some(Outcome::Stored(stored)) => stored,
        other => panic!("no stored response: {other:?}"),
    }
}

fn assert_sealed(stored: &idem_core::StoredResponse, key_id: &str) {
    assert_eq!(stored.status, 201);
    assert_eq!(
        stored.headers,
        vec![(idem_layer::sealing::SEALED, Bytes::from(key_id.to_owned()))]
    );
    for clear in ["BODYMARK", "CARDMARK", "x-card", "application/json"] {
        assert!(
            !stored
                .body
                .windows(clear.len())
                .any(|w| w == clear.as_bytes()),
            "{clear} is stored in clear"
        );
    }
}

const SECRET: &[u8] = b"the deployment secret, at least 32 bytes";

#[tokio::test]
async fn a_sealed_response_is_stored_as_ciphertext_and_replays_byte_for_byte() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let sealed = app(&store, Some(Keyring::derived(SECRET)), &runs);
    let first = post_order(&sealed, "order-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["x-card"], "4242-CARDMARK");
    assert_sealed(&stored(&store, "order-1").await, "0");
    // Another layer on the same store (no replay cache of its own yet).
    let other = app(&store, Some(Keyring::derived(SECRET)), &runs);
    let replay = post_order(&other, "order-1").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["x-card"], "4242-CARDMARK");
    assert_eq!(replay.headers["content-type"], "application/json");
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn after_a_rotation_both_generations_replay_and_a_wrong_key_replays_nothing() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let before = Keyring::derived(SECRET);
    let old = post_order(&app(&store, Some(before.clone()), &runs), "old").await;
    assert_eq!(old.status, StatusCode::CREATED);
    // Rotated: key 2 seals, key 0 still opens.
    let rotated = app(&store, Some(before.clone().rotated_to(2, [2; 32])), &runs);
    let new = post_order(&rotated, "new").await;
    assert_eq!(new.status, StatusCode::CREATED);
    assert_sealed(&stored(&store, "new").await, "2");
    assert_sealed(&stored(&store, "old").await, "0");
    for (key, first) in [("old", &old), ("new", &new)] {
        let replay = post_order(&rotated, key).await;
        assert_eq!(replay.status, StatusCode::CREATED, "{key}");
        assert_eq!(replay.body, first.body, "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // A layer without key 2, and one with another secret: nothing replays
    // and nothing runs again.
    for (keyring, key) in [
        (before, "new"),
        (
            Keyring::derived(b"another secret, not the deployment's"),
            "old",
        ),
    ] {
        let refused = post_order(&app(&store, Some(keyring), &runs), key).await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "{key}");
        assert_eq!(
            code(&refused).as_deref(),
            Some("idempotency_store_unavailable")
        );
        assert!(!refused.body.windows(8).any(|w| w == b"BODYMARK"), "{key}");
    }
    // Nor one without a keyring: a sealed record is no response to replay.
    let bare = post_order(&app(&store, None, &runs), "old").await;
    assert_eq!(bare.status, StatusCode::SERVICE_UNAVAILABLE);
    // One that unseals (sealing turned off) still opens what it holds the
    // keys of, and stores new responses in clear.
    let unsealing = Router::new()
        .route("/orders", post(create))
        .with_state(Arc::clone(&runs))
        .layer(
            IdempotencyLayer::new(store.clone())
                .tenant(TenantFromHeader::from_static("x-tenant"))
                .sealing(idem_layer::settings::Sealing::open_only(
                    Keyring::derived(SECRET).rotated_to(2, [2; 32]),
                )),
        );
    let opened = post_order(&unsealing, "new").await;
    assert_eq!(opened.body, new.body);
    let in_clear = post_order(&unsealing, "later").await;
    assert_eq!(in_clear.status, StatusCode::CREATED);
    let stored_later = stored(&store, "later").await;
    assert!(
        stored_later
            .headers
            .iter()
            .any(|(name, _)| name == "x-card")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Even a layer that fails open does not run it: the store answered.
    let fail_open = Router::new()
        .route("/orders", post(create))
        .with_state(Arc::clone(&runs))
        .layer(
            IdempotencyLayer::new(store.clone())
                .tenant(TenantFromHeader::from_static("x-tenant"))
                .fail_open(true)
                .sealing(Keyring::new(5, [5; 32])),
        );
    let refused = post_order(&fail_open, "old").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 3, "nothing ran again");
}

#[tokio::test]
async fn records_stored_before_sealing_still_replay() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let first = post_order(&app(&store, None, &runs), "plain").await;
    let stored = stored(&store, "plain").await;
    assert!(stored.headers.iter().any(|(name, _)| name == "x-card"));
    let replay = post_order(&app(&store, Some(Keyring::derived(SECRET)), &runs), "plain").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["x-card"], "4242-CARDMARK");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A layer with a fingerprint secret keys the fingerprints it writes: the
/// stored one is not the plain hash of the request (so a short body
/// cannot be confirmed by hashing guesses), retries replay, a changed
/// payload still conflicts, and records written unkeyed before still
/// replay through it.
#[tokio::test]
async fn fingerprints_are_keyed_and_unkeyed_records_still_replay() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let keyed = |secret: &'static [u8]| {
        Router::new()
            .route("/orders", post(create))
            .with_state(Arc::clone(&runs))
            .layer(
                IdempotencyLayer::new(store.clone())
                    .tenant(TenantFromHeader::from_static("x-tenant"))
                    .fingerprints(|f| f.secret(secret)),
            )
    };
    let send = |app: Router, key: &'static str, body: &'static str| async move {
        let response = app
            .oneshot(
                Request::post("/orders")
                    .header("x-tenant", "acme")
                    .header("idempotency-key", key)
                    .body(Body::from(body))
                    .expect("request"),
            )
            .await
            .expect("infallible");
        (
            response.status(),
            response.headers().contains_key("idempotent-replayed"),
        )
    };
    // Written unkeyed, replayed keyed.
    let (status, _) = send(app(&store, None, &runs), "plain", "1").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        send(keyed(SECRET), "plain", "1").await,
        (StatusCode::CREATED, true)
    );
    assert_eq!(
        send(keyed(SECRET), "plain", "2").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // Written keyed.
    assert_eq!(
        send(keyed(SECRET), "keyed", "1").await,
        (StatusCode::CREATED, false)
    );
    assert_eq!(
        send(keyed(SECRET), "keyed", "1").await,
        (StatusCode::CREATED, true)
    );
    assert_eq!(
        send(keyed(SECRET), "keyed", "2").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let records = store
        .list(&RecordQuery {
            limit: 10,
            ..RecordQuery::default()
        })
        .await
        .expect("list");
    let fingerprint_of = |key: &str| {
        records
            .iter()
            .find(|record| &*record.key == key)
            .expect("record")
            .fingerprint
    };
    let parts = Request::post("/orders")
        .header("x-tenant", "acme")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    let plain = idem_layer::fingerprint::fingerprint(
        "POST /orders",
        &parts,
        &[http::header::CONTENT_TYPE],
        b"1",
    );
    assert_eq!(fingerprint_of("plain"), plain, "the unkeyed one as it was");
    assert_ne!(
        fingerprint_of("keyed"),
        plain,
        "the keyed one is not the plain hash"
    );
    // Another secret reads the keyed record as another payload.
    assert_eq!(
        send(keyed(b"another secret altogether, 32 bytes"), "keyed", "1")
            .await
            .0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A handler's own `idem-sealed` header is never stored: a layer without
/// a keyring still replays its answer (without that header) instead of
/// taking it for a sealed record.
#[tokio::test]
async fn a_handlers_idem_sealed_header_is_never_taken_for_a_seal() {
    async fn mimic(State(runs): State<Arc<AtomicUsize>>) -> impl IntoResponse {
        runs.fetch_add(1, Ordering::SeqCst);
        (StatusCode::CREATED, [("idem-sealed", "0")], "not sealed")
    }
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/orders", post(mimic))
        .with_state(Arc::clone(&runs))
        .layer(
            IdempotencyLayer::new(store.clone()).tenant(TenantFromHeader::from_static("x-tenant")),
        );
    let first = post_order(&app, "mimic").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = post_order(&app, "mimic").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, "not sealed");
    assert!(!replay.headers.contains_key("idem-sealed"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
