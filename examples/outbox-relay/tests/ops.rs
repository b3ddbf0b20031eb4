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
            "IdemOutboxLagHigh"
        ]
    );
}

/// A query of a name the relay does not export would show an empty panel,
/// or never alert.
#[tokio::test]
async fn every_metric_the_relays_dashboard_and_rules_query_is_exported_from_the_start() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let Some(nats) = NatsServer::spawn() else {
        return;
    };
    let database = server.database();
    let store = idem_postgres::PgStore::from_url(&database).expect("store");
    store.migrate().await.expect("migrate");
    let relay = Spawned::start(
        Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .env("DATABASE_URL", &database)
            .env("NATS_URL", nats.url())
            .env("OUTBOX_METRICS", "127.0.0.1:0")
            .env("RUST_LOG", "warn"),
    );
    let request = Request::get(format!("http://{}/metrics", relay.address()))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let text = String::from_utf8_lossy(&send(&client(), request).await.body).into_owned();
    let names = exported(&text);

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
