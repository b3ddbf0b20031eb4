//! Record format 3: a new key's record kept as one string, so that its hot
//! paths are native commands or one small compare-and-set.
//!
//! * **A new key** is one `SET <record> <reservation> NX PX <retention> GET`:
//!   written when the key is free, and otherwise answered with the record
//!   that holds it, so a replay (and a conflict) costs the same one native
//!   command and no script.
//! * **A completion** is `complete_string.lua`: it checks that the record
//!   is still this reservation's (processing, this owner token) and sets
//!   the completed record (`KEEPTTL`: retention counts from the
//!   reservation). It reads no clock.
//! * **Every other path that may write** (a renewal, a release, a
//!   takeover, a cancel, an operator's act) runs the format 2 scripts.
//!   Those meet a string with `WRONGTYPE`, which the transport answers
//!   [`Answer::StringRecord`]; the store's step for it,
//!   [`converting`], then has `convert.lua` rewrite the string as the
//!   packed format 2 hash it stands for (same expiry) and runs the script
//!   again. A record stays a hash from
//!   then on. Reads take the string as it is (`get.lua` through
//!   `string_record.lua`, `count_lapsed.lua`), and so does a waiter, which
//!   marks it waited on by its state byte (`watch.lua`).
//!
//! # Layout
//!
//! ```text
//! 3 p|a|c <owner token, 36> <attempt id, 36> <fingerprint, 64 hex>
//! <start>:<lease ms>:<retention ms>:
//! t|b <length>: <tenant>   (b: the tenant_bin form, decode.rs)
//! <length>: <operation>
//! <length>: <key>
//! completed only: <status>:<stored>:<ended>:<length of the headers>: <headers><body>
//! ```
//!
//! The start and the end are the writing process' clock (Unix ms): the
//! start bounds how long a process may keep a replay (the record expires a
//! retention after it). Leases are judged on Redis' clock: a string's
//! reservation began a retention before its key expires, or at the start
//! it carries, whichever is later, so an expiry changed from outside
//! (`PEXPIRE`) never shortens a live lease (a lengthened expiry lengthens
//! a processing record's lease by as much; the writer's clock skew may
//! lengthen one too). `convert.lua` and `get.lua` take the hash's start
//! so (`PEXPIRETIME`: every read of a record answers the same start), and
//! so does `count_lapsed.lua` (from `PTTL`); a duplicate's native
//! in-progress answer reads the lease from the key's remaining time
//! (`PTTL`: it began `retention - PTTL` ago), and when that says the lease
//! ran out, the reserve script decides on the converted hash.

use idem_core::{Fingerprint, Outcome, Replay, StoreError};
use redis::Script;

use crate::invocation::{Answer, Invocation};
use crate::pool::Conn;

use crate::decode::{TenantForm, newer_format, replay_from, write_headers};
use crate::errors::corrupt;

/// The record's format byte and its states: processing, processing with
/// a duplicate waiting on it (`watch.lua`), completed.
const VERSION: u8 = b'3';
const PROCESSING: u8 = b'p';
const WATCHED: u8 = b'a';
const COMPLETED: u8 = b'c';

/// Where the format byte and the state byte are (0-based).
const VERSION_AT: usize = 0;
const STATE_AT: usize = 1;
/// Where the fixed fields are; the variable part (`<start>:…`) follows
/// the fingerprint.
const OWNER: std::ops::Range<usize> = 2..38;
const ATTEMPT: std::ops::Range<usize> = 38..74;
const FINGERPRINT: std::ops::Range<usize> = 74..138;

