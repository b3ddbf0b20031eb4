//! Store failure (contract section 8): fail closed with 503 by default,
//! within the store timeout; fail open when configured; a full memory
//! store refuses new keys without evicting live records.

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::Duration,
};

use common::*;
use http::{HeaderName, StatusCode};
use idem_core::{
    Cancellation, Completion, Lease, Outcome, Record, Release, Renewal, Reservation,
    ReserveRequest, ScopeHash, Store, StoreError,
};
use idem_layer::{BoxError, IdempotencyLayer, InFlight, TenantFromHeader};
use idem_memory::MemoryStore;
use tower::Layer;

const OK: u8 = 0;
const FAIL: u8 = 1;
const HANG: u8 = 2;
/// Only the next `complete` fails.
const FAIL_NEXT_COMPLETE: u8 = 3;
/// Every `complete` fails; every other call is answered (a store that
/// takes reservations but not the outcome: the background completion
/// cannot land while a retry can take over).
const FAIL_COMPLETES: u8 = 4;
/// Every `renew` fails; every other call is answered (a lease lapses
/// under a running attempt while retries can reserve).
const FAIL_RENEWS: u8 = 5;

/// The memory store behind a switch that makes every call fail or hang,
/// as a crashed or paused backend would.
#[derive(Clone)]
struct Switched {
    inner: MemoryStore,
    mode: Arc<AtomicU8>,
    /// Waiting duplicates: how many wait now; they wait (whatever their
    /// bound) until `changes` wakes them.
    waiting: Arc<AtomicU8>,
    changes: Arc<tokio::sync::Notify>,
    /// Renewals failed at or after this instant (see `FAIL_RENEWS`).
    lapsed_at: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    failed_after_lapse: Arc<AtomicU8>,
    /// Renewals answered.
    renewed: Arc<std::sync::atomic::AtomicUsize>,
}

impl Switched {
    async fn gate(&self) -> Result<(), StoreError> {
        match self.mode.load(Ordering::SeqCst) {
            FAIL => Err(StoreError::unavailable("connection refused")),
            FAIL_NEXT_COMPLETE => Ok(()),
            HANG => std::future::pending().await,
            _ => Ok(()),
        }
    }
}

