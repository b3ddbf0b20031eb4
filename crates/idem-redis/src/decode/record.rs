//! A record read back whole from its hash: its state, times, fingerprint,
//! attempts and outcome.

use std::collections::HashMap;

use idem_core::{
    Attempt, AttemptOutcome, Fingerprint, LateEvidence, OwnerToken, Record, RecordState, ScopeHash,
    StoreError,
};
use redis::Value;

use super::*;

/// `completed:201:<ms>` or `released::<ms>`, as the scripts write it.
pub(crate) fn decode_late(raw: &str) -> Result<Option<LateEvidence>, StoreError> {
    if raw.is_empty() {
        return Ok(None);
    }
    let mut parts = raw.splitn(3, ':');
    let (kind, status, at) = (parts.next(), parts.next(), parts.next());
    let at_ms = at
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| corrupt("late evidence time"))?;
    match (kind, status) {
        (Some("completed"), Some(status)) => Ok(Some(LateEvidence::Completed {
            status: status
                .parse()
                .map_err(|_| corrupt("late evidence status"))?,
            at_ms,
        })),
        (Some("released"), _) => Ok(Some(LateEvidence::Released { at_ms })),
        _ => Err(corrupt(format!("late evidence {raw:?}"))),
    }
}

/// The newest attempt, kept in the `cur_*` fields.
fn current_attempt(
    fields: &HashMap<String, &Value>,
    generation: u64,
) -> Result<Attempt, StoreError> {
    let get = |name: &str| {
        fields
            .get(name)
            .map(|v| text(v))
            .transpose()
            .map(Option::unwrap_or_default)
    };
    let number = |raw: String| {
        raw.parse::<u64>()
            .map_err(|_| corrupt(format!("attempt field {raw:?}")))
    };
    let ended = get(f::CUR_END)?;
    let started = number(get(f::CUR_START)?)?;
    let outcome = match get(f::CUR_OUTCOME)?.as_str() {
        "running" => AttemptOutcome::Running,
        "completed" => AttemptOutcome::Completed {
            status: get(f::STATUS)?
                .parse()
                .map_err(|_| corrupt("attempt status"))?,
        },
        "released" => AttemptOutcome::Released,
        "superseded" => AttemptOutcome::Superseded,
        "cancelled" => AttemptOutcome::Cancelled,
        "released_by_operator" => AttemptOutcome::ReleasedByOperator,
        "unknown" => AttemptOutcome::Unknown,
        other => return Err(corrupt(format!("attempt outcome {other:?}"))),
    };
    Ok(Attempt {
        id: AttemptId(uuid::Uuid::parse_str(&get(f::CUR_ID)?).map_err(|_| corrupt("attempt id"))?),
        generation,
        started_at_ms: started,
        // A completion or release writes its end by its caller's clock, the
        // start is Redis': an end before the start is read as the start.
        ended_at_ms: if ended.is_empty() {
            None
        } else {
            Some(number(ended)?.max(started))
        },
        outcome,
        late: decode_late(&get(f::CUR_LATE)?)?,
    })
}

pub(crate) fn decode_record(scope: ScopeHash, pairs: &[Value]) -> Result<Record, StoreError> {
    let mut fields: HashMap<String, &Value> = HashMap::new();
    for pair in pairs.chunks(2) {
        if let [name, value] = pair {
            fields.insert(text(name)?, value);
        }
    }
    let field = |name: &str| {
        fields
            .get(name)
            .copied()
            .ok_or_else(|| corrupt(format!("record lacks {name}")))
    };
    let opt_int = |name: &str| fields.get(name).map(|v| int(v)).transpose();
    if let Some(version) = opt_int(f::V)?
        && u32::try_from(version).map_or(true, |n| n > f::NEWEST.number())
    {
        return Err(newer_format(version));
    }
    let state = text(field(f::STATE)?)?;
    let state =
        RecordState::parse(&state).ok_or_else(|| corrupt(format!("unknown state {state}")))?;
    // The token is kept after an attempt ends (the scripts check the
    // state first); only a processing record has an owner.
    let owner = match fields.get(f::OWNER).map(|v| text(v)).transpose()? {
        Some(token) if state == RecordState::Processing && !token.is_empty() => Some(OwnerToken(
            uuid::Uuid::parse_str(&token).map_err(|_| corrupt("owner token"))?,
        )),
        _ => None,
    };
    let outcome = match (state, fields.get(f::STATUS)) {
        (RecordState::Completed, Some(status)) => Some(outcome(
            int(status)?,
            text(field(f::STORED)?)? == "1",
            &bytes(field(f::HEADERS)?)?,
            bytes(field(f::BODY)?)?,
        )?),
        _ => None,
    };
    let mut attempts: Vec<Attempt> = match fields.get(f::HIST).map(|v| bytes(v)).transpose()? {
        Some(raw) if !raw.is_empty() => {
            serde_json::from_slice(&raw).map_err(|e| corrupt(format!("attempt history: {e}")))?
        }
        _ => Vec::new(),
    };
    if fields.contains_key(f::CUR_ID) {
        attempts.push(current_attempt(&fields, int(field(f::GEN)?)?)?);
    }
    let times = times(&fields, state)?;
    Ok(Record {
        scope,
        tenant: decode_tenant(&fields)?.into(),
        operation: text(field(f::OP)?)?.into(),
        key: text(field(f::KEY)?)?.into(),
        fingerprint: Fingerprint::from_hex(&text(field(f::FP)?)?)
            .ok_or_else(|| corrupt("fingerprint"))?,
        state,
        generation: int(field(f::GEN)?)?,
        owner,
        lease_expires_at_ms: opt_int(f::LEASE_UNTIL)?.unwrap_or(0),
        lease_ms: opt_int(f::LEASE_MS)?.unwrap_or(0),
        retention_ms: opt_int(f::RETENTION_MS)?.unwrap_or(0),
        created_at_ms: times.created,
        updated_at_ms: times.updated,
        completed_at_ms: times.completed,
        expires_at_ms: opt_int(f::EXPIRES)?.unwrap_or(0),
        outcome,
        attempts,
    })
}

/// A record of a format newer than this version of idem reads: refused,
/// never misread (see [`crate::format`]).
pub(crate) fn newer_format(version: u64) -> StoreError {
    StoreError::Refused(
        format!(
            "record format {version} is newer than this store reads ({}); upgrade every instance",
            f::NEWEST.number()
        )
        .into(),
    )
}

/// A record's creation, last change and completion, in Unix ms.
struct Times {
    created: u64,
    updated: u64,
    completed: Option<u64>,
}

/// Derived, not kept: creation is the first attempt's start until a
/// second attempt begins (then `created`), completion is the newest
/// attempt's end, the last change is the later of its start and end.
fn times(fields: &HashMap<String, &Value>, state: RecordState) -> Result<Times, StoreError> {
    let opt_int = |name: &str| fields.get(name).map(|v| int(v)).transpose();
    let started = opt_int(f::CUR_START)?;
    let ended = match fields.get(f::CUR_END).map(|v| text(v)).transpose()? {
        Some(ended) if !ended.is_empty() => {
            let ended = ended.parse::<u64>().map_err(|_| corrupt("attempt end"))?;
            // Never before the start (see current_attempt).
            Some(started.map_or(ended, |started| ended.max(started)))
        }
        _ => None,
    };
    let completed = (state == RecordState::Completed).then_some(ended).flatten();
    let updated = [started, ended].into_iter().flatten().max().unwrap_or(0);
    Ok(Times {
        created: opt_int(f::CREATED)?.or(started).unwrap_or(0),
        updated,
        completed,
    })
}
