//! The operations kit in `deploy/`: the Prometheus rules pass their unit
//! tests in `promtool`, and every metric the rules and the Grafana
//! dashboard query is exported by a running gateway.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use idem_tests::{
    client,
    deploy::{check_rules, dashboard_queries, deploy, exported, metric_names},
    postgres_server::PgServer,
    process::Spawned,
    redis_server::binary_available,
    redis_server::skip_or_fail,
    send,
};

/// The rules are valid, and each alert fires on the series its test
/// gives and stays quiet on the others (`idem.rules.test.yml`).
#[test]
fn the_alert_rules_pass_their_unit_tests() {
    if !binary_available("promtool") {
        skip_or_fail("promtool");
        return;
    }
    // Valid, its unit tests pass, and every alert of the rules has a test.
    let alerts = check_rules("idem.rules.yml", "idem.rules.test.yml");
    assert!(alerts.len() >= 10, "{alerts:?}");
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
    let queries = dashboard_queries("idem-gateway.json");
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

/// A request to the gateway at `addr` with these headers.
fn request(
    addr: std::net::SocketAddr,
    method: http::Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", "Bearer alice")
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
        .expect("request")
}

/// The caller's trace: its id and the caller's span.
const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The gateway continues a caller's trace with a span of its own as the
/// upstream's parent, passes `tracestate` on, and starts a trace for a
/// request without one; keyed or not.
#[tokio::test]
async fn the_upstream_continues_the_callers_trace() {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &[]).await;
    let http = client();
    let traced = [("traceparent", CALLER), ("tracestate", "vendor=opaque")];
    let keyed = [
        ("traceparent", CALLER),
        ("tracestate", "vendor=opaque"),
        ("idempotency-key", "trace-1"),
    ];
    let first = send(
        &http,
        request(gateway.addr, http::Method::POST, "/orders", &keyed),
    )
    .await;
    assert_eq!(first.status, http::StatusCode::CREATED, "{first:?}");
    let plain = send(
        &http,
        request(gateway.addr, http::Method::GET, "/items", &traced),
    )
    .await;
    assert_eq!(plain.status, http::StatusCode::CREATED, "{plain:?}");
    let fresh = send(
        &http,
        request(
            gateway.addr,
            http::Method::GET,
            "/items",
            &[("tracestate", "a=b")],
        ),
    )
    .await;
    assert_eq!(fresh.status, http::StatusCode::CREATED, "{fresh:?}");
    let bad = [
        ("traceparent", "00-XYZ-00f067aa0ba902b7-01"),
        ("tracestate", "a=b"),
    ];
    let unreadable = send(
        &http,
        request(gateway.addr, http::Method::GET, "/items", &bad),
    )
    .await;
    assert_eq!(
        unreadable.status,
        http::StatusCode::CREATED,
        "{unreadable:?}"
    );

    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 4, "{seen:?}");
    let fields = |value: &Option<String>| -> Vec<String> {
        let value = value.as_deref().expect("a traceparent");
        assert_eq!(value.len(), 55, "{value}");
        value.split('-').map(str::to_owned).collect()
    };
    let mut spans = Vec::new();
    for continued in &seen[..2] {
        let parts = fields(&continued.traceparent);
        assert_eq!(parts[0], "00");
        assert_eq!(
            parts[1], "4bf92f3577b34da6a3ce929d0e0e4736",
            "the caller's trace"
        );
        assert_ne!(
            parts[2], "00f067aa0ba902b7",
            "the gateway's span is the parent"
        );
        assert_ne!(parts[2], "0000000000000000");
        assert_eq!(parts[3], "01", "the caller's flags");
        assert_eq!(continued.tracestate.as_deref(), Some("vendor=opaque"));
        spans.push(parts[2].clone());
    }
    assert_ne!(spans[0], spans[1], "a span per request");
    for started in &seen[2..] {
        let parts = fields(&started.traceparent);
        assert_ne!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(parts[1], "00000000000000000000000000000000");
        assert_eq!(parts[3], "00", "not sampled: nothing is recorded");
        assert_eq!(started.tracestate, None, "no state without its trace");
    }
    assert_ne!(
        fields(&seen[2].traceparent)[1],
        fields(&seen[3].traceparent)[1]
    );
}

/// A collector of OTLP/HTTP spans on loopback: every span it received.
async fn collector() -> (
    idem_tests::TestServer,
    std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>,
) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = std::sync::Arc::clone(&spans);
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let kept = std::sync::Arc::clone(&kept);
            async move {
                let export = ExportTraceServiceRequest::decode(body).expect("an OTLP export");
                let mut kept = kept.lock().expect("spans");
                for resource in export.resource_spans {
                    let name = resource
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .any(|kv| kv.key == "service.name");
                    assert!(name, "the resource names the service");
                    for scope in resource.scope_spans {
                        kept.extend(scope.spans);
                    }
                }
                http::StatusCode::OK
            }
        }),
    );
    (idem_tests::TestServer::start(app).await, spans)
}