impl Store for Switched {
    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        self.gate().await?;
        self.inner.reserve(request).await
    }
    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        if self.mode.load(Ordering::SeqCst) == FAIL_RENEWS {
            let lapsed_at = *self.lapsed_at.lock().expect("lock");
            if lapsed_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                self.failed_after_lapse.fetch_add(1, Ordering::SeqCst);
            }
            return Err(StoreError::unavailable("connection reset"));
        }
        self.gate().await?;
        let renewal = self.inner.renew(lease).await;
        self.renewed.fetch_add(1, Ordering::SeqCst);
        renewal
    }
    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        if self
            .mode
            .compare_exchange(FAIL_NEXT_COMPLETE, OK, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return Err(StoreError::unavailable("connection reset"));
        }
        if self.mode.load(Ordering::SeqCst) == FAIL_COMPLETES {
            return Err(StoreError::unavailable("connection reset"));
        }
        self.gate().await?;
        self.inner.complete(lease, outcome).await
    }
    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        self.gate().await?;
        self.inner.release(lease).await
    }
    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        self.gate().await?;
        self.inner.cancel(scope).await
    }
    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        self.gate().await?;
        self.inner.get(scope).await
    }
    async fn changed(&self, _scope: &ScopeHash, _timeout: Duration) {
        let changed = self.changes.notified();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        changed.await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl idem_core::RecordsAdmin for Switched {
    async fn list(&self, query: &idem_core::RecordQuery) -> Result<Vec<Record>, StoreError> {
        self.gate().await?;
        self.inner.list(query).await
    }
    async fn force_release(
        &self,
        scope: &ScopeHash,
    ) -> Result<idem_core::ForceRelease, StoreError> {
        self.gate().await?;
        self.inner.force_release(scope).await
    }
    async fn erase(&self, scope: &ScopeHash) -> Result<idem_core::Erasure, StoreError> {
        self.gate().await?;
        self.inner.erase(scope).await
    }
}

fn switched_layer(store: &Switched) -> IdempotencyLayer<Switched> {
    IdempotencyLayer::new(store.clone())
        .tenant(TenantFromHeader::new(HeaderName::from_static(TENANT)))
        .timing(|t| t.store_timeout(Duration::from_millis(200)))
}

/// A switched store, a probe and a layer with a 600 ms lease: what the
/// tests of lapsed leases start from.
fn leased_600ms() -> (Switched, Probe, IdempotencyLayer<Switched>) {
    let store = switched();
    let layer = switched_layer(&store).timing(|t| t.lease(Duration::from_millis(600)));
    (store, Probe::default(), layer)
}

fn switched() -> Switched {
    Switched {
        inner: MemoryStore::new(),
        mode: Arc::new(AtomicU8::new(OK)),
        waiting: Arc::new(AtomicU8::new(0)),
        changes: Arc::new(tokio::sync::Notify::new()),
        lapsed_at: Arc::default(),
        failed_after_lapse: Arc::new(AtomicU8::new(0)),
        renewed: Arc::default(),
    }
}

/// Waits until a renewal failed 600 ms or more after now: with the
/// attempt seen started (its keeper counts the lease from the start,
/// before), a 600 ms lease has lapsed under it by then.
async fn renewal_failed_past_600ms(store: &Switched) {
    let lapsed_at = tokio::time::Instant::now() + Duration::from_millis(600);
    *store.lapsed_at.lock().expect("lock") = Some(lapsed_at);
    wait_until(
        Duration::from_secs(10),
        "a renewal to fail after the lease",
        async || store.failed_after_lapse.load(Ordering::SeqCst) > 0,
    )
    .await;
}

/// The attempt of `k` started (it waits at the gate) on a store whose
/// renewals fail, and run on until its 600 ms lease lapsed under it: a
/// renewal failed after the lease, as the attempt's keeper counts it from
/// the handler's start (before this saw the handler), would have ended.
/// The store would now let a retry take the lease over.
async fn running_past_its_lease(
    store: &Switched,
    layer: &IdempotencyLayer<Switched>,
    probe: &Probe,
) -> tokio::task::JoinHandle<Answer> {
    store.mode.store(FAIL_RENEWS, Ordering::SeqCst);
    let first = tokio::spawn(send(&layer.layer(inner(probe)), order_at("/slow", "k")));
    wait_calls(probe, 1).await;
    renewal_failed_past_600ms(store).await;
    first
}

/// A retry of an attempt that still runs here after its lease lapsed (its
/// renewals failed) is answered in progress, never let take it over; once
/// the attempt ends, its outcome is recorded and replayed.
#[tokio::test]
async fn a_retry_of_an_attempt_running_past_its_lapsed_lease_is_in_progress() {
    let (store, probe, layer) = leased_600ms();
    let first = running_past_its_lease(&store, &layer, &probe).await;
    let svc = layer.layer(inner(&probe));
    // A retry that took the lease over would run the handler and wait at
    // its gate: bounded, so that it fails instead.
    let retry = tokio::time::timeout(Duration::from_secs(10), send(&svc, order_at("/slow", "k")))
        .await
        .expect("answered without running the handler");
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.code().as_deref(), Some("idempotency_in_progress"));
    assert_eq!(probe.calls(), 1, "the handler did not run again");
    store.mode.store(OK, Ordering::SeqCst);
    probe.open_gate(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&svc, order_at("/slow", "k")).await;
    assert!(replay.replayed(), "a replay, not a second run");
    assert_eq!(replay.body, first.body);
    assert_eq!(probe.calls(), 1, "the handler ran once");
}

