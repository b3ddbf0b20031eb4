//! Random sequences of reservations, completions, releases, renewals,
//! cancels and clock jumps against the memory store agree with a small
//! reference model of the contract's state table.

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use idem_core::{
    Cancellation, Completion, Fingerprint, IdempotencyKey, Lease, Outcome, Release, Renewal,
    Reservation, ReserveRequest, Scope, Store, StoredResponse,
};
use idem_memory::MemoryStore;
use proptest::prelude::*;

const LEASE_MS: u64 = 30_000;
const RETENTION_MS: u64 = 3_600_000;

#[derive(Debug, Clone)]
enum Op {
    Reserve { key: u8, fp: u8 },
    Complete { key: u8, lease: u8, status: u16 },
    Release { key: u8, lease: u8 },
    Renew { key: u8, lease: u8 },
    Cancel { key: u8 },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u8, 0..2u8).prop_map(|(key, fp)| Op::Reserve { key, fp }),
        3 => (0..3u8, 0..3u8, prop::sample::select(vec![200u16, 201, 404])).prop_map(|(key, lease, status)| Op::Complete { key, lease, status }),
        2 => (0..3u8, 0..3u8).prop_map(|(key, lease)| Op::Release { key, lease }),
        1 => (0..3u8, 0..3u8).prop_map(|(key, lease)| Op::Renew { key, lease }),
        1 => (0..3u8).prop_map(|key| Op::Cancel { key }),
        2 => prop::sample::select(vec![1_000u64, 10_000, 29_000, 31_000, 600_000, RETENTION_MS + 1]).prop_map(|ms| Op::Advance { ms }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Processing,
    Completed(u16),
    Cancelled,
    Released,
}

#[derive(Debug, Clone)]
struct ModelRecord {
    state: State,
    fp: u8,
    generation: u64,
    owner: Option<usize>,
    /// The lease whose completion or release made the state: its own
    /// write sent again (a retry after a lost reply) answers as the first.
    writer: Option<usize>,
    lease_until: u64,
    expires_at: u64,
    /// Generations whose attempt was taken over while it ran (its outcome
    /// unknown); the record's history keeps the newest of them whatever
    /// else it drops.
    superseded: Vec<u64>,
    /// The current attempt ended by a release that kept the record
    /// processing (an unknown outcome in its history).
    ended: bool,
}

/// What the model expects a call to answer, reduced to comparable facts.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Acquired(u64),
    TakenOver(u64),
    InProgress(u64),
    Completed(u16),
    Cancelled,
    Conflict,
    Recorded,
    Released,
    Renewed,
    Fenced,
    CancelDone,
    AlreadyCompleted,
    AlreadyCancelled,
    NotFound,
}

#[derive(Default)]
struct Model {
    now: u64,
    records: HashMap<u8, ModelRecord>,
}

impl Model {
    fn live(&mut self, key: u8) -> Option<&mut ModelRecord> {
        let now = self.now;
        if self.records.get(&key).is_some_and(|r| r.expires_at <= now) {
            self.records.remove(&key);
        }
        self.records.get_mut(&key)
    }

    fn reserve(&mut self, key: u8, fp: u8, lease_id: usize) -> Answer {
        let now = self.now;
        let fresh = |generation, superseded| ModelRecord {
            state: State::Processing,
            fp,
            generation,
            owner: Some(lease_id),
            writer: None,
            lease_until: now + LEASE_MS,
            expires_at: now + RETENTION_MS,
            superseded,
            ended: false,
        };
        match self.live(key) {
            None => {
                self.records.insert(key, fresh(1, Vec::new()));
                Answer::Acquired(1)
            }
            Some(r) if r.state == State::Released => {
                *r = fresh(r.generation + 1, std::mem::take(&mut r.superseded));
                Answer::Acquired(r.generation)
            }
            Some(r) if r.fp != fp => Answer::Conflict,
            Some(r) => match r.state {
                State::Processing if r.lease_until > now => Answer::InProgress(r.lease_until - now),
                State::Processing => {
                    let mut superseded = std::mem::take(&mut r.superseded);
                    if !r.ended {
                        superseded.push(r.generation);
                    }
                    *r = fresh(r.generation + 1, superseded);
                    Answer::TakenOver(r.generation)
                }
                State::Completed(status) => Answer::Completed(status),
                State::Cancelled => Answer::Cancelled,
                State::Released => unreachable!(),
            },
        }
    }

