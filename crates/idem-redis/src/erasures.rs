//! Erasures heard by every process: `erase.lua` publishes an erased
//! record's scope on `<prefix>erased` (on a single node), and one
//! subscriber connection per store hears it and tells the store's
//! [`ErasureFeed`], which the layer's replay cache reads.
//!
//! The subscriber proves its connection every
//! [`HEARTBEAT`](idem_core::erasures::HEARTBEAT) with a `PING` on it (the
//! answer comes after every message published before it); an answer that
//! fails or takes longer than [`WINDOW`](idem_core::erasures::WINDOW), or
//! the connection's end, is a loss: the feed turns unhealthy (the caches
//! drop their copies and keep none) until the subscriber has connected and
//! subscribed again, tried every heartbeat. A cluster has no feed (a
//! `PUBLISH` there travels to every node): its caches keep copies at most a
//! second.

use futures_util::{FutureExt, StreamExt};
use idem_core::{
    ErasureFeed, ScopeHash,
    erasures::{HEARTBEAT, Subscriber, WINDOW},
};

/// The channel erasures are published on.
pub(crate) fn channel(prefix: &str) -> String {
    format!("{prefix}erased")
}

/// A store's erasure subscriber, started on first use.
pub(crate) struct Erasures {
    client: Option<redis::Client>,
    channel: String,
    subscriber: Subscriber,
}

impl Erasures {
    /// For a single node at `url`; `None`: a cluster, no feed.
    pub(crate) fn new(url: Option<&str>, prefix: &str) -> Self {
        Self {
            client: url.and_then(|url| redis::Client::open(url).ok()),
            channel: channel(prefix),
            subscriber: Subscriber::default(),
        }
    }

    /// The feed, its subscriber started on the first call (inside a tokio
    /// runtime; `None` outside one, and on a cluster).
    pub(crate) fn feed(&self) -> Option<ErasureFeed> {
        self.subscriber.feed(|| {
            let (client, channel) = (self.client.clone()?, self.channel.clone());
            Some(move |feed: ErasureFeed| {
                let (client, channel) = (client.clone(), channel.clone());
                async move {
                    if let Err(error) = listen(&client, &channel, &feed).await {
                        tracing::debug!(%error, "the erasures subscription ended");
                    }
                }
            })
        })
    }
}

/// One subscription, until it is lost.
async fn listen(
    client: &redis::Client,
    channel: &str,
    feed: &ErasureFeed,
) -> Result<(), redis::RedisError> {
    let mut pubsub = tokio::time::timeout(WINDOW, client.get_async_pubsub())
        .await
        .map_err(|_| timed_out())??;
    tokio::time::timeout(WINDOW, pubsub.subscribe(channel))
        .await
        .map_err(|_| timed_out())??;
    let (mut sink, mut stream) = pubsub.split();
    let mut beat = tokio::time::interval(HEARTBEAT);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = stream.next() => {
                let Some(message) = message else {
                    return Ok(());
                };
                match scope_of(message.get_payload_bytes()) {
                    Some(scope) => feed.erased(scope),
                    None => tracing::warn!("an unreadable erasure message; ignored"),
                }
            }
            _ = beat.tick() => {
                let pong = tokio::time::timeout(WINDOW, sink.ping::<redis::Value>()).await;
                // The answer to the ping comes after every message sent
                // before it; drain what arrived so that the proof covers it.
                while let Some(Some(message)) = stream.next().now_or_never() {
                    if let Some(scope) = scope_of(message.get_payload_bytes()) {
                        feed.erased(scope);
                    }
                }
                pong.map_err(|_| timed_out())??;
                feed.heard();
            }
        }
    }
}

fn timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
}

/// A scope as `erase.lua` publishes it: 64 hex digits.
fn scope_of(payload: &[u8]) -> Option<ScopeHash> {
    ScopeHash::from_hex(std::str::from_utf8(payload).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_scope_reads_back() {
        let scope = ScopeHash::from_bytes([0xab; 32]);
        assert_eq!(scope_of(&scope.hex_bytes()), Some(scope));
        assert_eq!(scope_of(b"not hex"), None);
    }
}
