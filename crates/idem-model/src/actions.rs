//! What may happen next in a state, as the model offers it to the
//! checker: each owner's moves, the store's, its network's and its
//! operators', and an owner's own events applied.

use idem_core::{RecordState, machine};

use crate::{Action, IdemModel, Owner, Persistence, Ran, State, TICK_MS, steps::status_of};

impl IdemModel {
    /// What owner `o` may do next (`reachable`: the store answers).
    pub(crate) fn owner_actions(
        &self,
        state: &State,
        o: u8,
        owner: &Owner,
        reachable: bool,
        actions: &mut Vec<Action>,
    ) {
        let lose = state.left.lost_replies > 0;
        match owner {
            Owner::Idle if state.left.requests > 0 && state.caches[usize::from(o)].is_some() => {
                // Answered from the owner's replay cache.
                actions.push(Action::Request(o, false));
            }
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
        self.lease_actions(state, o, owner, reachable, actions);
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

    /// An owner's moves on its lease: a stall past it, or a renewal.
    fn lease_actions(
        &self,
        state: &State,
        o: u8,
        owner: &Owner,
        reachable: bool,
        actions: &mut Vec<Action>,
    ) {
        // The layer renews every third of a lease; here a renewal is
        // taken when the next tick would let the lease lapse (earlier
        // ones only add states that differ by the renewal's time).
        let stalled = owner
            .token()
            .is_some_and(|token| state.stalled.contains(&token));
        if let Some(lease) = owner.lease()
            && !stalled
            && state.left.stalls > 0
            && matches!(
                owner,
                Owner::Running(_) | Owner::Holding(..) | Owner::Unknown(_)
            )
            && Self::holds_record(state, lease)
        {
            actions.push(Action::Stall(o));
        }
        if let Some(lease) = owner.lease()
            && !stalled
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
    }

    /// An owner's own event: a renewal, an abandon, a late answer or its
    /// giving up, a crash, a delayed reservation, a stall.
    pub(crate) fn owner_event(&self, state: &mut State, action: &Action) {
        match *action {
            Action::Renew(o) => {
                if let Some(lease) = state.owners[usize::from(o)].lease().cloned() {
                    let _ = self.on_store(state, |slot, now| machine::renew(slot, &lease, now));
                }
            }
            Action::Abandon(o) => {
                if let Owner::Abandoning(attempt, token) = state.owners[usize::from(o)] {
                    self.on_store(state, |slot, now| {
                        machine::abandon(slot, attempt, token, now)
                    });
                    state.owners[usize::from(o)] = Owner::Idle;
                }
            }
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
                    Self::excuse_owner(state, o);
                }
            }
            Action::Crash(o) => {
                state.left.owner_crashes -= 1;
                state.owners[usize::from(o)] = Owner::Crashed;
                if self.excuses.owner_crash {
                    Self::excuse_owner(state, o);
                }
            }
            Action::RequestDelayed(o) => {
                state.left.requests -= 1;
                state.left.delayed -= 1;
                let (attempt, token) = Self::ids(state, o);
                state.in_flight = Some((o, attempt, token));
                state.owners[usize::from(o)] = Owner::Abandoning(attempt, token);
            }
            Action::Stall(o) => {
                state.left.stalls -= 1;
                if let Some(token) = state.owners[usize::from(o)].token() {
                    state.stalled.push(token);
                }
                if self.excuses.stall {
                    Self::excuse_owner(state, o);
                }
            }
            _ => {}
        }
    }

    /// What the store, its network and its operators may do next.
    pub(crate) fn store_actions(&self, state: &State, reachable: bool, actions: &mut Vec<Action>) {
        // The stored record's state, if there is a record.
        let slot = state.store.slot.as_ref().map(|r| r.state);
        let processing = slot == Some(RecordState::Processing);
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
        if reachable && state.left.cancels > 0 && slot.is_some() {
            actions.push(Action::Cancel);
        }
        if reachable && state.left.force_releases > 0 && processing {
            actions.push(Action::ForceRelease);
        }
        if state.in_flight.is_some() {
            if reachable {
                actions.push(Action::DelayedLands);
            }
            actions.push(Action::DelayedDropped);
        }
        if reachable && state.left.erasures > 0 && slot.is_some() && !processing {
            actions.push(Action::Erase);
        }
        if self.design.cache_follows_erasures {
            for (i, cached) in state.caches.iter().enumerate() {
                if let (Some((_, era)), Ok(o)) = (cached, u8::try_from(i))
                    && *era != state.era
                {
                    actions.push(Action::HearErasure(o));
                }
            }
        }
        if reachable && state.left.expiry_changes > 0 && state.store.string_record && processing {
            actions.push(Action::ExpiryShortened);
        }
    }
}
