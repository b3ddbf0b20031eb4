//! Settling an attempt: its outcome stored, or its key released, as the
//! predicate says; a completion the store could not take retried in the
//! background (listed in [`pending`](crate::pending)) until it lands; a
//! record the store lost made again from the outcome.

use std::time::Duration;

use idem_core::{
    Completion, Current, Lease, Outcome, Release, Reservation, ReserveRequest, Store, StoreError,
};
use tracing::Instrument;

use super::{
    deadline_after,
    lease::{lapsed_backoff, while_held},
};
use crate::{
    metrics::{self as m, Outcome as Counted},
    runtime::Runtime,
};

/// Records what an attempt produced: stores the outcome, or releases the
/// key when the predicate called its status temporary (`stores` false). Answers what the
/// record says now when the attempt was fenced. A completion that hits a
/// store error is retried in the background (see `record_later`).
pub(crate) async fn settle<S: Store>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    lease: &Lease,
    stores: bool,
    outcome: Outcome,
) -> Option<Current> {
    if !stores {
        return rt.release(lease).await;
    }
    match rt.store.complete(lease, &outcome).await {
        Ok(completion) => completed(rt, request, &outcome, completion).await,
        Err(error) => {
            // The action ran; its client gets the real response, and the
            // outcome is recorded in the background while the lease is
            // held, so a store blip does not turn into a takeover and a
            // second execution.
            record_in_background(rt, request, lease, outcome, &error);
            None
        }
    }
}

/// Starts [`record_later`] after a completion's store error (a rare path,
/// kept out of [`settle`]'s code).
#[cold]
#[inline(never)]
fn record_in_background<S: Store>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    lease: &Lease,
    outcome: Outcome,
    error: &StoreError,
) {
    m::count(Counted::StoreError);
    tracing::error!(%error, "could not record the outcome yet; retrying in the background");
    // Listed before the client gets its answer: its retry finds it.
    let pending = rt.pending.register(*request.scope.hash());
    rt.tasks.spawn(
        record_later(rt.clone(), request.clone(), lease.clone(), outcome, pending)
            .in_current_span(),
    );
}

/// A completion found no record at all (a vacant one, released, is left
/// as it is): the store lost it (a failover that dropped an unreplicated
/// write, say), or an operator released it and then erased it, while the
/// action ran. Left
/// vacant, the retry would run the action again as a first attempt, so
/// the record is made again from the outcome: reserved anew and completed
/// at once. Only a vacant scope is written; if another attempt reserved
/// it meanwhile, that attempt's record stands.
async fn recreate<S: Store>(rt: &Runtime<S>, request: &ReserveRequest, outcome: &Outcome) {
    let store = &*rt.store;
    // A record that is there but vacant was released (by an operator, or
    // by this attempt's own release that a takeover followed): it did not
    // vanish, and its release stands; the outcome is kept on it as late
    // evidence.
    let scope = request.scope.hash();
    if let Ok(Some(_)) = store.get(scope).await {
        m::count(Counted::Fenced);
        tracing::warn!(
            status = outcome.status(),
            "completion fenced: the record was released while the attempt ran; the next \
             request runs"
        );
        return;
    }
    let lease = match store.reserve(request).await {
        Ok(Reservation::Acquired(lease)) => lease,
        Ok(_) => {
            tracing::warn!(
                "the record vanished under the completion and the key was reserved again \
                 meanwhile; that record stands"
            );
            return;
        }
        Err(error) => {
            tracing::error!(%error, "the record vanished under the completion and could not be made again");
            return;
        }
    };
    match rt.store.complete(&lease, outcome).await {
        Ok(Completion::Recorded) => tracing::warn!(
            status = outcome.status(),
            "the record vanished under the completion (a failover may have lost it); made \
             again from the outcome"
        ),
        Ok(Completion::Fenced(_)) | Err(_) => tracing::error!(
            "the record vanished under the completion; making it again failed, and a retry \
             after the lease may run again"
        ),
    }
}

