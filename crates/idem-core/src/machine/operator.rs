//! An operator's transitions: cancelling a record, releasing a stuck one,
//! erasing one that does not run.

use crate::{AttemptOutcome, Cancellation, Erasure, ForceRelease, Record, RecordState};

use super::{end_current_attempt, expire};

/// Cancels the record, atomically against completion.
pub fn cancel(slot: &mut Option<Record>, now_ms: u64) -> Cancellation {
    expire(slot, now_ms);
    let Some(record) = slot.as_mut() else {
        return Cancellation::NotFound;
    };
    match record.state {
        RecordState::Completed => Cancellation::AlreadyCompleted(record.clone()),
        RecordState::Cancelled => Cancellation::AlreadyCancelled(record.clone()),
        // A released record is vacant: the key is free, nothing runs, and
        // cancelling it would block the key for the whole retention.
        RecordState::Released => Cancellation::NotFound,
        RecordState::Processing => {
            end_current_attempt(record, AttemptOutcome::Cancelled, now_ms);
            record.state = RecordState::Cancelled;
            record.owner = None;
            record.updated_at_ms = now_ms;
            record.expires_at_ms = now_ms.saturating_add(record.retention_ms);
            Cancellation::Cancelled(record.clone())
        }
    }
}

/// Releases a processing record whatever its lease (an operator freeing a
/// stuck key): the attempt ends as released by an operator.
pub fn force_release(slot: &mut Option<Record>, now_ms: u64) -> ForceRelease {
    expire(slot, now_ms);
    let Some(record) = slot.as_mut() else {
        return ForceRelease::NotFound;
    };
    if record.state != RecordState::Processing {
        return ForceRelease::NotProcessing(record.clone());
    }
    end_current_attempt(record, AttemptOutcome::ReleasedByOperator, now_ms);
    record.state = RecordState::Released;
    record.owner = None;
    record.updated_at_ms = now_ms;
    ForceRelease::Released(record.clone())
}

/// Erases a live record that is not processing (an operator's erasure):
/// the slot is left empty, so its key is new.
pub fn erase(slot: &mut Option<Record>, now_ms: u64) -> Erasure {
    expire(slot, now_ms);
    match slot.as_ref() {
        None => Erasure::NotFound,
        Some(record) if record.state == RecordState::Processing => {
            Erasure::Processing(record.clone())
        }
        Some(_) => slot.take().map_or(Erasure::NotFound, Erasure::Erased),
    }
}
