//! How an answer is classified: stored, released or unknown, by its status
//! and by who produced it (`docs/design.md`, section 1).
//!
//! Every answer the layer settles is classified here
//! once, for HTTP and gRPC alike, the first answer and a late one alike.
//!
//! * **Stored**: recorded as completed; every retry replays it.
//! * **Released**: the key is released; a retry runs again.
//! * **Unknown**: the action may have run and its answer is not known. The
//!   attempt keeps its lease, a late answer is awaited in the background
//!   (bounded by [`unknown_outcome_wait`](crate::settings::Timing::unknown_outcome_wait))
//!   and recorded if it comes; otherwise the lease lapses and a later retry
//!   takes over as the next generation. Never released at once.
//!
//! Who produced the answer decides as much as its status: a status a
//! handler wrote in process is a known outcome ([`Producer::Handler`]); a
//! status received from an upstream ([`Producer::Upstream`], an answer
//! marked with [`RemoteAnswer`]) may come from a framework or proxy in
//! front of an executor that goes on running. The defaults,
//! [`default_http_verdict`] and [`default_grpc_verdict`], say per status
//! why.

use std::sync::Arc;

use http::StatusCode;

/// gRPC status codes by name, as the layer reads and writes them.
#[allow(missing_docs)]
pub mod code {
    pub const OK: u32 = 0;
    pub const CANCELLED: u32 = 1;
    pub const UNKNOWN: u32 = 2;
    pub const INVALID_ARGUMENT: u32 = 3;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const NOT_FOUND: u32 = 5;
    pub const ALREADY_EXISTS: u32 = 6;
    pub const PERMISSION_DENIED: u32 = 7;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const FAILED_PRECONDITION: u32 = 9;
    pub const ABORTED: u32 = 10;
    pub const OUT_OF_RANGE: u32 = 11;
    pub const UNIMPLEMENTED: u32 = 12;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
    pub const DATA_LOSS: u32 = 15;
    pub const UNAUTHENTICATED: u32 = 16;
}

/// What the layer does with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Recorded as completed and replayed to every retry.
    Stored,
    /// The key is released: a retry runs again.
    Released,
    /// The action may have run: the key stays reserved under its lease
    /// while a late answer may come, and is never released at once.
    Unknown,
}

/// Who produced an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Producer {
    /// The handler, in this process: its status is its own decision.
    Handler,
    /// An upstream the inner service called (the answer carries
    /// [`RemoteAnswer`]): its status may come from a framework or proxy in
    /// front of an executor that goes on running.
    Upstream,
}

/// A response extension by which an inner service that forwards requests
/// (a proxy, the gateway) says its answer was received from an upstream:
/// the layer classifies it as [`Producer::Upstream`]'s, so a deadline, a
/// cancellation, an `INTERNAL`, a gRPC answer without `grpc-status` or a
/// `502`/`504` from in front of the upstream is unknown, never released.
///
/// ```
/// use http::Response;
/// use idem_layer::classify::RemoteAnswer;
///
/// let mut response = Response::new(String::new());
/// response.extensions_mut().insert(RemoteAnswer);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteAnswer;

/// The default verdict of an HTTP status.
///
/// From a handler: 2xx, 3xx and 4xx are stored except 408, 425 and 429
/// (temporary: released); 5xx are released (the handler failed and says
/// so). From an upstream the same, except `502 Bad Gateway` and `504
/// Gateway Timeout`, which a proxy in front of the upstream gives while the
/// upstream may go on: unknown.
pub fn default_http_verdict(status: StatusCode, producer: Producer) -> Verdict {
    if producer == Producer::Upstream
        && matches!(
            status,
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT
        )
    {
        return Verdict::Unknown;
    }
    if default_should_store(status) {
        Verdict::Stored
    } else {
        Verdict::Released
    }
}

