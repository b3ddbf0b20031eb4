//! A real third-party SDK through the gateway: the official Stripe Python
//! SDK (`stripe` on PyPI, pinned in `tests/sdk/requirements.txt`), with its
//! own retries (`max_network_retries`), its own keys and its own reading of
//! answers, charges through the gateway in front of an upstream that counts
//! its charges. Every charge runs once through client timeouts, 500s and
//! 503s answered before acting, concurrent duplicates and a reused key;
//! the SDK reads the gateway's refusals as its own errors (the `error`
//! member) and obeys `Stripe-Should-Retry`; a fleet of SDK clients, which
//! ignore `Retry-After`, gets its charge with `--in-flight wait:…` where
//! the default answers a long charge's retries 409 until the SDK gives up.
//!
//! The script is `tests/sdk/stripe_charges.py`. Without Python's `stripe`
//! package the tests are skipped outside CI and fail in CI (`.ci/run`
//! installs it).

use std::{
    collections::HashMap,
    net::SocketAddr,
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::IntoResponse,
    routing::post,
};
use idem_tests::{TestServer, start_gateway};
use serde_json::Value;
use tokio::sync::{Notify, Semaphore};

/// The upstream: Stripe's `POST /v1/charges`, counting what it charged.
#[derive(Clone, Default)]
struct Charges {
    inner: Arc<Inner>,
}

struct Inner {
    /// Every charge made: its key as the upstream received it, its amount.
    made: Mutex<Vec<(String, u64)>>,
    /// Runs per key (a run that failed before charging counts).
    runs: Mutex<HashMap<String, usize>>,
    /// A `gated` charge waits for a permit.
    gate: Semaphore,
    /// Notified when a run starts.
    entered: Notify,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            made: Mutex::default(),
            runs: Mutex::default(),
            gate: Semaphore::new(0),
            entered: Notify::new(),
        }
    }
}

impl Charges {
    fn charged(&self, key: &str) -> usize {
        let made = self.inner.made.lock().expect("made");
        made.iter().filter(|(k, _)| k == key).count()
    }

    fn runs(&self, key: &str) -> usize {
        let runs = self.inner.runs.lock().expect("runs");
        runs.get(key).copied().unwrap_or(0)
    }

    /// Waits until `key` has had `n` runs; fails the test after 30 s.
    async fn wait_runs(&self, key: &str, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let entered = self.inner.entered.notified();
            if self.runs(key) >= n {
                return;
            }
            let waited = tokio::time::timeout_at(deadline, entered).await;
            assert!(waited.is_ok(), "{key} ran {} of {n} times", self.runs(key));
        }
    }
}

/// `POST /v1/charges` with a form body. The description steers it:
/// `fail-first-500` and `fail-first-503` answer that status before
/// charging on a key's first run; `gated` waits for a permit; anything
/// else charges at once.
async fn create_charge(
    State(charges): State<Charges>,
    headers: HeaderMap,
    body: String,
) -> impl IntoResponse {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let form: HashMap<String, String> = form_urlencoded::parse(body.as_bytes())
        .into_owned()
        .collect();
    let description = form.get("description").cloned().unwrap_or_default();
    let amount: u64 = form.get("amount").and_then(|a| a.parse().ok()).unwrap_or(0);
    let run = {
        let mut runs = charges.inner.runs.lock().expect("runs");
        let run = runs.entry(key.clone()).or_default();
        *run += 1;
        *run
    };
    charges.inner.entered.notify_waiters();
    let failure = match description.as_str() {
        "fail-first-500" if run == 1 => Some(StatusCode::INTERNAL_SERVER_ERROR),
        "fail-first-503" if run == 1 => Some(StatusCode::SERVICE_UNAVAILABLE),
        _ => None,
    };
    if let Some(status) = failure {
        let body = r#"{"error":{"type":"api_error","message":"not charged; try again"}}"#;
        return (
            status,
            [("content-type", "application/json")],
            body.to_owned(),
        );
    }
    if description == "gated" {
        charges.inner.gate.acquire().await.expect("gate").forget();
    }
    let id = {
        let mut made = charges.inner.made.lock().expect("made");
        made.push((key, amount));
        format!("ch_{}", made.len())
    };
    let body = serde_json::json!({
        "id": id, "object": "charge", "amount": amount, "currency": "usd",
    });
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
}

