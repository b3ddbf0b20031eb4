//! The test suite every [`Store`] must pass (feature `conformance`).
//!
//! Each check is an `async fn` taking a [`Harness`]: the store under test
//! and a way to move its clock. [`conformance_tests!`](crate::conformance_tests)
//! turns them into one `#[tokio::test]` each:
//!
//! ```ignore
//! struct MemoryHarness(MemoryStore);
//! impl idem_core::conformance::Harness for MemoryHarness { /* ... */ }
//! idem_core::conformance_tests!(|| async { Some(MemoryHarness::new()) });
//! ```
//!
//! Every check uses its own random tenant, so checks may share one store.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;

use crate::{
    ATTEMPT_HISTORY, AttemptOutcome, Cancellation, Completion, Current, Erasure, Fingerprint,
    ForceRelease, IdempotencyKey, LateEvidence, Outcome, RecordQuery, RecordState, RecordsAdmin,
    Release, Renewal, Reservation, ReserveRequest, Scope, Store, StoredResponse,
};

// ===== waiting in tests on real servers =====

/// Calls `attempt` until `done` holds of its answer or `within` passed,
/// pausing 20 ms between calls; answers the last answer, so the caller's
/// assertions say what was wrong when the time ran out.
pub async fn poll_until<T>(
    within: std::time::Duration,
    mut attempt: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let answer = attempt().await;
        if done(&answer) || tokio::time::Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until `ready` holds; fails the test naming `what` once `within`
/// passed.
pub async fn wait_until(
    within: std::time::Duration,
    what: &str,
    mut ready: impl AsyncFnMut() -> bool,
) {
    let ready = poll_until(within, async || ready().await, |ready| *ready).await;
    assert!(ready, "timed out after {within:?} waiting for {what}");
}

/// A store under test and control over its clock.
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// Lets at least `by` pass on the store's clock: `tokio::time::advance`
    /// for a store on tokio's clock, a real sleep for a server.
    fn advance(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// The lease length the checks reserve with.
    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// The retention the checks reserve with (longer than the lease).
    fn retention(&self) -> Duration {
        Duration::from_secs(24 * 3600)
    }
}

/// A scope with a random tenant, so checks never see each other's records.
pub fn fresh_scope(key: &str) -> Scope {
    let tenant = format!("conformance-{}", uuid::Uuid::new_v4());
    let key = IdempotencyKey::parse(key.as_bytes()).expect("test keys are valid");
    Scope::new(tenant, "POST /orders", key)
}

/// A fingerprint made from one byte.
pub fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

/// A response with a body that exercises binary safety.
pub fn response(status: u16, body: &[u8]) -> Outcome {
    Outcome::Stored(StoredResponse {
        status,
        headers: vec![
            (
                http::header::CONTENT_TYPE,
                Bytes::from_static(b"application/json"),
            ),
            (http::header::LOCATION, Bytes::from_static(b"/orders/1")),
            (
                http::HeaderName::from_static("x-binary"),
                Bytes::from_static(b"\x80\xff"),
            ),
        ],
        body: Bytes::copy_from_slice(body),
    })
}

fn request<H: Harness>(h: &H, scope: &Scope, fp: u8) -> ReserveRequest {
    ReserveRequest {
        scope: scope.clone(),
        fingerprint: fingerprint(fp),
        lease: h.lease(),
        retention: h.retention(),
    }
}

async fn reserve<H: Harness>(h: &H, scope: &Scope, fp: u8) -> Reservation {
    h.store()
        .reserve(&request(h, scope, fp))
        .await
        .expect("reserve")
}

async fn acquire<H: Harness>(h: &H, scope: &Scope, fp: u8) -> crate::Lease {
    match reserve(h, scope, fp).await {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A body with every byte value, including NUL and invalid UTF-8.
/// Reserves and checks the answer's kind: `expect_reservation!(h, &scope,
/// fingerprint, Reservation::Acquired(_))`.
macro_rules! expect_reservation {
    ($h:expr, $scope:expr, $fp:expr, $pattern:pat) => {{
        let answer = reserve($h, $scope, $fp).await;
        assert!(matches!(answer, $pattern), "{answer:?}");
    }};
}

async fn release<H: Harness>(h: &H, lease: &crate::Lease) -> crate::Release {
    h.store().release(lease).await.expect("release")
}

async fn renew<H: Harness>(h: &H, lease: &crate::Lease) -> crate::Renewal {
    h.store().renew(lease).await.expect("renew")
}

async fn cancel<H: Harness>(h: &H, scope: &crate::ScopeHash) -> crate::Cancellation {
    h.store().cancel(scope).await.expect("cancel")
}

async fn get<H: Harness>(h: &H, scope: &crate::ScopeHash) -> Option<crate::Record> {
    h.store().get(scope).await.expect("get")
}

async fn complete<H: Harness>(h: &H, lease: &crate::Lease, outcome: &Outcome) -> Completion {
    h.store().complete(lease, outcome).await.expect("complete")
}

/// Completes and checks the outcome was recorded.
async fn recorded<H: Harness>(h: &H, lease: &crate::Lease, outcome: &Outcome) {
    assert_eq!(complete(h, lease, outcome).await, Completion::Recorded);
}

fn binary_body() -> Vec<u8> {
    (0..=255u8).chain(0..=255u8).collect()
}

/// Absent → acquired: generation 1, one running attempt, record readable.
pub async fn reserve_new_acquires<H: Harness>(h: &H) {
    let scope = fresh_scope("new");
    let lease = acquire(h, &scope, 1).await;
    assert_eq!(lease.generation, 1);
    assert_eq!(lease.scope, *scope.hash());
    let record = get(h, scope.hash()).await.expect("record exists");
    assert_eq!(record.state, RecordState::Processing);
    assert_eq!(record.generation, 1);
    assert_eq!(&*record.tenant, scope.tenant());
    assert_eq!(&*record.operation, scope.operation());
    assert_eq!(&*record.key, "new");
    assert_eq!(record.fingerprint, fingerprint(1));
    assert_eq!(record.attempts.len(), 1);
    assert_eq!(record.attempts[0].id, lease.attempt);
    assert_eq!(record.attempts[0].outcome, AttemptOutcome::Running);
}

/// Completed → replay with the exact status, headers and bytes.
pub async fn completed_replays_exact_response<H: Harness>(h: &H) {
    let scope = fresh_scope("replay");
    let lease = acquire(h, &scope, 1).await;
    let outcome = response(201, &binary_body());
    recorded(h, &lease, &outcome).await;
    h.advance(Duration::from_millis(1500)).await;
    match reserve(h, &scope, 1).await {
        Reservation::Completed(replay) => {
            assert_eq!(replay.outcome, outcome);
            assert!(replay.age >= Duration::from_secs(1), "age {:?}", replay.age);
        }
        other => panic!("expected Completed, got {other:?}"),
    }
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.outcome, Some(outcome));
    assert_eq!(
        record.attempts[0].outcome,
        AttemptOutcome::Completed { status: 201 }
    );
    assert!(record.attempts[0].ended_at_ms.is_some());
}

/// An outcome too large to store replays as "not stored".
pub async fn not_stored_outcome_is_kept<H: Harness>(h: &H) {
    let scope = fresh_scope("too-large");
    let lease = acquire(h, &scope, 1).await;
    let outcome = Outcome::NotStored { status: 200 };
    recorded(h, &lease, &outcome).await;
    match reserve(h, &scope, 1).await {
        Reservation::Completed(replay) => assert_eq!(replay.outcome, outcome),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A different fingerprint conflicts in every state and changes nothing.
pub async fn conflict_leaves_record_untouched<H: Harness>(h: &H) {
    // processing
    let scope = fresh_scope("conflict");
    let lease = acquire(h, &scope, 1).await;
    let before = get(h, scope.hash()).await;
    assert_eq!(reserve(h, &scope, 2).await, Reservation::Conflict);
    assert_eq!(get(h, scope.hash()).await, before);
    // processing, lease lapsed: still a conflict, no takeover
    h.advance(h.lease() + Duration::from_millis(100)).await;
    assert_eq!(reserve(h, &scope, 2).await, Reservation::Conflict);
    assert_eq!(get(h, scope.hash()).await, before);
    // completed
    recorded(h, &lease, &response(200, b"ok")).await;
    let before = get(h, scope.hash()).await;
    assert_eq!(reserve(h, &scope, 2).await, Reservation::Conflict);
    assert_eq!(get(h, scope.hash()).await, before);
    // cancelled
    let scope = fresh_scope("conflict-cancelled");
    let _lease = acquire(h, &scope, 1).await;
    assert!(matches!(
        cancel(h, scope.hash()).await,
        Cancellation::Cancelled(_)
    ));
    let before = get(h, scope.hash()).await;
    assert_eq!(reserve(h, &scope, 2).await, Reservation::Conflict);
    assert_eq!(get(h, scope.hash()).await, before);
}

/// A live lease answers in progress with the time left on it.
pub async fn in_progress_while_lease_live<H: Harness>(h: &H) {
    let scope = fresh_scope("busy");
    let _lease = acquire(h, &scope, 1).await;
    match reserve(h, &scope, 1).await {
        Reservation::InProgress { retry_after } => {
            assert!(retry_after <= h.lease(), "{retry_after:?}");
            assert!(retry_after > h.lease() / 2, "{retry_after:?}");
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(
        record.attempts.len(),
        1,
        "an in-progress answer starts no attempt"
    );
}

/// Renewal keeps the lease live past its first expiry.
pub async fn renew_extends_lease<H: Harness>(h: &H) {
    let scope = fresh_scope("renew");
    let lease = acquire(h, &scope, 1).await;
    h.advance(h.lease() * 2 / 3).await;
    assert_eq!(renew(h, &lease).await, Renewal::Renewed);
    h.advance(h.lease() * 2 / 3).await;
    assert!(
        matches!(reserve(h, &scope, 1).await, Reservation::InProgress { .. }),
        "renewed lease must still be live"
    );
}

/// A request renewed past the retention window never expires while it
/// runs: renewal pushes the expiry out.
pub async fn renewal_outlives_retention<H: Harness>(h: &H) {
    let scope = fresh_scope("long-runner");
    let lease = acquire(h, &scope, 1).await;
    let step = h.lease() / 2;
    let mut elapsed = Duration::ZERO;
    while elapsed < h.retention() + h.lease() {
        h.advance(step).await;
        elapsed += step;
        assert_eq!(
            renew(h, &lease).await,
            Renewal::Renewed,
            "after {elapsed:?}"
        );
    }
    expect_reservation!(h, &scope, 1, Reservation::InProgress { .. });
    recorded(h, &lease, &response(200, b"late but fine")).await;
}

/// A lapsed lease is taken over with generation + 1; the old attempt is
/// marked superseded and reported.
pub async fn takeover_after_lease_expiry<H: Harness>(h: &H) {
    let scope = fresh_scope("takeover");
    let first = acquire(h, &scope, 1).await;
    h.advance(h.lease() + Duration::from_millis(100)).await;
    let second = match reserve(h, &scope, 1).await {
        Reservation::TakenOver { lease, superseded } => {
            assert_eq!(superseded.id, first.attempt);
            assert_eq!(superseded.generation, 1);
            assert_eq!(superseded.outcome, AttemptOutcome::Superseded);
            lease
        }
        other => panic!("expected TakenOver, got {other:?}"),
    };
    assert_eq!(second.generation, 2);
    assert_ne!(second.attempt, first.attempt);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.generation, 2);
    assert_eq!(record.attempts.len(), 2);
    assert_eq!(record.attempts[0].outcome, AttemptOutcome::Superseded);
    assert_eq!(record.attempts[1].outcome, AttemptOutcome::Running);
}

/// An attempt whose caller was told its outcome is unknown keeps that in
/// its history while it holds the key, and ends as its late answer says,
/// or superseded when a retry takes over after its lease lapsed.
pub async fn an_unknown_outcome_is_kept<H: Harness>(h: &H) {
    let history = async |scope: &Scope| {
        let record = get(h, scope.hash()).await.expect("record");
        let outcomes: Vec<_> = record.attempts.iter().map(|a| a.outcome).collect();
        (record.state, outcomes)
    };
    // Kept while the key is held; a late answer completes it.
    let scope = fresh_scope("unknown-late");
    let lease = acquire(h, &scope, 1).await;
    let renewal = h.store().mark_unknown(&lease).await.expect("mark_unknown");
    assert_eq!(renewal, Renewal::Renewed);
    assert_eq!(
        history(&scope).await,
        (RecordState::Processing, vec![AttemptOutcome::Unknown])
    );
    expect_reservation!(h, &scope, 1, Reservation::InProgress { .. });
    recorded(h, &lease, &response(201, b"late")).await;
    assert_eq!(
        history(&scope).await,
        (
            RecordState::Completed,
            vec![AttemptOutcome::Completed { status: 201 }]
        )
    );
    // Another owner's token changes nothing.
    let scope = fresh_scope("unknown-fenced");
    let lease = acquire(h, &scope, 1).await;
    let stranger = crate::Lease {
        token: crate::OwnerToken::new(),
        ..lease
    };
    let renewal = h
        .store()
        .mark_unknown(&stranger)
        .await
        .expect("mark_unknown");
    assert!(matches!(renewal, Renewal::Fenced(_)), "{renewal:?}");
    assert_eq!(
        history(&scope).await,
        (RecordState::Processing, vec![AttemptOutcome::Running])
    );
    // No late answer: the lease lapses and the retry that takes over
    // finds it superseded (its side effects unknown).
    let scope = fresh_scope("unknown-lapsed");
    let lease = acquire(h, &scope, 1).await;
    let renewal = h.store().mark_unknown(&lease).await.expect("mark_unknown");
    assert_eq!(renewal, Renewal::Renewed);
    h.advance(h.lease() + Duration::from_millis(100)).await;
    match reserve(h, &scope, 1).await {
        Reservation::TakenOver { superseded, .. } => {
            assert_eq!(superseded.id, lease.attempt);
            assert_eq!(superseded.outcome, AttemptOutcome::Superseded);
        }
        other => panic!("expected TakenOver, got {other:?}"),
    }
    assert_eq!(
        history(&scope).await,
        (
            RecordState::Processing,
            vec![AttemptOutcome::Superseded, AttemptOutcome::Running]
        )
    );
    // Cancelled while unknown: the attempt ends cancelled.
    let scope = fresh_scope("unknown-cancelled");
    let lease = acquire(h, &scope, 1).await;
    let _ = h.store().mark_unknown(&lease).await.expect("mark_unknown");
    assert!(matches!(
        cancel(h, scope.hash()).await,
        Cancellation::Cancelled(_)
    ));
    assert_eq!(
        history(&scope).await,
        (RecordState::Cancelled, vec![AttemptOutcome::Cancelled])
    );
}

/// A first attempt of `scope` (fingerprint 1) whose lease lapsed, and the
/// second attempt that took it over.
async fn lapsed_and_taken_over<H: Harness>(h: &H, scope: &Scope) -> (crate::Lease, crate::Lease) {
    let first = acquire(h, scope, 1).await;
    h.advance(h.lease() + Duration::from_millis(100)).await;
    let Reservation::TakenOver { lease: second, .. } = reserve(h, scope, 1).await else {
        panic!("expected TakenOver");
    };
    (first, second)
}

/// A superseded attempt's complete, renew and release are fenced; its
/// completion is late evidence and never the result.
pub async fn superseded_writes_are_fenced<H: Harness>(h: &H) {
    let scope = fresh_scope("fenced");
    let (first, second) = lapsed_and_taken_over(h, &scope).await;
    assert!(matches!(
        renew(h, &first).await,
        Renewal::Fenced(Current::Processing { .. })
    ));
    assert!(matches!(
        complete(h, &first, &response(201, b"first")).await,
        Completion::Fenced(Current::Processing { .. })
    ));
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(
        record.state,
        RecordState::Processing,
        "a fenced completion changes no state"
    );
    assert!(matches!(
        record.attempt(first.attempt).expect("attempt kept").late,
        Some(LateEvidence::Completed { status: 201, .. })
    ));
    // The new owner's result wins, and the first attempt's later release is fenced too.
    let second_outcome = response(202, b"second");
    recorded(h, &second, &second_outcome).await;
    match release(h, &first).await {
        Release::Fenced(Current::Completed(replay)) => assert_eq!(replay.outcome, second_outcome),
        other => panic!("expected Fenced(Completed), got {other:?}"),
    }
    match h
        .store()
        .complete(&first, &response(500, b"again"))
        .await
        .expect("complete")
    {
        Completion::Fenced(Current::Completed(replay)) => {
            assert_eq!(replay.outcome, second_outcome);
        }
        other => panic!("expected Fenced(Completed), got {other:?}"),
    }
    match reserve(h, &scope, 1).await {
        Reservation::Completed(replay) => assert_eq!(replay.outcome, second_outcome),
        other => panic!("expected Completed, got {other:?}"),
    }
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.outcome, Some(second_outcome));
    assert!(matches!(
        record.attempt(first.attempt).expect("attempt kept").late,
        Some(LateEvidence::Completed { status: 500, .. })
    ));
}

/// A forged token with the right generation is fenced.
pub async fn wrong_token_is_fenced<H: Harness>(h: &H) {
    let scope = fresh_scope("forged");
    let lease = acquire(h, &scope, 1).await;
    let forged = crate::Lease {
        token: crate::OwnerToken::new(),
        ..lease.clone()
    };
    assert!(matches!(
        complete(h, &forged, &response(200, b"x")).await,
        Completion::Fenced(_)
    ));
    assert!(matches!(release(h, &forged).await, Release::Fenced(_)));
    assert!(matches!(renew(h, &forged).await, Renewal::Fenced(_)));
    recorded(h, &lease, &response(200, b"x")).await;
}

/// Release frees the key (any fingerprint); the next attempt gets the next
/// generation and the released attempt stays in the history.
pub async fn release_frees_key<H: Harness>(h: &H) {
    let scope = fresh_scope("release");
    let first = acquire(h, &scope, 1).await;
    assert_eq!(release(h, &first).await, Release::Released);
    let record = get(h, scope.hash()).await.expect("record kept");
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts[0].outcome, AttemptOutcome::Released);
    let second = acquire(h, &scope, 2).await;
    assert_eq!(second.generation, 2);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.fingerprint, fingerprint(2));
    assert_eq!(record.attempts.len(), 2);
    // The released attempt can write nothing any more.
    assert!(matches!(
        complete(h, &first, &response(200, b"late")).await,
        Completion::Fenced(_)
    ));
}

/// Releases `lease` of a record bound to its request (fingerprint 1) by
/// an earlier takeover of `first`: a changed request then conflicts, and
/// the same request takes the record over, told of `first` as the
/// attempt of unknown outcome. Answers the new lease.
async fn release_and_take_over_again<H: Harness>(
    h: &H,
    scope: &Scope,
    lease: &crate::Lease,
    first: &crate::Lease,
) -> crate::Lease {
    assert_eq!(release(h, lease).await, Release::Released);
    assert_eq!(reserve(h, scope, 2).await, Reservation::Conflict);
    match reserve(h, scope, 1).await {
        Reservation::TakenOver { lease, superseded } => {
            // The attempt of unknown outcome, not the released one.
            assert_eq!(superseded.id, first.attempt);
            assert_eq!(superseded.outcome, AttemptOutcome::Superseded);
            lease
        }
        other => panic!("the same request takes over: {other:?}"),
    }
}

/// A release after a takeover frees the key for the same request only:
/// the attempt the takeover superseded may have acted, so a changed
/// request conflicts. The record stays processing with its lease lapsed
/// and no owner; the same request takes it over at once (generation + 1),
/// a retried release of that lease is answered as released, and the
/// binding holds through later releases of the chain.
pub async fn a_release_after_a_takeover_keeps_the_payload<H: Harness>(h: &H) {
    let scope = fresh_scope("takeover-release");
    let (first, second) = lapsed_and_taken_over(h, &scope).await;
    assert_eq!(release(h, &second).await, Release::Released);
    // Its reply lost, the release is sent again: still released.
    assert_eq!(release(h, &second).await, Release::Released);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.state, RecordState::Processing);
    assert_eq!(record.owner, None);
    assert_eq!(record.fingerprint, fingerprint(1));
    assert_eq!(record.attempts[0].id, first.attempt);
    assert_eq!(record.attempts[0].outcome, AttemptOutcome::Superseded);
    assert_eq!(record.attempts[1].outcome, AttemptOutcome::Released);
    assert_eq!(record.attempts[1].late, None);
    assert_eq!(reserve(h, &scope, 2).await, Reservation::Conflict);
    let third = match reserve(h, &scope, 1).await {
        Reservation::TakenOver { lease, superseded } => {
            // The attempt of unknown outcome, not the released one.
            assert_eq!(superseded.id, first.attempt);
            assert_eq!(superseded.outcome, AttemptOutcome::Superseded);
            lease
        }
        other => panic!("the same request takes over: {other:?}"),
    };
    assert_eq!(third.generation, 3);
    // Later in the chain, the binding holds.
    let fourth = release_and_take_over_again(h, &scope, &third, &first).await;
    let outcome = response(201, b"{\"order\":4}");
    recorded(h, &fourth, &outcome).await;
    match reserve(h, &scope, 1).await {
        Reservation::Completed(replay) => assert_eq!(replay.outcome, outcome),
        other => panic!("expected Completed, got {other:?}"),
    }
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.generation, 4);
    assert_eq!(record.attempts[1].outcome, AttemptOutcome::Released);
    assert_eq!(record.attempts[2].outcome, AttemptOutcome::Released);
}