/// The default verdict of a gRPC answer's `grpc-status` (`None` when the
/// answer has none).
///
/// | code | from a handler | from an upstream | why |
/// |---|---|---|---|
/// | `OK` | stored | stored | a result |
/// | `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`, `UNAUTHENTICATED` | stored | stored | terminal: a retry gets the same answer |
/// | `RESOURCE_EXHAUSTED`, `ABORTED`, `UNAVAILABLE` | released | released | refused before acting; gRPC's retry policy retries them |
/// | `DEADLINE_EXCEEDED` | unknown | unknown | a deadline cuts the answer, not the work |
/// | `CANCELLED` | unknown | unknown | abandoned mid-way: what ran is not known |
/// | `UNKNOWN`, `DATA_LOSS` | unknown | unknown | the producer does not know what happened |
/// | `INTERNAL` | released | unknown | the handler's own failure (as HTTP 500); from an upstream possibly an intermediary's |
/// | above 16 | released | unknown | not a code the layer can read |
/// | none | released | unknown | a broken handler; from an upstream a broken call |
pub fn default_grpc_verdict(status: Option<u32>, producer: Producer) -> Verdict {
    let upstream = producer == Producer::Upstream;
    match status {
        Some(status) if grpc_terminal(status) => Verdict::Stored,
        Some(code::RESOURCE_EXHAUSTED | code::ABORTED | code::UNAVAILABLE) => Verdict::Released,
        Some(code::DEADLINE_EXCEEDED | code::CANCELLED | code::UNKNOWN | code::DATA_LOSS) => {
            Verdict::Unknown
        }
        // INTERNAL, a code above 16, or none.
        _ if upstream => Verdict::Unknown,
        _ => Verdict::Released,
    }
}

/// The default outcome predicate: store 2xx, 3xx and 4xx except 408, 425
/// and 429; release the key for everything else (temporary failures).
pub fn default_should_store(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 425 | 429)
}

/// The gRPC statuses a retry would only repeat (a result, or a terminal
/// answer): stored, by the three-way default and by the earlier two-way
/// one alike.
pub(crate) fn grpc_terminal(status: u32) -> bool {
    matches!(
        status,
        code::OK
            | code::INVALID_ARGUMENT
            | code::NOT_FOUND
            | code::ALREADY_EXISTS
            | code::PERMISSION_DENIED
            | code::FAILED_PRECONDITION
            | code::OUT_OF_RANGE
            | code::UNIMPLEMENTED
            | code::UNAUTHENTICATED
    )
}

/// An HTTP classifier: a status and its producer to a verdict.
pub type HttpClassifier = Arc<dyn Fn(StatusCode, Producer) -> Verdict + Send + Sync>;
/// A gRPC classifier: a `grpc-status` (`None` when absent) and its
/// producer to a verdict.
pub type GrpcClassifier = Arc<dyn Fn(Option<u32>, Producer) -> Verdict + Send + Sync>;

/// The layer's classification: one for HTTP answers, one for gRPC answers.
#[derive(Clone)]
pub(crate) struct Classifier {
    pub(crate) http: HttpClassifier,
    pub(crate) grpc: GrpcClassifier,
}

impl Default for Classifier {
    fn default() -> Self {
        Self {
            http: Arc::new(default_http_verdict),
            grpc: Arc::new(default_grpc_verdict),
        }
    }
}

impl Classifier {
    /// The verdict of an answer: its HTTP status, its `grpc-status` when
    /// it is a gRPC answer (`Some(None)`: a gRPC answer without one), and
    /// whether it came from an upstream.
    pub(crate) fn verdict(
        &self,
        status: StatusCode,
        grpc: Option<Option<u32>>,
        remote: bool,
    ) -> Verdict {
        let producer = if remote {
            Producer::Upstream
        } else {
            Producer::Handler
        };
        match grpc {
            // An upstream's 502 or 504 is an intermediary's answer in front
            // of the executor (a proxy's own timeout or lost connection),
            // whatever `grpc-status` it carries: the executor may have
            // acted. (A gRPC classifier does not see the HTTP status; an
            // HTTP one does, and the default's unknowns say the same.)
            Some(_)
                if remote
                    && matches!(
                        status,
                        StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT
                    ) =>
            {
                Verdict::Unknown
            }
            Some(grpc_status) => (self.grpc)(grpc_status, producer),
            None => (self.http)(status, producer),
        }
    }

    /// A `bool` predicate of the earlier API (`store_outcome_if`): stored
    /// or released for a handler's answers as before; an upstream's
    /// answers keep the default's unknowns (a `bool` cannot say unknown,
    /// and an upstream's deadline must never release).
    pub(crate) fn http_from_bool(
        predicate: Arc<dyn Fn(StatusCode) -> bool + Send + Sync>,
    ) -> HttpClassifier {
        Arc::new(move |status, producer| {
            let unknown = default_http_verdict(status, producer) == Verdict::Unknown;
            if producer == Producer::Upstream && unknown {
                Verdict::Unknown
            } else if predicate(status) {
                Verdict::Stored
            } else {
                Verdict::Released
            }
        })
    }

