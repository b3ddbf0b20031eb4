//! The record format: every field of a Redis record named once, the
//! format versions, and which one a store writes.
//!
//! The Lua sources never spell a field: they write `@name@` (the lower-case
//! name of a field's constant in this module's source), and the quoted
//! field takes its place when a script is assembled (`scripts.rs`). The decoder
//! (`decode.rs`) reads the same constants, so renaming a field, or adding
//! one, is one change here. A test (`scripts.rs`) checks that every
//! placeholder in the sources names a field and that no source spells a
//! field itself.
//!
//! # Versions
//!
//! * **Format 1** keeps every field apart (the expanded layout below) and
//!   a response's headers with four bytes of length per name and value. Its
//!   records carry no `v` field: its absence is format 1.
//! * **Format 2** writes a new key's record packed: `n` for
//!   the reservation's numbers and `d` for the completion's (see
//!   `head.lua`); headers with one byte of length per name and value (led
//!   by a byte 1, which the four-byte form never begins with); and `v` = `2`
//!   in every record it writes. Any path other than a new key, a replay, a
//!   completion or a release rewrites a packed record expanded before it
//!   changes it, keeping `v`. Measured against format 1 (`bench/HISTORY.md`,
//!   "Packed records" and "Compact headers"): about 15 % fewer Redis
//!   instructions per new key and its completion, 15 to 30 % fewer bytes,
//!   and a typical API response kept inside the record instead of a key of
//!   its own.
//!
//! * **Format 3** (the default) keeps a new key's record as one string
//!   instead of a hash (`string_record.rs`): reserved, and replayed, by
//!   one native `SET … NX PX … GET`, completed by a compare-and-set
//!   script that reads no clock. Every other path that may write (a
//!   renewal, a release, a takeover, a cancel, an operator's act) first
//!   rewrites the string as the format 2 hash it stands for
//!   (`convert.lua`, keeping its expiry), and works on that; a record
//!   that ever had a second attempt is a hash. Reads and waits take the
//!   string as it is. A store writing format 2 reads format 3 records the
//!   same way; earlier versions do not, so format 3 rolls out in the two
//!   steps below.
//!
//! Every store reads every format up to [`NEWEST`]. A record of a newer
//! format (written by a later idem) is refused, never misread: the scripts
//! that meet one answer an error (`503 idempotency_store_unavailable`,
//! never failed open) and change nothing.
//!
//! A rolling upgrade to a version that brings a new format runs in two
//! steps: deploy it writing the previous format
//! ([`RedisStoreBuilder::record_format`](crate::RedisStoreBuilder::record_format),
//! the gateway's `--redis-record-format`), so the instances not yet
//! upgraded read everything written; once every instance runs it, write
//! the new format. Format 2 needs no first step from format 1: every
//! store that writes format 1 reads format 2.

/// A format of the records a store writes (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
#[non_exhaustive]
pub enum RecordFormat {
    /// Every field apart, headers with four bytes of length; no `v`
    /// field.
    V1,
    /// Packed new keys, compact headers, `v` = `2`.
    V2,
    /// A new key's record as one string (`string_record.rs`);
    /// every other path works on the format 2 hash it stands for (the
    /// default).
    #[default]
    V3,
}

impl RecordFormat {
    /// The format's number, as a record's `v` field keeps it.
    pub fn number(self) -> u32 {
        match self {
            Self::V1 => 1,
            Self::V2 => 2,
            Self::V3 => 3,
        }
    }

    /// The format numbered `number`, if this version of idem knows it.
    pub fn from_number(number: u32) -> Option<Self> {
        match number {
            1 => Some(Self::V1),
            2 => Some(Self::V2),
            3 => Some(Self::V3),
            _ => None,
        }
    }

    /// Whether a new key's record is written packed (`n`, `d`).
    pub(crate) fn packed(self) -> bool {
        self >= Self::V2
    }

    /// Whether headers are written in the compact form.
    pub(crate) fn compact_headers(self) -> bool {
        self >= Self::V2
    }

    /// Whether a new key's record is one string (format 3).
    pub(crate) fn string_records(self) -> bool {
        self >= Self::V3
    }

    /// The format of the hashes this store's scripts write: its own, or
    /// format 2 for format 3 (whose records become format 2 hashes on
    /// every path but the hot ones).
    pub(crate) fn hash_format(self) -> Self {
        self.min(Self::V2)
    }
}

/// The newest format this version of idem reads.
pub const NEWEST: RecordFormat = RecordFormat::V3;

