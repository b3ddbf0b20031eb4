//! The PostgreSQL outbox: events a handler emits commit with its writes and
//! the completed record (or none of them does), and the relay publishes
//! them to a real `nats-server -js` in order, each once within the
//! broker's duplicate window, whatever the relay's crashes, late commits
//! and second relays.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use async_nats::jetstream;
use axum::{Router, routing::post};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use idem_core::{
    Completion, CompletionSlot, Current, Outcome, Reservation, ReserveRequest, Store,
    StoredResponse,
    conformance::{fingerprint, fresh_scope},
};
use idem_layer::{IdempotencyLayer, TenantFromHeader};
use idem_postgres::{EmitError, IdemTransaction, PgStore, relay::Relay};
use idem_tests::{
    nats_server::{NatsServer, stream_messages},
    pgbouncer::PgBouncer,
    postgres_server::PgServer,
};
use tower::ServiceExt;

/// Emits `x-events` events (default 1) on `events.orders`, payloads
/// `<key>:<n>`, after an insert; `x-status` picks the answer's status.
async fn create(headers: HeaderMap, mut tx: IdemTransaction) -> (StatusCode, String) {
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (note) VALUES ('x') RETURNING id")
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .expect("insert");
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    let events: usize = headers
        .get("x-events")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1);
    for n in 1..=events {
        tx.emit("events.orders", format!("{key}:{n}"))
            .expect("emit");
    }
    assert_eq!(tx.emitted(), events);
    tx.commit().await.expect("hand over");
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    (
        StatusCode::from_u16(status).expect("status"),
        format!("{{\"order\":{id}}}"),
    )
}

struct Scene {
    store: PgStore,
    router: Router,
    nats: NatsServer,
    jetstream: jetstream::Context,
}

/// A store on a fresh database (or `store`), the layer over `create`, a
/// private NATS with the stream `EVENTS` (`events.>`).
async fn scene_on(store: PgStore) -> Option<Scene> {
    let nats = NatsServer::spawn()?;
    store.migrate().await.expect("migrate");
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, note text)")
        .persistent(false)
        .execute(&mut *tx)
        .await
        .expect("orders table");
    tx.commit().await.expect("commit");
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(TenantFromHeader::from_static("x-tenant-id"));
    let router = Router::new()
        .route("/orders", post(create))
        .with_state(store.clone())
        .layer(layer);
    let client = async_nats::connect(nats.url()).await.expect("nats");
    let jetstream = jetstream::new(client);
    jetstream
        .create_stream(jetstream::stream::Config {
            name: "EVENTS".to_owned(),
            subjects: vec!["events.>".to_owned()],
            ..Default::default()
        })
        .await
        .expect("stream");
    Some(Scene {
        store,
        router,
        nats,
        jetstream,
    })
}

async fn scene() -> Option<Scene> {
    let server = PgServer::shared()?;
    scene_on(PgStore::from_url(&server.database()).expect("store")).await
}

impl Scene {
    async fn call(&self, key: &str, extra: &[(&str, &str)]) -> StatusCode {
        let mut request = Request::post("/orders")
            .header("x-tenant-id", "acme")
            .header("idempotency-key", key);
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        let response = self
            .router
            .clone()
            .oneshot(request.body(axum::body::Body::empty()).expect("request"))
            .await
            .expect("infallible");
        response.status()
    }

    fn relay(&self) -> Relay {
        Relay::new(&self.store, self.jetstream.clone())
    }

    /// One value, read in a transaction of its own (unnamed: it runs
    /// behind PgBouncer too).
    async fn read<T>(&self, sql: &str) -> T
    where
        T: Send + Unpin + for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let value = sqlx::query_scalar(sql)
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .expect("read");
        tx.commit().await.expect("commit");
        value
    }

    async fn outbox(&self) -> i64 {
        self.read("SELECT count(*) FROM idem_records_outbox").await
    }

    async fn unpublished(&self) -> i64 {
        self.read("SELECT count(*) FROM idem_records_outbox WHERE published_at_ms IS NULL")
            .await
    }

    /// Every message of the stream, in stream order: (message id, payload).
    async fn stream(&self) -> Vec<(String, String)> {
        stream_messages(&self.nats.url(), "EVENTS")
            .await
            .into_iter()
            .map(|(id, payload)| (id, String::from_utf8_lossy(&payload).into_owned()))
            .collect()
    }
}