/// The layout as the Lua sources name it: each placeholder (between `@`s,
/// upper case) and what replaces it, derived from the constants above, so
/// the layout is defined once (a test in `scripts.rs` forbids a literal
/// offset into a string record in the sources). Offsets are Lua's
/// (1-based, inclusive ends); `S_STATE_OFFSET` is `SETRANGE`'s (0-based).
pub(crate) fn layout() -> Vec<(&'static str, String)> {
    let quoted = |bytes: &[u8]| format!("'{}'", String::from_utf8_lossy(bytes));
    let lua = |at: usize| (at + 1).to_string();
    vec![
        ("S_NUMBER", char::from(VERSION).to_string()),
        ("S_VERSION", quoted(&[VERSION])),
        ("S_PROCESSING", quoted(&[PROCESSING])),
        ("S_WATCHED", quoted(&[WATCHED])),
        ("S_COMPLETED", quoted(&[COMPLETED])),
        ("S_HEAD_PROCESSING", quoted(&[VERSION, PROCESSING])),
        ("S_HEAD_WATCHED", quoted(&[VERSION, WATCHED])),
        ("S_HEAD_COMPLETED", quoted(&[VERSION, COMPLETED])),
        ("S_VERSION_AT", lua(VERSION_AT)),
        ("S_STATE_AT", lua(STATE_AT)),
        ("S_STATE_OFFSET", STATE_AT.to_string()),
        ("S_AFTER_HEAD", lua(STATE_AT + 1)),
        ("S_OWNER_FROM", lua(OWNER.start)),
        ("S_OWNER_TO", OWNER.end.to_string()),
        ("S_ATTEMPT_FROM", lua(ATTEMPT.start)),
        ("S_ATTEMPT_TO", ATTEMPT.end.to_string()),
        ("S_FP_FROM", lua(FINGERPRINT.start)),
        ("S_FP_TO", FINGERPRINT.end.to_string()),
        ("S_VARIABLE_AT", lua(FINGERPRINT.end)),
    ]
}

/// `source` with the layout's placeholders (`@S_…@`) replaced.
pub(crate) fn substitute_layout(source: &str) -> String {
    layout()
        .into_iter()
        .fold(source.to_owned(), |source, (name, value)| {
            source.replace(&format!("@{name}@"), &value)
        })
}

/// Reads a record kept as one string: the Lua shared by `get.lua` and
/// `convert.lua` (`string_fields`).
pub(crate) const LUA: &str = include_str!("lua/string_record.lua");

/// How many times a script that met a string record converts it and runs
/// again (see [`converting`]).
const CONVERSION_ROUNDS: usize = 3;

/// Rewrites a record kept as one string as the hash it stands for
/// (`convert.lua`), for a script that met it.
static CONVERT: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(&substitute_layout(&crate::format::substitute(&format!(
        "{}\n{}",
        LUA,
        include_str!("lua/convert.lua")
    ))))
});

/// The store's step for a record kept as one string that a script met
/// ([`Answer::StringRecord`], from the transport, which knows no record
/// format): `answer` as it is, or, for that one, the record rewritten as
/// the hash it stands for (same expiry) and the script run again. The
/// callers await the transport's call themselves, so that no async layer
/// grows every call's future; the conversion is boxed (off the hot path).
pub(crate) async fn converting(
    answer: Answer,
    invocation: &Invocation<'_>,
    conn: &mut Conn,
) -> redis::RedisResult<Answer> {
    match answer {
        Answer::StringRecord => Box::pin(converted(invocation, conn)).await,
        answer => Ok(answer),
    }
}

/// Converts the record `invocation` met and runs it again. Another call
/// may convert the record first (then this one finds a hash and converts
/// nothing), and a record that expired meanwhile may be a new string
/// again: a few rounds, each converting what is there and running the
/// script again.
async fn converted(invocation: &Invocation<'_>, conn: &mut Conn) -> redis::RedisResult<Answer> {
    let Some(key) = invocation.record_key() else {
        return Ok(Answer::StringRecord);
    };
    let convert = Invocation::on_key_bytes(&CONVERT, key);
    for _ in 0..CONVERSION_ROUNDS {
        convert.invoke(conn).await?;
        match invocation.invoke(conn).await? {
            Answer::StringRecord => {}
            answer => return Ok(answer),
        }
    }
    Ok(Answer::StringRecord)
}

