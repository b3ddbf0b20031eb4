//! One retried call: its key, its body kept for replays, each attempt
//! classified, the limits asked, and the retries and their delays.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Response, header, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower::{Service, ServiceExt, retry::budget::Budget};

use idem_core::protocol::is_grpc;

use crate::{
    backoff::{ceiling, full_jitter, parse_retry_after},
    body::{BoxError, ReplayBody},
    config::Config,
    error::{Error, RetryInfo, StopReason},
    limits::{Limits, Refusal},
};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(idem_core::protocol::IDEMPOTENCY_KEY);

fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

fn clone_parts(parts: &Parts) -> Parts {
    let (mut copy, ()) = Request::new(()).into_parts();
    copy.method = parts.method.clone();
    copy.uri = parts.uri.clone();
    copy.version = parts.version;
    copy.headers = parts.headers.clone();
    copy.extensions = parts.extensions.clone();
    copy
}

/// The outcome of one attempt.
enum Attempt<R, E> {
    Answer(Response<ReplayBody<R>>),
    Failed(E),
    TimedOut(Duration),
}

/// The most of a 409 body read to find its problem `code`.
const IN_PROGRESS_BODY_LIMIT: usize = 64 * 1024;

/// Whether an answer may be retried, and why ("503", "in_progress", ...).
async fn classify<R>(
    response: Response<R>,
) -> Result<(Response<ReplayBody<R>>, Option<String>), BoxError>
where
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    if let Some(reason) = grpc_reason(response.headers()) {
        return Ok((response.map(ReplayBody::once), reason));
    }
    let status = response.status();
    match status.as_u16() {
        408 | 425 | 429 | 502 | 503 | 504 => Ok((
            response.map(ReplayBody::once),
            Some(status.as_str().to_owned()),
        )),
        409 => {
            // Only an idempotency layer's "in progress" is worth retrying;
            // its problem document is small. A larger body is not one: it
            // reaches the caller whole, read bytes first.
            let (parts, body) = response.into_parts();
            let mut body = Box::pin(body);
            let mut read = BytesMut::new();
            while read.len() <= IN_PROGRESS_BODY_LIMIT {
                match body.frame().await {
                    Some(frame) => {
                        if let Ok(data) = frame.map_err(Into::into)?.into_data() {
                            read.extend_from_slice(&data);
                        }
                    }
                    None => break,
                }
            }
            let bytes = read.freeze();
            if bytes.len() > IN_PROGRESS_BODY_LIMIT {
                return Ok((
                    Response::from_parts(parts, ReplayBody::prefixed(bytes, body)),
                    None,
                ));
            }
            let code = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
            // An answer fetched by its key whose outcome is unknown may be
            // recorded later: asked again, as an attempt in progress is.
            let reason = match code.as_deref() {
                Some(idem_core::protocol::codes::IN_PROGRESS) => Some("in_progress".to_owned()),
                Some(idem_core::protocol::codes::OUTCOME_UNKNOWN) => {
                    Some("outcome_unknown".to_owned())
                }
                _ => None,
            };
            Ok((
                Response::from_parts(parts, ReplayBody::buffered(bytes)),
                reason,
            ))
        }
        _ => Ok((response.map(ReplayBody::once), None)),
    }
}

/// A gRPC answer whose status is in its head (a trailers-only answer, as
/// every unary failure is): `Some` with why it may be retried, or
/// `Some(None)` when it may not. The statuses retried are those after
/// which the same call with the same key may succeed, as `408`, `429`,
/// `502`, `503`, `504` and `409 idempotency_in_progress` are for HTTP (an
/// idempotency layer releases the key for all but `DEADLINE_EXCEEDED`,
/// whose outcome it keeps as unknown; a `RESOURCE_EXHAUSTED` whose problem
/// code is `request_body_too_large` is final): `UNAVAILABLE`,
/// `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED` and `ABORTED` (the layer's
/// "in progress"). `None` for any other answer.
fn grpc_reason(headers: &http::HeaderMap) -> Option<Option<String>> {
    if !is_grpc(headers) {
        return None;
    }
    let problem = headers
        .get(idem_core::protocol::GRPC_PROBLEM)
        .map(http::HeaderValue::as_bytes);
    Some(match idem_core::protocol::grpc_status(headers)? {
        14 => Some("grpc_unavailable".to_owned()),
        4 => Some("grpc_deadline_exceeded".to_owned()),
        // A message over the layer's limit is as large the next time.
        8 if problem == Some(idem_core::protocol::codes::BODY_TOO_LARGE.as_bytes()) => None,
        8 => Some("grpc_resource_exhausted".to_owned()),
        10 => Some(
            match problem {
                Some(code) if code == idem_core::protocol::codes::IN_PROGRESS.as_bytes() => {
                    "in_progress"
                }
                _ => "grpc_aborted",
            }
            .to_owned(),
        ),
        _ => None,
    })
}

