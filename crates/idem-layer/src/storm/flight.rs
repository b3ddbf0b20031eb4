//! Single flight: concurrent duplicates of one key inside one process
//! share one reservation round (the store call, and in wait mode the wait
//! on the store) instead of each making its own.
//!
//! The first request of a scope to reserve leads a flight; a request of
//! the same scope and fingerprint that comes while it flies follows it and
//! is answered from what the leader was answered, as the store would have
//! answered it:
//!
//! * a replay, a cancellation: the same;
//! * the leader runs the request (it acquired or took over the lease): in
//!   progress, for as long as the leader's lease; in wait mode, a follower
//!   waits on (one) flight again, whose leader waits on the store;
//! * in progress (the leader's wait ended, or it does not wait): the same,
//!   unless the follower's own wait has time left, then it waits again;
//! * anything else (a conflict, which the leader may resolve by a changed
//!   fingerprint format; a store error; a leader that went away): the
//!   follower asks the store itself.
//!
//! A request with another fingerprint never follows: the store answers it.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{Fingerprint, ScopeHash};
use tokio::sync::Notify;

use crate::found::Found;

/// What a flight's leader was answered, as its followers take it.
#[derive(Clone)]
pub(crate) enum Shared {
    /// Answer this.
    Found(Found),
    /// The leader runs the request under a lease this long.
    Running(Duration),
    /// Ask the store.
    Alone,
}

/// One reservation round in flight: one allocation (a fresh key's round
/// has no follower, and costs no more).
pub(crate) struct Flight {
    fingerprint: Fingerprint,
    /// What the leader was answered, once it was.
    answer: OnceLock<Shared>,
    /// Wakes the followers once the answer is set.
    answered: Notify,
}

impl Flight {
    /// Sets the answer (the first one set stands) and wakes the followers.
    fn answer(&self, answer: Shared) {
        let _ = self.answer.set(answer);
        self.answered.notify_waiters();
    }
}

/// Hashes a scope by its first eight bytes: a scope hash is already a
/// uniform digest, so hashing it again would only cost.
#[derive(Default, Clone, Copy)]
pub(crate) struct ScopeHasher(u64);

impl std::hash::Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut first = [0u8; 8];
        let n = bytes.len().min(8);
        first[..n].copy_from_slice(&bytes[..n]);
        self.0 ^= u64::from_le_bytes(first);
    }
}

type ByScope = HashMap<ScopeHash, Arc<Flight>, std::hash::BuildHasherDefault<ScopeHasher>>;

/// The shards' count: duplicates of different keys rarely share a lock.
const SHARDS: usize = 16;

/// The flights of one layer, by scope.
#[derive(Default)]
pub(crate) struct Flights {
    shards: [Mutex<ByScope>; SHARDS],
    /// Requests waiting for an attempt to end (see [`Flights::waiting`]).
    waiting: AtomicUsize,
}

/// A request counted as waiting while it lives.
pub(crate) struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a request takes part in its scope's round.
pub(crate) enum Role<'a> {
    /// It reserves, and publishes what it was answered.
    Lead(Leader<'a>),
    /// It waits for the leader's answer.
    Follow(Arc<Flight>),
    /// A round of another fingerprint flies: it asks the store alone.
    Alone,
}

impl Flights {
    fn shard(&self, scope: &ScopeHash) -> &Mutex<ByScope> {
        &self.shards[usize::from(scope.as_bytes()[0]) % SHARDS]
    }

    /// How many requests wait for an attempt to end: following a round,
    /// or waiting on the store.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Counts a request as waiting until the guard goes.
    pub(crate) fn wait(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(&self.waiting)
    }

    /// Follows the round of `scope` in flight for `fingerprint`, or leads
    /// a new one.
    pub(crate) fn join(&self, scope: &ScopeHash, fingerprint: &Fingerprint) -> Role<'_> {
        let mut flights = self
            .shard(scope)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(flight) = flights.get(scope) {
            return if flight.fingerprint == *fingerprint {
                Role::Follow(Arc::clone(flight))
            } else {
                Role::Alone
            };
        }
        let flight = Arc::new(Flight {
            fingerprint: *fingerprint,
            answer: OnceLock::new(),
            answered: Notify::new(),
        });
        flights.insert(*scope, Arc::clone(&flight));
        Role::Lead(Leader {
            flights: self,
            scope: *scope,
            flight,
        })
    }
}

/// A round's leader; ending it (publishing, or dropped when its request
/// goes away) lets the next request of the scope lead a new one.
pub(crate) struct Leader<'a> {
    flights: &'a Flights,
    scope: ScopeHash,
    flight: Arc<Flight>,
}

impl Leader<'_> {
    /// Gives the followers `answer` and ends the round.
    pub(crate) fn publish(self, answer: Shared) {
        self.flight.answer(answer);
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        let mut flights = self
            .flights
            .shard(&self.scope)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if flights
            .get(&self.scope)
            .is_some_and(|flight| Arc::ptr_eq(flight, &self.flight))
        {
            flights.remove(&self.scope);
        }
        // A leader that did not publish (its request went away): its
        // followers ask for themselves.
        self.flight.answer(Shared::Alone);
    }
}

/// Waits for the leader's answer until `deadline` (none: until it comes);
/// `None` when the deadline came first.
pub(crate) async fn follow(
    flight: Arc<Flight>,
    deadline: Option<tokio::time::Instant>,
) -> Option<Shared> {
    let wait = async {
        loop {
            let answered = flight.answered.notified();
            let mut answered = std::pin::pin!(answered);
            // Registered before the check: an answer set in between wakes it.
            answered.as_mut().enable();
            if let Some(answer) = flight.answer.get() {
                return answer.clone();
            }
            answered.await;
        }
    };
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, wait).await.ok(),
        None => Some(wait.await),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_leads_the_same_payload_follows_another_goes_alone() {
        let flights = Flights::default();
        let (scope, fp) = (
            ScopeHash::from_bytes([7; 32]),
            Fingerprint::from_bytes([1; 32]),
        );
        let Role::Lead(leader) = flights.join(&scope, &fp) else {
            panic!("the first leads");
        };
        let Role::Follow(follower) = flights.join(&scope, &fp) else {
            panic!("the same payload follows");
        };
        assert!(matches!(
            flights.join(&scope, &Fingerprint::from_bytes([2; 32])),
            Role::Alone
        ));
        leader.publish(Shared::Running(Duration::from_secs(3)));
        assert!(matches!(
            follow(follower, None).await,
            Some(Shared::Running(lease)) if lease == Duration::from_secs(3)
        ));
        // The round ended: the next request leads.
        assert!(matches!(flights.join(&scope, &fp), Role::Lead(_)));
    }

    #[tokio::test]
    async fn followers_of_a_leader_that_went_away_ask_the_store() {
        let flights = Flights::default();
        let (scope, fp) = (
            ScopeHash::from_bytes([8; 32]),
            Fingerprint::from_bytes([1; 32]),
        );
        let leader = flights.join(&scope, &fp);
        let Role::Follow(follower) = flights.join(&scope, &fp) else {
            panic!("follows");
        };
        drop(leader);
        assert!(matches!(follow(follower, None).await, Some(Shared::Alone)));
        // A follower whose own deadline comes first stops waiting.
        let _leader = flights.join(&scope, &fp);
        let Role::Follow(follower) = flights.join(&scope, &fp) else {
            panic!("follows");
        };
        let deadline = tokio::time::Instant::now() + Duration::from_millis(10);
        assert!(follow(follower, Some(deadline)).await.is_none());
    }
}