macro_rules! fields {
    ($($(#[doc = $doc:literal])* $constant:ident = $name:literal;)*) => {
        // Some are named only by the Lua sources, through FIELDS.
        $( $(#[doc = $doc])* #[allow(dead_code)] pub(crate) const $constant: &str = $name; )*
        /// Every field: the placeholder the Lua sources write between `@`s
        /// (the constant's name in lower case) and the field itself.
        pub(crate) const FIELDS: &[(&str, &str)] = &[
            $( (stringify!($constant), $name), )*
        ];
    };
}

fields! {
    /// `processing`, `completed`, `released` or `cancelled`.
    STATE = "state";
    /// The lease generation (absent in a packed record: 1).
    GEN = "gen";
    /// The lease holder's token; meaningful only while processing.
    OWNER = "owner";
    /// The request's fingerprint, hex.
    FP = "fp";
    /// The record's expiry, Unix ms (the key expires with it).
    EXPIRES = "expires";
    /// The lease's end, Unix ms.
    LEASE_UNTIL = "lease_until";
    /// The lease, ms.
    LEASE_MS = "lease_ms";
    /// The retention, ms.
    RETENTION_MS = "retention_ms";
    /// The tenant as text.
    TENANT = "tenant";
    /// A tenant ending in a 64-digit hex hash, with the hash as 32 bytes
    /// (`decode.rs`, `TenantForm`).
    TENANT_BIN = "tenant_bin";
    /// The operation.
    OP = "op";
    /// The idempotency key.
    KEY = "key";
    /// The completed response's status (expanded layout).
    STATUS = "status";
    /// `1` when the response was kept for replay, `0` when not (expanded
    /// layout).
    STORED = "stored";
    /// The response's headers, when headers and body fit in the record.
    HEADERS = "headers";
    /// The response's body, likewise.
    BODY = "body";
    /// The length of the headers, when headers and body are kept in the
    /// response key (`<record>:r`) instead.
    SPLIT = "split";
    /// The newest attempt's id.
    CUR_ID = "cur_id";
    /// The newest attempt's start, Unix ms.
    CUR_START = "cur_start";
    /// The newest attempt's end, Unix ms, or empty.
    CUR_END = "cur_end";
    /// The newest attempt's outcome.
    CUR_OUTCOME = "cur_outcome";
    /// Late evidence of the newest attempt (`completed:201:<ms>`).
    CUR_LATE = "cur_late";
    /// The record's creation, once a second attempt starts.
    CREATED = "created";
    /// Older attempts, JSON.
    HIST = "hist";
    /// A packed record's `<start>:<lease ms>:<retention ms>`.
    N = "n";
    /// A packed record's `<status>:<stored>:<end>`.
    D = "d";
    /// Set when a duplicate waits on the record (`watch.lua`).
    W = "w";
    /// The id of the cancel call that cancelled the record.
    CANCEL_ID = "cancel_id";
    /// The record's format, from format 2 on (see the module's docs).
    V = "v";
}

/// `source` with every `@field@` placeholder replaced by its quoted
/// field. A placeholder that names no field is left as it is (a test
/// checks there is none).
pub(crate) fn substitute(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let field = after.find('@').and_then(|end| {
            let name = &after[..end];
            FIELDS
                .iter()
                .find(|(placeholder, _)| placeholder.eq_ignore_ascii_case(name))
                .filter(|_| {
                    name.bytes()
                        .all(|byte| byte.is_ascii_lowercase() || byte == b'_')
                })
                .map(|(_, field)| (end, *field))
        });
        match field {
            Some((end, field)) => {
                out.push('\'');
                out.push_str(field);
                out.push('\'');
                rest = &after[end + 1..];
            }
            None => {
                out.push('@');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_quoted_fields() {
        assert_eq!(
            substitute("redis.call('HMGET', record, @state@, @cur_end@) -- @NOTIFY@"),
            "redis.call('HMGET', record, 'state', 'cur_end') -- @NOTIFY@"
        );
        assert_eq!(substitute("a @ b @nope@ c"), "a @ b @nope@ c");
    }

    #[test]
    fn fields_are_distinct_and_formats_number_in_order() {
        let mut names: Vec<_> = FIELDS.iter().map(|(_, field)| *field).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FIELDS.len());
        for format in [RecordFormat::V1, RecordFormat::V2, RecordFormat::V3] {
            assert_eq!(RecordFormat::from_number(format.number()), Some(format));
        }
        assert_eq!(RecordFormat::default(), NEWEST);
        assert_eq!(RecordFormat::from_number(NEWEST.number() + 1), None);
    }
}
