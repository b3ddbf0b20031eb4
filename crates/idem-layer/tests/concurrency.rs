//! Concurrent duplicates, client disconnects and cancellation races.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use idem_layer::{InFlight, OnDisconnect};
use idem_memory::MemoryStore;
use tower::ServiceExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_duplicates_execute_once_reject_mode() {
    let (_store, probe, svc) = fresh();
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..100 {
        let answers = answers.clone();
        // A combinator rather than an async block: the compiler proves the
        // layer's future `Send` here without higher-ranked trouble.
        let reply =
            futures_util::FutureExt::map(send(&svc, keyed("/slow", "same")), move |answer| {
                let _ = answers.send(answer.status);
            });
        tokio::spawn(reply);
    }
    // While the one execution is held, all 99 duplicates are answered 409.
    for _ in 0..99 {
        assert_eq!(answered.recv().await, Some(StatusCode::CONFLICT));
    }
    assert_eq!(probe.calls(), 1);
    probe.open_gate(1);
    assert_eq!(answered.recv().await, Some(StatusCode::CREATED));
    assert_eq!(probe.calls(), 1, "the handler ran exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_duplicates_execute_once_wait_mode() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store).timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(10))));
    let svc = service(&layer, &probe);
    let tasks: Vec<_> = (0..100)
        .map(|_| tokio::spawn(send(&svc, keyed("/slow", "same"))))
        .collect();
    wait_calls(&probe, 1).await;
    // Every duplicate is waiting for the outcome before it exists, so the
    // replays below come from waiting, not from arriving late.
    wait_until(
        Duration::from_secs(10),
        "99 waiting duplicates",
        async || layer.duplicates_waiting() >= 99,
    )
    .await;
    // They share one wait on the store (single flight).
    assert_eq!(store.waiting(), 1);
    assert_eq!(probe.calls(), 1);
    probe.open_gate(1);
    let mut bodies = Vec::new();
    let mut replayed = 0;
    for task in tasks {
        let answer = task.await.expect("join");
        assert_eq!(answer.status, StatusCode::CREATED);
        replayed += usize::from(answer.replayed());
        bodies.push(answer.body);
    }
    assert_eq!(probe.calls(), 1, "the handler ran exactly once");
    assert_eq!(replayed, 99, "every waiter got the replay");
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "every answer has the same bytes"
    );
}

/// Layers cloned from one base and set up apart keep their own settings
/// for duplicates in flight: a refusing layer answers a duplicate `409`
/// at once even while a waiting layer's duplicate of the same key waits
/// (they shared their reservations in flight, and the refusing layer's
/// request waited on the other's for as long as it took).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clones_set_up_apart_answer_duplicates_by_their_own_settings() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let base = layer(&store);
    let waiting = base
        .clone()
        .timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(30))));
    let refusing = base.clone().timing(|t| t.in_flight(InFlight::Reject));
    let (waits, refuses) = (service(&waiting, &probe), service(&refusing, &probe));
    let first = tokio::spawn(send(&waits, keyed("/slow", "apart")));
    wait_calls(&probe, 1).await;
    let duplicate = tokio::spawn(send(&waits, keyed("/slow", "apart")));
    wait_until(
        Duration::from_secs(10),
        "the waiting layer's duplicate waits",
        async || waiting.duplicates_waiting() >= 1,
    )
    .await;
    // The handler is still held: a refusal now is a refusal at once.
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        send(&refuses, keyed("/slow", "apart")),
    )
    .await
    .expect("the refusing layer answers while the attempt runs");
    refused.assert_problem(StatusCode::CONFLICT, "idempotency_in_progress");
    probe.open_gate(1);
    assert_eq!(first.await.expect("join").status, StatusCode::CREATED);
    let duplicate = duplicate.await.expect("join");
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(probe.calls(), 1, "the handler ran exactly once");
}

#[tokio::test(start_paused = true)]
async fn wait_mode_gives_409_when_the_bound_passes() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store).timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(2))));
    let svc = service(&layer, &probe);
    let first = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;
    let started = tokio::time::Instant::now();
    let waited = send(&svc, keyed("/slow", "k")).await;
    assert_eq!(waited.code().as_deref(), Some("idempotency_in_progress"));
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
    probe.open_gate(1);
    first.await.expect("join").expect("response");
    assert_eq!(probe.calls(), 1);
}