/// What a reservation writes: the processing record.
pub(crate) struct Reservation<'a> {
    pub(crate) token: &'a uuid::Uuid,
    pub(crate) attempt: &'a uuid::Uuid,
    pub(crate) fingerprint: &'a [u8; 64],
    pub(crate) start_ms: u64,
    pub(crate) lease_ms: u64,
    pub(crate) retention_ms: u64,
    pub(crate) tenant: &'a TenantForm<'a>,
    pub(crate) operation: &'a str,
    pub(crate) key: &'a str,
}

impl Reservation<'_> {
    /// Writes the processing record.
    pub(crate) fn write(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let mut ids = [uuid::Uuid::encode_buffer(), uuid::Uuid::encode_buffer()];
        let [owner, attempt] = &mut ids;
        debug_assert_eq!((VERSION_AT, STATE_AT, OWNER.start), (0, 1, 2));
        out.write_all(&[VERSION, PROCESSING])?;
        out.write_all(self.token.hyphenated().encode_lower(owner).as_bytes())?;
        out.write_all(self.attempt.hyphenated().encode_lower(attempt).as_bytes())?;
        out.write_all(self.fingerprint)?;
        let form = if self.tenant.field() == crate::format::TENANT_BIN {
            'b'
        } else {
            't'
        };
        let [text, hash] = self.tenant.pieces();
        let mut head = Numbers::default();
        head.number(self.start_ms);
        head.number(self.lease_ms);
        head.number(self.retention_ms);
        head.byte(form as u8);
        head.number(text.len() + hash.len());
        out.write_all(head.bytes())?;
        out.write_all(text)?;
        out.write_all(hash)?;
        let mut operation = Numbers::default();
        operation.number(self.operation.len());
        out.write_all(operation.bytes())?;
        out.write_all(self.operation.as_bytes())?;
        let mut key = Numbers::default();
        key.number(self.key.len());
        out.write_all(key.bytes())?;
        out.write_all(self.key.as_bytes())
    }
}

/// Numbers in decimal, each followed by `:`, gathered on the stack: a
/// record's numbers go to the command's argument in one write each group,
/// not one per digit run as `write!` sends them.
struct Numbers {
    buffer: [u8; Self::CAPACITY],
    len: usize,
}

impl Default for Numbers {
    fn default() -> Self {
        Self {
            buffer: [0; Self::CAPACITY],
            len: 0,
        }
    }
}

impl Numbers {
    /// Room for the largest group a record writes: four numbers of up to
    /// 20 digits (`u64::MAX`), each with its `:`, and the tenant's form
    /// byte (a test writes that group with the largest numbers).
    const CAPACITY: usize = 4 * 21 + 1;

    /// Appends `number` and a `:`.
    fn number(&mut self, number: impl itoa::Integer) {
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(number).as_bytes();
        self.put(digits);
        self.byte(b':');
    }

    /// Appends one byte.
    fn byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }

    fn put(&mut self, bytes: &[u8]) {
        // Every group fits (see CAPACITY, and the test that writes the
        // largest); were one longer, it would be cut here rather than panic.
        debug_assert!(self.len + bytes.len() <= Self::CAPACITY);
        let end = (self.len + bytes.len()).min(Self::CAPACITY);
        let taken = end - self.len;
        self.buffer[self.len..end].copy_from_slice(&bytes[..taken]);
        self.len = end;
    }

    fn bytes(&self) -> &[u8] {
        &self.buffer[..self.len]
    }
}

