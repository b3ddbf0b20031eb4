//! The capacity holds under concurrency, the expiry heap stays bounded,
//! and reading every record leaves the thread to other requests between
//! shards.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{
    Fingerprint, IdempotencyKey, RecordsAdmin, Release, Reservation, ReserveRequest, Scope, Store,
    StoreError,
};
use idem_memory::MemoryStore;

fn request(thread: usize, n: usize) -> ReserveRequest {
    ReserveRequest {
        scope: Scope::new(
            "tenant",
            "POST /orders",
            IdempotencyKey::parse(format!("k-{thread}-{n}").as_bytes()).expect("key"),
        ),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    }
}

/// Eight threads reserve distinct keys (so on many shards) against a
/// capacity of 50, in 200 rounds: every round ends with exactly 50 records
/// and exactly 50 acquired reservations, the rest refused as full.
#[test]
fn concurrent_reservations_never_exceed_the_capacity() {
    const THREADS: usize = 8;
    const CAPACITY: usize = 50;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(THREADS)
        .build()
        .expect("runtime");
    for round in 0..200 {
        let store = MemoryStore::builder().capacity(CAPACITY).build();
        let acquired = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(tokio::sync::Barrier::new(THREADS));
        runtime.block_on(async {
            let tasks: Vec<_> = (0..THREADS)
                .map(|thread| {
                    let (store, acquired, barrier) =
                        (store.clone(), Arc::clone(&acquired), Arc::clone(&barrier));
                    tokio::spawn(async move {
                        barrier.wait().await;
                        for n in 0..CAPACITY {
                            match store.reserve(&request(thread, n)).await {
                                Ok(Reservation::Acquired(_)) => {
                                    acquired.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(StoreError::Full { capacity, .. }) => {
                                    assert_eq!(capacity, CAPACITY);
                                }
                                other => panic!("unexpected answer {other:?}"),
                            }
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("task");
            }
        });
        assert_eq!(store.len(), CAPACITY, "round {round}: records");
        assert_eq!(
            acquired.load(Ordering::Relaxed),
            CAPACITY,
            "round {round}: acquired"
        );
    }
}

/// Re-reserving the same keys thousands of times (each new attempt moves
/// the record's expiry) leaves the expiry heap at about twice the records,
/// not one entry per attempt.
#[tokio::test(start_paused = true)]
async fn new_attempts_do_not_grow_the_expiry_heap() {
    let store = MemoryStore::builder().shards(1).build();
    for _ in 0..2_000 {
        tokio::time::advance(Duration::from_millis(5)).await;
        for n in 0..10 {
            let lease = match store.reserve(&request(0, n)).await.expect("reserve") {
                Reservation::Acquired(lease) => lease,
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(
                store.release(&lease).await.expect("release"),
                Release::Released
            );
        }
    }
    // The ten records are held, released: none counts against the capacity.
    assert_eq!(store.len(), 0);
    let entries = store.expiry_entries();
    assert!(
        (10..=2 * 10 + 16).contains(&entries),
        "{entries} heap entries for 10 records after 20,000 attempts"
    );
}

/// A stored body sliced from a large read buffer does not keep that buffer
/// alive: the record owns a copy of just the body and header values.
#[tokio::test]
async fn a_record_does_not_pin_the_buffer_its_body_came_from() {
    use bytes::Bytes;
    use idem_core::{Completion, Outcome, StoredResponse};
    let store = MemoryStore::new();
    let lease = match store.reserve(&request(0, 0)).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("unexpected {other:?}"),
    };
    let buffer = Bytes::from(vec![b'x'; 8192]);
    let outcome = Outcome::Stored(StoredResponse {
        status: 201,
        headers: vec![(
            idem_core::HeaderName::from_static("location"),
            buffer.slice(100..110),
        )],
        body: buffer.slice(0..66),
    });
    assert_eq!(
        store.complete(&lease, &outcome).await.expect("complete"),
        Completion::Recorded
    );
    drop(outcome);
    assert!(
        buffer.is_unique(),
        "the record still refers to the 8 KiB buffer"
    );
    let record = store
        .get(request(0, 0).scope.hash())
        .await
        .expect("get")
        .expect("record");
    match record.outcome {
        Some(Outcome::Stored(stored)) => {
            assert_eq!(stored.body, buffer.slice(0..66));
            assert_eq!(stored.headers[0].1, buffer.slice(100..110));
        }
        other => panic!("unexpected {other:?}"),
    }
}

fn tenant_request(tenant: &str, n: usize, retention: Duration) -> ReserveRequest {
    ReserveRequest {
        scope: Scope::new(
            tenant,
            "POST /orders",
            IdempotencyKey::parse(format!("k-{n}").as_bytes()).expect("key"),
        ),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(30),
        retention,
    }
}

/// A tenant at its quota is refused with an honest wait (until its
/// earliest record expires); another tenant's new keys still work; a
/// released record stops counting.
#[tokio::test(start_paused = true)]
async fn a_tenant_at_its_quota_leaves_other_tenants_working() {
    let store = MemoryStore::builder()
        .capacity(100)
        .tenant_quota(Some(5))
        .build();
    let hour = Duration::from_secs(3600);
    let mut leases = Vec::new();
    for n in 0..5 {
        match store.reserve(&tenant_request("flood", n, hour)).await {
            Ok(Reservation::Acquired(lease)) => leases.push(lease),
            other => panic!("unexpected {other:?}"),
        }
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    match store.reserve(&tenant_request("flood", 99, hour)).await {
        Err(StoreError::QuotaExceeded { quota, retry_after }) => {
            assert_eq!(quota, 5);
            // The earliest record expires an hour after it was made, a
            // minute ago.
            assert!(
                retry_after > Duration::from_secs(3500) && retry_after <= hour,
                "{retry_after:?}"
            );
        }
        other => panic!("expected the quota, got {other:?}"),
    }
    // A key the tenant holds is still served (its lease lapsed: a
    // takeover, which needs no new place).
    assert!(matches!(
        store.reserve(&tenant_request("flood", 0, hour)).await,
        Ok(Reservation::TakenOver { .. })
    ));
    for n in 0..5 {
        assert!(matches!(
            store.reserve(&tenant_request("other", n, hour)).await,
            Ok(Reservation::Acquired(_))
        ));
    }
    // Releasing one frees a place in the quota.
    let lease = leases.pop().expect("a lease");
    assert_eq!(
        store.release(&lease).await.expect("release"),
        Release::Released
    );
    assert!(matches!(
        store.reserve(&tenant_request("flood", 99, hour)).await,
        Ok(Reservation::Acquired(_))
    ));
    assert_eq!(store.len(), 10);
}

/// A full store answers with the time until its earliest record expires,
/// and admits a new key once one has.
#[tokio::test(start_paused = true)]
async fn a_full_store_says_when_room_frees_up() {
    let store = MemoryStore::builder().capacity(3).build();
    for n in 0..3 {
        let retention = Duration::from_secs(100 * (n as u64 + 1));
        assert!(matches!(
            store.reserve(&tenant_request("t", n, retention)).await,
            Ok(Reservation::Acquired(_))
        ));
    }
    tokio::time::advance(Duration::from_secs(40)).await;
    match store
        .reserve(&tenant_request("t", 9, Duration::from_secs(60)))
        .await
    {
        Err(StoreError::Full {
            capacity,
            retry_after,
        }) => {
            assert_eq!(capacity, 3);
            assert_eq!(retry_after, Duration::from_secs(60));
        }
        other => panic!("expected full, got {other:?}"),
    }
    assert!(store.is_full());
    tokio::time::advance(Duration::from_secs(61)).await;
    assert!(matches!(
        store
            .reserve(&tenant_request("t", 9, Duration::from_secs(60)))
            .await,
        Ok(Reservation::Acquired(_))
    ));
}

/// The byte bound holds: a response that would cross it is recorded
/// without its bytes (a retry is told it cannot be replayed, the action is
/// not run again), and new keys are refused once the bound is reached.
#[tokio::test]
async fn the_byte_bound_holds_while_a_tenant_floods() {
    use bytes::Bytes;
    use idem_core::{Completion, Outcome, StoredResponse};
    let max = 64 * 1024;
    let store = MemoryStore::builder().max_bytes(max).build();
    let big = |n: u8| {
        Outcome::Stored(StoredResponse {
            status: 201,
            headers: vec![(
                idem_core::HeaderName::from_static("content-type"),
                Bytes::from_static(b"text/plain"),
            )],
            body: Bytes::from(vec![n; 10_500]),
        })
    };
    let hour = Duration::from_secs(3600);
    let (mut stored, mut not_stored, mut refused) = (0, 0, 0);
    for n in 0..40 {
        match store.reserve(&tenant_request("flood", n, hour)).await {
            Ok(Reservation::Acquired(lease)) => {
                assert_eq!(
                    store
                        .complete(&lease, &big(n as u8))
                        .await
                        .expect("complete"),
                    Completion::Recorded
                );
                let record = store.get(&lease.scope).await.expect("get").expect("record");
                match record.outcome {
                    Some(Outcome::Stored(_)) => stored += 1,
                    Some(Outcome::NotStored { status: 201 }) => not_stored += 1,
                    other => panic!("unexpected outcome {other:?}"),
                }
            }
            Err(StoreError::Full { .. }) => refused += 1,
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            store.bytes() <= max,
            "{} bytes over a bound of {max}",
            store.bytes()
        );
    }
    assert!(stored >= 5, "only {stored} responses stored");
    assert!(not_stored > 0, "no response was recorded without its bytes");
    assert!(refused > 0, "no new key was refused at the bound");
    assert!(store.is_full());
}

/// Reading every record (a listing, or the count of lapsed records a
/// gateway keeps every 5 s) lets the thread's other tasks run between
/// shards: a full store takes tens of milliseconds to read, which would
/// otherwise hold up every request queued on that thread. On one thread,
/// a task that counts its turns gets one after each shard.
#[tokio::test(flavor = "current_thread")]
async fn reading_every_record_lets_other_tasks_run_between_shards() {
    let store = MemoryStore::builder().shards(8).build();
    for n in 0..64 {
        let reserved = store.reserve(&request(0, n)).await.expect("reserve");
        assert!(matches!(reserved, Reservation::Acquired(_)));
    }
    let turns = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&turns);
    let ticker = tokio::spawn(async move {
        loop {
            counter.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    });
    assert_eq!(store.count_lapsed(10).await.expect("count"), 0);
    let during = turns.load(Ordering::Relaxed);
    ticker.abort();
    assert!(
        during >= 7,
        "the other task ran {during} times while 8 shards were read"
    );
}

/// An erased record gives its place back, in the store and in its
/// tenant's quota: the tenant's next new key is taken.
#[tokio::test(start_paused = true)]
async fn an_erased_record_frees_its_place_in_the_quota() {
    use idem_core::{Erasure, RecordsAdmin};
    let store = MemoryStore::builder()
        .capacity(100)
        .tenant_quota(Some(2))
        .build();
    let hour = Duration::from_secs(3600);
    let mut scopes = Vec::new();
    for n in 0..2 {
        let request = tenant_request("quota", n, hour);
        let Ok(Reservation::Acquired(lease)) = store.reserve(&request).await else {
            panic!("a place in the quota");
        };
        let outcome = idem_core::Outcome::NotStored { status: 400 };
        let _ = store.complete(&lease, &outcome).await.expect("complete");
        scopes.push(*request.scope.hash());
    }
    assert!(matches!(
        store.reserve(&tenant_request("quota", 9, hour)).await,
        Err(StoreError::QuotaExceeded { .. })
    ));
    assert_eq!(store.len(), 2);
    assert!(matches!(
        store.erase(&scopes[0]).await.expect("erase"),
        Erasure::Erased(_)
    ));
    assert_eq!(store.len(), 1);
    assert!(matches!(
        store.reserve(&tenant_request("quota", 9, hour)).await,
        Ok(Reservation::Acquired(_))
    ));
}