/// The client of a `/slow` request goes away while its handler runs; the
/// handler is let finish and the request retried until it is no longer in
/// progress: that retry.
async fn retry_after_a_disconnect<S, B>(svc: &S, probe: &Probe) -> Answer
where
    S: tower::Service<
            http::Request<http_body_util::Full<bytes::Bytes>>,
            Response = http::Response<B>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Debug + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let client = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(probe, 1).await;
    client.abort(); // the client disconnects
    assert!(client.await.is_err_and(|e| e.is_cancelled()));
    probe.open_gate(1);
    poll_until(
        Duration::from_secs(10),
        async || send(svc, keyed("/slow", "k")).await,
        |answer| answer.status != StatusCode::CONFLICT,
    )
    .await
}

/// The lost-acknowledgement case: the client goes away mid-handler, the
/// handler runs to completion in a task of its own, and the retry is a
/// replay.
#[tokio::test]
async fn disconnect_in_detach_mode_records_the_outcome() {
    let (_store, probe, svc) = fresh();
    let retry = retry_after_a_disconnect(&svc, &probe).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, "{\"order\":1}");
    assert_eq!(probe.calls(), 1, "the retry was replayed, not re-executed");
}

/// A duplicate whose client goes away while it waits for the running
/// attempt started none of its own: it is dropped, and nothing of it runs
/// on in a task (it would hold its wait, and run the handler if the key
/// were released).
#[tokio::test]
async fn a_waiter_whose_client_went_away_is_dropped() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store).timing(|t| t.in_flight(InFlight::Wait(Duration::from_secs(30))));
    let svc = service(&layer, &probe);
    let first = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;
    let waiter = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_until(Duration::from_secs(10), "the duplicate waits", async || {
        store.waiting() == 1
    })
    .await;
    waiter.abort();
    assert!(waiter.await.is_err_and(|e| e.is_cancelled()));
    assert_eq!(store.waiting(), 0, "the dropped duplicate waits no more");
    probe.open_gate(1);
    let first = first.await.expect("join").expect("response");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(probe.calls(), 1);
}

/// Two layers, one in front of the other (two stores): when the client
/// goes away mid-handler, both attempts run on and both record the
/// outcome, so a retry through the front layer is a replay. Each layer's
/// response future keeps its own mark of a started attempt.
#[tokio::test]
async fn stacked_layers_both_record_the_outcome_when_the_client_goes_away() {
    let (back_store, front_store) = (MemoryStore::new(), MemoryStore::new());
    let probe = Probe::default();
    let back = service(&layer(&back_store), &probe);
    let front = tower::Layer::layer(&layer(&front_store), back.clone());
    let retry = retry_after_a_disconnect(&front, &probe).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the front layer recorded the outcome");
    assert_eq!(retry.body, "{\"order\":1}");
    let behind = send(&back, keyed("/slow", "k")).await;
    assert!(behind.replayed(), "the back layer recorded it too");
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn disconnect_in_release_mode_drops_the_handler_and_frees_the_key() {
    let (_store, probe, svc) =
        fresh_with(|layer| layer.timing(|t| t.on_disconnect(OnDisconnect::Release)));
    let client = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;
    client.abort();
    assert!(client.await.is_err_and(|e| e.is_cancelled()));
    // The release runs in a task of its own; wait for the key to be free.
    probe.open_gate(1);
    let retry = poll_until(
        Duration::from_secs(10),
        async || {
            probe.open_gate(1);
            send(&svc, keyed("/slow", "k")).await
        },
        |answer| answer.status != StatusCode::CONFLICT,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        !retry.replayed(),
        "the key was released, so the retry executes"
    );
    assert_eq!(probe.calls(), 2);
    assert_eq!(probe.finished(), 1, "the dropped handler never finished");
}

/// Completion first, then cancel: the cancel reports that completion won
/// and the retry replays.
#[tokio::test]
async fn cancel_after_completion_reports_the_completed_outcome() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store);
    let svc = service(&layer, &probe);
    let first = send(&svc, keyed("/orders", "k")).await;
    let records = layer.records_service();
    let cancel = records_call(
        &records,
        http::Method::DELETE,
        "/records?method=POST&path=/orders&key=k",
    )
    .await;
    assert_eq!(cancel.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&cancel.body).expect("json");
    assert_eq!(json["result"], "already_completed");
    assert_eq!(json["record"]["state"], "completed");
    assert_eq!(json["record"]["status"], 201);
    let retry = send(&svc, keyed("/orders", "k")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.calls(), 1);
}

