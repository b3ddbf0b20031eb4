//! The records API: inspect and cancel records over HTTP.
//!
//! `GET ?method=POST&path=/orders&key=K` returns the caller's record as
//! JSON; `DELETE` on the same address requests cancellation and answers
//! with the state that won. The tenant comes from the layer's extractor, so
//! another tenant's record, like an absent one, reads as
//! `404 idempotency_record_not_found`. `path` is the route as the layer saw
//! it: axum's route template (`/orders/{id}`) when the layer runs inside a
//! `Router`, else the request path (normalized, as the layer scopes it).
//! The query is form-encoded: a `+` in a value is a space, so a key with a
//! `+` is written `%2B` (`idem_client::output_request` does).
//!
//! The service is made by [`IdempotencyLayer::records_service`](crate::IdempotencyLayer::records_service),
//! from the layer's store and its settings: the ones that name a record
//! (the tenant extractor, [`scope_secret`](crate::IdempotencyLayer::scope_secret),
//! [`scope_format`](crate::IdempotencyLayer::scope_format)), the records
//! API's own ([`RecordsApi`](crate::settings::RecordsApi)), sealing (an
//! answer fetched by key is opened), problems and the store timeout. It
//! shares with that layer the replay cache an erasure clears, the listing
//! budget and the shutdown signal. It needs no route behind the layer: an
//! operator's process that serves only the records API builds a layer with
//! the identity settings of the instances that serve requests (and their
//! keyring, to fetch sealed answers by key: without it a sealed answer is
//! `503`), over the same store, and mounts `records_service()` alone. The
//! serving instances' replay caches hear of its erasures as of any other
//! process's: through the store's push channel where it has one (a single
//! Redis node, PostgreSQL reached directly), else a cached copy lives at
//! most a second. A constructor apart from the layer would repeat every
//! identity setting for a service that must agree with the layer on each
//! of them, so there is none.
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
//!     "outcome": {"kind": "completed", "status": 201},  // running | unknown | completed | released | superseded | cancelled | released_by_operator
//!     "late": null                    // a fenced attempt's own late outcome
//!   }]
//! }
//! ```
//!
//! Operators also:
//!
//! * `GET` without `key` lists the caller's live records, oldest first:
//!   `{"records": [...]}`, filtered by `state=processing`,
//!   `older_than=10m` (since created), `lapsed=true` (processing records
//!   whose lease lapsed: stuck), and `limit` (default 100, at most 1,000).
//!   A listing reads every record in the store (no store keeps an index
//!   by tenant), so listings are budgeted per layer: one runs at a time,
//!   and they take at most a twentieth of the time, beyond a first second
//!   of listing. After a listing that took `t`, the next one waits `19 t`
//!   (less while the second is unspent). A listing asked for outside the
//!   budget is `429 idempotency_listing_busy` with `Retry-After`; nothing
//!   reaches the store. So a caller who lists in a loop costs the store a
//!   twentieth of its time, not all of it, and leaves every other request
//!   alone; the others' listings wait their turn. Reading, cancelling or
//!   releasing one record is not budgeted. A listing is given 30 s (or
//!   the store timeout, if longer): it reads every record, which takes
//!   longer than one store call.
//! * With the admin credential (or, where
//!   [`tenant_release`](crate::settings::RecordsApi::tenant_release) allows it,
//!   as the record's own tenant; otherwise `403 idempotency_admin_required`),
//!   `POST ?method=…&path=…&key=…&action=release` releases a stuck
//!   processing record whatever its lease: `200 {"result": "released",
//!   "record": …}` (its attempt is kept as `released_by_operator`, its
//!   later writes are fenced, the next request runs), `409 {"result":
//!   "not_processing", …}` for any other state, `404` for none.
//! * With the admin credential ([`admin_token`](crate::settings::RecordsApi::admin_token),
//!   header `x-idem-admin-token`), `tenant=` acts for another tenant and a
//!   list without `tenant` covers every tenant; `tenant=` without the
//!   credential is `403 idempotency_admin_required`.
//! * With the admin credential, `POST ?method=…&path=…&key=…&tenant=…&action=erase`
//!   erases one record that is not processing (data protection, or an
//!   answer stored by mistake): `200 {"result": "erased", "record": …}`
//!   (the record as it was), `409 {"result": "processing", …}` for a
//!   processing record (erasing it would let a retry run while its attempt
//!   may still act; release it first if its owner is gone), `404` for
//!   none. `POST ?tenant=…&action=erase` erases every record of the
//!   tenant that is not processing, a page of the listing at a time
//!   (budgeted as listings are), each page after the last one's final
//!   record, so the processing records it keeps never stop it early:
//!   `200 {"result": "erased", "finished": true, "erased": N, "processing": M}`
//!   once every record was seen; a store that fails part way is
//!   `503 idempotency_store_unavailable`, whose detail says how many were
//!   erased and kept before it stopped (erase again to finish).
//!   An erased key is new: a retry of it runs again. Each erasure is
//!   counted (`idem_records_erased_total`) and logged with the scope hash
//!   and the tenant, never the key, and this layer's replay cache forgets
//!   the record; other processes' caches hear of it through the store's
//!   push channel (within about a second; at most 1 s on a store without
//!   one, see [`IdempotencyLayer::replay_cache`](crate::IdempotencyLayer::replay_cache)).
//!
//! # Output by key
//!
//! With [`output_by_key`](crate::settings::RecordsApi::output_by_key) on (off
//! by default), `GET ?method=…&path=…&key=…&output=true` answers the
//! caller's own stored answer without the payload: the stored status,
//! headers and body (a sealed one opened) with `Idempotent-Replayed: true`,
//! as a retry would get it (a content coding its `Accept-Encoding` does not
//! take is decoded or refused, as for a retry); the handler never runs. `wait=10s` (at most
//! 60 s, default none) waits for an attempt still running, woken by the
//! store's push channel where it has one (Redis single node, the memory
//! store) and by polling where it does not. Otherwise:
//!
//! * a running attempt past the wait: `409 idempotency_in_progress`, or
//!   `409 idempotency_outcome_unknown` when the attempt answered that its
//!   outcome is unknown (it may have acted; its late answer may still be
//!   recorded; an upstream's `502` and `504` are unknown too), each with
//!   `Retry-After`; once the attempt's lease lapsed with no answer (its
//!   process lost, or its wait for a late answer over), the detail says no
//!   answer will come and that only the request sent again, with its
//!   payload, takes the record over;
//! * a wait ends at once when the layer [closes](crate::IdempotencyLayer::close)
//!   (a shutdown begins), answering as past the wait;
//! * an answer not stored: `409 idempotency_response_not_stored`; a
//!   cancelled record: `410 idempotency_cancelled`;
//! * a record released by a failure: `404 idempotency_record_not_found`,
//!   saying so (send the request again); no record (never made, expired or
//!   erased, which a store cannot tell apart): `404` too;
//! * off, from the anonymous tenant, or with `tenant=` (the admin
//!   credential reads records, not answers): `403 idempotency_output_refused`.
//!
//! The tenant is the caller's own, as for every request, so another
//! tenant's answer reads as none. A capability handed out with the first
//! answer (a token that alone fetches it) was considered and is not built:
//! the key already is one where keys are random and a tenant is one
//! principal, which is when output by key should be on.
//!
//! `DELETE` answers `200` with `{"result": …, "record": …}`, where `result`
//! says which side won: `cancelled` (the record was processing and is now
//! cancelled; the running attempt's completion will be fenced),
//! `already_completed` (completion won: the record is unchanged and holds
//! the outcome, which retries replay) or `already_cancelled`. An absent or
//! released record (nothing runs, nothing to cancel) is `404`.

