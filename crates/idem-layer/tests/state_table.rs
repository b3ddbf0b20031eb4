//! Every row of the contract's state table (section 3) and outcome table
//! (section 4), through the layer with `oneshot`.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use idem_core::{Reservation, ReserveRequest, Scope, Store};
use idem_layer::{IdempotencyLayer, settings::Timing};
use idem_memory::MemoryStore;
use tower::{Layer, Service, ServiceExt};

#[tokio::test]
async fn absent_executes_and_completed_replays_exact_bytes() {
    let (_store, probe, svc) = fresh();

    let first = send(&svc, order("k1", r#"{"item":"book","qty":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(
        first.header("set-cookie"),
        Some("session=1"),
        "the first caller gets every header"
    );

    let second = send(&svc, order("k1", r#"{"item":"book","qty":1}"#)).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(second.body, first.body, "replayed bytes are identical");
    assert_eq!(second.header("location"), Some("/orders/1"));
    assert_eq!(second.content_type(), Some("application/json"));
    assert_eq!(second.header("x-echo-len"), first.header("x-echo-len"));
    assert_eq!(
        second.header("set-cookie"),
        None,
        "Set-Cookie is not replayed"
    );
    assert_eq!(second.header("date"), None, "Date is not replayed");
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn different_payload_is_a_conflict_in_every_state() {
    let (_store, probe, svc) = fresh();

    // completed
    assert_eq!(
        send(&svc, order("k", r#"{"qty":1}"#)).await.status,
        StatusCode::CREATED
    );
    let conflict = send(&svc, order("k", r#"{"qty":2}"#)).await;
    conflict.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_conflict");
    assert_eq!(conflict.content_type(), Some("application/problem+json"));
    // the conflict changed nothing: the original still replays
    let replay = send(&svc, order("k", r#"{"qty":1}"#)).await;
    assert!(replay.replayed());
    assert_eq!(probe.calls(), 1);

    // processing
    let slow = svc.clone().oneshot(keyed_json("/slow", "s", "t1", "{}"));
    let slow = tokio::spawn(slow);
    wait_calls(&probe, 2).await;
    let conflict = send(&svc, keyed_json("/slow", "s", "t1", r#"{"x":1}"#)).await;
    assert_eq!(conflict.code().as_deref(), Some("idempotency_conflict"));
    probe.open_gate(1);
    slow.await.expect("join").expect("response");
    assert_eq!(probe.calls(), 2);
}

#[tokio::test]
async fn duplicate_in_flight_gets_409_with_retry_after() {
    let (_store, probe, svc) =
        fresh_with(|layer| layer.timing(|t| t.lease(Duration::from_secs(12))));
    let first = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;

    let busy = send(&svc, keyed("/slow", "k")).await;
    busy.assert_problem(StatusCode::CONFLICT, "idempotency_in_progress");
    let retry_after: u64 = busy
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    assert!((1..=12).contains(&retry_after), "Retry-After {retry_after}");

    probe.open_gate(1);
    let first = first.await.expect("join").expect("response");
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = send(&svc, keyed("/slow", "k")).await;
    assert!(replay.replayed());
    assert_eq!(probe.calls(), 1);
}

/// A dead owner's lease (reserved directly in the store, never renewed)
/// is taken over after it lapses, with the next generation, and the
/// handler learns which attempt it superseded.
#[tokio::test(start_paused = true)]
async fn lapsed_lease_is_taken_over_with_next_generation() {
    let (store, probe, svc) = fresh_with(|layer| layer.timing(|t| t.lease(Duration::from_secs(5))));
    let request = || keyed("/ctx", "k");

    // The "crashed" first attempt, with the fingerprint the layer computes.
    let scope = Scope::new("t1", "POST /ctx", "k".parse().expect("key"));
    let fingerprint = {
        let (parts, _) = request().into_parts();
        idem_layer::fingerprint::fingerprint(
            "POST /ctx",
            &parts,
            &[http::header::CONTENT_TYPE],
            b"",
        )
    };
    let reserve = ReserveRequest {
        scope,
        fingerprint,
        lease: Duration::from_secs(5),
        retention: Duration::from_secs(3600),
    };
    assert!(matches!(
        store.reserve(&reserve).await.expect("reserve"),
        Reservation::Acquired(_)
    ));

    let busy = send(&svc, request()).await;
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    assert_eq!(probe.calls(), 0);

    tokio::time::advance(Duration::from_secs(6)).await;
    let taken = send(&svc, request()).await;
    assert_eq!(taken.status, StatusCode::OK);
    assert_eq!(
        std::str::from_utf8(&taken.body).expect("utf8"),
        "key=k tenant=t1 op=POST /ctx generation=2 superseded=1"
    );
    assert_eq!(probe.calls(), 1);
    let replay = send(&svc, request()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, taken.body);
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn cancelled_record_answers_410() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store);
    let svc = service(&layer, &probe);
    let slow = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;

    let records = layer.records_service();
    let cancel = records_call(
        &records,
        http::Method::DELETE,
        "/_idempotency/records?method=POST&path=/slow&key=k",
    )
    .await;
    assert_eq!(cancel.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&cancel.body).expect("json");
    assert_eq!(json["result"], "cancelled");
    assert_eq!(json["record"]["state"], "cancelled");

    probe.open_gate(1);
    let fenced = slow.await.expect("join").expect("response");
    assert_eq!(
        fenced.status(),
        StatusCode::GONE,
        "the cancelled attempt's own client gets 410"
    );
    let retry = send(&svc, keyed("/slow", "k")).await;
    retry.assert_problem(StatusCode::GONE, "idempotency_cancelled");
    assert_eq!(probe.calls(), 1);
    // Cancellation did not stop the handler: it finished, and its outcome is late evidence.
    assert_eq!(probe.finished(), 1);
    let record = records_call(
        &records,
        http::Method::GET,
        "/_idempotency/records?method=POST&path=/slow&key=k",
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(json["attempts"][0]["late"]["kind"], "completed");
    assert_eq!(json["attempts"][0]["late"]["status"], 201);
}

#[tokio::test]
async fn stored_outcomes_are_replayed() {
    for status in [200u16, 201, 204, 302, 400, 403, 404, 409] {
        let store = MemoryStore::new();
        let probe = Probe::default();
        let svc = service(&layer(&store), &probe);
        let path = format!("/status/{status}");
        let first = send(&svc, keyed(&path, "k")).await;
        assert_eq!(first.status.as_u16(), status);
        let second = send(&svc, keyed(&path, "k")).await;
        assert_eq!(second.status.as_u16(), status, "status {status} replayed");
        assert!(second.replayed(), "status {status} replayed");
        assert_eq!(second.body, first.body);
        assert_eq!(probe.calls(), 1, "status {status} executes once");
    }
}

#[tokio::test]
async fn temporary_failures_release_the_key() {
    for status in [500u16, 502, 503, 504, 408, 425, 429] {
        let store = MemoryStore::new();
        let probe = Probe::default();
        let svc = service(&layer(&store), &probe);
        let path = format!("/status/{status}");
        let first = send(&svc, keyed(&path, "k")).await;
        assert_eq!(first.status.as_u16(), status, "passed through");
        assert_eq!(first.body, format!("status {status} run 1"));
        let second = send(&svc, keyed(&path, "k")).await;
        assert!(!second.replayed(), "status {status} is not replayed");
        assert_eq!(second.body, format!("status {status} run 2"));
        assert_eq!(probe.calls(), 2, "status {status} re-executes");
    }
}

#[tokio::test]
async fn handler_error_and_panic_release_the_key() {
    let (_store, probe, svc) = fresh();

    let error = svc.clone().oneshot(keyed("/error", "e")).await;
    assert!(
        error.is_err(),
        "a handler error is passed through as the service error"
    );
    let error = svc.clone().oneshot(keyed("/error", "e")).await;
    assert!(error.is_err());
    assert_eq!(probe.calls(), 2, "the error released the key");

    let panic = send(&svc, keyed("/panic", "p")).await;
    panic.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, "handler_failed");
    let again = send(&svc, keyed("/panic", "p")).await;
    assert_eq!(again.code().as_deref(), Some("handler_failed"));
    assert_eq!(probe.calls(), 4, "the panic released the key");
}

#[tokio::test]
async fn outcome_predicate_is_configurable() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    // Store 503s too.
    let svc = service(
        &layer(&store).answers(|a| a.store_outcome_if(|s| s.as_u16() != 404)),
        &probe,
    );
    send(&svc, keyed("/status/503", "a")).await;
    assert!(send(&svc, keyed("/status/503", "a")).await.replayed());
    send(&svc, keyed("/status/404", "b")).await;
    assert!(!send(&svc, keyed("/status/404", "b")).await.replayed());
    assert_eq!(probe.calls(), 3);
}

#[tokio::test]
async fn response_over_storable_limit_reaches_first_caller_only() {
    let (_store, probe, svc) = fresh_with(|layer| layer.answers(|a| a.max_response(1024)));
    let first = send(&svc, keyed("/big/5000", "k")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.body.len(),
        5000,
        "the first caller gets the whole body"
    );
    assert!(first.body.iter().all(|b| *b == b'x'));
    let retry = send(&svc, keyed("/big/5000", "k")).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.code().as_deref(),
        Some("idempotency_response_not_stored")
    );
    assert_eq!(probe.calls(), 1, "the handler is not run again");
    // Exactly at the limit is stored.
    let at_limit = send(&svc, keyed("/big/1024", "k2")).await;
    let replay = send(&svc, keyed("/big/1024", "k2")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, at_limit.body);
}

#[tokio::test]
async fn other_methods_pass_through_without_store_calls() {
    let (store, probe, svc) = fresh();
    for _ in 0..2 {
        let answer = send(
            &svc,
            method(http::Method::PUT, "/orders")
                .key("k")
                .tenant("t1")
                .build(),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    // Even an invalid key is not looked at.
    let answer = send(
        &svc,
        method(http::Method::GET, "/orders").key("a b").build(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(probe.calls(), 3);
    assert!(store.is_empty(), "no record was made");

    // PATCH is keyed by default; PUT when configured.
    let svc = service(&layer(&store).methods([http::Method::PUT]), &probe);
    send(
        &svc,
        method(http::Method::PUT, "/orders")
            .key("k")
            .tenant("t1")
            .build(),
    )
    .await;
    assert!(
        send(
            &svc,
            method(http::Method::PUT, "/orders")
                .key("k")
                .tenant("t1")
                .build()
        )
        .await
        .replayed()
    );
}

#[tokio::test]
async fn missing_key_passes_through_unless_required() {
    let (store, probe, svc) = fresh();
    send(&svc, post("/orders").tenant("t1").build()).await;
    send(&svc, post("/orders").tenant("t1").build()).await;
    assert_eq!(probe.calls(), 2);
    assert!(store.is_empty());

    let svc = service(&layer(&store).require_key(true), &probe);
    let refused = send(&svc, post("/orders").tenant("t1").build()).await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "idempotency_key_missing");
    assert_eq!(probe.calls(), 2);
}

#[tokio::test]
async fn invalid_keys_get_400_from_the_vectors() {
    let (_store, probe, svc) = fresh();
    let mut checked = 0;
    for line in include_str!("fixtures/idempotency-key.jsonl")
        .lines()
        .filter(|l| !l.is_empty())
    {
        let case: serde_json::Value = serde_json::from_str(line).expect("json");
        let header = case["header"].as_str().expect("header");
        let Ok(value) = http::HeaderValue::from_bytes(header.as_bytes()) else {
            continue;
        };
        let mut request = post("/status/200").tenant("t1").build();
        request.headers_mut().insert("idempotency-key", value);
        let answer = send(&svc, request).await;
        match case.get("error") {
            Some(_) => {
                assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", case["note"]);
                assert_eq!(
                    answer.code().as_deref(),
                    Some("idempotency_key_invalid"),
                    "{}",
                    case["note"]
                );
            }
            None => assert_eq!(answer.status, StatusCode::OK, "{}", case["note"]),
        }
        checked += 1;
    }
    assert!(checked > 20);
    let errors = include_str!("fixtures/idempotency-key.jsonl")
        .matches("\"error\"")
        .count();
    let valid_runs = checked - errors;
    assert!(
        probe.calls() <= valid_runs,
        "no invalid key reached the handler"
    );
}

#[tokio::test]
async fn two_key_fields_are_invalid() {
    let (_store, probe, svc) = fresh();
    let request = post("/orders").key("a").key("a").tenant("t1").build();
    let answer = send(&svc, request).await;
    answer.assert_problem(StatusCode::BAD_REQUEST, "idempotency_key_invalid");
    assert_eq!(probe.calls(), 0);
}

#[tokio::test]
async fn quoted_and_bare_keys_name_the_same_record() {
    let (_store, probe, svc) = fresh();
    let first = send(&svc, post("/orders").key("\"abc\"").tenant("t1").build()).await;
    let second = send(&svc, keyed("/orders", "abc")).await;
    assert!(second.replayed());
    assert_eq!(first.body, second.body);
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn tenants_are_isolated_and_required() {
    let (store, probe, svc) = fresh();
    let a = send(&svc, keyed_json("/orders", "same", "alice", "{}")).await;
    let b = send(&svc, keyed_json("/orders", "same", "bob", r#"{"other":1}"#)).await;
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    assert_eq!(probe.calls(), 2);

    let anonymous = send(&svc, post("/orders").key("k").build()).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.code().as_deref(),
        Some("idempotency_tenant_missing")
    );
    assert_eq!(probe.calls(), 2);

    let svc = service(&layer(&store).allow_anonymous(true), &probe);
    send(&svc, post("/orders").key("k").build()).await;
    assert!(
        send(&svc, post("/orders").key("k").build())
            .await
            .replayed()
    );
    assert_eq!(probe.calls(), 3);
}

#[tokio::test]
async fn body_over_the_limit_is_413_and_never_executes() {
    let (store, probe, svc) = fresh_with(|layer| layer.fingerprints(|f| f.max_body(100)));
    // A keyed body of `len` bytes, its length declared or not.
    let body_of = |len: usize, declared: bool| {
        let request = post("/orders").key("k").tenant("t1");
        let request = if declared {
            request.header("content-length", &len.to_string())
        } else {
            request
        };
        send(&svc, request.body(vec![b'a'; len]).build())
    };
    body_of(101, true)
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    body_of(101, false)
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    assert_eq!(probe.calls(), 0);
    assert!(store.is_empty(), "nothing was reserved");
    // At the limit it runs.
    let answer = body_of(100, false).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(
        answer.header("x-echo-len"),
        Some("100"),
        "the handler got the whole body"
    );
}

#[tokio::test]
async fn json_key_order_and_whitespace_do_not_change_the_fingerprint() {
    let (_store, probe, svc) = fresh();
    send(&svc, order("k", r#"{"a":1,"b":[1,2],"c":{"y":1,"x":2}}"#)).await;
    let replay = send(
        &svc,
        order(
            "k",
            "{ \"c\": {\"x\":2, \"y\":1.0},\n \"b\": [1, 2], \"a\": 1 }",
        ),
    )
    .await;
    assert!(replay.replayed());
    let conflict = send(&svc, order("k", r#"{"a":1,"b":[2,1],"c":{"y":1,"x":2}}"#)).await;
    assert_eq!(conflict.code().as_deref(), Some("idempotency_conflict"));
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn query_string_is_part_of_the_fingerprint() {
    let (_store, _probe, svc) = fresh();
    send(&svc, keyed("/status/200?x=1", "k")).await;
    let conflict = send(&svc, keyed("/status/200?x=2", "k")).await;
    assert_eq!(conflict.code().as_deref(), Some("idempotency_conflict"));
}

#[tokio::test]
async fn custom_fingerprint_replaces_the_default() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    // Only the operation counts: any payload replays.
    let layer = layer(&store).fingerprints(|f| {
        f.function(|op, _, _| idem_core::Fingerprint::from_bytes([op.len() as u8; 32]))
    });
    let svc = service(&layer, &probe);
    send(&svc, order("k", r#"{"a":1}"#)).await;
    assert!(send(&svc, order("k", r#"{"a":2}"#)).await.replayed());
    assert_eq!(probe.calls(), 1);
}

#[tokio::test]
async fn handler_sees_the_context() {
    let (_store, _probe, svc) = fresh();
    let answer = send(&svc, post("/ctx").key("\"my key\"").tenant("acme").build()).await;
    assert_eq!(
        std::str::from_utf8(&answer.body).expect("utf8"),
        "key=my key tenant=acme op=POST /ctx generation=1 superseded="
    );
}

/// The handler outlives several lease lengths; renewal keeps duplicates
/// out (no takeover while the process is alive).
#[tokio::test(start_paused = true)]
async fn long_handler_keeps_its_lease() {
    let (_store, probe, svc) =
        fresh_with(|layer| layer.timing(|t| t.lease(Duration::from_secs(3))));
    let first = tokio::spawn(svc.clone().oneshot(keyed("/slow", "k")));
    wait_calls(&probe, 1).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Bounded: a duplicate that took the lease over would run the
        // handler, which waits for the gate.
        let busy = tokio::time::timeout(Duration::from_secs(10), send(&svc, keyed("/slow", "k")))
            .await
            .expect("the duplicate is answered, not run");
        assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    }
    probe.open_gate(1);
    assert_eq!(
        first.await.expect("join").expect("response").status(),
        StatusCode::CREATED
    );
    assert_eq!(probe.calls(), 1);
}

/// The layer validates its configuration once, not at every application:
/// a change made after it was applied is validated again, either way.
#[tokio::test]
async fn a_changed_configuration_is_validated_again() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let valid = layer(&store);
    let first = send(&service(&valid, &probe), order("v1", r#"{"qty":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let invalid = valid.clone().timing(|t| {
        t.lease(Duration::from_secs(30))
            .retention(Duration::from_secs(30))
    });
    let refused = send(&service(&invalid, &probe), order("v2", r#"{"qty":1}"#)).await;
    refused.assert_problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "idempotency_misconfigured",
    );
    let mended = invalid.timing(|t| t.retention(Duration::from_secs(60)));
    let again = send(&service(&mended, &probe), order("v3", r#"{"qty":1}"#)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    // The first layer, applied again, is still valid.
    let reused = send(&service(&valid, &probe), order("v4", r#"{"qty":1}"#)).await;
    assert_eq!(reused.status, StatusCode::CREATED);
    assert_eq!(probe.calls(), 3);
}

/// A group's setter changes the group as the layer holds it: a lease set
/// by one call survives a retention set by the next (and another group's
/// setter between them), and a body limit survives a later change of the
/// fingerprinted headers; `|_|` replaces the group whole.
#[tokio::test]
async fn group_setters_change_their_group_as_the_layer_holds_it() {
    let store = MemoryStore::new();
    let kept = layer(&store)
        .timing(|t| t.lease(Duration::from_secs(100)))
        .answers(|a| a.max_response(1024))
        .timing(|t| t.retention(Duration::from_secs(60)));
    assert_eq!(
        kept.validate(),
        Err(idem_layer::ConfigError::RetentionNotLongerThanLease {
            retention: Duration::from_secs(60),
            lease: Duration::from_secs(100),
        })
    );
    let replaced = kept.timing(|_| Timing::default().retention(Duration::from_secs(60)));
    assert_eq!(replaced.validate(), Ok(()));
    let probe = Probe::default();
    let limited = layer(&store)
        .fingerprints(|f| f.max_body(8))
        .fingerprints(|f| f.headers([]));
    let svc = service(&limited, &probe);
    let over = send(&svc, order("g", r#"{"qty":10}"#)).await;
    over.assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    assert_eq!(probe.calls(), 0, "nothing ran");
}

/// A zero lease, store timeout or body timeout would refuse or lose every
/// keyed request: each is a configuration error, named.
#[test]
fn a_zero_bound_is_a_configuration_error() {
    let store = MemoryStore::new();
    type Zeroes = fn(Timing) -> Timing;
    let zeroed: [(&str, Zeroes); 3] = [
        ("the lease", |t| t.lease(Duration::ZERO)),
        ("the store timeout", |t| t.store_timeout(Duration::ZERO)),
        ("the body timeout", |t| t.body_timeout(Duration::ZERO)),
    ];
    for (name, zero) in zeroed {
        match layer(&store).timing(zero).validate() {
            Err(idem_layer::ConfigError::Zero(what)) => assert_eq!(what, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(layer(&store).validate().is_ok());
}

#[tokio::test]
async fn retention_not_longer_than_lease_is_a_configuration_error() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store).timing(|t| {
        t.lease(Duration::from_secs(30))
            .retention(Duration::from_secs(30))
    });
    assert!(matches!(
        layer.validate(),
        Err(idem_layer::ConfigError::RetentionNotLongerThanLease { .. })
    ));
    // Applied anyway: no panic; protected requests are refused, keyed or
    // not, and never run unprotected; other methods pass through.
    let svc = service(&layer, &probe);
    let keyed = send(&svc, order("k", r#"{"qty":1}"#)).await;
    keyed.assert_problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "idempotency_misconfigured",
    );
    assert_eq!(keyed.content_type(), Some("application/problem+json"));
    let keyless = send(&svc, post("/orders").tenant("t1").body("{}").build()).await;
    assert_eq!(keyless.code().as_deref(), Some("idempotency_misconfigured"));
    assert_eq!(probe.calls(), 0, "nothing ran");
    let read = send(&svc, method(http::Method::GET, "/orders").build()).await;
    assert_eq!(read.status, StatusCode::CREATED, "GET passes through");
    assert_eq!(probe.calls(), 1);
    assert!(store.is_empty(), "nothing was reserved");
    // The command API refuses too.
    let command = idem_layer::Command::new(
        "t1",
        "charge",
        idem_layer::IdempotencyKey::parse(b"k").expect("key"),
        &serde_json::json!({"amount": 1}),
    )
    .expect("command");
    let ran = std::sync::atomic::AtomicBool::new(false);
    let answer = layer
        .run::<u32, String, _, _>(&command, |_| async {
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(1)
        })
        .await;
    assert!(matches!(
        answer,
        Err(idem_layer::CommandError::Misconfigured(_))
    ));
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    assert!(IdempotencyLayer::new(MemoryStore::new()).validate().is_ok());
}

#[tokio::test]
async fn records_api_shows_attempts_and_hides_other_tenants() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let layer = layer(&store);
    let svc = service(&layer, &probe);
    send(&svc, keyed("/status/503", "k")).await;
    send(&svc, keyed("/status/503", "k")).await;
    let mut records = layer.records_service();
    let uri = "/_idempotency/records?method=POST&path=%2Fstatus%2F503&key=k";
    let mine = records_call(&records, http::Method::GET, uri).await;
    assert_eq!(mine.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&mine.body).expect("json");
    assert_eq!(json["state"], "released");
    assert_eq!(json["generation"], 2);
    assert_eq!(json["operation"], "POST /status/503");
    assert_eq!(json["attempts"].as_array().map(Vec::len), Some(2));
    assert_eq!(json["attempts"][0]["outcome"]["kind"], "released");
    assert!(json["attempts"][1]["id"].is_string());
    assert!(json["attempts"][1]["ended_at"].is_string());

    let theirs = send(
        &records,
        method(http::Method::GET, uri).tenant("t2").build(),
    )
    .await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(
        theirs.code().as_deref(),
        Some("idempotency_record_not_found")
    );
    let delete = send(
        &records,
        method(http::Method::DELETE, uri).tenant("t2").build(),
    )
    .await;
    assert_eq!(delete.status, StatusCode::NOT_FOUND);
    let absent = records_call(&records, http::Method::GET, "/r?method=POST&path=/x&key=zz").await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
    let bad = records_call(&records, http::Method::GET, "/r?method=POST").await;
    assert_eq!(
        bad.code().as_deref(),
        Some("idempotency_record_query_invalid")
    );
    // A parameter given twice, a flag that is neither true nor false, and
    // an action on GET or DELETE are refused, not guessed or ignored (a
    // list of every record for `lapsed=maybe`, the first key of two).
    let named = format!("{uri}&other=kept");
    let guessed = [
        (http::Method::GET, format!("{uri}&key=k2")),
        (http::Method::GET, "/r?lapsed=maybe".to_owned()),
        (http::Method::GET, "/r?lapsed=true&lapsed=false".to_owned()),
        (http::Method::GET, format!("{uri}&output=yes")),
        (http::Method::GET, format!("{uri}&action=erase")),
        (http::Method::DELETE, format!("{uri}&action=release")),
    ];
    for (verb, query) in guessed {
        let refused = records_call(&records, verb.clone(), &query).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{verb} {query}");
        assert_eq!(
            refused.code().as_deref(),
            Some("idempotency_record_query_invalid"),
            "{verb} {query}"
        );
    }
    let kept = records_call(&records, http::Method::GET, &named).await;
    assert_eq!(kept.status, StatusCode::OK, "an unknown name is left alone");
    let nobody = send(&records, method(http::Method::GET, uri).build()).await;
    assert_eq!(nobody.status, StatusCode::UNAUTHORIZED);
    std::future::poll_fn(|cx| {
        Service::<http::Request<http_body_util::Full<bytes::Bytes>>>::poll_ready(&mut records, cx)
    })
    .await
    .expect("ready");
}

/// A keyed body that never ends is cut off at the body timeout: 408,
/// handler not run, nothing reserved.
#[tokio::test(start_paused = true)]
async fn body_that_never_ends_is_408() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let runs = probe.calls.clone();
    let inner = tower::service_fn(move |_: http::Request<axum::body::Body>| {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async { Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty())) }
    });
    let svc = layer(&store)
        .timing(|t| t.body_timeout(Duration::from_secs(5)))
        .layer(inner);
    let endless = futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
    let request = http::Request::post("/orders")
        .header("idempotency-key", "k")
        .header(TENANT, "t1")
        .body(axum::body::Body::from_stream(endless))
        .expect("request");
    let started = tokio::time::Instant::now();
    let response = svc.oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("body")
        .to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(json["code"], "request_body_timeout");
    assert_eq!(probe.calls(), 0);
    assert!(store.is_empty());
}

/// A handler's answer whose `Content-Length` its body contradicts reaches
/// the client with the length of the bytes it gets, as its replay does
/// (it kept the handler's `3` beside a five-byte body, which frames an
/// HTTP/1.1 connection wrongly); an agreeing length is left as it is.
/// `Set-Cookie2`, like `Set-Cookie`, reaches the first caller only.
#[tokio::test]
async fn the_first_answer_states_the_length_of_its_body() {
    let store = MemoryStore::new();
    let inner = tower::service_fn(
        |request: http::Request<http_body_util::Full<bytes::Bytes>>| async move {
            let length = if request.uri().path() == "/wrong" {
                "3"
            } else {
                "5"
            };
            Ok::<_, std::convert::Infallible>(
                http::Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-length", length)
                    .header("set-cookie2", "c=3")
                    .body(axum::body::Body::from("hello"))
                    .expect("response"),
            )
        },
    );
    let svc = layer(&store).layer(inner);
    for path in ["/wrong", "/right"] {
        let first = send(
            &svc,
            post(path).key("framed").tenant("t1").json("{}").build(),
        )
        .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(&first.body[..], b"hello");
        assert_eq!(first.header("content-length"), Some("5"), "{path}");
        assert_eq!(first.header("set-cookie2"), Some("c=3"), "{path}");
        let replay = send(
            &svc,
            post(path).key("framed").tenant("t1").json("{}").build(),
        )
        .await;
        assert!(replay.replayed(), "{path}");
        assert_eq!(&replay.body[..], b"hello");
        assert_eq!(replay.header("set-cookie2"), None, "{path}: not replayed");
    }
}
