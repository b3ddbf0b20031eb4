//! The contract's state machine as pure functions.
//!
//! Retention counts from the reservation that started the newest attempt
//! (a client's retry horizon starts with its first request); renewing a
//! lease pushes the expiry out if the lease would outlive it, and a
//! cancellation keeps the record a full retention from the cancel.
//!
//! Each function takes the slot a store holds for one scope (`None` when
//! there is no record), the store's current time in milliseconds since the
//! epoch, and applies one transition in place. A store that can lock the
//! slot around the call is correct by construction; `idem-memory` does
//! exactly that.

use std::time::Duration;

mod operator;

pub use operator::{cancel, erase, force_release};

use crate::{
    ATTEMPT_HISTORY, Attempt, AttemptId, AttemptOutcome, Completion, Current, LateEvidence, Lease,
    Outcome, OwnerToken, Record, RecordState, Release, Renewal, Replay, Reservation,
    ReserveRequest,
};

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Drops the record from the slot if it has expired.
pub fn expire(slot: &mut Option<Record>, now_ms: u64) {
    if slot.as_ref().is_some_and(|r| r.is_expired(now_ms)) {
        *slot = None;
    }
}

/// What the record says now, as told to a duplicate or a fenced attempt.
pub fn current(slot: &Option<Record>, now_ms: u64) -> Current {
    let Some(record) = slot.as_ref().filter(|r| !r.is_expired(now_ms)) else {
        return Current::Vacant;
    };
    match record.state {
        RecordState::Released => Current::Vacant,
        RecordState::Cancelled => Current::Cancelled,
        RecordState::Processing => Current::Processing {
            retry_after: Duration::from_millis(record.lease_expires_at_ms.saturating_sub(now_ms)),
        },
        RecordState::Completed => match &record.outcome {
            Some(outcome) => Current::Completed(replay(record, outcome, now_ms)),
            None => Current::Vacant,
        },
    }
}

fn replay(record: &Record, outcome: &Outcome, now_ms: u64) -> Replay {
    let completed = record.completed_at_ms.unwrap_or(record.updated_at_ms);
    Replay {
        outcome: outcome.clone(),
        age: Duration::from_millis(now_ms.saturating_sub(completed)),
        expires_in: Some(Duration::from_millis(
            record.expires_at_ms.saturating_sub(now_ms),
        )),
        attempt: record
            .attempts
            .iter()
            .rev()
            .find(|attempt| attempt.generation == record.generation)
            .map(|attempt| attempt.id),
    }
}

/// Adds an attempt, dropping the oldest beyond [`ATTEMPT_HISTORY`] but
/// never the newest attempt of unknown outcome (superseded while it ran):
/// it binds the key to its request for as long as the record lives (see
/// [`release`]), however many attempts fail after it.
fn push_attempt(record: &mut Record, attempt: Attempt) {
    record.attempts.push(attempt);
    while record.attempts.len() > ATTEMPT_HISTORY {
        let pinned = record
            .attempts
            .iter()
            .rposition(|a| a.outcome == AttemptOutcome::Superseded);
        record.attempts.remove(usize::from(pinned == Some(0)));
    }
}

fn end_current_attempt(
    record: &mut Record,
    outcome: AttemptOutcome,
    now_ms: u64,
) -> Option<Attempt> {
    let generation = record.generation;
    let attempt = record
        .attempts
        .iter_mut()
        .rev()
        .find(|a| a.generation == generation && a.outcome.is_open())?;
    attempt.outcome = outcome;
    attempt.ended_at_ms = Some(now_ms);
    Some(attempt.clone())
}

/// What starts an attempt: the request, the store's now, the new
/// attempt's id and owner token.
struct Start<'a> {
    request: &'a ReserveRequest,
    now_ms: u64,
    attempt: AttemptId,
    token: OwnerToken,
}

