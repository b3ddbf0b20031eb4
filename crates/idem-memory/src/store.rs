//! The store contract in memory: each call one lock of the scope's shard
//! around idem-core's state machine.

use std::{sync::Arc, time::Duration};

use idem_core::{
    AttemptId, Cancellation, Completion, Erasure, Fleet, ForceRelease, IdentityClaim, Lease,
    OldestRecords, Outcome, OwnerToken, Record, RecordQuery, RecordsAdmin, Release, Renewal,
    Reservation, ReserveRequest, ScopeHash, Store, StoreError, machine,
};

use crate::{MemoryStore, Refused, weight::outcome_weight};

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

    /// Every erasure goes through this process: the feed is always healthy.
    fn erasures(&self) -> Option<idem_core::ErasureFeed> {
        Some(self.inner.erasures.clone())
    }

    async fn mark_unknown(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        Ok(self.with_existing(&lease.scope, |slot, now| {
            machine::mark_unknown(slot, lease, now)
        }))
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

    async fn erase(&self, scope: &ScopeHash) -> Result<Erasure, StoreError> {
        Ok(self.erasing(scope))
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
