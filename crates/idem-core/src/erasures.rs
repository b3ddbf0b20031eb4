//! What a store's push channel says of erasures: every process sharing the
//! store hears of a record erased through any of them, and knows whether
//! it can trust that it would have heard (`docs/design.md`, section 3).
//!
//! A store with a push channel hands out an [`ErasureFeed`]
//! ([`Store::erasures`](crate::Store::erasures)) and drives it: it calls
//! [`heard`](ErasureFeed::heard) each time the channel proves healthy (a
//! heartbeat answered on the subscriber's own connection, at least every
//! [`HEARTBEAT`]), [`erased`](ErasureFeed::erased) for each erasure it
//! hears of, and [`lost`](ErasureFeed::lost) when the subscription ends.
//! A [`Subscriber`] keeps the store's subscription going and restarts it.
//! A reader (the layer's replay cache) keeps copies only while the feed is
//! [`healthy`](ErasureFeed::healthy), tags each with the feed's epoch, and
//! trusts a copy only while the epoch is the same: every loss of the
//! channel, and every gap between heartbeats longer than [`WINDOW`],
//! starts a new epoch, so whatever was kept before it is dropped.

use std::{
    future::Future,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::broadcast;

use crate::ScopeHash;

/// How often a store's subscriber proves its channel healthy.
pub const HEARTBEAT: Duration = Duration::from_millis(500);

/// How long after the last proof the feed still counts as healthy.
pub const WINDOW: Duration = Duration::from_secs(1);

/// How many erasures a slow reader may fall behind before it must drop
/// everything it kept (it hears that it lagged).
const BACKLOG: usize = 1024;

/// A never-heard mark.
const NEVER: u64 = u64::MAX;

/// The erasures of a store's records, as its push channel brings them (see
/// the module's docs). Cloning shares the feed.
#[derive(Clone)]
pub struct ErasureFeed(Arc<Inner>);

struct Inner {
    base: Instant,
    /// When the channel last proved healthy (ms after `base`), or `NEVER`.
    heard: AtomicU64,
    /// Bumped on every loss of the channel and every gap in its proofs.
    epoch: AtomicU64,
    /// When an erasure was last heard of (ms after `base`), or `NEVER`.
    last_erasure: AtomicU64,
    /// Whether the feed needs no proofs (a store inside this process).
    local: bool,
    erased: broadcast::Sender<ScopeHash>,
}

impl std::fmt::Debug for ErasureFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ErasureFeed")
            .field("healthy", &self.healthy().is_some())
            .field("epoch", &self.0.epoch.load(Ordering::Acquire))
            .finish_non_exhaustive()
    }
}

impl ErasureFeed {
    fn with(local: bool) -> Self {
        Self(Arc::new(Inner {
            base: Instant::now(),
            heard: AtomicU64::new(NEVER),
            epoch: AtomicU64::new(0),
            last_erasure: AtomicU64::new(NEVER),
            local,
            erased: broadcast::channel(BACKLOG).0,
        }))
    }

    /// A feed of a channel between processes: unhealthy until its first
    /// [`heard`](Self::heard).
    pub fn remote() -> Self {
        Self::with(false)
    }