/// An attribute of a span, as text.
fn attribute(span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let value = span
        .attributes
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?;
    match value.value.as_ref()? {
        Value::StringValue(text) => Some(text.clone()),
        Value::IntValue(n) => Some(n.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// With `--otlp-endpoint`, the gateway exports its span of each request:
/// in the caller's trace, the caller's span as its parent, the span the
/// upstream got as its parent, with the outcome, the scope hash and the
/// attempt, never the raw key. A trace the caller did not sample is not
/// exported.
#[tokio::test]
async fn the_gateways_spans_are_exported_over_otlp() {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let (collector, spans) = collector().await;
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let endpoint = format!("http://{}", collector.addr);
    let gateway = start_gateway(&origin, &["--otlp-endpoint", &endpoint]).await;
    let http = client();
    let key = "otlp-raw-key-5d2c";
    let keyed = [("traceparent", CALLER), ("idempotency-key", key)];
    let first = send(
        &http,
        request(gateway.addr, http::Method::POST, "/orders", &keyed),
    )
    .await;
    assert_eq!(first.status, http::StatusCode::CREATED, "{first:?}");
    let replay = send(
        &http,
        request(gateway.addr, http::Method::POST, "/orders", &keyed),
    )
    .await;
    assert!(replay.replayed(), "{replay:?}");
    let unsampled = [(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    )];
    let quiet = send(
        &http,
        request(gateway.addr, http::Method::GET, "/items", &unsampled),
    )
    .await;
    assert_eq!(quiet.status, http::StatusCode::CREATED);
    // A request without a trace starts a sampled one.
    let fresh = send(
        &http,
        request(gateway.addr, http::Method::GET, "/fresh", &[]),
    )
    .await;
    assert_eq!(fresh.status, http::StatusCode::CREATED);
    assert_eq!(upstream.runs(), 3);

    idem_tests::wait_until(
        std::time::Duration::from_secs(30),
        "the collector received three spans",
        async || spans.lock().expect("spans").len() >= 3,
    )
    .await;
    let spans = spans.lock().expect("spans").clone();
    assert_eq!(
        spans.len(),
        3,
        "the unsampled trace is not exported: {spans:?}"
    );
    let caller_trace = hex_decode("4bf92f3577b34da6a3ce929d0e0e4736");
    let (mut executed, mut replayed) = (None, None);
    for span in &spans[..] {
        if span.trace_id == caller_trace {
            assert_eq!(span.parent_span_id, hex_decode("00f067aa0ba902b7"));
            assert_eq!(
                attribute(span, "http.response.status_code").as_deref(),
                Some("201")
            );
            match attribute(span, "idem.outcome").as_deref() {
                Some("executed") => executed = Some(span.clone()),
                Some("replayed") => replayed = Some(span.clone()),
                other => panic!("outcome {other:?}: {span:?}"),
            }
        } else {
            assert_eq!(
                attribute(span, "url.path").as_deref(),
                Some("/fresh"),
                "{span:?}"
            );
            assert!(span.parent_span_id.is_empty(), "a new trace: {span:?}");
        }
        assert!(
            !format!("{span:?}").contains(key),
            "the raw key is exported: {span:?}"
        );
    }
    let executed = executed.expect("the executed request's span");
    let replayed = replayed.expect("the replay's span");
    // The upstream's parent is the gateway's span of the executed request.
    let seen = upstream.seen.lock().expect("seen").clone();
    let parent = seen[0].traceparent.as_deref().expect("traceparent");
    assert_eq!(hex_decode(&parent[36..52]), executed.span_id);
    let scope = attribute(&executed, "idem.scope").expect("the scope hash");
    assert_eq!(scope.len(), 64);
    assert_eq!(attribute(&executed, "idem.attempt").as_deref(), Some("1"));
    assert_eq!(
        attribute(&replayed, "idem.scope"),
        None,
        "a replay reaches no upstream"
    );
    assert_eq!(
        attribute(&executed, "http.request.method").as_deref(),
        Some("POST")
    );
}

fn hex_decode(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The records admin token of the operator page's tests.
const ADMIN: &str = "operator-token-0123456789";

/// A gateway whose keyed `/slow` requests go stuck: the upstream holds
/// them, the gateway stops waiting after 100 ms, and the lease (1 s)
/// lapses; with the operator page on.
async fn stuck_gateway() -> (
    idem_tests::upstream::Upstream,
    idem_tests::TestServer,
    idem_gateway::Started,
) {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &origin,
        &[
            "--records-admin-token",
            ADMIN,
            "--lease",
            "1s",
            "--upstream-timeout",
            "100ms",
            "--unknown-outcome-wait",
            "100ms",
        ],
    )
    .await;
    (upstream, origin, gateway)
}

/// A keyed `POST /slow` with this raw key header value.
async fn post_slow(addr: std::net::SocketAddr, key: &str) -> idem_tests::Reply {
    send(
        &client(),
        request(
            addr,
            http::Method::POST,
            "/slow",
            &[("idempotency-key", key)],
        ),
    )
    .await
}

/// The lapsed records of the gateway's store (the records API, with the
/// admin token).
async fn lapsed_records(addr: std::net::SocketAddr) -> Vec<serde_json::Value> {
    let listing = send(
        &client(),
        request(
            addr,
            http::Method::GET,
            "/_idempotency/records?lapsed=true",
            &[("x-idem-admin-token", ADMIN)],
        ),
    )
    .await;
    serde_json::from_slice::<serde_json::Value>(&listing.body)
        .ok()
        .and_then(|body| body["records"].as_array().cloned())
        .unwrap_or_default()
}

/// Waits until the gateway's store holds `n` lapsed records.
async fn wait_for_lapsed(addr: std::net::SocketAddr, n: usize) {
    idem_tests::wait_until(
        std::time::Duration::from_secs(30),
        "the record's lease lapsed",
        async || lapsed_records(addr).await.len() == n,
    )
    .await;
}

/// In a real headless Chromium: the page asks for the admin token, lists
/// the stuck record the test made (its key escaped, never markup) and the
/// unknown outcome behind it, and its release button frees the key: the
/// retry runs as attempt 2. A screenshot is kept in the target folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_page_releases_a_stuck_record_in_a_real_browser() {
    let Some(browser) = idem_tests::browser::Browser::start().await else {
        return;
    };
    let (upstream, _origin, gateway) = stuck_gateway().await;
    let key = "\"<i>stuck</i>-1\"";
    let first = post_slow(gateway.addr, key).await;
    assert_eq!(first.status, http::StatusCode::GATEWAY_TIMEOUT, "{first:?}");
    wait_for_lapsed(gateway.addr, 1).await;

    let page = format!("http://{}/_idempotency/operator", gateway.addr);
    browser.goto(&page).await;
    let signing_in = browser.source_with("name=\"token\"").await;
    assert!(signing_in.contains("name=\"token\""), "{signing_in}");
    assert!(!signing_in.contains("Lapsed records"), "{signing_in}");
    browser.type_into("input[name=token]", ADMIN).await;
    browser.click("button[type=submit]").await;
    let listed = browser.source_with("Lapsed records").await;
    assert!(listed.contains("Lapsed records"), "{listed}");
    assert!(
        listed.contains("&lt;i&gt;stuck&lt;/i&gt;-1"),
        "the stuck record, escaped: {listed}"
    );
    assert!(
        !listed.contains("<i>stuck"),
        "the key was written as markup"
    );
    assert!(
        listed.contains("upstream_timeout"),
        "the unknown outcome: {listed}"
    );
    assert!(listed.contains("POST /slow"), "{listed}");

    let png = browser.screenshot().await;
    assert_eq!(&png[1..4], b"PNG", "a PNG");
    let artifact = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("operator-page.png");
    std::fs::write(&artifact, &png).expect("keep the screenshot");

    browser.click("form.release button").await;
    browser.source_with("Released POST /slow").await;
    assert!(
        browser.url().await.starts_with(&page),
        "back on the page after the release"
    );
    browser.close().await;

    // The key is free: the retry runs, as attempt 2.
    upstream.gate.add_permits(2);
    let retry = post_slow(gateway.addr, key).await;
    assert_eq!(retry.status, http::StatusCode::CREATED, "{retry:?}");
    let seen = upstream.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[1].attempt.as_deref(), Some("2"));
}

/// The page and its actions need the admin token: a wrong token signs
/// nothing in, a release without a session or without the session's
/// anti-forgery token is refused and releases nothing, and the session
/// cookie is `HttpOnly` and `SameSite=Strict`. Without
/// `--records-admin-token` there is no page (and the request never
/// reaches the upstream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_page_needs_the_admin_token() {
    let (upstream, origin, gateway) = stuck_gateway().await;
    let first = post_slow(gateway.addr, "held-1").await;
    assert_eq!(first.status, http::StatusCode::GATEWAY_TIMEOUT);
    wait_for_lapsed(gateway.addr, 1).await;
    let lapsed = lapsed_records(gateway.addr).await;
    let scope = lapsed[0]["scope"].as_str().expect("scope").to_owned();

    let form = |path: &str, body: String, cookie: Option<&str>| {
        let mut request = Request::post(format!("http://{}{path}", gateway.addr))
            .header("content-type", "application/x-www-form-urlencoded");
        if let Some(cookie) = cookie {
            request = request.header("cookie", cookie);
        }
        request.body(Full::new(Bytes::from(body))).expect("request")
    };
    let http = client();
    // Not signed in: the sign-in form, no records.
    let page = send(
        &http,
        request(
            gateway.addr,
            http::Method::GET,
            "/_idempotency/operator",
            &[],
        ),
    )
    .await;
    assert_eq!(page.status, http::StatusCode::OK);
    let text = String::from_utf8_lossy(&page.body);
    assert!(
        text.contains("name=\"token\"") && !text.contains("held-1"),
        "{text}"
    );
    // A wrong token.
    let wrong = send(
        &http,
        form(
            "/_idempotency/operator/sign-in",
            "token=not-it".into(),
            None,
        ),
    )
    .await;
    assert_eq!(wrong.status, http::StatusCode::FORBIDDEN);
    assert!(wrong.header("set-cookie").is_none());
    // A release without a session.
    let release = format!("scope={scope}&csrf=whatever");
    let refused = send(
        &http,
        form("/_idempotency/operator/release", release.clone(), None),
    )
    .await;
    assert_eq!(refused.status, http::StatusCode::FORBIDDEN);
    // Signed in: the cookie's attributes.
    let signed = send(
        &http,
        form(
            "/_idempotency/operator/sign-in",
            format!("token={ADMIN}"),
            None,
        ),
    )
    .await;
    assert_eq!(signed.status, http::StatusCode::SEE_OTHER);
    let cookie = signed
        .header("set-cookie")
        .expect("a session cookie")
        .to_owned();
    for attribute in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/_idempotency/operator",
        "; Secure",
    ] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    let session = cookie.split(';').next().expect("name=value").to_owned();
    // A session, but a form from elsewhere (no anti-forgery token).
    let forged = send(
        &http,
        form("/_idempotency/operator/release", release, Some(&session)),
    )
    .await;
    assert_eq!(forged.status, http::StatusCode::FORBIDDEN);
    // Still stuck: nothing was released.
    wait_for_lapsed(gateway.addr, 1).await;
    let page = send(
        &http,
        request(
            gateway.addr,
            http::Method::GET,
            "/_idempotency/operator",
            &[("cookie", &session)],
        ),
    )
    .await;
    let text = String::from_utf8_lossy(&page.body).into_owned();
    assert!(text.contains("held-1"), "{text}");
    assert_eq!(page.header("cache-control"), Some("no-store"));
    let csrf = text
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the page's anti-forgery token")
        .to_owned();
    let released = send(
        &http,
        form(
            "/_idempotency/operator/release",
            format!("scope={scope}&csrf={csrf}"),
            Some(&session),
        ),
    )
    .await;
    assert_eq!(released.status, http::StatusCode::SEE_OTHER, "{released:?}");
    wait_for_lapsed(gateway.addr, 0).await;
    assert_eq!(upstream.runs(), 1);
    // The page an action leads to reads the store again once; reloading
    // it (`?done=…`) is budgeted like any listing: a record made since is
    // not shown until the listing's time has passed.
    let done = "/_idempotency/operator?done=Released";
    let listed = std::time::Instant::now();
    let after = send(
        &http,
        request(
            gateway.addr,
            http::Method::GET,
            done,
            &[("cookie", &session)],
        ),
    )
    .await;
    assert!(!String::from_utf8_lossy(&after.body).contains("held-1"));
    assert_eq!(
        post_slow(gateway.addr, "held-2").await.status,
        http::StatusCode::GATEWAY_TIMEOUT
    );
    wait_for_lapsed(gateway.addr, 1).await;
    for _ in 0..20 {
        // Checked while that listing may still answer (it is read again
        // after LISTING_EVERY, 5 s): a loaded machine may get fewer checks.
        if listed.elapsed() >= std::time::Duration::from_millis(4_500) {
            break;
        }
        let reloaded = send(
            &http,
            request(
                gateway.addr,
                http::Method::GET,
                done,
                &[("cookie", &session)],
            ),
        )
        .await;
        let text = String::from_utf8_lossy(&reloaded.body).into_owned();
        assert!(!text.contains("held-2"), "a listing out of budget: {text}");
    }

    // Without the admin token, no page; the upstream never sees the path.
    assert_eq!(upstream.runs(), 2, "held-1 and held-2 ran once each");
    let plain = idem_tests::start_gateway(&origin, &[]).await;
    let none = send(
        &http,
        request(plain.addr, http::Method::GET, "/_idempotency/operator", &[]),
    )
    .await;
    assert_eq!(none.status, http::StatusCode::NOT_FOUND, "{none:?}");
    assert_eq!(upstream.runs(), 2);
}