/// A duplicate waiting on a record is not left waiting when a release
/// after a takeover frees the key (the record stays processing, held by
/// nobody, for the same request to take over): whether it began waiting
/// before the release or after, its wait ends long before its bound.
pub async fn a_release_after_a_takeover_ends_waits<H: Harness>(h: &H) {
    let scope = fresh_scope("takeover-release-wait");
    let (_, second) = lapsed_and_taken_over(h, &scope).await;
    let bound = Duration::from_secs(60);
    let prompt = Duration::from_secs(10);
    let waited = async {
        let started = tokio::time::Instant::now();
        h.store().changed(scope.hash(), bound).await;
        started.elapsed()
    };
    let (waited, released) = tokio::join!(waited, release(h, &second));
    assert_eq!(released, Release::Released);
    assert!(
        waited < prompt,
        "a waiter slept {waited:?} past the release"
    );
    let started = tokio::time::Instant::now();
    h.store().changed(scope.hash(), bound).await;
    let waited = started.elapsed();
    assert!(
        waited < prompt,
        "a waiter after the release slept {waited:?}"
    );
    let Reservation::TakenOver { lease, .. } = reserve(h, &scope, 1).await else {
        panic!("the same request takes over");
    };
    assert_eq!(lease.generation, 3);
}

/// A completion or a release sent again by its own lease after the first
/// was applied (its reply was lost to a timeout, and the layer retries it)
/// is answered as the first was, and keeps no late evidence against its
/// own attempt.
pub async fn a_write_whose_reply_was_lost_is_answered_again<H: Harness>(h: &H) {
    let scope = fresh_scope("lost-reply-complete");
    let lease = acquire(h, &scope, 1).await;
    let outcome = response(201, b"{\"order\":1}");
    recorded(h, &lease, &outcome).await;
    assert_eq!(complete(h, &lease, &outcome).await, Completion::Recorded);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.outcome, Some(outcome));
    assert_eq!(record.attempts[0].late, None);

    let scope = fresh_scope("lost-reply-release");
    let lease = acquire(h, &scope, 1).await;
    assert_eq!(release(h, &lease).await, Release::Released);
    assert_eq!(release(h, &lease).await, Release::Released);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts[0].late, None);
    // A newer attempt's record is not this lease's write: still fenced.
    let second = acquire(h, &scope, 1).await;
    assert!(matches!(
        complete(h, &lease, &response(200, b"late")).await,
        Completion::Fenced(_)
    ));
    assert_eq!(release(h, &second).await, Release::Released);
    assert!(matches!(release(h, &lease).await, Release::Fenced(_)));
}

