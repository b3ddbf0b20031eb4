//! One execution of the inner service under a lease, and the recording of
//! its outcome.

use std::{collections::VecDeque, future::Future, panic::AssertUnwindSafe, time::Duration};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{Completion, Lease, Outcome, Release, Renewal, Store, StoredResponse};
use tower::Service;
use tracing::Instrument;

use crate::{
    IdempotencyLayer, ResponseBody,
    answer::{answer_current, storable_headers},
    body::BoxError,
    layer::Config,
    metrics::{self as m, Outcome as Counted},
    problem::{ProblemCode, problem},
    service::store_call,
};

/// What the handler produced, read as far as the storable limit.
enum Buffered<B> {
    Complete {
        parts: http::response::Parts,
        body: Bytes,
    },
    TooLarge {
        parts: http::response::Parts,
        prefix: VecDeque<Bytes>,
        rest: B,
    },
    Failed(BoxError),
}

async fn buffer<B>(response: Response<B>, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let (parts, mut body) = response.into_parts();
    let mut chunks = VecDeque::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Buffered::Failed(error.into()),
        };
        // Trailers are not stored.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        chunks.push_back(data);
        if total > limit {
            return Buffered::TooLarge {
                parts,
                prefix: chunks,
                rest: body,
            };
        }
    }
    let body = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut joined = BytesMut::with_capacity(total);
            chunks
                .iter()
                .for_each(|chunk| joined.extend_from_slice(chunk));
            joined.freeze()
        }
    };
    Buffered::Complete { parts, body }
}

/// Drives `work` while renewing the lease every third of its length.
async fn renewing<S: Store, T>(
    config: &Config,
    store: &S,
    lease: &Lease,
    work: impl Future<Output = T>,
) -> T {
    let period = (config.lease / 3).max(Duration::from_millis(1));
    let mut work = std::pin::pin!(work);
    let mut renew = true;
    loop {
        tokio::select! {
            biased;
            output = &mut work => return output,
            () = tokio::time::sleep(period), if renew => {
                match store_call(config, "renew", store.renew(lease)).await {
                    Ok(Renewal::Renewed) => {}
                    Ok(Renewal::Fenced(_)) => {
                        // Keep running: stopping a handler half-way is worse. Its
                        // completion will be fenced and kept as late evidence.
                        tracing::warn!("lease lost while the handler runs");
                        renew = false;
                    }
                    Err(error) => tracing::warn!(%error, "lease renewal failed; retrying"),
                }
            }
        }
    }
}

/// One execution of the handler under `lease`, and the recording of its
/// outcome.
pub(crate) async fn attempt<I, S, ReqBody, ResBody>(
    layer: IdempotencyLayer<S>,
    mut inner: I,
    request: Request<ReqBody>,
    lease: Lease,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S: Store,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    let config = &*layer.config;
    let store = &*layer.store;
    let max_response = config.max_response;
    let work = AssertUnwindSafe(async move {
        let response = inner.call(request).await?;
        Ok(buffer(response, max_response).await)
    })
    .catch_unwind();
    let release = || async {
        m::count(Counted::Released);
        match store_call(config, "release", store.release(&lease)).await {
            Ok(Release::Released) => {}
            Ok(Release::Fenced(_)) => m::count(Counted::Fenced),
            Err(error) => tracing::warn!(%error, "could not release the reservation"),
        }
    };
    let buffered = match renewing(config, store, &lease, work).await {
        Ok(Ok(buffered)) => buffered,
        Ok(Err(error)) => {
            release().await;
            return Err(error);
        }
        Err(_panic) => {
            release().await;
            return Ok(problem(
                ProblemCode::HandlerFailed,
                "the handler panicked",
                None,
            ));
        }
    };
    let (parts, body, outcome) = match buffered {
        Buffered::Complete { parts, body } => {
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: storable_headers(&parts.headers, &config.replay_denylist),
                body: body.clone(),
            };
            (parts, ResponseBody::full(body), Outcome::Stored(stored))
        }
        Buffered::TooLarge {
            parts,
            prefix,
            rest,
        } => {
            let status = parts.status.as_u16();
            (
                parts,
                ResponseBody::prefixed(prefix, rest),
                Outcome::NotStored { status },
            )
        }
        Buffered::Failed(error) => {
            release().await;
            let detail = format!("the handler's response body failed: {error}");
            return Ok(problem(ProblemCode::HandlerFailed, &detail, None));
        }
    };
    if !(config.should_store)(parts.status) {
        release().await;
        return Ok(Response::from_parts(parts, body));
    }
    match store_call(config, "complete", store.complete(&lease, &outcome)).await {
        Ok(Completion::Recorded) => m::count(Counted::Executed),
        Ok(Completion::Fenced(current)) => {
            m::count(Counted::Fenced);
            tracing::warn!("completion fenced: a newer attempt or a cancellation owns the record");
            if let Some(answer) = answer_current(current) {
                return Ok(answer);
            }
        }
        Err(error) => {
            // The handler ran; its client gets the real response, and the
            // outcome is recorded in the background while the lease lives,
            // so a store blip does not turn into a takeover and a second
            // execution.
            m::count(Counted::StoreError);
            tracing::error!(%error, "could not record the outcome yet; retrying while the lease lives");
            tokio::spawn(record_later(layer.clone(), lease, outcome).in_current_span());
        }
    }
    Ok(Response::from_parts(parts, body))
}

/// Retries a completion that failed on a store error, every 100 ms, until
/// it is recorded or fenced, or the lease would have lapsed.
async fn record_later<S: Store>(layer: IdempotencyLayer<S>, lease: Lease, outcome: Outcome) {
    let deadline = tokio::time::Instant::now() + lease.ttl;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match store_call(
            &layer.config,
            "complete",
            layer.store.complete(&lease, &outcome),
        )
        .await
        {
            Ok(Completion::Recorded) => {
                m::count(Counted::Executed);
                tracing::info!("outcome recorded after a store error");
                return;
            }
            Ok(Completion::Fenced(_)) => {
                m::count(Counted::Fenced);
                return;
            }
            Err(error) => tracing::debug!(%error, "recording the outcome failed again"),
        }
    }
    tracing::error!(
        "the outcome could not be recorded before the lease lapsed; a retry will take over"
    );
}
