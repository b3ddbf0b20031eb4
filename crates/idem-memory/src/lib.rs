//! The embedded default store for idem: in-process, sharded, bounded and
//! lease-aware.
//!
//! * **Sharded.** Records live in 64 independently locked shards (by the
//!   scope hash), so there is no global lock on the request path.
//! * **Bounded.** [`MemoryStoreBuilder::capacity`] caps the live records
//!   (default 1,000,000). When the cap is reached and nothing has expired, a
//!   new reservation fails with [`StoreError::Full`] (the layer answers
//!   `503 idempotency_store_unavailable`): a live record is never evicted,
//!   since that would let a retry execute twice.
//! * **Incremental expiry.** Each shard keeps a min-heap of expiry times;
//!   every write pops a few expired records, so no sweep stops the world.
//!   An expired record is also invisible to reads the moment it expires.
//! * **Store clock.** Time is read from tokio's clock (`tokio::time::Instant`),
//!   so tests can use `tokio::time::pause` and `advance`.
//! * **Waiting without polling.** [`Store::changed`] wakes waiting
//!   duplicates when the record is completed, released or cancelled.
//!
//! Records do not survive a restart and are not shared between processes:
//! use `idem-redis` for that.
//!
//! ```
//! use idem_memory::MemoryStore;
//! let store = MemoryStore::builder().capacity(100_000).build();
//! assert_eq!(store.len(), 0);
//! ```

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    hash::{BuildHasherDefault, Hasher},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use idem_core::{
    AttemptId, Cancellation, Completion, Lease, Outcome, OwnerToken, Record, RecordState, Release,
    Renewal, Reservation, ReserveRequest, ScopeHash, Store, StoreError, machine,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, futures::OwnedNotified};

/// How many expired records one write removes from its shard at most.
const SWEEP_PER_WRITE: usize = 8;

/// Builder for [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    capacity: usize,
    shards: usize,
}

impl MemoryStoreBuilder {
    /// The most live records the store holds (default 1,000,000).
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// The number of shards, rounded up to a power of two (default 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1).next_power_of_two();
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shards = (0..self.shards).map(|_| Shard::default()).collect();
        let now = tokio::time::Instant::now();
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                mask: self.shards - 1,
                capacity: self.capacity,
                len: AtomicUsize::new(0),
                base: now,
                base_ms,
            }),
        }
    }
}

/// The in-process store. Cheap to clone: clones share the records.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Shard]>,
    mask: usize,
    capacity: usize,
    len: AtomicUsize,
    base: tokio::time::Instant,
    base_ms: u64,
}

/// The scope hash is already uniform: use its first eight bytes.
#[derive(Default)]
struct ScopeHasher(u64);

impl Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8).take(1) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(word);
        }
    }

    fn write_usize(&mut self, _: usize) {}
}

type Map<V> = HashMap<ScopeHash, V, BuildHasherDefault<ScopeHasher>>;

#[derive(Debug, Default)]
struct Shard {
    state: Mutex<ShardState>,
}

#[derive(Debug, Default)]
struct ShardState {
    /// Boxed, so that growing the map moves pointers, not records; an
    /// `Option` inside, so transitions run on the record in place.
    records: Map<Box<Option<Record>>>,
    expiries: BinaryHeap<Reverse<(u64, ScopeHash)>>,
    waiters: Map<Arc<Notify>>,
}

impl ShardState {
    fn record(&self, scope: &ScopeHash) -> Option<&Record> {
        self.records
            .get(scope)
            .and_then(|slot| slot.as_ref().as_ref())
    }

    /// Removes up to `limit` expired records; returns how many.
    fn sweep(&mut self, now_ms: u64, limit: usize) -> usize {
        let mut removed = 0;
        let mut popped = 0;
        while popped < limit {
            match self.expiries.peek() {
                Some(Reverse((at, _))) if *at <= now_ms => {}
                _ => break,
            }
            let Some(Reverse((_, scope))) = self.expiries.pop() else {
                break;
            };
            popped += 1;
            if self.record(&scope).is_some_and(|r| r.is_expired(now_ms)) {
                self.records.remove(&scope);
                self.wake(&scope);
                removed += 1;
            }
        }
        removed
    }

    fn wake(&mut self, scope: &ScopeHash) {
        if let Some(notify) = self.waiters.remove(scope) {
            notify.notify_waiters();
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store with the default capacity (1,000,000 records) and 64 shards.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set capacity and shard count.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            capacity: 1_000_000,
            shards: 64,
        }
    }

