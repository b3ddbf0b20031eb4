//! Answers built from what a record says: replays, in progress, cancelled.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use idem_core::{Current, Outcome, Replay};

use crate::{
    ResponseBody,
    encoding::Fit,
    headers::IDEMPOTENT_REPLAYED,
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
};

/// The answer for a fenced attempt's client: what the record says now.
/// `None` when the record is vacant: the attempt's own response is then
/// the only evidence of what happened, and its client gets it.
pub(crate) fn answer_current<B>(current: Current) -> Option<Response<ResponseBody<B>>> {
    match current {
        Current::Vacant => None,
        Current::Processing { retry_after } => Some(in_progress(retry_after)),
        Current::Completed(replay) => Some(replay_response(replay)),
        Current::Cancelled => Some(cancelled()),
    }
}

pub(crate) fn storable_headers(
    headers: &HeaderMap,
    denylist: &[HeaderName],
) -> Vec<(HeaderName, Bytes)> {
    // `idem-sealed` is idem's own name for a sealed response: a handler's
    // header of that name is never stored, so no stored response is taken
    // for a sealed one.
    headers
        .iter()
        .filter(|(name, _)| {
            !denylist.contains(name)
                && **name != crate::sealing::SEALED
                && **name != crate::headers::STORED_TRAILER
        })
        .map(|(name, value)| (name.clone(), Bytes::copy_from_slice(value.as_bytes())))
        .collect()
}

/// The longest `Retry-After` hint of a `409 idempotency_in_progress`.
const IN_PROGRESS_HINT: Duration = Duration::from_secs(2);

/// `409 idempotency_in_progress`, with a short `Retry-After` hint: whole
/// seconds, at least 1, at most 2 and never more than the lease left
/// (rounded down). Most attempts finish well before their lease; a hint
/// of the whole lease (30 s by default) would outlast a client's deadline.
pub(crate) fn in_progress<B>(lease_left: Duration) -> Response<ResponseBody<B>> {
    in_progress_about(lease_left, None)
}

/// [`in_progress`] pointing to the record it collided with.
pub(crate) fn in_progress_about<B>(
    lease_left: Duration,
    record: Option<crate::problem::RecordRef>,
) -> Response<ResponseBody<B>> {
    m::count(Counted::InProgress);
    let detail = "a request with this Idempotency-Key is being processed; retry later";
    let hint = Duration::from_secs(lease_left.min(IN_PROGRESS_HINT).as_secs().max(1));
    crate::problem::problem_about(ProblemCode::InProgress, detail, Some(hint), record)
}

pub(crate) fn cancelled<B>() -> Response<ResponseBody<B>> {
    m::count(Counted::Cancelled);
    problem(
        ProblemCode::Cancelled,
        "the request with this Idempotency-Key was cancelled",
        None,
    )
}

/// [`replay_response`] for a retry with `request`'s headers: a content
/// coding the retry does not accept is decoded (within `limit`) or refused
/// (see [`encoding`](crate::encoding)).
pub(crate) fn replay_to<B>(
    request: &http::HeaderMap,
    mut replay: Replay,
    limit: usize,
) -> Response<ResponseBody<B>> {
    if let Outcome::Stored(stored) = &mut replay.outcome {
        match crate::encoding::fit(&stored.headers, &stored.body, request, limit) {
            Fit::AsIs => {}
            Fit::Decoded(body) => {
                stored.body = body;
                stored
                    .headers
                    .retain(|(name, _)| !crate::encoding::describes_coding(name));
            }
            Fit::Refused(coding) => {
                m::count(Counted::Replayed);
                let detail = format!(
                    "the request with this Idempotency-Key completed with status {}; its \
                     response is coded {coding}, which this request's Accept-Encoding does not \
                     accept, and it cannot be decoded here",
                    stored.status
                );
                let mut response = problem(ProblemCode::ReplayNotAcceptable, &detail, None);
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                return response;
            }
        }
    }
    replay_response(replay)
}

/// A stored outcome as a response, with `Idempotent-Replayed: true`.
pub(crate) fn replay_response<B>(replay: Replay) -> Response<ResponseBody<B>> {
    m::count(Counted::Replayed);
    m::replay_age(replay.age);
    let stored = match replay.outcome {
        Outcome::Stored(stored) => stored,
        Outcome::NotStored { status } => {
            let detail = format!(
                "the request with this Idempotency-Key completed with status {status}, but its \
                 response was not stored (it exceeded the storable limit, its body failed \
                 before it was read whole, or the service asked not to store it) and cannot \
                 be replayed"
            );
            let mut response = problem(ProblemCode::ResponseNotStored, &detail, None);
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            return response;
        }
    };
    let mut headers = stored.headers;
    let trailers = crate::headers::take_trailers(&mut headers);
    let mut response = Response::new(ResponseBody::full_with_trailers(stored.body, trailers));
    *response.status_mut() = http::StatusCode::from_u16(stored.status)
        .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let out = response.headers_mut();
    for (name, value) in headers {
        if let Ok(value) = HeaderValue::from_maybe_shared(value) {
            out.append(name, value);
        }
    }
    out.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
