//! One execution of the inner service under a lease, and the recording of
//! its outcome.

use std::{
    collections::VecDeque,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, future::Fuse};
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{
    Completion, CompletionSlot, Current, DeferredCompletion, Lease, Outcome, Renewal, Reservation,
    ReserveRequest, Store, StoreError, StoredResponse,
};
use tower::Service;
use tracing::Instrument;

use crate::{
    LateResponse, ResponseBody, UnknownOutcome,
    answer::{answer_current, storable_headers},
    body::BoxError,
    config::Config,
    metrics::{self as m, Outcome as Counted, StoreOp},
    problem::{ProblemCode, problem},
    runtime::{Runtime, commit_call, deadline_after, store_call},
};

/// What the handler produced, read as far as the storable limit.
enum Buffered<B> {
    Complete {
        parts: http::response::Parts,
        body: Bytes,
    },
    TooLarge {
        parts: http::response::Parts,
        prefix: VecDeque<Bytes>,
        rest: B,
    },
    /// The body failed after the head (`parts`) had come: the handler
    /// answered, but its answer cannot be read whole.
    Failed {
        parts: http::response::Parts,
        error: BoxError,
    },
}

async fn buffer<B>(response: Response<B>, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (parts, mut body) = response.into_parts();
    let mut chunks = VecDeque::new();
    let mut total = 0usize;
    // A body that panics fails like one that errs: its head (the
    // handler's answer) has come, so the status decides, not the panic.
    loop {
        let frame = match AssertUnwindSafe(body.frame()).catch_unwind().await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(error))) => {
                return Buffered::Failed {
                    parts,
                    error: error.into(),
                };
            }
            Err(_panic) => {
                return Buffered::Failed {
                    parts,
                    error: "the response body panicked".into(),
                };
            }
        };
        // Trailers are not stored.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        chunks.push_back(data);
        if total > limit {
            return Buffered::TooLarge {
                parts,
                prefix: chunks,
                rest: body,
            };
        }
    }
    let body = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut joined = BytesMut::with_capacity(total);
            chunks
                .iter()
                .for_each(|chunk| joined.extend_from_slice(chunk));
            joined.freeze()
        }
    };
    Buffered::Complete { parts, body }
}

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
async fn keep_alive<S: Store>(
    config: &Config,
    store: &S,
    lease: &Lease,
    lapse: Option<&Lapse<'_>>,
) {
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
        match store_call(config, StoreOp::Renew, store.renew(lease)).await {
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
    config: &'a Config,
    store: &'a S,
    lease: &'a Lease,
    lapse: Option<&'a Lapse<'a>>,
    work: W,
) -> impl Future<Output = W::Output> + 'a {
    Renewing {
        work,
        keeper: keep_alive(config, store, lease, lapse).fuse(),
    }
}

