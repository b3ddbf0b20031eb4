//! Records, attempts, leases and stored responses.

use std::{fmt, time::Duration};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{Fingerprint, ScopeHash};

/// How many attempts a record keeps; older ones are dropped, newest kept,
/// except the newest attempt of unknown outcome (superseded while it ran),
/// which stays while the record lives: it binds the key to its request.
pub const ATTEMPT_HISTORY: usize = 8;

/// Identifies one execution attempt (a UUIDv7, so ids sort by start time).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AttemptId(pub uuid::Uuid);

impl AttemptId {
    /// A fresh, time-ordered attempt id: a UUIDv7 of the current
    /// millisecond and 74 random bits. Ids of one millisecond are in no
    /// particular order (nothing orders attempts by id: a record orders
    /// them by generation), which spares the process-wide counter that
    /// `Uuid::now_v7` keeps under a lock.
    pub fn new() -> Self {
        Self(uuid::Uuid::new_v7(uuid::Timestamp::now(uuid::NoContext)))
    }
}

impl Default for AttemptId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AttemptId({})", self.0)
    }
}

/// A secret that proves ownership of a lease (random, 122 bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnerToken(pub uuid::Uuid);

impl OwnerToken {
    /// A fresh random token.
    pub fn new() -> Self {
        Self(uuid::Uuid::new_v4())
    }
}

impl Default for OwnerToken {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnerToken(<redacted>)")
    }
}

/// The right to execute one attempt of a scope.
///
/// Every write after [`Store::reserve`](crate::Store::reserve) presents the
/// lease and is a compare-and-set on its `generation` and `token`: once a
/// newer attempt took over, or the record was cancelled, the write is fenced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The record this lease is on.
    pub scope: ScopeHash,
    /// The attempt this lease belongs to.
    pub attempt: AttemptId,
    /// The lease generation: one above the record's previous one.
    pub generation: u64,
    /// The owner's secret.
    pub token: OwnerToken,
    /// How long the lease lasts after each reservation or renewal.
    pub ttl: Duration,
}

/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header fields in order; values are raw bytes. A name is an
    /// [`http::HeaderName`] (lower case): a standard one is kept and cloned
    /// without an allocation, and a replay needs no parse.
    pub headers: Vec<(http::HeaderName, Bytes)>,
    /// The complete body.
    pub body: Bytes,
}

/// What a completed record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The response, replayable byte for byte.
    Stored(StoredResponse),
    /// The handler completed with `status`, but its response was not
    /// stored: it exceeded the storable limit (and was only delivered to
    /// the first caller), or its body failed after the head.
    NotStored {
        /// The status the first caller received.
        status: u16,
    },
}

impl Outcome {
    /// The status code of the completed response.
    pub fn status(&self) -> u16 {
        match self {
            Outcome::Stored(response) => response.status,
            Outcome::NotStored { status } => *status,
        }
    }

    /// A copy that owns its bytes in two exactly sized allocations (the
    /// body, and every header value in one buffer). A response body is often
    /// a slice of a connection's read buffer (8 KiB or more); a store that
    /// keeps the outcome in memory keeps this copy, so a record never pins
    /// that buffer.
    pub fn compacted(&self) -> Outcome {
        match self {
            Outcome::NotStored { status } => Outcome::NotStored { status: *status },
            Outcome::Stored(response) => {
                // One allocation for every header value and the body.
                let total = response.headers.iter().map(|(_, v)| v.len()).sum::<usize>()
                    + response.body.len();
                let mut buffer = Vec::with_capacity(total);
                for (_, value) in &response.headers {
                    buffer.extend_from_slice(value);
                }
                buffer.extend_from_slice(&response.body);
                let buffer = Bytes::from(buffer);
                let mut at = 0;
                let headers = response
                    .headers
                    .iter()
                    .map(|(name, value)| {
                        let slice = buffer.slice(at..at + value.len());
                        at += value.len();
                        (name.clone(), slice)
                    })
                    .collect();
                Outcome::Stored(StoredResponse {
                    status: response.status,
                    headers,
                    body: buffer.slice(at..),
                })
            }
        }
    }
}

/// The lifecycle state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// An attempt holds the lease.
    Processing,
    /// The outcome is stored and replayed.
    Completed,
    /// Cancelled on request; the key answers 410 until the record expires.
    Cancelled,
    /// The last attempt failed temporarily and released the key: the next
    /// reservation starts a new attempt as if the record were absent.
    Released,
}

impl RecordState {
    /// The state's name as used in the records API and in stores.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::Processing => "processing",
            RecordState::Completed => "completed",
            RecordState::Cancelled => "cancelled",
            RecordState::Released => "released",
        }
    }

    /// The state of a name [`as_str`](Self::as_str) gives; `None` for any
    /// other text.
    pub fn parse(name: &str) -> Option<Self> {
        [
            RecordState::Processing,
            RecordState::Completed,
            RecordState::Cancelled,
            RecordState::Released,
        ]
        .into_iter()
        .find(|state| state.as_str() == name)
    }
}

