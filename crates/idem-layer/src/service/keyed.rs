//! A keyed request on its way through the state machine: admitted by the
//! engine, then run, replayed or refused; a conflict points to the record
//! it met.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use idem_core::{Attempt, Lease, ReserveRequest, Store, StoreError};
use tower::Service;

use super::passthrough;
use crate::{
    IdempotencyContext, OnDisconnect, ResponseBody,
    answer::{cancelled, in_progress_about, replay_to},
    attempt::attempt,
    body::BoxError,
    disconnect::{ReleaseOnDrop, attempt_started},
    engine::{Admission, Found, admit},
    metrics::{self as m, Outcome as Counted},
    problem::store_unavailable,
    problem::{ProblemCode, RecordRef, problem_about},
    runtime::Runtime,
};

/// The forms of the default fingerprint a record may have been written in
/// besides the one this layer writes, in the order they are tried: this
/// format the other way (keyed or not, when the layer has a key), then
/// the other format, the way this layer writes first.
fn other_fingerprints(
    config: &crate::config::Config,
) -> impl Iterator<Item = (crate::fingerprint::FingerprintFormat, Option<[u8; 32]>)> {
    let format = config.fingerprints.format;
    let other = format.other();
    let (written, unwritten) = match config.fingerprints.key {
        Some(key) if config.fingerprints.keyed => (Some(key), Some(None)),
        Some(key) => (None, Some(Some(key))),
        None => (None, None),
    };
    [
        unwritten.map(|key| (format, key)),
        Some((other, written)),
        unwritten.map(|key| (other, key)),
    ]
    .into_iter()
    .flatten()
}

/// Where the record of `request` is in the records API (when the layer
/// knows where it is mounted), as its own caller reads it, with the state
/// and first sighting given.
fn pointer(
    config: &crate::config::Config,
    request: &ReserveRequest,
    state: &'static str,
    first_seen: Option<String>,
) -> RecordRef {
    let href = config.records.path.as_deref().map(|records| {
        let operation = request.scope.operation();
        let (method, path) = operation.split_once(' ').unwrap_or((operation, ""));
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("method", method)
            .append_pair("path", path)
            .append_pair("key", &request.scope.key().to_sf_string())
            .finish();
        format!("{records}?{query}")
    });
    RecordRef {
        href,
        state,
        first_seen,
    }
}

/// The record a conflicting request collided with: read once more (a
/// conflict is rare, and the caller is told what its key already names).
/// `None` when the read fails or finds nothing any more: the `422` stands
/// without it.
async fn conflicting<S: Store>(rt: &Runtime<S>, request: &ReserveRequest) -> Option<RecordRef> {
    let read = rt.store.get(request.scope.hash()).await;
    let record = read.ok()??;
    let first_seen = std::time::UNIX_EPOCH + Duration::from_millis(record.created_at_ms);
    Some(pointer(
        &rt.config,
        request,
        record.state.as_str(),
        Some(humantime::format_rfc3339_millis(first_seen).to_string()),
    ))
}

/// A keyed request on its way through the state machine.
pub(super) struct Keyed<I, S, ReqBody> {
    pub(super) rt: Runtime<S>,
    pub(super) inner: I,
    pub(super) parts: Parts,
    pub(super) body: Bytes,
    /// What the fingerprint covers when it is not `body` (a compressed
    /// gRPC message, uncompressed).
    pub(super) print: Option<Bytes>,
    pub(super) reserve: ReserveRequest,
    pub(super) request_body: std::marker::PhantomData<fn() -> ReqBody>,
}

