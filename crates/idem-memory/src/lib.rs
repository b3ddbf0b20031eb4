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

    /// Adds an expiry to the heap. Renewals and new attempts add entries
    /// while older ones stay until they surface, so when the heap holds
    /// twice as many entries as the shard has records it is rebuilt from
    /// the records: the heap stays bounded by the capacity, at an
    /// amortized constant cost per write.
    fn push_expiry(&mut self, at_ms: u64, scope: ScopeHash) {
        self.expiries.push(Reverse((at_ms, scope)));
        if self.expiries.len() > 2 * self.records.len() + 16 {
            self.expiries = self
                .records
                .iter()
                .filter_map(|(scope, slot)| {
                    slot.as_ref()
                        .as_ref()
                        .map(|r| Reverse((r.expires_at_ms, *scope)))
                })
                .collect();
        }
    }

    /// Entries in the expiry heap (for tests of its bound).
    fn expiry_entries(&self) -> usize {
        self.expiries.len()
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

    /// How many duplicates are waiting right now (in-flight wait mode) for a
    /// running attempt's outcome. For tests and gauges.
    pub fn waiting(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|shard| {
                shard
                    .state
                    .lock()
                    .waiters
                    .values()
                    .map(|notify| Arc::strong_count(notify) - 1)
                    .sum::<usize>()
            })
            .sum()
    }

    /// How many entries the expiry heaps hold in all: at most about twice
    /// the records, whatever the number of renewals. For tests and gauges.
    pub fn expiry_entries(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|shard| shard.state.lock().expiry_entries())
            .sum()
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
    /// the record count, the expiry heap and the waiters in step. A
    /// transition on an empty slot takes a place in the count first,
    /// atomically against the capacity, so reservations racing on
    /// different shards never exceed it; with no place left a record the
    /// transition created is dropped and the answer is `Err`. Only
    /// `reserve` creates records; the other transitions leave an empty
    /// slot empty and give the place back.
    fn with_slot<T>(
        &self,
        scope: &ScopeHash,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> Result<T, T> {
        let now_ms = self.now_ms();
        let len = &self.inner.len;
        let mut state = self.shard(scope).state.lock();
        let swept = state.sweep(now_ms, SWEEP_PER_WRITE);
        if swept > 0 {
            len.fetch_sub(swept, Ordering::Relaxed);
        }
        // (state, generation, expiry) before and after, to know whom to wake
        // and whether the expiry heap needs a new entry.
        let facts = |slot: &Option<Record>| {
            slot.as_ref()
                .map(|r| (r.expires_at_ms, r.state, r.generation))
        };
        let (result, before, after) = match state.records.get_mut(scope) {
            Some(slot) => {
                let before = facts(slot);
                let result = apply(slot, now_ms);
                let after = facts(slot);
                if after.is_none() {
                    state.records.remove(scope);
                    len.fetch_sub(1, Ordering::Relaxed);
                }
                (result, before, after)
            }
            None => {
                let capacity = self.inner.capacity;
                let taken = len.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < capacity).then_some(n + 1)
                });
                let mut slot = None;
                if taken.is_err() {
                    // Full: a transition that creates nothing may still run.
                    let result = apply(&mut slot, now_ms);
                    return if slot.is_none() {
                        Ok(result)
                    } else {
                        Err(result)
                    };
                }
                let result = apply(&mut slot, now_ms);
                let after = facts(&slot);
                match slot {
                    Some(record) => {
                        state.records.insert(*scope, Box::new(Some(record)));
                    }
                    None => {
                        len.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                (result, None, after)
            }
        };
        if before != after {
            state.wake(scope);
        }
        if let Some((expires_at_ms, ..)) = after
            && before.map(|b| b.0) != Some(expires_at_ms)
        {
            state.push_expiry(expires_at_ms, *scope);
        }
        Ok(result)
    }

    /// A transition that never creates a record, so never meets the cap.
    fn with_existing<T>(
        &self,
        scope: &ScopeHash,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        self.with_slot(scope, apply).unwrap_or_else(|result| result)
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
}

impl Store for MemoryStore {
    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let scope = request.scope.hash();
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        let reserve =
            |slot: &mut Option<Record>, now| machine::reserve(slot, request, now, attempt, token);
        if let Ok(reservation) = self.with_slot(scope, reserve) {
            return Ok(reservation);
        }
        // Full: make room from expired records, then try once more.
        self.sweep_all();
        self.with_slot(scope, reserve)
            .map_err(|_| StoreError::Full {
                capacity: self.inner.capacity,
            })
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        Ok(self.with_existing(&lease.scope, |slot, now| machine::renew(slot, lease, now)))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        Ok(self.with_existing(&lease.scope, |slot, now| {
            machine::complete(slot, lease, outcome, now)
        }))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        Ok(self.with_existing(&lease.scope, |slot, now| machine::release(slot, lease, now)))
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        Ok(self.with_existing(scope, machine::cancel))
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
