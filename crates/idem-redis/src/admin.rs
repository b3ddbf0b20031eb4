//! The records API on Redis ([`RecordsAdmin`]): listings, the lapsed
//! records' count, and an operator's acts on one record.

use idem_core::{
    Erasure, ForceRelease, OldestRecords, Record, RecordQuery, RecordState, RecordsAdmin,
    ScopeHash, StoreError,
};

use crate::{
    RedisStore, decode::*, errors::corrupt, invocation::Invocation, keys::record_key_pieces,
    pool::Pool,
};

/// How many record reads [`RecordsAdmin::list`](idem_core::RecordsAdmin::list) keeps in
/// flight at once.
const LIST_READS_AT_ONCE: usize = 32;

/// How many keys one call of the lapsed-records count asks `SCAN` for
/// (`count_lapsed.lua`): each call holds Redis for its page (about 5 µs a
/// key on a small machine, the `SCAN` included), so a call stays under a
/// millisecond.
const COUNT_LAPSED_PAGE: usize = 100;

/// An operator's act on one record (force release, erasure): the kind
/// its script answered, and the record when it sent one.
async fn operator_act(
    store: &RedisStore,
    script: &redis::Script,
    scope: &ScopeHash,
) -> Result<(String, Option<Record>), StoreError> {
    let invocation = Invocation::on_record(script, &store.prefix, scope);
    operator_reply(store, invocation, scope).await
}

/// The kind and the record an operator's script answered.
async fn operator_reply(
    store: &RedisStore,
    invocation: Invocation<'_>,
    scope: &ScopeHash,
) -> Result<(String, Option<Record>), StoreError> {
    let reply = items(store.run(invocation, false).await?.0)?;
    let Some((kind, pairs)) = reply.split_first() else {
        return Err(corrupt("an operator's script answered nothing"));
    };
    let record = if pairs.is_empty() {
        None
    } else {
        Some(decode_record(*scope, pairs)?)
    };
    Ok((text(kind)?, record))
}

impl RecordsAdmin for RedisStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let clock: Vec<u64> = self.command(redis::cmd("TIME")).await?;
        let now_ms = match clock.as_slice() {
            [secs, micros] => secs * 1000 + micros / 1000,
            _ => return Err(corrupt("TIME answered oddly")),
        };
        use futures_util::TryStreamExt;
        // A query that only processing records can match reads the others'
        // state alone (most records are completed).
        let only_processing = query.lapsed || query.state == Some(RecordState::Processing);
        // A tenant's listing reads other tenants' records no further than
        // their tenant: as the 'tenant' field holds it (every record before
        // the binary form, and every tenant without one), and as
        // 'tenant_bin' does.
        let binary = query
            .tenant
            .as_deref()
            .map(|tenant| match encode_tenant(tenant) {
                ("tenant_bin", binary) => binary,
                _ => Vec::new(),
            });
        let tenant = query.tenant.as_deref().zip(binary.as_deref());
        // The reads share the connection, LIST_READS_AT_ONCE in flight:
        // Redis takes them in batches instead of one round trip each.
        // Only the oldest matches so far are kept: a listing holds no more
        // than its answer and a page of keys, however many records it
        // reads.
        let found = self
            .record_scopes()
            .map_ok(|page| futures_util::stream::iter(page.into_iter().map(Ok)))
            .try_flatten()
            .map_ok(|scope| async move { self.read(&scope, only_processing, tenant).await })
            .try_buffer_unordered(LIST_READS_AT_ONCE)
            .try_fold(OldestRecords::new(query.limit), |mut found, record| {
                if let Some(record) = record.filter(|record| query.matches(record, now_ms)) {
                    found.offer(record);
                }
                std::future::ready(Ok(found))
            })
            .await?;
        Ok(found.into_oldest_first())
    }

    /// Counted inside Redis on a single node: `SCAN` pages of record keys,
    /// each read by `count_lapsed.lua` where it lives, so a record's fields
    /// never cross the network and the count costs Redis about a third of
    /// reading each record out (see the README's lapsed-records gauge). A
    /// key `SCAN` names twice (a table Redis resized during the count) is
    /// counted twice. On a cluster (whose scripts may touch only the keys
    /// they name) the lapsed records are listed and counted.
    async fn count_lapsed(&self, limit: usize) -> Result<usize, StoreError> {
        if matches!(self.pool, Pool::Cluster(_)) {
            let listed = self.list(&RecordQuery::stuck(limit)).await?;
            return Ok(listed.len());
        }
        let pattern = self.record_pattern();
        let key_length: usize = record_key_pieces(&self.prefix, &[0; 64])
            .iter()
            .map(|piece| piece.len())
            .sum();
        let (mut cursor, mut count) = (0u64, 0usize);
        loop {
            let mut invocation = Invocation::new(&self.scripts.count_lapsed, &[]);
            invocation
                .arg(cursor)
                .arg(&pattern)
                .arg(COUNT_LAPSED_PAGE)
                .arg(key_length);
            let reply = items(self.run(invocation, false).await?.0)?;
            let [next, lapsed] = reply.as_slice() else {
                return Err(corrupt("lapsed count answered oddly"));
            };
            count = count.saturating_add(usize::try_from(int(lapsed)?).unwrap_or(usize::MAX));
            cursor = int(next)?;
            if cursor == 0 || count >= limit {
                return Ok(count.min(limit));
            }
        }
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        let (kind, record) = operator_act(self, &self.scripts.force_release, scope).await?;
        Ok(match (kind.as_str(), record) {
            ("released", Some(record)) => ForceRelease::Released(record),
            ("not_processing", Some(record)) => ForceRelease::NotProcessing(record),
            _ => ForceRelease::NotFound,
        })
    }

    async fn erase(&self, scope: &ScopeHash) -> Result<Erasure, StoreError> {
        // The erasure is published, in the script, to every process's
        // replay cache (`erasures.rs`).
        let mut invocation = Invocation::on_record(&self.scripts.erase, &self.prefix, scope);
        let hex = scope.hex_bytes();
        invocation
            .arg(crate::erasures::channel(&self.prefix))
            .arg(&hex[..]);
        let (kind, record) = operator_reply(self, invocation, scope).await?;
        Ok(match (kind.as_str(), record) {
            ("erased", Some(record)) => Erasure::Erased(record),
            ("processing", Some(record)) => Erasure::Processing(record),
            _ => Erasure::NotFound,
        })
    }
}
