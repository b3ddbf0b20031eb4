//! Outcomes this layer holds but has not recorded yet: completions that
//! hit a store error and are retried in the background (see
//! `record_later` in `attempt.rs`), by scope.
//!
//! Once an attempt's lease has lapsed with the store down, nothing in the
//! store stands between a retry and a takeover, only the background
//! completion's next try. A retry that reaches this layer first would run
//! the action a second time. So a reservation of a scope listed here
//! first has the completion tried at once and waits for that try: once it
//! is recorded the reservation replays it; if the store still does not
//! take it, the request is answered `503 idempotency_store_unavailable`
//! (fail-open or not: the action ran). And every reservation the store
//! answers while completions are pending has them all tried at once (at
//! most every 100 ms), so
//! a store that comes back takes them before most retries arrive, also
//! those that reach another instance.
//!
//! The same holds while an attempt still runs here whose lease lapsed
//! because its renewals failed (the store was down): the store would let
//! a retry take it over and run the action beside the running one. Such
//! an attempt is listed as running until its outcome is recorded or handed
//! to a background completion, and a reservation of its scope is answered
//! as in progress (`409`, or a wait in the in-flight wait mode).
//!
//! Cost on the request path while nothing is pending: one atomic load.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{ScopeHash, StoreError};
use tokio::sync::Notify;

/// The background completions of one layer (shared by its clones).
pub(crate) struct Pending {
    /// How many are registered: the request path reads only this while
    /// it is zero.
    count: AtomicUsize,
    entries: Mutex<HashMap<ScopeHash, Arc<Entry>>>,
    /// The store answered a reservation: every pending completion tries
    /// again at once.
    answered: Notify,
    /// When `answered` last woke them (milliseconds since `epoch`): at
    /// most once per [`WAKE_EVERY`], or a store that takes reservations
    /// but refuses completions would get a try of every pending
    /// completion per request.
    woken_at: AtomicU64,
    epoch: tokio::time::Instant,
}

/// The least time between two wake-ups of every pending completion.
const WAKE_EVERY: Duration = Duration::from_millis(100);

impl Default for Pending {
    fn default() -> Self {
        Self {
            count: AtomicUsize::new(0),
            entries: Mutex::default(),
            answered: Notify::new(),
            woken_at: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
        }
    }
}

/// Why a reservation of a scope waits for what this layer holds of it.
#[derive(Debug)]
pub(crate) enum Held {
    /// An attempt runs here whose lease lapsed while the store was down:
    /// in progress.
    Running,
    /// An outcome the store did not take, even when tried again now: the
    /// store is unavailable for this key.
    Unrecorded(StoreError),
}

/// One background completion, or one running attempt whose lease lapsed.
#[derive(Default)]
struct Entry {
    /// A running attempt (no outcome yet: nothing to try).
    running: bool,
    /// A reservation of its scope wants a try now.
    nudge: Notify,
    /// A try ended (recorded or not), or the completion gave up.
    tried: Notify,
    /// Recorded (or given up: nothing more will come of it).
    done: AtomicBool,
    /// The store took the outcome (or answered that a newer attempt owns
    /// the record): `done` and not given up.
    recorded: AtomicBool,
}

/// A background completion's place in [`Pending`], removed when dropped
/// (the completion recorded, was fenced, or gave up).
pub(crate) struct Registration {
    pending: Arc<Pending>,
    scope: ScopeHash,
    entry: Arc<Entry>,
}

impl Pending {
    /// Lists a background completion of `scope`. A newer entry of the
    /// same scope replaces an older one in the list (the older keeps
    /// trying).
    pub(crate) fn register(self: &Arc<Self>, scope: ScopeHash) -> Registration {
        self.enter(scope, false)
    }

    /// Lists an attempt of `scope` that runs on after its lease lapsed.
    pub(crate) fn register_running(self: &Arc<Self>, scope: ScopeHash) -> Registration {
        self.enter(scope, true)
    }