impl<I, S, ReqBody, ResBody> Keyed<I, S, ReqBody>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // An async block, not an `async fn`, as `handle` says.
    #[allow(clippy::manual_async_fn)]
    pub(super) fn run(
        mut self,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>> {
        async move {
            let rt = self.rt.clone();
            let config = &*rt.config;
            // The default fingerprint is read in every form it was written
            // in: a record written unkeyed (before fingerprints were keyed)
            // or in the other format is tried before a conflict.
            let mut others = config
                .fingerprints
                .function
                .is_none()
                .then(|| other_fingerprints(config))
                .into_iter()
                .flatten();
            let (parts, body) = (&self.parts, self.print.as_ref().unwrap_or(&self.body));
            let admission = admit(&rt, &mut self.reserve, |request| {
                let Some((format, key)) = others.next() else {
                    return false;
                };
                request.fingerprint = format.of(
                    key.as_ref(),
                    request.scope.operation(),
                    parts,
                    &config.fingerprints.headers,
                    body,
                );
                true
            })
            .await;
            match admission {
                Admission::Run { lease, superseded } => self.execute(lease, superseded).await,
                Admission::Found(Found::InProgress(retry_after)) => {
                    // The record it collided with, linked: no store call.
                    let record = pointer(config, &self.reserve, "processing", None);
                    Ok(in_progress_about(retry_after, Some(record)))
                }
                Admission::Found(Found::Completed(replay)) => Ok(replay_to(
                    &self.parts.headers,
                    replay,
                    config.answers.max_response,
                )),
                Admission::Found(Found::Cancelled) => Ok(cancelled()),
                Admission::Found(Found::Conflict) => {
                    m::count(Counted::Conflict);
                    let detail = "this Idempotency-Key was used with a different request payload";
                    let record = conflicting(&rt, &self.reserve).await;
                    Ok(problem_about(ProblemCode::Conflict, detail, None, record))
                }
                Admission::Held(error) => Ok(store_unavailable(&error)),
                // Fail-open covers a store that cannot be reached, never one
                // that answered: a full store or a record it cannot decode
                // may hold the key's outcome, and running again could
                // execute it twice.
                Admission::Failed(
                    error @ (StoreError::Unavailable(_) | StoreError::Timeout(_)),
                ) if config.fail_open => {
                    tracing::warn!(%error, "idempotency store failed; running the handler unprotected");
                    m::count(Counted::FailOpen);
                    let request = Request::from_parts(self.parts, ReqBody::from(self.body));
                    passthrough(self.inner, request).await
                }
                Admission::Failed(error) => Ok(store_unavailable(&error)),
            }
        }
    }

    // An async block, not an `async fn`, as `handle` says.
    #[allow(clippy::manual_async_fn)]
    fn execute(
        self,
        lease: Lease,
        superseded: Option<Attempt>,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, I::Error>> {
        async move {
            let Keyed {
                rt,
                inner,
                mut parts,
                body,
                reserve,
                ..
            } = self;
            let scope = &reserve.scope;
            crate::metrics::trace_attempt(lease.generation);
            parts.extensions.insert(IdempotencyContext {
                key: scope.key().clone(),
                tenant: Arc::clone(scope.shared_tenant()),
                operation: Arc::clone(scope.shared_operation()),
                scope: *scope.hash(),
                fingerprint: reserve.fingerprint,
                attempt: lease.attempt,
                generation: lease.generation,
                superseded,
            });
            let request = Request::from_parts(parts, ReqBody::from(body));
            match rt.config.timing.on_disconnect {
                OnDisconnect::Detach => {
                    // The attempt runs inline while the client waits; if the
                    // client goes away, the response future moves the rest
                    // of the request to a task of its own and the outcome is
                    // still recorded.
                    attempt_started(&rt.tasks);
                    attempt(rt, inner, request, reserve, lease).await
                }
                OnDisconnect::Release => {
                    let guard = ReleaseOnDrop {
                        rt: rt.clone(),
                        lease: Some(lease.clone()),
                    };
                    // Dropped with the response future: the handler is
                    // dropped and the guard releases the key.
                    let result = attempt(rt, inner, request, reserve, lease).await;
                    guard.disarm();
                    result
                }
            }
        }
    }
}
