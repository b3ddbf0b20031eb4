//! One execution of the HTTP inner service under a lease (kept by the
//! [`engine`](crate::engine)): its response read within the storable
//! limit, an answer broken mid-body or never given (an unknown outcome)
//! accounted for, and the outcome settled through the engine or the
//! handler's own transaction.

use std::{future::Future, panic::AssertUnwindSafe, time::Duration};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use idem_core::{
    Completion, CompletionSlot, DeferredCompletion, Lease, Outcome, ReserveRequest, Store,
};
use tower::Service;
use tracing::Instrument;

mod buffer;

use buffer::{BodyFailed, Buffered, buffer, outcome_of};

use crate::{
    LateResponse, ResponseBody, UnknownOutcome,
    answer::answer_current,
    body::BoxError,
    classify::{RemoteAnswer, Verdict},
    engine::{Lapse, renewing, settle},
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
    runtime::Runtime,
};

/// What the inner service produced.
enum Produced<B> {
    /// An answer, buffered up to the storable limit.
    Answer(Buffered<B>),
    /// A response whose outcome the inner service does not know.
    Unknown(Response<B>, UnknownOutcome),
    /// A stream of events (`text/event-stream`): passed on as it comes,
    /// never stored.
    Streaming(Response<B>),
}

/// Whether a response is a stream of events (server-sent events), which
/// the layer passes on as it comes instead of reading it whole: a stream
/// may not end, and its first caller must not wait for the limit to fill.
pub(crate) fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value
                .split(';')
                .next()
                .is_some_and(|kind| kind.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// Calls the inner service and reads what it produced: an answer read up
/// to `max_response`, an unknown outcome (marked so, or an informational
/// status: no final answer, yet the handler acted or may have, so the key
/// is kept as for an unknown outcome, never released), or an event
/// stream.
// An async block, not an `async fn`, as the service's `handle` says.
#[allow(clippy::manual_async_fn)]
fn produce<I, ReqBody, ResBody>(
    mut inner: I,
    request: Request<ReqBody>,
    max_response: usize,
) -> impl Future<Output = Result<Produced<ResBody>, I::Error>>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    async move {
        let mut response = inner.call(request).await?;
        if let Some(unknown) = response.extensions_mut().remove::<UnknownOutcome>() {
            return Ok(Produced::Unknown(response, unknown));
        }
        if response.status().is_informational() {
            return Ok(Produced::Unknown(response, UnknownOutcome::new()));
        }
        if is_event_stream(response.headers()) {
            return Ok(Produced::Streaming(response));
        }
        Ok(Produced::Answer(buffer(response, max_response).await))
    }
}

