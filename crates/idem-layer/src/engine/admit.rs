//! The reservation loop: what this layer holds of the scope first, then
//! the store's reservation, waiting on an attempt in flight when the layer
//! waits, until the request may run or the record answers it. Callers
//! only translate the [`Admission`].

use std::time::Duration;

use idem_core::{Attempt, Lease, Reservation, ReserveRequest, ScopeHash, Store, StoreError};

use super::deadline_after;
use crate::{
    InFlight,
    found::Found,
    metrics::{self as m, Outcome as Counted, Saved},
    pending::Held,
    runtime::Runtime,
    storm::{Flight, Role, Shared, follow},
};

/// What a request's reservation came to.
pub(crate) enum Admission {
    /// Run the action under `lease`; on a takeover, `superseded` is the
    /// attempt whose lease lapsed (it may have acted).
    Run {
        /// The attempt's lease.
        lease: Lease,
        /// The attempt taken over, if any.
        superseded: Option<Attempt>,
    },
    /// The record answers: the request does not run.
    Found(Found),
    /// An earlier attempt's outcome this layer holds is not recorded yet,
    /// and the store did not take it now: the request must not run (no
    /// fail-open: the action ran).
    Held(StoreError),
    /// The store's reservation failed: nothing is known.
    Failed(StoreError),
}

/// Reserves `request`'s scope: the loop of the contract's state table.
/// `on_conflict` may change the request (another fingerprint format) and
/// answer `true` to have the reservation tried again; otherwise a
/// conflict is [`Found::Conflict`]. A replay this process keeps answers at
/// once ([`ReplayCache`](crate::storm::ReplayCache)), and a duplicate of a
/// reservation in flight here shares it ([`storm`](crate::storm)). Counts takeovers
/// and saved store calls; the callers count the answers they give.
pub(crate) async fn admit<S: Store>(
    rt: &Runtime<S>,
    request: &mut ReserveRequest,
    mut on_conflict: impl FnMut(&mut ReserveRequest) -> bool,
) -> Admission {
    let deadline = match rt.config.timing.in_flight {
        InFlight::Wait(bound) => Some(deadline_after(bound)),
        InFlight::Reject => None,
    };
    // Whether the next round waits on the store before it reserves, and
    // the hint to bound that wait by: this request followed a round whose
    // leader runs, or still found, the request in progress.
    let mut wait_first = None;
    loop {
        let (scope, fingerprint) = (*request.scope.hash(), request.fingerprint);
        if let Some(replay) = rt
            .replays()
            .and_then(|cache| cache.get(&scope, &fingerprint))
        {
            m::saved(Saved::Cache);
            return Admission::Found(Found::Completed(replay));
        }
        let leader = match rt.flights.join(&scope, &fingerprint) {
            Role::Lead(leader) => Some(leader),
            Role::Alone => None,
            Role::Follow(answer) => match follow_counted(rt, answer, deadline).await {
                Some(Shared::Found(Found::InProgress(hint)) | Shared::Running(hint)) => {
                    m::saved(Saved::Flight);
                    if deadline.is_some_and(|deadline| tokio::time::Instant::now() < deadline) {
                        wait_first = Some(hint);
                        continue;
                    }
                    return Admission::Found(Found::InProgress(hint));
                }
                Some(Shared::Found(found)) => {
                    m::saved(Saved::Flight);
                    return Admission::Found(found);
                }
                Some(Shared::Alone) => None,
                // This request's own wait ended first.
                None => return Admission::Found(Found::InProgress(RUNNING_RETRY_AFTER)),
            },
        };
        let Some(admission) =
            round(rt, request, deadline, wait_first.take(), &mut on_conflict).await
        else {
            // Tried again under another fingerprint: a round of its own.
            continue;
        };
        if let Some(leader) = leader {
            leader.publish(match &admission {
                Admission::Run { lease, .. } => Shared::Running(lease.ttl),
                Admission::Found(Found::Conflict) | Admission::Held(_) | Admission::Failed(_) => {
                    Shared::Alone
                }
                Admission::Found(found) => Shared::Found(found.clone()),
            });
        }
        return admission;
    }
}

/// [`follow`], counted as waiting where the request waits for an attempt
/// (wait mode).
async fn follow_counted<S>(
    rt: &Runtime<S>,
    answer: std::sync::Arc<Flight>,
    deadline: Option<tokio::time::Instant>,
) -> Option<Shared> {
    let _waiting = deadline.map(|_| rt.flights.wait());
    follow(answer, deadline).await
}

