//! The direct API (`IdempotencyLayer::run`) on every store: memory, Redis
//! and PostgreSQL, each a real server where it has one.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idem_core::{IdempotencyKey, Reservation, ReserveRequest, Store};
use idem_layer::{ActionError, Command, CommandError, Done, IdempotencyLayer};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    id: u64,
    cents: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    Insufficient { short_by: u64 },
    Flaky,
}

fn charge(key: &str, cents: u64) -> Command {
    let key =
        IdempotencyKey::parse(format!("{key}-{}", uuid::Uuid::new_v4()).as_bytes()).expect("key");
    Command::new(
        "shop",
        "charge",
        key,
        &serde_json::json!({ "cents": cents }),
    )
    .expect("command")
}

fn same_key(command: &Command, cents: u64) -> Command {
    Command::new(
        command.scope().tenant(),
        command.scope().operation(),
        command.scope().key().clone(),
        &serde_json::json!({ "cents": cents }),
    )
    .expect("command")
}

type Outcome = Result<Done<Receipt>, CommandError<Declined>>;

/// The behaviours of the direct API, on one store.
async fn suite<S: Store>(store: S) {
    let layer = IdempotencyLayer::new(store).timing(|t| t.lease(Duration::from_secs(5)));
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = |cents: u64| {
        let runs = Arc::clone(&runs);
        move |_ctx| async move {
            let id = runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, ActionError<Declined>>(Receipt { id, cents })
        }
    };

    // Once only under concurrent duplicates; the typed result replays.
    let command = charge("concurrent", 1299);
    let results: Vec<Outcome> =
        futures_util::future::join_all((0..20).map(|_| layer.run(&command, pay(1299)))).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran more than once");
    let ran: Vec<_> = results
        .iter()
        .filter_map(|r| match r {
            Ok(Done::Ran(receipt)) => Some(receipt.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ran.len(), 1);
    for result in &results {
        match result {
            Ok(Done::Ran(_)) => {}
            Ok(Done::Replayed(receipt)) => assert_eq!(receipt, &ran[0]),
            Err(CommandError::InProgress { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let replay: Outcome = layer.run(&command, pay(1299)).await;
    assert_eq!(replay.expect("replay"), Done::Replayed(ran[0].clone()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A changed command under the same key is a conflict.
    let changed: Outcome = layer.run(&same_key(&command, 1), pay(1)).await;
    assert!(
        matches!(changed, Err(CommandError::Conflict)),
        "{changed:?}"
    );

    // A temporary error releases the key: the next delivery runs again.
    let flaky = charge("flaky", 5);
    let first: Outcome = layer
        .run(&flaky, |_| async {
            Err(ActionError::Temporary(Declined::Flaky))
        })
        .await;
    assert!(
        matches!(first, Err(CommandError::Retry(Some(Declined::Flaky)))),
        "{first:?}"
    );
    let second: Outcome = layer.run(&flaky, pay(5)).await;
    assert!(matches!(second, Ok(Done::Ran(_))), "{second:?}");

    // A permanent error is stored and replayed, typed.
    let poor = charge("poor", 10_000);
    let declined = Declined::Insufficient { short_by: 42 };
    let first: Outcome = layer
        .run(&poor, |_| async {
            Err(ActionError::Permanent(Declined::Insufficient {
                short_by: 42,
            }))
        })
        .await;
    assert!(
        matches!(&first, Err(CommandError::Failed { error, replayed: false, recording: None }) if *error == declined),
        "{first:?}"
    );
    let before = runs.load(Ordering::SeqCst);
    let again: Outcome = layer.run(&poor, pay(10_000)).await;
    assert!(
        matches!(&again, Err(CommandError::Failed { error, replayed: true, recording: None }) if *error == declined),
        "{again:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        before,
        "a stored failure ran again"
    );

    // A result that does not encode as JSON (a map keyed by pairs) is an
    // action that ran: its delivery gets it, and later ones get
    // ResultNotStored instead of running it again. So is a permanent
    // error that does not encode.
    let odd = charge("unencodable", 3);
    let ran = Arc::new(AtomicUsize::new(0));
    let tally = |value: u8| {
        let ran = Arc::clone(&ran);
        move |_ctx| async move {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ActionError<Declined>>(std::collections::HashMap::from([((1u8, 2u8), value)]))
        }
    };
    let first = layer.run(&odd, tally(3)).await;
    assert_eq!(
        first
            .expect("the delivery that ran gets its result")
            .into_inner()[&(1, 2)],
        3
    );
    for _ in 0..2 {
        let again = layer.run(&odd, tally(4)).await;
        assert!(
            matches!(again, Err(CommandError::ResultNotStored { status: 200 })),
            "{again:?}"
        );
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "an unencodable result ran again"
    );
    let refused = charge("unencodable-error", 3);
    let odd_error = |_ctx| async {
        Err::<Receipt, _>(ActionError::Permanent(std::collections::HashMap::from([(
            (1u8, 2u8),
            0u8,
        )])))
    };
    let first = layer.run(&refused, odd_error).await;
    assert!(
        matches!(
            first,
            Err(CommandError::Failed {
                replayed: false,
                ..
            })
        ),
        "{first:?}"
    );
    let before = runs.load(Ordering::SeqCst);
    let again = layer.run(&refused, pay(3)).await;
    assert!(
        matches!(again, Err(CommandError::ResultNotStored { status: 422 })),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), before, "a refused command ran");

    // A lost owner: its lease lapses, and the next delivery takes over with
    // the next generation, seeing the superseded attempt.
    let orphan = charge("orphan", 7);
    let reserved = layer
        .store()
        .reserve(&ReserveRequest {
            scope: orphan.scope().clone(),
            fingerprint: orphan.fingerprint(),
            lease: Duration::from_millis(300),
            retention: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(reserved, Reservation::Acquired(_)));
    let busy: Outcome = layer.run(&orphan, pay(7)).await;
    assert!(
        matches!(busy, Err(CommandError::InProgress { .. })),
        "{busy:?}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let seen = Arc::new(std::sync::Mutex::new(None));
    let saw = Arc::clone(&seen);
    let taken: Outcome = layer
        .run(&orphan, move |ctx| async move {
            *saw.lock().expect("lock") = Some((ctx.generation, ctx.superseded.is_some()));
            Ok(Receipt { id: 99, cents: 7 })
        })
        .await;
    assert_eq!(
        taken.expect("takeover"),
        Done::Ran(Receipt { id: 99, cents: 7 })
    );
    assert_eq!(*seen.lock().expect("lock"), Some((2, true)));
    let record = layer
        .store()
        .get(orphan.scope().hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.generation, 2);
    assert_eq!(record.attempts.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_memory() {
    suite(idem_memory::MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis() {
    let Some(server) = idem_tests::redis_server::RedisServer::spawn() else {
        return;
    };
    suite(idem_redis::RedisStore::from_url(&server.url()).expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    let Some(server) = idem_tests::postgres_server::PgServer::shared() else {
        return;
    };
    let store = idem_postgres::PgStore::from_url(&server.database()).expect("store");
    store.migrate().await.expect("migrate");
    suite(store).await;
}

/// A layer with a scope secret runs a command under the keyed hash of its
/// scope (the command's own is unkeyed), and replays it from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_layer_runs_commands_under_the_keyed_scope() {
    let secret = || idem_core::ScopeSecret::new(&[0x42; 32]).expect("secret");
    let layer = IdempotencyLayer::new(idem_memory::MemoryStore::new()).scope_secret(secret());
    let command = charge("keyed", 500);
    let runs = AtomicUsize::new(0);
    for expected_ran in [true, false] {
        let done: Outcome = layer
            .run(&command, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(Receipt { id: 1, cents: 500 })
            })
            .await;
        let done = done.expect("done");
        assert_eq!(matches!(done, Done::Ran(_)), expected_ran, "{done:?}");
        assert_eq!(done.into_inner(), Receipt { id: 1, cents: 500 });
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let scope = command.scope();
    let keyed = idem_core::ScopeHash::keyed(
        &secret(),
        scope.tenant(),
        scope.operation(),
        scope.key().as_str(),
    );
    let store = layer.store();
    assert!(store.get(&keyed).await.expect("get").is_some());
    assert!(store.get(scope.hash()).await.expect("get").is_none());
}

/// A layer with BLAKE3 scopes runs commands under the BLAKE3 hash of
/// their scope, keyed or not, and replays them there.
#[tokio::test]
async fn a_blake3_layer_runs_commands_under_the_blake3_scope() {
    let secret = idem_core::ScopeSecret::new(&[0x43; 32]).expect("secret");
    for secret in [None, Some(secret)] {
        let mut layer = IdempotencyLayer::new(idem_memory::MemoryStore::new())
            .scope_format(idem_core::ScopeFormat::Blake3);
        if let Some(secret) = &secret {
            layer = layer.scope_secret(secret.clone());
        }
        let command = charge("blake3", 700);
        let runs = AtomicUsize::new(0);
        for expected_ran in [true, false] {
            let done: Outcome = layer
                .run(&command, |_| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok(Receipt { id: 2, cents: 700 })
                })
                .await;
            let done = done.expect("done");
            assert_eq!(matches!(done, Done::Ran(_)), expected_ran, "{done:?}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let scope = command.scope();
        let blake3 = idem_core::ScopeFormat::Blake3.hash(
            secret.as_ref(),
            scope.tenant(),
            scope.operation(),
            scope.key().as_str(),
        );
        let store = layer.store();
        assert!(store.get(&blake3).await.expect("get").is_some());
        assert!(store.get(scope.hash()).await.expect("get").is_none());
    }
}
