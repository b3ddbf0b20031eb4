//! What a retried call reports: why it stopped, how it went, and its
//! errors.

use std::{fmt, time::Duration};

use crate::{body::BoxError, limits::GateError};

/// Why the middleware stopped retrying a request whose last answer was
/// retryable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// Not an idempotent method and no `Idempotency-Key`: retrying could
    /// execute the action twice.
    UnsafeMethod,
    /// The body was not buffered (over the limit or of unknown length), so
    /// it could not be sent again.
    BodyNotReplayable,
    /// The attempt limit was reached.
    MaxAttempts,
    /// The next attempt would have started after the deadline.
    Deadline,
    /// The shared retry budget is spent.
    BudgetExhausted,
}

impl StopReason {
    pub(crate) fn label(self) -> &'static str {
        match self {
            StopReason::UnsafeMethod => "unsafe_method",
            StopReason::BodyNotReplayable => "body_not_replayable",
            StopReason::MaxAttempts => "max_attempts",
            StopReason::Deadline => "deadline",
            StopReason::BudgetExhausted => "budget_exhausted",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What happened to a request: in the extensions of the final response,
/// and in every [`Error`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryInfo {
    /// How many attempts were sent.
    pub attempts: u32,
    /// Why retrying stopped although the last answer was retryable; `None`
    /// when the last answer was final.
    pub stopped: Option<StopReason>,
    /// The `Idempotency-Key` every attempt carried, if any.
    pub key: Option<String>,
    /// The boundary the request was limited on, if any (see
    /// [`RetryLayer::limits`](crate::RetryLayer::limits)).
    pub boundary: Option<String>,
    /// How long its attempts were held for their boundary's turn, in all.
    pub held: Duration,
}

/// A request that failed without a response.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The inner service failed on the last attempt.
    Service {
        /// The inner error.
        source: E,
        /// The attempts made.
        info: RetryInfo,
    },
    /// The last attempt did not answer within the attempt timeout.
    TimedOut {
        /// The attempt timeout.
        after: Duration,
        /// The attempts made.
        info: RetryInfo,
    },
    /// The request body (to buffer it) or a 409 body (to read its problem
    /// code) could not be read.
    Body(BoxError),
    /// The boundary's turn would come after the deadline: the attempt was
    /// not sent.
    Limited {
        /// The boundary.
        boundary: String,
        /// How long the request would have had to wait.
        wait: Duration,
        /// The attempts made before.
        info: RetryInfo,
    },
    /// The limit gate's store failed, and the limits hold requests back
    /// then ([`OnGateError::HoldBack`](crate::OnGateError::HoldBack)).
    Gate {
        /// The gate's error.
        source: GateError,
        /// The attempts made before.
        info: RetryInfo,
    },
}

impl<E> Error<E> {
    /// The attempts made, when any were.
    pub fn info(&self) -> Option<&RetryInfo> {
        match self {
            Error::Service { info, .. }
            | Error::TimedOut { info, .. }
            | Error::Limited { info, .. }
            | Error::Gate { info, .. } => Some(info),
            Error::Body(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = |info: &RetryInfo| {
            info.stopped
                .map_or("the error is final".to_owned(), |s| format!("stopped: {s}"))
        };
        match self {
            Error::Service { source, info } => {
                write!(
                    f,
                    "request failed after {} attempt(s) ({}): {source}",
                    info.attempts,
                    stopped(info)
                )
            }
            Error::TimedOut { after, info } => {
                write!(
                    f,
                    "request timed out after {after:?} on attempt {} ({})",
                    info.attempts,
                    stopped(info)
                )
            }
            Error::Body(error) => write!(f, "body could not be read: {error}"),
            Error::Limited { boundary, wait, .. } => write!(
                f,
                "not sent: the turn of boundary {boundary:?} would come in {wait:?}, after the deadline"
            ),
            Error::Gate { source, .. } => write!(f, "not sent: {source}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Service { source, .. } => Some(source),
            Error::TimedOut { .. } | Error::Limited { .. } => None,
            Error::Body(error) => Some(error.as_ref()),
            Error::Gate { source, .. } => Some(source),
        }
    }
}
