//! A model of idem's protocol, explored by the [`stateright`] model checker.
//!
//! The model holds one scope, a few *owners* (gateway processes or layers)
//! that take client requests for it, a *store* and a *clock*. The store's
//! record is driven by `idem_core::machine`, the pure state machine the
//! memory store runs and the Redis and PostgreSQL stores implement, so the
//! checker checks the code, not a copy of it. Every interleaving of these
//! steps is explored, within the bounds of [`Bounds`]:
//!
//! * an owner takes a request and reserves (the reply may be lost after the
//!   store applied it); runs the action, which succeeds, fails temporarily
//!   or ends with an unknown outcome (a side effect happens in the first
//!   and the third); renews its lease; completes, releases or abandons (a
//!   reply may be lost, a call may fail while the store is down); learns a
//!   late answer or gives up waiting for it; crashes;
//! * the store crashes and restarts (keeping what its [`Persistence`]
//!   made durable), becomes unreachable for a while without restarting,
//!   and takes an operator's cancel;
//! * the clock advances by a tick, so leases lapse. An owner that is alive
//!   and reaches the store acts before its lease lapses (the layer renews
//!   every third of a lease): a tick that would let such a lease lapse is
//!   not taken. While the store is down or unreachable, time runs freely.
//!
//! Which of the bad-day designs are in force is set by [`Design`]; which
//! documented limits excuse a second side effect by [`Excuses`]. The
//! properties are in [`IdemModel::properties`] (see `docs/model.md`).

use std::{
    fmt::Write as _,
    hash::{Hash, Hasher},
    time::Duration,
};

use bytes::Bytes;
use idem_core::{
    AttemptId, Cancellation, Completion, Fingerprint, IdempotencyKey, Lease, Outcome, OwnerToken,
    Record, RecordState, Reservation, ReserveRequest, Scope, StoredResponse, machine,
};
use stateright::{Model, Property};

/// The length of one clock tick, in store milliseconds.
pub const TICK_MS: u64 = 1_000;
/// The lease, two ticks.
pub const LEASE_MS: u64 = 2 * TICK_MS;
/// The clock's reading at the start.
const START_MS: u64 = 1_000_000;

/// Which of the bad-day designs the owners and the store follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Design {
    /// SPEC section 8: after a store restart a lease counts as running
    /// until at least a lease after the start
    /// ([`machine::lease_after_start`]).
    pub restart_grace: bool,
    /// A release the store could not take is kept and retried.
    pub retry_release: bool,
    /// An abandon (the reservation whose reply was lost) the store could
    /// not take is kept and retried.
    pub retry_abandon: bool,
    /// An unknown outcome keeps the lease and waits for a late answer; off,
    /// it is released like a temporary failure.
    pub unknown_wait: bool,
}

impl Design {
    /// idem's design: every bad-day rule in force.
    pub const IDEM: Self = Self {
        restart_grace: true,
        retry_release: true,
        retry_abandon: true,
        unknown_wait: true,
    };
}

/// The documented limits: faults after which a second side effect of one
/// scope is allowed (and the upstream sees a higher `Idempotency-Attempt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Excuses {
    /// An owner that crashed before its outcome was recorded: its lease
    /// lapses and a retry takes over.
    pub owner_crash: bool,
    /// An owner that gave up waiting for an unknown outcome.
    pub unknown_give_up: bool,
    /// A store that lost writes it had acknowledged in a restart (no
    /// persistence, or `appendfsync everysec`).
    pub store_loss: bool,
    /// A store unreachable, without a restart, for longer than a lease
    /// held across the outage.
    pub partition: bool,
    /// An operator force-released a processing record (the records API's
    /// release of a record whose owner is gone): its owner may still run.
    pub operator_release: bool,
}

impl Excuses {
    /// Every limit the docs name.
    pub const DOCUMENTED: Self = Self {
        owner_crash: true,
        unknown_give_up: true,
        store_loss: true,
        partition: true,
        operator_release: true,
    };
}

