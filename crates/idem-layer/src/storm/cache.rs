//! The replay cache: completed records this process was answered with,
//! kept so that a storm of retries costs the store nothing.
//!
//! A completed record does not change until it expires: no call of the
//! store contract turns it back (a cancellation, a release, an operator's
//! force release and a takeover all leave a completed record as it is). So
//! a copy answers exactly as the store would, for as long as the record
//! lives, and a replay from the cache is the store's replay byte for byte
//! (the same outcome, through the same answer). What bounds a copy:
//!
//! * **Expiry.** An entry lives at most until the record's expiry as the
//!   store reported it ([`Replay::expires_in`]; a store that does not say
//!   gets nothing cached) and at most the cache's bound (1 s by default),
//!   whichever comes first.
//! * **The fingerprint.** A hit answers only a request with the record's
//!   fingerprint; any other goes to the store, which answers the conflict
//!   (or, for another fingerprint format, the replay).
//! * **A record the store lost** (a Redis restarted without persistence):
//!   the copy still answers within its bound, which is the safe side (the
//!   action ran; the store alone would run it again).
//! * **Another process's action.** What could change a completed record's
//!   answer is its expiry and its erasure; a copy held by another process
//!   lives on for at most the bound.
//! * **A changed deployment secret** changes every scope hash: a copy
//!   under an old hash is never asked for.
//!
//! The cache is bounded in bytes (the responses' headers and bodies and a
//! fixed overhead per entry) and evicts the least valuable entries first
//! (`quick_cache`'s CLOCK-Pro).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use idem_core::{Fingerprint, Outcome, Replay, ScopeHash};

/// What an entry costs besides its response: the key, the fingerprint,
/// the outcome's frame and the cache's own bookkeeping.
const OVERHEAD: u64 = 160;

/// One completed record.
struct Entry {
    fingerprint: Fingerprint,
    outcome: Outcome,
    /// The attempt whose outcome it is.
    attempt: Option<idem_core::AttemptId>,
    /// The record's age when it was kept.
    age: Duration,
    kept: Instant,
    /// When the copy stops answering: the record's expiry or the bound.
    until: Instant,
    weight: u64,
}

/// Weighs an entry by its bytes.
#[derive(Clone)]
struct Bytes;