use std::{
    convert::Infallible,
    task::{Context, Poll},
};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderValue, Method, Request, Response, StatusCode, header, request::Parts};
use http_body_util::Empty;
use idem_core::{
    Cancellation, ForceRelease, IdempotencyKey, RecordQuery, RecordState, RecordsAdmin, Scope,
    ScopeHash, Store,
};
use serde_json::json;
use tower::Service;

use crate::{
    ResponseBody,
    headers::ADMIN_TOKEN,
    listing::Listing,
    path::operation_name,
    problem::unavailable_problem,
    problem::{ProblemCode, problem},
    runtime::Runtime,
};

mod erase;
mod json;
mod output;

pub use json::record_json;
use json::{answer_cancel, json_response, listing_busy};
pub use output::OUTPUT_WAIT_MAX;

/// The body type of the records API.
pub type RecordsBody = ResponseBody<Empty<Bytes>>;

/// Tower service for the records API; see the [module docs](self).
pub struct RecordsService<S> {
    rt: Runtime<S>,
}

impl<S> Clone for RecordsService<S> {
    fn clone(&self) -> Self {
        Self {
            rt: self.rt.clone(),
        }
    }
}

impl<S> std::fmt::Debug for RecordsService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordsService").finish_non_exhaustive()
    }
}