/// What the store keeps across a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Persistence {
    /// Every write is durable before it is answered (`appendfsync always`,
    /// PostgreSQL's commit).
    Always,
    /// Writes become durable in a later step (`appendfsync everysec`).
    EverySecond,
    /// Nothing survives a restart.
    Nothing,
}

/// How far the checker explores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Owners (gateway processes).
    pub owners: u8,
    /// Client requests, over all owners.
    pub requests: u8,
    /// Clock ticks.
    pub ticks: u8,
    /// Owner crashes.
    pub owner_crashes: u8,
    /// Store crashes (each followed by a restart).
    pub store_crashes: u8,
    /// Outages without a restart.
    pub outages: u8,
    /// Replies lost after the store applied the call.
    pub lost_replies: u8,
    /// Operator cancels.
    pub cancels: u8,
    /// Operator force releases (of a processing record).
    pub force_releases: u8,
    /// Reservations that reach the store after their caller gave up.
    pub delayed: u8,
}

impl Bounds {
    /// Two owners, three requests, four ticks (two leases), no fault: the
    /// base every CI exploration adds its faults to.
    pub const BASE: Self = Self {
        owners: 2,
        requests: 3,
        ticks: 4,
        owner_crashes: 0,
        store_crashes: 0,
        outages: 0,
        lost_replies: 0,
        cancels: 0,
        force_releases: 0,
        delayed: 0,
    };

    /// The deeper run documented in `docs/model.md`: every fault at once.
    pub const DEEP: Self = Self {
        owner_crashes: 1,
        store_crashes: 1,
        outages: 1,
        lost_replies: 1,
        cancels: 1,
        force_releases: 1,
        delayed: 1,
        ..Self::BASE
    };
}

/// The model: its design, its excuses, the store's persistence and the
/// bounds of the exploration.
#[derive(Clone, Debug)]
pub struct IdemModel {
    /// The designs in force.
    pub design: Design,
    /// The limits that excuse a second side effect.
    pub excuses: Excuses,
    /// The store's persistence.
    pub persistence: Persistence,
    /// The exploration's bounds.
    pub bounds: Bounds,
}

