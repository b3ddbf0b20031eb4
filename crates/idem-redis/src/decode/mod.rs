//! Replies and records, decoded; headers encoded.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{AttemptId, Current, Lease, Outcome, Replay, StoreError, StoredResponse};
use redis::Value;

use crate::errors::corrupt;
use crate::format as f;
use crate::invocation::Invocation;

mod headers;
mod record;
mod tenant;

#[cfg(test)]
pub(crate) use headers::{COMPACT_HEADERS, encode_headers, encode_headers_as};
pub(crate) use headers::{decode_headers, write_headers};
#[cfg(test)]
pub(crate) use record::decode_late;
pub(crate) use record::{decode_record, newer_format};
use tenant::decode_tenant;
pub(crate) use tenant::{TenantForm, encode_tenant};

/// Every text in a reply, one after another (a cluster answers `INFO` per
/// node).
pub(crate) fn collect_text(value: &Value, out: &mut String) {
    match value {
        Value::BulkString(bytes) => {
            out.push_str(&String::from_utf8_lossy(bytes));
            out.push('\n');
        }
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => {
            out.push_str(text);
            out.push('\n');
        }
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|item| collect_text(item, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(key, item)| {
            collect_text(key, out);
            collect_text(item, out);
        }),
        _ => {}
    }
}

// ===== reply decoding =====

/// Whether a script answered from its hot path: the integer 1 (a new key
/// acquired at generation 1, an outcome recorded, a lease released), which
/// costs Redis far less to build and encode than a table.
pub(crate) fn hot_path(reply: &Value) -> bool {
    matches!(reply, Value::Int(1))
}

/// Whether `reply` is a table led by `kind`: how the paths off the hot
/// one answer (fence.lua), the retry of a call whose reply was lost among
/// them.
pub(crate) fn led_by(reply: &Value, kind: &str) -> bool {
    matches!(reply, Value::Array(items) if tag(items.first()).is_ok_and(|led| led == kind))
}

pub(crate) fn items(value: Value) -> Result<Vec<Value>, StoreError> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(corrupt(format!("unexpected script reply {other:?}"))),
    }
}

pub(crate) fn text(value: &Value) -> Result<String, StoreError> {
    match value {
        Value::BulkString(bytes) => {
            String::from_utf8(bytes.clone()).map_err(|_| corrupt("non-UTF-8 text"))
        }
        Value::SimpleString(s) => Ok(s.clone()),
        Value::Int(n) => Ok(n.to_string()),
        other => Err(corrupt(format!("expected text, got {other:?}"))),
    }
}

/// A reply's tag (`"acquired"`, `"completed"`, ...), borrowed.
pub(crate) fn tag(value: Option<&Value>) -> Result<&str, StoreError> {
    match value {
        Some(Value::BulkString(bytes)) => {
            std::str::from_utf8(bytes).map_err(|_| corrupt("non-UTF-8 tag"))
        }
        Some(Value::SimpleString(s)) => Ok(s),
        Some(other) => Err(corrupt(format!("expected a tag, got {other:?}"))),
        None => Err(corrupt("empty reply")),
    }
}

/// A bulk string taken out of the reply without copying.
fn owned_bytes(value: Value) -> Result<Bytes, StoreError> {
    match value {
        Value::BulkString(bytes) => Ok(Bytes::from(bytes)),
        Value::Nil => Ok(Bytes::new()),
        other => Err(corrupt(format!("expected bytes, got {other:?}"))),
    }
}

pub(crate) fn int(value: &Value) -> Result<u64, StoreError> {
    match value {
        Value::Int(n) => u64::try_from(*n).map_err(|_| corrupt("negative number")),
        other => text(other)?
            .parse()
            .map_err(|_| corrupt(format!("expected a number, got {other:?}"))),
    }
}

pub(crate) fn bytes(value: &Value) -> Result<Bytes, StoreError> {
    match value {
        Value::BulkString(bytes) => Ok(Bytes::copy_from_slice(bytes)),
        Value::Nil => Ok(Bytes::new()),
        other => Err(corrupt(format!("expected bytes, got {other:?}"))),
    }
}

