//! The store contract on PostgreSQL: one statement per call on the
//! record's row, the database's clock, idem-core's state machine on the
//! row read `FOR UPDATE`.

use idem_core::IdentityClaim;
use std::time::Duration;

use idem_core::{
    Cancellation, Completion, Erasure, Fleet, ForceRelease, Lease, Outcome, OwnerToken, Record,
    RecordQuery, RecordsAdmin, Release, Renewal, Reservation, ReserveRequest, ScopeHash, Store,
    StoreError, machine,
};

use crate::{PgStore, given_up::GivenUp, on_pool, row, sql::failed};
use sqlx::Row;

impl Store for PgStore {
    /// A handler's transaction on this database completes the record
    /// ([`IdemTransaction`](crate::IdemTransaction)).
    fn completes_in_transactions(&self) -> bool {
        true
    }

    /// Behind a transaction pooler (`PgStoreBuilder::transaction_pooler`),
    /// a call that runs out of time waited in the pooler's queue while the
    /// database was busy: busy, not an outage (a pooler that cannot be
    /// reached refuses the connection at once).
    fn timeout_means_busy(&self) -> bool {
        self.pooled()
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        self.inner.given_up.wait()
    }

    /// Erasures heard through `LISTEN` on a connection of its own (the
    /// first call starts it); `None` behind a transaction pooler, where a
    /// session cannot listen.
    fn erasures(&self) -> Option<idem_core::ErasureFeed> {
        if self.pooled() {
            return None;
        }
        self.inner
            .erasures
            .feed(&self.inner.pool, &self.inner.sql.table)
    }

    fn background_tasks(&self) -> usize {
        self.inner.given_up.len()
    }

    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        self.classified(async {
            let attempt = idem_core::AttemptId::new();
            let token = OwnerToken::new();
            let conn = self.inner.pool.acquire().await.map_err(failed)?;
            // From here a statement may reach the server: given up (dropped)
            // before its answer, the guard frees what it may have reserved.
            let mut guard = GivenUp {
                store: self.clone(),
                conn: None,
                scope: *request.scope.hash(),
                attempt,
                token,
                within: request.lease,
            };
            let conn = guard.conn.insert(conn);
            let answer = self.reserve_on(conn, request, attempt, token).await;
            // Answered: the caller owns what it reserved. An error leaves the
            // guard armed: whatever landed before it is freed.
            if answer.is_ok() {
                guard.conn = None;
            }
            answer
        })
        .await
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        self.classified(async {
            let ttl = row::ms(u64::try_from(lease.ttl.as_millis()).unwrap_or(u64::MAX));
            let query = sqlx::query(&self.inner.sql.renew)
                .bind(lease.scope.as_bytes().to_vec())
                .bind(row::ms(lease.generation))
                .bind(lease.token.0)
                .bind(ttl);
            if self.fenced_write(query).await? {
                return Ok(Renewal::Renewed);
            }
            self.transition(&lease.scope, |slot, now_ms| {
                machine::renew(slot, lease, now_ms)
            })
            .await
        })
        .await
    }

    async fn mark_unknown(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        self.classified(async {
            self.transition(&lease.scope, |slot, now_ms| {
                machine::mark_unknown(slot, lease, now_ms)
            })
            .await
        })
        .await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        self.classified(async {
            if self
                .fenced_write(self.complete_query(lease, outcome))
                .await?
            {
                return Ok(Completion::Recorded);
            }
            self.transition(&lease.scope, |slot, now_ms| {
                machine::complete(slot, lease, outcome, now_ms)
            })
            .await
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        self.classified(async {
            self.transition(&lease.scope, |slot, now_ms| {
                machine::release(slot, lease, now_ms)
            })
            .await
        })
        .await
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        self.classified(async { self.transition(scope, machine::cancel).await })
            .await
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        self.classified(async {
            let query = sqlx::query(&self.inner.sql.read).bind(scope.as_bytes().to_vec());
            let found = on_pool!(self.inner, query, fetch_optional).map_err(failed)?;
            let Some(found) = found else {
                return Ok(None);
            };
            let now: i64 = found.try_get("now_ms").map_err(failed)?;
            let record = row::decode(&found)?;
            Ok((!record.is_expired(u64::try_from(now).unwrap_or(0))).then_some(record))
        })
        .await
    }
}

impl RecordsAdmin for PgStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        self.classified(async {
            let older = query.older_than.map_or(0, |age| {
                row::ms(u64::try_from(age.as_millis()).unwrap_or(u64::MAX))
            });
            let list = sqlx::query(&self.inner.sql.list)
                .bind(query.tenant.as_deref().map(row::stored_tenant))
                .bind(query.state.map(|state| state.as_str()))
                .bind(older)
                .bind(query.lapsed)
                .bind(i64::try_from(query.limit).unwrap_or(i64::MAX))
                .bind(
                    query
                        .after
                        .as_ref()
                        .map(|after| row::ms(after.created_at_ms)),
                )
                .bind(query.after.as_ref().map(|after| after.key.clone()))
                .bind(
                    query
                        .after
                        .as_ref()
                        .map(|after| after.scope.as_bytes().to_vec()),
                );
            let rows = on_pool!(self.inner, list, fetch_all).map_err(failed)?;
            rows.iter().map(row::decode).collect()
        })
        .await
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        self.classified(async { self.transition(scope, machine::force_release).await })
            .await
    }

    async fn erase(&self, scope: &ScopeHash) -> Result<Erasure, StoreError> {
        self.classified(async { self.transition(scope, machine::erase).await })
            .await
    }
}

impl Fleet for PgStore {
    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        PgStore::claim_identity(self, marker, ttl, replace)
    }

    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        PgStore::claim_duty(self, duty, holder, ttl)
    }
}
