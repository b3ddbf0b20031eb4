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
//!   gets nothing cached) and at most the cache's bound (60 s by default;
//!   1 s where the store has no push channel), whichever comes first.
//! * **The fingerprint.** A hit answers only a request with the record's
//!   fingerprint; any other goes to the store, which answers the conflict
//!   (or, for another fingerprint format, the replay).
//! * **A record the store lost** (a Redis restarted without persistence):
//!   the copy still answers within its bound, which is the safe side (the
//!   action ran; the store alone would run it again).
//! * **Another process's action.** What could change a completed record's
//!   answer is its expiry and its erasure. Where the store has a push
//!   channel ([`Store::erasures`](idem_core::Store::erasures): the memory
//!   store, a single Redis node, PostgreSQL reached directly), an erasure
//!   through any process reaches every cache within about a second, and a
//!   copy lives up to the bound (60 s by default); copies are kept and
//!   trusted only while the channel is healthy (a heartbeat every 500 ms
//!   proves it), and every loss or gap drops them all. Where it has none, the
//!   bound is capped to [`UNWATCHED_BOUND`] (1 s), which is then the
//!   longest another process's erasure goes unseen. A copy is never kept
//!   from a read that an erasure heard of may have followed (within the
//!   quiet time after it).
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

use idem_core::{ErasureFeed, Fingerprint, Outcome, Replay, ScopeHash};

/// The longest a copy lives where the store has no push channel.
pub(crate) const UNWATCHED_BOUND: Duration = Duration::from_secs(1);

/// After an erasure is heard of, how long no copy is kept (a read that
/// began before the erasure may answer after it): longer than any store
/// call, the layer's store timeout doubled or 5 s.
fn quiet_after_erasure(store_timeout: Duration) -> Duration {
    (store_timeout * 2).max(Duration::from_secs(5))
}

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
    /// The erasure feed's epoch it was kept in.
    epoch: u64,
    weight: u64,
}

type Entries = quick_cache::sync::Cache<ScopeHash, Arc<Entry>, Bytes>;

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
    entries: Arc<Entries>,
    bound: Duration,
    /// The store's erasures; `None` where it has no push channel.
    feed: Option<ErasureFeed>,
    quiet: Duration,
}

impl ReplayCache {
    /// A cache of at most `bytes`, each entry kept at most `bound` (at most
    /// [`UNWATCHED_BOUND`] without a feed); `None` when either is zero (no
    /// cache, and `feed`, which may start the store's subscriber, is not
    /// asked). With a feed, a task (on the current tokio runtime) forgets
    /// what the feed says was erased.
    pub(crate) fn new(
        bytes: usize,
        bound: Duration,
        feed: impl FnOnce() -> Option<ErasureFeed>,
        store_timeout: Duration,
    ) -> Option<Self> {
        if bytes == 0 || bound.is_zero() {
            return None;
        }
        let feed = feed();
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        // An estimate for the table's first size: entries of about 1 KB.
        let estimated = usize::try_from(bytes / 1024).unwrap_or(usize::MAX).max(16);
        let entries = Arc::new(quick_cache::sync::Cache::with_weighter(
            estimated, bytes, Bytes,
        ));
        // The feed is heard only with a task to hear it.
        let feed = feed.filter(|_| tokio::runtime::Handle::try_current().is_ok());
        if let Some(feed) = &feed {
            tokio::spawn(forget_erased(Arc::downgrade(&entries), feed.subscribe()));
        }
        let bound = match feed {
            Some(_) => bound,
            None => bound.min(UNWATCHED_BOUND),
        };
        Some(Self {
            entries,
            bound,
            feed,
            quiet: quiet_after_erasure(store_timeout),
        })
    }

    /// The feed's epoch while copies may be trusted: always (`Some(0)`)
    /// without a feed, while it is healthy with one.
    fn epoch(&self) -> Option<u64> {
        match &self.feed {
            Some(feed) => feed.healthy(),
            None => Some(0),
        }
    }

