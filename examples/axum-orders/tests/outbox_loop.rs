//! The loop, end to end, with real processes killed by SIGKILL: the
//! `axum-orders` service takes keyed payments over HTTP and commits the
//! ledger row, the record and the `charges` event together; the outbox
//! relay publishes the event to a private `nats-server -js`; the charge
//! consumer charges once per event. Each component is killed at its crash
//! point (the service before its commit; the relay after the commit and
//! before publishing, and after publishing and before marking; the
//! consumer after charging and before acknowledging, and after charging
//! and before recording, which a redelivery reconciles), clients retry
//! throughout, and every key ends with one ledger row, one message in the
//! stream and one charge. Directly and behind PgBouncer.
//!
//! The relay and the consumer run as children of this test binary (the
//! ignored test `child` runs the library entry point their binaries call,
//! `outbox_relay::run` and `charge_consumer::run`), so that each is a real
//! process built with this test's crash points.

use std::{collections::BTreeMap, process::Command, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{
    Reply, client, nats_server::NatsServer, pgbouncer::PgBouncer, postgres_server::PgServer,
    process::Spawned, send,
};

/// The service's lease: the retry after a kill before the commit waits it.
const LEASE: &str = "2s";
/// The consumer's ack wait: a charge killed before its ack is redelivered
/// after it.
const ACK_WAIT: &str = "2s";

/// A child process's role (`OUTBOX_LOOP_ROLE`): `relay` or `consumer`.
/// Not a test of its own: the loop's tests start it as a child.
#[test]
#[ignore = "a child process of the loop's tests"]
fn child() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    match std::env::var("OUTBOX_LOOP_ROLE").as_deref() {
        Ok("relay") => runtime.block_on(async {
            let options = outbox_relay::Options::from_vars();
            let hold = std::env::var("RELAY_TEST_HOLD").ok();
            let result = outbox_relay::run(options, move |relay| {
                relay.on_stage(move |stage| {
                    let held = match stage {
                        idem_postgres::relay::Stage::Selected { .. } => "before-publish",
                        idem_postgres::relay::Stage::Published { .. } => "after-publish",
                        _ => "",
                    };
                    let hold = hold.as_deref() == Some(held);
                    async move {
                        if hold {
                            eprintln!("outbox-relay: holding {held}");
                            std::future::pending::<()>().await;
                        }
                    }
                })
            })
            .await;
            result.expect("the relay ran");
        }),
        Ok("consumer") => runtime
            .block_on(charge_consumer::run())
            .expect("the consumer ran"),
        other => panic!("no role: {other:?}"),
    }
}

/// The components' shared settings.
struct Loop {
    /// The service's database, as the service reaches it.
    service_db: String,
    /// The same database, directly (the relay's `LISTEN`, the checks).
    direct_db: String,
    pooled: bool,
    consumer_db: String,
    nats: NatsServer,
    ledger: std::path::PathBuf,
    pool: sqlx::PgPool,
}

impl Loop {
    fn service(&self) -> Service {
        let process = Spawned::start(
            Command::new(env!("CARGO_BIN_EXE_axum-orders"))
                .env("IDEM_LISTEN", "127.0.0.1:0")
                .env("IDEM_STORE", &self.service_db)
                .env("IDEM_LEASE", LEASE)
                .env(
                    "IDEM_TRANSACTION_POOLER",
                    if self.pooled { "true" } else { "false" },
                )
                .env("ORDERS_TEST_HOOKS", "1"),
        );
        let addr = process.address();
        Service { process, addr }
    }

    fn child(&self, role: &str) -> Command {
        let mut command = Command::new(std::env::current_exe().expect("test binary"));
        command
            .args(["--exact", "child", "--ignored", "--nocapture"])
            .env("OUTBOX_LOOP_ROLE", role)
            .env("NATS_URL", self.nats.url())
            .env("RUST_LOG", "warn");
        command
    }

    /// The relay, held at `hold` when given.
    fn relay(&self, hold: Option<&str>) -> Spawned {
        let mut command = self.child("relay");
        command
            .env("DATABASE_URL", &self.service_db)
            .env("OUTBOX_LISTEN_URL", &self.direct_db)
            .env(
                "IDEM_TRANSACTION_POOLER",
                if self.pooled { "true" } else { "false" },
            )
            .env("OUTBOX_STREAM", "CHARGES")
            .env("OUTBOX_SUBJECTS", "charges")
            .env("OUTBOX_METRICS", "127.0.0.1:0")
            .env_remove("RELAY_TEST_HOLD");
        if let Some(hold) = hold {
            command.env("RELAY_TEST_HOLD", hold);
        }
        Spawned::start_after(&mut command, "outbox-relay metrics on")
    }