    /// As [`http_from_bool`](Self::http_from_bool), for
    /// `grpc_should_store`: a gRPC answer without `grpc-status` is
    /// released (a handler's) or unknown (an upstream's), as before.
    pub(crate) fn grpc_from_bool(
        predicate: Arc<dyn Fn(u32) -> bool + Send + Sync>,
    ) -> GrpcClassifier {
        Arc::new(move |status, producer| {
            let unknown = default_grpc_verdict(status, producer) == Verdict::Unknown;
            match status {
                _ if producer == Producer::Upstream && unknown => Verdict::Unknown,
                Some(status) if predicate(status) => Verdict::Stored,
                _ => Verdict::Released,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_grpc_code_has_its_documented_verdict() {
        use Verdict::{Released as R, Stored as S, Unknown as U};
        // By code 0..=16, then 17 and none: (handler, upstream).
        let expected = [
            (S, S), // OK
            (U, U), // CANCELLED
            (U, U), // UNKNOWN
            (S, S), // INVALID_ARGUMENT
            (U, U), // DEADLINE_EXCEEDED
            (S, S), // NOT_FOUND
            (S, S), // ALREADY_EXISTS
            (S, S), // PERMISSION_DENIED
            (R, R), // RESOURCE_EXHAUSTED
            (S, S), // FAILED_PRECONDITION
            (R, R), // ABORTED
            (S, S), // OUT_OF_RANGE
            (S, S), // UNIMPLEMENTED
            (R, U), // INTERNAL
            (R, R), // UNAVAILABLE
            (U, U), // DATA_LOSS
            (S, S), // UNAUTHENTICATED
        ];
        for (code, (handler, upstream)) in expected.into_iter().enumerate() {
            let code = u32::try_from(code).expect("code");
            assert_eq!(
                default_grpc_verdict(Some(code), Producer::Handler),
                handler,
                "{code}"
            );
            assert_eq!(
                default_grpc_verdict(Some(code), Producer::Upstream),
                upstream,
                "{code}"
            );
        }
        assert_eq!(default_grpc_verdict(Some(17), Producer::Handler), R);
        assert_eq!(default_grpc_verdict(Some(17), Producer::Upstream), U);
        assert_eq!(default_grpc_verdict(None, Producer::Handler), R);
        assert_eq!(default_grpc_verdict(None, Producer::Upstream), U);
    }

    #[test]
    fn http_statuses_follow_section_four_and_a_proxys_own_are_unknown() {
        for (status, handler, upstream) in [
            (201, Verdict::Stored, Verdict::Stored),
            (422, Verdict::Stored, Verdict::Stored),
            (429, Verdict::Released, Verdict::Released),
            (500, Verdict::Released, Verdict::Released),
            (502, Verdict::Released, Verdict::Unknown),
            (503, Verdict::Released, Verdict::Released),
            (504, Verdict::Released, Verdict::Unknown),
        ] {
            let status = StatusCode::from_u16(status).expect("status");
            assert_eq!(default_http_verdict(status, Producer::Handler), handler);
            assert_eq!(default_http_verdict(status, Producer::Upstream), upstream);
        }
    }

    #[test]
    fn a_bool_predicate_keeps_an_upstreams_unknowns() {
        let store_all = Classifier::grpc_from_bool(Arc::new(|_| true));
        assert_eq!(
            store_all(Some(code::DEADLINE_EXCEEDED), Producer::Handler),
            Verdict::Stored
        );
        assert_eq!(
            store_all(Some(code::DEADLINE_EXCEEDED), Producer::Upstream),
            Verdict::Unknown
        );
        assert_eq!(store_all(None, Producer::Handler), Verdict::Released);
        let release_all = Classifier::http_from_bool(Arc::new(|_| false));
        assert_eq!(
            release_all(StatusCode::CREATED, Producer::Upstream),
            Verdict::Released
        );
        assert_eq!(
            release_all(StatusCode::GATEWAY_TIMEOUT, Producer::Upstream),
            Verdict::Unknown
        );
    }
}