/// Three events emitted under the layer commit with the record, leave in
/// the order emitted with ids of scope, generation and position, and are
/// marked; the replay of the key emits nothing more.
#[tokio::test]
async fn events_commit_with_the_record_and_leave_in_order() {
    let Some(scene) = scene().await else { return };
    assert_eq!(
        scene.call("k1", &[("x-events", "3")]).await,
        StatusCode::CREATED
    );
    assert_eq!(scene.outbox().await, 3);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 3);
    assert_eq!(scene.unpublished().await, 0, "published events are marked");
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 0);

    let scope = idem_core::Scope::new(
        "acme",
        "POST /orders",
        idem_core::IdempotencyKey::parse(b"k1").expect("key"),
    );
    let hex = scope.hash().to_hex();
    let record = scene
        .store
        .get(scope.hash())
        .await
        .expect("get")
        .expect("record");
    let attempt = record.attempts[0].id.0.simple();
    let expected: Vec<(String, String)> = (1..=3)
        .map(|n| (format!("{hex}-1-{attempt}-{n}"), format!("k1:{n}")))
        .collect();
    assert_eq!(scene.stream().await, expected);

    // The replay answers from the record: no second order, no event.
    assert_eq!(
        scene.call("k1", &[("x-events", "3")]).await,
        StatusCode::CREATED
    );
    assert_eq!(scene.outbox().await, 3);
    let (scope_column, generation, attempt): (Vec<u8>, i64, uuid::Uuid) = {
        let mut tx = scene.store.pool().begin().await.expect("begin");
        let row: (Vec<u8>, i64, uuid::Uuid) = sqlx::query_as(
            "SELECT scope, generation, attempt FROM idem_records_outbox WHERE position = 2",
        )
        .fetch_one(&mut *tx)
        .await
        .expect("row");
        tx.commit().await.expect("commit");
        row
    };
    assert_eq!(scope_column, scope.hash().as_bytes().to_vec());
    assert_eq!(generation, 1);
    let record = scene
        .store
        .get(scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(attempt, record.attempts[0].id.0, "the attempt that emitted");
}

/// A response the layer does not record (a 5xx) rolls the handler's
/// transaction back, events included: nothing leaves.
#[tokio::test]
async fn an_unrecorded_answer_takes_its_events_along() {
    let Some(scene) = scene().await else { return };
    assert_eq!(
        scene
            .call("k2", &[("x-status", "503"), ("x-events", "2")])
            .await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(scene.outbox().await, 0, "a rolled-back attempt left events");
    let orders: i64 = scene.read("SELECT count(*) FROM orders").await;
    assert_eq!(orders, 0);
    // The retry runs, and its events leave.
    assert_eq!(
        scene.call("k2", &[("x-events", "2")]).await,
        StatusCode::CREATED
    );
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 2);
    assert_eq!(scene.stream().await.len(), 2);
}

/// An attempt whose lease was taken over while it ran is fenced: its
/// order and its events roll back; only the attempt holding the record
/// emits.
#[tokio::test]
async fn a_fenced_attempts_events_never_leave() {
    let Some(scene) = scene().await else { return };
    let store = &scene.store;
    let scope = fresh_scope("fenced-events");
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
    tx.emit("events.orders", "superseded").expect("emit");
    tx.commit().await.expect("hand over");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Reservation::TakenOver { lease: second, .. } =
        store.reserve(&request).await.expect("reserve")
    else {
        panic!("not taken over");
    };
    let outcome = |body: &'static [u8]| {
        Outcome::Stored(StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: Bytes::from_static(body),
        })
    };
    let deferred = slot.take().expect("the handed-over transaction");
    let answer = deferred
        .commit(first, outcome(b"late"))
        .await
        .expect("commit");
    assert!(
        matches!(answer, Completion::Fenced(Current::Processing { .. })),
        "{answer:?}"
    );
    assert_eq!(
        scene.outbox().await,
        0,
        "a fenced attempt's event was written"
    );

    // The attempt that holds the record commits its event, with its own
    // generation in the id.
    let slot = CompletionSlot::new();
    let mut tx = IdemTransaction::begin(store, Some(slot.clone()))
        .await
        .expect("begin");
    tx.emit("events.orders", "current").expect("emit");
    tx.commit().await.expect("hand over");
    let deferred = slot.take().expect("the handed-over transaction");
    let answer = deferred
        .commit(second.clone(), outcome(b"done"))
        .await
        .expect("commit");
    assert!(matches!(answer, Completion::Recorded), "{answer:?}");
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    assert_eq!(
        scene.stream().await,
        vec![(
            format!(
                "{}-{}-{}-1",
                scope.hash().to_hex(),
                second.generation,
                second.attempt.0.simple()
            ),
            "current".to_owned()
        )]
    );
}

