//! The request body the retry middleware sends: buffered (replayable) or
//! the caller's body, sent once.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// A boxed error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A request body as the inner service receives it.
    pub struct ReplayBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Buffered { data: Option<Bytes> },
        Once { #[pin] body: B },
        Prefixed { prefix: Option<Bytes>, body: Pin<Box<B>> },
    }
}

impl<B> ReplayBody<B> {
    /// A buffered body, which can be sent again.
    pub fn buffered(data: Bytes) -> Self {
        Self {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The caller's body, sent once.
    pub fn once(body: B) -> Self {
        Self {
            kind: Kind::Once { body },
        }
    }

    /// Bytes already read from `body`, then the rest of it.
    pub(crate) fn prefixed(prefix: Bytes, body: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                body,
            },
        }
    }
}

impl<B> Body for ReplayBody<B>
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
            KindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Once { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Prefixed { prefix, body } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => body.as_mut().poll_frame(cx).map_err(Into::into),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data } => data.is_none(),
            Kind::Once { body } => body.is_end_stream(),
            Kind::Prefixed { prefix, body } => prefix.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Once { body } => body.size_hint(),
            Kind::Prefixed { prefix, body } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(extra));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(extra));
                }
                hint
            }
        }
    }
}

impl<B> std::fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Buffered { data } => f
                .debug_struct("ReplayBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Once { .. } => f.debug_struct("ReplayBody::Once").finish_non_exhaustive(),
            Kind::Prefixed { .. } => f
                .debug_struct("ReplayBody::Prefixed")
                .finish_non_exhaustive(),
        }
    }
}