    fn owned(&mut self, key: u8, lease_id: usize) -> Option<&mut ModelRecord> {
        self.live(key)
            .filter(|r| r.state == State::Processing && r.owner == Some(lease_id))
    }

    fn complete(&mut self, key: u8, lease_id: usize, status: u16) -> Answer {
        if self
            .live(key)
            .is_some_and(|r| matches!(r.state, State::Completed(_)) && r.writer == Some(lease_id))
        {
            return Answer::Recorded;
        }
        match self.owned(key, lease_id) {
            Some(r) => {
                r.state = State::Completed(status);
                r.owner = None;
                r.writer = Some(lease_id);
                Answer::Recorded
            }
            None => Answer::Fenced,
        }
    }

    fn release(&mut self, key: u8, lease_id: usize) -> Answer {
        if self.live(key).is_some_and(|r| {
            (r.state == State::Released || r.state == State::Processing && r.ended)
                && r.writer == Some(lease_id)
        }) {
            return Answer::Released;
        }
        let now = self.now;
        match self.owned(key, lease_id) {
            Some(r) => {
                // An attempt of unknown outcome in the history: freed for
                // the same request only (processing, its lease lapsed).
                if !r.superseded.is_empty() {
                    r.lease_until = now;
                    r.ended = true;
                } else {
                    r.state = State::Released;
                }
                r.owner = None;
                r.writer = Some(lease_id);
                Answer::Released
            }
            None => Answer::Fenced,
        }
    }

    fn renew(&mut self, key: u8, lease_id: usize) -> Answer {
        let now = self.now;
        match self.owned(key, lease_id) {
            Some(r) => {
                r.lease_until = now + LEASE_MS;
                r.expires_at = r.expires_at.max(r.lease_until);
                Answer::Renewed
            }
            None => Answer::Fenced,
        }
    }

    fn cancel(&mut self, key: u8) -> Answer {
        let now = self.now;
        match self.live(key) {
            None => Answer::NotFound,
            Some(r) => match r.state {
                State::Completed(_) => Answer::AlreadyCompleted,
                State::Cancelled => Answer::AlreadyCancelled,
                // A released record is vacant: nothing to cancel.
                State::Released => Answer::NotFound,
                State::Processing => {
                    r.state = State::Cancelled;
                    r.owner = None;
                    r.expires_at = now + RETENTION_MS;
                    Answer::CancelDone
                }
            },
        }
    }
}

fn scope(key: u8) -> Scope {
    Scope::new(
        "tenant",
        "POST /orders",
        IdempotencyKey::parse(format!("key-{key}").as_bytes()).expect("key"),
    )
}

fn outcome(status: u16) -> Outcome {
    Outcome::Stored(StoredResponse {
        status,
        headers: vec![],
        body: Bytes::from(format!("status {status}")),
    })
}