/// Drives `work` while the lease is held; `None` once it is lost.
fn while_held<'a, S: Store, W: Future + 'a>(
    config: &'a Config,
    store: &'a S,
    lease: &'a Lease,
    work: W,
) -> impl Future<Output = Option<W::Output>> + 'a {
    WhileHeld {
        work,
        keeper: keep_alive(config, store, lease, None),
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

/// Records what an attempt produced: stores the outcome, or releases the
/// key when the predicate calls the status temporary. Answers what the
/// record says now when the attempt was fenced. A completion that hits a
/// store error is retried in the background (see `record_later`).
pub(crate) async fn settle<S: Store>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    lease: &Lease,
    status: http::StatusCode,
    outcome: Outcome,
) -> Option<Current> {
    if !(rt.config.should_store)(status) {
        return rt.release(lease).await;
    }
    match store_call(
        &rt.config,
        StoreOp::Complete,
        rt.store.complete(lease, &outcome),
    )
    .await
    {
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

/// A completion found no record at all: the store lost it (a failover
/// that dropped an unreplicated write, say), while the action ran. Left
/// vacant, the retry would run the action again as a first attempt, so
/// the record is made again from the outcome: reserved anew and completed
/// at once. Only a vacant scope is written; if another attempt reserved
/// it meanwhile, that attempt's record stands.
async fn recreate<S: Store>(rt: &Runtime<S>, request: &ReserveRequest, outcome: &Outcome) {
    let config = &*rt.config;
    let store = &*rt.store;
    let lease = match store_call(config, StoreOp::Reserve, store.reserve(request)).await {
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
    match store_call(config, StoreOp::Complete, store.complete(&lease, outcome)).await {
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

/// A response whose body failed after its head: the status the handler
/// answered, and why its body cannot be read.
struct BodyFailed {
    status: http::StatusCode,
    error: BoxError,
}

/// The outcome of a buffered response, and the body its client gets.
fn outcome_of<B>(
    buffered: Buffered<B>,
) -> Result<(http::response::Parts, ResponseBody<B>, Outcome), BodyFailed>
where
    B: Body<Data = Bytes> + Unpin,
{
    Ok(match buffered {
        Buffered::Complete { parts, body } => {
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: Vec::new(),
                body: body.clone(),
            };
            (parts, ResponseBody::full(body), Outcome::Stored(stored))
        }
        Buffered::TooLarge {
            parts,
            prefix,
            rest,
        } => {
            let status = parts.status.as_u16();
            (
                parts,
                ResponseBody::prefixed(prefix, rest),
                Outcome::NotStored { status },
            )
        }
        Buffered::Failed { parts, error } => {
            return Err(BodyFailed {
                status: parts.status,
                error,
            });
        }
    })
}

/// What the inner service produced.
enum Produced<B> {
    /// An answer, buffered up to the storable limit.
    Answer(Buffered<B>),
    /// A response whose outcome the inner service does not know.
    Unknown(Response<B>, UnknownOutcome),
}

/// One execution of the handler under `lease`, and the recording of its
/// outcome.
// An async block, not an `async fn`, as the service's `handle` says.
#[allow(clippy::manual_async_fn)]
pub(crate) fn attempt<I, S, ReqBody, ResBody>(
    rt: Runtime<S>,
    mut inner: I,
    mut request: Request<ReqBody>,
    reserved: ReserveRequest,
    lease: Lease,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S: Store,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    async move {
        let config = &*rt.config;
        let store = &*rt.store;
        let max_response = config.max_response;
        // Lists the attempt if its lease lapses while it runs; dropped
        // last, after its outcome was recorded or handed on.
        let lapse = Lapse::new(&rt.pending);
        // Where a handler leaves a transaction to commit with the outcome,
        // on a store a handler's transaction can complete.
        let slot = store.completes_in_transactions().then(|| {
            let slot = CompletionSlot::new();
            request.extensions_mut().insert(slot.clone());
            slot
        });
        let work = AssertUnwindSafe(async move {
            let mut response = inner.call(request).await?;
            if let Some(unknown) = response.extensions_mut().remove::<UnknownOutcome>() {
                return Ok(Produced::Unknown(response, unknown));
            }
            // An informational status is no final answer to the request:
            // the handler acted (or may have), so the key is kept as for
            // an unknown outcome, never released.
            if response.status().is_informational() {
                return Ok(Produced::Unknown(response, UnknownOutcome::new()));
            }
            Ok(Produced::Answer(buffer(response, max_response).await))
        })
        .catch_unwind();
        // A failed attempt releases the key; if it was superseded meanwhile,
        // its client gets what the record says now instead of its own failure.
        let (rt_ref, lease_ref) = (&rt, &lease);
        let failed = |detail: String| async move {
            match rt_ref.release(lease_ref).await.and_then(answer_current) {
                Some(answer) => answer,
                None => problem(ProblemCode::HandlerFailed, &detail, None),
            }
        };
        let buffered = match renewing(config, store, &lease, Some(&lapse), work).await {
            Ok(Ok(Produced::Answer(buffered))) => buffered,
            Ok(Ok(Produced::Unknown(response, unknown))) => {
                m::count(Counted::Unknown);
                tracing::warn!(
                    status = response.status().as_u16(),
                    "outcome unknown: the key stays reserved while a late answer may come"
                );
                let late = unknown.take_late();
                rt.tasks
                    .spawn(await_late(rt.clone(), reserved, lease, late).in_current_span());
                return Ok(response.map(ResponseBody::inner));
            }
            Ok(Err(error)) => {
                return match rt.release(&lease).await.and_then(answer_current) {
                    Some(answer) => Ok(answer),
                    None => Err(error),
                };
            }
            Err(_panic) => return Ok(failed("the handler panicked".to_owned()).await),
        };
        let (parts, body, mut outcome) = match outcome_of(buffered) {
            Ok(produced) => produced,
            Err(lost) => {
                // A transaction the handler left is rolled back as it is
                // dropped here: nothing it wrote happened, and the key is
                // released for the retry.
                if slot.and_then(|slot| slot.take()).is_some() {
                    let detail = format!("the handler's response body failed: {}", lost.error);
                    return Ok(failed(detail).await);
                }
                return Ok(body_lost(&rt, &reserved, &lease, lost).await);
            }
        };
        if let Outcome::Stored(stored) = &mut outcome {
            stored.headers = storable_headers(&parts.headers, &config.replay_denylist);
        }
        let answer = match slot.and_then(|slot| slot.take()) {
            Some(deferred) if (config.should_store)(parts.status) => {
                settle_in_transaction(&rt, &lease, deferred, outcome).await
            }
            // Not recorded: a deferred transaction is dropped, which rolls
            // back what the handler wrote, and the key is released.
            _ => settle(&rt, &reserved, &lease, parts.status, outcome)
                .await
                .and_then(answer_current),
        };
        Ok(answer.unwrap_or_else(|| Response::from_parts(parts, body)))
    }
}

/// A response whose head came but whose body failed: the handler ran
/// and answered `status`, so running it again on a retry could repeat its
/// action (an upstream that broke the connection mid-body has done its
/// work). A status the layer stores is recorded as completed without its
/// response, as a response over the storable limit is: this client and
/// every retry get `409 idempotency_response_not_stored`, and nothing runs
/// again. A status the layer does not store releases the key, as it would
/// have with its body.
async fn body_lost<S: Store, B>(
    rt: &Runtime<S>,
    request: &ReserveRequest,
    lease: &Lease,
    lost: BodyFailed,
) -> Response<ResponseBody<B>> {
    let BodyFailed { status, error } = lost;
    let code = status.as_u16();
    let stored = (rt.config.should_store)(status);
    tracing::warn!(%error, status = code, stored, "the response body failed after its head");
    let outcome = Outcome::NotStored { status: code };
    if let Some(answer) = settle(rt, request, lease, status, outcome)
        .await
        .and_then(answer_current)
    {
        return answer;
    }
    if stored {
        let detail = format!(
            "the handler answered {code}, but its response body failed before it was read \
             whole ({error}); the outcome is recorded without the response, and retries get \
             this answer without running it again"
        );
        problem(ProblemCode::ResponseNotStored, &detail, None)
    } else {
        let detail = format!("the handler answered {code}, but its response body failed ({error})");
        problem(ProblemCode::HandlerFailed, &detail, None)
    }
}

/// Records the outcome through the transaction the handler left: one
/// commit makes the handler's writes and the outcome durable together.
/// `None` lets the handler's response through; otherwise its client gets
/// the answer, since nothing the handler wrote was committed (or whether
/// it was is unknown).
async fn settle_in_transaction<S: Store, B>(
    rt: &Runtime<S>,
    lease: &Lease,
    deferred: Box<dyn DeferredCompletion>,
    outcome: Outcome,
) -> Option<Response<ResponseBody<B>>> {
    let commit = deferred.commit(lease.clone(), outcome);
    match commit_call(&rt.config, commit).await {
        Ok(Completion::Recorded) => {
            m::count(Counted::Executed);
            None
        }
        Ok(Completion::Fenced(current)) => {
            m::count(Counted::Fenced);
            tracing::warn!(
                "transactional completion fenced: a newer attempt or a cancellation owns the \
                 record; the handler's writes were rolled back"
            );
            Some(answer_current(current).unwrap_or_else(|| {
                unavailable(
                    "the attempt lost its lease before its transaction committed; nothing was \
                     committed; retry",
                )
            }))
        }
        Err(error) => {
            m::count(Counted::StoreError);
            tracing::error!(%error, "the transaction with the outcome did not commit, or its commit is unknown");
            Some(unavailable(
                "the transaction holding the outcome did not commit, or its commit is unknown; \
                 a retry replays the outcome if it did and runs again if it did not",
            ))
        }
    }
}

/// `503 idempotency_store_unavailable` with a 1 s `Retry-After`.
fn unavailable<B>(detail: &str) -> Response<ResponseBody<B>> {
    problem(
        ProblemCode::StoreUnavailable,
        detail,
        Some(Duration::from_secs(1)),
    )
}

/// After an unknown outcome: waits (bounded, renewing the lease) for the
/// late answer and records it, so that a retry replays it. If none comes,
/// the lease is left to lapse: a later retry takes over with the next
/// generation, which the executor can see.
async fn await_late<S: Store>(
    rt: Runtime<S>,
    request: ReserveRequest,
    lease: Lease,
    late: Option<futures_util::future::BoxFuture<'static, Option<LateResponse>>>,
) {
    let Some(late) = late else {
        tracing::warn!("outcome unknown and no answer can come; the lease will lapse");
        return;
    };
    let config = &*rt.config;
    let max_response = config.max_response;
    let answer = tokio::time::timeout(config.unknown_wait, async move {
        let response = late.await?;
        Some(buffer(response, max_response).await)
    });
    let produced = match renewing(config, &*rt.store, &lease, None, answer).await {
        Ok(Some(buffered)) => outcome_of(buffered),
        Ok(None) | Err(_) => {
            tracing::warn!("no late answer came; the lease will lapse and a retry takes over");
            return;
        }
    };
    match produced {
        Ok((parts, _, mut outcome)) => {
            if let Outcome::Stored(stored) = &mut outcome {
                stored.headers = storable_headers(&parts.headers, &config.replay_denylist);
            }
            tracing::info!(
                status = parts.status.as_u16(),
                "late answer arrived; recording it"
            );
            let _ = settle(&rt, &request, &lease, parts.status, outcome).await;
        }
        Err(lost) => {
            let _ = body_lost::<_, ()>(&rt, &request, &lease, lost).await;
        }
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
    let config = &*rt.config;
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
    if while_held(config, store, &lease, retries).await.is_some() {
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
    let call = rt.store.complete(lease, outcome);
    let completion = store_call(&rt.config, StoreOp::Complete, call).await?;
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

/// The pause after `pause` between the tries of an attempt whose lease
/// lapsed with the store down (its renewals, or the recording of its
/// outcome): doubled, to at most 500 ms, so a store that comes back takes
/// them within that, before most retries arrive.
fn lapsed_backoff(pause: Duration) -> Duration {
    (pause * 2).min(Duration::from_millis(500))
}