impl Start<'_> {
    fn lease(&self, generation: u64) -> Lease {
        Lease {
            scope: *self.request.scope.hash(),
            attempt: self.attempt,
            generation,
            token: self.token,
            ttl: self.request.lease,
        }
    }

    fn attempt(&self, generation: u64) -> Attempt {
        Attempt {
            id: self.attempt,
            generation,
            started_at_ms: self.now_ms,
            ended_at_ms: None,
            outcome: AttemptOutcome::Running,
            late: None,
        }
    }

    /// A new record, its first attempt running. Inlined, so that the
    /// record is written where it is kept rather than moved there.
    #[inline(always)]
    fn record(&self) -> Record {
        let (request, now_ms) = (self.request, self.now_ms);
        let (lease_ms, retention_ms) = (millis(request.lease), millis(request.retention));
        Record {
            scope: *request.scope.hash(),
            tenant: request.scope.shared_tenant().clone(),
            operation: request.scope.shared_operation().clone(),
            key: request.scope.key().shared().clone(),
            fingerprint: request.fingerprint,
            state: RecordState::Processing,
            generation: 1,
            owner: Some(self.token),
            lease_expires_at_ms: now_ms.saturating_add(lease_ms),
            lease_ms,
            retention_ms,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            completed_at_ms: None,
            expires_at_ms: now_ms.saturating_add(retention_ms),
            outcome: None,
            attempts: vec![self.attempt(1)],
        }
    }

    /// The next attempt on an existing record (released, taken over, or
    /// completed without its outcome).
    fn next(&self, record: &mut Record) -> Lease {
        let now_ms = self.now_ms;
        record.generation += 1;
        record.state = RecordState::Processing;
        record.fingerprint = self.request.fingerprint;
        record.owner = Some(self.token);
        record.lease_ms = millis(self.request.lease);
        record.retention_ms = millis(self.request.retention);
        record.lease_expires_at_ms = now_ms.saturating_add(record.lease_ms);
        record.updated_at_ms = now_ms;
        record.expires_at_ms = now_ms.saturating_add(record.retention_ms);
        let generation = record.generation;
        push_attempt(record, self.attempt(generation));
        self.lease(generation)
    }
}

/// Reserves the slot for a request (the contract's state table).
///
/// `attempt` and `token` are used only when a new attempt starts.
pub fn reserve(
    slot: &mut Option<Record>,
    request: &ReserveRequest,
    now_ms: u64,
    attempt: AttemptId,
    token: OwnerToken,
) -> Reservation {
    reserve_with(slot, request, now_ms, || (attempt, token))
}

/// [`reserve`], with the new attempt's id and owner token made by `ids`
/// only when an attempt starts: a replay, a conflict or a request in
/// flight makes none.
pub fn reserve_with(
    slot: &mut Option<Record>,
    request: &ReserveRequest,
    now_ms: u64,
    ids: impl FnOnce() -> (AttemptId, OwnerToken),
) -> Reservation {
    expire(slot, now_ms);
    let start = move || {
        let (attempt, token) = ids();
        Start {
            request,
            now_ms,
            attempt,
            token,
        }
    };
    let Some(record) = slot.as_mut() else {
        let start = start();
        *slot = Some(start.record());
        return Reservation::Acquired(start.lease(1));
    };
    match record.state {
        RecordState::Released => Reservation::Acquired(start().next(record)),
        _ if record.fingerprint != request.fingerprint => Reservation::Conflict,
        RecordState::Processing if record.lease_expires_at_ms > now_ms => Reservation::InProgress {
            retry_after: Duration::from_millis(record.lease_expires_at_ms - now_ms),
        },
        RecordState::Processing => {
            // A running attempt is superseded. One that already ended (a
            // release after a takeover keeps the record processing, see
            // `release`) is not: the attempt of unknown outcome reported
            // is then the newest one superseded before it.
            let superseded = end_current_attempt(record, AttemptOutcome::Superseded, now_ms)
                .or_else(|| newest_superseded(record).cloned())
                .unwrap_or_else(|| Attempt {
                    id: AttemptId(uuid::Uuid::nil()),
                    generation: record.generation,
                    started_at_ms: record.updated_at_ms,
                    ended_at_ms: Some(now_ms),
                    outcome: AttemptOutcome::Superseded,
                    late: None,
                });
            Reservation::TakenOver {
                lease: start().next(record),
                superseded,
            }
        }
        RecordState::Completed => match &record.outcome {
            Some(outcome) => Reservation::Completed(replay(record, outcome, now_ms)),
            // A completed record always holds its outcome; one that lost it
            // cannot be replayed, so it is treated as released.
            None => Reservation::Acquired(start().next(record)),
        },
        RecordState::Cancelled => Reservation::Cancelled,
    }
}