async fn run(ops: Vec<Op>) {
    let store = MemoryStore::new();
    let mut model = Model::default();
    // Every lease handed out, per key: (lease id in the model, the lease).
    let mut leases: HashMap<u8, Vec<(usize, Lease)>> = HashMap::new();
    let mut next_id = 0usize;
    for (step, op) in ops.into_iter().enumerate() {
        let pick = |leases: &HashMap<u8, Vec<(usize, Lease)>>, key: u8, n: u8| {
            let list = leases.get(&key)?;
            // 0 = newest, 1 = the one before, ...
            list.iter().rev().nth(usize::from(n)).cloned()
        };
        let (expected, actual) = match op.clone() {
            Op::Reserve { key, fp } => {
                let request = ReserveRequest {
                    scope: scope(key),
                    fingerprint: Fingerprint::from_bytes([fp; 32]),
                    lease: Duration::from_millis(LEASE_MS),
                    retention: Duration::from_millis(RETENTION_MS),
                };
                let expected = model.reserve(key, fp, next_id);
                let actual = match store.reserve(&request).await.expect("reserve") {
                    Reservation::Acquired(lease) => {
                        leases
                            .entry(key)
                            .or_default()
                            .push((next_id, lease.clone()));
                        Answer::Acquired(lease.generation)
                    }
                    Reservation::TakenOver { lease, .. } => {
                        leases
                            .entry(key)
                            .or_default()
                            .push((next_id, lease.clone()));
                        Answer::TakenOver(lease.generation)
                    }
                    Reservation::InProgress { retry_after } => {
                        Answer::InProgress(retry_after.as_millis() as u64)
                    }
                    Reservation::Completed(replay) => Answer::Completed(replay.outcome.status()),
                    Reservation::Cancelled => Answer::Cancelled,
                    Reservation::Conflict => Answer::Conflict,
                };
                next_id += 1;
                (expected, actual)
            }
            Op::Complete { key, lease, status } => {
                let Some((id, lease)) = pick(&leases, key, lease) else {
                    continue;
                };
                let expected = model.complete(key, id, status);
                let actual = match store
                    .complete(&lease, &outcome(status))
                    .await
                    .expect("complete")
                {
                    Completion::Recorded => Answer::Recorded,
                    Completion::Fenced(_) => Answer::Fenced,
                };
                (expected, actual)
            }
            Op::Release { key, lease } => {
                let Some((id, lease)) = pick(&leases, key, lease) else {
                    continue;
                };
                let expected = model.release(key, id);
                let actual = match store.release(&lease).await.expect("release") {
                    Release::Released => Answer::Released,
                    Release::Fenced(_) => Answer::Fenced,
                };
                (expected, actual)
            }
            Op::Renew { key, lease } => {
                let Some((id, lease)) = pick(&leases, key, lease) else {
                    continue;
                };
                let expected = model.renew(key, id);
                let actual = match store.renew(&lease).await.expect("renew") {
                    Renewal::Renewed => Answer::Renewed,
                    Renewal::Fenced(_) => Answer::Fenced,
                };
                (expected, actual)
            }
            Op::Cancel { key } => {
                let expected = model.cancel(key);
                let actual = match store.cancel(scope(key).hash()).await.expect("cancel") {
                    Cancellation::Cancelled(_) => Answer::CancelDone,
                    Cancellation::AlreadyCompleted(_) => Answer::AlreadyCompleted,
                    Cancellation::AlreadyCancelled(_) => Answer::AlreadyCancelled,
                    Cancellation::NotFound => Answer::NotFound,
                };
                (expected, actual)
            }
            Op::Advance { ms } => {
                model.now += ms;
                tokio::time::advance(Duration::from_millis(ms)).await;
                continue;
            }
        };
        assert_eq!(actual, expected, "step {step}: {op:?}");
    }
    // The store holds every live key, and counts at most one record per
    // key against its capacity (expired ones may wait for the sweep;
    // released ones do not count).
    let mut live = 0;
    for key in 0..3u8 {
        let record = store.get(scope(key).hash()).await.expect("get");
        assert_eq!(
            record.is_some(),
            model.live(key).is_some(),
            "key {key} presence"
        );
        live += usize::from(record.is_some_and(|r| r.state != idem_core::RecordState::Released));
    }
    assert!(
        (live..=3).contains(&store.len()),
        "{} records for {live} live keys",
        store.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn memory_store_agrees_with_the_model(ops in prop::collection::vec(op(), 1..60)) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(run(ops));
    }
}