    /// How many records the store holds, including expired ones not yet
    /// swept.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The configured capacity.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    fn now_ms(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.inner.base);
        self.inner
            .base_ms
            .saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
    }

    fn shard(&self, scope: &ScopeHash) -> &Shard {
        let bytes = scope.as_bytes();
        let index = usize::from(bytes[0]) | (usize::from(bytes[1]) << 8);
        &self.inner.shards[index & self.inner.mask]
    }

    /// Runs one transition on a scope's slot under its shard lock, keeping
    /// the record count, the expiry heap and the waiters in step.
    fn with_slot<T>(
        &self,
        scope: &ScopeHash,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        let now_ms = self.now_ms();
        let mut state = self.shard(scope).state.lock();
        let swept = state.sweep(now_ms, SWEEP_PER_WRITE);
        // (state, generation, expiry) before and after, to know whom to wake
        // and whether the expiry heap needs a new entry.
        let facts = |slot: &Option<Record>| {
            slot.as_ref()
                .map(|r| (r.expires_at_ms, r.state, r.generation))
        };
        let (existed, result, before, after) = match state.records.get_mut(scope) {
            Some(slot) => {
                let before = facts(slot);
                let result = apply(slot, now_ms);
                (true, result, before, facts(slot))
            }
            None => {
                let mut slot = None;
                let result = apply(&mut slot, now_ms);
                let after = facts(&slot);
                if slot.is_some() {
                    state.records.insert(*scope, Box::new(slot));
                }
                (false, result, None, after)
            }
        };
        let exists = after.is_some();
        if existed && !exists {
            state.records.remove(scope);
        }
        if before != after {
            state.wake(scope);
        }
        if let Some((expires_at_ms, ..)) = after
            && before.map(|b| b.0) != Some(expires_at_ms)
        {
            state.expiries.push(Reverse((expires_at_ms, *scope)));
        }
        drop(state);
        let len = &self.inner.len;
        match (existed, exists) {
            (false, true) => len.fetch_add(1, Ordering::Relaxed),
            (true, false) => len.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
        if swept > 0 {
            len.fetch_sub(swept, Ordering::Relaxed);
        }
        result
    }

    /// Removes expired records from every shard; used when the store is full.
    fn sweep_all(&self) {
        let now_ms = self.now_ms();
        for shard in &self.inner.shards {
            let swept = shard.state.lock().sweep(now_ms, usize::MAX);
            if swept > 0 {
                self.inner.len.fetch_sub(swept, Ordering::Relaxed);
            }
        }
    }

    /// Registers interest in a scope whose lease is live, under the shard
    /// lock so no change can slip in between: `notify_waiters` wakes every
    /// `Notified` created before it. `None` when there is no live lease to
    /// wait on.
    fn watch(&self, scope: &ScopeHash) -> Option<(OwnedNotified, Duration)> {
        let now_ms = self.now_ms();
        let mut state = self.shard(scope).state.lock();
        let lease_left = match state.record(scope) {
            Some(r) if r.state == RecordState::Processing && r.lease_expires_at_ms > now_ms => {
                Duration::from_millis(r.lease_expires_at_ms - now_ms)
            }
            _ => return None,
        };
        let notify = Arc::clone(state.waiters.entry(*scope).or_default());
        Some((notify.notified_owned(), lease_left))
    }

    fn has_live_record(&self, scope: &ScopeHash) -> bool {
        let now_ms = self.now_ms();
        self.shard(scope)
            .state
            .lock()
            .record(scope)
            .is_some_and(|r| !r.is_expired(now_ms))
    }
}

impl Store for MemoryStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let scope = request.scope.hash();
        if self.len() >= self.inner.capacity && !self.has_live_record(scope) {
            self.sweep_all();
            if self.len() >= self.inner.capacity {
                return Err(StoreError::Full {
                    capacity: self.inner.capacity,
                });
            }
        }
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        Ok(self.with_slot(scope, |slot, now| {
            machine::reserve(slot, request, now, attempt, token)
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        Ok(self.with_slot(&lease.scope, |slot, now| machine::renew(slot, lease, now)))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        Ok(self.with_slot(&lease.scope, |slot, now| {
            machine::complete(slot, lease, outcome, now)
        }))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        Ok(self.with_slot(&lease.scope, |slot, now| machine::release(slot, lease, now)))
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        Ok(self.with_slot(scope, machine::cancel))
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        let now_ms = self.now_ms();
        let state = self.shard(scope).state.lock();
        Ok(state
            .record(scope)
            .filter(|r| !r.is_expired(now_ms))
            .cloned())
    }

    async fn changed(&self, scope: &ScopeHash, timeout: Duration) {
        let Some((notified, lease_left)) = self.watch(scope) else {
            return;
        };
        let _ = tokio::time::timeout(timeout.min(lease_left), notified).await;
        let mut state = self.shard(scope).state.lock();
        if state
            .waiters
            .get(scope)
            .is_some_and(|n| Arc::strong_count(n) == 1)
        {
            state.waiters.remove(scope);
        }
    }
}
