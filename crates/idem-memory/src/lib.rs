//! The embedded default store for idem: in-process, sharded, bounded and
//! lease-aware.
//!
//! * **Sharded.** Records live in 64 independently locked shards (by the
//!   scope hash), so there is no global lock on the request path.
//! * **Bounded.** [`MemoryStoreBuilder::capacity`] caps the live records
//!   (default 1,000,000; released records do not count) and
//!   [`MemoryStoreBuilder::max_bytes`] their estimated bytes (default
//!   1 GiB). When either is reached and nothing has expired, a new
//!   reservation fails with [`StoreError::Full`], whose `retry_after` is the
//!   time until the earliest record expires (the layer answers
//!   `503 idempotency_store_unavailable` with that `Retry-After`): a live
//!   record is never evicted, since that would let a retry execute twice.
//! * **Fair.** [`MemoryStoreBuilder::tenant_quota`] caps the live records
//!   of each tenant, so one caller cannot fill the store for everyone: a
//!   tenant at its quota gets [`StoreError::QuotaExceeded`] (`429
//!   idempotency_quota_exceeded` from the layer) while others go on.
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
    AttemptId, Cancellation, Completion, Fleet, ForceRelease, IdentityClaim, Lease, OldestRecords,
    Outcome, OwnerToken, Record, RecordQuery, RecordState, RecordsAdmin, Release, Renewal,
    Reservation, ReserveRequest, ScopeHash, Store, StoreError, machine,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, futures::OwnedNotified};

/// How many expired records one write removes from its shard at most.
const SWEEP_PER_WRITE: usize = 8;

/// How many expired records a full store removes from each shard at most
/// before it refuses a new key.
const FULL_SWEEP_PER_SHARD: usize = 64;

/// Builder for [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    capacity: usize,
    max_bytes: usize,
    tenant_quota: Option<usize>,
    shards: usize,
}

