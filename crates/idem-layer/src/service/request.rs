//! A keyed request's parts the layer reads before it reserves: its key
//! (or why it has none), and its body within the limit and the timeout,
//! with what its fingerprint covers.

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Response, header, request::Parts};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::KeyError;

use crate::{
    ResponseBody,
    body::{BoxError, within},
    config::Config,
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
    protocol::Protocol,
};

/// The refusal of a request of a protected method without a usable key:
/// `error` when its key is malformed or repeated, else none came and the
/// layer requires one. Counted as rejected.
pub(super) fn key_refusal<R>(
    error: Option<KeyError>,
    method: &Method,
) -> Response<ResponseBody<R>> {
    m::count(Counted::Rejected);
    match error {
        Some(error) => problem(ProblemCode::KeyInvalid, &error.to_string(), None),
        None => {
            let detail = format!("{method} requests must carry an Idempotency-Key header");
            problem(ProblemCode::KeyMissing, &detail, None)
        }
    }
}

/// A keyed request's body, and what its fingerprint covers when it is
/// not that body (see [`Protocol::fingerprinted`]: a gRPC call is
/// fingerprinted over its message uncompressed, and a streaming call is
/// refused before anything runs); or the refusal.
pub(super) async fn read<B, R>(
    parts: &Parts,
    body: B,
    protocol: Protocol,
    config: &Config,
) -> Result<(Bytes, Option<Bytes>), Response<ResponseBody<R>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = config.fingerprints.max_body;
    let body = read_body(parts, body, limit, config.timing.body_timeout).await?;
    match protocol.fingerprinted(parts, &body, limit) {
        Ok(print) => Ok((body, print)),
        Err((code, detail)) => Err(problem(code, &detail, None)),
    }
}

/// Reads a keyed request's body within the limit, or the refusal.
async fn read_body<B, R>(
    parts: &Parts,
    body: B,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, Response<ResponseBody<R>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        let detail = format!("the request body exceeds the limit of {limit} bytes");
        problem(ProblemCode::BodyTooLarge, &detail, None)
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    // A body that has already arrived (the usual small one) is collected
    // without a timer.
    let collect = std::pin::pin!(collect(Limited::new(body, limit)));
    let Ok(collected) = within(Some(timeout), collect).await else {
        let detail = format!("the request body did not arrive within {timeout:?}");
        return Err(problem(ProblemCode::BodyTimeout, &detail, None));
    };
    match collected {
        Ok(collected) => Ok(collected),
        Err(error) if error.is::<LengthLimitError>() => Err(too_large()),
        Err(error) => {
            let detail = format!("the request body could not be read: {error}");
            Err(problem(ProblemCode::BodyInvalid, &detail, None))
        }
    }
}

/// A body's bytes, its trailers dropped: a body of one data frame (the
/// usual small one) is taken as it is, without a copy; more are joined.
async fn collect<B: Body>(body: B) -> Result<Bytes, B::Error> {
    let mut body = std::pin::pin!(body);
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.as_mut().frame().await {
        let Ok(mut data) = frame?.into_data() else {
            continue;
        };
        let chunk = data.copy_to_bytes(data.remaining());
        match &mut joined {
            Some(joined) => joined.extend_from_slice(&chunk),
            None if first.is_empty() => first = chunk,
            None if chunk.is_empty() => {}
            None => {
                let mut both = BytesMut::with_capacity(first.len() + chunk.len());
                both.extend_from_slice(&first);
                both.extend_from_slice(&chunk);
                joined = Some(both);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http::HeaderMap;
    use http_body::Frame;
    use http_body_util::{StreamBody, combinators::BoxBody};

    use super::collect;

    fn body(frames: Vec<Frame<Bytes>>) -> BoxBody<Bytes, Infallible> {
        let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, Infallible>));
        BoxBody::new(StreamBody::new(stream))
    }

    fn data(text: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(text.as_bytes()))
    }

    /// Every way the bytes may come in frames gives the same body:
    /// one frame (taken as it is), several, empty ones anywhere, trailers.
    #[tokio::test]
    async fn frames_join_into_the_body() {
        let cases: Vec<(Vec<Frame<Bytes>>, &str)> = vec![
            (vec![], ""),
            (vec![data("")], ""),
            (vec![data("abc")], "abc"),
            (vec![data(""), data("abc"), data("")], "abc"),
            (vec![data("ab"), data("c")], "abc"),
            (vec![data("a"), data(""), data("b"), data("c")], "abc"),
            (
                vec![data("ab"), Frame::trailers(HeaderMap::new()), data("c")],
                "abc",
            ),
        ];
        for (frames, want) in cases {
            let described = format!("{frames:?}");
            let got = collect(body(frames)).await.expect("infallible");
            assert_eq!(got, want, "{described}");
        }
        // One frame is the frame's own bytes, not a copy.
        let one = Bytes::from_static(b"payload");
        let got = collect(body(vec![Frame::data(one.clone())]))
            .await
            .expect("infallible");
        assert_eq!(got.as_ptr(), one.as_ptr());
    }
}
