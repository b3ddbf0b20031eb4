//! The records API's JSON answers: a record, its attempts, and the
//! results of acting on it.

use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use idem_core::{Attempt, Record};
use serde_json::{Value, json};

use super::RecordsBody;
use crate::{
    ResponseBody,
    problem::{ProblemCode, problem},
};

/// A JSON document answered with `status`.
pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<RecordsBody> {
    let bytes = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
    let mut response = Response::new(ResponseBody::full(bytes));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

pub(super) fn answer_cancel(result: &str, record: &Record) -> Response<RecordsBody> {
    json_response(
        StatusCode::OK,
        &json!({ "result": result, "record": record_json(record) }),
    )
}

/// `429 idempotency_listing_busy`: a listing outside the budget, told
/// when to `act` again.
pub(super) fn listing_busy(act: &str, wait: Duration) -> Response<RecordsBody> {
    let detail = format!(
        "records are listed at most one at a time and for a twentieth of the time; {act} again \
         after Retry-After"
    );
    problem(ProblemCode::ListingBusy, &detail, Some(wait))
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
