//! The model's state: owners, the store and its record, the clock, the
//! side effects; and the actions between states.

use std::{
    fmt::Write as _,
    hash::{Hash, Hasher},
};

use idem_core::{AttemptId, Lease, Outcome, OwnerToken, Record};

use crate::settings::Bounds;

/// What an owner is doing about the scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Nothing: ready for a request.
    Idle,
    /// Holds a lease and is about to run the action.
    Running(Lease),
    /// Ran the action, which answered; records the outcome.
    Holding(Lease, u16),
    /// Ran the action; its outcome is unknown, a late answer may come.
    Unknown(Lease),
    /// The action failed temporarily; releases the key.
    Releasing(Lease),
    /// A reservation whose reply was lost; frees it by its owner token.
    Abandoning(AttemptId, OwnerToken),
    /// Crashed: does nothing more.
    Crashed,
}

impl Owner {
    pub(crate) fn lease(&self) -> Option<&Lease> {
        match self {
            Self::Running(lease)
            | Self::Holding(lease, _)
            | Self::Unknown(lease)
            | Self::Releasing(lease) => Some(lease),
            _ => None,
        }
    }

    pub(crate) fn token(&self) -> Option<OwnerToken> {
        match self {
            Self::Abandoning(_, token) => Some(*token),
            other => other.lease().map(|lease| lease.token),
        }
    }
}

/// One side effect: the action ran and may have acted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effect {
    /// The owner that ran it.
    pub owner: u8,
    /// The lease it ran under.
    pub token: OwnerToken,
}

/// The store: its record, its clock and what it keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreState {
    /// The record the scope's slot holds.
    pub slot: Option<Record>,
    /// What survives a crash.
    pub durable: Option<Record>,
    /// Running (not crashed).
    pub up: bool,
    /// Reachable by the owners (no outage).
    pub reachable: bool,
    /// When it last started.
    pub started_ms: u64,
    /// The record is a format 3 string (a new key's, written by one
    /// native `SET`, not written since): its lease is judged from its
    /// key's expiry.
    pub string_record: bool,
    /// How much an operator shortened that key's expiry, in ms.
    pub expiry_cut_ms: u64,
}

/// One state of the whole system.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    /// The store's clock.
    pub now_ms: u64,
    /// The store.
    pub store: StoreState,
    /// The owners, by index.
    pub owners: Vec<Owner>,
    /// Side effects so far, in order.
    pub effects: Vec<Effect>,
    /// Generations the action ran under (each at most once).
    pub executed: Vec<u64>,
    /// The first outcome the store recorded (never changes after).
    pub recorded: Option<Outcome>,
    /// A cancel that won (the record is never completed after).
    pub cancelled: bool,
    /// A violation seen in a step, by the property it breaks.
    pub violation: Option<&'static str>,
    /// Ids made so far (attempt ids and owner tokens are numbered).
    pub made: u32,
    /// Leases an owner stopped waiting on (an unknown outcome given up):
    /// left to lapse, as designed, not forgotten.
    pub given_up: Vec<OwnerToken>,
    /// Leases a documented limit excuses: a side effect under one of them
    /// (before or after the fault) may be followed by another.
    pub excused: Vec<OwnerToken>,
    /// The store lost writes it had acknowledged (a documented limit, when
    /// excused): nothing is promised about the scope after it.
    pub lost: bool,
    /// A reservation on its way to the store whose caller gave up: its
    /// owner, attempt and token. It lands (or its connection drops) before
    /// the owner's abandon, which goes out after it on one connection.
    pub in_flight: Option<(u8, AttemptId, OwnerToken)>,
    /// Leases whose owner stalled past them (see [`Action::Stall`]).
    pub stalled: Vec<OwnerToken>,
    /// Each owner's replay cache (kept when erasures are explored): the
    /// status of the answer it holds a copy of, and the era it was
    /// recorded in.
    pub caches: Vec<Option<(u16, u8)>>,
    /// How many erasures the scope has had: an erasure makes its key new.
    pub era: u8,
    /// When the last erasure happened. An owner whose cached copy is of
    /// an earlier era has not heard it yet.
    pub erased_at_ms: u64,
    /// Budgets left.
    pub left: Bounds,
}

impl Hash for State {
    // The checker keeps a fingerprint per state: every field that can
    // tell two states apart is hashed (a record through its `Debug` form).
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut text = String::new();
        let _ = write!(text, "{self:?}");
        text.hash(state);
    }
}

/// One step of the system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The clock advances a tick.
    Tick,
    /// Owner `.0` takes a request and reserves; `.1`: the reply is lost.
    Request(u8, bool),
    /// Owner `.0` runs the action, with this result.
    Execute(u8, Ran),
    /// Owner `.0` renews its lease.
    Renew(u8),
    /// Owner `.0` records its outcome; `.1`: the reply is lost.
    Complete(u8, bool),
    /// Owner `.0` releases; `.1`: the reply is lost.
    Release(u8, bool),
    /// Owner `.0` frees the reservation whose reply was lost.
    Abandon(u8),
    /// Owner `.0`'s call fails: the store is down or unreachable.
    CallFails(u8),
    /// Owner `.0` learns the late answer to its unknown outcome.
    LateAnswer(u8),
    /// Owner `.0` stops waiting for its unknown outcome.
    GiveUp(u8),
    /// Owner `.0` crashes.
    Crash(u8),
    /// The store crashes.
    StoreCrash,
    /// The store starts again with what it kept.
    StoreRestart,
    /// The store makes its writes durable (`appendfsync everysec`).
    Fsync,
    /// The store becomes unreachable without restarting.
    OutageStarts,
    /// The store is reachable again.
    OutageEnds,
    /// An operator cancels the record.
    Cancel,
    /// An operator force-releases the processing record.
    ForceRelease,
    /// Owner `.0` sends a reservation that is delayed: its caller gives up
    /// before it lands.
    RequestDelayed(u8),
    /// The delayed reservation lands.
    DelayedLands,
    /// The delayed reservation's connection drops: it never lands.
    DelayedDropped,
    /// Owner `.0` stalls (a blocked thread, a long pause) while it holds a
    /// lease: it stays alive but stops renewing, lets its lease lapse, and
    /// then goes on acting under it.
    Stall(u8),
    /// An operator shortens the format 3 record's expiry by a lease.
    ExpiryShortened,
    /// An operator erases the record (completed or released): its key is
    /// new, and the store's feed tells every owner.
    Erase,
    /// Owner `.0` hears the erasure (or finds its feed broken) and drops
    /// its cached copy.
    HearErasure(u8),
}

/// What running the action came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ran {
    /// It acted and answered (a stored outcome).
    Success,
    /// It failed before acting (a 503): the key is released.
    TemporaryFailure,
    /// It may have acted; no answer came (an upstream timeout).
    Unknown,
}