/// The newest attempt the record keeps that was superseded while it ran.
fn newest_superseded(record: &Record) -> Option<&Attempt> {
    record
        .attempts
        .iter()
        .rev()
        .find(|a| a.outcome == AttemptOutcome::Superseded)
}

/// Whether an attempt in the record's history was superseded while it
/// held the key: its outcome is unknown, it may have acted.
fn holds_an_unknown_outcome(record: &Record) -> bool {
    newest_superseded(record).is_some()
}

fn owns(slot: &Option<Record>, lease: &Lease, now_ms: u64) -> bool {
    slot.as_ref().is_some_and(|r| {
        !r.is_expired(now_ms)
            && r.state == RecordState::Processing
            && r.generation == lease.generation
            && r.owner == Some(lease.token)
    })
}

/// Whether the record already holds this lease's own write, in `state`
/// and as its current attempt's `outcome`: the retry of a write whose
/// reply was lost (a timeout after the store had applied it). It is
/// answered as the write was, and keeps no late evidence against itself.
fn already_written(
    slot: &Option<Record>,
    lease: &Lease,
    state: RecordState,
    outcome: impl Fn(&AttemptOutcome) -> bool,
    now_ms: u64,
) -> bool {
    slot.as_ref().is_some_and(|r| {
        !r.is_expired(now_ms)
            && r.state == state
            && r.generation == lease.generation
            && r.attempts
                .iter()
                .rev()
                .find(|a| a.generation == lease.generation)
                .is_some_and(|a| a.id == lease.attempt && outcome(&a.outcome))
    })
}

fn keep_evidence(slot: &mut Option<Record>, lease: &Lease, late: LateEvidence) {
    if let Some(attempt) = slot
        .as_mut()
        .and_then(|r| r.attempts.iter_mut().find(|a| a.id == lease.attempt))
    {
        attempt.late = Some(late);
    }
}

/// Extends the lease if it is still the record's current one.
pub fn renew(slot: &mut Option<Record>, lease: &Lease, now_ms: u64) -> Renewal {
    expire(slot, now_ms);
    if !owns(slot, lease, now_ms) {
        return Renewal::Fenced(current(slot, now_ms));
    }
    if let Some(record) = slot.as_mut() {
        record.lease_ms = millis(lease.ttl);
        record.lease_expires_at_ms = now_ms.saturating_add(record.lease_ms);
        // A request that runs longer than the retention never expires under
        // its own feet.
        record.expires_at_ms = record.expires_at_ms.max(record.lease_expires_at_ms);
    }
    Renewal::Renewed
}

/// Keeps in the attempt's history that its caller was told its outcome is
/// unknown ([`AttemptOutcome::Unknown`]), if the lease is still current:
/// the record stays processing under the lease it has, awaiting a late
/// answer (the lease is not extended: without one, a retry takes over as
/// soon as it lapses).
pub fn mark_unknown(slot: &mut Option<Record>, lease: &Lease, now_ms: u64) -> Renewal {
    expire(slot, now_ms);
    if !owns(slot, lease, now_ms) {
        return Renewal::Fenced(current(slot, now_ms));
    }
    if let Some(attempt) = slot.as_mut().and_then(|r| {
        r.attempts
            .iter_mut()
            .rev()
            .find(|a| a.id == lease.attempt && a.outcome == AttemptOutcome::Running)
    }) {
        attempt.outcome = AttemptOutcome::Unknown;
    }
    Renewal::Renewed
}