    /// The consumer, stopping at `crash` (`(variable, charge id)`) when
    /// given: `CONSUMER_CRASH_AFTER_EXECUTE` (charged and recorded, not
    /// acknowledged) or `CONSUMER_CRASH_BEFORE_RECORD` (charged, not
    /// recorded).
    fn consumer(&self, crash: Option<(&str, &str)>) -> Spawned {
        let mut command = self.child("consumer");
        command
            .env("IDEM_STORE", &self.consumer_db)
            .env("IDEM_LEASE", LEASE)
            .env("LEDGER", &self.ledger)
            .env("ACK_WAIT", ACK_WAIT)
            .env_remove("CONSUMER_CRASH_AFTER_EXECUTE")
            .env_remove("CONSUMER_CRASH_BEFORE_RECORD");
        if let Some((variable, id)) = crash {
            command.env(variable, id);
        }
        Spawned::start_after(&mut command, "charge-consumer consuming")
    }

    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .persistent(false)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    /// The consumer's charges, by charge id.
    fn charges(&self) -> BTreeMap<String, usize> {
        let mut charges = BTreeMap::new();
        for line in std::fs::read_to_string(&self.ledger)
            .unwrap_or_default()
            .lines()
        {
            if let Some(id) = line
                .strip_prefix("charged ")
                .and_then(|rest| rest.split(' ').next())
            {
                *charges.entry(id.to_owned()).or_default() += 1;
            }
        }
        charges
    }

    /// Whether the consumer has acknowledged every message of the stream
    /// (none pending, none waiting for its acknowledgement).
    async fn all_acknowledged(&self) -> bool {
        let client = async_nats::connect(self.nats.url()).await.expect("nats");
        let jetstream = async_nats::jetstream::new(client);
        let stream = jetstream.get_stream("CHARGES").await.expect("stream");
        let Ok(mut consumer) = stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>("charge-consumer")
            .await
        else {
            return false;
        };
        let info = consumer.info().await.expect("consumer info");
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    /// The stream's messages, counted by message id.
    async fn stream(&self) -> BTreeMap<String, usize> {
        let mut ids = BTreeMap::new();
        for (id, _) in idem_tests::nats_server::stream_messages(&self.nats.url(), "CHARGES").await {
            *ids.entry(id).or_default() += 1;
        }
        ids
    }
}

struct Service {
    process: Spawned,
    addr: String,
}

impl Service {
    fn pay(&self, key: &str, hold: Option<&str>) -> Request<Full<Bytes>> {
        let mut request = Request::post(format!("http://{}/payments", self.addr))
            .header("idempotency-key", key)
            .header("x-tenant-id", "shop")
            .header("content-type", "application/json");
        if let Some(point) = hold {
            request = request.header("x-test-hold", point);
        }
        let body = format!("{{\"account\":\"{key}\",\"cents\":1299}}");
        request.body(Full::new(Bytes::from(body))).expect("request")
    }