/// A takeover whose attempt fails temporarily frees the key for the same
/// request only. The attempt it took over (still running at another
/// instance, its renewals failing) may have acted: a changed request with
/// the key gets 422 instead of running, and the same request runs again.
#[tokio::test]
async fn after_a_failed_takeover_a_changed_request_conflicts() {
    let (store, probe, layer) = leased_600ms();
    let first = running_past_its_lease(&store, &layer, &probe).await;
    // Another instance: a layer of its own on the same store, whose
    // handler answers 503 (a temporary failure: the key is released).
    let failing = Probe::default();
    let counted = failing.clone();
    let unavailable: Inner = tower::util::BoxCloneSyncService::new(tower::service_fn(
        move |_request: http::Request<http_body_util::Full<bytes::Bytes>>| {
            let n = counted.calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                Ok::<_, BoxError>(
                    http::Response::builder()
                        .status(StatusCode::SERVICE_UNAVAILABLE)
                        .body(http_body_util::Full::new(bytes::Bytes::from(format!(
                            "down, run {n}"
                        ))))
                        .expect("response"),
                )
            }
        },
    ));
    let other = switched_layer(&store).layer(unavailable);
    let takeover = send(&other, order_at("/slow", "k")).await;
    assert_eq!(takeover.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failing.calls(), 1, "the retry took the lapsed lease over");
    let changed = post("/slow")
        .key("k")
        .tenant("t1")
        .json("{\"changed\":true}")
        .build();
    let changed = send(&other, changed).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(failing.calls(), 1, "the changed request did not run");
    let again = send(&other, order_at("/slow", "k")).await;
    assert_eq!(again.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failing.calls(), 2, "the same request runs again");
    // The first attempt ends; its completion is fenced.
    store.mode.store(OK, Ordering::SeqCst);
    probe.open_gate(1);
    tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first attempt ends")
        .expect("join");
    assert_eq!(probe.calls(), 1);
}

/// The same in the in-flight wait mode: the duplicate waits for the
/// attempt running here and replays its outcome.
#[tokio::test]
async fn a_waiting_duplicate_of_an_attempt_running_past_its_lapsed_lease_replays_it() {
    let (store, probe, layer) = leased_600ms();
    let layer = layer.timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = running_past_its_lease(&store, &layer, &probe).await;
    let duplicate = tokio::spawn(send(&layer.layer(inner(&probe)), order_at("/slow", "k")));
    // The test runs on one thread: the duplicate goes as far as it can
    // (to its wait) before the attempt is let go.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // It waits: no answer while the attempt runs.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate answered while the attempt still ran"
    );
    store.mode.store(OK, Ordering::SeqCst);
    probe.open_gate(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    let duplicate = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("answered")
        .expect("join");
    assert!(
        duplicate.replayed(),
        "{:?} {:?}",
        duplicate.status,
        duplicate.code()
    );
    assert_eq!(duplicate.body, first.body);
    assert_eq!(probe.calls(), 1, "the handler ran once");
}

