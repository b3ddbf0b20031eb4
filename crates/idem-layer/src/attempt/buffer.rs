//! Reading the handler's answer as far as the storable limit (a gRPC
//! answer as messages), its verdict, and the outcome it makes.

use std::{collections::VecDeque, panic::AssertUnwindSafe};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{Outcome, StoredResponse};

use crate::{
    ResponseBody,
    answer::storable_headers,
    body::BoxError,
    classify::{RemoteAnswer, Verdict},
    protocol::Protocol,
};

/// What the handler produced, read as far as the storable limit.
pub(super) enum Buffered<B> {
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
    pub(super) fn verdict(&self, config: &crate::config::Config) -> Verdict {
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
            Buffered::Failed { parts, .. } => {
                config.answers.classify.verdict(parts.status, None, remote)
            }
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

pub(super) async fn buffer<B>(response: Response<B>, limit: usize) -> Buffered<B>
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
    let body = joined(chunks, total);
    Buffered::Complete {
        protocol,
        parts,
        body,
        trailers,
    }
}

/// `chunks` (`total` bytes) as one: a single chunk as it is, without a
/// copy.
fn joined(mut chunks: VecDeque<Bytes>, total: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut joined = BytesMut::with_capacity(total);
            chunks
                .iter()
                .for_each(|chunk| joined.extend_from_slice(chunk));
            joined.freeze()
        }
    }
}

/// Gives a buffered answer the length of the bytes its client gets: a
/// `Content-Length` the body contradicts (a producer's mistake, or an
/// upstream that sent one beside `Transfer-Encoding`, whose chunks were
/// decoded) would frame the client's connection wrongly and differ from
/// the replay, whose length is the stored body's. One agreeing header is
/// left as it is.
fn frame_exactly(headers: &mut http::HeaderMap, len: usize) {
    let mut values = headers.get_all(http::header::CONTENT_LENGTH).iter();
    let agrees = match (values.next(), values.next()) {
        (None, _) => return,
        (Some(value), None) => value.as_bytes() == itoa::Buffer::new().format(len).as_bytes(),
        _ => false,
    };
    if !agrees {
        headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    }
}

/// A response whose body failed after its head: the status the handler
/// answered, and why its body cannot be read.
pub(super) struct BodyFailed {
    pub(super) status: http::StatusCode,
    pub(super) error: BoxError,
}

/// The outcome of a buffered response (a stored one keeps its headers
/// but those of `denylist`, then its trailers), and the body its client
/// gets.
pub(super) fn outcome_of<B>(
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
            frame_exactly(&mut parts.headers, body.len());
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