/// The start-up lines link the operator page (or say how to turn it on).
#[test]
fn the_start_up_lines_link_the_operator_page() {
    use std::io::{BufRead, BufReader};
    for (args, expected) in [
        (
            vec!["--records-admin-token", ADMIN],
            "/_idempotency/operator (sign in with the records admin token)",
        ),
        (vec![], "operator: off (set --records-admin-token"),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0"])
            .args(&args)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the gateway");
        let stdout = child.stdout.take().expect("stdout");
        let lines: Vec<String> = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .take_while(|line| !line.starts_with("Try it"))
            .collect();
        let _ = child.kill();
        let _ = child.wait();
        let addr = lines[0]
            .strip_prefix("idem-gateway listening on http://")
            .expect("the first line");
        let operator = lines
            .iter()
            .find(|line| line.trim_start().starts_with("operator:"))
            .unwrap_or_else(|| panic!("no operator line: {lines:?}"));
        assert!(operator.contains(expected), "{operator}");
        if !args.is_empty() {
            assert!(operator.contains(&format!("http://{addr}/")), "{operator}");
        }
    }
}

/// One sign-in form post from `source` (a loopback address of its own):
/// the status, `Retry-After` and `Set-Cookie`.
async fn sign_in_from(
    source: std::net::IpAddr,
    gateway: std::net::SocketAddr,
    token: &str,
) -> (u16, Option<String>, Option<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind((source, 0).into()).expect("bind the source");
    let mut stream = socket.connect(gateway).await.expect("connect");
    let body = format!("token={token}");
    let request = format!(
        "POST /_idempotency/operator/sign-in HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\
         content-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("read");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let header = |name: &str| {
        text.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    (status, header("retry-after"), header("set-cookie"))
}

/// Sign-in is throttled per source: a guesser's wrong tokens soon get
/// `429` with `Retry-After` (its tokens not even compared), while the
/// operator, from another address, signs in at once: no lock-out. With
/// `--operator-plain-http` the cookie drops `Secure`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_is_throttled_per_source_without_locking_the_operator_out() {
    use idem_tests::{TestServer, start_gateway, upstream::Upstream};
    let origin = TestServer::start(Upstream::default().router()).await;
    let gateway = start_gateway(&origin, &["--records-admin-token", ADMIN]).await;
    let guesser: std::net::IpAddr = [127, 0, 0, 2].into();
    let operator: std::net::IpAddr = [127, 0, 0, 3].into();
    let mut refused = 0;
    let mut throttled = 0;
    let guessing = std::time::Instant::now();
    for n in 0..300 {
        match sign_in_from(guesser, gateway.addr, &format!("guess-{n}")).await {
            (403, _, None) => refused += 1,
            (429, Some(wait), None) => {
                assert!(wait.parse::<u64>().is_ok_and(|s| s >= 1), "{wait}");
                throttled += 1;
            }
            other => panic!("a guess: {other:?}"),
        }
    }
    // Five at once, then one a second earned back: however long the
    // guesses took on this machine.
    let earned = usize::try_from(guessing.elapsed().as_secs()).unwrap_or(usize::MAX);
    assert!(
        refused <= 5 + earned + 1,
        "{refused} wrong tokens compared in {earned} s"
    );
    assert_eq!(throttled, 300 - refused, "every other guess throttled");
    // Even the right token waits, from the guesser's address.
    assert_eq!(sign_in_from(guesser, gateway.addr, ADMIN).await.0, 429);
    // The operator, elsewhere, is not locked out.
    let (status, _, cookie) = sign_in_from(operator, gateway.addr, ADMIN).await;
    assert_eq!(status, 303);
    assert!(cookie.expect("a session").ends_with("; Secure"));

    let plain = start_gateway(
        &origin,
        &["--records-admin-token", ADMIN, "--operator-plain-http"],
    )
    .await;
    let (status, _, cookie) = sign_in_from(operator, plain.addr, ADMIN).await;
    assert_eq!(status, 303);
    let cookie = cookie.expect("a session");
    assert!(!cookie.contains("Secure"), "{cookie}");
}
