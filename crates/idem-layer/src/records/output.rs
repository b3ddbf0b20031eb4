//! Output by key: a caller's own stored answer fetched by its key alone,
//! waiting (bounded) for an attempt still running.

use std::time::Duration;

use http::{Method, Response, request::Parts};
use idem_core::{Current, Record, RecordState, RecordsAdmin, ScopeHash, Store};

use super::{Query, RecordsBody, RecordsService, Refusal, invalid};
use crate::problem::{ProblemCode, problem, unavailable_problem};

/// The longest an output request waits for a running attempt.
pub const OUTPUT_WAIT_MAX: Duration = Duration::from_secs(60);

/// A processing record past the wait: `409 idempotency_outcome_unknown`
/// when its attempt answered its caller that the outcome is unknown, else
/// `409 idempotency_in_progress`; `Retry-After` the lease left (at least
/// a second).
fn still_running(record: &Record, now_ms: u64) -> Response<RecordsBody> {
    let left = Duration::from_millis(record.lease_expires_at_ms.saturating_sub(now_ms));
    let unknown = record
        .attempts
        .iter()
        .rev()
        .find(|a| a.generation == record.generation)
        .is_some_and(|a| a.outcome == idem_core::AttemptOutcome::Unknown);
    if left.is_zero() {
        // Nobody holds the lease any more: no late answer will come, and
        // only the request itself, sent again, takes the record over (the
        // answer still carries a `Retry-After`, as every retryable refusal).
        let (code, detail) = if unknown {
            (
                ProblemCode::OutcomeUnknown,
                "the attempt with this Idempotency-Key answered that its outcome is unknown, and \
                 it has ended without an answer: it may have acted; reconcile, then send the \
                 request again with its payload to take the record over",
            )
        } else {
            (
                ProblemCode::InProgress,
                "the attempt with this Idempotency-Key ended without an answer (its process was \
                 lost): send the request again with its payload to take the record over",
            )
        };
        return problem(code, detail, None);
    }
    if unknown {
        let hint = Duration::from_secs(left.as_secs().clamp(1, 60));
        return problem(
            ProblemCode::OutcomeUnknown,
            "the attempt with this Idempotency-Key answered that its outcome is unknown: it may \
             have acted, and its late answer may still be recorded; ask again later",
            Some(hint),
        );
    }
    crate::answer::in_progress(left)
}

impl<S: RecordsAdmin> RecordsService<S> {
    /// `GET ?method=…&path=…&key=…&output=true[&wait=…]`: the caller's own
    /// stored answer by its key alone (see the module docs).
    pub(super) async fn output(
        &self,
        parts: &Parts,
        query: &Query,
    ) -> Result<Response<RecordsBody>, Refusal> {
        let config = &self.rt.config;
        let refused = |detail: &str| (ProblemCode::OutputRefused, detail.to_owned());
        if parts.method != Method::GET {
            return Err(invalid("an answer is fetched with GET"));
        }
        if !config.records.output_by_key {
            return Err(refused(
                "fetching an answer by its key alone is off (RecordsApi::output_by_key)",
            ));
        }
        if query.tenant.is_some() {
            return Err(refused(
                "an answer is fetched by its own caller only: tenant= is not allowed",
            ));
        }
        let tenant = config
            .tenant
            .shared_tenant(parts)
            .filter(|_| !config.tenant.ambiguous(parts))
            .ok_or_else(|| {
                refused("an anonymous caller cannot fetch an answer by its key: anyone could")
            })?;
        let scope = self.scope(Some(tenant.to_string()), query)?;
        let wait = query
            .wait
            .as_deref()
            .map(humantime::parse_duration)
            .transpose()
            .map_err(|e| invalid(format!("wait: {e}")))?
            .unwrap_or_default()
            .min(OUTPUT_WAIT_MAX);
        self.answer_of(parts, &scope, tokio::time::Instant::now() + wait)
            .await
    }

    /// The stored answer of `scope` as a retry would get it, waiting until
    /// `deadline` (or the server's shutdown) while its attempt runs.
    async fn answer_of(
        &self,
        parts: &Parts,
        scope: &ScopeHash,
        deadline: tokio::time::Instant,
    ) -> Result<Response<RecordsBody>, Refusal> {
        let not_found = |detail: &str| (ProblemCode::RecordNotFound, detail.to_owned());
        loop {
            let record = match self.rt.store.get(scope).await {
                Ok(record) => record,
                Err(error) => return Ok(unavailable_problem(&error)),
            };
            let now_ms = idem_core::unix_ms();
            let Some(record) = record.filter(|r| !r.is_expired(now_ms)) else {
                return Err(not_found(
                    "no answer for this key: no record (never made, expired, or erased)",
                ));
            };
            match record.state {
                RecordState::Released => {
                    return Err(not_found(
                        "no answer for this key: its attempt failed and released it; send the \
                         request again",
                    ));
                }
                RecordState::Cancelled => return Ok(crate::answer::cancelled()),
                RecordState::Completed => {
                    let Current::Completed(replay) =
                        idem_core::machine::current(&Some(record), now_ms)
                    else {
                        return Ok(unavailable_problem(&idem_core::StoreError::Corrupt(
                            "a completed record without its outcome".into(),
                        )));
                    };
                    // As a retry would get it: a content coding the
                    // request does not accept is decoded or refused.
                    return Ok(match self.rt.store.open(replay, scope) {
                        Ok(replay) => crate::answer::replay_to(
                            &parts.headers,
                            replay,
                            self.rt.config.answers.max_response,
                        ),
                        Err(error) => unavailable_problem(&error),
                    });
                }
                RecordState::Processing => {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        return Ok(still_running(&record, now_ms));
                    }
                    if self.rt.closing.is_cancelled() {
                        return Ok(still_running(&record, now_ms));
                    }
                    tokio::select! {
                        () = self.rt.store.changed(scope, left) => {}
                        () = self.rt.closing.cancelled() => {}
                    }
                }
            }
        }
    }
}