    fn enter(self: &Arc<Self>, scope: ScopeHash, running: bool) -> Registration {
        let entry = Arc::new(Entry {
            running,
            ..Entry::default()
        });
        self.lock().insert(scope, Arc::clone(&entry));
        self.count.fetch_add(1, Ordering::AcqRel);
        if !running {
            crate::metrics::outcomes_pending(1.0);
        }
        Registration {
            pending: Arc::clone(self),
            scope,
            entry,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopeHash, Arc<Entry>>> {
        // A panic while the map was locked left it whole (each use is one
        // map call): the map is used as it is.
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether any completion is pending (then a reservation asks
    /// [`settled`](Self::settled) first).
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// Before a reservation of `scope`: `Err` with what this layer holds
    /// of it. An unrecorded outcome is tried at once, and this waits for
    /// that try (within `bound`): `Ok` once it recorded.
    pub(crate) async fn settled(&self, scope: &ScopeHash, bound: Duration) -> Result<(), Held> {
        if !self.any() {
            return Ok(());
        }
        let Some(entry) = self.lock().get(scope).cloned() else {
            return Ok(());
        };
        // Made before the nudge: a try that ends after it wakes it.
        let tried = entry.tried.notified();
        if entry.done.load(Ordering::Acquire) {
            return Ok(());
        }
        if entry.running {
            return Err(Held::Running);
        }
        entry.nudge.notify_one();
        let _ = tokio::time::timeout(bound, tried).await;
        if entry.done.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(Held::Unrecorded(StoreError::unavailable(
            "an earlier attempt with this key ran, and the store has not taken its outcome yet",
        )))
    }

    /// Waits, at most `bound`, until what this layer holds of `scope`
    /// changes (a running attempt ended, or handed its outcome on).
    pub(crate) async fn changed(&self, scope: &ScopeHash, bound: Duration) {
        let Some(entry) = self.lock().get(scope).cloned() else {
            return;
        };
        let tried = entry.tried.notified();
        if entry.done.load(Ordering::Acquire) {
            return;
        }
        let _ = tokio::time::timeout(bound, tried).await;
    }

    /// The store answered a reservation: pending completions try now
    /// (unless they were woken less than [`WAKE_EVERY`] ago).
    #[inline]
    pub(crate) fn store_answered(&self) {
        if self.count.load(Ordering::Relaxed) > 0 {
            self.wake_all();
        }
    }

    fn wake_all(&self) {
        // Counted from 1: the first wake-up is never held back.
        let now = u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last = self.woken_at.load(Ordering::Acquire);
        let due = last == 0 || now.saturating_sub(last) >= WAKE_EVERY.as_millis() as u64;
        if due
            && self
                .woken_at
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.answered.notify_waiters();
        }
    }

    /// Waits until `deadline`, or less: until the store answers a
    /// reservation (see [`store_answered`](Self::store_answered)). What
    /// an attempt whose lease lapsed waits with before its next renewal.
    pub(crate) async fn until_answered(&self, deadline: tokio::time::Instant) {
        let answered = self.answered.notified();
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {}
            () = answered => {}
        }
    }

    /// What this layer still holds of `scope`: an outcome (or a release)
    /// the store has not taken yet, as a handle to wait on; `None` when
    /// nothing is held or it was settled.
    pub(crate) fn recording(&self, scope: &ScopeHash) -> Option<Recording> {
        if !self.any() {
            return None;
        }
        let entry = self.lock().get(scope).cloned()?;
        (!entry.running && !entry.done.load(Ordering::Acquire)).then_some(Recording { entry })
    }

    /// How many completions are pending.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// An outcome that ran and is held by the layer until the store takes it
/// (a completion, or a release, that hit a store error and is retried in
/// the background). What a caller that acknowledges work elsewhere (a
/// message broker) waits on before it acknowledges: until the outcome is
/// recorded, a crash of this process would leave the record processing
/// and a redelivery could run the action again once its lease lapsed.
///
/// Clones watch the same outcome; two handles are equal when they do.
#[derive(Clone)]
pub struct Recording {
    entry: Arc<Entry>,
}

impl Recording {
    /// Whether the store has taken the outcome.
    pub fn is_recorded(&self) -> bool {
        self.entry.recorded.load(Ordering::Acquire)
    }

    /// Waits until the store has taken the outcome (`true`), or the layer
    /// gave up on it (`false`: the record's retention passed with the
    /// store unavailable, or the layer was dropped).
    pub async fn recorded(&self) -> bool {
        loop {
            // Made before the check: a try that ends after it wakes it.
            let tried = self.entry.tried.notified();
            if self.entry.done.load(Ordering::Acquire) {
                return self.is_recorded();
            }
            tried.await;
        }
    }
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("recorded", &self.is_recorded())
            .finish()
    }
}

impl PartialEq for Recording {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.entry, &other.entry)
    }
}

impl Eq for Recording {}

impl Registration {
    /// Waits `pause` before the next try, or less: until a reservation of
    /// the scope asks for a try, or the store answers one of any scope.
    pub(crate) async fn pause(&self, pause: Duration) {
        let until = tokio::time::Instant::now() + pause;
        tokio::select! {
            () = self.pending.until_answered(until) => {}
            () = self.entry.nudge.notified() => {}
        }
    }

    /// A try ended; `recorded` when the store took the outcome (or
    /// answered that a newer attempt owns the record).
    pub(crate) fn tried(&self, recorded: bool) {
        if recorded {
            self.entry.recorded.store(true, Ordering::Release);
            self.entry.done.store(true, Ordering::Release);
        }
        self.entry.tried.notify_waiters();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.entry.done.store(true, Ordering::Release);
        {
            let mut entries = self.pending.lock();
            if entries
                .get(&self.scope)
                .is_some_and(|listed| Arc::ptr_eq(listed, &self.entry))
            {
                entries.remove(&self.scope);
            }
        }
        self.pending.count.fetch_sub(1, Ordering::AcqRel);
        if !self.entry.running {
            crate::metrics::outcomes_pending(-1.0);
        }
        self.entry.tried.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(byte: u8) -> ScopeHash {
        ScopeHash::from_bytes([byte; 32])
    }

    #[tokio::test]
    async fn the_gauge_counts_the_held_outcomes() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _guard = metrics::set_default_local_recorder(&recorder);
        let gauge = || {
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .find_map(|(key, _, _, value)| match value {
                    DebugValue::Gauge(value)
                        if key.key().name() == crate::metrics::OUTCOMES_PENDING =>
                    {
                        Some(value.into_inner())
                    }
                    _ => None,
                })
        };
        let pending = Arc::new(Pending::default());
        // Two held, one of them recorded since (the recorder's snapshot
        // takes what was added since the last one: read once).
        let (first, _second) = (pending.register(scope(1)), pending.register(scope(2)));
        drop(first);
        assert_eq!(gauge(), Some(1.0));
    }

