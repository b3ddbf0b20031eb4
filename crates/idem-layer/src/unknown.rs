//! Outcomes the inner service cannot know: the action may have run.

use std::{
    fmt,
    future::Future,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use futures_util::{FutureExt, future::BoxFuture};
use http::Response;
use http_body::Body;
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};

use crate::BoxError;

/// A late answer's response, body boxed.
pub type LateResponse = Response<UnsyncBoxBody<Bytes, BoxError>>;

/// A response extension by which the inner service says that it does not
/// know the outcome: the request reached the executor, but no answer came
/// back in time (a proxy's upstream timeout) or the answer could not be
/// read. The action may have run, so retrying at once could run it twice.
///
/// The layer then neither stores the response nor releases the key: the
/// client gets the response as it is (a `504`, say), the attempt keeps its
/// lease, and, if a late answer was attached, the layer keeps waiting for
/// it in the background (up to [`Timing::unknown_outcome_wait`](crate::settings::Timing::unknown_outcome_wait),
/// renewing the lease) and records it, so that a retry replays it. Without
/// a late answer, or if none comes, the lease lapses and a later retry
/// takes over with the next generation. Retries in the meantime get `409`.
///
/// ```
/// use http::{Response, StatusCode};
/// use idem_layer::UnknownOutcome;
///
/// let mut response = Response::new(String::from("upstream timed out"));
/// *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
/// response.extensions_mut().insert(UnknownOutcome::new());
/// ```
#[derive(Clone, Default)]
pub struct UnknownOutcome {
    late: Arc<Mutex<Option<BoxFuture<'static, Option<LateResponse>>>>>,
}

impl fmt::Debug for UnknownOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnknownOutcome").finish_non_exhaustive()
    }
}

impl UnknownOutcome {
    /// The outcome is unknown and no answer will come.
    pub fn new() -> Self {
        Self::default()
    }

    /// The outcome is unknown for now; `late` resolves to the executor's
    /// answer if it comes (`None` if it cannot come any more).
    pub fn with_late_answer<F, B>(late: F) -> Self
    where
        F: Future<Output = Option<Response<B>>> + Send + 'static,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let late = late.map(|answer| {
            answer.map(|response| response.map(|body| body.map_err(Into::into).boxed_unsync()))
        });
        Self {
            late: Arc::new(Mutex::new(Some(late.boxed()))),
        }
    }

    /// Takes the late answer (once).
    pub(crate) fn take_late(&self) -> Option<BoxFuture<'static, Option<LateResponse>>> {
        self.late.lock().ok().and_then(|mut late| late.take())
    }
}
