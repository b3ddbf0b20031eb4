//! Differential checking of a store against idem-core's state machine
//! (feature `conformance`): generated sequences of store calls by several
//! owners run call by call against the store under test and against
//! [`machine`] on a record held here, the reference. Every
//! answer and, after every call, the record the store reads back must be
//! the reference's, as far as [`Seen`] and [`RecordSeen`] compare them.
//!
//! # What is compared
//!
//! * Each answer's kind and what it carries: a reservation's generation,
//!   the superseded attempt (id, generation, outcome), a replay's outcome
//!   (status, headers, body) and attempt; the current state a fenced write
//!   reports; a record an operator's call answers with.
//! * The record after each call: state, generation, fingerprint, owner
//!   token, the stored outcome, and every attempt in the kept history (id,
//!   generation, outcome, the kind and status of late evidence).
//! * Not compared: every timestamp a store synthesizes (start, end, expiry,
//!   a replay's age, a lease's time left), which differ by clock and
//!   rounding.
//!
//! # Time
//!
//! Leases lapse by the store's clock (a server's, for Redis and
//! PostgreSQL), which a test cannot warp. A [`Op::Lapse`] waits a real
//! lease and a margin; the reference reads the same wall clock. Each call
//! is judged at the instant before it was sent less [`TOLERANCE`] and the
//! instant after its answer plus [`TOLERANCE`]: where a lease boundary
//! falls between (a slow call, a clock a few milliseconds apart), either
//! answer is accepted and the reference follows the one the store gave.
//!
//! # Sequences and shrinking
//!
//! [`generate`] draws a sequence from a seed (owners 0 to 2, at most two
//! lapses). A mismatch is shrunk ([`shrink`]): calls are dropped one at a
//! time while the mismatch stays, until no call can go, so the report is a
//! shortest failing sequence (a local minimum) and its seed.

use std::time::Duration;

mod seen;

use seen::*;
pub use seen::{AttemptSeen, CurrentSeen, RecordSeen, ReplaySeen, Seen};

use bytes::Bytes;

use crate::{
    AttemptId, Lease, Outcome, OwnerToken, Record, RecordsAdmin, Reservation, ReserveRequest,
    Scope, StoreError, StoredResponse,
    conformance::{fingerprint, fresh_scope},
    machine,
};

/// How far apart the store's clock and this process' may be, and how
/// close to a lease boundary either answer is accepted.
pub const TOLERANCE: Duration = Duration::from_millis(60);

/// How many owners a sequence has.
const OWNERS: u8 = 3;

/// One call of a generated sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `owner` reserves with payload `fp` (0 or 1); a lease it gets is
    /// its own from then on.
    Reserve {
        /// Who.
        owner: u8,
        /// Which payload.
        fp: u8,
    },
    /// `owner` renews its lease.
    Renew {
        /// Who.
        owner: u8,
    },
    /// `owner` marks its attempt's outcome unknown.
    MarkUnknown {
        /// Who.
        owner: u8,
    },
    /// `owner` completes with `status` (a `204` is recorded as answered
    /// but not stored).
    Complete {
        /// Who.
        owner: u8,
        /// The status.
        status: u16,
    },
    /// `owner` releases.
    Release {
        /// Who.
        owner: u8,
    },
    /// The record is cancelled.
    Cancel,
    /// An operator force-releases the record.
    ForceRelease,
    /// An operator erases the record.
    Erase,
    /// A lease and a margin pass.
    Lapse,
    /// The call before, sent again: a retry after its reply was lost.
    Again,
}

/// A sequence that found the store and the reference apart.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The sequence as run.
    pub ops: Vec<Op>,
    /// The call (its index in `ops`) whose answer, or the record after it,
    /// differed.
    pub at: usize,
    /// What differed: the store's and the reference's.
    pub what: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "the store and the machine differ at call {}:", self.at)?;
        for (i, op) in self.ops.iter().enumerate() {
            let mark = if i == self.at { "=>" } else { "  " };
            writeln!(f, "{mark} {i:2} {op:?}")?;
        }
        write!(f, "{}", self.what)
    }
}

/// A small deterministic generator (xorshift), so a seed names a sequence.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A sequence of 4 to 25 calls drawn from `seed`, led by a new key, with at
/// most two lapses.
pub fn generate(seed: u64) -> Vec<Op> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let len = 4 + rng.below(21);
    let mut lapses = 0;
    // Every sequence starts with a new key: most of what can differ
    // happens to a record.
    let mut ops = vec![Op::Reserve { owner: 0, fp: 0 }];
    while (ops.len() as u64) < len {
        let owner = u8::try_from(rng.below(u64::from(OWNERS))).unwrap_or(0);
        let op = match rng.below(100) {
            0..=23 => Op::Reserve {
                owner,
                fp: u8::from(rng.below(5) == 0),
            },
            24..=29 => Op::Renew { owner },
            30..=34 => Op::MarkUnknown { owner },
            35..=53 => Op::Complete {
                owner,
                status: [200, 201, 204, 422][usize::try_from(rng.below(4)).unwrap_or(0)],
            },
            54..=64 => Op::Release { owner },
            65..=68 => Op::Cancel,
            69..=72 => Op::ForceRelease,
            73..=78 => Op::Erase,
            79..=85 => Op::Again,
            _ if lapses < 2 => {
                lapses += 1;
                // A lapse matters most to the next reservation.
                if rng.below(2) == 0 {
                    ops.push(Op::Lapse);
                    Op::Reserve { owner, fp: 0 }
                } else {
                    Op::Lapse
                }
            }
            _ => Op::Reserve { owner, fp: 0 },
        };
        ops.push(op);
    }
    ops
}