/// Cancel while processing: 410 afterwards, the running attempt's
/// completion fenced and kept as late evidence.
pub async fn cancel_processing_fences_completion<H: Harness>(h: &H) {
    let scope = fresh_scope("cancel");
    let lease = acquire(h, &scope, 1).await;
    match cancel(h, scope.hash()).await {
        Cancellation::Cancelled(record) => {
            assert_eq!(record.state, RecordState::Cancelled);
            assert_eq!(record.attempts[0].outcome, AttemptOutcome::Cancelled);
        }
        other => panic!("expected Cancelled, got {other:?}"),
    }
    assert_eq!(
        complete(h, &lease, &response(201, b"done")).await,
        Completion::Fenced(Current::Cancelled)
    );
    assert!(matches!(
        renew(h, &lease).await,
        Renewal::Fenced(Current::Cancelled)
    ));
    assert_eq!(reserve(h, &scope, 1).await, Reservation::Cancelled);
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.state, RecordState::Cancelled);
    assert_eq!(record.outcome, None);
    assert!(matches!(
        record.attempts[0].late,
        Some(LateEvidence::Completed { status: 201, .. })
    ));
    assert!(matches!(
        cancel(h, scope.hash()).await,
        Cancellation::AlreadyCancelled(_)
    ));
}