/// One execution of the handler under `lease`, and the recording of its
/// outcome.
// An async block, not an `async fn`, as the service's `handle` says.
#[allow(clippy::manual_async_fn)]
pub(crate) fn attempt<I, S, ReqBody, ResBody>(
    rt: Runtime<S>,
    inner: I,
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
        let max_response = config.answers.max_response;
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
        let work = AssertUnwindSafe(produce(inner, request, max_response)).catch_unwind();
        // A failed attempt releases the key; if it was superseded meanwhile,
        // its client gets what the record says now instead of its own failure.
        let (rt_ref, lease_ref) = (&rt, &lease);
        let failed = |detail: String| async move {
            match rt_ref.release(lease_ref).await.and_then(answer_current) {
                Some(answer) => answer,
                None => problem(ProblemCode::HandlerFailed, &detail, None),
            }
        };
        let buffered = match renewing(store, &lease, Some(&lapse), work).await {
            Ok(Ok(Produced::Answer(buffered))) => buffered,
            Ok(Ok(Produced::Unknown(response, unknown))) => {
                let (status, late) = (response.status().as_u16(), unknown.take_late());
                let until = "while a late answer may come";
                kept_unknown(&rt, reserved, lease, status, late, until).await;
                return Ok(response.map(ResponseBody::inner));
            }
            Ok(Ok(Produced::Streaming(response))) => {
                return Ok(streamed(&rt, &reserved, &lease, slot.as_ref(), response).await);
            }
            Ok(Err(error)) => {
                return match rt.release(&lease).await.and_then(answer_current) {
                    Some(answer) => Ok(answer),
                    None => Err(error),
                };
            }
            Err(_panic) => return Ok(failed("the handler panicked".to_owned()).await),
        };
        let verdict = buffered.verdict(config);
        // A body that fails after an unknown head is answered, not
        // released: nothing runs again.
        let stores = verdict != Verdict::Released;
        let (parts, body, outcome) = match outcome_of(buffered, &config.answers.replay_denylist) {
            Ok(produced) => produced,
            Err(lost) => {
                // A transaction the handler left is rolled back as it is
                // dropped here: nothing it wrote happened, and the key is
                // released for the retry.
                if slot.and_then(|slot| slot.take()).is_some() {
                    let detail = format!("the handler's response body failed: {}", lost.error);
                    return Ok(failed(detail).await);
                }
                return Ok(body_lost(&rt, &reserved, &lease, lost, stores).await);
            }
        };
        if verdict == Verdict::Unknown {
            // The action may have run (a deadline, an upstream's 504): the
            // key stays reserved under its lease, never released at once.
            // A transaction the handler left is dropped: rolled back.
            drop(slot);
            let status = parts.status.as_u16();
            kept_unknown(&rt, reserved, lease, status, None, "until its lease lapses").await;
            return Ok(Response::from_parts(parts, body));
        }
        if verdict == Verdict::Stored
            && parts.status.as_u16() < 400
            && slot
                .as_ref()
                .is_some_and(CompletionSlot::dropped_uncommitted)
        {
            return Ok(uncommitted(&rt, &lease, slot, parts.status.as_u16()).await);
        }
        let answer = record(&rt, &reserved, &lease, slot.as_ref(), stores, outcome).await;
        Ok(answer.unwrap_or_else(|| Response::from_parts(parts, body)))
    }
}

/// An outcome the attempt does not know (it may have acted): counted and
/// logged, kept in the record's history, and its late answer (if one can
/// come) awaited in the background; the key stays reserved meanwhile.
async fn kept_unknown<S: Store>(
    rt: &Runtime<S>,
    reserved: ReserveRequest,
    lease: Lease,
    status: u16,
    late: Option<futures_util::future::BoxFuture<'static, Option<LateResponse>>>,
    until: &str,
) {
    m::count(Counted::Unknown);
    tracing::warn!(status, "outcome unknown: the key stays reserved {until}");
    keep_unknown(rt, &lease).await;
    rt.tasks
        .spawn(await_late(rt.clone(), reserved, lease, late).in_current_span());
}

/// The action ran and its answer streams: recorded at once as answered
/// but not stored (a retry gets `409 idempotency_response_not_stored`,
/// never a stream cut short), and the stream goes to its client as it
/// comes.
async fn streamed<S: Store, B>(
    rt: &Runtime<S>,
    reserved: &ReserveRequest,
    lease: &Lease,
    slot: Option<&CompletionSlot>,
    response: Response<B>,
) -> Response<ResponseBody<B>> {
    let status = response.status();
    tracing::info!(
        status = status.as_u16(),
        "an event stream: passed on, not stored"
    );
    let outcome = Outcome::NotStored {
        status: status.as_u16(),
    };
    let remote = response.extensions().get::<RemoteAnswer>().is_some();
    // idem's own headers never reach the client; "nothing ran" releases
    // the key here too.
    let (mut parts, body) = response.into_parts();
    let nothing_ran = crate::headers::nothing_ran(&parts);
    crate::headers::opted_out(&mut parts);
    let response = Response::from_parts(parts, body);
    let stores = !nothing_ran
        && rt.config.answers.classify.verdict(status, None, remote) != Verdict::Released;
    let answer = record(rt, reserved, lease, slot, stores, outcome).await;
    answer.unwrap_or_else(|| response.map(ResponseBody::inner))
}