/// Without the layer, `commit` writes the events with the handler's rows
/// at once; their ids are the transaction's own.
#[tokio::test]
async fn without_the_layer_events_commit_with_the_writes() {
    let Some(scene) = scene().await else { return };
    let mut tx = IdemTransaction::begin(&scene.store, None)
        .await
        .expect("begin");
    tx.emit("events.orders", "a").expect("emit");
    tx.emit("events.orders", "b").expect("emit");
    tx.commit().await.expect("commit");
    // A transaction dropped without commit writes none.
    let mut dropped = IdemTransaction::begin(&scene.store, None)
        .await
        .expect("begin");
    dropped.emit("events.orders", "never").expect("emit");
    drop(dropped);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 2);
    let stream = scene.stream().await;
    assert_eq!(stream.len(), 2);
    let prefix = stream[0].0.strip_suffix("-1").expect("position 1");
    assert!(prefix.starts_with("tx-"), "{prefix}");
    assert_eq!(stream[1].0, format!("{prefix}-2"));
    assert_eq!(
        stream.iter().map(|(_, p)| p.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
}

/// A subject no event can be published on is refused at `emit`, never
/// left in the outbox to block the relay.
#[tokio::test]
async fn emit_refuses_a_subject_no_event_can_be_published_on() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let store = PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    let mut tx = IdemTransaction::begin(&store, None).await.expect("begin");
    for subject in [
        "",
        "a b",
        "a..b",
        ".a",
        "a.",
        "a.*",
        ">",
        "a.>",
        "tab\there",
    ] {
        assert_eq!(
            tx.emit(subject, "x"),
            Err(EmitError::Subject(subject.to_owned())),
            "{subject:?}"
        );
    }
    tx.emit("charges.eu-west.v1", "x").expect("a fine subject");
    assert_eq!(tx.emitted(), 1);
}

/// A relay that dies after the broker acknowledged a batch and before it
/// marked it (here: the batch's future is dropped at that stage, which
/// rolls its transaction back) leaves the events unpublished; the next
/// relay publishes them again with the same message ids, and the broker
/// drops the copies: one message per event.
#[tokio::test]
async fn a_batch_published_again_after_a_crash_is_one_message_per_event() {
    let Some(scene) = scene().await else { return };
    assert_eq!(
        scene.call("k3", &[("x-events", "4")]).await,
        StatusCode::CREATED
    );
    let (reached, mut at_published) = tokio::sync::mpsc::unbounded_channel();
    let stuck = scene.relay().on_stage(move |stage| {
        let reached = reached.clone();
        async move {
            if matches!(stage, idem_postgres::relay::Stage::Published { .. }) {
                let _ = reached.send(());
                std::future::pending::<()>().await;
            }
        }
    });
    let batch = tokio::spawn(async move { stuck.publish_once().await });
    tokio::time::timeout(Duration::from_secs(20), at_published.recv())
        .await
        .expect("the relay reached the stage")
        .expect("stage");
    batch.abort();
    let _ = batch.await;
    assert_eq!(scene.stream().await.len(), 4, "the broker has the batch");
    idem_tests::poll_until(
        Duration::from_secs(20),
        async || scene.unpublished().await,
        |unpublished| *unpublished == 4,
    )
    .await;

    assert_eq!(scene.relay().publish_once().await.expect("publish"), 4);
    assert_eq!(scene.unpublished().await, 0);
    let stream = scene.stream().await;
    assert_eq!(stream.len(), 4, "a re-publish was not dropped: {stream:?}");
    let payloads: Vec<&str> = stream.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(payloads, ["k3:1", "k3:2", "k3:3", "k3:4"]);
}

