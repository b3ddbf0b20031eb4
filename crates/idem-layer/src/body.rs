//! The response body of the layer.

use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// A boxed error, as the layer's bodies report them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The body of every response that leaves the layer: a buffered body
    /// (problems, replays, and responses the layer stored) or the inner
    /// service's body, possibly behind a prefix the layer already read.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes>, trailers: Option<Box<http::HeaderMap>> },
        Stream { prefix: VecDeque<Bytes>, #[pin] rest: B },
    }
}

impl<B> ResponseBody<B> {
    /// A body of known bytes.
    pub fn full(data: Bytes) -> Self {
        Self::full_with_trailers(data, None)
    }

    /// A body of known bytes, then `trailers` (a gRPC answer's status
    /// travels in them).
    pub fn full_with_trailers(data: Bytes, trailers: Option<http::HeaderMap>) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers: trailers.map(Box::new),
            },
        }
    }

    /// The inner service's body, passed through.
    pub fn inner(body: B) -> Self {
        Self::prefixed(VecDeque::new(), body)
    }

    /// Chunks already read from `rest`, then the remainder of `rest`.
    pub(crate) fn prefixed(prefix: VecDeque<Bytes>, rest: B) -> Self {
        Self {
            kind: Kind::Stream { prefix, rest },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
            KindProj::Stream { prefix, rest } => {
                if let Some(chunk) = prefix.pop_front() {
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
                rest.poll_frame(cx).map_err(Into::into)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Stream { prefix, rest } => prefix.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Stream { prefix, rest } => {
                let buffered: u64 = prefix.iter().map(|c| c.len() as u64).sum();
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + buffered);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + buffered);
                }
                hint
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Full { data, trailers } => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .field("trailers", &trailers.as_ref().map_or(0, |t| t.len()))
                .finish(),
            Kind::Stream { prefix, .. } => f
                .debug_struct("ResponseBody::Stream")
                .field("prefix_chunks", &prefix.len())
                .finish_non_exhaustive(),
        }
    }
}

/// Awaits `future` within `bound` (`None`: unbounded), arming the timer
/// only if the future is still pending after a first poll: work that is
/// already done (a memory-store call, a body that has arrived) runs no
/// timer.
pub(crate) async fn within<F: Future + Unpin>(
    bound: Option<Duration>,
    mut future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut future).poll(cx)));
    match (first.await, bound) {
        (Poll::Ready(output), _) => Ok(output),
        (Poll::Pending, None) => Ok(future.await),
        (Poll::Pending, Some(bound)) => tokio::time::timeout(bound, future).await,
    }
}