/// Completion before cancel: the cancel reports that completion won.
pub async fn cancel_after_completion_reports_outcome<H: Harness>(h: &H) {
    let scope = fresh_scope("cancel-late");
    let lease = acquire(h, &scope, 1).await;
    let outcome = response(201, b"created");
    recorded(h, &lease, &outcome).await;
    match cancel(h, scope.hash()).await {
        Cancellation::AlreadyCompleted(record) => {
            assert_eq!(record.state, RecordState::Completed);
            assert_eq!(record.outcome, Some(outcome.clone()));
        }
        other => panic!("expected AlreadyCompleted, got {other:?}"),
    }
    expect_reservation!(h, &scope, 1, Reservation::Completed(_));
}

/// Cancel of an absent scope is not found and creates nothing.
pub async fn cancel_absent_is_not_found<H: Harness>(h: &H) {
    let scope = fresh_scope("nothing");
    assert_eq!(cancel(h, scope.hash()).await, Cancellation::NotFound);
    assert_eq!(get(h, scope.hash()).await, None);
    expect_reservation!(h, &scope, 1, Reservation::Acquired(_));
}

/// A released record is vacant: cancel finds nothing, and the key stays
/// free for the next request.
pub async fn cancel_released_is_not_found<H: Harness>(h: &H) {
    let scope = fresh_scope("released-cancel");
    let lease = acquire(h, &scope, 1).await;
    assert_eq!(release(h, &lease).await, Release::Released);
    assert_eq!(cancel(h, scope.hash()).await, Cancellation::NotFound);
    expect_reservation!(h, &scope, 2, Reservation::Acquired(_));
}

