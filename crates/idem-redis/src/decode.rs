//! Replies and records, decoded; headers encoded.

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use idem_core::{
    Attempt, AttemptId, AttemptOutcome, Current, Fingerprint, HeaderName, LateEvidence, Lease,
    Outcome, OwnerToken, Record, RecordState, Replay, ScopeHash, StoreError, StoredResponse,
};
use redis::Value;

use crate::errors::corrupt;
use crate::format as f;
use crate::invocation::Invocation;

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

/// A tenant as the record keeps it: `("tenant", tenant)`, or, for a tenant
/// that ends in a 64-digit lower-case hex hash (every hashed tenant of
/// the layer and the gateway), `("tenant_bin", prefix + the hash's 32
/// bytes)`: 69 characters become 37 bytes, within the 64 bytes of Redis'
/// compact hash encoding.
pub(crate) fn encode_tenant(tenant: &str) -> (&'static str, Vec<u8>) {
    let form = TenantForm::of(tenant);
    (form.field(), form.pieces().concat())
}

/// A tenant as [`encode_tenant`] keeps it, without a copy: its field and
/// the pieces of its value.
pub(crate) struct TenantForm<'a> {
    /// The tenant, or the prefix before its hash.
    text: &'a [u8],
    /// The hash's bytes, when the tenant ends in one.
    hash: Option<[u8; 32]>,
}

/// A tenant text and its hash's bytes, when it ends in one.
type EncodedTenant = (std::sync::Arc<str>, Option<[u8; 32]>);

thread_local! {
    /// The tenant this thread encoded last, kept alive, with its hash's
    /// bytes: one caller's requests share one tenant text (the layer's
    /// extractors hand out one `Arc` per caller), so its hex is decoded
    /// once per run of that caller's requests on the thread, not per
    /// request. Holding the `Arc` keeps its text from being freed and
    /// replaced, so the same pointer means the same text.
    static LAST_TENANT: std::cell::RefCell<Option<EncodedTenant>> =
        const { std::cell::RefCell::new(None) };
}

impl<'a> TenantForm<'a> {
    /// [`of`](Self::of) for a shared tenant text: the hash of the text this
    /// thread encoded last is reused when `tenant` is that very text.
    pub(crate) fn of_shared(tenant: &'a std::sync::Arc<str>) -> Self {
        let reused = LAST_TENANT
            .try_with(|last| match &*last.borrow() {
                Some((text, hash)) if std::sync::Arc::ptr_eq(text, tenant) => Some(*hash),
                _ => None,
            })
            .ok()
            .flatten();
        if let Some(hash) = reused {
            let bytes = tenant.as_bytes();
            let text = match hash {
                Some(_) => &bytes[..bytes.len() - 64],
                None => bytes,
            };
            return Self { text, hash };
        }
        let form = Self::of(tenant);
        // A thread past its thread-locals' end keeps nothing.
        let _ = LAST_TENANT.try_with(|last| {
            *last.borrow_mut() = Some((std::sync::Arc::clone(tenant), form.hash));
        });
        form
    }

    pub(crate) fn of(tenant: &'a str) -> Self {
        /// Each byte's value as a lower-case hex digit, or 0x10 when it is
        /// none: an upper-case digit would not read back as written.
        const NIBBLES: [u8; 256] = {
            let mut table = [0x10u8; 256];
            let mut digit = 0;
            while digit < 16 {
                table[b"0123456789abcdef"[digit] as usize] = digit as u8;
                digit += 1;
            }
            table
        };
        // Every pair looked up without a branch; one check at the end.
        fn decode(hex: &[u8]) -> Option<[u8; 32]> {
            let mut hash = [0u8; 32];
            let mut seen = 0u8;
            for (byte, pair) in hash.iter_mut().zip(hex.chunks_exact(2)) {
                let (high, low) = (NIBBLES[usize::from(pair[0])], NIBBLES[usize::from(pair[1])]);
                seen |= high | low;
                *byte = high << 4 | low;
            }
            (seen < 0x10).then_some(hash)
        }
        let bytes = tenant.as_bytes();
        if let Some(split) = bytes.len().checked_sub(64) {
            let (prefix, hex) = bytes.split_at(split);
            if let Some(hash) = decode(hex) {
                return Self {
                    text: prefix,
                    hash: Some(hash),
                };
            }
        }
        Self {
            text: bytes,
            hash: None,
        }
    }

    /// `tenant` or `tenant_bin`.
    pub(crate) fn field(&self) -> &'static str {
        if self.hash.is_some() {
            f::TENANT_BIN
        } else {
            f::TENANT
        }
    }

    /// The field's value, in two pieces.
    pub(crate) fn pieces(&self) -> [&[u8]; 2] {
        [
            self.text,
            self.hash.as_ref().map_or(&[][..], |hash| &hash[..]),
        ]
    }
}