    /// The feed of a store inside this process (every erasure goes through
    /// it): always healthy.
    pub fn local() -> Self {
        Self::with(true)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.0.base.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    /// The channel proved healthy now. After a gap longer than [`WINDOW`]
    /// (or a loss), a new epoch begins.
    pub fn heard(&self) {
        let now = self.now_ms();
        let before = self.0.heard.swap(now, Ordering::AcqRel);
        let window = u64::try_from(WINDOW.as_millis()).unwrap_or(u64::MAX);
        if before == NEVER || now.saturating_sub(before) > window {
            self.0.epoch.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The subscription ended (a disconnect, a heartbeat that failed):
    /// unhealthy until the next [`heard`](Self::heard), which begins a new
    /// epoch.
    pub fn lost(&self) {
        self.0.heard.store(NEVER, Ordering::Release);
        self.0.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The record of `scope` was erased (by any process sharing the store).
    pub fn erased(&self, scope: ScopeHash) {
        self.0.last_erasure.store(self.now_ms(), Ordering::Release);
        let _ = self.0.erased.send(scope);
    }

    /// The current epoch while the feed is healthy; `None` while it is not
    /// (nothing may be kept or trusted then).
    pub fn healthy(&self) -> Option<u64> {
        let epoch = self.0.epoch.load(Ordering::Acquire);
        if self.0.local {
            return Some(epoch);
        }
        let heard = self.0.heard.load(Ordering::Acquire);
        let window = u64::try_from(WINDOW.as_millis()).unwrap_or(u64::MAX);
        (heard != NEVER && self.now_ms().saturating_sub(heard) <= window).then_some(epoch)
    }

    /// Whether an erasure was heard of within `within` (a reader holding an
    /// answer it read before then must not keep it: the erasure may have
    /// come after its read).
    pub fn erased_within(&self, within: Duration) -> bool {
        let last = self.0.last_erasure.load(Ordering::Acquire);
        let within = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
        last != NEVER && self.now_ms().saturating_sub(last) <= within
    }

    /// Every erasure heard from now on; a receiver that falls behind hears
    /// that it lagged and must drop everything it kept.
    pub fn subscribe(&self) -> broadcast::Receiver<ScopeHash> {
        self.0.erased.subscribe()
    }
}

/// A store's subscriber to its push channel: started on the first
/// [`feed`](Self::feed), kept connected while the store lives (each time
/// a subscription ends, the feed is [lost](ErasureFeed::lost) and a new one
/// is tried a [`HEARTBEAT`] later), stopped when it is dropped. The store
/// says how to listen; this keeps it going.
#[derive(Default)]
pub struct Subscriber {
    feed: OnceLock<Option<ErasureFeed>>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber").finish_non_exhaustive()
    }
}

impl Subscriber {
    /// The feed. On the first call, `listener` gives what keeps one
    /// subscription (it resolves when the subscription ends, having told
    /// the feed what it heard and [`heard`](ErasureFeed::heard) each proof);
    /// the subscriber runs it on the current tokio runtime, again after
    /// each end. `None` (now and on every later call) when `listener` gives
    /// none (a store without a push channel) or outside a runtime.
    pub fn feed<L, F>(&self, listener: impl FnOnce() -> Option<L>) -> Option<ErasureFeed>
    where
        L: Fn(ErasureFeed) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        self.feed
            .get_or_init(|| {
                let runtime = tokio::runtime::Handle::try_current().ok()?;
                let listen = listener()?;
                let feed = ErasureFeed::remote();
                let kept = feed.clone();
                let task = runtime.spawn(async move {
                    loop {
                        listen(kept.clone()).await;
                        kept.lost();
                        tokio::time::sleep(HEARTBEAT).await;
                    }
                });
                if let Ok(mut slot) = self.task.lock() {
                    *slot = Some(task.abort_handle());
                }
                Some(feed)
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_feed_is_healthy_between_proofs_and_each_loss_begins_an_epoch() {
        let feed = ErasureFeed::remote();
        assert_eq!(feed.healthy(), None, "unhealthy until first heard");
        feed.heard();
        let first = feed.healthy().expect("healthy");
        feed.heard();
        assert_eq!(feed.healthy(), Some(first), "one epoch while proofs come");
        feed.lost();
        assert_eq!(feed.healthy(), None);
        feed.heard();
        let second = feed.healthy().expect("healthy again");
        assert_ne!(first, second, "a loss begins a new epoch");
        assert!(!feed.erased_within(Duration::from_secs(5)));
        let mut erasures = feed.subscribe();
        let scope = ScopeHash::from_bytes([7; 32]);
        feed.erased(scope);
        assert_eq!(erasures.try_recv().expect("heard"), scope);
        assert!(feed.erased_within(Duration::from_secs(5)));
    }

    #[test]
    fn a_local_feed_is_always_healthy() {
        let feed = ErasureFeed::local();
        assert_eq!(feed.healthy(), Some(0));
    }
}
