//! The capacity holds under concurrency, and the expiry heap stays bounded.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{
    Fingerprint, IdempotencyKey, Release, Reservation, ReserveRequest, Scope, Store, StoreError,
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
                                Err(StoreError::Full { capacity }) => {
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
    assert_eq!(store.len(), 10);
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
        headers: vec![("location".to_owned(), buffer.slice(100..110))],
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
