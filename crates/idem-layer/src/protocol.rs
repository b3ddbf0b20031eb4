//! The protocol a request or an answer speaks, picked once from its head:
//! what the layer fingerprints, how it reads an answer and classifies its
//! outcome, and how it writes its own refusals. The request path asks the
//! [`Protocol`] and never branches on the protocol itself.
//!
//! A request's protocol decides its fingerprint and how its refusals are
//! written; an answer's decides how it is read and classified. They are
//! picked apart because they can differ: a proxy in front of a gRPC
//! service answers a gRPC call with a plain HTTP error, which is read and
//! classified by its HTTP status.

use bytes::Bytes;
use http::{HeaderMap, Response, request::Parts, response};

use crate::{
    ResponseBody,
    classify::Verdict,
    config::Config,
    grpc::{self, Framing, Unreadable},
    problem::ProblemCode,
};

/// HTTP, or gRPC (a content type of `application/grpc`, with or without a
/// subtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    /// The protocol of a request or an answer with these headers.
    #[inline]
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        if grpc::is_grpc(headers) {
            Protocol::Grpc
        } else {
            Protocol::Http
        }
    }

    /// What a keyed request's fingerprint covers when it is not its body
    /// as it came (a gRPC message that came compressed), or why the
    /// request is refused (a streaming gRPC call, a body that is no gRPC
    /// message). An HTTP request's fingerprint covers its body.
    pub(crate) fn fingerprinted(
        self,
        parts: &Parts,
        body: &Bytes,
        limit: usize,
    ) -> Result<Option<Bytes>, (ProblemCode, String)> {
        match self {
            Protocol::Http => Ok(None),
            Protocol::Grpc => {
                grpc::fingerprinted(&parts.headers, body, limit).map_err(|unreadable| {
                    match unreadable {
                    Unreadable::Stream => (
                        ProblemCode::StreamRefused,
                        "the keyed gRPC call carries more than one request message; only unary \
                         calls are protected: call streaming methods without an idempotency-key"
                            .to_owned(),
                    ),
                    Unreadable::Malformed(detail) => (ProblemCode::BodyInvalid, detail),
                }
                })
            }
        }
    }

    /// Whether the layer's answers to this request are written again on
    /// their way out (see [`answered`](Self::answered)).
    #[inline]
    pub(crate) fn rewrites(self, config: &Config) -> bool {
        self == Protocol::Grpc || config.shapes_problems()
    }

    /// An answer to this request on its way out: a refusal of the layer
    /// shaped by the settings, and for a gRPC caller written as a gRPC
    /// status (a trailers-only answer); any other answer unchanged.
    pub(crate) fn answered<B>(
        self,
        response: Response<ResponseBody<B>>,
        config: &Config,
    ) -> Response<ResponseBody<B>> {
        let response = config.shape(response);
        match self {
            Protocol::Http => response,
            Protocol::Grpc => grpc::refusal(response, config.problems.should_retry_header.as_ref()),
        }
    }

    /// How an answer of this protocol is read: a gRPC answer as messages
    /// (a second one, or a status that lags the first, makes it a
    /// stream); `None`: as bytes.
    #[inline]
    pub(crate) fn framing(self) -> Option<Framing> {
        (self == Protocol::Grpc).then(Framing::default)
    }

    /// The verdict of an answer of this protocol read whole: a gRPC answer
    /// by its `grpc-status` (or its absence) as the head or the trailers
    /// carry it, an HTTP answer by its status. `remote`: an upstream's
    /// answer.
    pub(crate) fn verdict(
        self,
        config: &Config,
        parts: &response::Parts,
        trailers: Option<&HeaderMap>,
        remote: bool,
    ) -> Verdict {
        let status = match self {
            Protocol::Http => None,
            Protocol::Grpc => Some(grpc::status(&parts.headers, trailers)),
        };
        config
            .answers
            .classify
            .verdict(parts.status, status, remote)
    }

    /// The verdict of an answer of this protocol passed on before its end
    /// (over the storable limit, or a gRPC stream): a gRPC stream is
    /// stored, since the call ran and answered (it is recorded as
    /// answered, its status still to come); an HTTP answer goes by its
    /// status.
    pub(crate) fn passed_verdict(
        self,
        config: &Config,
        parts: &response::Parts,
        remote: bool,
    ) -> Verdict {
        match self {
            Protocol::Http => config.answers.classify.verdict(parts.status, None, remote),
            Protocol::Grpc => Verdict::Stored,
        }
    }
}
