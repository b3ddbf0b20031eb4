//! What a record weighs: the store's estimate of the bytes a record
//! takes, for its byte bound.

use idem_core::{Outcome, Record, RecordState, ReserveRequest};

/// What the store estimates one record takes besides its variable parts
/// (its scope's texts, its attempts, its response): the boxed record, its
/// share of the table and of the expiry heap (up to two entries, at
/// twice their size while the heap grows), the blocks of a stored
/// response, and a typical allocator's 16 bytes or so on each of its
/// eight blocks. `tests/footprint.rs` counts what records ask of the
/// allocator and holds the estimate above it.
pub(crate) const RECORD_OVERHEAD: usize = 640;

/// What the store estimates each stored header takes besides its bytes
/// (its entry in the response's header list).
pub(crate) const HEADER_OVERHEAD: usize = 64;

/// The estimated bytes of a stored outcome.
pub(crate) fn outcome_weight(outcome: &Outcome) -> usize {
    match outcome {
        Outcome::NotStored { .. } => 0,
        Outcome::Stored(response) => {
            response.body.len()
                + response
                    .headers
                    .iter()
                    .map(|(name, value)| HEADER_OVERHEAD + name.as_str().len() + value.len())
                    .sum::<usize>()
        }
    }
}

/// The estimated bytes of a record without its response: the fixed
/// part, its scope's texts (`texts` bytes) and room for `attempts`
/// attempts.
pub(crate) fn base_weight(texts: usize, attempts: usize) -> usize {
    RECORD_OVERHEAD + texts + attempts * std::mem::size_of::<idem_core::Attempt>()
}

/// The estimated bytes of a record.
pub(crate) fn weight_of(r: &Record) -> usize {
    base_weight(
        r.tenant.len() + r.operation.len() + r.key.len(),
        r.attempts.capacity(),
    ) + r.outcome.as_ref().map_or(0, outcome_weight)
}

/// The estimated bytes of the record a reservation makes: what the byte
/// bound must have room for before it is made.
pub(crate) fn new_weight(request: &ReserveRequest) -> usize {
    let scope = &request.scope;
    base_weight(
        scope.tenant().len() + scope.operation().len() + scope.key().as_str().len(),
        1,
    )
}

/// The estimated bytes of a slot.
pub(crate) fn weight(slot: &Option<Record>) -> usize {
    slot.as_ref().map_or(0, weight_of)
}

/// Whether a record takes a place in the capacity and its tenant's quota:
/// every record but a released one (its key is free again).
pub(crate) fn occupies(slot: &Option<Record>) -> bool {
    slot.as_ref()
        .is_some_and(|r| r.state != RecordState::Released)
}