impl MemoryStoreBuilder {
    /// The most live records the store holds (default 1,000,000). Released
    /// records (the key is free again) do not count.
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// The most bytes the records may take, as the store estimates them
    /// (default 1 GiB): stored bodies and headers (64 bytes a header
    /// besides its name and value), the tenant, operation and key, 72
    /// bytes an attempt, and 640 bytes per record for the rest, at least
    /// what the records take on the heap (a record of a UUID key and a
    /// small JSON response with two headers takes about 940 bytes,
    /// counting 16 bytes of allocator overhead per block; the estimate
    /// says about 1,060). A new key beyond it is refused like a full store; a
    /// completion whose response would cross it is recorded without the
    /// response (its retries get `409 idempotency_response_not_stored`), so
    /// the action is never run twice and the bound holds. The check is made
    /// before the shard is locked: completions racing on different shards
    /// can each pass it and cross the bound by their responses together.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The most live records one tenant may hold (default: no quota beyond
    /// the capacity). A tenant at its quota gets
    /// [`StoreError::QuotaExceeded`] (`429` from the layer) for new keys;
    /// other tenants are not affected.
    pub fn tenant_quota(mut self, quota: Option<usize>) -> Self {
        self.tenant_quota = quota;
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
                max_bytes: self.max_bytes,
                bytes: AtomicUsize::new(0),
                tenant_quota: self.tenant_quota,
                tenants: (0..TENANT_SHARDS).map(|_| Mutex::default()).collect(),
                tenant_hasher: std::collections::hash_map::RandomState::new(),
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
    /// Live records that count against the capacity (not released ones).
    len: AtomicUsize,
    max_bytes: usize,
    /// The estimated bytes of every record held.
    bytes: AtomicUsize,
    tenant_quota: Option<usize>,
    /// Live records per tenant (by a keyed hash of the tenant), sharded;
    /// kept only under a tenant quota.
    tenants: Box<[Mutex<HashMap<u64, TenantCount>>]>,
    tenant_hasher: std::collections::hash_map::RandomState,
    base: tokio::time::Instant,
    base_ms: u64,
}

/// How many locks the per-tenant counts are spread over.
const TENANT_SHARDS: usize = 16;

/// What the store estimates one record takes besides its variable parts
/// (its scope's texts, its attempts, its response): the boxed record, its
/// share of the table and of the expiry heap (up to two entries, at
/// twice their size while the heap grows), the blocks of a stored
/// response, and a typical allocator's 16 bytes or so on each of its
/// eight blocks. `tests/footprint.rs` counts what records ask of the
/// allocator and holds the estimate above it.
const RECORD_OVERHEAD: usize = 640;

/// What the store estimates each stored header takes besides its bytes
/// (its entry in the response's header list).
const HEADER_OVERHEAD: usize = 64;

#[derive(Debug, Default, Clone, Copy)]
struct TenantCount {
    records: usize,
    /// The earliest expiry of the tenant's records, as far as known: set
    /// when a record is made, cleared when the tenant holds none.
    earliest_expiry_ms: u64,
}

/// The estimated bytes of a stored outcome.
fn outcome_weight(outcome: &Outcome) -> usize {
    match outcome {
        Outcome::NotStored { .. } => 0,
        Outcome::Stored(response) => {
            response.body.len()
                + response
                    .headers
                    .iter()
                    .map(|(name, value)| HEADER_OVERHEAD + name.as_str().len() + value.len())
                    .sum::<usize>()
        }
    }
}

/// The estimated bytes of a record without its response: the fixed
/// part, its scope's texts (`texts` bytes) and room for `attempts`
/// attempts.
fn base_weight(texts: usize, attempts: usize) -> usize {
    RECORD_OVERHEAD + texts + attempts * std::mem::size_of::<idem_core::Attempt>()
}

/// The estimated bytes of a record.
fn weight_of(r: &Record) -> usize {
    base_weight(
        r.tenant.len() + r.operation.len() + r.key.len(),
        r.attempts.capacity(),
    ) + r.outcome.as_ref().map_or(0, outcome_weight)
}

/// The estimated bytes of the record a reservation makes: what the byte
/// bound must have room for before it is made.
fn new_weight(request: &ReserveRequest) -> usize {
    let scope = &request.scope;
    base_weight(
        scope.tenant().len() + scope.operation().len() + scope.key().as_str().len(),
        1,
    )
}

/// The estimated bytes of a slot.
fn weight(slot: &Option<Record>) -> usize {
    slot.as_ref().map_or(0, weight_of)
}

/// Whether a record takes a place in the capacity and its tenant's quota:
/// every record but a released one (its key is free again).
fn occupies(slot: &Option<Record>) -> bool {
    slot.as_ref()
        .is_some_and(|r| r.state != RecordState::Released)
}

/// Why a new record was refused.
enum Refused {
    Full,
    Quota(Duration),
}

/// At least a second: the shortest `Retry-After` a client is told.
fn at_least_a_second(ms: u64) -> Duration {
    Duration::from_millis(ms).max(Duration::from_secs(1))
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

/// A shard's records, found by the scope each record holds: an entry is
/// one pointer, not the scope hash again beside it (32 bytes less per
/// record, before the table's spare room).
/// One shard's records, found by a keyed hash of their scope hash.
#[derive(Default)]
struct Records {
    /// Each slot beside its scope's hash under the table's key: growing
    /// the table rehashes from the hashes it keeps, without reading every
    /// record (one cache miss each on a large store), and a lookup reads
    /// a record only when the whole hash matches.
    table: hashbrown::HashTable<Slot>,
    /// Keyed at random per table: a caller who can compute scope hashes
    /// (they are unkeyed unless the layer has a scope secret) still cannot
    /// pick keys whose records share one bucket and lengthen every lookup
    /// in it, nor learn where a record sits. foldhash's seeded mix of one
    /// word (a folded multiply) is enough for that and costs a fraction of
    /// SipHash: the table never shows its hashes.
    hasher: foldhash::quality::RandomState,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("len", &self.table.len())
            .finish()
    }
}

/// A scope's first eight bytes: what the table hashes, and what an entry
/// of the expiry heap keeps of the scope.
fn scope_prefix(scope: &ScopeHash) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&scope.as_bytes()[..8]);
    u64::from_le_bytes(word)
}