/// What a reservation makes of the record its `SET … GET` found.
#[derive(Debug)]
pub(crate) enum Found {
    /// Completed with this fingerprint: the replay.
    Replay(Replay),
    /// Held, or completed, for another request.
    Conflict,
    /// This very reservation (a retried call whose reply was lost).
    Ours,
    /// Processing for this request under another owner: in progress while
    /// its lease runs, which the record's remaining time tells (`PTTL`:
    /// the lease, which began with the retention, ends when the remaining
    /// time falls to `lease_ends_at`, the retention less the lease); else
    /// the reserve script decides.
    Held { lease_ends_at: i64 },
}

impl Found {
    /// How long the lease of a [`Found::Held`] record still runs, once its
    /// key's `PTTL` is known (zero for a key gone or without expiry).
    pub(crate) fn lease_left(lease_ends_at: i64, pttl: i64) -> u64 {
        if pttl < 0 {
            return 0;
        }
        u64::try_from(pttl.saturating_sub(lease_ends_at)).unwrap_or(0)
    }

    /// A [`Found::Held`] of a record with this lease and retention.
    fn held(lease_ms: u64, retention_ms: u64) -> Self {
        let ms = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        Self::Held {
            lease_ends_at: ms(retention_ms).saturating_sub(ms(lease_ms)),
        }
    }
}

/// Judges the record a reservation of `fingerprint` under `token` found.
pub(crate) fn found(
    raw: Vec<u8>,
    fingerprint: &Fingerprint,
    token: &uuid::Uuid,
) -> Result<Found, StoreError> {
    let parsed = Parsed::of(&raw)?;
    if parsed.fingerprint != fingerprint.hex_bytes() {
        return Ok(Found::Conflict);
    }
    if !parsed.completed {
        let mut buffer = uuid::Uuid::encode_buffer();
        let ours = token.hyphenated().encode_lower(&mut buffer).as_bytes() == parsed.owner;
        return Ok(if ours {
            Found::Ours
        } else {
            Found::held(parsed.lease, parsed.retention)
        });
    }
    let (tail, expires) = (parsed.tail, parsed.start.saturating_add(parsed.retention));
    let attempt = crate::decode::attempt_id(raw.get(ATTEMPT).unwrap_or_default())?;
    replay_from(raw, tail, Some((expires, attempt))).map(Found::Replay)
}

/// Writes a completion's part: `<status>:<stored>:<ended>:<length of the
/// headers>:`, the headers (compact, decode.rs) and the body.
pub(crate) fn write_completion(
    out: &mut dyn std::io::Write,
    outcome: &Outcome,
    ended_ms: u64,
) -> std::io::Result<()> {
    /// Counts what is written: the headers' length, before they are.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    match outcome {
        Outcome::Stored(response) => {
            let mut length = Count(0);
            write_headers(&mut length, &response.headers, true)?;
            let mut head = Numbers::default();
            head.number(response.status);
            head.number(1u8);
            head.number(ended_ms);
            head.number(length.0);
            out.write_all(head.bytes())?;
            write_headers(out, &response.headers, true)?;
            out.write_all(&response.body)
        }
        Outcome::NotStored { status } => {
            let mut head = Numbers::default();
            head.number(*status);
            head.number(0u8);
            head.number(ended_ms);
            head.number(0u8);
            out.write_all(head.bytes())
        }
    }
}

/// The parts of a string record a reservation reads.
struct Parsed<'a> {
    completed: bool,
    owner: &'a [u8],
    fingerprint: &'a [u8],
    start: u64,
    lease: u64,
    retention: u64,
    /// Where the completion's part begins.
    tail: usize,
}

