//! One execution of the HTTP inner service under a lease (kept by the
//! [`engine`](crate::engine)): its response read within the storable
//! limit, an answer broken mid-body or never given (an unknown outcome)
//! accounted for, and the outcome settled through the engine or the
//! handler's own transaction.

use std::{collections::VecDeque, future::Future, panic::AssertUnwindSafe, time::Duration};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{
    Completion, CompletionSlot, DeferredCompletion, Lease, Outcome, ReserveRequest, Store,
    StoredResponse,
};
use tower::Service;
use tracing::Instrument;

use crate::{
    LateResponse, ResponseBody, UnknownOutcome,
    answer::{answer_current, storable_headers},
    body::BoxError,
    classify::{RemoteAnswer, Verdict},
    engine::{Lapse, renewing, settle},
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
    protocol::Protocol,
    runtime::Runtime,
};

/// What the handler produced, read as far as the storable limit.
enum Buffered<B> {
    Complete {
        /// The answer's protocol, as its head says.
        protocol: Protocol,
        parts: http::response::Parts,
        body: Bytes,
        trailers: Option<http::HeaderMap>,
    },
    /// Passed on as it comes, not stored: over the storable limit, or a
    /// gRPC answer that streams (see [`grpc`](crate::grpc)).
    Passed {
        protocol: Protocol,
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

impl<B> Buffered<B> {
    /// The answer's verdict (see [`classify`](crate::classify)), as its
    /// protocol reads it ([`Protocol::verdict`], [`Protocol::passed_verdict`]);
    /// an answer whose body failed by its HTTP status. An answer marked
    /// [`RemoteAnswer`] is an upstream's.
    fn verdict(&self, config: &crate::config::Config) -> Verdict {
        let (Buffered::Complete { parts, .. }
        | Buffered::Passed { parts, .. }
        | Buffered::Failed { parts, .. }) = self;
        let remote = parts.extensions.get::<RemoteAnswer>().is_some();
        // "Nothing ran": the request was refused before its endpoint began
        // executing; released whatever the status (docs/design.md, 1). The
        // marker may come in the head or in the trailers (where a gRPC
        // service puts its metadata).
        let in_trailers = matches!(self, Buffered::Complete { trailers: Some(trailers), .. }
            if trailers.contains_key(crate::NOTHING_RAN));
        if crate::headers::nothing_ran(parts) || in_trailers {
            return Verdict::Released;
        }
        match self {
            Buffered::Complete {
                protocol,
                parts,
                trailers,
                ..
            } => protocol.verdict(config, parts, trailers.as_ref(), remote),
            Buffered::Passed {
                protocol, parts, ..
            } => protocol.passed_verdict(config, parts, remote),
            Buffered::Failed { parts, .. } => config.classify.verdict(parts.status, None, remote),
        }
    }
}

/// The next frame of `body`: `Err` with a description when it fails or
/// panics (a body that panics fails like one that errs: its head, the
/// handler's answer, has come, so the status decides, not the panic).
async fn next_frame<B>(body: &mut B) -> Result<Option<http_body::Frame<Bytes>>, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    match AssertUnwindSafe(body.frame()).catch_unwind().await {
        Ok(None) => Ok(None),
        Ok(Some(Ok(frame))) => Ok(Some(frame)),
        Ok(Some(Err(error))) => Err(error.into()),
        Err(_panic) => Err("the response body panicked".into()),
    }
}

async fn buffer<B>(response: Response<B>, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (parts, mut body) = response.into_parts();
    let protocol = Protocol::of(&parts.headers);
    let mut framing = protocol.framing();
    let mut chunks = VecDeque::new();
    let mut total = 0usize;
    let mut trailers: Option<http::HeaderMap> = None;
    loop {
        // After the first whole message the status is due: it gets the
        // grace (trailers end an answer, so none is waited once they came).
        let status_due = trailers.is_none()
            && framing
                .as_ref()
                .is_some_and(|framing| framing.begun == 1 && framing.at_boundary());
        let next = if status_due {
            match tokio::time::timeout(crate::grpc::STREAM_GRACE, next_frame(&mut body)).await {
                Ok(next) => next,
                // The status did not follow the first message: a stream,
                // passed on from here.
                Err(_) => {
                    return Buffered::Passed {
                        protocol,
                        parts,
                        prefix: chunks,
                        rest: body,
                    };
                }
            }
        } else {
            next_frame(&mut body).await
        };
        let frame = match next {
            Ok(None) => break,
            Ok(Some(frame)) => frame,
            Err(error) => return Buffered::Failed { parts, error },
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    match &mut trailers {
                        Some(trailers) => trailers.extend(more),
                        None => trailers = Some(more),
                    }
                }
                continue;
            }
        };
        if let Some(framing) = &mut framing {
            framing.feed(&data);
        }
        let streams = framing.as_ref().is_some_and(|f| f.begun > 1);
        total += data.len();
        chunks.push_back(data);
        if total > limit || streams {
            return Buffered::Passed {
                protocol,
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
    Buffered::Complete {
        protocol,
        parts,
        body,
        trailers,
    }
}

/// A response whose body failed after its head: the status the handler
/// answered, and why its body cannot be read.
struct BodyFailed {
    status: http::StatusCode,
    error: BoxError,
}

/// The outcome of a buffered response (a stored one keeps its headers
/// but those of `denylist`, then its trailers), and the body its client
/// gets.
fn outcome_of<B>(
    buffered: Buffered<B>,
    denylist: &[http::HeaderName],
) -> Result<(http::response::Parts, ResponseBody<B>, Outcome), BodyFailed>
where
    B: Body<Data = Bytes> + Unpin,
{
    Ok(match buffered {
        Buffered::Complete {
            mut parts,
            body,
            mut trailers,
            ..
        } => {
            let status = parts.status.as_u16();
            // idem's own marker never reaches the client, nor the store.
            if let Some(trailers) = trailers.as_mut() {
                trailers.remove(crate::NOTHING_RAN);
            }
            if crate::headers::opted_out(&mut parts) {
                // The handler said not to store it: the action ran, so the
                // key stays taken, and a retry is told so.
                return Ok((
                    parts,
                    ResponseBody::full_with_trailers(body, trailers),
                    Outcome::NotStored { status },
                ));
            }
            let mut headers = storable_headers(&parts.headers, denylist);
            if let Some(trailers) = &trailers {
                crate::headers::store_trailers(trailers, &mut headers);
            }
            let stored = StoredResponse {
                status,
                headers,
                body: body.clone(),
            };
            (
                parts,
                ResponseBody::full_with_trailers(body, trailers),
                Outcome::Stored(stored),
            )
        }
        Buffered::Passed {
            mut parts,
            prefix,
            rest,
            ..
        } => {
            crate::headers::opted_out(&mut parts);
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
            if is_event_stream(response.headers()) {
                return Ok(Produced::Streaming(response));
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
        let buffered = match renewing(store, &lease, Some(&lapse), work).await {
            Ok(Ok(Produced::Answer(buffered))) => buffered,
            Ok(Ok(Produced::Unknown(response, unknown))) => {
                m::count(Counted::Unknown);
                tracing::warn!(
                    status = response.status().as_u16(),
                    "outcome unknown: the key stays reserved while a late answer may come"
                );
                let late = unknown.take_late();
                keep_unknown(&rt, &lease).await;
                rt.tasks
                    .spawn(await_late(rt.clone(), reserved, lease, late).in_current_span());
                return Ok(response.map(ResponseBody::inner));
            }
            Ok(Ok(Produced::Streaming(response))) => {
                // The action ran and its answer streams: recorded at once
                // as answered but not stored (a retry gets `409
                // idempotency_response_not_stored`, never a stream cut
                // short), and the stream goes to its client as it comes.
                let status = response.status();
                tracing::info!(
                    status = status.as_u16(),
                    "an event stream: passed on, not stored"
                );
                let outcome = Outcome::NotStored {
                    status: status.as_u16(),
                };
                let remote = response.extensions().get::<RemoteAnswer>().is_some();
                // idem's own headers never reach the client; "nothing ran"
                // releases the key here too.
                let (mut parts, body) = response.into_parts();
                let nothing_ran = crate::headers::nothing_ran(&parts);
                crate::headers::opted_out(&mut parts);
                let response = Response::from_parts(parts, body);
                let stores = !nothing_ran
                    && config.classify.verdict(status, None, remote) != Verdict::Released;
                let answer = record(&rt, &reserved, &lease, slot.as_ref(), stores, outcome).await;
                return Ok(answer.unwrap_or_else(|| response.map(ResponseBody::inner)));
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
        let (parts, body, outcome) = match outcome_of(buffered, &config.replay_denylist) {
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
            m::count(Counted::Unknown);
            tracing::warn!(
                status = parts.status.as_u16(),
                "outcome unknown: the key stays reserved until its lease lapses"
            );
            drop(slot);
            keep_unknown(&rt, &lease).await;
            rt.tasks
                .spawn(await_late(rt.clone(), reserved, lease, None).in_current_span());
            return Ok(Response::from_parts(parts, body));
        }
        if verdict == Verdict::Stored
            && parts.status.as_u16() < 400
            && slot
                .as_ref()
                .is_some_and(CompletionSlot::dropped_uncommitted)
        {
            // A success whose transaction was dropped without a commit:
            // its writes rolled back, so the success is never recorded.
            // Whatever else was handed over rolls back with it.
            drop(slot.and_then(|slot| slot.take()));
            tracing::error!(
                status = parts.status.as_u16(),
                "the handler answered a success and dropped its IdemTransaction without \
                 commit(): nothing it wrote was kept; the key is released"
            );
            let detail = "the handler answered a success but did not commit its transaction: \
                          nothing it wrote was kept, and the request may be retried";
            return Ok(match rt.release(&lease).await.and_then(answer_current) {
                Some(answer) => answer,
                None => problem(ProblemCode::TransactionNotCommitted, detail, None),
            });
        }
        let answer = record(&rt, &reserved, &lease, slot.as_ref(), stores, outcome).await;
        Ok(answer.unwrap_or_else(|| Response::from_parts(parts, body)))
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
    let max_response = config.max_response;
    let answer = tokio::time::timeout(config.unknown_wait, async move {
        let response = late.await?;
        Some(buffer(response, max_response).await)
    });
    let (verdict, produced) = match renewing(&*rt.store, &lease, None, answer).await {
        Ok(Some(buffered)) => (
            buffered.verdict(config),
            outcome_of(buffered, &config.replay_denylist),
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