/// After the retention window the key is new again.
pub async fn expiry_after_retention<H: Harness>(h: &H) {
    let scope = fresh_scope("expire");
    let lease = acquire(h, &scope, 1).await;
    recorded(h, &lease, &response(200, b"old")).await;
    h.advance(h.retention() / 2).await;
    expect_reservation!(h, &scope, 1, Reservation::Completed(_));
    h.advance(h.retention() / 2 + Duration::from_millis(300))
        .await;
    assert_eq!(get(h, scope.hash()).await, None);
    let lease = acquire(h, &scope, 2).await;
    assert_eq!(lease.generation, 1, "an expired record is forgotten");
}

/// The attempt history keeps the newest [`ATTEMPT_HISTORY`] attempts.
pub async fn attempt_history_is_bounded<H: Harness>(h: &H) {
    let scope = fresh_scope("history");
    let mut last = None;
    for _ in 0..ATTEMPT_HISTORY + 3 {
        let lease = acquire(h, &scope, 1).await;
        assert_eq!(release(h, &lease).await, Release::Released);
        last = Some(lease);
    }
    let last = last.expect("at least one attempt");
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.attempts.len(), ATTEMPT_HISTORY);
    assert_eq!(record.generation, (ATTEMPT_HISTORY + 3) as u64);
    assert_eq!(record.attempts.last().map(|a| a.id), Some(last.attempt));
    assert_eq!(record.attempts[0].generation, 4);
}