/// A completed record's outcome; `stored` is the record's flag (the
/// response was kept for replay).
pub(crate) fn outcome(
    status: u64,
    stored: bool,
    headers: &[u8],
    body: Bytes,
) -> Result<Outcome, StoreError> {
    let status = u16::try_from(status).map_err(|_| corrupt("status"))?;
    Ok(if stored {
        Outcome::Stored(StoredResponse {
            status,
            headers: decode_headers(headers)?,
            body,
        })
    } else {
        Outcome::NotStored { status }
    })
}

/// Decodes the `current(state)` reply shape of the scripts.
pub(crate) fn decode_current(mut reply: Vec<Value>) -> Result<Current, StoreError> {
    let tag = tag(reply.first())?;
    let at = |i: usize| {
        reply
            .get(i)
            .ok_or_else(|| corrupt(format!("short reply to {tag}")))
    };
    match tag {
        "vacant" => Ok(Current::Vacant),
        "cancelled" => Ok(Current::Cancelled),
        "processing" => Ok(Current::Processing {
            retry_after: Duration::from_millis(int(at(1)?)?),
        }),
        "completed" => {
            // '<status>:<stored>:<completed at, Unix ms>', then headers
            // and body.
            let meta = self::tag(Some(at(1)?))?;
            let mut parts = meta.splitn(3, ':');
            let mut number = |what: &str| {
                parts
                    .next()
                    .and_then(|part| part.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(format!("completed reply lacks {what}")))
            };
            let (status, stored, completed) = (
                number("status")?,
                number("stored")?,
                number("completion time")?,
            );
            if reply.len() < 4 {
                return Err(corrupt("short reply to completed"));
            }
            // The attempt whose outcome it is, when the script says: read
            // before the body is swapped out of its place.
            let attempt = match reply.get(4) {
                Some(Value::BulkString(id)) => attempt_id(id)?,
                _ => None,
            };
            // The body is taken out of the reply, not copied.
            let body = owned_bytes(reply.swap_remove(3))?;
            let headers = match &reply[2] {
                Value::BulkString(headers) => headers.as_slice(),
                Value::Nil => &[],
                other => return Err(corrupt(format!("expected headers, got {other:?}"))),
            };
            // A waiter's answer says no expiry (0): nothing keeps it.
            let mut replay = replay(status, stored, completed, 0, headers, body)?;
            replay.attempt = attempt;
            Ok(Current::Completed(replay))
        }
        other => Err(corrupt(format!("unexpected reply {other}"))),
    }
}

/// A replay as the reserve script answers it, one string:
/// `<status>:<stored>:<completed at, Unix ms>:<expiry>:<attempt id>:<length
/// of the headers>:`, then the headers and the body; the expiry is the record's
/// `expires` (Unix ms) or a packed record's `n` led by `p`
/// (`p<start>:<lease ms>:<retention ms>`: it expires at start plus
/// retention). The body is a slice of the reply, not a copy.
pub(crate) fn decode_replay(raw: Vec<u8>) -> Result<Replay, StoreError> {
    replay_from(raw, 0, None)
}

/// A replay as [`decode_replay`] reads it, from `raw[at..]`; with the
/// expiry and the attempt given (`known`), the text there has neither of
/// its own (a string record's completion, `string_record.rs`).
pub(crate) fn replay_from(
    raw: Vec<u8>,
    at: usize,
    known: Option<(u64, Option<idem_core::AttemptId>)>,
) -> Result<Replay, StoreError> {
    let (expires, known_attempt) = match known {
        Some((expires, attempt)) => (Some(expires), Some(attempt)),
        None => (None, None),
    };
    let mut fields = Fields { raw: &raw, at };
    let (_, status) = fields.number("status")?;
    let (_, stored) = fields.number("stored")?;
    let (_, completed) = fields.number("completion time")?;
    let expires = match expires {
        Some(expires) => expires,
        None => match fields.number("expiry")? {
            (true, started) => {
                let _lease = fields.number("lease")?;
                started.saturating_add(fields.number("retention")?.1)
            }
            (false, expires) => expires,
        },
    };
    let attempt = match known_attempt {
        Some(attempt) => attempt,
        // The attempt id field (empty: not named).
        None => attempt_id(fields.text("attempt")?)?,
    };
    let (_, headers) = fields.number("headers' length")?;
    let at = fields.at;
    // A response key cut short reads as what it holds, as Lua's
    // string.sub reads it.
    let headers_end = usize::try_from(headers)
        .map_or(raw.len(), |length| at.saturating_add(length))
        .min(raw.len());
    let raw = Bytes::from(raw);
    let body = raw.slice(headers_end..);
    let mut replay = replay(
        status,
        stored,
        completed,
        expires,
        &raw[at..headers_end],
        body,
    )?;
    replay.attempt = attempt;
    Ok(replay)
}