    /// The replay kept for `scope`, if it answers a request with
    /// `fingerprint` now.
    pub(crate) fn get(&self, scope: &ScopeHash, fingerprint: &Fingerprint) -> Option<Replay> {
        let entry = self.entries.get(scope)?;
        let now = Instant::now();
        if now >= entry.until || self.epoch() != Some(entry.epoch) {
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
        let Some(epoch) = self.epoch() else {
            return;
        };
        if self
            .feed
            .as_ref()
            .is_some_and(|feed| feed.erased_within(self.quiet))
        {
            return;
        }
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
                epoch,
                weight: OVERHEAD + u64::try_from(response).unwrap_or(u64::MAX),
            }),
        );
    }
}

/// Forgets each record the feed says was erased; everything when it fell
/// behind. Ends with the cache.
async fn forget_erased(
    entries: std::sync::Weak<Entries>,
    mut erased: tokio::sync::broadcast::Receiver<ScopeHash>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let heard = erased.recv().await;
        let Some(entries) = entries.upgrade() else {
            return;
        };
        match heard {
            Ok(scope) => {
                entries.remove(&scope);
            }
            Err(RecvError::Lagged(_)) => entries.clear(),
            Err(RecvError::Closed) => return,
        }
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
        let cache = ReplayCache::new(
            1 << 20,
            Duration::from_secs(60),
            || Some(ErasureFeed::local()),
            Duration::from_secs(1),
        )
        .expect("a cache");
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
        // No cache: the store's feed (which may start its subscriber) is
        // not asked for.
        let unasked = || -> Option<ErasureFeed> { panic!("the feed was asked for") };
        assert!(
            ReplayCache::new(0, Duration::from_secs(1), unasked, Duration::from_secs(1)).is_none()
        );
        assert!(ReplayCache::new(1, Duration::ZERO, unasked, Duration::from_secs(1)).is_none());
    }

    #[test]
    fn without_a_feed_copies_live_at_most_a_second() {
        let cache = ReplayCache::new(
            1 << 20,
            Duration::from_secs(60),
            || None,
            Duration::from_secs(1),
        )
        .expect("a cache");
        let (scope, fp) = (
            ScopeHash::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        cache.keep(&scope, &fp, &replay(b"{}", Some(Duration::from_secs(3600))));
        let hit = cache.get(&scope, &fp).expect("a hit");
        assert!(hit.expires_in.expect("expiry") <= UNWATCHED_BOUND);
    }

    #[tokio::test]
    async fn copies_are_kept_and_trusted_only_while_the_feed_is_healthy() {
        let feed = ErasureFeed::remote();
        let cache = ReplayCache::new(
            1 << 20,
            Duration::from_secs(60),
            || Some(feed.clone()),
            Duration::from_secs(1),
        )
        .expect("a cache");
        let fp = Fingerprint::from_bytes([2; 32]);
        let scope = |n: u8| ScopeHash::from_bytes([n; 32]);
        let long = || replay(b"{}", Some(Duration::from_secs(3600)));
        // Unhealthy: nothing kept.
        cache.keep(&scope(1), &fp, &long());
        assert!(cache.get(&scope(1), &fp).is_none());
        // Healthy: kept for the whole bound.
        feed.heard();
        cache.keep(&scope(1), &fp, &long());
        let hit = cache.get(&scope(1), &fp).expect("a hit");
        assert!(hit.expires_in.expect("expiry") > UNWATCHED_BOUND);
        // Lost: not trusted, and not again once it is back (a new epoch).
        feed.lost();
        assert!(cache.get(&scope(1), &fp).is_none());
        feed.heard();
        assert!(cache.get(&scope(1), &fp).is_none());
        // An erasure heard removes its copy, and no copy is kept for a
        // while after it.
        cache.keep(&scope(2), &fp, &long());
        assert!(cache.get(&scope(2), &fp).is_some());
        feed.erased(scope(2));
        for _ in 0..100 {
            if cache.get(&scope(2), &fp).is_none() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(cache.get(&scope(2), &fp).is_none(), "the erasure was heard");
        cache.keep(&scope(3), &fp, &long());
        assert!(
            cache.get(&scope(3), &fp).is_none(),
            "quiet after an erasure"
        );
    }

    #[test]
    fn the_cache_holds_its_byte_bound() {
        let cache = ReplayCache::new(
            64 * 1024,
            Duration::from_secs(60),
            || None,
            Duration::from_secs(1),
        )
        .expect("a cache");
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