/// A transaction that drew a lower `seq` but commits after a higher one
/// has been published is published too (no cursor skips it).
#[tokio::test]
async fn a_late_commit_is_published_not_skipped() {
    let Some(scene) = scene().await else { return };
    let mut late = scene.store.pool().begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idem_records_outbox (id, position, subject, payload, created_at_ms) \
         VALUES ('late-1', 1, 'events.orders', 'late', 0)",
    )
    .execute(&mut *late)
    .await
    .expect("insert");
    assert_eq!(scene.call("k4", &[]).await, StatusCode::CREATED);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    late.commit().await.expect("commit");
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    let payloads: Vec<String> = scene.stream().await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(payloads, ["k4:1", "late"]);
    let first_seq: i64 = scene
        .read("SELECT seq FROM idem_records_outbox WHERE id = 'late-1'")
        .await;
    let second_seq: i64 = scene
        .read("SELECT seq FROM idem_records_outbox WHERE id <> 'late-1'")
        .await;
    assert!(first_seq < second_seq, "the scene needs the late row first");
}

/// Two relays publishing at once, in small batches: every event leaves
/// once, and each scope's events reach the stream in the order emitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_keep_each_scopes_order() {
    let Some(scene) = scene().await else { return };
    let scene = Arc::new(scene);
    let keys = 12;
    let per_key = 5;
    for k in 0..keys {
        let status = scene
            .call(&format!("ord-{k}"), &[("x-events", &per_key.to_string())])
            .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = scene.relay().batch(3);
            tokio::spawn(async move {
                let mut published = 0;
                loop {
                    match relay.publish_once().await.expect("publish") {
                        0 => return published,
                        n => published += n,
                    }
                }
            })
        })
        .collect();
    let mut total = 0;
    for relay in relays {
        total += relay.await.expect("relay");
    }
    assert_eq!(total, keys * per_key);
    let stream = scene.stream().await;
    assert_eq!(stream.len(), keys * per_key);
    let mut seen: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (id, payload) in &stream {
        let (key, n) = payload.split_once(':').expect("payload");
        let n: u32 = n.parse().expect("position");
        assert!(id.ends_with(&format!("-{n}")), "{id} carries {payload}");
        seen.entry(key.to_owned()).or_default().push(n);
    }
    assert_eq!(seen.len(), keys);
    for (key, positions) in seen {
        assert_eq!(
            positions,
            (1..=per_key as u32).collect::<Vec<_>>(),
            "{key}'s events left out of order"
        );
    }
}

/// The backlog counts what waits and how long; the sweep deletes the
/// published events once kept long enough, never an unpublished one.
#[tokio::test]
async fn the_backlog_is_measured_and_published_events_are_swept() {
    let Some(scene) = scene().await else { return };
    assert_eq!(
        scene.call("k5", &[("x-events", "2")]).await,
        StatusCode::CREATED
    );
    let backlog = scene.relay().backlog().await.expect("backlog");
    assert_eq!(backlog.events, 2);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 2);
    assert_eq!(
        scene.call("k6", &[("x-events", "1")]).await,
        StatusCode::CREATED
    );
    let backlog = scene.relay().backlog().await.expect("backlog");
    assert_eq!(backlog.events, 1);
    // Kept an hour: nothing is swept yet.
    assert_eq!(scene.relay().sweep().await.expect("sweep"), 0);
    assert_eq!(
        scene
            .relay()
            .keep_published(Duration::ZERO)
            .sweep()
            .await
            .expect("sweep"),
        2
    );
    assert_eq!(scene.outbox().await, 1, "the unpublished event was kept");
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    let backlog = scene.relay().backlog().await.expect("backlog");
    assert_eq!((backlog.events, backlog.oldest), (0, Duration::ZERO));
}