impl<S> RecordsService<S> {
    pub(crate) fn new(rt: Runtime<S>) -> Self {
        Self { rt }
    }
}

impl<S: RecordsAdmin, B: Send + 'static> Service<Request<B>> for RecordsService<S> {
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
            Ok(this.rt.config.shape(answer))
        })
    }
}

/// The query of a records API request.
#[derive(Default)]
struct Query {
    method: Option<String>,
    path: Option<String>,
    key: Option<String>,
    tenant: Option<String>,
    state: Option<String>,
    older_than: Option<String>,
    lapsed: bool,
    limit: Option<String>,
    action: Option<String>,
    /// `output=true`: the record's stored answer, not the record.
    output: bool,
    /// How long an output request waits for a running attempt.
    wait: Option<String>,
}

impl Query {
    /// The query, or why it is refused: a parameter given twice (which
    /// one counts would be a guess), a flag that is neither `true`/`1` nor
    /// `false`/`0`, or an `action` on another method than `POST`. Other
    /// names are left for what serves beside the API.
    fn parse(parts: &Parts) -> Result<Self, Refusal> {
        let mut query = Query::default();
        let mut seen: Vec<std::borrow::Cow<'_, str>> = Vec::new();
        for (name, value) in
            form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
        {
            if seen.contains(&name) {
                return Err(invalid(format!("`{name}` is given more than once")));
            }
            match &*name {
                "lapsed" => query.lapsed = flag("lapsed", &value)?,
                "output" => query.output = flag("output", &value)?,
                other => match query.text(other) {
                    Some(slot) => *slot = Some(value.into_owned()),
                    None => continue,
                },
            }
            seen.push(name);
        }
        if query.action.is_some() && parts.method != Method::POST {
            return Err(invalid("`action` is for POST"));
        }
        Ok(query)
    }

    /// Where the text parameter `name` goes; `None` for a name the API
    /// does not know.
    fn text(&mut self, name: &str) -> Option<&mut Option<String>> {
        Some(match name {
            "method" => &mut self.method,
            "path" => &mut self.path,
            "key" => &mut self.key,
            "tenant" => &mut self.tenant,
            "state" => &mut self.state,
            "older_than" => &mut self.older_than,
            "limit" => &mut self.limit,
            "action" => &mut self.action,
            "wait" => &mut self.wait,
            _ => return None,
        })
    }
}

/// A flag parameter's value.
fn flag(name: &str, value: &str) -> Result<bool, Refusal> {
    match value {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(invalid(format!("`{name}` is true or false"))),
    }
}

/// The most records one list answers.
const LIST_LIMIT: usize = 1_000;

type Refusal = (ProblemCode, String);

fn invalid(detail: impl Into<String>) -> Refusal {
    (ProblemCode::RecordQueryInvalid, detail.into())
}

