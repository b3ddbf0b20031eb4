//! What the differential check compares of a store's answers and records:
//! states, generations, attempts, owner acceptance and replayed bytes, not
//! the timestamps a store synthesizes.

use crate::{
    AttemptId, AttemptOutcome, Cancellation, Completion, Current, Erasure, ForceRelease,
    LateEvidence, Outcome, OwnerToken, Record, RecordState, Release, Renewal, Replay, Reservation,
};

/// An answer of the store or the reference, as compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// [`Reservation::Acquired`].
    Acquired(u64),
    /// [`Reservation::TakenOver`]: the generation and the superseded
    /// attempt.
    TakenOver(u64, AttemptSeen),
    /// [`Reservation::InProgress`].
    InProgress,
    /// [`Reservation::Completed`].
    Replayed(ReplaySeen),
    /// [`Reservation::Cancelled`].
    ReservationCancelled,
    /// [`Reservation::Conflict`].
    Conflict,
    /// Renewed, recorded or released.
    Done,
    /// A write fenced, and the current state it reported.
    Fenced(CurrentSeen),
    /// A cancellation, force release or erasure, and the record it
    /// reported.
    Operator(&'static str, Option<RecordSeen>),
}

/// [`Current`], as compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CurrentSeen {
    /// Vacant.
    Vacant,
    /// Processing.
    Processing,
    /// Completed.
    Completed(ReplaySeen),
    /// Cancelled.
    Cancelled,
}

/// A replay, as compared (not its age nor expiry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplaySeen {
    outcome: Outcome,
    attempt: Option<AttemptId>,
}

/// An attempt, as compared (not its times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptSeen {
    id: AttemptId,
    generation: u64,
    outcome: AttemptOutcome,
    late: Option<(&'static str, Option<u16>)>,
}

/// A record, as compared (not its times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSeen {
    state: RecordState,
    generation: u64,
    fingerprint: crate::Fingerprint,
    owner: Option<OwnerToken>,
    outcome: Option<Outcome>,
    attempts: Vec<AttemptSeen>,
}

pub(super) fn attempt_seen(attempt: &crate::Attempt) -> AttemptSeen {
    AttemptSeen {
        id: attempt.id,
        generation: attempt.generation,
        outcome: attempt.outcome,
        late: attempt.late.map(|late| match late {
            LateEvidence::Completed { status, .. } => ("completed", Some(status)),
            LateEvidence::Released { .. } => ("released", None),
        }),
    }
}

pub(super) fn record_seen(record: &Record) -> RecordSeen {
    RecordSeen {
        state: record.state,
        generation: record.generation,
        fingerprint: record.fingerprint,
        owner: record.owner,
        outcome: record.outcome.clone(),
        attempts: record.attempts.iter().map(attempt_seen).collect(),
    }
}

pub(super) fn replay_seen(replay: &Replay) -> ReplaySeen {
    ReplaySeen {
        outcome: replay.outcome.clone(),
        attempt: replay.attempt,
    }
}

pub(super) fn current_seen(current: &Current) -> CurrentSeen {
    match current {
        Current::Vacant => CurrentSeen::Vacant,
        Current::Processing { .. } => CurrentSeen::Processing,
        Current::Completed(replay) => CurrentSeen::Completed(replay_seen(replay)),
        Current::Cancelled => CurrentSeen::Cancelled,
    }
}

pub(super) fn reservation_seen(reservation: &Reservation) -> Seen {
    match reservation {
        Reservation::Acquired(lease) => Seen::Acquired(lease.generation),
        Reservation::TakenOver { lease, superseded } => {
            Seen::TakenOver(lease.generation, attempt_seen(superseded))
        }
        Reservation::InProgress { .. } => Seen::InProgress,
        Reservation::Completed(replay) => Seen::Replayed(replay_seen(replay)),
        Reservation::Cancelled => Seen::ReservationCancelled,
        Reservation::Conflict => Seen::Conflict,
    }
}

pub(super) fn renewal_seen(renewal: &Renewal) -> Seen {
    match renewal {
        Renewal::Renewed => Seen::Done,
        Renewal::Fenced(current) => Seen::Fenced(current_seen(current)),
    }
}

pub(super) fn completion_seen(completion: &Completion) -> Seen {
    match completion {
        Completion::Recorded => Seen::Done,
        Completion::Fenced(current) => Seen::Fenced(current_seen(current)),
    }
}

pub(super) fn release_seen(release: &Release) -> Seen {
    match release {
        Release::Released => Seen::Done,
        Release::Fenced(current) => Seen::Fenced(current_seen(current)),
    }
}

pub(super) fn cancellation_seen(cancellation: &Cancellation) -> Seen {
    match cancellation {
        Cancellation::NotFound => Seen::Operator("not_found", None),
        Cancellation::Cancelled(r) => Seen::Operator("cancelled", Some(record_seen(r))),
        Cancellation::AlreadyCompleted(r) => {
            Seen::Operator("already_completed", Some(record_seen(r)))
        }
        Cancellation::AlreadyCancelled(r) => {
            Seen::Operator("already_cancelled", Some(record_seen(r)))
        }
    }
}

pub(super) fn force_release_seen(answer: &ForceRelease) -> Seen {
    match answer {
        ForceRelease::Released(r) => Seen::Operator("released", Some(record_seen(r))),
        ForceRelease::NotProcessing(r) => Seen::Operator("not_processing", Some(record_seen(r))),
        ForceRelease::NotFound => Seen::Operator("not_found", None),
    }
}

pub(super) fn erasure_seen(answer: &Erasure) -> Seen {
    match answer {
        Erasure::Erased(r) => Seen::Operator("erased", Some(record_seen(r))),
        Erasure::Processing(r) => Seen::Operator("processing", Some(record_seen(r))),
        Erasure::NotFound => Seen::Operator("not_found", None),
    }
}