/// Behind PgBouncer in transaction mode: the events commit with the
/// record through the pooler, and the running relay, which polls only
/// once a minute here, is woken by the commit's `NOTIFY` on its direct
/// listening connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_a_commit_wakes_the_relay_through_its_direct_listener() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(bouncer) = PgBouncer::spawn(server, 4) else {
        return;
    };
    let Some(scene) = scene_on(bouncer.store(server)).await else {
        return;
    };
    // The pooled store's database, reached directly.
    let database = scene
        .store
        .pool()
        .connect_options()
        .get_database()
        .expect("database")
        .to_owned();
    let direct = format!("postgres://postgres@127.0.0.1:{}/{database}", server.port);
    let relay = scene
        .relay()
        .poll_every(Duration::from_secs(60))
        .listen_on(&direct)
        .expect("listen url");
    let running = tokio::spawn(relay.run(std::future::pending()));
    // Once it listens, its first passes find nothing; only the commit's
    // notification can wake it within the minute.
    let watcher = sqlx::PgPool::connect(&direct).await.expect("direct");
    idem_tests::wait_until(Duration::from_secs(20), "the relay to listen", async || {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN %outbox%'",
        )
        .fetch_one(&watcher)
        .await
        .expect("activity");
        listening == 1
    })
    .await;
    assert_eq!(
        scene.call("k7", &[("x-events", "2")]).await,
        StatusCode::CREATED
    );
    let stream = idem_tests::poll_until(
        Duration::from_secs(20),
        async || scene.stream().await,
        |stream| stream.len() == 2,
    )
    .await;
    assert_eq!(stream.len(), 2, "the relay was not woken: {stream:?}");
    running.abort();
    drop(scene.nats);
}

/// The trap that reorders a scope: while one relay publishes a batch, a
/// second must not publish the rows after it. Relay A takes the first
/// three of a scope's six events and holds before publishing; relay B's
/// batch waits on A's row locks (seen in `pg_stat_activity`) instead of
/// taking events 4 to 6; once A goes on, B publishes the rest after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_relay_waits_for_the_batch_the_first_holds() {
    let Some(scene) = scene().await else { return };
    assert_eq!(
        scene.call("k8", &[("x-events", "6")]).await,
        StatusCode::CREATED
    );
    let (reached, mut selected) = tokio::sync::mpsc::unbounded_channel();
    let go = Arc::new(tokio::sync::Notify::new());
    let hold = go.clone();
    let first = scene.relay().batch(3).on_stage(move |stage| {
        let (reached, hold) = (reached.clone(), hold.clone());
        async move {
            if matches!(stage, idem_postgres::relay::Stage::Selected { .. }) {
                let _ = reached.send(());
                hold.notified().await;
            }
        }
    });
    let first = tokio::spawn(async move { first.publish_once().await });
    tokio::time::timeout(Duration::from_secs(20), selected.recv())
        .await
        .expect("the first relay selected its batch")
        .expect("stage");
    let second = scene.relay().batch(3);
    let second = tokio::spawn(async move { second.publish_once().await });
    let waiting = idem_tests::poll_until(
        Duration::from_secs(20),
        async || {
            let waits: i64 = scene
                .read(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .await;
            (waits, second.is_finished())
        },
        |(waits, finished)| *waits == 1 || *finished,
    )
    .await;
    assert_eq!(
        waiting,
        (1, false),
        "the second relay did not wait for the first one's batch"
    );
    assert!(scene.stream().await.is_empty());
    go.notify_one();
    assert_eq!(first.await.expect("first").expect("publish"), 3);
    assert_eq!(second.await.expect("second").expect("publish"), 3);
    let payloads: Vec<String> = scene.stream().await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(
        payloads,
        (1..=6).map(|n| format!("k8:{n}")).collect::<Vec<_>>()
    );
}

/// A key reused after its record expired starts at generation 1 again:
/// its events get ids of their own (the attempt's id is in them), so the
/// outbox takes them and the broker does not drop them as the old ones.
#[tokio::test]
async fn a_key_reused_after_its_record_expired_emits_new_event_ids() {
    let Some(scene) = scene().await else { return };
    assert_eq!(scene.call("k9", &[]).await, StatusCode::CREATED);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    // The record expires and is swept (here: deleted at once).
    let mut tx = scene.store.pool().begin().await.expect("begin");
    sqlx::query("DELETE FROM idem_records")
        .execute(&mut *tx)
        .await
        .expect("delete");
    tx.commit().await.expect("commit");
    assert_eq!(scene.call("k9", &[]).await, StatusCode::CREATED);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 1);
    let stream = scene.stream().await;
    assert_eq!(
        stream.len(),
        2,
        "the second payment's event was dropped: {stream:?}"
    );
    assert_ne!(stream[0].0, stream[1].0);
    assert!(
        stream.iter().all(|(id, _)| id.contains("-1-")),
        "{stream:?}"
    );
}

