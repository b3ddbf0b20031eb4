//! The records API: inspect and cancel records over HTTP.
//!
//! `GET ?method=POST&path=/orders&key=K` returns the caller's record as
//! JSON; `DELETE` on the same address requests cancellation and answers
//! with the state that won. The tenant comes from the layer's extractor, so
//! another tenant's record, like an absent one, reads as
//! `404 idempotency_record_not_found`. `path` is the route as the layer saw
//! it: axum's route template (`/orders/{id}`) when the layer runs inside a
//! `Router`, else the request path (normalized, as the layer scopes it).
//!
//! `GET` answers `200` with the record:
//!
//! ```json
//! {
//!   "scope": "<64 hex: the scope hash>",
//!   "tenant": "acme", "operation": "POST /orders", "key": "order-1",
//!   "state": "completed",             // processing | completed | cancelled | released
//!   "generation": 1,                  // the newest attempt's lease generation
//!   "fingerprint": "<64 hex>",
//!   "created_at": "2026-11-30T10:00:00.000Z", "updated_at": "…",
//!   "completed_at": "…",              // null until completed
//!   "expires_at": "…",
//!   "status": 201,                    // the stored response's status, null before
//!   "stored": true,                   // false when the response was too large to keep
//!   "attempts": [{
//!     "id": "<uuid>", "generation": 1,
//!     "started_at": "…", "ended_at": "…",
//!     "outcome": {"kind": "completed", "status": 201},  // running | completed | released | superseded | cancelled
//!     "late": null                    // a fenced attempt's own late outcome
//!   }]
//! }
//! ```
//!
//! `DELETE` answers `200` with `{"result": …, "record": …}`, where `result`
//! says which side won: `cancelled` (the record was processing and is now
//! cancelled; the running attempt's completion will be fenced),
//! `already_completed` (completion won: the record is unchanged and holds
//! the outcome, which retries replay) or `already_cancelled`. An absent or
//! released record (nothing runs, nothing to cancel) is `404`.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, UNIX_EPOCH},
};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderValue, Method, Request, Response, StatusCode, header, request::Parts};
use http_body_util::Empty;
use idem_core::{Attempt, Cancellation, IdempotencyKey, Record, Scope, ScopeHash, Store};
use serde_json::{Value, json};
use tower::Service;

use crate::{
    ResponseBody,
    layer::Config,
    problem::{ProblemCode, problem},
    service::{store_call, unavailable_problem},
    tenant::ANONYMOUS_TENANT,
};

/// The body type of the records API.
pub type RecordsBody = ResponseBody<Empty<Bytes>>;

/// Tower service for the records API; see the [module docs](self).
pub struct RecordsService<S> {
    store: Arc<S>,
    config: Arc<Config>,
}

impl<S> Clone for RecordsService<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S> std::fmt::Debug for RecordsService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordsService").finish_non_exhaustive()
    }
}

impl<S> RecordsService<S> {
    pub(crate) fn new(store: Arc<S>, config: Arc<Config>) -> Self {
        Self { store, config }
    }
}

impl<S: Store, B: Send + 'static> Service<Request<B>> for RecordsService<S> {
    type Response = Response<RecordsBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    #[inline]
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let answer = this.answer(request).await;
            Ok(this.config.shape(answer))
        })
    }
}