/// Cancel and completion racing on many keys at once: for each key exactly
/// one side wins, and the record, the cancel answer and the retry agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_racing_completion_always_agrees() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store);
    let svc = service(&layer, &probe);
    let records = layer.records_service();
    let mut races = Vec::new();
    for i in 0..50 {
        let key = format!("race-{i}");
        let path = format!("/sleep/{}", i % 3);
        let own = tokio::spawn(send(&svc, post(&path).key(&key).tenant("t1").build()));
        // Give the request a head start of varying length.
        tokio::time::sleep(std::time::Duration::from_micros(700 * (i % 4))).await;
        let uri = format!("/records?method=POST&path={path}&key={key}");
        let cancel = records_call(&records, http::Method::DELETE, &uri).await;
        let own = own.await.expect("join");
        let retry = send(&svc, post(&path).key(&key).tenant("t1").build()).await;
        races.push((cancel, own, retry));
    }
    let (mut cancelled, mut completed) = (0, 0);
    for (cancel, own, retry) in races {
        let result = if cancel.status == StatusCode::NOT_FOUND {
            // cancel ran before the reservation: nothing to cancel
            "not_found".to_owned()
        } else {
            let json: serde_json::Value = serde_json::from_slice(&cancel.body).expect("json");
            json["result"].as_str().expect("result").to_owned()
        };
        match result.as_str() {
            "cancelled" => {
                cancelled += 1;
                assert_eq!(own.status, StatusCode::GONE);
                assert_eq!(retry.status, StatusCode::GONE);
            }
            "already_completed" | "not_found" => {
                completed += 1;
                assert_eq!(own.status, StatusCode::CREATED);
                assert_eq!(retry.status, StatusCode::CREATED);
                assert!(retry.replayed());
                assert_eq!(retry.body, own.body);
            }
            other => panic!("unexpected cancel result {other}"),
        }
    }
    eprintln!("cancelled {cancelled}, completed {completed}");
    assert_eq!(cancelled + completed, 50);
    assert_eq!(
        probe.calls(),
        50,
        "every key ran once: no retry executed, whichever side won"
    );
}

/// Both sides of the race, each forced to win once: a cancel while the
/// handler is held wins (the handler's completion is fenced, its client and
/// the retry get 410); a cancel after completion loses (it reports the
/// outcome, the retry replays). The agreement checks of the random race run
/// on both outcomes for certain.
#[tokio::test]
async fn cancel_and_completion_each_win_when_first() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store);
    let svc = service(&layer, &probe);
    let records = layer.records_service();
    let cancel = |key: &str| {
        let uri = format!("/records?method=POST&path=/slow&key={key}");
        send(
            &records,
            method(http::Method::DELETE, &uri).tenant("t1").build(),
        )
    };
    let result = |answer: &Answer| {
        let json: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
        json["result"].as_str().expect("result").to_owned()
    };
    // Cancel first.
    let own = tokio::spawn(send(&svc, keyed("/slow", "first")));
    wait_calls(&probe, 1).await;
    assert_eq!(result(&cancel("first").await), "cancelled");
    probe.open_gate(1);
    assert_eq!(own.await.expect("join").status, StatusCode::GONE);
    let retry = send(&svc, keyed("/slow", "first")).await;
    assert_eq!(retry.status, StatusCode::GONE);
    // Completion first.
    probe.open_gate(1);
    let own = send(&svc, keyed("/slow", "second")).await;
    assert_eq!(own.status, StatusCode::CREATED);
    assert_eq!(result(&cancel("second").await), "already_completed");
    let retry = send(&svc, keyed("/slow", "second")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, own.body);
    assert_eq!(probe.calls(), 2);
}
