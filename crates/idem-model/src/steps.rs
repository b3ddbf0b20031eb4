//! The steps of the model: what each action does to the state, driving
//! idem-core's own state machine for the store's record.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AttemptId, Completion, Erasure, Fingerprint, IdempotencyKey, Lease, Outcome, OwnerToken,
    Record, RecordState, Reservation, ReserveRequest, Scope, StoredResponse, machine,
};

use crate::{
    IdemModel,
    settings::{LEASE_MS, Persistence, TICK_MS, erasure_window_ms},
    state::{Effect, Owner, Ran, State},
};

/// The scope every request names.
pub(crate) fn scope() -> Scope {
    Scope::new(
        "tenant",
        "POST /payments",
        IdempotencyKey::parse(b"pay-1").unwrap_or_else(|_| unreachable!("a valid key")),
    )
}

pub(crate) fn request() -> ReserveRequest {
    ReserveRequest {
        scope: scope(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_millis(LEASE_MS),
        retention: Duration::from_secs(24 * 3600),
    }
}

/// The outcome an attempt of `generation` records: its status names the
/// generation, so a write that landed from another attempt shows.
pub(crate) fn outcome(status: u16) -> Outcome {
    Outcome::Stored(StoredResponse {
        status,
        headers: Vec::new(),
        body: Bytes::new(),
    })
}

pub(crate) fn status_of(generation: u64) -> u16 {
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
    /// A replay cache answers an erased answer only within the feed's
    /// window after the erasure.
    pub const STALE: &str = "no replay of an erased answer past the erasure window";
}

impl IdemModel {
    pub(crate) fn reachable(state: &State) -> bool {
        state.store.up && state.store.reachable
    }

    /// The lease expiry of the record as the store counts it now.
    pub(crate) fn expiry(&self, state: &State) -> Option<u64> {
        let mut slot = state.store.slot.clone();
        if self.design.restart_grace {
            machine::lease_after_start(&mut slot, state.store.started_ms);
        }
        slot.filter(|r| r.state == RecordState::Processing && r.owner.is_some())
            .map(|r| r.lease_expires_at_ms)
    }

    /// Whether `owner`'s lease is the record's current one.
    pub(crate) fn holds_record(state: &State, lease: &Lease) -> bool {
        state.store.slot.as_ref().is_some_and(|r| {
            r.state == RecordState::Processing
                && r.generation == lease.generation
                && r.owner == Some(lease.token)
        })
    }

    /// Whether the clock may advance: an owner that is alive, reaches the
    /// store and must act on it acts first (a lease about to lapse is
    /// renewed or its outcome recorded; a release or abandon lands).
    pub(crate) fn may_tick(&self, state: &State) -> bool {
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
            // A stalled owner holds nothing back: its lease may lapse.
            _ if owner
                .token()
                .is_some_and(|token| state.stalled.contains(&token)) =>
            {
                true
            }
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
    pub(crate) fn on_store<T>(
        &self,
        state: &mut State,
        call: impl FnOnce(&mut Option<Record>, u64) -> T,
    ) -> T {
        if self.design.restart_grace {
            machine::lease_after_start(&mut state.store.slot, state.store.started_ms);
        }
        // A format 3 string that any call writes becomes the format 2 hash
        // it stands for, whose lease is its own, not its expiry's.
        let string = state.store.string_record.then(|| state.store.slot.clone());
        let answer = call(&mut state.store.slot, state.now_ms);
        if string.is_some_and(|before| before != state.store.slot) {
            state.store.string_record = false;
            state.store.expiry_cut_ms = 0;
        }
        if self.persistence == Persistence::Always {
            state.store.durable = state.store.slot.clone();
        }
        answer
    }

    /// A side effect under `token`: a violation when an earlier one ran and
    /// neither lease is excused by a documented limit.
    pub(crate) fn effect(state: &mut State, owner: u8, token: OwnerToken) {
        let excused = |token: &OwnerToken| state.excused.contains(token);
        if !state.lost && !excused(&token) && state.effects.iter().any(|e| !excused(&e.token)) {
            state.violation.get_or_insert(property::ONCE);
        }
        state.effects.push(Effect { owner, token });
    }

    /// Excuses the lease `owner` holds now and every lease it ran under.
    pub(crate) fn excuse_owner(state: &mut State, owner: u8) {
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
    pub(crate) fn ids(state: &mut State, o: u8) -> (AttemptId, OwnerToken) {
        let n = state.made;
        state.made += 1;
        (
            AttemptId(uuid::Uuid::from_u128(u128::from(n) << 8 | u128::from(o))),
            OwnerToken(uuid::Uuid::from_u128(
                1 << 64 | u128::from(n) << 8 | u128::from(o),
            )),
        )
    }

    pub(crate) fn request_step(&self, state: &mut State, o: u8, lost: bool) {
        state.left.requests -= 1;
        if let Some((status, era)) = state.caches.get(usize::from(o)).copied().flatten() {
            // Answered from the owner's replay cache, without the store.
            if era != state.era {
                if state.now_ms >= state.erased_at_ms + erasure_window_ms() {
                    state.violation.get_or_insert(property::STALE);
                }
            } else if state.recorded.as_ref() != Some(&outcome(status)) && !state.lost {
                state.violation.get_or_insert(property::REPLAY);
            }
            return;
        }
        let ids = Self::ids(state, o);
        let lapsed_before = self.expiry(state).is_some_and(|at| at <= state.now_ms)
            || state
                .store
                .slot
                .as_ref()
                .is_some_and(|r| r.state == RecordState::Processing && r.owner.is_none());
        let new_key = state.store.slot.is_none();
        let cut = if state.store.string_record {
            state.store.expiry_cut_ms
        } else {
            0
        };
        let later_start = self.design.format3_later_start;
        let answer = self.on_store(state, |slot, now| {
            // Format 3 judges a string record's lease from its key's
            // expiry (`string_fields` in idem-redis's
            // `lua/string_record.lua`, copied here): the start the
            // expiry gives is `cut` earlier than the start the record
            // carries, and the later of the two counts.
            let own = slot
                .as_mut()
                .filter(|r| cut > 0 && r.state == RecordState::Processing)
                .map(|r| {
                    let own = r.lease_expires_at_ms;
                    let from_expiry = own.saturating_sub(cut);
                    r.lease_expires_at_ms = if later_start {
                        own.max(from_expiry)
                    } else {
                        from_expiry
                    };
                    own
                });
            let answer = machine::reserve(slot, &request(), now, ids.0, ids.1);
            if let (Some(own), Some(record)) = (own, slot.as_mut())
                && !matches!(answer, Reservation::TakenOver { .. })
            {
                record.lease_expires_at_ms = own;
            }
            answer
        });
        if new_key && matches!(answer, Reservation::Acquired(_)) {
            // A new key's record: format 3's one native `SET`.
            state.store.string_record = true;
            state.store.expiry_cut_ms = 0;
        }
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
                self.cache(state, o, &replay.outcome);
                Owner::Idle
            }
            _ => Owner::Idle,
        };
    }

    pub(crate) fn execute_step(&self, state: &mut State, o: u8, ran: Ran) {
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
                    // The history keeps the unknown outcome (the layer's
                    // `Store::mark_unknown`, when the store is reached).
                    if Self::reachable(state) {
                        let _ = self
                            .on_store(state, |slot, now| machine::mark_unknown(slot, &lease, now));
                    }
                    Owner::Unknown(lease)
                } else {
                    Owner::Releasing(lease)
                }
            }
        };
    }

    pub(crate) fn complete_step(&self, state: &mut State, o: u8, lost: bool) {
        let index = usize::from(o);
        let Owner::Holding(lease, status) = state.owners[index].clone() else {
            return;
        };
        let written = outcome(status);
        let answer = self.on_store(state, |slot, now| {
            machine::complete(slot, &lease, &written, now)
        });
        if matches!(answer, Completion::Recorded) {
            if state.recorded.is_none() {
                state.recorded = Some(written.clone());
            }
            self.cache(state, o, &written);
        }
        if lost {
            // Completions are retried; the retry is answered as the first.
            state.left.lost_replies -= 1;
            return;
        }
        state.owners[index] = Owner::Idle;
    }

    pub(crate) fn release_step(&self, state: &mut State, o: u8, lost: bool) {
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

    /// Owner `o` keeps a copy of `answer` in its replay cache (when
    /// erasures are explored; a copy that would outlive an erasure it has
    /// not heard is not taken while its feed says nothing new).
    pub(crate) fn cache(&self, state: &mut State, o: u8, answer: &Outcome) {
        if self.bounds.erasures == 0 {
            return;
        }
        let Outcome::Stored(response) = answer else {
            return;
        };
        if let Some(slot) = state.caches.get_mut(usize::from(o)) {
            *slot = Some((response.status, state.era));
        }
    }

    /// An operator's erasure of the record: its key is new (a new era, in
    /// which the action may run again), and every owner is told.
    pub(crate) fn erase_step(&self, state: &mut State) {
        state.left.erasures -= 1;
        let answer = self.on_store(state, machine::erase);
        if !matches!(answer, Erasure::Erased(_)) {
            return;
        }
        state.era += 1;
        state.erased_at_ms = state.now_ms;
        state.recorded = None;
        state.executed.clear();
        let earlier: Vec<OwnerToken> = state.effects.iter().map(|e| e.token).collect();
        state.excused.extend(earlier);
    }

    /// Owner `o` hears the last erasure (or finds its feed broken): it
    /// drops its cached copy.
    pub(crate) fn hear_erasure(state: &mut State, o: u8) {
        state.caches[usize::from(o)] = None;
    }

    /// The clock passed the feed's window after an erasure: an owner that
    /// has not heard it counts its feed as broken and empties its cache.
    pub(crate) fn silent_feeds_empty_caches(&self, state: &mut State) {
        if !self.design.cache_follows_erasures
            || state.now_ms < state.erased_at_ms + erasure_window_ms()
        {
            return;
        }
        let era = state.era;
        for cached in &mut state.caches {
            if cached.is_some_and(|(_, of)| of != era) {
                *cached = None;
            }
        }
    }

    pub(crate) fn call_fails(&self, state: &mut State, o: u8) {
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

    pub(crate) fn outage_ends(&self, state: &mut State) {
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

    pub(crate) fn restart(&self, state: &mut State) {
        let lost = state.store.slot != state.store.durable;
        if lost {
            state.store.string_record = false;
            state.store.expiry_cut_ms = 0;
        }
        state.store.slot = state.store.durable.clone();
        state.store.up = true;
        state.store.started_ms = state.now_ms;
        if lost && self.excuses.store_loss {
            state.lost = true;
        }
    }

    /// Whether a live lease is held by an alive owner that does not know
    /// it: nobody runs it, and the key stays taken until it lapses.
    pub(crate) fn orphaned(&self, state: &State) -> bool {
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