/// Records the outcome if the lease is still current; otherwise keeps late
/// evidence on the attempt.
pub fn complete(
    slot: &mut Option<Record>,
    lease: &Lease,
    outcome: &Outcome,
    now_ms: u64,
) -> Completion {
    expire(slot, now_ms);
    let completed = |a: &AttemptOutcome| matches!(a, AttemptOutcome::Completed { .. });
    if already_written(slot, lease, RecordState::Completed, completed, now_ms) {
        return Completion::Recorded;
    }
    if !owns(slot, lease, now_ms) {
        let status = outcome.status();
        keep_evidence(
            slot,
            lease,
            LateEvidence::Completed {
                status,
                at_ms: now_ms,
            },
        );
        return Completion::Fenced(current(slot, now_ms));
    }
    if let Some(record) = slot.as_mut() {
        let status = outcome.status();
        end_current_attempt(record, AttemptOutcome::Completed { status }, now_ms);
        record.state = RecordState::Completed;
        record.owner = None;
        // Copied only when it becomes the result (a fenced write needs only
        // its status), into buffers of its own: a body sliced from a
        // connection's read buffer would keep that whole buffer alive.
        record.outcome = Some(outcome.compacted());
        record.completed_at_ms = Some(now_ms);
        record.updated_at_ms = now_ms;
    }
    Completion::Recorded
}

/// Frees the key if the lease is still current; otherwise keeps late
/// evidence on the attempt.
///
/// A record whose history holds a superseded attempt (its outcome unknown:
/// it may have acted) is freed for the same request only: it stays
/// processing, its lease lapsed and held by nobody, so the same request
/// takes it over at once and a changed one conflicts. Released, it would
/// take any payload after an attempt that may have run.
pub fn release(slot: &mut Option<Record>, lease: &Lease, now_ms: u64) -> Release {
    expire(slot, now_ms);
    let released = |a: &AttemptOutcome| *a == AttemptOutcome::Released;
    if already_written(slot, lease, RecordState::Released, released, now_ms)
        || already_written(slot, lease, RecordState::Processing, released, now_ms)
    {
        return Release::Released;
    }
    if !owns(slot, lease, now_ms) {
        keep_evidence(slot, lease, LateEvidence::Released { at_ms: now_ms });
        return Release::Fenced(current(slot, now_ms));
    }
    if let Some(record) = slot.as_mut() {
        end_current_attempt(record, AttemptOutcome::Released, now_ms);
        if holds_an_unknown_outcome(record) {
            record.lease_expires_at_ms = now_ms;
        } else {
            record.state = RecordState::Released;
        }
        record.owner = None;
        record.updated_at_ms = now_ms;
    }
    Release::Released
}

/// The lease a store that (re)started at `started_ms` grants the record's
/// owner (SPEC section 8): a processing record's lease counts as running
/// until at least a lease after the start, so that an owner which held an
/// outcome (or kept running) while the store was down can record it, or
/// renew, before anyone takes over. A store that can tell when it started
/// (Redis' uptime and replication id, PostgreSQL's postmaster start and
/// timeline) applies it before every transition; applying it twice changes
/// nothing.
pub fn lease_after_start(slot: &mut Option<Record>, started_ms: u64) {
    if let Some(record) = slot.as_mut()
        && record.state == RecordState::Processing
        && record.owner.is_some()
    {
        let floor = started_ms.saturating_add(record.lease_ms);
        record.lease_expires_at_ms = record.lease_expires_at_ms.max(floor);
    }
}

