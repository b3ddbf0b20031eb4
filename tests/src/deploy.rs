//! The operations kit in `deploy/` as the tests read it: `promtool` on its
//! rules, the metric names its rules and dashboards query, and the names a
//! `/metrics` text exports.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

/// The repository's `deploy/` folder.
pub fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `promtool` in `deploy/prometheus` with these arguments: its output, or
/// the test fails with it.
pub fn promtool(args: &[&str]) -> String {
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

/// The rules file `rules` (in `deploy/prometheus`) is valid, its unit
/// tests `tests` pass, and every alert of it has a test that expects it
/// to fire: the alerts' names.
pub fn check_rules(rules: &str, tests: &str) -> Vec<String> {
    let checked = promtool(&["check", "rules", rules]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", tests]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    let text = std::fs::read_to_string(deploy().join("prometheus").join(rules)).expect("rules");
    let tests = std::fs::read_to_string(deploy().join("prometheus").join(tests)).expect("tests");
    let alerts: Vec<String> = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .map(str::to_owned)
        .collect();
    for alert in &alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - "
            )),
            "no test fires {alert}"
        );
    }
    alerts
}

/// The queries of a Grafana dashboard in `deploy/grafana`.
pub fn dashboard_queries(file: &str) -> Vec<String> {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana").join(file)).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    queries
}

/// The `idem_*` names in a PromQL text (recording rules' own names, which
/// hold a colon, are not metrics a gateway exports).
pub fn metric_names(promql: &str) -> BTreeSet<String> {
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
pub fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}