/// An event the broker can never take (larger than its `max_payload`) is
/// set aside, with why; the events before and after it leave once each,
/// and the relay does not publish the ones before it again and again.
#[tokio::test]
async fn an_event_the_broker_refuses_for_good_is_set_aside() {
    let Some(scene) = scene().await else { return };
    let mut tx = IdemTransaction::begin(&scene.store, None)
        .await
        .expect("begin");
    tx.emit("events.orders", "before").expect("emit");
    tx.emit("events.orders", vec![b'x'; 1_100_000])
        .expect("emit");
    tx.emit("events.orders", "after").expect("emit");
    tx.commit().await.expect("commit");
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 3);
    assert_eq!(scene.relay().publish_once().await.expect("publish"), 0);
    let payloads: Vec<String> = scene.stream().await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(payloads, ["before", "after"]);
    let refusal: String = scene
        .read("SELECT refusal FROM idem_records_outbox WHERE refused_at_ms IS NOT NULL")
        .await;
    assert!(refusal.contains("max payload"), "{refusal}");
    let backlog = scene.relay().backlog().await.expect("backlog");
    assert_eq!(backlog.events, 0, "a refused event counted as waiting");
    assert_eq!(backlog.refused, 1, "the set-aside event is not reported");
}

/// A batch that fails leaves marked what the broker acknowledged before
/// the failure: a relay retrying never sends those again.
#[tokio::test]
async fn what_the_broker_acknowledged_before_a_failure_is_marked() {
    let Some(scene) = scene().await else { return };
    let mut tx = IdemTransaction::begin(&scene.store, None)
        .await
        .expect("begin");
    tx.emit("events.orders", "taken").expect("emit");
    tx.emit("nowhere.orders", "no stream takes it")
        .expect("emit");
    tx.emit("events.orders", "held back").expect("emit");
    tx.commit().await.expect("commit");
    assert!(scene.relay().publish_once().await.is_err());
    assert!(scene.relay().publish_once().await.is_err());
    assert_eq!(scene.unpublished().await, 2);
    let payloads: Vec<String> = scene.stream().await.into_iter().map(|(_, p)| p).collect();
    assert_eq!(payloads, ["taken"], "sent again, or sent past the failure");
}

/// A failing relay pauses between tries, doubling, whatever wakes it
/// meanwhile: a commit's notification does not make it retry at once.
/// Each of a dozen commits waits briefly for a try it might set off; the
/// tries stay within what the pauses allow in the time it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_relay_backs_off_whatever_wakes_it() {
    let Some(scene) = scene().await else { return };
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = tries.clone();
    let relay = scene.relay().on_stage(move |stage| {
        let counted = counted.clone();
        async move {
            if matches!(stage, idem_postgres::relay::Stage::Selected { .. }) {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    let running = tokio::spawn(relay.run(std::future::pending()));
    let started = std::time::Instant::now();
    for n in 0..12 {
        let before = tries.load(std::sync::atomic::Ordering::SeqCst);
        let mut tx = IdemTransaction::begin(&scene.store, None)
            .await
            .expect("begin");
        tx.emit("nowhere.orders", format!("{n}")).expect("emit");
        tx.commit().await.expect("commit");
        idem_tests::poll_until(
            Duration::from_millis(300),
            async || tries.load(std::sync::atomic::Ordering::SeqCst),
            |now| *now > before,
        )
        .await;
    }
    let elapsed = started.elapsed();
    running.abort();
    let made = tries.load(std::sync::atomic::Ordering::SeqCst);
    // Tries at 0, 0.1, 0.3, 0.7, 1.5 s, ...: two more than the doublings
    // of 100 ms that fit in the time, and one for the race at the end.
    let doublings = (elapsed.as_secs_f64() / 0.1).log2().ceil().max(0.0) as usize;
    assert!(
        made <= doublings + 3,
        "{made} tries in {elapsed:?}: the pause was cut short"
    );
    assert!(made >= 2, "the relay never retried");
}