/// gRPC's retry pushback (`grpc-retry-pushback-ms`), as a delay.
fn grpc_pushback(headers: &http::HeaderMap) -> Option<Duration> {
    let millis: u64 = headers
        .get("grpc-retry-pushback-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_millis(millis))
}

/// How long a gRPC request body may pause before it is taken for a
/// stream (see [`buffer_body`]).
const GRPC_STREAM_GRACE: Duration = Duration::from_millis(100);

/// The request's key: its own, or a fresh one for a method of
/// [`RetryLayer::key_methods`] (kept for every attempt).
fn ensure_key(config: &Config, parts: &mut Parts) -> Option<String> {
    let key = parts
        .headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if key.is_some() || !config.key_methods.contains(&parts.method) {
        return key;
    }
    let fresh = uuid::Uuid::new_v4().to_string();
    let value = HeaderValue::try_from(fresh.as_str()).ok()?;
    parts.headers.insert(IDEMPOTENCY_KEY, value);
    Some(fresh)
}

/// The body, buffered when it is small enough and of known length (so it
/// can be sent again); otherwise handed back to be sent once. A gRPC
/// call's body announces no length: it is read until it ends, and sent
/// once, what was read first, if it grows over the limit or pauses for
/// [`GRPC_STREAM_GRACE`] (a streaming call's messages come as the caller
/// makes them; a unary call's one message is there at once).
async fn buffer_body<B>(
    config: &Config,
    parts: &Parts,
    body: B,
) -> Result<(Option<Bytes>, Option<ReplayBody<B>>), BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let replayable = body
        .size_hint()
        .upper()
        .is_some_and(|upper| upper <= config.body_limit as u64);
    if replayable {
        let bytes = Limited::new(body, config.body_limit)
            .collect()
            .await?
            .to_bytes();
        return Ok((Some(bytes), None));
    }
    if !is_grpc(&parts.headers) {
        return Ok((None, Some(ReplayBody::once(body))));
    }
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    loop {
        let next = if read.is_empty() {
            Ok(body.frame().await)
        } else {
            tokio::time::timeout(GRPC_STREAM_GRACE, body.frame()).await
        };
        match next {
            Ok(None) => return Ok((Some(read.freeze()), None)),
            Ok(Some(frame)) => {
                if let Ok(data) = frame.map_err(Into::into)?.into_data() {
                    read.extend_from_slice(&data);
                }
            }
            Err(_paused) => break,
        }
        if read.len() > config.body_limit {
            break;
        }
    }
    Ok((None, Some(ReplayBody::prefixed(read.freeze(), body))))
}

/// Waits for the boundary's turn (see [`Limits`]); the time held, or the
/// error that stops the request before this attempt is sent.
async fn admit<E>(
    limits: &Limits,
    (boundary, owner): &(String, String),
    deadline: Option<tokio::time::Instant>,
    info: RetryInfo,
) -> Result<Duration, Error<E>> {
    match limits.admit(boundary, owner, deadline).await {
        Ok(waited) => Ok(waited),
        Err(Refusal::TooLate(wait)) => {
            metrics::counter!("idem_client_limit_refusals_total", "boundary" => boundary.clone())
                .increment(1);
            Err(Error::Limited {
                boundary: boundary.clone(),
                wait,
                info,
            })
        }
        Err(Refusal::Gate(source)) => Err(Error::Gate { source, info }),
    }
}

/// One attempt: what came back, why it may be retried (`None`: final),
/// and the `Retry-After` it asked for.
type Sent<R, E> = (Attempt<R, E>, Option<String>, Option<Duration>);

async fn send_once<S, B, R>(
    config: &Config,
    inner: S,
    request: Request<ReplayBody<B>>,
    attempt: u32,
) -> Result<Sent<R, S::Error>, Error<S::Error>>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    let span = tracing::debug_span!("attempt", attempt);
    let entered = span.enter();
    let call = inner.oneshot(request);
    drop(entered);
    let outcome = match config.attempt_timeout {
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result.map_err(Some),
            Err(_) => Err(None),
        },
        None => call.await.map_err(Some),
    };
    Ok(match outcome {
        Ok(response) => {
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| parse_retry_after(v.as_bytes(), SystemTime::now()))
                .or_else(|| grpc_pushback(response.headers()));
            let (response, reason) = classify(response).await.map_err(Error::Body)?;
            (Attempt::Answer(response), reason, retry_after)
        }
        Err(Some(error)) => (Attempt::Failed(error), Some("transport".to_owned()), None),
        Err(None) => {
            let after = config.attempt_timeout.unwrap_or_default();
            (Attempt::TimedOut(after), Some("timeout".to_owned()), None)
        }
    })
}

/// The request as the caller gets it: the answer with its [`RetryInfo`],
/// or the error.
fn finish<R, E>(
    attempt: Attempt<R, E>,
    info: RetryInfo,
) -> Result<Response<ReplayBody<R>>, Error<E>> {
    match attempt {
        Attempt::Answer(mut response) => {
            response.extensions_mut().insert(info);
            Ok(response)
        }
        Attempt::Failed(source) => Err(Error::Service { source, info }),
        Attempt::TimedOut(after) => Err(Error::TimedOut { after, info }),
    }
}