impl<S: RecordsAdmin> RecordsService<S> {
    /// Whether the request carries the admin credential.
    fn is_admin(&self, parts: &Parts) -> bool {
        use sha2::Digest;
        let (Some(expected), Some(given)) = (
            self.rt.config.records.admin_token,
            parts.headers.get(ADMIN_TOKEN),
        ) else {
            return false;
        };
        let given: [u8; 32] = sha2::Sha256::digest(given.as_bytes()).into();
        // Digests of equal length, compared whole.
        given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// The tenant the request acts for: the caller's own, or with the admin
    /// credential the `tenant` asked for (`None`: every tenant, for
    /// listing).
    fn tenant(&self, parts: &Parts, query: &Query) -> Result<Option<String>, Refusal> {
        if self.is_admin(parts) {
            return Ok(query.tenant.clone());
        }
        if query.tenant.is_some() {
            let detail = "acting for another tenant needs the admin credential";
            return Err((ProblemCode::AdminRequired, detail.to_owned()));
        }
        match self.rt.config.tenant_of(parts) {
            Some(tenant) => Ok(Some(tenant.to_string())),
            None if self.rt.config.records.admin_token.is_some()
                && parts.headers.contains_key(ADMIN_TOKEN) =>
            {
                let detail = "the admin credential is not the one configured";
                Err((ProblemCode::AdminRequired, detail.to_owned()))
            }
            None => {
                let detail = "the records API needs an identified caller";
                Err((ProblemCode::TenantMissing, detail.to_owned()))
            }
        }
    }

    fn scope(&self, tenant: Option<String>, query: &Query) -> Result<ScopeHash, Refusal> {
        let (Some(method), Some(path), Some(key)) = (&query.method, &query.path, &query.key) else {
            return Err(invalid("the query needs method, path and key"));
        };
        let Some(tenant) = tenant else {
            return Err(invalid("name the record's tenant"));
        };
        let key = IdempotencyKey::parse(key.as_bytes())
            .map_err(|e| (ProblemCode::KeyInvalid, e.to_string()))?;
        let operation = operation_name(&method.to_ascii_uppercase(), &crate::normalize_path(path));
        let config = &self.rt.config;
        let secret = config.scope_secret.as_ref();
        Ok(*Scope::hashed_as(config.scope_format, secret, tenant, operation, key).hash())
    }

    fn list_query(tenant: Option<String>, query: &Query) -> Result<RecordQuery, Refusal> {
        let state = match query.state.as_deref() {
            None => None,
            Some(name) => Some(
                RecordState::parse(name)
                    .ok_or_else(|| invalid(format!("unknown state {name:?}")))?,
            ),
        };
        let older_than = query
            .older_than
            .as_deref()
            .map(humantime::parse_duration)
            .transpose()
            .map_err(|e| invalid(format!("older_than: {e}")))?;
        let limit = query
            .limit
            .as_deref()
            .map(str::parse::<usize>)
            .transpose()
            .map_err(|_| invalid("limit is not a number"))?
            .unwrap_or(100)
            .min(LIST_LIMIT);
        Ok(RecordQuery {
            tenant,
            state,
            older_than,
            lapsed: query.lapsed,
            limit,
            after: None,
        })
    }

    async fn answer<B>(&self, request: Request<B>) -> Response<RecordsBody> {
        let (parts, _) = request.into_parts();
        match self.act(&parts).await {
            Ok(response) => response,
            Err((code, detail)) => problem(code, &detail, None),
        }
    }

    async fn act(&self, parts: &Parts) -> Result<Response<RecordsBody>, Refusal> {
        let query = Query::parse(parts)?;
        if query.output {
            return self.output(parts, &query).await;
        }
        let tenant = self.tenant(parts, &query)?;
        // Naming any part of a record asks for that record; naming none
        // asks for a list.
        let one = query.key.is_some() || query.method.is_some() || query.path.is_some();
        match (&parts.method, one) {
            (&Method::GET, false) => self.list(tenant, &query).await,
            (&Method::GET, true) => {
                let scope = self.scope(tenant, &query)?;
                match self.rt.store.get(&scope).await {
                    Ok(Some(record)) => Ok(json_response(StatusCode::OK, &record_json(&record))),
                    Ok(None) => Err(not_found()),
                    Err(error) => Ok(unavailable_problem(&error)),
                }
            }
            (&Method::DELETE, _) => self.cancel(self.scope(tenant, &query)?).await,
            (&Method::POST, _) if query.action.as_deref() == Some("release") => {
                if !self.rt.config.records.tenant_release && !self.is_admin(parts) {
                    let detail = "releasing a record needs the admin credential: its attempt may \
                                  still run (RecordsApi::tenant_release lets a tenant \
                                  release its own)";
                    return Err((ProblemCode::AdminRequired, detail.to_owned()));
                }
                self.release(self.scope(tenant, &query)?).await
            }
            (&Method::POST, _) if query.action.as_deref() == Some("erase") => {
                if !self.is_admin(parts) {
                    let detail = "erasing records needs the admin credential";
                    return Err((ProblemCode::AdminRequired, detail.to_owned()));
                }
                if one {
                    let scope = self.scope(tenant, &query)?;
                    Ok(self.erase_one(&scope).await)
                } else {
                    let Some(tenant) = tenant else {
                        return Err(invalid("name the tenant whose records to erase"));
                    };
                    Ok(self.erase_tenant(tenant).await)
                }
            }
            (&Method::POST, _) => Err(invalid("POST takes action=release or action=erase")),
            _ => {
                let mut response = json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &json!({"status": 405, "title": "Method Not Allowed"}),
                );
                response
                    .headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, DELETE, POST"));
                Ok(response)
            }
        }
    }

