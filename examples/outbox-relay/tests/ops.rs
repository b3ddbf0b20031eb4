//! The relay's operations kit in `deploy/`: its Prometheus rules pass their
//! unit tests in `promtool`, and every metric the rules and its Grafana
//! dashboard query is on the `/metrics` of a relay that has published
//! nothing yet.

use std::{collections::BTreeSet, process::Command};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use idem_tests::{
    client,
    deploy::{check_rules, dashboard_queries, deploy, exported, metric_names},
    nats_server::NatsServer,
    postgres_server::PgServer,
    process::Spawned,
    redis_server::{binary_available, skip_or_fail},
    send,
};

/// A migrated database of the shared server and a private NATS.
struct Scene {
    database: String,
    store: idem_postgres::PgStore,
    nats: NatsServer,
}

impl Scene {
    /// `None` skips (no PostgreSQL or `nats-server`, outside CI).
    async fn new() -> Option<Self> {
        let server = PgServer::shared()?;
        let nats = NatsServer::spawn()?;
        let database = server.database();
        let store = idem_postgres::PgStore::from_url(&database).expect("store");
        store.migrate().await.expect("migrate");
        Some(Self {
            database,
            store,
            nats,
        })
    }

    /// The `outbox-relay` binary on this scene, with `settings` besides.
    fn relay(&self, settings: &[(&str, &str)]) -> Spawned {
        Spawned::start(
            Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
                .env("DATABASE_URL", &self.database)
                .env("NATS_URL", self.nats.url())
                .env("OUTBOX_METRICS", "127.0.0.1:0")
                .env("RUST_LOG", "warn")
                .envs(settings.iter().copied()),
        )
    }
}

/// A relay's `/metrics` text.
async fn metrics_of(relay: &Spawned) -> String {
    let request = Request::get(format!("http://{}/metrics", relay.address()))
        .body(Full::new(Bytes::new()))
        .expect("request");
    String::from_utf8_lossy(&send(&client(), request).await.body).into_owned()
}

/// The rules are valid, and each alert fires on the series its test
/// gives and stays quiet on the others (`idem-outbox.rules.test.yml`).
#[test]
fn the_relays_alert_rules_pass_their_unit_tests() {
    if !binary_available("promtool") {
        skip_or_fail("promtool");
        return;
    }
    let alerts = check_rules("idem-outbox.rules.yml", "idem-outbox.rules.test.yml");
    assert_eq!(
        alerts,
        [
            "IdemOutboxStalled",
            "IdemOutboxPublishFailing",
            "IdemOutboxLagHigh",
            "IdemOutboxEventRefused"
        ]
    );
}

/// A query of a name the relay does not export would show an empty panel,
/// or never alert.
#[tokio::test]
async fn every_metric_the_relays_dashboard_and_rules_query_is_exported_from_the_start() {
    let Some(scene) = Scene::new().await else {
        return;
    };
    let relay = scene.relay(&[]);
    let names = exported(&metrics_of(&relay).await);

    let queries = dashboard_queries("idem-outbox.json");
    assert!(queries.len() >= 8, "{queries:?}");
    let rules =
        std::fs::read_to_string(deploy().join("prometheus/idem-outbox.rules.yml")).expect("rules");
    let queried: BTreeSet<String> = queries
        .iter()
        .flat_map(|q| metric_names(q))
        .chain(metric_names(&rules))
        .collect();
    assert!(queried.len() >= 7, "{queried:?}");
    let missing: Vec<&String> = queried.iter().filter(|n| !names.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}; exported: {names:?}"
    );
}

/// The backlog gauges follow a relay that is behind, busy with full
/// batches (one event each, every mark slowed by a trigger): they read
/// the backlog when it starts and again as it shrinks, never only once
/// the relay is idle.
#[tokio::test]
async fn the_backlog_gauges_move_while_every_batch_is_full() {
    let Some(scene) = Scene::new().await else {
        return;
    };
    let store = &scene.store;
    let fill = "INSERT INTO idem_records_outbox (id, position, subject, payload, created_at_ms) \
                SELECT 'slow-' || i, 1, 'charges', 'x', 0 FROM generate_series(1, 1000) AS i; \
                CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS \
                  $$ BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$; \
                CREATE TRIGGER slow BEFORE UPDATE ON idem_records_outbox \
                  FOR EACH ROW EXECUTE FUNCTION slow();";
    sqlx::raw_sql(fill)
        .execute(store.pool())
        .await
        .expect("fill");
    let relay = scene.relay(&[
        ("OUTBOX_STREAM", "CHARGES"),
        ("OUTBOX_SUBJECTS", "charges"),
        ("OUTBOX_BATCH", "1"),
    ]);
    let backlog = async || {
        metrics_of(&relay)
            .await
            .lines()
            .find_map(|line| line.strip_prefix("idem_outbox_backlog "))
            .and_then(|value| value.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let mut seen = BTreeSet::new();
    idem_tests::poll_until(
        std::time::Duration::from_secs(20),
        async || {
            let now = backlog().await;
            if now > 0.0 {
                seen.insert(now as u64);
            }
            seen.len()
        },
        |readings| *readings >= 2,
    )
    .await;
    assert!(
        seen.len() >= 2,
        "the backlog gauge did not move while the relay was behind: {seen:?}"
    );
    let mut tx = store.pool().begin().await.expect("begin");
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idem_records_outbox WHERE published_at_ms IS NULL",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("left");
    tx.commit().await.expect("commit");
    assert!(
        left > 0,
        "the relay caught up before the gauge was read twice"
    );
}