fn outcome_of(owner: u8, status: u16) -> Outcome {
    if status == 204 {
        return Outcome::NotStored { status };
    }
    Outcome::Stored(StoredResponse {
        status,
        headers: vec![(
            http::HeaderName::from_static("location"),
            Bytes::from(format!("/orders/{owner}")),
        )],
        body: Bytes::from(format!("{{\"owner\":{owner},\"status\":{status}}}")),
    })
}

/// The reference's answer at `now_ms`, on a copy of `slot`.
type Step<'a> = Box<dyn Fn(&mut Option<Record>, u64) -> Seen + 'a>;

/// Runs `ops` against `store` (leases of `lease`) and the reference; the
/// first mismatch, if any. A store error fails the run as a mismatch too.
pub async fn run<S: RecordsAdmin>(store: &S, lease: Duration, ops: &[Op]) -> Result<(), Mismatch> {
    let scope: Scope = fresh_scope("differential");
    let request = |fp: u8| ReserveRequest {
        scope: scope.clone(),
        fingerprint: fingerprint(fp + 1),
        lease,
        retention: Duration::from_secs(3600),
    };
    let mut slot: Option<Record> = None;
    let mut leases: [Option<Lease>; OWNERS as usize] = Default::default();
    let mismatch = |at: usize, what: String| Mismatch {
        ops: ops.to_vec(),
        at,
        what,
    };
    let failed = |at: usize, error: StoreError| mismatch(at, format!("store error: {error}"));
    let mut previous: Option<Op> = None;
    for (at, &listed) in ops.iter().enumerate() {
        let op = match listed {
            Op::Again => match previous {
                Some(Op::Lapse) | None => continue,
                Some(op) => op,
            },
            op => op,
        };
        previous = Some(op);
        let before = crate::unix_ms().saturating_sub(millis(TOLERANCE));
        let (seen, step) = match op {
            Op::Lapse => {
                tokio::time::sleep(lease + TOLERANCE * 3).await;
                continue;
            }
            op => match call(store, op, &scope, &request, &mut leases).await {
                Ok(Some(called)) => called,
                Ok(None) => continue,
                Err(error) => return Err(failed(at, error)),
            },
        };
        let after = crate::unix_ms().saturating_add(millis(TOLERANCE));
        slot = judged(&seen, &step, &slot, before, after).map_err(|what| mismatch(at, what))?;
        // The record as the store reads it back.
        let read = store.get(scope.hash()).await.map_err(|e| failed(at, e))?;
        let read = read.as_ref().map(record_seen);
        let reference = slot.as_ref().map(record_seen);
        if read != reference {
            return Err(mismatch(
                at,
                format!("record after the call:\n  store:   {read:?}\n  machine: {reference:?}"),
            ));
        }
    }
    Ok(())
}

/// The store's answer to `op` on `scope` (`request` makes an owner's
/// request; `leases` holds each owner's lease), and the reference's step
/// for it; `None` for an op with nothing to call (a lapse, or an owner
/// without a lease).
async fn call<S: RecordsAdmin>(
    store: &S,
    op: Op,
    scope: &Scope,
    request: &dyn Fn(u8) -> ReserveRequest,
    leases: &mut [Option<Lease>; OWNERS as usize],
) -> Result<Option<(Seen, Step<'static>)>, StoreError> {
    Ok(Some(match op {
        Op::Lapse | Op::Again => return Ok(None),
        Op::Reserve { owner, fp } => {
            let request = request(fp);
            let answer = store.reserve(&request).await?;
            let (attempt, token) = match &answer {
                Reservation::Acquired(lease) | Reservation::TakenOver { lease, .. } => {
                    leases[usize::from(owner)] = Some(lease.clone());
                    (lease.attempt, lease.token)
                }
                _ => (AttemptId::new(), OwnerToken::new()),
            };
            let seen = reservation_seen(&answer);
            (
                seen,
                Box::new(move |slot, now| {
                    reservation_seen(&machine::reserve(slot, &request, now, attempt, token))
                }),
            )
        }
        Op::Renew { owner }
        | Op::MarkUnknown { owner }
        | Op::Complete { owner, .. }
        | Op::Release { owner } => {
            let Some(lease) = leases[usize::from(owner)].clone() else {
                return Ok(None);
            };
            return call_owner(store, op, lease).await;
        }
        Op::Cancel => {
            let answer = store.cancel(scope.hash()).await?;
            (
                cancellation_seen(&answer),
                Box::new(|slot, now| cancellation_seen(&machine::cancel(slot, now))),
            )
        }
        Op::ForceRelease => {
            let answer = store.force_release(scope.hash()).await?;
            (
                force_release_seen(&answer),
                Box::new(|slot, now| force_release_seen(&machine::force_release(slot, now))),
            )
        }
        Op::Erase => {
            let answer = store.erase(scope.hash()).await?;
            (
                erasure_seen(&answer),
                Box::new(|slot, now| erasure_seen(&machine::erase(slot, now))),
            )
        }
    }))
}

