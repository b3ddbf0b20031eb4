//! The memory store's builder: capacity, bytes, tenant quotas.

use std::sync::{Arc, atomic::AtomicUsize};

use parking_lot::Mutex;

use crate::{Inner, MemoryStore, TENANT_SHARDS, shard::Shard};

/// Builder for [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    pub(crate) capacity: usize,
    pub(crate) max_bytes: usize,
    pub(crate) tenant_quota: Option<usize>,
    pub(crate) shards: usize,
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
    /// [`StoreError::QuotaExceeded`](idem_core::StoreError::QuotaExceeded) (`429` from the layer) for new keys;
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
        let base_ms = idem_core::unix_ms();
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
                erasures: idem_core::ErasureFeed::local(),
            }),
        }
    }
}