impl IdemModel {
    /// idem as designed, with the documented limits, on a store with
    /// `persistence`, explored within `bounds`.
    pub fn idem(persistence: Persistence, bounds: Bounds) -> Self {
        Self {
            design: Design::IDEM,
            excuses: Excuses::DOCUMENTED,
            persistence,
            bounds,
        }
    }
}

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
    fn lease(&self) -> Option<&Lease> {
        match self {
            Self::Running(lease)
            | Self::Holding(lease, _)
            | Self::Unknown(lease)
            | Self::Releasing(lease) => Some(lease),
            _ => None,
        }
    }

    fn token(&self) -> Option<OwnerToken> {
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

/// The scope every request names.
fn scope() -> Scope {
    Scope::new(
        "tenant",
        "POST /payments",
        IdempotencyKey::parse(b"pay-1").unwrap_or_else(|_| unreachable!("a valid key")),
    )
}

fn request() -> ReserveRequest {
    ReserveRequest {
        scope: scope(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_millis(LEASE_MS),
        retention: Duration::from_secs(24 * 3600),
    }
}

/// The outcome an attempt of `generation` records: its status names the
/// generation, so a write that landed from another attempt shows.
fn outcome(status: u16) -> Outcome {
    Outcome::Stored(StoredResponse {
        status,
        headers: Vec::new(),
        body: Bytes::new(),
    })
}

fn status_of(generation: u64) -> u16 {
    200 + u16::try_from(generation % 50).unwrap_or(0)
}

/// The property names, as the checker reports them.
pub mod property {
    /// No two side effects unless a documented limit excuses the first.
    pub const ONCE: &str = "a side effect runs at most once";
    /// The action runs at most once per lease generation.
    pub const PER_GENERATION: &str = "at most one execution per generation";
    /// A takeover only of a lapsed lease with no recorded outcome.
    pub const TAKEOVER: &str = "a new generation only after a lapsed lease";
    /// The first recorded outcome stays.
    pub const COMPLETED: &str = "a completed record never changes";
    /// A replay is the recorded outcome.
    pub const REPLAY: &str = "every replay equals the recorded outcome";
    /// A write of a superseded attempt never lands.
    pub const FENCED: &str = "a fenced write never lands";
    /// A cancelled record is never completed.
    pub const CANCELLED: &str = "a cancelled record is never completed";
    /// A live lease is held by an owner that knows it (or crashed).
    pub const NO_ORPHAN: &str = "no live lease that nobody runs";
    /// Every outcome an owner holds is recorded in the end.
    pub const RECORDED: &str = "a held outcome is recorded once the store answers";
    /// Every release and abandon lands in the end.
    pub const FREED: &str = "a released or abandoned key becomes free";
}

impl IdemModel {
    fn reachable(state: &State) -> bool {
        state.store.up && state.store.reachable
    }

    /// The lease expiry of the record as the store counts it now.
    fn expiry(&self, state: &State) -> Option<u64> {
        let mut slot = state.store.slot.clone();
        if self.design.restart_grace {
            machine::lease_after_start(&mut slot, state.store.started_ms);
        }
        slot.filter(|r| r.state == RecordState::Processing && r.owner.is_some())
            .map(|r| r.lease_expires_at_ms)
    }

    /// Whether `owner`'s lease is the record's current one.
    fn holds_record(state: &State, lease: &Lease) -> bool {
        state.store.slot.as_ref().is_some_and(|r| {
            r.state == RecordState::Processing
                && r.generation == lease.generation
                && r.owner == Some(lease.token)
        })
    }

    /// Whether the clock may advance: an owner that is alive, reaches the
    /// store and must act on it acts first (a lease about to lapse is
    /// renewed or its outcome recorded; a release or abandon lands).
    fn may_tick(&self, state: &State) -> bool {
        if state.left.ticks == 0 {
            return false;
        }
        if !Self::reachable(state) {
            return true;
        }
        if state.in_flight.is_some() {
            return false;
        }
        let expiry = self.expiry(state);
        state.owners.iter().all(|owner| match owner {
            Owner::Releasing(_) | Owner::Abandoning(..) => false,
            Owner::Running(lease) | Owner::Holding(lease, _) | Owner::Unknown(lease) => {
                !Self::holds_record(state, lease)
                    || expiry.is_none_or(|at| at > state.now_ms + TICK_MS)
            }
            Owner::Idle | Owner::Crashed => true,
        })
    }

    /// Applies a store call to the record (after the restart grace, when
    /// in force) and keeps it durable as the persistence says.
    fn on_store<T>(
        &self,
        state: &mut State,
        call: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        if self.design.restart_grace {
            machine::lease_after_start(&mut state.store.slot, state.store.started_ms);
        }
        let answer = call(&mut state.store.slot, state.now_ms);
        if self.persistence == Persistence::Always {
            state.store.durable = state.store.slot.clone();
        }
        answer
    }

    /// A side effect under `token`: a violation when an earlier one ran and
    /// neither lease is excused by a documented limit.
    fn effect(state: &mut State, owner: u8, token: OwnerToken) {
        let excused = |token: &OwnerToken| state.excused.contains(token);
        if !state.lost && !excused(&token) && state.effects.iter().any(|e| !excused(&e.token)) {
            state.violation.get_or_insert(property::ONCE);
        }
        state.effects.push(Effect { owner, token });
    }

    /// Excuses the lease `owner` holds now and every lease it ran under.
    fn excuse_owner(state: &mut State, owner: u8) {
        let mut tokens: Vec<OwnerToken> = state
            .effects
            .iter()
            .filter(|e| e.owner == owner)
            .map(|e| e.token)
            .collect();
        tokens.extend(state.owners[usize::from(owner)].token());
        for token in tokens {
            if !state.excused.contains(&token) {
                state.excused.push(token);
            }
        }
    }

    /// A new attempt id and owner token of owner `o` (its index is the
    /// token's low byte).
    fn ids(state: &mut State, o: u8) -> (AttemptId, OwnerToken) {
        let n = state.made;
        state.made += 1;
        (
            AttemptId(uuid::Uuid::from_u128(u128::from(n) << 8 | u128::from(o))),
            OwnerToken(uuid::Uuid::from_u128(
                1 << 64 | u128::from(n) << 8 | u128::from(o),
            )),
        )
    }

    fn request_step(&self, state: &mut State, o: u8, lost: bool) {
        state.left.requests -= 1;
        let ids = Self::ids(state, o);
        let lapsed_before = self.expiry(state).is_some_and(|at| at <= state.now_ms)
            || state
                .store
                .slot
                .as_ref()
                .is_some_and(|r| r.state == RecordState::Processing && r.owner.is_none());
        let answer = self.on_store(state, |slot, now| {
            machine::reserve(slot, &request(), now, ids.0, ids.1)
        });
        if matches!(answer, Reservation::TakenOver { .. }) && !lapsed_before {
            state.violation.get_or_insert(property::TAKEOVER);
        }
        let index = usize::from(o);
        if lost {
            state.left.lost_replies -= 1;
            // The caller gave up on the call: whatever the store did, the
            // reservation is freed by its owner token.
            state.owners[index] = Owner::Abandoning(ids.0, ids.1);
            return;
        }
        state.owners[index] = match answer {
            Reservation::Acquired(lease) | Reservation::TakenOver { lease, .. } => {
                Owner::Running(lease)
            }
            Reservation::Completed(replay) => {
                if state.recorded.as_ref() != Some(&replay.outcome) && !state.lost {
                    state.violation.get_or_insert(property::REPLAY);
                }
                Owner::Idle
            }
            _ => Owner::Idle,
        };
    }

    fn execute_step(&self, state: &mut State, o: u8, ran: Ran) {
        let index = usize::from(o);
        let Some(lease) = state.owners[index].lease().cloned() else {
            return;
        };
        if state.executed.contains(&lease.generation) && !state.lost {
            state.violation.get_or_insert(property::PER_GENERATION);
        }
        state.executed.push(lease.generation);
        state.owners[index] = match ran {
            Ran::Success => {
                Self::effect(state, o, lease.token);
                Owner::Holding(lease.clone(), status_of(lease.generation))
            }
            Ran::TemporaryFailure => Owner::Releasing(lease),
            Ran::Unknown => {
                Self::effect(state, o, lease.token);
                if self.design.unknown_wait {
                    Owner::Unknown(lease)
                } else {
                    Owner::Releasing(lease)
                }
            }
        };
    }

    fn complete_step(&self, state: &mut State, o: u8, lost: bool) {
        let index = usize::from(o);
        let Owner::Holding(lease, status) = state.owners[index].clone() else {
            return;
        };
        let written = outcome(status);
        let answer = self.on_store(state, |slot, now| {
            machine::complete(slot, &lease, &written, now)
        });
        if matches!(answer, Completion::Recorded) && state.recorded.is_none() {
            state.recorded = Some(written);
        }
        if lost {
            // Completions are retried; the retry is answered as the first.
            state.left.lost_replies -= 1;
            return;
        }
        state.owners[index] = Owner::Idle;
    }

    fn release_step(&self, state: &mut State, o: u8, lost: bool) {
        let index = usize::from(o);
        let Owner::Releasing(lease) = state.owners[index].clone() else {
            return;
        };
        let _ = self.on_store(state, |slot, now| machine::release(slot, &lease, now));
        if lost {
            state.left.lost_replies -= 1;
            if self.design.retry_release {
                return;
            }
        }
        state.owners[index] = Owner::Idle;
    }

    fn call_fails(&self, state: &mut State, o: u8) {
        let index = usize::from(o);
        let keep = match &state.owners[index] {
            Owner::Releasing(_) => self.design.retry_release,
            Owner::Abandoning(..) => self.design.retry_abandon,
            _ => true,
        };
        if !keep {
            state.owners[index] = Owner::Idle;
        }
    }

    fn outage_ends(&self, state: &mut State) {
        state.store.reachable = true;
        // An owner whose lease lapsed while nobody could reach the store
        // (no restart to grant it time back) may be taken over.
        if !self.excuses.partition {
            return;
        }
        let expiry = self.expiry(state);
        let lapsed: Vec<OwnerToken> = state
            .owners
            .iter()
            .filter_map(Owner::lease)
            .filter(|lease| Self::holds_record(state, lease))
            .filter(|_| expiry.is_some_and(|at| at <= state.now_ms))
            .map(|lease| lease.token)
            .collect();
        state.excused.extend(lapsed);
    }

    fn restart(&self, state: &mut State) {
        let lost = state.store.slot != state.store.durable;
        state.store.slot = state.store.durable.clone();
        state.store.up = true;
        state.store.started_ms = state.now_ms;
        if lost && self.excuses.store_loss {
            state.lost = true;
        }
    }

    /// Whether a live lease is held by an alive owner that does not know
    /// it: nobody runs it, and the key stays taken until it lapses.
    fn orphaned(&self, state: &State) -> bool {
        let Some(record) = state.store.slot.as_ref() else {
            return false;
        };
        let Some(token) = record.owner else {
            return false;
        };
        if record.state != RecordState::Processing
            || state.lost
            || state.given_up.contains(&token)
            || self.expiry(state).is_none_or(|at| at <= state.now_ms)
        {
            return false;
        }
        // The owner's index is the token's low byte.
        let index = (token.0.as_u128() & 0xff) as usize;
        match state.owners.get(index) {
            Some(Owner::Crashed) | None => false,
            Some(owner) => owner.token() != Some(token),
        }
    }
}

impl Model for IdemModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now_ms: START_MS,
            store: StoreState {
                slot: None,
                durable: None,
                up: true,
                reachable: true,
                started_ms: 0,
            },
            owners: vec![Owner::Idle; usize::from(self.bounds.owners)],
            effects: Vec::new(),
            executed: Vec::new(),
            recorded: None,
            cancelled: false,
            violation: None,
            made: 0,
            given_up: Vec::new(),
            excused: Vec::new(),
            lost: false,
            in_flight: None,
            left: self.bounds,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.violation.is_some() {
            return;
        }
        let reachable = Self::reachable(state);
        let lose = state.left.lost_replies > 0;
        if self.may_tick(state) {
            actions.push(Action::Tick);
        }
        for (i, owner) in state.owners.iter().enumerate() {
            let Ok(o) = u8::try_from(i) else { continue };
            match owner {
                Owner::Idle if reachable && state.left.requests > 0 => {
                    actions.push(Action::Request(o, false));
                    if lose {
                        actions.push(Action::Request(o, true));
                    }
                    if state.left.delayed > 0 && state.in_flight.is_none() {
                        actions.push(Action::RequestDelayed(o));
                    }
                }
                Owner::Running(_) => {
                    actions.push(Action::Execute(o, Ran::Success));
                    actions.push(Action::Execute(o, Ran::TemporaryFailure));
                    actions.push(Action::Execute(o, Ran::Unknown));
                }
                Owner::Unknown(_) => {
                    actions.push(Action::LateAnswer(o));
                    actions.push(Action::GiveUp(o));
                }
                _ => {}
            }
            // The layer renews every third of a lease; here a renewal is
            // taken when the next tick would let the lease lapse (earlier
            // ones only add states that differ by the renewal's time).
            if let Some(lease) = owner.lease()
                && reachable
                && matches!(
                    owner,
                    Owner::Running(_) | Owner::Holding(..) | Owner::Unknown(_)
                )
                && self
                    .expiry(state)
                    .is_some_and(|at| at <= state.now_ms + TICK_MS)
                && Self::holds_record(state, lease)
            {
                actions.push(Action::Renew(o));
            }
            match owner {
                Owner::Holding(..) if reachable => {
                    actions.push(Action::Complete(o, false));
                    if lose {
                        actions.push(Action::Complete(o, true));
                    }
                }
                Owner::Releasing(_) if reachable => {
                    actions.push(Action::Release(o, false));
                    if lose {
                        actions.push(Action::Release(o, true));
                    }
                }
                // The abandon goes out after the delayed reservation on its
                // connection.
                Owner::Abandoning(..)
                    if reachable && state.in_flight.is_none_or(|(owner, ..)| owner != o) =>
                {
                    actions.push(Action::Abandon(o));
                }
                Owner::Holding(..) | Owner::Releasing(_) | Owner::Abandoning(..) => {
                    actions.push(Action::CallFails(o));
                }
                _ => {}
            }
            if !matches!(owner, Owner::Crashed) && state.left.owner_crashes > 0 {
                actions.push(Action::Crash(o));
            }
        }
        if state.store.up && state.left.store_crashes > 0 {
            actions.push(Action::StoreCrash);
        }
        if !state.store.up {
            actions.push(Action::StoreRestart);
        }
        if state.store.up
            && self.persistence == Persistence::EverySecond
            && state.store.durable != state.store.slot
        {
            actions.push(Action::Fsync);
        }
        if state.store.reachable && state.left.outages > 0 {
            actions.push(Action::OutageStarts);
        }
        if !state.store.reachable {
            actions.push(Action::OutageEnds);
        }
        if reachable && state.left.cancels > 0 && state.store.slot.is_some() {
            actions.push(Action::Cancel);
        }
        if reachable
            && state.left.force_releases > 0
            && state
                .store
                .slot
                .as_ref()
                .is_some_and(|r| r.state == RecordState::Processing)
        {
            actions.push(Action::ForceRelease);
        }
        if state.in_flight.is_some() {
            if reachable {
                actions.push(Action::DelayedLands);
            }
            actions.push(Action::DelayedDropped);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => {
                state.left.ticks -= 1;
                state.now_ms += TICK_MS;
            }
            Action::Request(o, lost) => self.request_step(&mut state, o, lost),
            Action::Execute(o, ran) => self.execute_step(&mut state, o, ran),
            Action::Renew(o) => {
                if let Some(lease) = state.owners[usize::from(o)].lease().cloned() {
                    let _ =
                        self.on_store(&mut state, |slot, now| machine::renew(slot, &lease, now));
                }
            }
            Action::Complete(o, lost) => self.complete_step(&mut state, o, lost),
            Action::Release(o, lost) => self.release_step(&mut state, o, lost),
            Action::Abandon(o) => {
                if let Owner::Abandoning(attempt, token) = state.owners[usize::from(o)] {
                    self.on_store(&mut state, |slot, now| {
                        machine::abandon(slot, attempt, token, now)
                    });
                    state.owners[usize::from(o)] = Owner::Idle;
                }
            }
            Action::CallFails(o) => self.call_fails(&mut state, o),
            Action::LateAnswer(o) => {
                if let Owner::Unknown(lease) = state.owners[usize::from(o)].clone() {
                    let status = status_of(lease.generation);
                    state.owners[usize::from(o)] = Owner::Holding(lease, status);
                }
            }
            Action::GiveUp(o) => {
                if let Some(token) = state.owners[usize::from(o)].token() {
                    state.given_up.push(token);
                }
                state.owners[usize::from(o)] = Owner::Idle;
                if self.excuses.unknown_give_up {
                    Self::excuse_owner(&mut state, o);
                }
            }
            Action::Crash(o) => {
                state.left.owner_crashes -= 1;
                state.owners[usize::from(o)] = Owner::Crashed;
                if self.excuses.owner_crash {
                    Self::excuse_owner(&mut state, o);
                }
            }
            Action::StoreCrash => {
                state.left.store_crashes -= 1;
                state.store.up = false;
                if self.persistence == Persistence::Nothing {
                    state.store.durable = None;
                }
            }
            Action::StoreRestart => self.restart(&mut state),
            Action::Fsync => state.store.durable = state.store.slot.clone(),
            Action::OutageStarts => {
                state.left.outages -= 1;
                state.store.reachable = false;
            }
            Action::OutageEnds => self.outage_ends(&mut state),
            Action::ForceRelease => {
                state.left.force_releases -= 1;
                let owner = state.store.slot.as_ref().and_then(|r| r.owner);
                let _ = self.on_store(&mut state, machine::force_release);
                if self.excuses.operator_release {
                    state.excused.extend(owner);
                }
            }
            Action::RequestDelayed(o) => {
                state.left.requests -= 1;
                state.left.delayed -= 1;
                let (attempt, token) = Self::ids(&mut state, o);
                state.in_flight = Some((o, attempt, token));
                state.owners[usize::from(o)] = Owner::Abandoning(attempt, token);
            }
            Action::DelayedLands => {
                if let Some((_, attempt, token)) = state.in_flight.take() {
                    let _ = self.on_store(&mut state, |slot, now| {
                        machine::reserve(slot, &request(), now, attempt, token)
                    });
                }
            }
            Action::DelayedDropped => state.in_flight = None,
            Action::Cancel => {
                state.left.cancels -= 1;
                let answer = self.on_store(&mut state, machine::cancel);
                if matches!(answer, Cancellation::Cancelled(_)) {
                    state.cancelled = true;
                }
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(property::ONCE, |_, state: &State| {
                state.violation != Some(property::ONCE)
            }),
            Property::always(property::PER_GENERATION, |_, state: &State| {
                state.violation != Some(property::PER_GENERATION)
            }),
            Property::always(property::TAKEOVER, |_, state: &State| {
                state.violation != Some(property::TAKEOVER)
            }),
            Property::always(property::REPLAY, |_, state: &State| {
                state.violation != Some(property::REPLAY)
            }),
            Property::always(property::COMPLETED, |_, state: &State| {
                let Some(recorded) = state.recorded.as_ref().filter(|_| !state.lost) else {
                    return true;
                };
                state.store.slot.as_ref().is_none_or(|r| {
                    r.state == RecordState::Completed && r.outcome.as_ref() == Some(recorded)
                })
            }),
            Property::always(property::FENCED, |_, state: &State| {
                state.store.slot.as_ref().is_none_or(|r| {
                    r.state != RecordState::Completed
                        || r.outcome == Some(outcome(status_of(r.generation)))
                })
            }),
            Property::always(property::CANCELLED, |_, state: &State| {
                !state.cancelled
                    || state
                        .store
                        .slot
                        .as_ref()
                        .is_none_or(|r| r.state != RecordState::Completed)
            }),
            Property::always(property::NO_ORPHAN, |model: &IdemModel, state: &State| {
                !model.orphaned(state)
            }),
            Property::eventually(property::RECORDED, |_, state: &State| {
                !state
                    .owners
                    .iter()
                    .any(|o| matches!(o, Owner::Holding(..) | Owner::Unknown(_)))
            }),
            Property::eventually(property::FREED, |_, state: &State| {
                !state
                    .owners
                    .iter()
                    .any(|o| matches!(o, Owner::Releasing(_) | Owner::Abandoning(..)))
            }),
        ]
    }
}