/// Retries a completion that failed on a store error, every 100 ms, while
/// the lease is held (renewing it), until it is recorded or fenced; after
/// a lease that lapsed with the store down, on until the store answers
/// (see below). Listed in the layer's pending completions (`pending`)
/// meanwhile: a reservation of the scope, or one the store answers,
/// has it try at once instead of after its pause.
async fn record_later<S: Store>(
    rt: Runtime<S>,
    request: ReserveRequest,
    lease: Lease,
    outcome: Outcome,
    pending: crate::pending::Registration,
) {
    let store = &*rt.store;
    let attempt = async || {
        let tried = try_record(&rt, &request, &lease, &outcome).await;
        pending.tried(tried.is_ok());
        tried
    };
    let retries = async {
        loop {
            pending.pause(Duration::from_millis(100)).await;
            match attempt().await {
                Ok(()) => return,
                Err(error) => tracing::debug!(%error, "recording the outcome failed again"),
            }
        }
    };
    if while_held(store, &lease, retries).await.is_some() {
        return;
    }
    // The lease was lost: to a newer attempt or a cancellation (the
    // completion is fenced and kept as evidence), with the record itself
    // (then it is made again from the outcome), or to time, renewals having
    // failed while the store was down. Then nothing owns the record yet,
    // and the store still takes this attempt's completion (it fences by
    // generation and owner, not by time): recording it is all that stands
    // between the next retry and a second run. So the tries go on, backing
    // off to two a second, until the store answers or the record's
    // retention has passed.
    let deadline = deadline_after(request.retention);
    let mut pause = Duration::from_millis(100);
    loop {
        match attempt().await {
            Ok(()) => return,
            Err(error) if tokio::time::Instant::now() + pause < deadline => {
                tracing::debug!(%error, "recording the outcome failed again");
                pending.pause(pause).await;
                pause = lapsed_backoff(pause);
            }
            Err(error) => {
                tracing::error!(
                    %error,
                    "the outcome could not be recorded within the record's retention"
                );
                return;
            }
        }
    }
}

/// One try of a background completion: `Ok` once the store answered
/// (see [`completed`]).
async fn try_record<S: Store>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    lease: &Lease,
    outcome: &Outcome,
) -> Result<(), StoreError> {
    let completion = rt.store.complete(lease, outcome).await?;
    if completed(rt, request, outcome, completion).await.is_none() {
        tracing::info!("outcome recorded after a store error");
    }
    Ok(())
}

/// What a completion the store answered comes to: counted; a record that
/// vanished under it made again from the outcome; `Some` with what the
/// record says now when a newer attempt or a cancellation fenced it (the
/// outcome is kept as late evidence).
async fn completed<S: Store>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    outcome: &Outcome,
    completion: Completion,
) -> Option<Current> {
    match completion {
        Completion::Recorded => {
            m::count(Counted::Executed);
            None
        }
        Completion::Fenced(Current::Vacant) => {
            m::count(Counted::Executed);
            recreate(rt, request, outcome).await;
            None
        }
        Completion::Fenced(current) => {
            m::count(Counted::Fenced);
            tracing::warn!("completion fenced: a newer attempt or a cancellation owns the record");
            Some(current)
        }
    }
}

impl<S: Store> Runtime<S> {
    /// Releases the key after a temporary failure or a dropped attempt.
    /// Answers what the record says now when the lease was lost (the
    /// attempt was superseded or cancelled), so the attempt's client can
    /// get that instead.
    pub(crate) async fn release(&self, lease: &Lease) -> Option<Current> {
        m::count(Counted::Released);
        let released = self.store.release(lease).await;
        match released {
            Ok(Release::Released) => None,
            Ok(Release::Fenced(current)) => {
                m::count(Counted::Fenced);
                Some(current)
            }
            Err(error) => {
                self.release_in_background(lease, &error);
                None
            }
        }
    }

    /// Starts [`release_later`] after a release's store error (a rare
    /// path, kept out of [`release`](Self::release)'s code).
    #[cold]
    #[inline(never)]
    fn release_in_background(&self, lease: &Lease, error: &StoreError) {
        use tracing::Instrument;
        m::count(Counted::StoreError);
        tracing::warn!(%error, "could not release the reservation yet; retrying in the background");
        // Listed before the client gets its answer: its retry finds it.
        let pending = self.pending.register(lease.scope);
        self.tasks
            .spawn(release_later(self.clone(), lease.clone(), pending).in_current_span());
    }
}

/// Retries a release the store did not take, like a completion (see
/// [`pending`](crate::pending)): at once when a reservation of its scope
/// reaches this layer (which waits for that try, so the retry the client
/// was told it may send runs instead of meeting `409`) or when the store
/// answers any reservation, else backing off to two tries a second, until
/// the store answers or the record's retention passed. A release is fenced
/// by its lease's generation and owner token: a late one changes nothing
/// of a record another attempt took over.
async fn release_later<S: Store>(
    rt: Runtime<S>,
    lease: Lease,
    pending: crate::pending::Registration,
) {
    let deadline = deadline_after(rt.config.timing.retention);
    let mut pause = Duration::from_millis(100);
    loop {
        pending.pause(pause).await;
        match rt.store.release(&lease).await {
            Ok(answer) => {
                pending.tried(true);
                if let Release::Fenced(_) = answer {
                    m::count(Counted::Fenced);
                }
                tracing::info!("reservation released after a store error");
                return;
            }
            Err(error) => {
                pending.tried(false);
                if tokio::time::Instant::now() + pause >= deadline {
                    tracing::error!(
                        %error,
                        "the reservation could not be released within the record's retention"
                    );
                    return;
                }
                tracing::debug!(%error, "releasing the reservation failed again");
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
}