impl quick_cache::Weighter<ScopeHash, Arc<Entry>> for Bytes {
    fn weight(&self, _: &ScopeHash, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// The cache of one layer (see the module's docs).
pub(crate) struct ReplayCache {
    entries: quick_cache::sync::Cache<ScopeHash, Arc<Entry>, Bytes>,
    bound: Duration,
}

impl ReplayCache {
    /// A cache of at most `bytes`, each entry kept at most `bound`; `None`
    /// when either is zero (no cache).
    pub(crate) fn new(bytes: usize, bound: Duration) -> Option<Self> {
        if bytes == 0 || bound.is_zero() {
            return None;
        }
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        // An estimate for the table's first size: entries of about 1 KB.
        let estimated = usize::try_from(bytes / 1024).unwrap_or(usize::MAX).max(16);
        Some(Self {
            entries: quick_cache::sync::Cache::with_weighter(estimated, bytes, Bytes),
            bound,
        })
    }

    /// The replay kept for `scope`, if it answers a request with
    /// `fingerprint` now.
    pub(crate) fn get(&self, scope: &ScopeHash, fingerprint: &Fingerprint) -> Option<Replay> {
        let entry = self.entries.get(scope)?;
        let now = Instant::now();
        if now >= entry.until {
            self.entries.remove(scope);
            return None;
        }
        if entry.fingerprint != *fingerprint {
            return None;
        }
        let held = now - entry.kept;
        Some(Replay {
            outcome: entry.outcome.clone(),
            age: entry.age + held,
            expires_in: Some(entry.until - now),
            attempt: entry.attempt,
        })
    }

    /// Forgets what is kept for `scope` (its record was erased).
    pub(crate) fn forget(&self, scope: &ScopeHash) {
        self.entries.remove(scope);
    }

    /// Keeps `replay`, which the store answered a request with
    /// `fingerprint` for `scope`, if the store said when it expires.
    pub(crate) fn keep(&self, scope: &ScopeHash, fingerprint: &Fingerprint, replay: &Replay) {
        let Some(expires_in) = replay.expires_in else {
            return;
        };
        let life = expires_in.min(self.bound);
        if life.is_zero() {
            return;
        }
        let response = match &replay.outcome {
            Outcome::Stored(response) => {
                let headers: usize = response
                    .headers
                    .iter()
                    .map(|(name, value)| name.as_str().len() + value.len())
                    .sum();
                headers + response.body.len()
            }
            Outcome::NotStored { .. } => 0,
        };
        let kept = Instant::now();
        self.entries.insert(
            *scope,
            Arc::new(Entry {
                fingerprint: *fingerprint,
                outcome: replay.outcome.clone(),
                attempt: replay.attempt,
                age: replay.age,
                kept,
                until: kept + life,
                weight: OVERHEAD + u64::try_from(response).unwrap_or(u64::MAX),
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes as Body;
    use idem_core::{HeaderName, StoredResponse};

    use super::*;

    fn replay(body: &'static [u8], expires_in: Option<Duration>) -> Replay {
        Replay {
            outcome: Outcome::Stored(StoredResponse {
                status: 201,
                headers: vec![(
                    HeaderName::from_static("location"),
                    Body::from_static(b"/o/1"),
                )],
                body: Body::from_static(body),
            }),
            age: Duration::from_secs(2),
            expires_in,
            attempt: None,
        }
    }

    #[test]
    fn a_copy_answers_its_fingerprint_until_the_shorter_of_expiry_and_bound() {
        let cache = ReplayCache::new(1 << 20, Duration::from_secs(60)).expect("a cache");
        let (scope, fp) = (
            ScopeHash::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        let other = Fingerprint::from_bytes([3; 32]);
        // No expiry said: nothing kept.
        cache.keep(&scope, &fp, &replay(b"{}", None));
        assert!(cache.get(&scope, &fp).is_none());
        cache.keep(&scope, &fp, &replay(b"{}", Some(Duration::from_secs(3600))));
        let hit = cache.get(&scope, &fp).expect("a hit");
        assert_eq!(hit.outcome, replay(b"{}", None).outcome);
        assert!(hit.age >= Duration::from_secs(2));
        assert!(hit.expires_in.expect("expiry") <= Duration::from_secs(60));
        // Another payload goes to the store.
        assert!(cache.get(&scope, &other).is_none());
        // A record about to expire is kept only until it does.
        let soon = ScopeHash::from_bytes([4; 32]);
        cache.keep(&soon, &fp, &replay(b"{}", Some(Duration::from_millis(1))));
        std::thread::sleep(Duration::from_millis(5));
        assert!(cache.get(&soon, &fp).is_none());
        assert!(ReplayCache::new(0, Duration::from_secs(1)).is_none());
        assert!(ReplayCache::new(1, Duration::ZERO).is_none());
    }

    #[test]
    fn the_cache_holds_its_byte_bound() {
        let cache = ReplayCache::new(64 * 1024, Duration::from_secs(60)).expect("a cache");
        static BODY: [u8; 1000] = [b'x'; 1000];
        let fp = Fingerprint::from_bytes([2; 32]);
        for n in 0..1000u32 {
            let mut bytes = [0u8; 32];
            bytes[..4].copy_from_slice(&n.to_be_bytes());
            cache.keep(
                &ScopeHash::from_bytes(bytes),
                &fp,
                &replay(&BODY, Some(Duration::from_secs(60))),
            );
        }
        assert!(
            cache.entries.weight() <= 64 * 1024,
            "{}",
            cache.entries.weight()
        );
        assert!(cache.entries.len() >= 32, "{}", cache.entries.len());
    }
}
