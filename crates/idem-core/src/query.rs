//! Which records a listing answers, and how a store keeps the oldest of
//! them while it scans.

use std::time::Duration;

use crate::{Record, RecordState, ScopeHash};

/// Which records [`RecordsAdmin::list`](crate::RecordsAdmin::list) answers, oldest first (then by key).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordQuery {
    /// Only this tenant's records (`None`: every tenant, for operators).
    pub tenant: Option<String>,
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records created at least this long ago (store clock).
    pub older_than: Option<Duration>,
    /// Only processing records whose lease has lapsed (stuck: nobody
    /// renews them and nobody took them over yet).
    pub lapsed: bool,
    /// At most this many records (0: none).
    pub limit: usize,
    /// Only records after this one in the listing's order (oldest first:
    /// by creation, then key, then scope): the next page of a listing
    /// whose last record was `after` ([`RecordCursor::after`]).
    pub after: Option<RecordCursor>,
}

/// Where a listing's page ended: the next page lists the records after it
/// in the listing's order (oldest first, by creation time, then key, then
/// scope), so a caller pages past records it keeps (an erase past the
/// processing records it must leave) without reading them again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordCursor {
    /// The record's creation time (store clock, Unix ms).
    pub created_at_ms: u64,
    /// Its key.
    pub key: String,
    /// Its scope.
    pub scope: ScopeHash,
}

impl RecordCursor {
    /// The cursor after `record`.
    pub fn after(record: &Record) -> Self {
        Self {
            created_at_ms: record.created_at_ms,
            key: record.key.to_string(),
            scope: record.scope,
        }
    }

    /// Whether `record` comes after the cursor in the listing's order.
    pub fn precedes(&self, record: &Record) -> bool {
        (record.created_at_ms, &*record.key, record.scope)
            > (self.created_at_ms, self.key.as_str(), self.scope)
    }
}

impl RecordQuery {
    /// Every tenant's processing records whose lease lapsed (stuck), at
    /// most `limit`: what [`RecordsAdmin::count_lapsed`](crate::RecordsAdmin::count_lapsed) counts.
    pub fn stuck(limit: usize) -> Self {
        Self {
            lapsed: true,
            limit,
            ..Self::default()
        }
    }

    /// Whether `record` is one the query asks for, at `now_ms`.
    pub fn matches(&self, record: &Record, now_ms: u64) -> bool {
        let older = self.older_than.is_none_or(|age| {
            let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            now_ms.saturating_sub(record.created_at_ms) >= age
        });
        !record.is_expired(now_ms)
            && self.tenant.as_ref().is_none_or(|t| **t == *record.tenant)
            && self.state.is_none_or(|s| s == record.state)
            && older
            && self
                .after
                .as_ref()
                .is_none_or(|after| after.precedes(record))
            && (!self.lapsed
                || (record.state == RecordState::Processing
                    && record.lease_expires_at_ms <= now_ms))
    }
}

/// The oldest records of a listing, kept while the store is scanned: it
/// holds at most `limit` records at any time, so a listing over a large
/// store holds no more than its answer. Oldest means created first; records
/// created in the same millisecond go by key. A record offered again (a
/// Redis `SCAN` may name a key twice) is kept once.
#[derive(Debug)]
pub struct OldestRecords {
    limit: usize,
    /// The newest kept record on top.
    kept: std::collections::BinaryHeap<ByAge>,
    /// The scopes of the kept records.
    scopes: std::collections::HashSet<ScopeHash>,
}

#[derive(Debug)]
struct ByAge(Record);

impl ByAge {
    fn age_key(&self) -> (u64, &str, ScopeHash) {
        (self.0.created_at_ms, &self.0.key, self.0.scope)
    }
}

impl PartialEq for ByAge {
    fn eq(&self, other: &Self) -> bool {
        self.age_key() == other.age_key()
    }
}

impl Eq for ByAge {}

impl PartialOrd for ByAge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByAge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.age_key().cmp(&other.age_key())
    }
}