/// One round of reservations: the store's answers (waiting on the store
/// between them while the request waits) until one settles what the
/// request does; `None` when `on_conflict` changed the request.
async fn round<S: Store>(
    rt: &Runtime<S>,
    request: &mut ReserveRequest,
    deadline: Option<tokio::time::Instant>,
    mut wait_first: Option<Duration>,
    on_conflict: &mut impl FnMut(&mut ReserveRequest) -> bool,
) -> Option<Admission> {
    let store = &*rt.store;
    loop {
        if let Some(hint) = wait_first.take() {
            let now = tokio::time::Instant::now();
            if let Some(deadline) = deadline.filter(|deadline| now < *deadline) {
                let _waiting = rt.flights.wait();
                store
                    .changed(request.scope.hash(), wait_bound(deadline - now, hint))
                    .await;
            }
        }
        // Before every reservation (a waiting duplicate's too: the attempt
        // it waits for may be this layer's). Boxed: the rare path's state
        // stays out of every request's future.
        if rt.pending.any()
            && let Err(held) = Box::pin(rt.outcome_recorded(request.scope.hash(), deadline)).await
        {
            return Some(match held {
                Held::Unrecorded(error) => Admission::Held(error),
                Held::Running => Admission::Found(Found::InProgress(RUNNING_RETRY_AFTER)),
            });
        }
        let reservation = match store.reserve(request).await {
            Ok(reservation) => {
                rt.pending.store_answered();
                reservation
            }
            Err(error) => return Some(Admission::Failed(error)),
        };
        let found = match reservation {
            Reservation::Acquired(lease) => {
                return Some(Admission::Run {
                    lease,
                    superseded: None,
                });
            }
            Reservation::TakenOver { lease, superseded } => {
                m::count(Counted::Takeover);
                tracing::info!(
                    generation = lease.generation,
                    superseded = %superseded.id,
                    "lease lapsed; taking over"
                );
                return Some(Admission::Run {
                    lease,
                    superseded: Some(superseded),
                });
            }
            Reservation::InProgress { retry_after } => {
                if deadline.is_some_and(|deadline| tokio::time::Instant::now() < deadline) {
                    wait_first = Some(retry_after);
                    continue;
                }
                Found::InProgress(retry_after)
            }
            Reservation::Completed(replay) => {
                if let Some(cache) = rt.replays() {
                    cache.keep(request.scope.hash(), &request.fingerprint, &replay);
                }
                Found::Completed(replay)
            }
            Reservation::Cancelled => Found::Cancelled,
            Reservation::Conflict => {
                if on_conflict(request) {
                    return None;
                }
                Found::Conflict
            }
        };
        return Some(Admission::Found(found));
    }
}

/// The `Retry-After` hint for a duplicate of an attempt that runs here
/// past its lapsed lease (the lease says nothing of when it ends).
pub(crate) const RUNNING_RETRY_AFTER: Duration = Duration::from_secs(1);

impl<S> Runtime<S> {
    /// Before a reservation of `scope`: `Err` when this layer holds an
    /// attempt of it that still runs after its lease lapsed, or an outcome
    /// of it that the store has not taken yet, even when tried again now
    /// (see [`pending`](crate::pending)). Either way the action ran or
    /// runs: fail-open does not apply, and the retry that the store would
    /// let take over waits instead. A running attempt is waited for until
    /// `deadline` (the in-flight wait mode's; `None`: not at all).
    pub(crate) async fn outcome_recorded(
        &self,
        scope: &ScopeHash,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), crate::pending::Held> {
        // One try of the completion: a store call, within its timeout. A
        // try that fails ends the wait at once; the floor is for a busy
        // machine that runs the try late.
        let bound = self
            .config
            .timing
            .store_timeout
            .saturating_mul(2)
            .max(Duration::from_secs(2));
        loop {
            return match self.pending.settled(scope, bound).await {
                Err(crate::pending::Held::Running) => {
                    let now = tokio::time::Instant::now();
                    if let Some(deadline) = deadline.filter(|deadline| now < *deadline) {
                        self.pending.changed(scope, deadline - now).await;
                        continue;
                    }
                    Err(crate::pending::Held::Running)
                }
                settled => settled,
            };
        }
    }
}

/// How long a waiting duplicate waits for the record to change: until its
/// own deadline, and no longer than the holder's lease has left (a lapsed
/// lease publishes nothing; the next reservation takes it over).
pub(crate) fn wait_bound(deadline_left: Duration, lease_left: Duration) -> Duration {
    deadline_left.min(lease_left.max(Duration::from_millis(1)))
}
