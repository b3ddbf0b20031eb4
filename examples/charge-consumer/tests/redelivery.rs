//! The consumer against its own `nats-server` and `redis-server`: killed
//! with SIGKILL after executing a charge and before acknowledging it, the
//! broker redelivers, and the ledger shows every charge once; every
//! redelivery is answered from the record.

use std::{collections::HashMap, path::Path, process::Command, time::Duration};

use idem_tests::{nats_server::NatsServer, process::Spawned, redis_server::RedisServer};

fn consumer(nats: &NatsServer, redis: &RedisServer, ledger: &Path, crash: Option<&str>) -> Spawned {
    consumer_acking_within(nats, redis, ledger, crash, "2s")
}

/// [`consumer`] with the broker's ack wait `ack_wait`.
fn consumer_acking_within(
    nats: &NatsServer,
    redis: &RedisServer,
    ledger: &Path,
    crash: Option<&str>,
    ack_wait: &str,
) -> Spawned {
    let mut command = Command::new(env!("CARGO_BIN_EXE_charge-consumer"));
    command
        .env("NATS_URL", nats.url())
        .env("IDEM_STORE", redis.url())
        .env("LEDGER", ledger)
        .env("ACK_WAIT", ack_wait);
    if let Some(id) = crash {
        command.env("CONSUMER_CRASH_AFTER_EXECUTE", id);
    }
    Spawned::start(&mut command)
}

/// A fresh directory for one test's ledger, and the ledger's path in it.
fn ledger_dir() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("idem-consumer-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("dir");
    let ledger = dir.join("charges.ledger");
    (dir, ledger)
}

/// Charges per id in the ledger.
fn ledger(path: &Path) -> HashMap<String, usize> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut counts = HashMap::new();
    for line in text.lines() {
        if let Some(id) = line.split_whitespace().nth(1) {
            *counts.entry(id.to_owned()).or_default() += 1;
        }
    }
    counts
}