/// The store's answer to an owner's `op` under its `lease`, and the
/// reference's step for it; `None` for an op that is no owner's.
async fn call_owner<S: RecordsAdmin>(
    store: &S,
    op: Op,
    lease: Lease,
) -> Result<Option<(Seen, Step<'static>)>, StoreError> {
    Ok(Some(match op {
        Op::Renew { .. } | Op::MarkUnknown { .. } => {
            let unknown = matches!(op, Op::MarkUnknown { .. });
            let answer = if unknown {
                store.mark_unknown(&lease).await
            } else {
                store.renew(&lease).await
            };
            let answer = answer?;
            (
                renewal_seen(&answer),
                Box::new(move |slot, now| {
                    renewal_seen(&if unknown {
                        machine::mark_unknown(slot, &lease, now)
                    } else {
                        machine::renew(slot, &lease, now)
                    })
                }),
            )
        }
        Op::Complete { owner, status } => {
            let outcome = outcome_of(owner, status);
            let answer = store.complete(&lease, &outcome).await?;
            (
                completion_seen(&answer),
                Box::new(move |slot, now| {
                    completion_seen(&machine::complete(slot, &lease, &outcome, now))
                }),
            )
        }
        Op::Release { .. } => {
            let answer = store.release(&lease).await?;
            (
                release_seen(&answer),
                Box::new(move |slot, now| release_seen(&machine::release(slot, &lease, now))),
            )
        }
        _ => return Ok(None),
    }))
}

/// The reference's record after `step`, taken at the start or the end of
/// the call's window (`before`, `after`), whichever gives the store's
/// answer `seen`; else what differs.
fn judged(
    seen: &Seen,
    step: &Step<'_>,
    slot: &Option<Record>,
    before: u64,
    after: u64,
) -> Result<Option<Record>, String> {
    let (mut early, mut late) = (slot.clone(), slot.clone());
    let (at_early, at_late) = (step(&mut early, before), step(&mut late, after));
    if *seen == at_early {
        Ok(early)
    } else if *seen == at_late {
        Ok(late)
    } else {
        let expected = if at_early == at_late {
            format!("{at_early:?}")
        } else {
            format!("{at_early:?} or {at_late:?}")
        };
        Err(format!(
            "answer:\n  store:   {seen:?}\n  machine: {expected}"
        ))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Drops calls from a failing `mismatch`'s sequence one at a time while it
/// still fails (each try a fresh run), at most `tries` runs; the shortest
/// failing sequence found.
pub async fn shrink<S: RecordsAdmin>(
    store: &S,
    lease: Duration,
    mismatch: Mismatch,
    tries: usize,
) -> Mismatch {
    let mut best = mismatch;
    let mut runs = 0;
    loop {
        let mut smaller = None;
        // Calls after the mismatch never matter.
        let upto = (best.at + 1).min(best.ops.len());
        for drop in (0..upto).rev() {
            if runs >= tries {
                return best;
            }
            let mut ops = best.ops[..upto].to_vec();
            ops.remove(drop);
            runs += 1;
            if let Err(found) = run(store, lease, &ops).await {
                smaller = Some(found);
                break;
            }
        }
        match smaller {
            Some(found) => best = found,
            None => return best,
        }
    }
}

/// Runs `cases` generated sequences from `first_seed` on, and panics with
/// the shrunk counterexample and its seed at the first mismatch.
pub async fn check<S: RecordsAdmin>(store: &S, lease: Duration, first_seed: u64, cases: u64) {
    for seed in first_seed..first_seed + cases {
        let ops = generate(seed);
        if let Err(found) = run(store, lease, &ops).await {
            let shrunk = shrink(store, lease, found, 60).await;
            panic!("seed {seed}: {shrunk}");
        }
    }
}

/// How many cases a differential test runs: `IDEM_DIFFERENTIAL_CASES` if
/// set (the deep mode), else `default`.
pub fn cases(default: u64) -> u64 {
    std::env::var("IDEM_DIFFERENTIAL_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_names_one_sequence() {
        assert_eq!(generate(7), generate(7));
        assert_ne!(generate(7), generate(8));
        for seed in 0..200 {
            let ops = generate(seed);
            assert!((4..=25).contains(&ops.len()));
            assert!(ops.iter().filter(|op| **op == Op::Lapse).count() <= 2);
        }
    }
}