/// The binding of a key to its request after a takeover outlasts the
/// attempt history: however many attempts of the same request fail and
/// release after it, the attempt of unknown outcome stays in the history
/// and a changed request still conflicts.
pub async fn the_binding_outlasts_the_attempt_history<H: Harness>(h: &H) {
    let scope = fresh_scope("long-chain");
    let (first, mut lease) = lapsed_and_taken_over(h, &scope).await;
    for _ in 0..ATTEMPT_HISTORY + 2 {
        lease = release_and_take_over_again(h, &scope, &lease, &first).await;
    }
    let record = get(h, scope.hash()).await.expect("record");
    assert_eq!(record.generation, (ATTEMPT_HISTORY + 4) as u64);
    assert_eq!(record.attempts.len(), ATTEMPT_HISTORY);
    assert_eq!(record.attempts[0].id, first.attempt);
    assert_eq!(record.attempts[0].outcome, AttemptOutcome::Superseded);
    assert_eq!(record.attempts[1].outcome, AttemptOutcome::Released);
    assert_eq!(record.attempts.last().map(|a| a.id), Some(lease.attempt));
}

/// Two tenants with the same key and operation never see each other.
pub async fn tenants_are_isolated<H: Harness>(h: &H) {
    let a = fresh_scope("shared-key");
    let b = fresh_scope("shared-key");
    let lease = acquire(h, &a, 1).await;
    recorded(h, &lease, &response(201, b"a")).await;
    expect_reservation!(h, &b, 2, Reservation::Acquired(_));
}