impl<'a> Parsed<'a> {
    fn of(raw: &'a [u8]) -> Result<Self, StoreError> {
        let completed = match raw {
            [VERSION, PROCESSING | WATCHED, ..] => false,
            [VERSION, COMPLETED, ..] => true,
            [version, ..] if version.is_ascii_digit() && *version > VERSION => {
                return Err(newer_format(u64::from(version - b'0')));
            }
            _ => return Err(corrupt("a string record of no known format")),
        };
        let short = || corrupt("a string record cut short");
        let (owner, fingerprint) = (
            raw.get(OWNER).ok_or_else(short)?,
            raw.get(FINGERPRINT).ok_or_else(short)?,
        );
        // The number at `at`, up to its ':', and where the text after it
        // begins.
        let number = |at: usize| -> Result<(u64, usize), StoreError> {
            let rest = raw.get(at..).ok_or_else(short)?;
            let length = rest.iter().position(|&b| b == b':').ok_or_else(short)?;
            let value = std::str::from_utf8(&rest[..length])
                .ok()
                .and_then(|digits| digits.parse().ok())
                .ok_or_else(|| corrupt("a string record's number"))?;
            Ok((value, at + length + 1))
        };
        let (start, at) = number(FINGERPRINT.end)?;
        let (lease, at) = number(at)?;
        let (retention, mut at) = number(at)?;
        // The tenant's form byte, then three length-led fields.
        at += 1;
        for _ in 0..3 {
            let (length, after) = number(at)?;
            at = usize::try_from(length)
                .ok()
                .and_then(|length| after.checked_add(length))
                .ok_or_else(short)?;
        }
        if at > raw.len() {
            return Err(short());
        }
        Ok(Self {
            completed,
            owner,
            fingerprint,
            start,
            lease,
            retention,
            tail: at,
        })
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn reservation<'a>(
        token: &'a uuid::Uuid,
        attempt: &'a uuid::Uuid,
        fingerprint: &'a [u8; 64],
        tenant: &'a TenantForm<'a>,
    ) -> Reservation<'a> {
        Reservation {
            token,
            attempt,
            fingerprint,
            start_ms: 1_700_000_000_000,
            lease_ms: 30_000,
            retention_ms: 86_400_000,
            tenant,
            operation: "POST /orders",
            key: "key:with:colons",
        }
    }

    fn written(reservation: &Reservation<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        reservation.write(&mut out).expect("write");
        out
    }

    /// The largest numbers every group can hold are written whole: the
    /// stack buffer they go through is large enough for each group.
    #[test]
    fn the_largest_numbers_are_written_whole() {
        let (token, attempt) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let tenant = TenantForm::of("acme");
        let fingerprint = [b'a'; 64];
        let mut largest = reservation(&token, &attempt, &fingerprint, &tenant);
        (largest.start_ms, largest.lease_ms, largest.retention_ms) = (u64::MAX, u64::MAX, u64::MAX);
        let raw = written(&largest);
        let max = u64::MAX.to_string();
        let head = format!("{max}:{max}:{max}:t4:acme12:POST /orders15:key:with:colons");
        assert!(
            raw.ends_with(head.as_bytes()),
            "{}",
            String::from_utf8_lossy(&raw)
        );
        let mut completed = Vec::new();
        let not_stored = Outcome::NotStored { status: u16::MAX };
        write_completion(&mut completed, &not_stored, u64::MAX).expect("write");
        assert_eq!(completed, format!("{}:0:{max}:0:", u16::MAX).as_bytes());
    }

    /// The layout as documented, a replay read back whole, and each way a
    /// found record is judged.
    #[test]
    fn a_record_reads_back_as_written() {
        let (token, attempt) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let fingerprint = Fingerprint::from_bytes([0xaa; 32]);
        let hashed = format!("auth:{}", "0f".repeat(32));
        let tenant = TenantForm::of(&hashed);
        let hex = fingerprint.hex_bytes();
        let raw = written(&reservation(&token, &attempt, &hex, &tenant));
        assert_eq!(&raw[..2], b"3p");
        assert_eq!(&raw[OWNER], token.to_string().as_bytes());
        assert_eq!(&raw[38..74], attempt.to_string().as_bytes());
        assert_eq!(&raw[FINGERPRINT], &[b'a'; 64][..]);
        let head = b"1700000000000:30000:86400000:b37:auth:";
        assert_eq!(&raw[138..138 + head.len()], head);
        assert!(raw.ends_with(b"12:POST /orders15:key:with:colons"));
        assert!(matches!(
            found(raw.clone(), &fingerprint, &token),
            Ok(Found::Ours)
        ));
        let other = uuid::Uuid::new_v4();
        assert!(matches!(
            found(raw.clone(), &fingerprint, &other),
            Ok(Found::Held {
                lease_ends_at: 86_370_000
            })
        ));
        // Waited on: still processing.
        let mut watched = raw.clone();
        watched[1] = WATCHED;
        assert!(matches!(
            found(watched, &fingerprint, &token),
            Ok(Found::Ours)
        ));
        // 10 s into a 30 s lease; a key gone or without expiry has none.
        assert_eq!(Found::lease_left(86_370_000, 86_390_000), 20_000);
        assert_eq!(Found::lease_left(86_370_000, 86_000_000), 0);
        assert_eq!(Found::lease_left(86_370_000, -2), 0);
        assert_eq!(Found::lease_left(86_370_000, -1), 0);
        // A lease longer than the retention runs as long as the key.
        let Found::Held { lease_ends_at } = Found::held(120_000, 60_000) else {
            panic!("not held");
        };
        assert_eq!(Found::lease_left(lease_ends_at, 59_000), 119_000);
        let changed = Fingerprint::from_bytes([0xbb; 32]);
        assert!(matches!(
            found(raw.clone(), &changed, &token),
            Ok(Found::Conflict)
        ));

        // Completed, as complete_string.lua writes it.
        let mut completed = raw.clone();
        completed[1] = COMPLETED;
        let body = Bytes::from_static(b"{\"id\":1}\n:7:");
        let stored = Outcome::Stored(idem_core::StoredResponse {
            status: 201,
            headers: vec![(
                idem_core::HeaderName::from_static("location"),
                Bytes::from_static(b"/orders/1"),
            )],
            body: body.clone(),
        });
        write_completion(&mut completed, &stored, 1_700_000_000_500).expect("write");
        let tail = b"201:1:1700000000500:20:\x01\x08location\x09/orders/1";
        assert!(completed.windows(tail.len()).any(|w| w == tail));
        let replayed = found(completed.clone(), &fingerprint, &other);
        let Ok(Found::Replay(replay)) = replayed else {
            panic!("not a replay");
        };
        let idem_core::Outcome::Stored(response) = replay.outcome else {
            panic!("not stored");
        };
        assert_eq!(response.status, 201);
        assert_eq!(response.body, body);
        assert_eq!(response.headers[0].1, Bytes::from_static(b"/orders/1"));
        // It expires a retention after its start, long past.
        assert_eq!(replay.expires_in, Some(std::time::Duration::ZERO));
        assert!(matches!(
            found(completed.clone(), &changed, &token),
            Ok(Found::Conflict)
        ));
        // An outcome kept without its response.
        let mut not_stored = raw.clone();
        not_stored[1] = COMPLETED;
        write_completion(&mut not_stored, &Outcome::NotStored { status: 502 }, 9).expect("write");
        assert!(not_stored.ends_with(b"key:with:colons502:0:9:0:"));
        let Ok(Found::Replay(replay)) = found(not_stored, &fingerprint, &token) else {
            panic!("not a replay");
        };
        assert!(matches!(replay.outcome, Outcome::NotStored { status: 502 }));

        // A newer format is refused; anything cut short or unknown is
        // corrupt, never a panic.
        let mut newer = completed.clone();
        newer[0] = b'4';
        assert!(matches!(
            found(newer, &fingerprint, &token),
            Err(StoreError::Refused(error)) if error.to_string().contains("format 4")
        ));
        for cut in 0..raw.len() {
            let cut = found(raw[..cut].to_vec(), &fingerprint, &token);
            assert!(cut.is_err(), "{cut:?}");
        }
        assert!(found(b"hello".to_vec(), &fingerprint, &token).is_err());
    }
}
