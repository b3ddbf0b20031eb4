//! The operations kit in `deploy/`: the Prometheus rules pass their unit
//! tests in `promtool`, and every metric the rules and the Grafana
//! dashboard query is exported by a running gateway.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use idem_tests::{
    client, postgres_server::PgServer, process::Spawned, redis_server::binary_available,
    redis_server::skip_or_fail, send,
};

/// The repository's `deploy/` folder.
fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// `promtool` in this folder with these arguments: its output, or the
/// test fails with it.
fn promtool(args: &[&str]) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(deploy().join("prometheus"))
        .output()
        .expect("run promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?} failed:\n{said}");
    said
}

/// The rules are valid, and each alert fires on the series its test
/// gives and stays quiet on the others (`idem.rules.test.yml`).
#[test]
fn the_alert_rules_pass_their_unit_tests() {
    if !binary_available("promtool") {
        skip_or_fail("promtool");
        return;
    }
    let checked = promtool(&["check", "rules", "idem.rules.yml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", "idem.rules.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Every alert of the rules has a test.
    let rules = std::fs::read_to_string(deploy().join("prometheus/idem.rules.yml")).expect("rules");
    let tests =
        std::fs::read_to_string(deploy().join("prometheus/idem.rules.test.yml")).expect("tests");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "no test fires {alert}"
        );
    }
}

/// The `idem_*` names in a PromQL text (recording rules' own names, which
/// hold a colon, are not metrics a gateway exports).
fn metric_names(promql: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = promql.as_bytes();
    let mut at = 0;
    while let Some(found) = promql[at..].find("idem_") {
        let start = at + found;
        let preceded = start > 0
            && (bytes[start - 1].is_ascii_alphanumeric()
                || bytes[start - 1] == b'_'
                || bytes[start - 1] == b':');
        let end = promql[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .map_or(promql.len(), |n| start + n);
        let name = &promql[start..end];
        if !preceded && !name.contains(':') {
            names.insert(name.to_owned());
        }
        at = end;
    }
    names
}

/// The names of the samples of a `/metrics` text.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// A gateway binary's `/metrics` text, right after it started.
async fn metrics_of(gateway: &Spawned) -> String {
    let request = Request::get(format!("http://{}/metrics", gateway.address()))
        .body(Full::new(Bytes::new()))
        .expect("request");
    String::from_utf8_lossy(&send(&client(), request).await.body).into_owned()
}

fn gateway(args: &[&str]) -> Spawned {
    Spawned::start(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn"),
    )
}

/// Every metric the dashboard's panels and the rules query is on the
/// `/metrics` of a gateway that has served nothing yet: on the memory
/// store (its record gauges) or on PostgreSQL (its pool's). A query of a
/// name no gateway exports would show an empty panel, or never alert.
#[tokio::test]
async fn every_metric_the_dashboard_and_the_rules_query_is_exported_from_the_start() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/idem-gateway.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    let panels = dashboard["panels"].as_array().expect("panels");
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    assert!(queries.len() >= 15, "{queries:?}");
    let rules = std::fs::read_to_string(deploy().join("prometheus/idem.rules.yml")).expect("rules");
    let dashboard_names: BTreeSet<String> = queries.iter().flat_map(|q| metric_names(q)).collect();
    let rule_names = metric_names(&rules);
    assert!(dashboard_names.len() >= 10, "{dashboard_names:?}");
    assert!(rule_names.len() >= 8, "{rule_names:?}");

    let memory = gateway(&[]);
    let postgres = gateway(&["--store", &server.database()]);
    let mut names = exported(&metrics_of(&memory).await);
    names.extend(exported(&metrics_of(&postgres).await));
    let missing: Vec<&String> = dashboard_names
        .union(&rule_names)
        .filter(|name| !names.contains(*name))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}; exported: {names:?}"
    );
}

/// The name finder sees what a query names, not a recording rule's name
/// nor a label value.
#[test]
fn metric_names_are_read_off_a_query() {
    let names = metric_names(
        "sum by (job) (rate(idem_requests_total{outcome=\"x\"}[5m])) / idem:records_lapsed:max \
         + histogram_quantile(0.5, idem_store_duration_seconds_bucket)",
    );
    let expected: BTreeSet<String> = ["idem_requests_total", "idem_store_duration_seconds_bucket"]
        .map(str::to_owned)
        .into();
    assert_eq!(names, expected);
}