/// A provider that says "too many" (429) or "unavailable" (503) says it to
/// every worker of the boundary: until its `Retry-After`, or a backoff.
async fn share_cooldown(
    config: &Config,
    limits: &Limits,
    boundary: &str,
    status: http::StatusCode,
    retry_after: Option<Duration>,
    attempts: u32,
) {
    if matches!(status.as_u16(), 429 | 503) {
        let period =
            retry_after.unwrap_or_else(|| ceiling(config.base_delay, config.max_delay, attempts));
        limits.cool_down(boundary, period).await;
    }
}

/// What a retry needs to be allowed, for [`stop_reason`].
struct RetryPlan<'a> {
    safe: bool,
    replayable: bool,
    attempts: u32,
    deadline: Option<tokio::time::Instant>,
    delay: Duration,
    limited: Option<(&'a Limits, &'a str)>,
}

/// Why the request may not be retried, if it may not.
async fn stop_reason(config: &Config, plan: RetryPlan<'_>) -> Option<StopReason> {
    let past_deadline = plan.deadline.is_some_and(|deadline| {
        tokio::time::Instant::now()
            .checked_add(plan.delay)
            .is_none_or(|at| at > deadline)
    });
    let stop = if !plan.safe {
        StopReason::UnsafeMethod
    } else if !plan.replayable {
        StopReason::BodyNotReplayable
    } else if plan.attempts >= config.max_attempts {
        StopReason::MaxAttempts
    } else if past_deadline {
        StopReason::Deadline
    } else if !config.budget.withdraw() {
        metrics::counter!("idem_client_budget_exhausted_total").increment(1);
        StopReason::BudgetExhausted
    } else if let Some((limits, boundary)) = plan.limited
        && !limits.budget(boundary, true).await
    {
        metrics::counter!("idem_client_budget_exhausted_total").increment(1);
        StopReason::BudgetExhausted
    } else {
        return None;
    };
    Some(stop)
}

pub(crate) async fn run<S, B, R>(
    config: Arc<Config>,
    inner: S,
    request: Request<B>,
) -> Result<Response<ReplayBody<R>>, Error<S::Error>>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    // A deadline beyond what the clock can hold is no deadline.
    let deadline = tokio::time::Instant::now().checked_add(config.deadline);
    let (mut parts, body) = request.into_parts();
    let key = ensure_key(&config, &mut parts);
    let safe = key.is_some() || is_idempotent(&parts.method);
    let (buffered, mut once) = buffer_body(&config, &parts, body)
        .await
        .map_err(Error::Body)?;
    config.budget.deposit();
    let limits = config.limits.as_ref();
    let place = limits.and_then(|limits| limits.place(&parts));
    let limited = limits.zip(place.as_ref());
    if let Some((limits, (boundary, _))) = limited {
        limits.budget(boundary, false).await;
    }
    let mut held = Duration::ZERO;
    let mut attempts = 0u32;
    loop {
        let info = |attempts, held| RetryInfo {
            attempts,
            stopped: None,
            key: key.clone(),
            boundary: place.as_ref().map(|(boundary, _)| boundary.clone()),
            held,
        };
        if let Some((limits, place)) = limited {
            held += admit(limits, place, deadline, info(attempts, held)).await?;
        }
        attempts += 1;
        metrics::counter!("idem_client_attempts_total").increment(1);
        let body = match (&buffered, once.take()) {
            (Some(bytes), _) => ReplayBody::buffered(bytes.clone()),
            (None, Some(body)) => body,
            // A body sent once is never retried (see `stop_reason`).
            (None, None) => ReplayBody::buffered(Bytes::new()),
        };
        let request = Request::from_parts(clone_parts(&parts), body);
        let (attempt, reason, retry_after) =
            send_once(&config, inner.clone(), request, attempts).await?;
        let mut info = info(attempts, held);
        let Some(reason) = reason else {
            return finish(attempt, info);
        };
        let delay = retry_after
            .unwrap_or_else(|| full_jitter(config.base_delay, config.max_delay, attempts));
        if let (Some((limits, (boundary, _))), Attempt::Answer(response)) = (limited, &attempt) {
            let status = response.status();
            share_cooldown(&config, limits, boundary, status, retry_after, attempts).await;
        }
        let plan = RetryPlan {
            safe,
            replayable: buffered.is_some(),
            attempts,
            deadline,
            delay,
            limited: limited.map(|(limits, (boundary, _))| (limits, boundary.as_str())),
        };
        if let Some(stop) = stop_reason(&config, plan).await {
            metrics::counter!("idem_client_give_ups_total", "reason" => stop.label()).increment(1);
            tracing::debug!(attempts, %stop, "not retrying");
            info.stopped = Some(stop);
            return finish(attempt, info);
        }
        metrics::counter!("idem_client_retries_total", "reason" => reason.clone()).increment(1);
        tracing::debug!(attempts, reason, ?delay, "retrying");
        drop(attempt);
        tokio::time::sleep(delay).await;
    }
}
