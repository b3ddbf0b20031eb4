//! Keeping an attempt's lease: renewals beside the work, a lease that
//! lapsed while the store was down renewed on, and the attempt listed
//! meanwhile so this layer's retries of it wait.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use futures_util::{FutureExt, future::Fuse};
use idem_core::{Lease, Renewal, Store};

use super::deadline_after;

/// Where an attempt that runs on after its lease lapsed is listed (see
/// [`pending`](crate::pending)): listed while its renewals fail past the
/// lease, and kept listed until the attempt's outcome is recorded or
/// handed on (the attempt drops it last).
pub(crate) struct Lapse<'a> {
    pending: &'a std::sync::Arc<crate::pending::Pending>,
    listed: std::sync::Mutex<Option<crate::pending::Registration>>,
}

impl<'a> Lapse<'a> {
    pub(crate) fn new(pending: &'a std::sync::Arc<crate::pending::Pending>) -> Self {
        Self {
            pending,
            listed: std::sync::Mutex::new(None),
        }
    }

    fn set(&self, listed: Option<crate::pending::Registration>) {
        // Poisoned only by a panic while set: the slot is used as it is.
        let mut slot = self
            .listed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = listed;
    }
}

/// Keeps the lease alive: renews it every third of its length; a failed
/// renewal is retried promptly (every quarter period, at most 1 s) until
/// the lease, as last renewed, would lapse. Returns when the lease is lost:
/// fenced by a newer attempt or a cancellation, or (without `lapse`)
/// lapsed because renewals kept failing. With `lapse`, a lease that lapsed
/// that way is renewed on (backing off to two tries a second, and at once
/// when the store answers one of the layer's reservations; the store
/// renews a lapsed lease that nothing took over) while the attempt runs,
/// which is listed meanwhile so that this layer's retries of it wait.
async fn keep_alive<S: Store>(store: &S, lease: &Lease, lapse: Option<&Lapse<'_>>) {
    let period = (lease.ttl / 3).max(Duration::from_millis(1));
    let retry = (period / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut held_until = deadline_after(lease.ttl);
    let mut next = deadline_after(period);
    // Once the lease lapsed under the running attempt (its renewals
    // failing): the pause before the next renewal.
    let mut lapsed: Option<Duration> = None;
    loop {
        match (lapsed, lapse) {
            // Lapsed: the next renewal also as soon as the store answers
            // one of this layer's reservations (it is back).
            (Some(_), Some(lapse)) => lapse.pending.until_answered(next).await,
            _ => tokio::time::sleep_until(next).await,
        }
        let sent = tokio::time::Instant::now();
        match store.renew(lease).await {
            Ok(Renewal::Renewed) => {
                if lapsed.take().is_some() {
                    tracing::info!("the lapsed lease was renewed: nothing took it over");
                    if let Some(lapse) = lapse {
                        lapse.set(None);
                    }
                }
                held_until = sent.checked_add(lease.ttl).unwrap_or(held_until);
                next = sent.checked_add(period).unwrap_or(held_until);
            }
            Ok(Renewal::Fenced(_)) => {
                // The attempt keeps running: stopping a handler half-way is
                // worse. Its completion will be fenced and kept as late
                // evidence.
                tracing::warn!("lease lost while the attempt runs");
                if let Some(lapse) = lapse {
                    lapse.set(None);
                }
                return;
            }
            Err(error) => {
                let now = tokio::time::Instant::now();
                if now < held_until {
                    tracing::warn!(%error, "lease renewal failed; retrying");
                    next = (now + retry).min(held_until);
                    continue;
                }
                let Some(lapse) = lapse else {
                    tracing::error!(%error, "lease renewal failed until the lease lapsed");
                    return;
                };
                let pause = match lapsed {
                    Some(pause) => lapsed_backoff(pause),
                    None => {
                        tracing::error!(
                            %error,
                            "lease renewal failed until the lease lapsed; the attempt runs on, \
                             and its renewals go on until the store answers"
                        );
                        lapse.set(Some(lapse.pending.register_running(lease.scope)));
                        retry
                    }
                };
                lapsed = Some(pause);
                next = now + pause;
            }
        }
    }
}

/// Drives `work` to its end while the lease is kept alive beside it (both
/// polled concurrently: a slow renewal never stalls the work).
/// With `lapse`, a lease that lapses while the store is down is renewed
/// on and the attempt listed meanwhile (see [`keep_alive`]).
pub(crate) fn renewing<'a, S: Store, W: Future + 'a>(
    store: &'a S,
    lease: &'a Lease,
    lapse: Option<&'a Lapse<'a>>,
    work: W,
) -> impl Future<Output = W::Output> + 'a {
    Renewing {
        work,
        keeper: keep_alive(store, lease, lapse).fuse(),
    }
}

/// Drives `work` while the lease is held; `None` once it is lost.
pub(super) fn while_held<'a, S: Store, W: Future + 'a>(
    store: &'a S,
    lease: &'a Lease,
    work: W,
) -> impl Future<Output = Option<W::Output>> + 'a {
    WhileHeld {
        work,
        keeper: keep_alive(store, lease, None),
    }
}

// Hand-written rather than `select` over pinned locals: an `async fn`
// keeps `work` twice in its state (as its argument and as the pinned
// local), and `work` holds the inner service's future.
pin_project_lite::pin_project! {
    /// `work` and the lease's keeper, polled in that order; the work goes
    /// on once the keeper has ended.
    struct Renewing<W, K> {
        #[pin]
        work: W,
        #[pin]
        keeper: Fuse<K>,
    }
}

impl<W: Future, K: Future<Output = ()>> Future for Renewing<W, K> {
    type Output = W::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<W::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(output);
        }
        // An ended keeper (the lease is lost) is not polled again; the
        // work's own waker is registered above.
        let _ = this.keeper.poll(cx);
        Poll::Pending
    }
}

pin_project_lite::pin_project! {
    /// `work` and the lease's keeper, polled in that order; `None` as soon
    /// as the keeper ends (the lease is lost).
    struct WhileHeld<W, K> {
        #[pin]
        work: W,
        #[pin]
        keeper: K,
    }
}

impl<W: Future, K: Future<Output = ()>> Future for WhileHeld<W, K> {
    type Output = Option<W::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(Some(output));
        }
        match this.keeper.poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The pause after `pause` between the tries of an attempt whose lease
/// lapsed with the store down (its renewals, or the recording of its
/// outcome): doubled, to at most 500 ms, so a store that comes back takes
/// them within that, before most retries arrive.
pub(super) fn lapsed_backoff(pause: Duration) -> Duration {
    (pause * 2).min(Duration::from_millis(500))
}