#[tokio::test]
async fn failing_store_answers_503_and_never_runs_the_handler() {
    let store = switched();
    let probe = Probe::default();
    let svc = switched_layer(&store).layer(inner(&probe));
    store.mode.store(FAIL, Ordering::SeqCst);
    let answer = send(&svc, order("k", "{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        answer.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(probe.calls(), 0);
    // Recovers when the store does.
    store.mode.store(OK, Ordering::SeqCst);
    assert_eq!(
        send(&svc, order("k", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(send(&svc, order("k", "{}")).await.replayed());
    assert_eq!(probe.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn hanging_store_times_out_into_503() {
    let store = switched();
    let probe = Probe::default();
    let svc = switched_layer(&store).layer(inner(&probe));
    store.mode.store(HANG, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let answer = send(&svc, order("k", "{}")).await;
    assert_eq!(
        answer.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(200),
        "answered at the store timeout"
    );
    assert_eq!(probe.calls(), 0);
}

#[tokio::test]
async fn fail_open_runs_the_handler_unprotected() {
    let store = switched();
    let probe = Probe::default();
    let svc = switched_layer(&store).fail_open(true).layer(inner(&probe));
    store.mode.store(FAIL, Ordering::SeqCst);
    assert_eq!(
        send(&svc, order("k", "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&svc, order("k", "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        probe.calls(),
        2,
        "without the store, nothing protects the retry"
    );
}

#[tokio::test]
async fn records_api_reports_store_failure() {
    let store = switched();
    let layer = switched_layer(&store);
    store.mode.store(FAIL, Ordering::SeqCst);
    let answer = send(
        &layer.records_service(),
        method(http::Method::GET, "/r?method=POST&path=/orders&key=k")
            .tenant("t1")
            .build(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn full_memory_store_refuses_new_keys_and_keeps_live_records() {
    let store = MemoryStore::builder().capacity(3).build();
    let probe = Probe::default();
    let svc = service(&layer(&store), &probe);
    for key in ["a", "b", "c"] {
        assert_eq!(
            send(&svc, order(key, "{}")).await.status,
            StatusCode::CREATED
        );
    }
    let refused = send(&svc, order("d", "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    let detail: serde_json::Value = serde_json::from_slice(&refused.body).expect("json");
    assert!(
        detail["detail"].as_str().expect("detail").contains("full"),
        "{detail}"
    );
    // Existing records still replay: nothing was evicted.
    for key in ["a", "b", "c"] {
        assert!(
            send(&svc, order(key, "{}")).await.replayed(),
            "{key} still replays"
        );
    }
    assert_eq!(probe.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn full_memory_store_accepts_new_keys_once_records_expire() {
    let store = MemoryStore::builder().capacity(2).build();
    let probe = Probe::default();
    let layer = layer(&store).timing(|t| {
        t.retention(Duration::from_secs(60))
            .lease(Duration::from_secs(5))
    });
    let svc = service(&layer, &probe);
    send(&svc, order("a", "{}")).await;
    send(&svc, order("b", "{}")).await;
    assert_eq!(
        send(&svc, order("c", "{}")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(
        send(&svc, order("c", "{}")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(store.len(), 1, "the expired records were swept");
}

/// The handler ran but recording its outcome failed once: the client gets
/// the real response and the outcome is recorded in the background, so the
/// retry is a replay, not a second execution.
#[tokio::test(start_paused = true)]
async fn a_failed_completion_is_recorded_in_the_background() {
    let store = switched();
    let probe = Probe::default();
    let svc = switched_layer(&store).layer(inner(&probe));
    store.mode.store(FAIL_NEXT_COMPLETE, Ordering::SeqCst);
    let first = send(&svc, order("k", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Until the background completion lands, a retry is told 409.
    let retry = poll_until(
        Duration::from_secs(10),
        async || send(&svc, order("k", "{}")).await,
        |retry| retry.status != StatusCode::CONFLICT,
    )
    .await;
    assert!(retry.replayed(), "{:?} {:?}", retry.status, retry.code());
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.calls(), 1);
}

/// When the store stays down past the lease, the background completion
/// goes on after the lease lapsed: nothing has taken the record over, so
/// the store still takes the attempt's completion once it is back, and the
/// retry is a replay, not a second run. (Before, the background completion
/// gave up when the lease lapsed, and the retry ran the handler again.)
#[tokio::test]
async fn the_background_completion_outlasts_a_lapsed_lease() {
    let (store, probe, layer) = leased_600ms();
    let first = lapsed_with_the_outcome_held(&store, &layer, &probe).await;
    store.mode.store(OK, Ordering::SeqCst);
    replayed_once_landed(&layer, &probe, &first).await;
}

/// The first attempt of `k` answered 201 with the store down, and the
/// store still down well past its 600 ms lease: the lease has lapsed,
/// and the outcome is held in the background alone.
async fn lapsed_with_the_outcome_held(
    store: &Switched,
    layer: &IdempotencyLayer<Switched>,
    probe: &Probe,
) -> Answer {
    let svc = layer.layer(inner(probe));
    let first = tokio::spawn(send(&svc, order_at("/slow", "k")));
    wait_calls(probe, 1).await;
    store.mode.store(FAIL, Ordering::SeqCst);
    probe.open_gate(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    // However long this takes, the lease has lapsed after it, and the
    // background completion's pause has grown to its longest (500 ms).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(layer.background_tasks(), 1, "recording in the background");
    // A retry that ran the handler would not wait at the gate.
    probe.open_gate(1);
    first
}

/// A store that comes back takes over a lapsed lease on the next
/// reservation: the retry that comes first, before the background
/// completion's next try, has that try made at once and replays it.
#[tokio::test]
async fn a_retry_after_a_lapsed_lease_replays_the_outcome_held_here() {
    let (store, probe, layer) = leased_600ms();
    let first = lapsed_with_the_outcome_held(&store, &layer, &probe).await;
    store.mode.store(OK, Ordering::SeqCst);
    let retry = send(&layer.layer(inner(&probe)), order_at("/slow", "k")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.code());
    assert!(retry.replayed(), "a replay, not a second run");
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.calls(), 1, "the handler ran once");
    assert_eq!(layer.background_tasks(), 0);
}

/// While the store takes reservations but not the outcome, a retry that
/// the store would let take over is refused (503), fail-open or not: the
/// action ran. Once the outcome lands, the retry replays it.
#[tokio::test]
async fn a_retry_is_refused_while_the_outcome_held_here_is_not_recorded() {
    let (store, probe, layer) = leased_600ms();
    let layer = layer.fail_open(true);
    let first = lapsed_with_the_outcome_held(&store, &layer, &probe).await;
    store.mode.store(FAIL_COMPLETES, Ordering::SeqCst);
    let svc = layer.layer(inner(&probe));
    let refused = send(&svc, order_at("/slow", "k")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(probe.calls(), 1, "the handler did not run again");
    store.mode.store(OK, Ordering::SeqCst);
    replayed_once_landed(&layer, &probe, &first).await;
}

/// A duplicate that waited through the outage (in-flight wait mode)
/// reserves again as the store comes back: it too is refused while the
/// outcome held here is not recorded, instead of taking over.
#[tokio::test]
async fn a_waiting_duplicate_is_refused_while_the_outcome_held_here_is_not_recorded() {
    let (store, probe, layer) = leased_600ms();
    let layer = layer.timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(60))));
    let svc = layer.layer(inner(&probe));
    let first = tokio::spawn(send(&svc, order_at("/slow", "k")));
    wait_calls(&probe, 1).await;
    let duplicate = tokio::spawn(send(&svc, order_at("/slow", "k")));
    wait_until(
        Duration::from_secs(10),
        "the duplicate to wait",
        async || store.waiting.load(Ordering::SeqCst) == 1,
    )
    .await;
    store.mode.store(FAIL, Ordering::SeqCst);
    probe.open_gate(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED);
    // The lease (600 ms) lapses with the store down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(layer.background_tasks(), 1, "recording in the background");
    store.mode.store(FAIL_COMPLETES, Ordering::SeqCst);
    // A duplicate that ran the handler would not wait at the gate.
    probe.open_gate(1);
    store.changes.notify_waiters();
    let duplicate = duplicate.await.expect("join");
    assert_eq!(duplicate.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(probe.calls(), 1, "the handler did not run again");
    store.mode.store(OK, Ordering::SeqCst);
    replayed_once_landed(&layer, &probe, &first).await;
}

/// Once the background completion has landed, the retry of `k` replays
/// `first`, and the handler has run once.
async fn replayed_once_landed(layer: &IdempotencyLayer<Switched>, probe: &Probe, first: &Answer) {
    wait_until(
        Duration::from_secs(10),
        "the background completion to land",
        async || layer.background_tasks() == 0,
    )
    .await;
    let retry = send(&layer.layer(inner(probe)), order_at("/slow", "k")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "a replay, not a second run");
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.calls(), 1, "the handler ran once");
}

fn order_at(path: &str, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    post(path).key(key).tenant("t1").json("{}").build()
}

/// The same for a command: a redelivery that the store would let take
/// over a lapsed lease gets `Store` (retry later, do not acknowledge)
/// while the outcome held here is not recorded, then its result.
#[tokio::test]
async fn a_redelivery_waits_for_the_command_outcome_held_here() {
    use idem_layer::{ActionError, Command, CommandError, Done};
    let store = switched();
    let layer = switched_layer(&store).timing(|t| t.lease(Duration::from_millis(600)));
    let key = idem_core::IdempotencyKey::parse(b"charge-1").expect("key");
    let command =
        Command::new("shop", "charge", key, &serde_json::json!({"cents": 5})).expect("command");
    let runs = Arc::new(AtomicU8::new(0));
    let charge = || {
        let (runs, mode) = (Arc::clone(&runs), Arc::clone(&store.mode));
        move |_ctx| async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            // The store goes down while the action runs.
            mode.store(FAIL, Ordering::SeqCst);
            Ok::<_, ActionError<String>>(format!("receipt-{run}"))
        }
    };
    let first = layer.run(&command, charge()).await;
    // The action ran, and the caller learns its result is not recorded
    // yet: a consumer must not acknowledge the delivery now.
    let recording = match first {
        Ok(Done::Unrecorded {
            ref value,
            ref recording,
        }) if value == "receipt-1" => recording.clone(),
        other => panic!("expected an unrecorded result: {other:?}"),
    };
    assert!(!recording.is_recorded());
    // The lease (600 ms) lapses with the store down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(layer.background_tasks(), 1, "recording in the background");
    store.mode.store(FAIL_COMPLETES, Ordering::SeqCst);
    let refused = layer.run(&command, charge()).await;
    assert!(
        matches!(refused, Err(CommandError::Store(_))),
        "{refused:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the action did not run again"
    );
    assert!(!recording.is_recorded(), "still not recorded");
    store.mode.store(OK, Ordering::SeqCst);
    let replayed = layer.run(&command, charge()).await;
    assert!(
        matches!(replayed, Ok(Done::Replayed(ref receipt)) if receipt == "receipt-1"),
        "{replayed:?}"
    );
    assert!(
        tokio::time::timeout(Duration::from_secs(10), recording.recorded())
            .await
            .expect("the handle resolves once the store took the result"),
        "recorded, not given up"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran once");
}

/// The same for a command: a redelivery while the action still runs past
/// its lapsed lease gets `InProgress` (retry later), never a second run.
#[tokio::test]
async fn a_redelivery_of_a_command_running_past_its_lapsed_lease_is_in_progress() {
    use idem_layer::{ActionError, Command, CommandError, Done};
    let store = switched();
    store.mode.store(FAIL_RENEWS, Ordering::SeqCst);
    let layer = switched_layer(&store).timing(|t| t.lease(Duration::from_millis(600)));
    let key = idem_core::IdempotencyKey::parse(b"charge-2").expect("key");
    let command =
        Command::new("shop", "charge", key, &serde_json::json!({"cents": 7})).expect("command");
    let runs = Arc::new(AtomicU8::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let charge = || {
        let (runs, go) = (Arc::clone(&runs), Arc::clone(&go));
        move |_ctx| async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            go.notified().await;
            Ok::<_, ActionError<String>>(format!("receipt-{run}"))
        }
    };
    let first = tokio::spawn({
        let (layer, command, action) = (layer.clone(), command.clone(), charge());
        async move { layer.run(&command, action).await }
    });
    wait_until(Duration::from_secs(10), "the action to start", async || {
        runs.load(Ordering::SeqCst) == 1
    })
    .await;
    renewal_failed_past_600ms(&store).await;
    let again = tokio::time::timeout(Duration::from_secs(10), layer.run(&command, charge()))
        .await
        .expect("answered without running the action");
    assert!(
        matches!(again, Err(CommandError::InProgress { .. })),
        "{again:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the action did not run again"
    );
    store.mode.store(OK, Ordering::SeqCst);
    go.notify_waiters();
    let first = first.await.expect("join");
    assert!(
        matches!(first, Ok(Done::Ran(ref receipt)) if receipt == "receipt-1"),
        "{first:?}"
    );
    let replayed = layer.run(&command, charge()).await;
    assert!(
        matches!(replayed, Ok(Done::Replayed(ref receipt)) if receipt == "receipt-1"),
        "{replayed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran once");
}

/// An attempt whose lease lapsed renews it as soon as the store answers
/// one of the layer's reservations (the store is back), not after its
/// pause: a retry that reaches another instance then finds the lease held
/// again. (Paused time: "as soon as" is with the clock standing still.)
#[tokio::test(start_paused = true)]
async fn a_lapsed_lease_is_renewed_as_soon_as_the_store_answers_a_reservation() {
    let (store, probe, layer) = leased_600ms();
    let first = running_past_its_lease(&store, &layer, &probe).await;
    // Long enough for the keeper's pause to have grown to its longest.
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.mode.store(OK, Ordering::SeqCst);
    let (renewed, at) = (
        store.renewed.load(Ordering::SeqCst),
        tokio::time::Instant::now(),
    );
    let other = send(&layer.layer(inner(&probe)), order_at("/orders", "other")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(at.elapsed(), Duration::ZERO, "the clock stood still");
    assert!(
        store.renewed.load(Ordering::SeqCst) > renewed,
        "renewed at once"
    );
    probe.open_gate(1);
    assert_eq!(first.await.expect("join").status, StatusCode::CREATED);
}
