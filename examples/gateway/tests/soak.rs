//! Chaos soak: 64 concurrent clients, a pool of keys with many duplicates
//! and some changed payloads, two gateway processes on one Redis (one
//! writing record format 2, one format 1: a rolling upgrade), gateways
//! killed (SIGKILL) or stopped (SIGTERM) and restarted, Redis paused and
//! resumed, and one upstream execution in 30 slower than the gateways'
//! upstream timeout (an unknown outcome: 504, the key kept, the late
//! answer recorded), and an operator erasing completed records through
//! either gateway's records API (the other gateway's replay cache hears of
//! it through Redis; a replay of an erased answer a while after the erase
//! is a violation). An independent
//! ledger in the upstream then checks every promise and prints the figures.
//!
//! Short profile (the default, about a minute with setup; CI runs it):
//! `cargo test -p idem-gateway --test soak -- --nocapture`.
//! Long profile: `IDEM_SOAK_SECONDS=600 cargo test -p idem-gateway --test soak -- --nocapture`.

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, extract::State, http::HeaderMap, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use idem_tests::{TestServer, redis_server::RedisServer};

const TENANTS: u64 = 4;
const KEYS: u64 = 60;
const CLIENTS: usize = 64;
/// The gateways' lease (`--lease`).
const LEASE: Duration = Duration::from_secs(2);
/// How long a key stays in the clients' pool: past the lease and a
/// restart, so that lost owners' keys are retried and taken over.
const KEY_LIFETIME_SECS: u64 = 8;
/// The gateways' upstream timeout (`--upstream-timeout`).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(1);
/// The records API's admin credential (`--records-admin-token`).
const ADMIN: &str = "the soak operator's token";
/// How long after an erasure answered a replay of the erased answer is
/// still allowed: the replay caches' bound on a healthy push channel
/// (about a second) and a loaded machine's delays.
const STALE_BOUND: Duration = Duration::from_secs(2);

/// An erasure the operator made: the record of `tenant`/`key` was erased
/// by a request sent at `sent`, answered at `answered`: `confirmed` when it
/// answered `erased`; not when no clean answer came (its gateway killed
/// mid-answer, a timeout, a 5xx), which may or may not have erased it.
#[derive(Debug, Clone)]
struct Erased {
    tenant: String,
    key: String,
    sent: Instant,
    answered: Instant,
    confirmed: bool,
}

/// One execution in the upstream.
#[derive(Debug, Clone)]
struct Execution {
    tenant: String,
    key: String,
    attempt: u64,
    payload: Bytes,
    started: Instant,
    /// Which gateway forwarded it (each has an upstream listener of its
    /// own).
    gateway: usize,
    /// How long the upstream worked on it.
    work: Duration,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Ledger {
    executions: Arc<Mutex<Vec<Execution>>>,
    counter: Arc<AtomicUsize>,
}

async fn pay(
    State((ledger, gateway)): State<(Ledger, usize)>,
    headers: HeaderMap,
    payload: Bytes,
) -> (StatusCode, Bytes) {
    let started = Instant::now();
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let n = ledger.counter.fetch_add(1, Ordering::SeqCst) + 1;
    // The gateway forwards the key as the client sent it (bare here); a
    // quoted one would have nothing to escape either.
    let (tenant, key) = (text("x-tenant"), text("idempotency-key"));
    let key = key.trim_matches('"').to_owned();
    let body = Bytes::from(format!(
        "{{\"tenant\":\"{tenant}\",\"key\":\"{key}\",\"execution\":{n}}}"
    ));
    let attempt = text("idempotency-attempt").parse().unwrap_or(0);
    // Some work, so that duplicates overlap and kills land mid-request;
    // one in 30 outlasts the gateways' upstream timeout.
    let work = if n % 30 == 0 {
        UPSTREAM_TIMEOUT + Duration::from_millis(500)
    } else {
        Duration::from_millis((n as u64 % 10) * 30)
    };
    ledger.executions.lock().expect("ledger").push(Execution {
        tenant,
        key,
        attempt,
        payload,
        started,
        gateway,
        work,
        body: body.clone(),
    });
    tokio::time::sleep(work).await;
    (StatusCode::CREATED, body)
}

struct Gateway {
    child: Option<Child>,
    /// Where it listens now: each start binds a fresh port, published
    /// here for the clients, so no port is reused across restarts.
    port: Arc<AtomicU16>,
    args: Vec<String>,
}

impl Gateway {
    fn start(args: &[String]) -> Self {
        let mut gateway = Self {
            child: None,
            port: Arc::new(AtomicU16::new(0)),
            args: args.to_vec(),
        };
        gateway.spawn();
        gateway
    }