/// The upstream and a gateway in front of it with `flags`.
async fn setup(flags: &[&str]) -> (Charges, TestServer, idem_gateway::Started) {
    let charges = Charges::default();
    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .with_state(charges.clone());
    let server = TestServer::start(app).await;
    let gateway = start_gateway(&server, flags).await;
    (charges, server, gateway)
}

/// Whether Python with the `stripe` package is here; in CI its absence is
/// a failure.
fn sdk_available() -> bool {
    let found = std::process::Command::new("python3")
        .args(["-c", "import stripe"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        idem_tests::redis_server::skip_or_fail("python3 with the stripe package");
    }
    found
}

/// How one SDK call is made.
struct Call<'a> {
    key: &'a str,
    retries: u32,
    /// The SDK's HTTP timeout, in seconds.
    timeout: f64,
    description: &'a str,
    amount: u64,
    /// `one`, or `together` (two callers at once with the same key).
    scenario: &'a str,
}

impl Default for Call<'_> {
    fn default() -> Self {
        Self {
            key: "",
            retries: 2,
            timeout: 30.0,
            description: "plain",
            amount: 100,
            scenario: "one",
        }
    }
}

/// Runs the SDK's script for `call` through the gateway at `base`; what
/// it printed. Bounded: the script is killed after 60 s.
async fn sdk(gateway: SocketAddr, call: Call<'_>) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/stripe_charges.py");
    let child = tokio::process::Command::new("python3")
        .arg(script)
        .arg(format!("http://{gateway}"))
        .args([call.scenario, call.key])
        .arg(call.retries.to_string())
        .arg(call.timeout.to_string())
        .arg(call.description)
        .arg(call.amount.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs");
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the SDK's script ends within 60 s")
        .expect("its output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the script failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The flags a deployment in front of SDK clients sets: the SDK's own
/// should-retry header and the `error` member it reads.
const FOR_SDKS: [&str; 3] = [
    "--should-retry-header",
    "Stripe-Should-Retry",
    "--problem-error-member",
];

/// A 500 or a 503 the upstream answered before charging releases the
/// key: the SDK's retry (it retries every 5xx) charges once. A retry after
/// the SDK's own timeout, while the charge still runs, is refused 409 with
/// `Stripe-Should-Retry: true`, and the SDK's later retry gets the charge
/// replayed. The upstream sees the key as the SDK sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_sdk_charges_once_through_timeouts_and_failures_before_acting() {
    if !sdk_available() {
        return;
    }
    let (charges, _server, gateway) = setup(&FOR_SDKS).await;
    for (key, description) in [("sdk-500", "fail-first-500"), ("sdk-503", "fail-first-503")] {
        let call = Call {
            key,
            description,
            ..Call::default()
        };
        let made = sdk(gateway.addr, call).await;
        assert!(made["id"].as_str().is_some(), "{key}: {made}");
        assert_eq!(charges.runs(key), 2, "{key}: {made}");
        assert_eq!(charges.charged(key), 1, "{key}: {made}");
    }

    // The SDK times out after 1 s and retries with the same key while
    // the charge is held; the charge is let go once the retries began.
    let slow = tokio::spawn(sdk(
        gateway.addr,
        Call {
            key: "sdk-slow-7f3a",
            retries: 8,
            timeout: 1.0,
            description: "gated",
            ..Call::default()
        },
    ));
    charges.wait_runs("sdk-slow-7f3a", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    charges.inner.gate.add_permits(1);
    let made = slow.await.expect("join");
    assert_eq!(made["id"], "ch_3", "{made}");
    assert_eq!(charges.runs("sdk-slow-7f3a"), 1, "{made}");
    let made_keys: Vec<String> = {
        let made = charges.inner.made.lock().expect("made");
        made.iter().map(|(k, _)| k.clone()).collect()
    };
    assert_eq!(made_keys, ["sdk-500", "sdk-503", "sdk-slow-7f3a"]);
}

/// Two callers send one charge at once with the same key: one charge, and
/// both get it. The same key with another amount is the SDK's `APIError`
/// 422 `idempotency_conflict`, which it does not retry
/// (`Stripe-Should-Retry: false`); a duplicate while the charge runs,
/// with the SDK's retries off, is 409 `idempotency_in_progress` with
/// `Retry-After` and `Stripe-Should-Retry: true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_sdk_reads_the_gateways_refusals() {
    if !sdk_available() {
        return;
    }
    let (charges, _server, gateway) = setup(&FOR_SDKS).await;
    let together = tokio::spawn(sdk(
        gateway.addr,
        Call {
            key: "sdk-twice",
            retries: 8,
            description: "gated",
            scenario: "together",
            ..Call::default()
        },
    ));
    charges.wait_runs("sdk-twice", 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    charges.inner.gate.add_permits(1);
    let both = together.await.expect("join");
    assert_eq!(both["both"][0]["id"], "ch_1", "{both}");
    assert_eq!(both["both"][1]["id"], "ch_1", "{both}");
    assert_eq!(charges.runs("sdk-twice"), 1);

    let other = Call {
        key: "sdk-twice",
        amount: 250,
        description: "gated",
        ..Call::default()
    };
    let conflict = sdk(gateway.addr, other).await;
    assert_eq!(conflict["error"], "APIError", "{conflict}");
    assert_eq!(conflict["status"], 422, "{conflict}");
    assert_eq!(conflict["code"], "idempotency_conflict", "{conflict}");
    assert_eq!(conflict["should_retry"], "false", "{conflict}");
    assert_eq!(charges.runs("sdk-twice"), 1);

    let held = tokio::spawn(sdk(
        gateway.addr,
        Call {
            key: "sdk-held",
            retries: 0,
            description: "gated",
            ..Call::default()
        },
    ));
    charges.wait_runs("sdk-held", 1).await;
    let busy = Call {
        key: "sdk-held",
        retries: 0,
        description: "gated",
        ..Call::default()
    };
    let busy = sdk(gateway.addr, busy).await;
    assert_eq!(busy["status"], 409, "{busy}");
    assert_eq!(busy["code"], "idempotency_in_progress", "{busy}");
    assert_eq!(busy["should_retry"], "true", "{busy}");
    assert!(busy["retry_after"].as_str().is_some(), "{busy}");
    charges.inner.gate.add_permits(1);
    assert_eq!(held.await.expect("join")["id"], "ch_2");
    assert_eq!(charges.charged("sdk-held"), 1);
}

/// The SDK ignores `Retry-After` (its backoff starts at 0.5 s): with its
/// default two retries, a charge that runs past them is 409 to the caller
/// although it succeeded, under the gateway's default `--in-flight
/// reject`. Under `--in-flight wait:30s` the SDK's retry waits for the
/// charge and gets it. Either way the charge runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_fleets_that_ignore_retry_after_get_their_charge_with_wait_mode() {
    if !sdk_available() {
        return;
    }
    for (mode, answered) in [("reject", false), ("wait:30s", true)] {
        let flags = [&FOR_SDKS[..], &["--in-flight", mode]].concat();
        let (charges, _server, gateway) = setup(&flags).await;
        let pending = tokio::spawn(sdk(
            gateway.addr,
            Call {
                key: "sdk-fleet",
                timeout: 1.0,
                description: "gated",
                ..Call::default()
            },
        ));
        charges.wait_runs("sdk-fleet", 1).await;
        if answered {
            // Let the SDK time out (after 1 s) and retry into the wait
            // first.
            tokio::time::sleep(Duration::from_secs(2)).await;
            charges.inner.gate.add_permits(1);
        }
        let first = pending.await.expect("join");
        if answered {
            assert_eq!(first["id"], "ch_1", "{mode}: {first}");
        } else {
            // The gate is still shut: every try of the SDK's found the
            // charge running.
            assert_eq!(first["status"], 409, "{mode}: {first}");
            assert_eq!(first["code"], "idempotency_in_progress", "{mode}: {first}");
            charges.inner.gate.add_permits(1);
            let again = Call {
                key: "sdk-fleet",
                description: "gated",
                ..Call::default()
            };
            // The charge is let go: a later call with the key is answered
            // with it, replayed (waiting out the charge, if need be).
            let later = poll_charge(gateway.addr, again).await;
            assert_eq!(later["id"], "ch_1", "{mode}: {later}");
        }
        eprintln!("{mode}: the SDK's call took {} s", first["seconds"]);
        assert_eq!(charges.runs("sdk-fleet"), 1, "{mode}");
        assert_eq!(charges.charged("sdk-fleet"), 1, "{mode}");
    }
}

/// The SDK call `call` until it answers a charge (a 409 while the charge
/// still runs is tried again), for at most 30 s.
async fn poll_charge(gateway: SocketAddr, call: Call<'_>) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let once = Call {
            key: call.key,
            description: call.description,
            ..Call::default()
        };
        let answer = sdk(gateway, once).await;
        if answer["id"].is_string() || tokio::time::Instant::now() > deadline {
            return answer;
        }
    }
}