fn json_response(status: StatusCode, value: &Value) -> Response<RecordsBody> {
    let bytes = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
    let mut response = Response::new(ResponseBody::full(bytes));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

impl<S: Store> RecordsService<S> {
    fn scope(&self, parts: &Parts) -> Result<ScopeHash, (ProblemCode, String)> {
        let tenant = match self.config.tenant.tenant(parts) {
            Some(tenant) => tenant,
            None if self.config.allow_anonymous => ANONYMOUS_TENANT.to_owned(),
            None => {
                let detail = "the records API needs an identified caller";
                return Err((ProblemCode::TenantMissing, detail.to_owned()));
            }
        };
        let (mut method, mut path, mut key) = (None, None, None);
        for (name, value) in
            form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
        {
            match &*name {
                "method" => method = Some(value.into_owned()),
                "path" => path = Some(value.into_owned()),
                "key" => key = Some(value.into_owned()),
                _ => {}
            }
        }
        let (Some(method), Some(path), Some(key)) = (method, path, key) else {
            let detail = "the query needs method, path and key";
            return Err((ProblemCode::RecordQueryInvalid, detail.to_owned()));
        };
        let key = IdempotencyKey::parse(key.as_bytes())
            .map_err(|e| (ProblemCode::KeyInvalid, e.to_string()))?;
        let operation = format!(
            "{} {}",
            method.to_ascii_uppercase(),
            crate::normalize_path(&path)
        );
        Ok(*Scope::new(tenant, operation, key).hash())
    }

    async fn answer<B>(&self, request: Request<B>) -> Response<RecordsBody> {
        let (parts, _) = request.into_parts();
        let scope = match self.scope(&parts) {
            Ok(scope) => scope,
            Err((code, detail)) => return problem(code, &detail, None),
        };
        let not_found = || problem(ProblemCode::RecordNotFound, "no record for this key", None);
        let unavailable = |error: idem_core::StoreError| unavailable_problem(&error);
        match parts.method {
            Method::GET => match store_call(&self.config, "get", self.store.get(&scope)).await {
                Ok(Some(record)) => json_response(StatusCode::OK, &record_json(&record)),
                Ok(None) => not_found(),
                Err(error) => unavailable(error),
            },
            Method::DELETE => {
                match store_call(&self.config, "cancel", self.store.cancel(&scope)).await {
                    Ok(Cancellation::Cancelled(record)) => answer_cancel("cancelled", &record),
                    Ok(Cancellation::AlreadyCancelled(record)) => {
                        answer_cancel("already_cancelled", &record)
                    }
                    Ok(Cancellation::AlreadyCompleted(record)) => {
                        answer_cancel("already_completed", &record)
                    }
                    Ok(Cancellation::NotFound) => not_found(),
                    Err(error) => unavailable(error),
                }
            }
            _ => {
                let mut response = json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &json!({"status": 405, "title": "Method Not Allowed"}),
                );
                response
                    .headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, DELETE"));
                response
            }
        }
    }
}

fn answer_cancel(result: &str, record: &Record) -> Response<RecordsBody> {
    json_response(
        StatusCode::OK,
        &json!({ "result": result, "record": record_json(record) }),
    )
}

fn timestamp(ms: u64) -> Value {
    let time = UNIX_EPOCH + Duration::from_millis(ms);
    Value::String(humantime::format_rfc3339_millis(time).to_string())
}

fn attempt_json(attempt: &Attempt) -> Value {
    json!({
        "id": attempt.id.to_string(),
        "generation": attempt.generation,
        "started_at": timestamp(attempt.started_at_ms),
        "ended_at": attempt.ended_at_ms.map(timestamp),
        "outcome": attempt.outcome,
        "late": attempt.late,
    })
}

/// The JSON form of a record, as the records API shows it. The stored
/// response body is not shown; its status is.
pub fn record_json(record: &Record) -> Value {
    json!({
        "scope": record.scope.to_hex(),
        "tenant": record.tenant,
        "operation": record.operation,
        "key": record.key,
        "state": record.state.as_str(),
        "generation": record.generation,
        "fingerprint": record.fingerprint.to_hex(),
        "created_at": timestamp(record.created_at_ms),
        "updated_at": timestamp(record.updated_at_ms),
        "completed_at": record.completed_at_ms.map(timestamp),
        "expires_at": timestamp(record.expires_at_ms),
        "status": record.outcome.as_ref().map(idem_core::Outcome::status),
        "stored": matches!(record.outcome, Some(idem_core::Outcome::Stored(_))),
        "attempts": record.attempts.iter().map(attempt_json).collect::<Vec<_>>(),
    })
}
