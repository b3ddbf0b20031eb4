//! Waiting duplicates without polling: the scripts that take a record out
//! of `processing` (complete, release, cancel, abandon, force release)
//! publish on the record's channel (`<record key>:c`), and one subscriber
//! connection per store wakes the waiters of that record.
//!
//! A waiter subscribes (once per record, shared by every waiter of it),
//! then marks the record as waited on and reads its state, in one script
//! (complete and release publish only for a marked record; cancel, abandon
//! and force release always do): an outcome published before the
//! subscription took effect is seen by that read, one published after it
//! wakes the waiter; a record processing but held by nobody (a release
//! after a takeover left it for the same request to take over) ends the
//! wait at once. While it waits it costs Redis nothing. On a cluster
//! (where a plain `PUBLISH` would travel to every node) and whenever the
//! subscriber connection cannot be had, waiters poll as the default
//! [`Store::changed`](idem_core::Store::changed) does.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Weak},
    time::Duration,
};

use futures_util::StreamExt;
use tokio::sync::Notify;

/// How often a waiter polls when it cannot subscribe.
const POLL: Duration = Duration::from_millis(25);

/// The subscriber side of a store.
pub(crate) struct Watch {
    client: Option<redis::Client>,
    /// Serializes subscription changes on the one connection, so that a
    /// subscribe and an unsubscribe of one channel reach Redis in order.
    sink: tokio::sync::Mutex<Subscriber>,
    /// The waiters of each channel.
    waiters: parking_lot::Mutex<HashMap<String, (Arc<Notify>, usize)>>,
}

#[derive(Default)]
struct Subscriber {
    sink: Option<redis::aio::PubSubSink>,
    subscribed: HashSet<String>,
    /// The task reading the connection's messages.
    task: Option<tokio::task::AbortHandle>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(task) = self.sink.get_mut().task.take() {
            task.abort();
        }
    }
}

impl Watch {
    /// Publishing and waiting on a single node at `url`; `None` (polling)
    /// on a cluster.
    pub(crate) fn new(url: Option<&str>) -> Arc<Self> {
        Arc::new(Self {
            client: url.and_then(|url| redis::Client::open(url).ok()),
            sink: tokio::sync::Mutex::new(Subscriber::default()),
            waiters: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    /// Whether the scripts should publish.
    pub(crate) fn publishes(&self) -> bool {
        self.client.is_some()
    }

    /// Registers a waiter of `channel`; the guard unregisters it.
    fn register(self: &Arc<Self>, channel: &str) -> (Arc<Notify>, Registered) {
        let mut waiters = self.waiters.lock();
        let entry = waiters
            .entry(channel.to_owned())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        let notify = Arc::clone(&entry.0);
        let guard = Registered {
            watch: Arc::clone(self),
            channel: channel.to_owned(),
        };
        (notify, guard)
    }

    /// Subscribes to `channel` unless it already is; `false` when the
    /// subscriber connection cannot be had.
    async fn subscribe(self: &Arc<Self>, channel: &str, within: Duration) -> bool {
        let Some(client) = &self.client else {
            return false;
        };
        let subscribe = async {
            let mut sub = self.sink.lock().await;
            if sub.subscribed.contains(channel) {
                return true;
            }
            if sub.sink.is_none() {
                let Ok(pubsub) = client.get_async_pubsub().await else {
                    return false;
                };
                let (sink, stream) = pubsub.split();
                let task = tokio::spawn(dispatch(Arc::downgrade(self), stream));
                if let Some(old) = sub.task.replace(task.abort_handle()) {
                    old.abort();
                }
                sub.sink = Some(sink);
            }
            let Some(sink) = sub.sink.as_mut() else {
                return false;
            };
            if sink.subscribe(channel).await.is_err() {
                sub.sink = None;
                sub.subscribed.clear();
                return false;
            }
            sub.subscribed.insert(channel.to_owned());
            true
        };
        tokio::time::timeout(within, subscribe)
            .await
            .unwrap_or(false)
    }

    /// Waits until `channel` is published on, `state` says the record is
    /// no longer processing, or `timeout` passes.
    pub(crate) async fn changed<F>(self: &Arc<Self>, channel: &str, timeout: Duration, state: F)
    where
        F: Future<Output = Option<String>>,
    {
        let (notify, _registered) = self.register(channel);
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !self.subscribe(channel, timeout).await {
            tokio::time::sleep(timeout.min(POLL)).await;
            return;
        }
        if state.await.as_deref() != Some("processing") {
            return;
        }
        let _ = tokio::time::timeout(timeout, notified).await;
    }

    /// The subscriber connection ended: forget it, wake every waiter.
    async fn lost(&self) {
        let mut sub = self.sink.lock().await;
        sub.sink = None;
        sub.subscribed.clear();
        drop(sub);
        for (notify, _) in self.waiters.lock().values() {
            notify.notify_waiters();
        }
    }

    /// Unsubscribes from a channel nobody waits on any more.
    async fn unsubscribe(&self, channel: String) {
        let mut sub = self.sink.lock().await;
        if self.waiters.lock().contains_key(&channel) || !sub.subscribed.remove(&channel) {
            return;
        }
        if let Some(sink) = sub.sink.as_mut()
            && sink.unsubscribe(&channel).await.is_err()
        {
            sub.sink = None;
            sub.subscribed.clear();
        }
    }
}

/// Wakes the waiters of each channel published on.
async fn dispatch(watch: Weak<Watch>, mut stream: redis::aio::PubSubStream) {
    while let Some(message) = stream.next().await {
        let Some(watch) = watch.upgrade() else {
            return;
        };
        let channel = message.get_channel_name();
        if let Some((notify, _)) = watch.waiters.lock().get(channel) {
            notify.notify_waiters();
        }
    }
    if let Some(watch) = watch.upgrade() {
        watch.lost().await;
    }
}

/// A registered waiter; the last one of a channel unsubscribes it.
struct Registered {
    watch: Arc<Watch>,
    channel: String,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut waiters = self.watch.waiters.lock();
        let Some(entry) = waiters.get_mut(&self.channel) else {
            return;
        };
        entry.1 -= 1;
        if entry.1 > 0 {
            return;
        }
        waiters.remove(&self.channel);
        drop(waiters);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let watch = Arc::clone(&self.watch);
            let channel = std::mem::take(&mut self.channel);
            runtime.spawn(async move { watch.unsubscribe(channel).await });
        }
    }
}