/// The table's hash of a scope prefix, under the table's key.
fn prefix_hash(hasher: &foldhash::quality::RandomState, prefix: u64) -> u64 {
    use std::hash::BuildHasher;
    hasher.hash_one(prefix)
}

/// The table's hash of a scope: its first eight bytes under the table's
/// key.
fn scope_hash(hasher: &foldhash::quality::RandomState, scope: &ScopeHash) -> u64 {
    prefix_hash(hasher, scope_prefix(scope))
}

/// A record's place in the table: the table's hash of its scope and the
/// box that holds it.
struct Slot {
    hash: u64,
    record: Box<Option<Record>>,
}

/// The scope a slot holds; an emptied slot (only ever the one being
/// changed, under the shard's lock) holds none.
fn slot_scope(slot: &Option<Record>) -> Option<&ScopeHash> {
    slot.as_ref().map(|record| &record.scope)
}

impl Records {
    fn get(&self, scope: &ScopeHash) -> Option<&Option<Record>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record) == Some(scope)
            })
            .map(|slot| &*slot.record)
    }

    fn get_mut(&mut self, scope: &ScopeHash) -> Option<&mut Option<Record>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find_mut(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record) == Some(scope)
            })
            .map(|slot| &mut *slot.record)
    }

    #[cfg(test)]
    fn insert(&mut self, record: Record) {
        self.insert_slot(Box::new(Some(record)));
    }

    /// Adds a slot that holds a record; an empty one is dropped.
    fn insert_slot(&mut self, record: Box<Option<Record>>) {
        let Some(held) = &*record else { return };
        let hash = scope_hash(&self.hasher, &held.scope);
        self.table
            .insert_unique(hash, Slot { hash, record }, |slot| slot.hash);
    }

    /// Removes a record whose scope begins with `prefix` and that has
    /// expired at `now_ms`, if there is one.
    fn remove_expired(&mut self, prefix: u64, now_ms: u64) -> Option<Record> {
        let hash = prefix_hash(&self.hasher, prefix);
        self.table
            .find_entry(hash, |slot| {
                slot.hash == hash
                    && (*slot.record).as_ref().is_some_and(|record| {
                        scope_prefix(&record.scope) == prefix && record.is_expired(now_ms)
                    })
            })
            .ok()
            .and_then(|entry| *entry.remove().0.record)
    }

    /// Removes the record of `scope`, or the emptied slot that held it.
    fn remove(&mut self, scope: &ScopeHash) -> Option<Box<Option<Record>>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find_entry(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record).is_none_or(|held| held == scope)
            })
            .ok()
            .map(|entry| entry.remove().0.record)
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn values(&self) -> impl Iterator<Item = &Option<Record>> {
        self.table.iter().map(|slot| &*slot.record)
    }
}

#[derive(Debug, Default)]
struct Shard {
    state: Mutex<ShardState>,
}

#[derive(Debug, Default)]
struct ShardState {
    /// Boxed, so that growing the map moves pointers, not records; an
    /// `Option` inside, so transitions run on the record in place.
    records: Records,
    /// When records expire, earliest first, each with its scope's first
    /// eight bytes (16 bytes an entry, not the 40 a whole scope takes):
    /// an entry removes an expired record of that prefix, and which one
    /// does not matter. Two scopes of one prefix (rare, or made on
    /// purpose by a caller who can compute unkeyed scope hashes) are each
    /// removed once expired, by either one's entry; an entry whose record
    /// was renewed, completed anew or already removed finds none.
    expiries: BinaryHeap<Reverse<(u64, u64)>>,
    waiters: Map<Arc<Notify>>,
}

impl ShardState {
    fn record(&self, scope: &ScopeHash) -> Option<&Record> {
        self.records.get(scope).and_then(|slot| slot.as_ref())
    }

