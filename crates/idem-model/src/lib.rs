//! A model of idem's protocol, explored by the [`stateright`] model checker.
//!
//! The model holds one scope, a few *owners* (gateway processes or layers)
//! that take client requests for it, a *store* and a *clock*. The store's
//! record is driven by `idem_core::machine`, the pure state machine: the
//! checker checks that code, which the memory store runs, and PostgreSQL
//! on its locked-row paths. Redis's scripts, format 3's Rust and
//! PostgreSQL's one-statement paths implement it apart and are tied to it
//! by the conformance suite and the differential check
//! (`idem_core::differential`), not by the checker (`docs/model.md`). Every interleaving of these
//! steps is explored, within the bounds of [`Bounds`]:
//!
//! * an owner takes a request and reserves (the reply may be lost after the
//!   store applied it); runs the action, which succeeds, fails temporarily
//!   or ends with an unknown outcome (a side effect happens in the first
//!   and the third); renews its lease; completes, releases or abandons (a
//!   reply may be lost, a call may fail while the store is down); learns a
//!   late answer or gives up waiting for it; crashes; stalls past its
//!   lease while alive (it stops renewing and then goes on acting);
//! * the store crashes and restarts (keeping what its [`Persistence`]
//!   made durable), becomes unreachable for a while without restarting,
//!   and takes an operator's cancel, force release, or shortening of a
//!   format 3 record's expiry (the lease that format judges from the
//!   expiry is copied here from `lua/string_record.lua`: see
//!   [`Design::format3_later_start`]), or an operator's erasure, which
//!   makes the key new and which owners' replay caches hear through the
//!   store's feed ([`Design::cache_follows_erasures`]);
//! * the clock advances by a tick, so leases lapse. An owner that is alive,
//!   has not stalled and reaches the store acts before its lease lapses (the layer renews
//!   every third of a lease): a tick that would let such a lease lapse is
//!   not taken. While the store is down or unreachable, time runs freely.
//!
//! Which of the bad-day designs are in force is set by [`Design`]; which
//! documented limits excuse a second side effect by [`Excuses`]. The
//! properties are in [`IdemModel::properties`] (see `docs/model.md`).

use idem_core::{Cancellation, RecordState, machine};
use stateright::{Model, Property};

mod actions;
mod settings;
mod state;
mod steps;

use settings::START_MS;
pub use settings::{Bounds, Design, Excuses, LEASE_MS, Persistence, TICK_MS, erasure_window_ms};
pub use state::{Action, Effect, Owner, Ran, State, StoreState};
pub use steps::property;
use steps::{outcome, request, status_of};

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
                string_record: false,
                expiry_cut_ms: 0,
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
            stalled: Vec::new(),
            caches: vec![None; usize::from(self.bounds.owners)],
            era: 0,
            erased_at_ms: 0,
            left: self.bounds,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.violation.is_some() {
            return;
        }
        let reachable = Self::reachable(state);
        if self.may_tick(state) {
            actions.push(Action::Tick);
        }
        for (i, owner) in state.owners.iter().enumerate() {
            let Ok(o) = u8::try_from(i) else { continue };
            self.owner_actions(state, o, owner, reachable, actions);
        }
        self.store_actions(state, reachable, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => {
                state.left.ticks -= 1;
                state.now_ms += TICK_MS;
                self.silent_feeds_empty_caches(&mut state);
            }
            Action::Request(o, lost) => self.request_step(&mut state, o, lost),
            Action::Execute(o, ran) => self.execute_step(&mut state, o, ran),
            Action::Complete(o, lost) => self.complete_step(&mut state, o, lost),
            Action::Release(o, lost) => self.release_step(&mut state, o, lost),
            Action::CallFails(o) => self.call_fails(&mut state, o),
            Action::Renew(_)
            | Action::Abandon(_)
            | Action::LateAnswer(_)
            | Action::GiveUp(_)
            | Action::Crash(_)
            | Action::RequestDelayed(_)
            | Action::Stall(_) => self.owner_event(&mut state, &action),
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
            Action::DelayedLands => {
                if let Some((_, attempt, token)) = state.in_flight.take() {
                    let _ = self.on_store(&mut state, |slot, now| {
                        machine::reserve(slot, &request(), now, attempt, token)
                    });
                }
            }
            Action::DelayedDropped => state.in_flight = None,
            Action::Erase => self.erase_step(&mut state),
            Action::HearErasure(o) => Self::hear_erasure(&mut state, o),
            Action::ExpiryShortened => {
                state.left.expiry_changes -= 1;
                state.store.expiry_cut_ms += LEASE_MS;
            }
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
            Property::always(property::STALE, |_, state: &State| {
                state.violation != Some(property::STALE)
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