    #[tokio::test]
    async fn a_running_attempt_is_held_until_it_ends() {
        let pending = Arc::new(Pending::default());
        let running = pending.register_running(scope(1));
        assert!(matches!(
            pending.settled(&scope(1), Duration::from_secs(10)).await,
            Err(Held::Running)
        ));
        let ended = tokio::spawn({
            let pending = Arc::clone(&pending);
            async move { pending.changed(&scope(1), Duration::from_secs(3600)).await }
        });
        tokio::task::yield_now().await;
        drop(running);
        ended.await.expect("join");
        assert!(
            pending
                .settled(&scope(1), Duration::from_secs(10))
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn an_unlisted_scope_is_settled_at_once() {
        let pending = Arc::new(Pending::default());
        assert!(
            pending
                .settled(&scope(1), Duration::from_secs(10))
                .await
                .is_ok()
        );
        let _listed = pending.register(scope(2));
        assert!(
            pending
                .settled(&scope(1), Duration::from_secs(10))
                .await
                .is_ok()
        );
    }

    /// A background completion whose only try comes when nudged (its
    /// pause is far longer than the test), recording or not.
    fn tries_when_nudged(
        registration: Registration,
        recorded: bool,
    ) -> tokio::task::JoinHandle<Registration> {
        tokio::spawn(async move {
            registration.pause(Duration::from_secs(3600)).await;
            registration.tried(recorded);
            registration
        })
    }

    #[tokio::test]
    async fn a_nudged_try_that_records_settles_the_scope() {
        let pending = Arc::new(Pending::default());
        let task = tries_when_nudged(pending.register(scope(1)), true);
        assert!(
            pending
                .settled(&scope(1), Duration::from_secs(10))
                .await
                .is_ok()
        );
        drop(task.await.expect("join"));
        assert_eq!(pending.len(), 0);
        assert!(pending.lock().is_empty());
    }

    #[tokio::test]
    async fn a_nudged_try_that_fails_leaves_the_scope_unsettled() {
        let pending = Arc::new(Pending::default());
        let task = tries_when_nudged(pending.register(scope(1)), false);
        assert!(matches!(
            pending.settled(&scope(1), Duration::from_secs(10)).await,
            Err(Held::Unrecorded(_))
        ));
        let registration = task.await.expect("join");
        assert_eq!(pending.len(), 1);
        drop(registration);
        assert!(
            pending
                .settled(&scope(1), Duration::from_secs(10))
                .await
                .is_ok()
        );
    }

    /// A pending completion paused for good, as a task.
    fn paused(pending: &Arc<Pending>, byte: u8) -> tokio::task::JoinHandle<()> {
        let registration = pending.register(scope(byte));
        tokio::spawn(async move {
            registration.pause(Duration::from_secs(3600)).await;
        })
    }

    /// Lets the spawned tasks run until they wait.
    async fn settle_tasks() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn answered_reservations_wake_the_pending_at_most_every_100_ms() {
        let pending = Arc::new(Pending::default());
        let first = paused(&pending, 1);
        settle_tasks().await;
        pending.store_answered();
        settle_tasks().await;
        assert!(first.is_finished(), "the first wake-up is at once");
        let second = paused(&pending, 2);
        settle_tasks().await;
        tokio::time::advance(Duration::from_millis(50)).await;
        pending.store_answered();
        settle_tasks().await;
        assert!(!second.is_finished(), "held back within 100 ms");
        tokio::time::advance(Duration::from_millis(50)).await;
        pending.store_answered();
        settle_tasks().await;
        assert!(second.is_finished(), "woken 100 ms after the last");
    }

    #[tokio::test]
    async fn an_answered_reservation_wakes_every_pending_completion() {
        let pending = Arc::new(Pending::default());
        let waits: Vec<_> = (0..3)
            .map(|i| {
                let registration = pending.register(scope(i));
                tokio::spawn(async move {
                    registration.pause(Duration::from_secs(3600)).await;
                })
            })
            .collect();
        // Each waits on the store's answer once it has started to pause.
        tokio::task::yield_now().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for wait in waits {
            while !wait.is_finished() {
                assert!(tokio::time::Instant::now() < deadline, "not woken");
                pending.store_answered();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(pending.len(), 0);
    }
}