    /// Removes up to `limit` expired records, handing each to `removed`
    /// (for the store's counts); returns how many.
    fn sweep(&mut self, now_ms: u64, limit: usize, gone: &mut impl FnMut(&Record)) -> usize {
        let mut removed = 0;
        let mut popped = 0;
        while popped < limit {
            match self.expiries.peek() {
                Some(Reverse((at, _))) if *at <= now_ms => {}
                _ => break,
            }
            let Some(Reverse((_, prefix))) = self.expiries.pop() else {
                break;
            };
            popped += 1;
            if let Some(record) = self.records.remove_expired(prefix, now_ms) {
                gone(&record);
                self.wake(&record.scope);
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
    fn push_expiry(&mut self, at_ms: u64, scope: &ScopeHash) {
        self.expiries.push(Reverse((at_ms, scope_prefix(scope))));
        if self.expiries.len() > 2 * self.records.len() + 16 {
            self.expiries = self
                .records
                .values()
                .filter_map(|slot| {
                    slot.as_ref()
                        .map(|r| Reverse((r.expires_at_ms, scope_prefix(&r.scope))))
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
            max_bytes: 1 << 30,
            tenant_quota: None,
            shards: 64,
        }
    }

    /// How many live records count against the capacity: every record but
    /// released ones, including expired ones not yet swept.
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

    /// Whether the store keeps per-tenant counts: only for a quota.
    fn counts_tenants(&self) -> bool {
        self.inner.tenant_quota.is_some()
    }

    fn tenant_key(&self, tenant: &str) -> u64 {
        use std::hash::BuildHasher;
        self.inner.tenant_hasher.hash_one(tenant)
    }

    fn tenant_shard(&self, key: u64) -> &Mutex<HashMap<u64, TenantCount>> {
        // The low bits pick the map's bucket; use high ones for the shard.
        &self.inner.tenants[(key >> 58) as usize % TENANT_SHARDS]
    }

    /// Takes a place for a new live record of `tenant`: in the capacity,
    /// within the byte bound, and in the tenant's quota, atomically
    /// against other reservations.
    /// `tenant` is `None` when the store keeps no per-tenant counts;
    /// `weight` is the estimate of the record the reservation makes.
    fn take_place(&self, tenant: Option<u64>, weight: usize, now_ms: u64) -> Result<(), Refused> {
        let inner = &*self.inner;
        if inner.bytes.load(Ordering::Relaxed) + weight > inner.max_bytes {
            return Err(Refused::Full);
        }
        let capacity = inner.capacity;
        inner
            .len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < capacity).then_some(n + 1)
            })
            .map_err(|_| Refused::Full)?;
        let Some(tenant) = tenant else {
            return Ok(());
        };
        let mut tenants = self.tenant_shard(tenant).lock();
        let count = tenants.entry(tenant).or_default();
        if let Some(quota) = inner.tenant_quota
            && count.records >= quota
        {
            let wait = count.earliest_expiry_ms.saturating_sub(now_ms);
            drop(tenants);
            inner.len.fetch_sub(1, Ordering::Relaxed);
            return Err(Refused::Quota(at_least_a_second(wait)));
        }
        count.records += 1;
        Ok(())
    }

    /// Gives a place back (the record was released, expired or dropped).
    fn give_place(&self, tenant: Option<u64>) {
        self.inner.len.fetch_sub(1, Ordering::Relaxed);
        let Some(tenant) = tenant else {
            return;
        };
        let mut tenants = self.tenant_shard(tenant).lock();
        if let Some(count) = tenants.get_mut(&tenant) {
            count.records = count.records.saturating_sub(1);
            if count.records == 0 {
                tenants.remove(&tenant);
            }
        }
    }

    /// Notes a new record's expiry as its tenant's earliest, if earlier.
    fn note_expiry(&self, tenant: u64, expires_at_ms: u64) {
        let mut tenants = self.tenant_shard(tenant).lock();
        if let Some(count) = tenants.get_mut(&tenant)
            && (count.earliest_expiry_ms == 0 || expires_at_ms < count.earliest_expiry_ms)
        {
            count.earliest_expiry_ms = expires_at_ms;
        }
    }

    /// Counts a record leaving the store (swept).
    fn forget(&self, record: &Record) {
        self.inner
            .bytes
            .fetch_sub(weight_of(record), Ordering::Relaxed);
        if record.state != RecordState::Released {
            self.give_place(
                self.counts_tenants()
                    .then(|| self.tenant_key(&record.tenant)),
            );
        }
    }

    /// Runs one transition on a scope's slot under its shard lock, keeping
    /// the counts (live records, bytes, per-tenant records), the expiry heap
    /// and the waiters in step. A reservation on a slot that holds no live
    /// record (absent, or released) takes a place first, atomically against
    /// the capacity, the byte bound and its tenant's quota, and is refused
    /// (`Err`) without running when there is none. A transition that ends a
    /// live record (release, expiry) gives its place back.
    fn with_slot<T>(
        &self,
        scope: &ScopeHash,
        reserving_for: Option<&ReserveRequest>,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> Result<T, Refused> {
        let now_ms = self.now_ms();
        let mut state = self.shard(scope).state.lock();
        state.sweep(now_ms, SWEEP_PER_WRITE, &mut |record| self.forget(record));
        // (expiry, state, generation, held) before and after, to know whom
        // to wake and whether the expiry heap needs a new entry. A release
        // after a takeover leaves the record processing but held by nobody:
        // its waiters wake to take it over.
        let facts = |slot: &Option<Record>| {
            slot.as_ref()
                .map(|r| (r.expires_at_ms, r.state, r.generation, r.owner.is_some()))
        };
        // A vacant scope's record is made in the box the table keeps (the
        // record is not moved into it afterwards).
        let mut vacant: Option<Box<Option<Record>>> = None;
        let (existed, slot): (bool, &mut Option<Record>) = match state.records.get_mut(scope) {
            Some(slot) => (true, slot),
            None => (false, vacant.insert(Box::new(None))),
        };
        let (before, before_weight, before_live) = (facts(slot), weight(slot), occupies(slot));
        let took = reserving_for.is_some() && !before_live;
        // The tenant's counts are touched only when a place is taken or
        // given back, so its key is hashed only then: before the transition
        // when it takes a place, or when an expired record is about to leave
        // the slot with its tenant; otherwise from the record left after it.
        // A store without a tenant quota keeps no per-tenant counts and
        // hashes no tenant.
        let counted = self.counts_tenants();
        let leaving = before_live && slot.as_ref().is_some_and(|r| r.is_expired(now_ms));
        let early = match (took, slot.as_ref(), reserving_for) {
            _ if !counted => None,
            (true, Some(record), _) => Some(self.tenant_key(&record.tenant)),
            (true, None, Some(request)) => Some(self.tenant_key(request.scope.tenant())),
            (false, Some(record), _) if leaving => Some(self.tenant_key(&record.tenant)),
            _ => None,
        };
        if let (true, Some(request)) = (took, reserving_for) {
            self.take_place(early, new_weight(request), now_ms)?;
        }
        let result = apply(slot, now_ms);
        let (after, after_weight, after_live) = (facts(slot), weight(slot), occupies(slot));
        let tenant = || {
            early
                .or_else(|| slot.as_ref().map(|r| self.tenant_key(&r.tenant)))
                .unwrap_or(0)
        };
        // Only a reservation makes a record live, and it took a place above.
        if (before_live || took) && !after_live {
            self.give_place(counted.then(tenant));
        }
        if counted
            && took
            && let Some((expires_at_ms, ..)) = after
        {
            self.note_expiry(tenant(), expires_at_ms);
        }
        let bytes = &self.inner.bytes;
        if after_weight > before_weight {
            bytes.fetch_add(after_weight - before_weight, Ordering::Relaxed);
        } else if before_weight > after_weight {
            bytes.fetch_sub(before_weight - after_weight, Ordering::Relaxed);
        }
        match (existed, vacant.take()) {
            (true, _) if after.is_none() => {
                state.records.remove(scope);
            }
            (false, Some(slot)) => state.records.insert_slot(slot),
            _ => {}
        }
        if before != after {
            state.wake(scope);
        }
        if let Some((expires_at_ms, ..)) = after
            && before.map(|b| b.0) != Some(expires_at_ms)
        {
            state.push_expiry(expires_at_ms, scope);
        }
        Ok(result)
    }

    /// A transition that never makes a record live, so never meets a bound.
    fn with_existing<T>(
        &self,
        scope: &ScopeHash,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        let mut apply = Some(apply);
        match self.with_slot(scope, None, |slot, now| {
            apply.take().map(|apply| apply(slot, now))
        }) {
            Ok(Some(result)) => result,
            // `with_slot` refuses only reservations, and runs `apply` once.
            _ => unreachable!("a transition without a reservation is never refused"),
        }
    }

    /// Removes expired records from every shard, a bounded number from
    /// each (so a full store never stops the world to sweep); used when the
    /// store is full.
    fn sweep_all(&self) {
        let now_ms = self.now_ms();
        for shard in &self.inner.shards {
            shard
                .state
                .lock()
                .sweep(now_ms, FULL_SWEEP_PER_SHARD, &mut |record| {
                    self.forget(record);
                });
        }
    }

    /// When the earliest record the store knows of expires, from now.
    fn earliest_expiry(&self) -> Duration {
        let now_ms = self.now_ms();
        let earliest = self
            .inner
            .shards
            .iter()
            .filter_map(|shard| {
                let state = shard.state.lock();
                state.expiries.peek().map(|Reverse((at, _))| *at)
            })
            .min()
            .unwrap_or(now_ms);
        at_least_a_second(earliest.saturating_sub(now_ms))
    }

    /// The estimated bytes the records take (see
    /// [`MemoryStoreBuilder::max_bytes`]).
    pub fn bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// The byte bound.
    pub fn max_bytes(&self) -> usize {
        self.inner.max_bytes
    }

    /// Whether a new key would be refused for want of room right now (the
    /// capacity is reached, or the byte bound has no room for the smallest
    /// record), before expired records are swept. For health checks and
    /// gauges.
    pub fn is_full(&self) -> bool {
        self.len() >= self.inner.capacity || self.bytes() + base_weight(0, 1) > self.inner.max_bytes
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
        let reserving = Some(request);
        // The ids are made under the slot's lock, and only when an attempt
        // starts (a replay makes none).
        let ids = || (AttemptId::new(), OwnerToken::new());
        let reserve =
            |slot: &mut Option<Record>, now| machine::reserve_with(slot, request, now, ids);
        let refused = match self.with_slot(scope, reserving, reserve) {
            Ok(reservation) => return Ok(reservation),
            Err(refused) => refused,
        };
        if let Refused::Full = refused {
            // Make room from expired records, then try once more.
            self.sweep_all();
        }
        self.with_slot(scope, reserving, reserve)
            .map_err(|refused| match refused {
                Refused::Full => StoreError::Full {
                    capacity: self.inner.capacity,
                    retry_after: self.earliest_expiry(),
                },
                Refused::Quota(retry_after) => StoreError::QuotaExceeded {
                    quota: self.inner.tenant_quota.unwrap_or(usize::MAX),
                    retry_after,
                },
            })
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        Ok(self.with_existing(&lease.scope, |slot, now| machine::renew(slot, lease, now)))
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        // A response that would cross the byte bound is recorded without
        // its bytes: the action ran and must not run again, but the bound
        // holds.
        let fits = self.bytes() + outcome_weight(outcome) <= self.inner.max_bytes;
        let not_stored;
        let outcome = if fits {
            outcome
        } else {
            tracing::warn!(
                status = outcome.status(),
                "the memory store is at its byte bound; the outcome is recorded without its response"
            );
            not_stored = Outcome::NotStored {
                status: outcome.status(),
            };
            &not_stored
        };
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

impl RecordsAdmin for MemoryStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let now_ms = self.now_ms();
        // Only records that are among the oldest so far are cloned: a
        // listing holds no more than its answer, however full the store.
        let mut found = OldestRecords::new(query.limit);
        for shard in &self.inner.shards {
            {
                let state = shard.state.lock();
                for record in state.records.values().filter_map(|slot| slot.as_ref()) {
                    if found.wants(record.created_at_ms, &record.key)
                        && query.matches(record, now_ms)
                    {
                        found.offer(record.clone());
                    }
                }
            }
            // A full store takes tens of milliseconds to read (80 ms for
            // a million records): the thread serves other requests between
            // shards instead of holding them all up for the whole listing
            // (the gateway counts lapsed records this way every 5 s).
            tokio::task::yield_now().await;
        }
        Ok(found.into_oldest_first())
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        Ok(self.with_existing(scope, machine::force_release))
    }
}

/// The records live in this process only: no other instance can find
/// them, so the store is this instance's own whatever its identity, and
/// every instance does its own chores.
impl Fleet for MemoryStore {
    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (duty, holder, ttl);
        std::future::ready(Ok(true))
    }

    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        let _ = (marker, ttl, replace);
        std::future::ready(Ok(IdentityClaim::Held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table's hash of a scope is keyed per table: two tables place one
    /// scope apart, and neither at the bucket its raw bytes would name,
    /// so scopes chosen for their hash bytes do not pile into one bucket.
    #[test]
    fn table_hashes_are_keyed() {
        let (one, other) = (Records::default(), Records::default());
        let scope = ScopeHash::from_bytes([0xa5; 32]);
        let raw = u64::from_le_bytes([0xa5; 8]);
        let hashes = [
            scope_hash(&one.hasher, &scope),
            scope_hash(&other.hasher, &scope),
        ];
        assert_ne!(hashes[0], hashes[1]);
        assert!(!hashes.contains(&raw));
        // Scopes alike in the bytes a shard and a bucket were taken from
        // still spread: 256 scopes sharing their first 8 bytes' low 16
        // bits land on many of 64 buckets.
        let buckets: std::collections::HashSet<u64> = (0..=255u8)
            .map(|i| {
                let mut bytes = [0u8; 32];
                bytes[2] = i;
                scope_hash(&one.hasher, &ScopeHash::from_bytes(bytes)) & 63
            })
            .collect();
        assert!(buckets.len() > 32, "{} buckets", buckets.len());
    }

    /// A reservation of `key` for `tenant`.
    fn request(tenant: &str, key: &str) -> ReserveRequest {
        ReserveRequest {
            scope: idem_core::Scope::new(
                tenant,
                "POST /orders",
                idem_core::IdempotencyKey::parse(key.as_bytes()).expect("key"),
            ),
            fingerprint: idem_core::Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
        }
    }

    /// A record expiring at `expires_at_ms` under `scope`.
    fn record_under(scope: [u8; 32], key: &str, expires_at_ms: u64) -> Record {
        let request = request("tenant", key);
        let mut slot = None;
        let _ = machine::reserve(&mut slot, &request, 0, AttemptId::new(), OwnerToken::new());
        let mut record = slot.expect("a record");
        record.scope = ScopeHash::from_bytes(scope);
        record.expires_at_ms = expires_at_ms;
        record
    }

    /// An expiry heap entry keeps a scope's first eight bytes only: of two
    /// records sharing them, each is removed once it has expired, by
    /// either entry, and never before.
    #[test]
    fn records_sharing_a_scope_prefix_expire_each_in_its_time() {
        let mut state = ShardState::default();
        let (mut early, mut late) = ([9u8; 32], [9u8; 32]);
        early[31] = 1;
        late[31] = 2;
        for record in [
            record_under(early, "early", 100),
            record_under(late, "late", 200),
        ] {
            let (at, scope) = (record.expires_at_ms, record.scope);
            state.records.insert(record);
            state.push_expiry(at, &scope);
        }
        let mut gone = Vec::new();
        assert_eq!(
            state.sweep(150, 8, &mut |r| gone.push(r.key.to_string())),
            1
        );
        assert_eq!(gone, ["early"]);
        assert!(state.record(&ScopeHash::from_bytes(late)).is_some());
        assert_eq!(
            state.sweep(250, 8, &mut |r| gone.push(r.key.to_string())),
            1
        );
        assert_eq!(gone, ["early", "late"]);
        assert_eq!(state.records.len(), 0);
        // An entry whose record was renewed past it removes nothing.
        state.records.insert(record_under(early, "early", 300));
        state.push_expiry(50, &ScopeHash::from_bytes(early));
        assert_eq!(
            state.sweep(120, 8, &mut |r| gone.push(r.key.to_string())),
            0
        );
        assert_eq!(state.records.len(), 1);
        state.records.remove(&ScopeHash::from_bytes(early));
        // The later record's entry surfacing first (it was renewed past the
        // other) removes the one that expired, not the live one.
        for record in [
            record_under(early, "early", 300),
            record_under(late, "late", 100),
        ] {
            let (at, scope) = (record.expires_at_ms, record.scope);
            state.records.insert(record);
            state.push_expiry(at, &scope);
        }
        state.push_expiry(50, &ScopeHash::from_bytes(early));
        gone.clear();
        assert_eq!(
            state.sweep(120, 1, &mut |r| gone.push(r.key.to_string())),
            1
        );
        assert_eq!(gone, ["late"]);
        assert!(state.record(&ScopeHash::from_bytes(early)).is_some());
    }

    /// A stored header's estimate covers its entry in the header list.
    #[test]
    fn a_header_estimate_covers_its_entry() {
        assert!(HEADER_OVERHEAD >= std::mem::size_of::<(idem_core::HeaderName, ::bytes::Bytes)>());
    }

    /// A new key needs room for its whole record in the byte bound (its
    /// key, tenant and operation, its attempt), not only the fixed part:
    /// the bound holds exactly.
    #[tokio::test]
    async fn a_new_key_needs_room_for_its_whole_record() {
        let request = request("a-tenant-of-some-length", "a-key-of-some-length-too");
        let needed = new_weight(&request);
        assert!(needed > RECORD_OVERHEAD + 50);
        let tight = MemoryStore::builder().max_bytes(needed - 1).build();
        assert!(matches!(
            tight.reserve(&request).await,
            Err(StoreError::Full { .. })
        ));
        assert_eq!(tight.bytes(), 0);
        assert!(!tight.is_full(), "a smaller key would fit");
        let enough = MemoryStore::builder().max_bytes(needed).build();
        assert!(matches!(
            enough.reserve(&request).await,
            Ok(Reservation::Acquired(_))
        ));
        assert_eq!(enough.bytes(), needed);
        assert!(enough.is_full(), "no room for even the smallest record");
        // Room for the fixed part of a record but not for its attempt:
        // full, as a new key would be refused.
        let almost = MemoryStore::builder()
            .max_bytes(needed + RECORD_OVERHEAD + 1)
            .build();
        assert!(matches!(
            almost.reserve(&request).await,
            Ok(Reservation::Acquired(_))
        ));
        assert!(almost.is_full());
    }

    /// A transition that finds its record expired (before the bounded
    /// sweep of a write got to it) removes the record's slot from the
    /// shard's table: the emptied slot is not left behind as an entry of
    /// its own, and the scope can be reserved again.
    #[tokio::test(start_paused = true)]
    async fn an_expired_record_leaves_no_slot_behind() {
        let store = MemoryStore::builder().shards(1).build();
        let slots =
            |store: &MemoryStore| -> usize { store.inner.shards[0].state.lock().records.len() };
        // More records expire before the last one than a write sweeps.
        for n in 0..SWEEP_PER_WRITE * 2 {
            let earlier = request("tenant", &format!("earlier-{n}"));
            assert!(matches!(
                store.reserve(&earlier).await,
                Ok(Reservation::Acquired(_))
            ));
        }
        tokio::time::advance(Duration::from_millis(5)).await;
        let last = request("tenant", "last");
        let Ok(Reservation::Acquired(lease)) = store.reserve(&last).await else {
            panic!("a new key was not acquired");
        };
        assert_eq!(slots(&store), SWEEP_PER_WRITE * 2 + 1);
        tokio::time::advance(last.retention + Duration::from_secs(1)).await;
        // The release's sweep removes the earliest expired records; the
        // release itself finds the last one expired and empties its slot.
        let released = store.release(&lease).await.expect("release");
        assert!(matches!(released, Release::Fenced(_)), "{released:?}");
        assert_eq!(slots(&store), SWEEP_PER_WRITE);
        assert!(store.get(last.scope.hash()).await.expect("get").is_none());
        assert!(matches!(
            store.reserve(&last).await,
            Ok(Reservation::Acquired(_))
        ));
    }
}