    fn spawn(&mut self) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0"])
            .args(&self.args)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn gateway");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let Some(port) = first
            .strip_prefix("idem-gateway listening on http://127.0.0.1:")
            .and_then(|p| p.trim().parse::<u16>().ok())
        else {
            // Never leave the process running behind a failed test.
            let _ = child.kill();
            let _ = child.wait();
            panic!("unexpected first line {first:?}");
        };
        std::thread::spawn(move || lines.for_each(drop));
        self.port.store(port, Ordering::SeqCst);
        self.child = Some(child);
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for the graceful exit (connections closed,
    /// detached work drained).
    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a client sent and got.
#[derive(Debug, Clone)]
struct Outcome {
    tenant: String,
    key: String,
    /// When the request was sent and its answer came.
    sent: Instant,
    answered: Instant,
    payload: Bytes,
    status: Option<StatusCode>,
    replayed: bool,
    code: Option<String>,
    body: Bytes,
}

fn payload(tenant: u64, key: u64, variant: u64) -> Bytes {
    Bytes::from(format!(
        "{{\"amount\":{},\"currency\":\"EUR\",\"variant\":{variant}}}",
        tenant * 1000 + key
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak() {
    let seconds: u64 = std::env::var("IDEM_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let ledger = Ledger::default();
    // One upstream listener per gateway, one ledger: each execution is
    // attributed to the gateway that ran it.
    let mut upstreams = Vec::new();
    for gateway in 0..2 {
        let router = Router::new()
            .route("/pay", post(pay))
            .with_state((ledger.clone(), gateway));
        upstreams.push(TestServer::start(router).await);
    }
    let upstream_flag = |gateway: usize| {
        [
            "--upstream".to_owned(),
            format!("http://{}", upstreams[gateway].addr),
        ]
    };
    let args: Vec<String> = [
        "--store",
        &redis.url(),
        "--tenant-header",
        "x-tenant",
        "--lease",
        "2s",
        "--retention",
        "1h",
        "--store-timeout",
        "250ms",
        "--upstream-timeout",
        "1s",
        "--drain-timeout",
        "10s",
        "--records-admin-token",
        ADMIN,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // The second gateway writes the default record format (3: a new key's
    // record one string), the first format 1 (expanded, four-byte
    // headers): each replays and takes over the other's records
    // throughout. Both keep replay caches (the default), which the
    // erasures must reach.
    let expanded: Vec<String> = args
        .iter()
        .cloned()
        .chain(upstream_flag(0))
        .chain(["--redis-record-format".to_owned(), "1".to_owned()])
        .collect();
    let compact: Vec<String> = args.iter().cloned().chain(upstream_flag(1)).collect();
    let gateways = [Gateway::start(&expanded), Gateway::start(&compact)];
    let ports = [Arc::clone(&gateways[0].port), Arc::clone(&gateways[1].port)];
    let gateways = Arc::new(Mutex::new(gateways));

    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    // When each SIGKILL was sent, and to which gateway.
    let kills: Arc<Mutex<Vec<(Instant, usize)>>> = Arc::default();
    let terminations = Arc::new(AtomicUsize::new(0));
    let pauses: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();

    // Chaos: every 2.5 s stop and restart a gateway, two times in three
    // with SIGKILL (its owners are lost), else with SIGTERM (it drains and
    // loses nothing); every other time also pause Redis for 600 ms.
    let chaos = {
        let (gateways, kills, pauses, terminations) = (
            Arc::clone(&gateways),
            Arc::clone(&kills),
            Arc::clone(&pauses),
            Arc::clone(&terminations),
        );
        let redis = Arc::new(redis);
        let redis_for_chaos = Arc::clone(&redis);
        let task = tokio::task::spawn_blocking(move || {
            let mut round = 0u64;
            while Instant::now() + Duration::from_millis(2500) < deadline {
                std::thread::sleep(Duration::from_millis(2500));
                round += 1;
                let victim = (round % 2) as usize;
                if round.is_multiple_of(3) {
                    // Outside the lock: the graceful exit takes a while.
                    let mut gateway = {
                        let mut gateways = gateways.lock().expect("gateways");
                        Gateway {
                            child: gateways[victim].child.take(),
                            port: Arc::clone(&gateways[victim].port),
                            args: Vec::new(),
                        }
                    };
                    gateway.terminate();
                    terminations.fetch_add(1, Ordering::SeqCst);
                } else {
                    let mut gateways = gateways.lock().expect("gateways");
                    gateways[victim].kill();
                    kills.lock().expect("kills").push((Instant::now(), victim));
                }
                std::thread::sleep(Duration::from_millis(200));
                gateways.lock().expect("gateways")[victim].spawn();
                if round.is_multiple_of(2) {
                    // The window is when Redis certainly was stopped: from
                    // after SIGSTOP was delivered to before SIGCONT is sent.
                    redis_for_chaos.pause();
                    let from = Instant::now();
                    std::thread::sleep(Duration::from_millis(600));
                    let to = Instant::now();
                    redis_for_chaos.resume();
                    pauses.lock().expect("pauses").push((from, to));
                }
            }
        });
        (task, redis)
    };

    // 64 clients.
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let seed = Arc::new(AtomicU64::new(0x9E37_79B9_7F4A_7C15));
    let next = move || {
        // A small xorshift: deterministic enough, and no extra dependency.
        let mut x = seed.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    // The operator: every 300 ms, erase a key of the current pool through
    // either gateway (the records API refuses a processing record, and
    // answers 404 for a key not used yet).
    let erasures: Arc<Mutex<Vec<Erased>>> = Arc::default();
    let erase_answers: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let operator = {
        let (http, erasures, erase_answers, ports, next) = (
            http.clone(),
            Arc::clone(&erasures),
            Arc::clone(&erase_answers),
            ports.clone(),
            next.clone(),
        );
        tokio::spawn(async move {
            while Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let r = next();
                let epoch = started.elapsed().as_secs() / KEY_LIFETIME_SECS;
                let (tenant, key) = (
                    format!("tenant-{}", r % TENANTS),
                    format!("key-{}", (r >> 8) % KEYS + epoch * KEYS),
                );
                let port = ports[((r >> 40) % 2) as usize].load(Ordering::SeqCst);
                let request = Request::post(format!(
                    "http://127.0.0.1:{port}/_idempotency/records?method=POST&path=/pay&key={key}&tenant={tenant}&action=erase"
                ))
                .header("x-idem-admin-token", ADMIN)
                .body(Full::new(Bytes::new()))
                .expect("request");
                let sent = Instant::now();
                let answer =
                    tokio::time::timeout(Duration::from_secs(5), http.request(request)).await;
                let answered = Instant::now();
                let (status, erased) = match answer {
                    Ok(Ok(response)) => {
                        let status = response.status();
                        let body = response.into_body().collect().await.map(|b| b.to_bytes());
                        let erased = body.as_ref().is_ok_and(|b| {
                            serde_json::from_slice::<serde_json::Value>(b)
                                .is_ok_and(|v| v["result"] == "erased")
                        });
                        let answer = match status {
                            StatusCode::OK if erased => Some(true),
                            StatusCode::NOT_FOUND | StatusCode::CONFLICT => None,
                            _ => Some(false),
                        };
                        (status.as_str().to_owned(), answer)
                    }
                    _ => ("none".to_owned(), Some(false)),
                };
                if let Some(confirmed) = erased {
                    erasures.lock().expect("erasures").push(Erased {
                        tenant,
                        key,
                        sent,
                        answered,
                        confirmed,
                    });
                }
                *erase_answers
                    .lock()
                    .expect("answers")
                    .entry(status)
                    .or_default() += 1;
            }
        })
    };
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (http, outcomes, next, ports) = (
            http.clone(),
            Arc::clone(&outcomes),
            next.clone(),
            ports.clone(),
        );
        clients.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let r = next();
                // The key pool rolls over every 8 s: fresh keys keep
                // executions (and kills landing on them) going for the whole
                // run, and a killed gateway's keys are still retried after
                // their 2 s lease lapsed, so takeovers happen.
                let epoch = started.elapsed().as_secs() / KEY_LIFETIME_SECS;
                let (tenant, key) = (r % TENANTS, (r >> 8) % KEYS + epoch * KEYS);
                // 4 % of requests change the payload of a key.
                let variant = if (r >> 20) % 25 == 0 {
                    1 + (r >> 30) % 3
                } else {
                    0
                };
                let port = ports[((r >> 40) % 2) as usize].load(Ordering::SeqCst);
                let body = payload(tenant, key, variant);
                let (tenant, key) = (format!("tenant-{tenant}"), format!("key-{key}"));
                let request = Request::post(format!("http://127.0.0.1:{port}/pay"))
                    .header("x-tenant", &tenant)
                    .header("idempotency-key", &key)
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone()))
                    .expect("request");
                let mut outcome = Outcome {
                    tenant,
                    key,
                    sent: Instant::now(),
                    answered: Instant::now(),
                    payload: body,
                    status: None,
                    replayed: false,
                    code: None,
                    body: Bytes::new(),
                };
                if let Ok(Ok(response)) =
                    tokio::time::timeout(Duration::from_secs(5), http.request(request)).await
                {
                    outcome.status = Some(response.status());
                    outcome.replayed = response.headers().contains_key("idempotent-replayed");
                    if let Ok(collected) = response.into_body().collect().await {
                        outcome.body = collected.to_bytes();
                    }
                    outcome.code = serde_json::from_slice::<serde_json::Value>(&outcome.body)
                        .ok()
                        .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
                }
                outcome.answered = Instant::now();
                outcomes.lock().expect("outcomes").push(outcome);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    for client in clients {
        client.await.expect("client");
    }
    operator.await.expect("operator");
    let (chaos_task, redis) = chaos;
    chaos_task.await.expect("chaos");

    // ===== the ledger's checks =====
    let executions = ledger.executions.lock().expect("ledger").clone();
    let outcomes = outcomes.lock().expect("outcomes").clone();
    let kills = kills.lock().expect("kills").clone();
    let pauses = pauses.lock().expect("pauses").clone();
    let erasures = erasures.lock().expect("erasures").clone();
    // A scope's era: how many erasures of it were sent before `at`. An
    // erasure answered `erased` found the record finished, so every
    // execution of the scope that starts after it was sent is of the new
    // era (the key is new: its generations start again at 1). One without
    // a clean answer may have erased it: counted too, which only splits the
    // scope's executions into more eras (fewer pairs to check), never
    // excuses a pair within one.
    let era = |tenant: &str, key: &str, at: Instant| {
        erasures
            .iter()
            .filter(|e| e.tenant == tenant && e.key == key && e.sent < at)
            .count()
    };
    let era_of = |execution: &Execution| era(&execution.tenant, &execution.key, execution.started);

    let mut by_scope: BTreeMap<(String, String, usize), Vec<&Execution>> = BTreeMap::new();
    let mut by_key: BTreeMap<(String, String), Vec<&Execution>> = BTreeMap::new();
    for execution in &executions {
        by_scope
            .entry((
                execution.tenant.clone(),
                execution.key.clone(),
                era_of(execution),
            ))
            .or_default()
            .push(execution);
        by_key
            .entry((execution.tenant.clone(), execution.key.clone()))
            .or_default()
            .push(execution);
    }
    // 1. Never two executions in one generation of a scope (within an era).
    let mut per_generation: HashMap<(String, String, usize, u64), usize> = HashMap::new();
    for execution in &executions {
        *per_generation
            .entry((
                execution.tenant.clone(),
                execution.key.clone(),
                era_of(execution),
                execution.attempt,
            ))
            .or_default() += 1;
    }
    let doubled: Vec<_> = per_generation.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        doubled.is_empty(),
        "two executions in one generation: {doubled:?}"
    );
    // 2. Re-executions only after a lost owner (a SIGKILL of the gateway
    //    that ran the first execution, never of the other one, never a
    //    graceful stop, nor an upstream timeout) or a store outage, and
    //    always with a higher generation.
    let mut re_executions = 0;
    for runs in by_scope.values() {
        for pair in runs.windows(2) {
            re_executions += 1;
            assert!(
                pair[1].attempt > pair[0].attempt,
                "re-execution without a higher generation: {pair:?}"
            );
            // The owner was lost while it held the first execution: killed
            // between its reservation (a little before the upstream saw the
            // request) and its completion (a little after the upstream
            // answered), or cut off from Redis for that long.
            let since = pair[0].started - Duration::from_millis(250);
            let until = pair[0].started + pair[0].work + Duration::from_millis(500);
            let lost_owner = kills
                .iter()
                .any(|(k, victim)| *victim == pair[0].gateway && *k >= since && *k <= until)
                || pauses
                    .iter()
                    .any(|(from, to)| *to >= since && *from <= until);
            assert!(
                lost_owner,
                "re-execution of {}/{} without a lost owner",
                pair[0].tenant, pair[0].key
            );
            // Only after the lost owner's lease lapsed (it was taken a little
            // before the first execution started).
            assert!(
                pair[1].started + Duration::from_millis(250) >= pair[0].started + LEASE,
                "takeover of {}/{} before the lease lapsed",
                pair[0].tenant,
                pair[0].key
            );
            assert_eq!(
                pair[0].payload, pair[1].payload,
                "a takeover runs the same request"
            );
        }
    }
    // 3. Every delivered success of a scope has the same bytes (within an
    //    era), 4. never another tenant's, and 7. never an erased era's a
    //    while after its erasure answered.
    let mut delivered: HashMap<(String, String, usize), Bytes> = HashMap::new();
    let mut stale_checked = 0;
    let (mut successes, mut replays) = (0, 0);
    for outcome in outcomes
        .iter()
        .filter(|o| o.status == Some(StatusCode::CREATED))
    {
        successes += 1;
        replays += usize::from(outcome.replayed);
        let tenant_in_body = format!("\"tenant\":\"{}\"", outcome.tenant);
        assert!(
            std::str::from_utf8(&outcome.body).is_ok_and(|b| b.contains(&tenant_in_body)),
            "cross-tenant or foreign body {:?} for {}",
            outcome.body,
            outcome.tenant
        );
        let producer = by_key
            .get(&(outcome.tenant.clone(), outcome.key.clone()))
            .and_then(|runs| runs.iter().find(|r| r.body == outcome.body));
        let Some(producer) = producer else {
            panic!(
                "{}/{} delivered bytes the upstream never produced",
                outcome.tenant, outcome.key
            );
        };
        let produced_in = era_of(producer);
        // An erasure confirmed a while before this request was sent, of an
        // answer produced before it: that answer must not come back.
        let erased_before = erasures.iter().find(|e| {
            e.confirmed
                && e.tenant == outcome.tenant
                && e.key == outcome.key
                && e.answered + STALE_BOUND < outcome.sent
        });
        stale_checked += usize::from(erased_before.is_some());
        let stale = erasures.iter().find(|e| {
            e.confirmed
                && e.tenant == outcome.tenant
                && e.key == outcome.key
                && e.answered + STALE_BOUND < outcome.sent
                && producer.started < e.sent
        });
        assert!(
            stale.is_none(),
            "{}/{} replayed an answer erased {:?} before the request was sent: {stale:?}",
            outcome.tenant,
            outcome.key,
            stale.map(|e| outcome.sent - e.answered)
        );
        let scope = (outcome.tenant.clone(), outcome.key.clone(), produced_in);
        let first = delivered
            .entry(scope)
            .or_insert_with(|| outcome.body.clone());
        assert_eq!(
            *first, outcome.body,
            "{}/{} delivered two different answers",
            outcome.tenant, outcome.key
        );
    }
    // 5. Nothing executed while the store was unreachable. A request
    //    reserved just before SIGSTOP reaches the upstream a moment later
    //    (the gateway's own latency, longer on a loaded machine): the same
    //    250 ms allowance as for a lost owner.
    for execution in &executions {
        let inside = pauses.iter().any(|(from, to)| {
            execution.started > *from + Duration::from_millis(250) && execution.started < *to
        });
        assert!(
            !inside,
            "executed while Redis was paused: {}/{}",
            execution.tenant, execution.key
        );
    }
    // 6. Every 422 is a real payload change.
    let mut conflicts = 0;
    for outcome in outcomes
        .iter()
        .filter(|o| o.status == Some(StatusCode::UNPROCESSABLE_ENTITY))
    {
        conflicts += 1;
        assert_eq!(outcome.code.as_deref(), Some("idempotency_conflict"));
        // The record it met is of an era between the erasures answered
        // before it was sent and those sent before its answer came.
        let (tenant, key) = (&outcome.tenant, &outcome.key);
        let lo = erasures
            .iter()
            .filter(|e| e.tenant == *tenant && e.key == *key && e.answered < outcome.sent)
            .count();
        let hi = era(tenant, key, outcome.answered);
        let changed = (lo..=hi).any(|era| {
            by_scope
                .get(&(tenant.clone(), key.clone(), era))
                .is_none_or(|runs| runs.iter().all(|r| r.payload != outcome.payload))
        });
        assert!(changed, "422 for an unchanged payload");
    }
    let count = |status: StatusCode| outcomes.iter().filter(|o| o.status == Some(status)).count();
    let transport = outcomes.iter().filter(|o| o.status.is_none()).count();
    println!(
        "SOAK {seconds}s: {} requests from {CLIENTS} clients, {} scopes live at a time, each for {KEY_LIFETIME_SECS} s",
        outcomes.len(),
        TENANTS * KEYS
    );
    println!(
        "  answers: {successes} 201 ({replays} replayed), {conflicts} 422, {} 409, {} 503, {transport} without an answer (gateway killed)",
        count(StatusCode::CONFLICT),
        count(StatusCode::SERVICE_UNAVAILABLE)
    );
    println!(
        "  upstream executions: {} in {} scopes; takeovers after a lost owner: {re_executions}",
        executions.len(),
        by_scope.len()
    );
    println!(
        "  chaos: {} gateway kills, {} graceful stops, {} Redis pauses, {} upstream timeouts (504)",
        kills.len(),
        terminations.load(Ordering::SeqCst),
        pauses.len(),
        count(StatusCode::GATEWAY_TIMEOUT)
    );
    let erase_answers = erase_answers.lock().expect("answers").clone();
    println!(
        "  erasures: {} erased (answers {erase_answers:?}); {stale_checked} later answers of erased scopes checked for staleness",
        erasures.iter().filter(|e| e.confirmed).count()
    );
    println!(
        "  violations: 0 double executions per generation, 0 differing replays, 0 cross-tenant, 0 executions during outages, 0 false 422s, 0 erased answers replayed {STALE_BOUND:?} after the erasure"
    );
    assert!(
        successes > 100 && replays > 0 && conflicts > 0,
        "the soak exercised too little"
    );
    assert!(
        count(StatusCode::GATEWAY_TIMEOUT) > 0 && terminations.load(Ordering::SeqCst) > 0,
        "the soak saw no upstream timeout or no graceful stop"
    );
    assert!(
        re_executions > 0,
        "no takeover happened: the re-execution checks checked nothing"
    );
    assert!(
        !erasures.is_empty() && stale_checked > 0,
        "no erasure was followed by a request: the staleness check checked nothing"
    );
    drop(gateways);
    drop(redis);
}