/// A success whose transaction was dropped without a commit: its writes
/// rolled back, so the success is never recorded, and whatever else was
/// handed over rolls back with it; the key is released.
async fn uncommitted<S: Store, B>(
    rt: &Runtime<S>,
    lease: &Lease,
    slot: Option<CompletionSlot>,
    status: u16,
) -> Response<ResponseBody<B>> {
    drop(slot.and_then(|slot| slot.take()));
    tracing::error!(
        status,
        "the handler answered a success and dropped its IdemTransaction without commit(): \
         nothing it wrote was kept; the key is released"
    );
    let detail = "the handler answered a success but did not commit its transaction: nothing \
                  it wrote was kept, and the request may be retried";
    match rt.release(lease).await.and_then(answer_current) {
        Some(answer) => answer,
        None => problem(ProblemCode::TransactionNotCommitted, detail, None),
    }
}

/// Records an attempt's outcome: through the transaction the handler
/// left, if it left one and the status is stored; else in the store (or
/// the key is released, for a status not stored: a deferred transaction
/// is then dropped, which rolls back what the handler wrote). `Some` with
/// what the record says now when the attempt was fenced.
async fn record<S: Store, B>(
    rt: &Runtime<S>,
    reserved: &ReserveRequest,
    lease: &Lease,
    slot: Option<&CompletionSlot>,
    stores: bool,
    outcome: Outcome,
) -> Option<Response<ResponseBody<B>>> {
    match slot.and_then(CompletionSlot::take) {
        Some(deferred) if stores => settle_in_transaction(rt, lease, deferred, outcome).await,
        _ => settle(rt, reserved, lease, stores, outcome)
            .await
            .and_then(answer_current),
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
    stored: bool,
) -> Response<ResponseBody<B>> {
    let BodyFailed { status, error } = lost;
    let code = status.as_u16();
    tracing::warn!(%error, status = code, stored, "the response body failed after its head");
    let outcome = Outcome::NotStored { status: code };
    if let Some(answer) = settle(rt, request, lease, stored, outcome)
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
    let committed = rt.store.commit(lease, deferred, outcome).await;
    match committed {
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

/// Keeps in the record's history that the attempt's caller is answered
/// that its outcome is unknown, before the answer goes out: whoever reads
/// the record afterwards (the records API, an operator) sees it.
async fn keep_unknown<S: Store>(rt: &Runtime<S>, lease: &Lease) {
    let marked = rt.store.mark_unknown(lease).await;
    if let Err(error) = marked {
        tracing::warn!(%error, "the unknown outcome could not be kept in the record's history");
    }
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
    let max_response = config.answers.max_response;
    let answer = tokio::time::timeout(config.timing.unknown_wait, async move {
        let response = late.await?;
        Some(buffer(response, max_response).await)
    });
    let (verdict, produced) = match renewing(&*rt.store, &lease, None, answer).await {
        Ok(Some(buffered)) => (
            buffered.verdict(config),
            outcome_of(buffered, &config.answers.replay_denylist),
        ),
        Ok(None) | Err(_) => {
            tracing::warn!("no late answer came; the lease will lapse and a retry takes over");
            return;
        }
    };
    if verdict == Verdict::Unknown {
        tracing::warn!(
            "the late answer is unknown too; the lease will lapse and a retry takes over"
        );
        return;
    }
    let stores = verdict == Verdict::Stored;
    match produced {
        Ok((parts, _, outcome)) => {
            tracing::info!(
                status = parts.status.as_u16(),
                "late answer arrived; recording it"
            );
            let _ = settle(&rt, &request, &lease, stores, outcome).await;
        }
        Err(lost) => {
            let _ = body_lost::<_, ()>(&rt, &request, &lease, lost, stores).await;
        }
    }
}