/// Frees a reservation whose caller gave up before its answer came (the
/// call was dropped after the store had applied it): nobody runs that
/// attempt, so the key must not stay taken for a whole lease. Only while
/// the record is still processing for that very attempt and owner token;
/// anything else about the record is left alone. `true` when it was freed.
pub fn abandon(
    slot: &mut Option<Record>,
    attempt: AttemptId,
    token: OwnerToken,
    now_ms: u64,
) -> bool {
    expire(slot, now_ms);
    let Some(record) = slot.as_ref() else {
        return false;
    };
    let current = record
        .attempts
        .iter()
        .rev()
        .find(|a| a.generation == record.generation);
    if record.state != RecordState::Processing
        || record.owner != Some(token)
        || current.is_none_or(|a| a.id != attempt)
    {
        return false;
    }
    // A takeover given up leaves the record as the takeover found it:
    // processing, its lease lapsed, held by nobody. Released, it would
    // take any payload, while the attempt it superseded may have acted:
    // a changed request must still conflict, and the same one takes over.
    let took_over = newest_superseded(record)
        .is_some_and(|a| a.generation.saturating_add(1) == record.generation);
    if took_over {
        if let Some(record) = slot.as_mut() {
            record.owner = None;
            record.lease_expires_at_ms = now_ms;
            record.updated_at_ms = now_ms;
        }
        return true;
    }
    let lease = Lease {
        scope: record.scope,
        attempt,
        generation: record.generation,
        token,
        ttl: Duration::ZERO,
    };
    matches!(release(slot, &lease, now_ms), Release::Released)
}

#[cfg(test)]
mod tests {
    use super::{abandon, complete, release, reserve};
    use crate::{
        AttemptId, AttemptOutcome, Outcome, OwnerToken, RecordState, Release, Reservation,
    };

    /// Reserves `request` anew at 1,000 ms: the time its lease has lapsed.
    fn lapsed_first_attempt(
        slot: &mut Option<crate::Record>,
        request: &crate::ReserveRequest,
    ) -> u64 {
        let Reservation::Acquired(first) =
            reserve(slot, request, 1_000, AttemptId::new(), OwnerToken::new())
        else {
            panic!("a new key is acquired");
        };
        1_000 + super::millis(first.ttl) + 1
    }

    /// After a store start, a lapsed lease counts as running until a lease
    /// after the start: the owner renews it, a retry in between is in
    /// progress; applied twice it changes nothing; a record nobody owns
    /// (an abandoned takeover) gets no grace.
    #[test]
    fn a_lease_runs_a_lease_past_the_stores_start() {
        let request = crate::test_support::request("k");
        let mut slot = None;
        let Reservation::Acquired(first) = reserve(
            &mut slot,
            &request,
            1_000,
            AttemptId::new(),
            OwnerToken::new(),
        ) else {
            panic!("a new key is acquired");
        };
        let lease_ms = super::millis(first.ttl);
        let started = 1_000 + 3 * lease_ms;
        super::lease_after_start(&mut slot, started);
        super::lease_after_start(&mut slot, started);
        assert_eq!(
            slot.as_ref().map(|r| r.lease_expires_at_ms),
            Some(started + lease_ms)
        );
        assert!(matches!(
            reserve(
                &mut slot,
                &request,
                started + lease_ms - 1,
                AttemptId::new(),
                OwnerToken::new()
            ),
            Reservation::InProgress { .. }
        ));
        assert!(matches!(
            super::renew(&mut slot, &first, started + 1),
            crate::Renewal::Renewed
        ));
        let mut unowned = slot.clone();
        if let Some(record) = unowned.as_mut() {
            record.owner = None;
            record.lease_expires_at_ms = 5;
        }
        super::lease_after_start(&mut unowned, started);
        assert_eq!(unowned.map(|r| r.lease_expires_at_ms), Some(5));
    }