/// Many concurrent reservations of one scope: exactly one acquires.
pub async fn concurrent_reserve_acquires_once<H: Harness>(h: Arc<H>) {
    let scope = fresh_scope("race");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let h = Arc::clone(&h);
        let request = request(&*h, &scope, 1);
        tasks.push(tokio::spawn(async move {
            h.store().reserve(&request).await.expect("reserve")
        }));
    }
    let mut acquired = 0;
    for task in tasks {
        match task.await.expect("task") {
            Reservation::Acquired(_) => acquired += 1,
            Reservation::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

/// An operator frees a stuck key: the processing record is released (the
/// attempt kept as released by an operator), its owner's writes are
/// fenced, and the next request runs as a new attempt. A completed record
/// is left alone.
pub async fn force_release_frees_a_stuck_key<H: Harness>(h: &H)
where
    H::Store: RecordsAdmin,
{
    let scope = fresh_scope("stuck");
    let lease = acquire(h, &scope, 1).await;
    let released = h.store().force_release(scope.hash()).await.expect("force");
    let ForceRelease::Released(record) = released else {
        panic!("expected Released, got {released:?}");
    };
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(
        record.attempts[0].outcome,
        AttemptOutcome::ReleasedByOperator
    );
    assert!(matches!(
        complete(h, &lease, &response(201, b"late")).await,
        Completion::Fenced(Current::Vacant)
    ));
    let next = acquire(h, &scope, 1).await;
    assert_eq!(next.generation, 2);
    let _ = h
        .store()
        .complete(&next, &response(201, b"ok"))
        .await
        .expect("complete");
    assert!(matches!(
        h.store().force_release(scope.hash()).await.expect("force"),
        ForceRelease::NotProcessing(_)
    ));
    assert_eq!(
        h.store()
            .force_release(fresh_scope("none").hash())
            .await
            .expect("force"),
        ForceRelease::NotFound
    );
}

/// A force release of a record a release after a takeover left processing
/// (held by nobody) releases the record and keeps the released attempt's
/// own outcome: the operator ended no attempt. (Found by the differential
/// check on a Redis Cluster, seed 5008.)
pub async fn a_force_release_keeps_an_ended_attempts_outcome<H: Harness>(h: &H)
where
    H::Store: RecordsAdmin,
{
    let scope = fresh_scope("force-after-release");
    let (first, second) = lapsed_and_taken_over(h, &scope).await;
    assert_eq!(release(h, &second).await, Release::Released);
    let released = h.store().force_release(scope.hash()).await.expect("force");
    let ForceRelease::Released(record) = released else {
        panic!("expected Released, got {released:?}");
    };
    assert_eq!(record.state, RecordState::Released);
    let outcomes: Vec<_> = record.attempts.iter().map(|a| (a.id, a.outcome)).collect();
    assert_eq!(
        outcomes,
        [
            (first.attempt, AttemptOutcome::Superseded),
            (second.attempt, AttemptOutcome::Released)
        ]
    );
    let read = get(h, scope.hash()).await.expect("record");
    assert_eq!(read.attempts[1].outcome, AttemptOutcome::Released);
}

/// An operator erases a finished record: it is gone, and its key is new
/// (the next request runs as a first attempt, under any payload). A
/// processing record is left as it is, its owner's lease intact.
pub async fn erase_frees_a_finished_key_and_leaves_a_processing_one<H: Harness>(h: &H)
where
    H::Store: RecordsAdmin,
{
    let scope = fresh_scope("erased");
    let lease = acquire(h, &scope, 1).await;
    let kept = h.store().erase(scope.hash()).await.expect("erase");
    let Erasure::Processing(record) = kept else {
        panic!("expected Processing, got {kept:?}");
    };
    assert_eq!(record.state, RecordState::Processing);
    // The owner still holds its lease: its completion is recorded.
    assert_eq!(
        complete(h, &lease, &response(201, b"stored")).await,
        Completion::Recorded
    );
    let erased = h.store().erase(scope.hash()).await.expect("erase");
    let Erasure::Erased(record) = erased else {
        panic!("expected Erased, got {erased:?}");
    };
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.key, scope.key().shared().clone());
    assert!(h.store().get(scope.hash()).await.expect("get").is_none());
    // The key is new: another payload is no conflict, and it runs as a
    // first attempt.
    let other = request(h, &scope, 9);
    let Reservation::Acquired(again) = h.store().reserve(&other).await.expect("reserve") else {
        panic!("an erased key is new");
    };
    assert_eq!(again.generation, 1);
    assert_eq!(
        h.store()
            .erase(fresh_scope("none").hash())
            .await
            .expect("erase"),
        Erasure::NotFound
    );
}

/// Listing finds a tenant's records by state and lapsed lease, oldest
/// first, and never another tenant's.
pub async fn list_finds_a_tenants_records<H: Harness>(h: &H)
where
    H::Store: RecordsAdmin,
{
    let tenant = format!("conformance-{}", uuid::Uuid::new_v4());
    let scope = |key: &str| {
        Scope::new(
            tenant.clone(),
            "POST /orders",
            IdempotencyKey::parse(key.as_bytes()).expect("key"),
        )
    };
    let (first, second, done) = (scope("first"), scope("second"), scope("done"));
    let _ = acquire(h, &first, 1).await;
    h.advance(Duration::from_millis(20)).await;
    let _ = acquire(h, &second, 1).await;
    let lease = acquire(h, &done, 1).await;
    let _ = h
        .store()
        .complete(&lease, &response(201, b"ok"))
        .await
        .expect("complete");
    let _ = acquire(h, &fresh_scope("elsewhere"), 1).await;
    let query = |state, lapsed| RecordQuery {
        tenant: Some(tenant.clone()),
        state,
        older_than: None,
        lapsed,
        limit: 100,
        after: None,
    };
    let all = h.store().list(&query(None, false)).await.expect("list");
    assert_eq!(all.len(), 3, "{all:?}");
    assert!(all.iter().all(|r| *r.tenant == *tenant));
    let processing = h
        .store()
        .list(&query(Some(RecordState::Processing), false))
        .await
        .expect("list");
    let keys: Vec<&str> = processing.iter().map(|r| &*r.key).collect();
    assert_eq!(keys, ["first", "second"], "oldest first");
    assert!(
        h.store()
            .list(&query(None, true))
            .await
            .expect("list")
            .is_empty()
    );
    h.advance(h.lease() + Duration::from_millis(50)).await;
    let stuck = h.store().list(&query(None, true)).await.expect("list");
    assert_eq!(stuck.len(), 2, "{stuck:?}");
    // The store-wide count takes them in (other checks sharing the store
    // may add lapsed records of their own), up to its limit.
    let counted = h.store().count_lapsed(10_000).await.expect("count");
    assert!(counted >= 2, "counted {counted} lapsed records");
    assert_eq!(h.store().count_lapsed(1).await.expect("count"), 1);
    let limited = RecordQuery {
        limit: 1,
        ..query(None, false)
    };
    let oldest = h.store().list(&limited).await.expect("list");
    let keys: Vec<&str> = oldest.iter().map(|r| &*r.key).collect();
    assert_eq!(keys, ["first"], "the limit keeps the oldest");
    let two_processing = RecordQuery {
        limit: 2,
        ..query(Some(RecordState::Processing), false)
    };
    let keys: Vec<String> = h
        .store()
        .list(&two_processing)
        .await
        .expect("list")
        .into_iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(keys, ["first", "second"]);
    // Page by page after a cursor: every record once, in the listing's
    // order, however the pages fall.
    let mut after = None;
    let mut paged = Vec::new();
    loop {
        let page = h
            .store()
            .list(&RecordQuery {
                limit: 1,
                after: after.take(),
                ..query(None, false)
            })
            .await
            .expect("list a page");
        let Some(last) = page.last() else { break };
        after = Some(crate::RecordCursor::after(last));
        paged.extend(page.iter().map(|r| r.key.to_string()));
    }
    let whole: Vec<String> = all.iter().map(|r| r.key.to_string()).collect();
    assert_eq!(paged, whole);
}

/// A tenant may hold any character, NUL included (the layer's anonymous
/// tenant starts with one, so no header value can name it): it is stored,
/// replayed and read back as it is, on every store.
pub async fn any_tenant_text_is_stored<H: Harness>(h: &H) {
    stores_any_tenant_text(h).await;
}

/// [`any_tenant_text_is_stored`], and such a tenant's records are listed
/// as they are.
pub async fn any_tenant_text_is_listed<H: Harness>(h: &H)
where
    H::Store: RecordsAdmin,
{
    for tenant in stores_any_tenant_text(h).await {
        let listed = h
            .store()
            .list(&RecordQuery {
                tenant: Some(tenant.clone()),
                state: None,
                older_than: None,
                lapsed: false,
                limit: 10,
                after: None,
            })
            .await
            .expect("list");
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(*listed[0].tenant, *tenant);
    }
}

/// Records a replayable outcome under tenants of any text, checks each
/// replays and reads back whole, and answers the tenants.
async fn stores_any_tenant_text<H: Harness>(h: &H) -> [String; 2] {
    let id = uuid::Uuid::new_v4();
    let tenants = [format!("\0anonymous-{id}"), format!("%00%25\0\\{id}")];
    for tenant in &tenants {
        let scope = Scope::new(
            tenant.clone(),
            "POST /orders",
            IdempotencyKey::parse(b"any-tenant").expect("key"),
        );
        let lease = acquire(h, &scope, 1).await;
        let outcome = response(201, b"anonymous");
        recorded(h, &lease, &outcome).await;
        match reserve(h, &scope, 1).await {
            Reservation::Completed(replay) => assert_eq!(replay.outcome, outcome),
            other => panic!("expected Completed, got {other:?}"),
        }
        let record = get(h, scope.hash()).await.expect("record");
        assert_eq!(*record.tenant, *tenant);
    }
    tenants
}

/// Runs every check in turn on one harness, records administration
/// included (for stores that are costly to set up, like a cluster). Use a
/// multi-thread runtime.
pub async fn run_all<H: Harness>(harness: Arc<H>)
where
    H::Store: RecordsAdmin,
{
    let h = &*harness;
    reserve_new_acquires(h).await;
    completed_replays_exact_response(h).await;
    not_stored_outcome_is_kept(h).await;
    conflict_leaves_record_untouched(h).await;
    in_progress_while_lease_live(h).await;
    renew_extends_lease(h).await;
    renewal_outlives_retention(h).await;
    takeover_after_lease_expiry(h).await;
    an_unknown_outcome_is_kept(h).await;
    superseded_writes_are_fenced(h).await;
    wrong_token_is_fenced(h).await;
    release_frees_key(h).await;
    a_write_whose_reply_was_lost_is_answered_again(h).await;
    a_release_after_a_takeover_keeps_the_payload(h).await;
    a_release_after_a_takeover_ends_waits(h).await;
    cancel_processing_fences_completion(h).await;
    cancel_after_completion_reports_outcome(h).await;
    cancel_absent_is_not_found(h).await;
    cancel_released_is_not_found(h).await;
    expiry_after_retention(h).await;
    attempt_history_is_bounded(h).await;
    the_binding_outlasts_the_attempt_history(h).await;
    tenants_are_isolated(h).await;
    force_release_frees_a_stuck_key(h).await;
    a_force_release_keeps_an_ended_attempts_outcome(h).await;
    erase_frees_a_finished_key_and_leaves_a_processing_one(h).await;
    list_finds_a_tenants_records(h).await;
    any_tenant_text_is_stored(h).await;
    any_tenant_text_is_listed(h).await;
    concurrent_reserve_acquires_once(Arc::clone(&harness)).await;
}

/// Expands to one `#[tokio::test]` per conformance check.
///
/// The argument is a closure returning a future of `Option<Harness>`;
/// `None` ends the test early (a store whose server is not installed on a
/// developer's machine, say, after printing a notice). The checks of
/// [`Store`] always; with `records_admin` after the closure, those of
/// [`RecordsAdmin`] too (listings, counts, force release).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr, records_admin) => {
        $crate::conformance_tests!($make);
        $crate::conformance_tests!(@each $make;
            force_release_frees_a_stuck_key,
            a_force_release_keeps_an_ended_attempts_outcome,
            erase_frees_a_finished_key_and_leaves_a_processing_one,
            list_finds_a_tenants_records,
            any_tenant_text_is_listed
        );
    };
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            reserve_new_acquires,
            completed_replays_exact_response,
            not_stored_outcome_is_kept,
            conflict_leaves_record_untouched,
            in_progress_while_lease_live,
            renew_extends_lease,
            renewal_outlives_retention,
            takeover_after_lease_expiry,
            an_unknown_outcome_is_kept,
            superseded_writes_are_fenced,
            wrong_token_is_fenced,
            release_frees_key,
            a_write_whose_reply_was_lost_is_answered_again,
            a_release_after_a_takeover_keeps_the_payload,
            a_release_after_a_takeover_ends_waits,
            cancel_processing_fences_completion,
            cancel_after_completion_reports_outcome,
            cancel_absent_is_not_found,
            cancel_released_is_not_found,
            expiry_after_retention,
            attempt_history_is_bounded,
            the_binding_outlasts_the_attempt_history,
            tenants_are_isolated,
            any_tenant_text_is_stored
        );
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn concurrent_reserve_acquires_once() {
            let Some(harness) = ($make)().await else { return };
            $crate::conformance::concurrent_reserve_acquires_once(::std::sync::Arc::new(harness)).await;
        }
    };
    (@each $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                let Some(harness) = ($make)().await else { return };
                $crate::conformance::$name(&harness).await;
            }
        )*
    };
}