/// The `:`-ended fields of a reply, read in turn.
struct Fields<'a> {
    raw: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    /// The next field's text, up to its `:` (which must follow).
    fn text(&mut self, what: &str) -> Result<&'a [u8], StoreError> {
        let field = self
            .raw
            .get(self.at..)
            .and_then(|rest| rest.split(|&byte| byte == b':').next())
            .filter(|field| self.at + field.len() < self.raw.len())
            .ok_or_else(|| corrupt(format!("replay lacks the {what}")))?;
        self.at += field.len() + 1;
        Ok(field)
    }

    /// The next number, and whether `p` led it.
    fn number(&mut self, what: &str) -> Result<(bool, u64), StoreError> {
        let led = self.raw.get(self.at).is_some_and(|&byte| byte == b'p');
        self.at += usize::from(led);
        let field = self.text(what)?;
        let value = std::str::from_utf8(field)
            .ok()
            .and_then(|digits| digits.parse::<u64>().ok())
            .ok_or_else(|| corrupt(format!("replay lacks the {what}")))?;
        Ok((led, value))
    }
}

/// An attempt id as the scripts answer it (the hyphenated UUID); `None`
/// for an empty field.
pub(crate) fn attempt_id(field: &[u8]) -> Result<Option<idem_core::AttemptId>, StoreError> {
    if field.is_empty() {
        return Ok(None);
    }
    std::str::from_utf8(field)
        .ok()
        .and_then(|text| uuid::Uuid::parse_str(text).ok())
        .map(|id| Some(idem_core::AttemptId(id)))
        .ok_or_else(|| corrupt("an attempt id that does not parse"))
}

/// The stored flag the scripts answer for a completed record whose
/// response key is gone (evicted or deleted): the action ran, its response
/// cannot be replayed whole.
const INCOMPLETE: u64 = 2;

/// A completed record missing its response: counted
/// (`idem_records_incomplete_total`) and logged; it is answered as an
/// outcome recorded without its response, never replayed as if whole.
#[cold]
fn incomplete(status: u64) {
    metrics::counter!("idem_records_incomplete_total").increment(1);
    tracing::error!(
        status,
        "a completed record's response is gone from Redis (evicted?); answered as not stored"
    );
}

/// The replay of a completed record, read from either answer. The age and
/// the time to the record's expiry (`expires`, Unix ms; 0: unknown, then
/// nothing keeps the replay) are measured against this process' clock: a
/// replay reads no clock in Redis (see head.lua), and skew between the
/// clocks shows in them alone (never negative).
fn replay(
    status: u64,
    stored: u64,
    completed: u64,
    expires: u64,
    headers: &[u8],
    body: Bytes,
) -> Result<Replay, StoreError> {
    if stored == INCOMPLETE {
        incomplete(status);
    }
    let now = unix_ms();
    Ok(Replay {
        outcome: outcome(status, stored == 1, headers, body)?,
        age: Duration::from_millis(now.saturating_sub(completed)),
        expires_in: (expires > 0).then(|| Duration::from_millis(expires.saturating_sub(now))),
        attempt: None,
    })
}

pub(crate) fn lease_args(invocation: &mut Invocation<'_>, lease: &Lease) {
    invocation.arg(lease.generation).uuid(&lease.token.0);
}

/// This process' clock, in Unix milliseconds (0 before 1970).
pub(crate) use idem_core::unix_ms;
