//! A shard of the store: its records (keyed by scope hash, with an
//! expiry queue) and the waiters on them.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    hash::{BuildHasherDefault, Hasher},
    sync::Arc,
};

use idem_core::{Record, ScopeHash};
use parking_lot::Mutex;
use tokio::sync::Notify;

/// The scope hash is already uniform: use its first eight bytes.
#[derive(Default)]
pub(crate) struct ScopeHasher(u64);

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

pub(crate) type Map<V> = HashMap<ScopeHash, V, BuildHasherDefault<ScopeHasher>>;

/// A shard's records, found by the scope each record holds: an entry is
/// one pointer, not the scope hash again beside it (32 bytes less per
/// record, before the table's spare room).
/// One shard's records, found by a keyed hash of their scope hash.
#[derive(Default)]
pub(crate) struct Records {
    /// Each slot beside its scope's hash under the table's key: growing
    /// the table rehashes from the hashes it keeps, without reading every
    /// record (one cache miss each on a large store), and a lookup reads
    /// a record only when the whole hash matches.
    pub(crate) table: hashbrown::HashTable<Slot>,
    /// Keyed at random per table: a caller who can compute scope hashes
    /// (they are unkeyed unless the layer has a scope secret) still cannot
    /// pick keys whose records share one bucket and lengthen every lookup
    /// in it, nor learn where a record sits. foldhash's seeded mix of one
    /// word (a folded multiply) is enough for that and costs a fraction of
    /// SipHash: the table never shows its hashes.
    pub(crate) hasher: foldhash::quality::RandomState,
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
pub(crate) fn scope_prefix(scope: &ScopeHash) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&scope.as_bytes()[..8]);
    u64::from_le_bytes(word)
}

/// The table's hash of a scope prefix, under the table's key.
pub(crate) fn prefix_hash(hasher: &foldhash::quality::RandomState, prefix: u64) -> u64 {
    use std::hash::BuildHasher;
    hasher.hash_one(prefix)
}

/// The table's hash of a scope: its first eight bytes under the table's
/// key.
pub(crate) fn scope_hash(hasher: &foldhash::quality::RandomState, scope: &ScopeHash) -> u64 {
    prefix_hash(hasher, scope_prefix(scope))
}

/// A record's place in the table: the table's hash of its scope and the
/// box that holds it.
pub(crate) struct Slot {
    pub(crate) hash: u64,
    pub(crate) record: Box<Option<Record>>,
}

/// The scope a slot holds; an emptied slot (only ever the one being
/// changed, under the shard's lock) holds none.
pub(crate) fn slot_scope(slot: &Option<Record>) -> Option<&ScopeHash> {
    slot.as_ref().map(|record| &record.scope)
}

impl Records {
    pub(crate) fn get(&self, scope: &ScopeHash) -> Option<&Option<Record>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record) == Some(scope)
            })
            .map(|slot| &*slot.record)
    }

    pub(crate) fn get_mut(&mut self, scope: &ScopeHash) -> Option<&mut Option<Record>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find_mut(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record) == Some(scope)
            })
            .map(|slot| &mut *slot.record)
    }

    #[cfg(test)]
    pub(crate) fn insert(&mut self, record: Record) {
        self.insert_slot(Box::new(Some(record)));
    }

    /// Adds a slot that holds a record; an empty one is dropped.
    pub(crate) fn insert_slot(&mut self, record: Box<Option<Record>>) {
        let Some(held) = &*record else { return };
        let hash = scope_hash(&self.hasher, &held.scope);
        self.table
            .insert_unique(hash, Slot { hash, record }, |slot| slot.hash);
    }

    /// Removes a record whose scope begins with `prefix` and that has
    /// expired at `now_ms`, if there is one.
    pub(crate) fn remove_expired(&mut self, prefix: u64, now_ms: u64) -> Option<Record> {
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
    pub(crate) fn remove(&mut self, scope: &ScopeHash) -> Option<Box<Option<Record>>> {
        let hash = scope_hash(&self.hasher, scope);
        self.table
            .find_entry(hash, |slot| {
                slot.hash == hash && slot_scope(&slot.record).is_none_or(|held| held == scope)
            })
            .ok()
            .map(|entry| entry.remove().0.record)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Option<Record>> {
        self.table.iter().map(|slot| &*slot.record)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Shard {
    pub(crate) state: Mutex<ShardState>,
}

#[derive(Debug, Default)]
pub(crate) struct ShardState {
    /// Boxed, so that growing the map moves pointers, not records; an
    /// `Option` inside, so transitions run on the record in place.
    pub(crate) records: Records,
    /// When records expire, earliest first, each with its scope's first
    /// eight bytes (16 bytes an entry, not the 40 a whole scope takes):
    /// an entry removes an expired record of that prefix, and which one
    /// does not matter. Two scopes of one prefix (rare, or made on
    /// purpose by a caller who can compute unkeyed scope hashes) are each
    /// removed once expired, by either one's entry; an entry whose record
    /// was renewed, completed anew or already removed finds none.
    pub(crate) expiries: BinaryHeap<Reverse<(u64, u64)>>,
    pub(crate) waiters: Map<Arc<Notify>>,
}

impl ShardState {
    pub(crate) fn record(&self, scope: &ScopeHash) -> Option<&Record> {
        self.records.get(scope).and_then(|slot| slot.as_ref())
    }

    /// Removes up to `limit` expired records, handing each to `removed`
    /// (for the store's counts); returns how many.
    pub(crate) fn sweep(
        &mut self,
        now_ms: u64,
        limit: usize,
        gone: &mut impl FnMut(&Record),
    ) -> usize {
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
    pub(crate) fn push_expiry(&mut self, at_ms: u64, scope: &ScopeHash) {
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
    pub(crate) fn expiry_entries(&self) -> usize {
        self.expiries.len()
    }

    pub(crate) fn wake(&mut self, scope: &ScopeHash) {
        if let Some(notify) = self.waiters.remove(scope) {
            notify.notify_waiters();
        }
    }
}
