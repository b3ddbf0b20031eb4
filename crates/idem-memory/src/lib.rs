//! The embedded default store for idem: in-process, sharded, bounded and
//! lease-aware.
//!
//! * **Sharded.** Records live in 64 independently locked shards (by the
//!   scope hash), so there is no global lock on the request path.
//! * **Bounded.** [`MemoryStoreBuilder::capacity`] caps the live records
//!   (default 1,000,000; released records do not count) and
//!   [`MemoryStoreBuilder::max_bytes`] their estimated bytes (default
//!   1 GiB). When either is reached and nothing has expired, a new
//!   reservation fails with [`StoreError::Full`](idem_core::StoreError::Full), whose `retry_after` is the
//!   time until the earliest record expires (the layer answers
//!   `503 idempotency_store_unavailable` with that `Retry-After`): a live
//!   record is never evicted, since that would let a retry execute twice.
//! * **Fair.** [`MemoryStoreBuilder::tenant_quota`] caps the live records
//!   of each tenant, so one caller cannot fill the store for everyone: a
//!   tenant at its quota gets [`StoreError::QuotaExceeded`](idem_core::StoreError::QuotaExceeded) (`429
//!   idempotency_quota_exceeded` from the layer) while others go on.
//! * **Incremental expiry.** Each shard keeps a min-heap of expiry times;
//!   every write pops a few expired records, so no sweep stops the world.
//!   An expired record is also invisible to reads the moment it expires.
//! * **Store clock.** Time is read from tokio's clock (`tokio::time::Instant`),
//!   so tests can use `tokio::time::pause` and `advance`.
//! * **Waiting without polling.** [`Store::changed`](idem_core::Store::changed) wakes waiting
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

// The examples in the docs compile without a warning (an unused import
// in a guide is a defect a reader would copy); a snippet's binding or
// helper that nothing after it uses is not one.
#![doc(test(attr(deny(warnings), allow(dead_code, unused_variables))))]

use std::{
    cmp::Reverse,
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{Record, RecordState, ReserveRequest, ScopeHash};
use parking_lot::Mutex;
use tokio::sync::futures::OwnedNotified;

mod builder;
mod shard;
mod store;
mod weight;

pub use builder::MemoryStoreBuilder;
use shard::*;
use weight::*;

/// How many expired records one write removes from its shard at most.
const SWEEP_PER_WRITE: usize = 8;

/// How many expired records a full store removes from each shard at most
/// before it refuses a new key.
const FULL_SWEEP_PER_SHARD: usize = 64;

/// The in-process store. Cheap to clone: clones share the records.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) shards: Box<[Shard]>,
    pub(crate) mask: usize,
    pub(crate) capacity: usize,
    /// Live records that count against the capacity (not released ones).
    pub(crate) len: AtomicUsize,
    pub(crate) max_bytes: usize,
    /// The estimated bytes of every record held.
    pub(crate) bytes: AtomicUsize,
    pub(crate) tenant_quota: Option<usize>,
    /// Live records per tenant (by a keyed hash of the tenant), sharded;
    /// kept only under a tenant quota.
    pub(crate) tenants: Box<[Mutex<HashMap<u64, TenantCount>>]>,
    pub(crate) tenant_hasher: std::collections::hash_map::RandomState,
    pub(crate) base: tokio::time::Instant,
    pub(crate) base_ms: u64,
    /// Erasures, for the replay caches of every layer on this store.
    pub(crate) erasures: idem_core::ErasureFeed,
}

/// How many locks the per-tenant counts are spread over.
pub(crate) const TENANT_SHARDS: usize = 16;

#[derive(Debug, Default, Clone, Copy)]
struct TenantCount {
    records: usize,
    /// The earliest expiry of the tenant's records, as far as known: set
    /// when a record is made, cleared when the tenant holds none.
    earliest_expiry_ms: u64,
}

/// Why a new record was refused.
pub(crate) enum Refused {
    Full,
    Quota(Duration),
}

/// At least a second: the shortest `Retry-After` a client is told.
fn at_least_a_second(ms: u64) -> Duration {
    Duration::from_millis(ms).max(Duration::from_secs(1))
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
        self.with_slot_removing(scope, reserving_for, false, apply)
    }

    /// An operator's erasure: the record leaves its slot, and its place
    /// (and its tenant's) is given back.
    pub(crate) fn erasing(&self, scope: &ScopeHash) -> idem_core::Erasure {
        let erasure = self.with_existing_removing(scope, true, idem_core::machine::erase);
        if matches!(erasure, idem_core::Erasure::Erased(_)) {
            self.inner.erasures.erased(*scope);
        }
        erasure
    }

    /// [`with_slot`](Self::with_slot); `removing` when `apply` may empty a
    /// live slot (the tenant's count is then taken from the record before).
    fn with_slot_removing<T>(
        &self,
        scope: &ScopeHash,
        reserving_for: Option<&ReserveRequest>,
        removing: bool,
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
            (false, Some(record), _) if leaving || (removing && before_live) => {
                Some(self.tenant_key(&record.tenant))
            }
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
        self.with_existing_removing(scope, false, apply)
    }

    /// [`with_existing`](Self::with_existing); `removing` as
    /// [`with_slot_removing`](Self::with_slot_removing) takes it.
    fn with_existing_removing<T>(
        &self,
        scope: &ScopeHash,
        removing: bool,
        apply: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        let mut apply = Some(apply);
        match self.with_slot_removing(scope, None, removing, |slot, now| {
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

#[cfg(test)]
mod tests {
    use idem_core::{AttemptId, OwnerToken, Release, Reservation, Store, StoreError, machine};

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