    /// Pays `key` until the answer is final (the client retries while the
    /// key is in progress or the service is gone; bounded).
    async fn pay_until_done(&self, key: &str) -> Reply {
        let reply = idem_tests::poll_until(
            Duration::from_secs(30),
            async || send(&client(), self.pay(key, None)).await,
            |reply| reply.status != StatusCode::CONFLICT,
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        reply
    }
}

/// The charge id of a payment's answer (`pay-<ledger id>`).
fn charge_id(reply: &Reply) -> String {
    let body: serde_json::Value = serde_json::from_slice(&reply.body).expect("json");
    format!("pay-{}", body["id"].as_i64().expect("id"))
}

async fn run_loop(the_loop: Loop) {
    let started = std::time::Instant::now();
    // Where the time went, shown when the test fails.
    let step = |what: &str| eprintln!("{:>6} ms: {what}", started.elapsed().as_millis());
    let mut service = the_loop.service();
    let mut relay = the_loop.relay(None);
    let mut consumer = the_loop.consumer(None);
    let mut paid = BTreeMap::new();

    // 1. The service dies before its commit: nothing of the payment
    //    exists; the client's retry after the lease runs it once.
    let lost = tokio::spawn(client().request(service.pay("p1", Some("before-commit"))));
    service.process.wait_for_line("holding before commit");
    service.process.kill();
    let _ = lost.await;
    assert_eq!(the_loop.count("SELECT count(*) FROM payments").await, 0);
    assert_eq!(
        the_loop
            .count("SELECT count(*) FROM idem_records_outbox")
            .await,
        0
    );
    service = the_loop.service();
    paid.insert("p1", charge_id(&service.pay_until_done("p1").await));

    step("p1 paid after the service's kill");
    // 2. The relay dies after the commit, before publishing.
    relay.kill();
    relay = the_loop.relay(Some("before-publish"));
    paid.insert("p2", charge_id(&service.pay_until_done("p2").await));
    relay.wait_for_line("holding before-publish");
    relay.kill();
    relay = the_loop.relay(None);

    step("p2 paid, the relay killed before publishing");
    // 3. The relay dies after publishing, before marking: the next one
    //    publishes again, and the broker drops the copy.
    relay.kill();
    relay = the_loop.relay(Some("after-publish"));
    paid.insert("p3", charge_id(&service.pay_until_done("p3").await));
    relay.wait_for_line("holding after-publish");
    relay.kill();
    relay = the_loop.relay(None);

    step("p3 paid, the relay killed after publishing");
    // 4. The consumer dies after charging, before acknowledging: the
    //    redelivery is answered from its record.
    consumer.kill();
    let reply = service.pay_until_done("p4").await;
    let p4 = charge_id(&reply);
    paid.insert("p4", p4.clone());
    consumer = the_loop.consumer(Some(("CONSUMER_CRASH_AFTER_EXECUTE", &p4)));
    consumer.wait_for_line("crash point");
    consumer.kill();

    // 5. The consumer dies after charging, before recording: the outcome
    //    is unknown; the redelivery after the lease takes the charge over
    //    and reconciles it against the ledger.
    let reply = service.pay_until_done("p5").await;
    let p5 = charge_id(&reply);
    paid.insert("p5", p5.clone());
    consumer = the_loop.consumer(Some(("CONSUMER_CRASH_BEFORE_RECORD", &p5)));
    consumer.wait_for_line("crash point: charged");
    consumer.kill();
    consumer = the_loop.consumer(None);
    step("p5 charged, the consumer killed before recording it");

    step("p4 charged, the consumer killed before its ack");
    // Clients retry every key once more: replays, nothing runs again.
    for key in paid.keys() {
        let replay = send(&client(), service.pay(key, None)).await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert!(replay.replayed(), "{key} ran again");
    }

    step("every key replayed");
    // Every charge is made, once.
    idem_tests::poll_until(
        Duration::from_secs(60),
        async || the_loop.charges().len(),
        |charged| *charged >= paid.len(),
    )
    .await;
    idem_tests::wait_until(Duration::from_secs(30), "every event marked", async || {
        the_loop
            .count("SELECT count(*) FROM idem_records_outbox WHERE published_at_ms IS NULL")
            .await
            == 0
    })
    .await;
    step("every charge made, every event marked");
    // The charge killed before its ack is redelivered after the ack wait
    // and answered from the consumer's record.
    idem_tests::wait_until(
        Duration::from_secs(30),
        "every message acknowledged",
        async || the_loop.all_acknowledged().await,
    )
    .await;
    step("every message acknowledged");
    let charges = the_loop.charges();
    let expected: BTreeMap<String, usize> = paid.values().map(|id| (id.clone(), 1)).collect();
    assert_eq!(charges, expected, "not one charge per payment");
    for key in paid.keys() {
        let rows = the_loop
            .count(&format!(
                "SELECT count(*) FROM payments WHERE account = '{key}'"
            ))
            .await;
        assert_eq!(rows, 1, "{key} has {rows} ledger rows");
    }
    let stream = the_loop.stream().await;
    assert_eq!(stream.len(), paid.len(), "{stream:?}");
    assert!(
        stream.values().all(|copies| *copies == 1),
        "an event reached the stream twice: {stream:?}"
    );
    let events = the_loop
        .count("SELECT count(*) FROM idem_records_outbox")
        .await;
    assert_eq!(events, paid.len() as i64, "one event per payment");
    drop((service, relay, consumer));
}

/// A fresh database for the service and one for the consumer's records,
/// a pool on the service's, a private NATS and a ledger file.
async fn scene(server: &PgServer, bouncer: Option<&PgBouncer>) -> Option<Loop> {
    let nats = NatsServer::spawn()?;
    let direct_db = server.database();
    let pool = sqlx::PgPool::connect(&direct_db).await.expect("connect");
    let ledger = std::env::temp_dir().join(format!(
        "idem-outbox-loop-{}.ledger",
        uuid::Uuid::new_v4().simple()
    ));
    Some(Loop {
        service_db: bouncer.map_or_else(|| direct_db.clone(), |b| b.url(&direct_db)),
        direct_db,
        pooled: bouncer.is_some(),
        consumer_db: server.database(),
        nats,
        ledger,
        pool,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_row_one_event_one_charge_per_key_whatever_is_killed() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(the_loop) = scene(server, None).await else {
        return;
    };
    let ledger = the_loop.ledger.clone();
    run_loop(the_loop).await;
    let _ = std::fs::remove_file(ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_row_one_event_one_charge_per_key_behind_pgbouncer() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(bouncer) = PgBouncer::spawn(server, 4) else {
        return;
    };
    let Some(the_loop) = scene(server, Some(&bouncer)).await else {
        return;
    };
    let ledger = the_loop.ledger.clone();
    run_loop(the_loop).await;
    let _ = std::fs::remove_file(ledger);
}