async fn publish(js: &async_nats::jetstream::Context, id: &str, cents: u64) {
    let payload = serde_json::json!({ "id": id, "account": "acme", "cents": cents });
    js.publish("charges", payload.to_string().into())
        .await
        .expect("publish")
        .await
        .expect("stored by the stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_acknowledging_charges_once_and_redeliveries_replay() {
    let Some(nats) = NatsServer::spawn() else {
        return;
    };
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (dir, ledger_path) = ledger_dir();

    let mut first = consumer(&nats, &redis, &ledger_path, Some("c-3"));
    assert!(first.banner.contains("consuming"), "{}", first.banner);
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    for n in 1..=5 {
        publish(&js, &format!("c-{n}"), 100 * n).await;
    }
    first.wait_for_line("crash point: executed c-3, not acknowledged");
    first.kill();
    let after_kill = ledger(&ledger_path);
    assert_eq!(after_kill.get("c-3"), Some(&1), "{after_kill:?}");

    // The broker redelivers c-3 (and whatever the first consumer held) to
    // the next consumer, which answers c-3 from the record.
    let second = consumer(&nats, &redis, &ledger_path, None);
    second.wait_for_line("answered c-3 from the record");
    let all_ran =
        |counts: &HashMap<String, usize>| (1..=5).all(|n| counts.contains_key(&format!("c-{n}")));
    let counts = idem_tests::poll_until(
        Duration::from_secs(30),
        async || ledger(&ledger_path),
        all_ran,
    )
    .await;
    assert!(all_ran(&counts), "not every charge ran: {counts:?}");
    // A duplicate message of a charge already made is answered from the
    // record; the same id with another amount is refused, never charged.
    publish(&js, "c-2", 200).await;
    second.wait_for_line("answered c-2 from the record");
    publish(&js, "c-1", 999_999).await;
    second.wait_for_line("c-1 arrived with another payload");
    let counts = ledger(&ledger_path);
    assert_eq!(counts.len(), 5, "{counts:?}");
    assert!(
        counts.values().all(|n| *n == 1),
        "a charge ran more than once: {counts:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ack floor (a stream sequence) of the consumer `charge-consumer`,
/// and how many deliveries it made (redeliveries counted).
async fn acks(js: &async_nats::jetstream::Context) -> (u64, u64) {
    let stream = js.get_stream("CHARGES").await.expect("stream");
    let info = stream
        .consumer_info("charge-consumer")
        .await
        .expect("consumer info");
    (
        info.ack_floor.stream_sequence,
        info.delivered.consumer_sequence,
    )
}

/// The store stops answering while a charge runs: the action ran, but its
/// outcome is not recorded. The consumer holds the message (in-progress
/// acknowledgements, so the broker neither counts it acknowledged nor
/// redelivers it) until the layer has recorded the outcome, then
/// acknowledges it; a duplicate of the charge is answered from the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledges_a_charge_only_once_its_outcome_is_recorded() {
    let Some(nats) = NatsServer::spawn() else {
        return;
    };
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    // The ledger is a FIFO: a charge blocks on it until the test reads it,
    // so the test can take the store away while the charge runs.
    let (dir, ledger_path) = ledger_dir();
    let made = Command::new("mkfifo")
        .arg(&ledger_path)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    // In-progress acknowledgements go every third of it: a loaded
    // machine has seconds of slack before the broker would redeliver.
    let ack_wait = Duration::from_secs(6);
    let consumer = consumer_acking_within(&nats, &redis, &ledger_path, None, "6s");
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    publish(&js, "c-1", 100).await;
    consumer.wait_for_line("charging c-1 (attempt 1)");
    // Reserved; the store stops answering before the charge returns.
    redis.pause();
    let charged = tokio::task::spawn_blocking({
        let path = ledger_path.clone();
        move || std::fs::read_to_string(path).expect("read the ledger")
    })
    .await
    .expect("join");
    assert!(charged.contains("charged c-1 100 cents"), "{charged:?}");
    consumer.wait_for_line("executed c-1 (attempt 1); acknowledging once it is recorded");
    // Longer than an ack wait: in progress, neither acknowledged nor
    // redelivered.
    let until = tokio::time::Instant::now() + ack_wait + Duration::from_secs(2);
    while tokio::time::Instant::now() < until {
        assert_eq!(
            acks(&js).await,
            (0, 1),
            "acknowledged or redelivered before its outcome was recorded"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The store answers again: the layer records the outcome, then the
    // consumer acknowledges.
    redis.resume();
    consumer.wait_for_line("the outcome is recorded; acknowledged");
    let floor = idem_tests::poll_until(
        Duration::from_secs(20),
        async || acks(&js).await,
        |(floor, _)| *floor == 1,
    )
    .await;
    assert_eq!(floor, (1, 1), "acknowledged once, never redelivered");
    // A duplicate message is answered from the record: no second charge
    // (one would block on the ledger, which nobody reads now).
    publish(&js, "c-1", 100).await;
    consumer.wait_for_line("answered c-1 from the record");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A charge whose key another owner holds (a live lease) is NAKed and
/// redelivered by the broker, never charged beside it; once that lease
/// lapses, a redelivery takes over and charges once, as attempt 2. A
/// changed payload under a charged id is terminated: the broker publishes
/// its termination advisory and never redelivers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_in_progress_is_redelivered_and_a_changed_one_terminated() {
    use futures_util::StreamExt;
    use idem_core::{IdempotencyKey, Reservation, ReserveRequest, Store};
    let Some(nats) = NatsServer::spawn() else {
        return;
    };
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (dir, ledger_path) = ledger_dir();
    // Another owner holds c-9 for 3 s: the same scope and fingerprint the
    // consumer computes for the message.
    let payload = serde_json::json!({ "id": "c-9", "account": "acme", "cents": 900 });
    let command = idem_layer::Command::new(
        "acme",
        "charge",
        IdempotencyKey::parse(b"c-9").expect("key"),
        &payload,
    )
    .expect("command");
    let store = idem_redis::RedisStore::from_url(&redis.url()).expect("store");
    let held = store
        .reserve(&ReserveRequest {
            scope: command.scope().clone(),
            fingerprint: command.fingerprint(),
            lease: Duration::from_secs(3),
            retention: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(held, Reservation::Acquired(_)), "{held:?}");
    let held_at = std::time::Instant::now();

    let consumer = consumer(&nats, &redis, &ledger_path, None);
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let mut terminated = client
        .subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.CHARGES.charge-consumer")
        .await
        .expect("subscribe");
    let js = async_nats::jetstream::new(client);
    js.publish("charges", payload.to_string().into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let charged = idem_tests::poll_until(
        Duration::from_secs(30),
        async || ledger(&ledger_path).get("c-9").copied(),
        |charges| charges.is_some(),
    )
    .await;
    assert_eq!(charged, Some(1), "charged once");
    assert!(
        held_at.elapsed() >= Duration::from_secs(3),
        "charged {:?} after the other owner took the key, inside its lease",
        held_at.elapsed()
    );
    let text = std::fs::read_to_string(&ledger_path).expect("ledger");
    assert!(text.contains("charged c-9 900 cents (attempt 2)"), "{text}");
    let (floor, deliveries) = idem_tests::poll_until(
        Duration::from_secs(20),
        async || acks(&js).await,
        |(floor, _)| *floor == 1,
    )
    .await;
    assert_eq!(floor, 1, "acknowledged once charged");
    assert!(
        deliveries >= 2,
        "the NAKed message was redelivered ({deliveries} deliveries)"
    );

    // The same id with another amount: a conflict, terminated.
    publish(&js, "c-9", 901).await;
    let advisory = tokio::time::timeout(Duration::from_secs(30), terminated.next())
        .await
        .expect("a termination advisory")
        .expect("subscription open");
    let advisory: serde_json::Value =
        serde_json::from_slice(&advisory.payload).expect("advisory JSON");
    assert_eq!(advisory["stream_seq"], 2, "{advisory}");
    consumer.wait_for_line("c-9 arrived with another payload");
    let (floor, _) = idem_tests::poll_until(
        Duration::from_secs(20),
        async || acks(&js).await,
        |(floor, _)| *floor == 2,
    )
    .await;
    assert_eq!(floor, 2, "the terminated message is settled, not pending");
    assert_eq!(
        acks(&js).await.1,
        deliveries + 1,
        "the terminated message was delivered once, never again"
    );
    assert_eq!(
        ledger(&ledger_path).get("c-9"),
        Some(&1),
        "never charged again"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