/// Reads back what [`encode_tenant`] wrote.
fn decode_tenant(fields: &HashMap<String, &Value>) -> Result<String, StoreError> {
    if let Some(value) = fields.get(f::TENANT) {
        return text(value);
    }
    let raw = bytes(
        fields
            .get(f::TENANT_BIN)
            .ok_or_else(|| corrupt("record lacks tenant"))?,
    )?;
    let split = raw
        .len()
        .checked_sub(32)
        .ok_or_else(|| corrupt("short tenant"))?;
    let prefix = std::str::from_utf8(&raw[..split]).map_err(|_| corrupt("tenant prefix"))?;
    let mut tenant = String::with_capacity(prefix.len() + 64);
    tenant.push_str(prefix);
    idem_core::push_hex(&mut tenant, &raw[split..]);
    Ok(tenant)
}

/// A stored response's headers as a record keeps them: each name and
/// value led by its length (four bytes, big-endian).
#[cfg(test)]
pub(crate) fn encode_headers(headers: &[(HeaderName, Bytes)]) -> Vec<u8> {
    encode_headers_as(headers, false)
}

/// [`encode_headers`], or with `compact` in the compact form (see
/// [`COMPACT_HEADERS`]).
#[cfg(test)]
pub(crate) fn encode_headers_as(headers: &[(HeaderName, Bytes)], compact: bool) -> Vec<u8> {
    // Sized once: growing from empty reallocates four or five times.
    let size = headers
        .iter()
        .map(|(name, value)| 8 + name.as_str().len() + value.len());
    let mut out = Vec::with_capacity(size.sum::<usize>() + 1);
    let _ = write_headers(&mut out, headers, compact);
    out
}

/// The first byte of a headers field in the compact form: each name and
/// value led by its length in one byte, or by 255 and then four bytes
/// (big-endian) when it is 255 or longer. Gateway-shaped headers
/// (`content-type` and `location`) take 10 bytes fewer than in the
/// four-byte form and so stay within the 64 bytes a value of Redis'
/// compact hash may take. A field in the four-byte form never begins with
/// this byte: it begins with the high byte of a header name's length,
/// and a header name is far shorter than 16 MiB (an empty field is empty
/// in either form).
pub(crate) const COMPACT_HEADERS: u8 = 1;

/// Writes a response's headers into `out` as a record keeps them: in the
/// four-byte form of [`encode_headers`], or with `compact` in the form of
/// [`COMPACT_HEADERS`].
pub(crate) fn write_headers(
    out: &mut dyn std::io::Write,
    headers: &[(HeaderName, Bytes)],
    compact: bool,
) -> std::io::Result<()> {
    if compact && !headers.is_empty() {
        out.write_all(&[COMPACT_HEADERS])?;
    }
    for (name, value) in headers {
        for part in [name.as_str().as_bytes(), value.as_ref()] {
            let length = u32::try_from(part.len()).unwrap_or(u32::MAX);
            match u8::try_from(length) {
                Ok(short) if compact && short < u8::MAX => out.write_all(&[short])?,
                _ => {
                    if compact {
                        out.write_all(&[u8::MAX])?;
                    }
                    out.write_all(&length.to_be_bytes())?;
                }
            }
            out.write_all(part)?;
        }
    }
    Ok(())
}

/// A record's headers field, in either form (see [`COMPACT_HEADERS`]).
pub(crate) fn decode_headers(raw: &[u8]) -> Result<Vec<(HeaderName, Bytes)>, StoreError> {
    fn four_bytes(raw: &mut &[u8]) -> Result<usize, StoreError> {
        let (length, rest) = raw
            .split_first_chunk::<4>()
            .ok_or_else(|| corrupt("truncated headers"))?;
        *raw = rest;
        Ok(u32::from_be_bytes(*length) as usize)
    }
    fn take<'a>(raw: &mut &'a [u8], compact: bool) -> Result<&'a [u8], StoreError> {
        let length = match raw.split_first() {
            Some((&short, rest)) if compact && short < u8::MAX => {
                *raw = rest;
                usize::from(short)
            }
            Some((_, rest)) if compact => {
                *raw = rest;
                four_bytes(raw)?
            }
            _ => four_bytes(raw)?,
        };
        if raw.len() < length {
            return Err(corrupt("truncated headers"));
        }
        let (part, rest) = raw.split_at(length);
        *raw = rest;
        Ok(part)
    }
    let (compact, mut raw) = match raw.split_first() {
        Some((&COMPACT_HEADERS, rest)) => (true, rest),
        _ => (false, raw),
    };
    let mut headers = Vec::new();
    while !raw.is_empty() {
        let (name, value) = (take(&mut raw, compact)?, take(&mut raw, compact)?);
        // Only names a header map held are stored; one that does not
        // parse is left out of the replay, as the layer always did.
        if let Ok(name) = HeaderName::from_bytes(name) {
            headers.push((name, Bytes::copy_from_slice(value)));
        }
    }
    Ok(headers)
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
pub(crate) fn current_attempt(
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

pub(crate) fn lease_args(invocation: &mut Invocation<'_>, lease: &Lease) {
    invocation.arg(lease.generation).uuid(&lease.token.0);
}

/// This process' clock, in Unix milliseconds (0 before 1970).
pub(crate) use idem_core::unix_ms;