impl OldestRecords {
    /// Keeps the `limit` oldest records offered.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            kept: std::collections::BinaryHeap::with_capacity(limit.min(1024) + 1),
            scopes: std::collections::HashSet::new(),
        }
    }

    /// Whether a record created at `created_at_ms` with `key` would be
    /// kept now: check before cloning a record to offer it.
    pub fn wants(&self, created_at_ms: u64, key: &str) -> bool {
        if self.kept.len() < self.limit {
            return true;
        }
        // Not past the newest kept (a tie is settled by the scope, in
        // `offer`).
        self.kept.peek().is_some_and(|newest| {
            let (at, newest_key, _) = newest.age_key();
            (created_at_ms, key) <= (at, newest_key)
        })
    }

    /// Offers a record: kept if it is among the `limit` oldest so far and
    /// no record of its scope is kept already.
    pub fn offer(&mut self, record: Record) {
        if self.limit == 0 {
            return;
        }
        let newer = self.kept.len() >= self.limit
            && self.kept.peek().is_some_and(|newest| {
                (record.created_at_ms, &*record.key, record.scope) >= newest.age_key()
            });
        if newer || !self.scopes.insert(record.scope) {
            return;
        }
        self.kept.push(ByAge(record));
        if self.kept.len() > self.limit
            && let Some(ByAge(newest)) = self.kept.pop()
        {
            self.scopes.remove(&newest.scope);
        }
    }

    /// The kept records, oldest first.
    pub fn into_oldest_first(self) -> Vec<Record> {
        self.kept
            .into_sorted_vec()
            .into_iter()
            .map(|ByAge(record)| record)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttemptId, OwnerToken, machine};

    fn record(created_at_ms: u64, key: &str) -> Record {
        let request = crate::test_support::request(key);
        let mut slot = None;
        let _ = machine::reserve(
            &mut slot,
            &request,
            created_at_ms,
            AttemptId::new(),
            OwnerToken::new(),
        );
        slot.expect("reserved")
    }

    /// The `limit` oldest records come out oldest first (same millisecond:
    /// by key), whatever order they were offered in, and no more than
    /// `limit` are ever held.
    #[test]
    fn oldest_records_keep_the_oldest_and_no_more() {
        let mut offered: Vec<(u64, String)> = (0..200u64)
            .map(|i| ((i * 7919) % 101, format!("k{:03}", (i * 31) % 200)))
            .collect();
        let mut oldest = OldestRecords::new(5);
        for (created, key) in &offered {
            oldest.offer(record(*created, key));
            assert!(oldest.kept.len() <= 5);
        }
        offered.sort();
        let expected: Vec<(u64, String)> = offered.into_iter().take(5).collect();
        let kept: Vec<(u64, String)> = oldest
            .into_oldest_first()
            .into_iter()
            .map(|r| (r.created_at_ms, r.key.to_string()))
            .collect();
        assert_eq!(kept, expected);
        let mut none = OldestRecords::new(0);
        assert!(!none.wants(0, "a"));
        none.offer(record(0, "a"));
        assert!(none.into_oldest_first().is_empty());
    }

    /// A record offered twice is kept once; a record evicted by older ones
    /// leaves no trace behind.
    #[test]
    fn a_record_offered_twice_is_kept_once() {
        let keys = |oldest: OldestRecords| -> Vec<String> {
            oldest
                .into_oldest_first()
                .into_iter()
                .map(|r| r.key.to_string())
                .collect()
        };
        let mut oldest = OldestRecords::new(3);
        let twice = record(5, "a");
        oldest.offer(twice.clone());
        oldest.offer(twice);
        oldest.offer(record(6, "b"));
        assert_eq!(keys(oldest), ["a", "b"]);
        let mut oldest = OldestRecords::new(1);
        oldest.offer(record(9, "late"));
        oldest.offer(record(1, "early"));
        assert_eq!(oldest.scopes.len(), 1);
        oldest.offer(record(0, "earliest"));
        assert_eq!(keys(oldest), ["earliest"]);
    }
}