/// How an attempt ended, as far as the record knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// Still holds (or held, until it lapses) the lease.
    Running,
    /// Completed and stored the record's outcome.
    Completed {
        /// The response status.
        status: u16,
    },
    /// Released the reservation after a temporary failure.
    Released,
    /// Taken over after its lease lapsed; its side effects are unknown.
    Superseded,
    /// Its record was cancelled while it ran.
    Cancelled,
    /// An operator released its key (a stuck attempt); its side effects
    /// are unknown.
    ReleasedByOperator,
    /// Its caller was answered that the outcome is unknown (a deadline it
    /// enforced, an upstream's `504`): the action may have run. The attempt
    /// still holds its lease, awaiting a late answer; it ends completed or
    /// released if one comes, and superseded if its lease lapses and a
    /// retry takes over.
    Unknown,
}

impl AttemptOutcome {
    /// Whether the attempt has not ended yet: running, or running with its
    /// outcome [unknown](Self::Unknown) to its caller.
    pub fn is_open(&self) -> bool {
        matches!(self, Self::Running | Self::Unknown)
    }
}

/// What a fenced attempt tried to write after it lost its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LateEvidence {
    /// It finished with this status; the response was not stored.
    Completed {
        /// The response status the attempt produced.
        status: u16,
        /// When the fenced write arrived (store clock, ms since the epoch).
        at_ms: u64,
    },
    /// It tried to release the reservation.
    Released {
        /// When the fenced write arrived (store clock, ms since the epoch).
        at_ms: u64,
    },
}

/// One execution attempt of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// The attempt id.
    pub id: AttemptId,
    /// The lease generation it ran under.
    pub generation: u64,
    /// When it started (store clock, ms since the epoch).
    pub started_at_ms: u64,
    /// When it ended, if it did.
    pub ended_at_ms: Option<u64>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// A fenced write that arrived after the attempt lost its lease.
    pub late: Option<LateEvidence>,
}

/// Everything a store keeps for one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The scope hash the record is stored under.
    pub scope: ScopeHash,
    /// The tenant part of the scope, kept for inspection (shared with the
    /// scope it came from, and in a memory store with the tenant's other
    /// records).
    pub tenant: std::sync::Arc<str>,
    /// The operation part of the scope, kept for inspection (shared as
    /// the tenant is).
    pub operation: std::sync::Arc<str>,
    /// The key part of the scope, kept for inspection (shared with the
    /// scope's key).
    pub key: std::sync::Arc<str>,
    /// The fingerprint of the request that reserved the record.
    pub fingerprint: Fingerprint,
    /// The current state.
    pub state: RecordState,
    /// The generation of the newest lease.
    pub generation: u64,
    /// The current lease owner's token (processing only).
    pub owner: Option<OwnerToken>,
    /// When the current lease lapses (processing only).
    pub lease_expires_at_ms: u64,
    /// Lease length, applied on every reservation and renewal.
    pub lease_ms: u64,
    /// Retention window, counted from the reservation that started the newest
    /// attempt (renewal extends it, so a running attempt never expires).
    pub retention_ms: u64,
    /// When the record was first reserved.
    pub created_at_ms: u64,
    /// When the state last changed.
    pub updated_at_ms: u64,
    /// When the outcome was recorded (completed only).
    pub completed_at_ms: Option<u64>,
    /// When the record expires and the key becomes new.
    pub expires_at_ms: u64,
    /// The stored outcome (completed only).
    pub outcome: Option<Outcome>,
    /// Attempts, oldest first, at most [`ATTEMPT_HISTORY`].
    pub attempts: Vec<Attempt>,
}

/// This process's clock in Unix milliseconds (0 before 1970): the time a
/// record's `*_ms` fields are written in, where a store reads no clock of
/// its own.
#[inline]
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

impl Record {
    /// The attempt with this id, if it is still in the history.
    pub fn attempt(&self, id: AttemptId) -> Option<&Attempt> {
        self.attempts.iter().find(|a| a.id == id)
    }

    /// Whether the record has expired at `now_ms` on the store's clock.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms <= now_ms
    }
}

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::AttemptId;

    /// An attempt id is a UUIDv7 of the current millisecond, and ids drawn
    /// in the same millisecond still differ.
    #[test]
    fn attempt_ids_are_v7_of_now_and_distinct() {
        let now_ms = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("after the epoch")
                .as_millis()
        };
        let before = now_ms();
        let ids: Vec<AttemptId> = (0..1000).map(|_| AttemptId::new()).collect();
        let after = now_ms();
        let distinct: std::collections::HashSet<_> = ids.iter().map(|id| id.0).collect();
        assert_eq!(distinct.len(), ids.len(), "every id is new");
        for id in &ids {
            assert_eq!(id.0.get_version_num(), 7, "{id}");
            let (secs, nanos) = id.0.get_timestamp().expect("a v7 id has a time").to_unix();
            let ms = u128::from(secs) * 1000 + u128::from(nanos) / 1_000_000;
            assert!((before..=after).contains(&ms), "{ms} in {before}..={after}");
        }
    }
}