    /// A given-up reservation is freed only while it still holds the
    /// record as its own: not under another token or attempt, not once
    /// completed, and only once.
    #[test]
    fn an_abandoned_takeover_leaves_the_lease_lapsed_not_released() {
        let request = crate::test_support::request("k");
        let mut slot = None;
        let lapsed = lapsed_first_attempt(&mut slot, &request);
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        let Reservation::TakenOver { .. } = reserve(&mut slot, &request, lapsed, attempt, token)
        else {
            panic!("a lapsed lease is taken over");
        };
        assert!(abandon(&mut slot, attempt, token, lapsed + 1));
        assert_eq!(
            slot.as_ref().map(|r| r.state),
            Some(RecordState::Processing),
            "not released: the first attempt may have acted"
        );
        assert_changed_conflicts(&mut slot, &request, lapsed + 2);
        assert!(matches!(
            reserve(&mut slot, &request, lapsed + 2, AttemptId::new(), OwnerToken::new()),
            Reservation::TakenOver { lease, .. } if lease.generation == 3
        ));
    }

    /// A later attempt of a bound chain (after a takeover's attempt was
    /// released), given up, is freed as its release would be: the record
    /// stays processing and bound to its request.
    #[test]
    fn an_abandoned_later_attempt_of_a_bound_record_stays_bound() {
        let request = crate::test_support::request("k");
        let mut slot = None;
        let lapsed = lapsed_first_attempt(&mut slot, &request);
        let Reservation::TakenOver { lease: second, .. } = reserve(
            &mut slot,
            &request,
            lapsed,
            AttemptId::new(),
            OwnerToken::new(),
        ) else {
            panic!("a lapsed lease is taken over");
        };
        assert_eq!(release(&mut slot, &second, lapsed + 1), Release::Released);
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        let Reservation::TakenOver { lease: third, .. } =
            reserve(&mut slot, &request, lapsed + 2, attempt, token)
        else {
            panic!("the same request takes over");
        };
        assert_eq!(third.generation, 3);
        assert!(abandon(&mut slot, attempt, token, lapsed + 3));
        assert_eq!(
            slot.as_ref().map(|r| r.state),
            Some(RecordState::Processing)
        );
        assert_changed_conflicts(&mut slot, &request, lapsed + 4);
    }

    /// A changed `request` (another fingerprint) conflicts at `now_ms`.
    fn assert_changed_conflicts(
        slot: &mut Option<crate::Record>,
        request: &crate::ReserveRequest,
        now_ms: u64,
    ) {
        let mut changed = request.clone();
        changed.fingerprint = crate::Fingerprint::from_bytes([9; 32]);
        assert!(matches!(
            reserve(slot, &changed, now_ms, AttemptId::new(), OwnerToken::new()),
            Reservation::Conflict
        ));
    }

    #[test]
    fn abandon_frees_only_its_own_running_reservation() {
        let request = crate::test_support::request("k");
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        let mut slot = None;
        let Reservation::Acquired(_) = reserve(&mut slot, &request, 1_000, attempt, token) else {
            panic!("a new key is acquired");
        };
        assert!(!abandon(&mut slot, attempt, OwnerToken::new(), 1_001));
        assert!(!abandon(&mut slot, AttemptId::new(), token, 1_001));
        assert_eq!(
            slot.as_ref().map(|r| r.state),
            Some(RecordState::Processing)
        );
        assert!(abandon(&mut slot, attempt, token, 1_002));
        let record = slot.as_ref().expect("record kept");
        assert_eq!(record.state, RecordState::Released);
        assert_eq!(record.attempts[0].outcome, AttemptOutcome::Released);
        assert!(!abandon(&mut slot, attempt, token, 1_003), "only once");

        // A completed reservation is left alone.
        let (attempt, token) = (AttemptId::new(), OwnerToken::new());
        let mut slot = None;
        let Reservation::Acquired(lease) = reserve(&mut slot, &request, 1_000, attempt, token)
        else {
            panic!("a new key is acquired");
        };
        let _ = complete(
            &mut slot,
            &lease,
            &Outcome::NotStored { status: 201 },
            1_001,
        );
        assert!(!abandon(&mut slot, attempt, token, 1_002));
        assert_eq!(slot.as_ref().map(|r| r.state), Some(RecordState::Completed));
    }
}
