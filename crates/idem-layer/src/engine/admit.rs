//! The reservation loop: what this layer holds of the scope first, then
//! the store's reservation, waiting on an attempt in flight when the layer
//! waits, until the request may run or the record answers it. Callers
//! only translate the [`Admission`].

use std::time::Duration;

use idem_core::{Attempt, Lease, Replay, Reservation, ReserveRequest, Store, StoreError};

use crate::{
    InFlight,
    metrics::{self as m, Outcome as Counted, StoreOp},
    pending::Held,
    runtime::{
        RUNNING_RETRY_AFTER, Runtime, deadline_after, store_call, wait_bound, wait_for_change,
    },
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

/// What the record says, for a request that does not run.
pub(crate) enum Found {
    /// The outcome to replay.
    Completed(Replay),
    /// An attempt runs (here or elsewhere); retry after this hint.
    InProgress(Duration),
    /// The record was cancelled.
    Cancelled,
    /// The key was used with another payload.
    Conflict,
}

/// Reserves `request`'s scope: the loop of the contract's state table.
/// `on_conflict` may change the request (another fingerprint format) and
/// answer `true` to have the reservation tried again; otherwise a
/// conflict is [`Found::Conflict`]. Counts takeovers; the callers count
/// the answers they give.
pub(crate) async fn admit<S: Store>(
    rt: &Runtime<S>,
    request: &mut ReserveRequest,
    mut on_conflict: impl FnMut(&mut ReserveRequest) -> bool,
) -> Admission {
    let (config, store) = (&*rt.config, &*rt.store);
    let deadline = match config.in_flight {
        InFlight::Wait(bound) => Some(deadline_after(bound)),
        InFlight::Reject => None,
    };
    loop {
        // Before every reservation (a waiting duplicate's too: the attempt
        // it waits for may be this layer's). Boxed: the rare path's state
        // stays out of every request's future.
        if rt.pending.any()
            && let Err(held) = Box::pin(rt.outcome_recorded(request.scope.hash(), deadline)).await
        {
            return match held {
                Held::Unrecorded(error) => Admission::Held(error),
                Held::Running => Admission::Found(Found::InProgress(RUNNING_RETRY_AFTER)),
            };
        }
        let reservation = match store_call(config, StoreOp::Reserve, store.reserve(request)).await {
            Ok(reservation) => {
                rt.pending.store_answered();
                reservation
            }
            Err(error) => return Admission::Failed(error),
        };
        let found = match reservation {
            Reservation::Acquired(lease) => {
                return Admission::Run {
                    lease,
                    superseded: None,
                };
            }
            Reservation::TakenOver { lease, superseded } => {
                m::count(Counted::Takeover);
                tracing::info!(
                    generation = lease.generation,
                    superseded = %superseded.id,
                    "lease lapsed; taking over"
                );
                return Admission::Run {
                    lease,
                    superseded: Some(superseded),
                };
            }
            Reservation::InProgress { retry_after } => {
                let now = tokio::time::Instant::now();
                if let Some(deadline) = deadline.filter(|deadline| now < *deadline) {
                    let bound = wait_bound(deadline - now, retry_after);
                    wait_for_change(store, request.scope.hash(), bound).await;
                    continue;
                }
                Found::InProgress(retry_after)
            }
            Reservation::Completed(replay) => Found::Completed(replay),
            Reservation::Cancelled => Found::Cancelled,
            Reservation::Conflict => {
                if on_conflict(request) {
                    continue;
                }
                Found::Conflict
            }
        };
        return Admission::Found(found);
    }
}