    /// `GET` naming no record: the records of the query, within the
    /// listing budget.
    async fn list(
        &self,
        tenant: Option<String>,
        query: &Query,
    ) -> Result<Response<RecordsBody>, Refusal> {
        let list = Self::list_query(tenant, query)?;
        let _listing = match Listing::begin(&self.rt.listings) {
            Ok(listing) => listing,
            Err(wait) => return Ok(listing_busy("list", wait)),
        };
        Ok(match self.rt.store.list(&list).await {
            Ok(records) => json_response(
                StatusCode::OK,
                &json!({ "records": records.iter().map(record_json).collect::<Vec<_>>() }),
            ),
            Err(error) => unavailable_problem(&error),
        })
    }

    /// `DELETE`: cancels the record (atomic against its completion).
    async fn cancel(&self, scope: ScopeHash) -> Result<Response<RecordsBody>, Refusal> {
        Ok(match self.rt.store.cancel(&scope).await {
            Ok(Cancellation::Cancelled(record)) => answer_cancel("cancelled", &record),
            Ok(Cancellation::AlreadyCancelled(record)) => {
                answer_cancel("already_cancelled", &record)
            }
            Ok(Cancellation::AlreadyCompleted(record)) => {
                answer_cancel("already_completed", &record)
            }
            Ok(Cancellation::NotFound) => return Err(not_found()),
            Err(error) => unavailable_problem(&error),
        })
    }

    /// `POST action=release`: frees a processing record's key.
    async fn release(&self, scope: ScopeHash) -> Result<Response<RecordsBody>, Refusal> {
        Ok(match self.rt.store.force_release(&scope).await {
            Ok(ForceRelease::Released(record)) => {
                tracing::warn!(scope = %record.scope, "an operator released a record");
                json_response(
                    StatusCode::OK,
                    &json!({ "result": "released", "record": record_json(&record) }),
                )
            }
            Ok(ForceRelease::NotProcessing(record)) => json_response(
                StatusCode::CONFLICT,
                &json!({ "result": "not_processing", "record": record_json(&record) }),
            ),
            Ok(ForceRelease::NotFound) => return Err(not_found()),
            Err(error) => unavailable_problem(&error),
        })
    }
}

/// No record for the request's key.
fn not_found() -> Refusal {
    (
        ProblemCode::RecordNotFound,
        "no record for this key".to_owned(),
    )
}
