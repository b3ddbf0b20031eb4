//! The `idem-gateway` binary as a process on a real Redis: killed
//! mid-request and restarted, and shut down gracefully with a request in
//! flight.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{
    Reply, TestServer, client, poll_until,
    redis_server::{RedisCluster, RedisServer},
    send,
    upstream::Upstream,
    wait_until,
};

struct Process {
    child: Child,
    addr: String,
}

impl Process {
    /// The text of the gateway's `/metrics`.
    async fn metrics(&self) -> String {
        let request = Request::get(format!("http://{}/metrics", self.addr))
            .body(Full::new(Bytes::new()))
            .expect("request");
        String::from_utf8_lossy(&send(&client(), request).await.body).into_owned()
    }

    /// Starts the binary and waits for the line that says where it listens.
    fn start(args: &[&str]) -> Self {
        Self::spawn(
            Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
                .args(["--listen", "127.0.0.1:0"])
                .args(args)
                .env("RUST_LOG", "error")
                .stderr(Stdio::inherit()),
        )
    }

    fn spawn(command: &mut Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn idem-gateway");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let Some(addr) = first.strip_prefix("idem-gateway listening on http://") else {
            // Never leave the process running behind a failed test.
            let _ = child.kill();
            let _ = child.wait();
            panic!("unexpected first line {first:?}");
        };
        let addr = addr.to_owned();
        // Keep draining stdout so the process never blocks on it.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn terminate(&self) {
        self.signal("-TERM");
    }

    /// Waits until the gateway stopped accepting connections: its graceful
    /// shutdown has begun.
    async fn wait_until_closed(&self) {
        wait_until(
            Duration::from_secs(20),
            "the listener to close after the signal",
            async || tokio::net::TcpStream::connect(&self.addr).await.is_err(),
        )
        .await;
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
        assert!(status.is_ok_and(|s| s.success()));
    }

    /// Waits for the process to exit; answers whether it exited cleanly.
    async fn exited_cleanly(mut self) -> bool {
        tokio::task::spawn_blocking(move || {
            let status = self.child.wait();
            drop(self);
            status.is_ok_and(|s| s.success())
        })
        .await
        .expect("join")
    }

    fn post(&self, path: &str, key: &str) -> Request<Full<Bytes>> {
        Request::post(format!("http://{}{}", self.addr, path))
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
            .expect("request")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn post(gateway: &Process, path: &str, key: &str) -> Reply {
    send(&client(), gateway.post(path, key)).await
}

/// A file a gateway process writes its log to; removed on drop.
struct Log(std::path::PathBuf);

impl Log {
    fn new(name: &str) -> Self {
        let file = format!("idem-gateway-{name}-{}.log", std::process::id());
        Self(std::env::temp_dir().join(file))
    }

    /// A fresh file for the process's stderr.
    fn file(&self) -> std::fs::File {
        std::fs::File::create(&self.0).expect("log file")
    }

    /// What was logged so far.
    fn text(&self) -> String {
        std::fs::read_to_string(&self.0).unwrap_or_default()
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The tenant secret every gateway of a test shares, so that a restarted
/// gateway finds the records its predecessor made.
const SECRET: &str = "the test gateways' shared tenant secret";

/// The lease of the crash tests: long enough that a restarted debug binary
/// answers while it lives, on a loaded machine too.
const LEASE: &str = "6s";

/// Retries until the answer is no longer `409 idempotency_in_progress`
/// (the lease lapsed and a retry took over), within 30 s.
async fn until_not_in_progress(gateway: &Process, path: &str, key: &str) -> Reply {
    let reply = poll_until(
        Duration::from_secs(30),
        async || post(gateway, path, key).await,
        |reply| reply.code().as_deref() != Some("idempotency_in_progress"),
    )
    .await;
    assert_ne!(
        reply.code().as_deref(),
        Some("idempotency_in_progress"),
        "still in progress 30 s later"
    );
    reply
}

/// A private Redis and a counting upstream, and the flags that put a
/// gateway between them; `None` when Redis is not installed (outside CI).
struct OnRedis {
    redis: RedisServer,
    upstream: Upstream,
    _server: TestServer,
    args: Vec<String>,
}

impl OnRedis {
    async fn start(extra: &[&str]) -> Option<Self> {
        let redis = RedisServer::spawn()?;
        let upstream = Upstream::default();
        let server = TestServer::start(upstream.router()).await;
        let mut args = vec![
            "--upstream".to_owned(),
            format!("http://{}", server.addr),
            "--store".to_owned(),
            redis.url(),
            "--tenant-secret".to_owned(),
            SECRET.to_owned(),
        ];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Some(Self {
            redis,
            upstream,
            _server: server,
            args,
        })
    }

    fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }
}

/// A gateway on `setup` logging at `info` to `log`, with a request of
/// `/slow` under `key` whose client left while the upstream runs it: the
/// request now runs detached.
async fn with_a_detached_request(setup: &OnRedis, log: &Log, key: &str) -> Process {
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0"])
            .args(setup.args())
            .env("RUST_LOG", "info")
            .stderr(log.file()),
    );
    let lost = tokio::spawn(send(&client(), gateway.post("/slow", key)));
    setup.upstream.wait_runs(1).await;
    lost.abort(); // the client goes away
    let _ = lost.await;
    // The gateway saw it go: the request runs detached.
    wait_until(
        Duration::from_secs(20),
        "the gateway to see the client go",
        async || log.text().contains("client went away"),
    )
    .await;
    gateway
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_request_then_restarted_on_the_same_redis() {
    let Some(setup) = OnRedis::start(&["--lease", LEASE, "--retention", "1h"]).await else {
        return;
    };
    let (upstream, args) = (&setup.upstream, setup.args());

    let mut first = Process::start(&args);
    let lost = tokio::spawn(send(&client(), first.post("/slow", "crash-1")));
    upstream.wait_runs(1).await;
    first.kill(); // SIGKILL while the upstream is executing
    let _ = lost.await;

    let second = Process::start(&args);
    // A takeover would wait at the upstream's gate: bound the wait, so a
    // restart slower than the lease fails here instead of hanging.
    let busy = tokio::time::timeout(Duration::from_secs(10), post(&second, "/slow", "crash-1"))
        .await
        .expect("answered while the lease lives");
    assert_eq!(
        busy.status,
        StatusCode::CONFLICT,
        "no second execution while the lease lives"
    );
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    let retry_after: u64 = busy
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    assert!((1..=2).contains(&retry_after));
    assert_eq!(upstream.runs(), 1);

    // Both runs may finish now: the killed owner's (still waiting in the
    // upstream) and the takeover's once the lease has lapsed.
    upstream.gate.add_permits(2);
    let takeover = until_not_in_progress(&second, "/slow", "crash-1").await;
    assert_eq!(takeover.status, StatusCode::CREATED);
    {
        let seen = upstream.seen.lock().expect("seen");
        assert_eq!(seen[0].attempt.as_deref(), Some("1"));
        assert_eq!(
            seen[1].key.as_deref(),
            Some("crash-1"),
            "the same key reaches the upstream, as the client sent it"
        );
        assert_eq!(
            seen[1].attempt.as_deref(),
            Some("2"),
            "with a higher Idempotency-Attempt"
        );
    }
    let replay = post(&second, "/slow", "crash-1").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, takeover.body);
    assert_eq!(upstream.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_in_flight_requests_finish_and_record() {
    let Some(setup) = OnRedis::start(&[]).await else {
        return;
    };
    let (upstream, args) = (&setup.upstream, setup.args());

    let gateway = Process::start(&args);
    let in_flight = tokio::spawn(send(&client(), gateway.post("/slow", "drain-1")));
    upstream.wait_runs(1).await;
    gateway.terminate();
    // The shutdown has begun (no new connections) while the request runs.
    gateway.wait_until_closed().await;
    upstream.gate.add_permits(1);
    let reply = in_flight.await.expect("join");
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "the in-flight request finished"
    );
    assert!(gateway.exited_cleanly().await, "exits cleanly");

    let restarted = Process::start(&args);
    let replay = post(&restarted, "/slow", "drain-1").await;
    assert!(replay.replayed(), "its outcome was recorded before exit");
    assert_eq!(replay.body, reply.body);
    assert_eq!(upstream.runs(), 1);
}

/// SIGTERM after the client went away: the gateway's connections are
/// closed at once, but it waits for the detached request (up to
/// `--drain-timeout`), records its outcome and only then exits; after a
/// restart the retry is replayed, not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_requests_whose_client_left() {
    let Some(setup) = OnRedis::start(&[]).await else {
        return;
    };
    let (upstream, args) = (&setup.upstream, setup.args());
    let log = Log::new("left");
    // Detached: the case whose outcome used to be lost at shutdown.
    let gateway = with_a_detached_request(&setup, &log, "left-1").await;
    gateway.terminate();
    // Connections are closed and the drain has begun before the upstream
    // answers: only the drain can record this outcome.
    gateway.wait_until_closed().await;
    upstream.gate.add_permits(1);
    assert!(gateway.exited_cleanly().await, "exits cleanly");

    let restarted = Process::start(&args);
    let replay = post(&restarted, "/slow", "left-1").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed(), "its outcome was recorded before exit");
    assert_eq!(&replay.body[..], b"slow run 1");
    assert_eq!(upstream.runs(), 1);
}

/// SIGTERM with a detached request whose upstream never answers: the
/// gateway exits once `--drain-timeout` has passed (not when the upstream
/// timeout would), logs what it left, and the record stays processing
/// (its lease lapses; nothing released it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_is_bounded_and_says_what_it_left() {
    let Some(setup) = OnRedis::start(&[
        "--drain-timeout",
        "1s",
        "--upstream-timeout",
        "120s",
        "--lease",
        "60s",
    ])
    .await
    else {
        return;
    };
    let (upstream, args) = (&setup.upstream, setup.args());
    let log = Log::new("bounded");
    let gateway = with_a_detached_request(&setup, &log, "stuck-1").await;
    let signalled = std::time::Instant::now();
    gateway.terminate();
    // Without the bound it would wait for the upstream (120 s).
    let exited = tokio::time::timeout(Duration::from_secs(30), gateway.exited_cleanly())
        .await
        .expect("exited within the drain bound, not the upstream timeout");
    assert!(exited, "exits cleanly");
    let took = signalled.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "exited after {took:?}, before the drain bound"
    );
    let text = log.text();
    let left = text
        .lines()
        .find(|line| line.contains("still running after the drain timeout"))
        .unwrap_or_else(|| panic!("no line says what was left:\n{text}"));
    assert!(left.contains("shutdown: 1 background task(s)"), "{left}");

    // The record stays processing: a restarted gateway reads it so, and a
    // retry is in progress, not a second run.
    let restarted = Process::start(&args);
    let record = send(
        &client(),
        Request::get(format!(
            "http://{}/_idempotency/records?method=POST&path=/slow&key=stuck-1",
            restarted.addr
        ))
        .header("authorization", "Bearer alice")
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await;
    assert_eq!(record.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(json["state"], "processing", "{json}");
    let retry = post(&restarted, "/slow", "stuck-1").await;
    assert_eq!(retry.code().as_deref(), Some("idempotency_in_progress"));
    assert_eq!(upstream.runs(), 1);
    upstream.gate.add_permits(1);
}

#[test]
fn invalid_flags_are_one_line_errors_not_panics() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
        .args([
            "--lease",
            "30s",
            "--retention",
            "10s",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("retention"), "{stderr}");
    assert!(!stderr.contains("panicked"));
    // Values no clock can hold are refused the same way.
    for flags in [
        ["--in-flight", "wait:292400000000y"],
        ["--retention", "9000y"],
        // A record format this version does not know.
        ["--redis-record-format", "4"],
        ["--redis-record-format", "0"],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(flags)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .expect("run");
        assert_eq!(output.status.code(), Some(2), "{flags:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // A problem type base that is no absolute URI, or one that would end
    // its `Link` target and add another; a records prefix that is not
    // plain segments.
    for flags in [
        [
            "--problem-type-base",
            "https://docs.example/p/>; rel=\"x\", <https://evil.example/",
        ],
        ["--problem-type-base", "/problems/"],
        ["--problem-type-base", "https://docs.example/a b/"],
        ["--problem-type-base", "https://docs.example/%zz/"],
        ["--records-prefix", "/"],
        ["--records-prefix", "/a/../b"],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(flags)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .expect("run");
        assert_eq!(output.status.code(), Some(2), "{flags:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains(flags[0]), "{stderr}");
    }
    // Redis settings without Redis (the default store is memory).
    for flag in ["--redis-record-format=1", "--wait-for-replicas=1"] {
        let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args([flag, "--listen", "127.0.0.1:0"])
            .output()
            .expect("run");
        assert_eq!(output.status.code(), Some(2), "{flag}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!(
                "{} needs a Redis store",
                flag.split('=').next().unwrap_or(flag)
            )) && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
    // Keyed scopes on a store that outlives the process, with a tenant
    // secret that would be generated anew at every start.
    let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
        .args(["--keyed-scopes", "--store", "redis://127.0.0.1:1"])
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--keyed-scopes needs --tenant-secret") && !stderr.contains("panicked"),
        "{stderr}"
    );
    // Secrets too short to be secrets: a tenant secret (15 bytes, one
    // short of 16), and an HMAC key for JWT tenants (31 bytes, one short
    // of 32). Run under `timeout`: a gateway that accepted one would serve.
    let refused = |args: &[&std::ffi::OsStr]| {
        let output = Command::new("timeout")
            .arg("30")
            .arg(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .expect("run");
        assert!(
            !matches!(output.status.code(), Some(0 | 124)),
            "started with {args:?}"
        );
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    let stderr = refused(&["--tenant-secret".as_ref(), "012345678901234".as_ref()]);
    assert!(stderr.contains("at least 16 bytes"), "{stderr}");
    let key_file = std::env::temp_dir().join(format!("idem-short-hmac-{}", std::process::id()));
    std::fs::write(&key_file, "0123456789012345678901234567890").expect("key file");
    let stderr = refused(&["--tenant-jwt-keys".as_ref(), key_file.as_os_str()]);
    let _ = std::fs::remove_file(&key_file);
    assert!(
        stderr.contains("an HMAC secret must be at least 32 bytes"),
        "{stderr}"
    );
}

/// An upstream whose next connection is accepted and then held unread: the
/// gateway has reserved and is calling the upstream, which has not seen
/// the request. Later connections are served normally.
struct HoldingUpstream {
    addr: std::net::SocketAddr,
    hold_next: std::sync::Arc<std::sync::atomic::AtomicBool>,
    held: std::sync::Arc<tokio::sync::Notify>,
    upstream: Upstream,
}

impl HoldingUpstream {
    async fn start() -> Self {
        use std::sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hold_next = Arc::new(AtomicBool::new(false));
        let held = Arc::new(tokio::sync::Notify::new());
        let upstream = Upstream::default();
        let router = upstream.router();
        let (hold, signal) = (Arc::clone(&hold_next), Arc::clone(&held));
        tokio::spawn(async move {
            let mut parked = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                if hold.swap(false, Ordering::SeqCst) {
                    parked.push(stream);
                    signal.notify_one();
                    continue;
                }
                let service = hyper_util::service::TowerToHyperService::new(router.clone());
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        Self {
            addr,
            hold_next,
            held,
            upstream,
        }
    }
}

/// Crash point 1: killed after reserving, before the upstream saw the
/// request. The restarted gateway answers 409 while the lease lives, then
/// takes over: the upstream executes once, with Idempotency-Attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_before_the_upstream_is_called() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let up = HoldingUpstream::start().await;
    let upstream_url = format!("http://{}", up.addr);
    let redis_url = redis.url();
    let args = [
        "--upstream",
        &upstream_url,
        "--store",
        &redis_url,
        "--tenant-secret",
        SECRET,
        "--lease",
        LEASE,
        "--retention",
        "1h",
    ];

    up.hold_next
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let mut first = Process::start(&args);
    let held = up.held.notified();
    let lost = tokio::spawn(send(&client(), first.post("/orders", "crash-before")));
    held.await; // the gateway is connected to the upstream; the request is unread
    first.kill();
    let _ = lost.await;
    assert_eq!(up.upstream.runs(), 0);

    let second = Process::start(&args);
    let busy = post(&second, "/orders", "crash-before").await;
    assert_eq!(busy.code().as_deref(), Some("idempotency_in_progress"));
    let takeover = until_not_in_progress(&second, "/orders", "crash-before").await;
    assert_eq!(takeover.status, StatusCode::CREATED);
    assert_eq!(
        up.upstream.runs(),
        1,
        "executed once, by the attempt that took over"
    );
    let seen = up.upstream.seen.lock().expect("seen")[0].clone();
    assert_eq!(seen.key.as_deref(), Some("crash-before"));
    assert_eq!(seen.attempt.as_deref(), Some("2"));
    assert!(post(&second, "/orders", "crash-before").await.replayed());
}

/// Crash point 3: killed after the outcome was recorded, before the client
/// read the response. The retry is a replay of exactly what the upstream
/// answered, and the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_completion_before_the_client_reads() {
    use std::io::Write;
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let redis_url = redis.url();
    let args = [
        "--upstream",
        &upstream_url,
        "--store",
        &redis_url,
        "--tenant-secret",
        SECRET,
    ];

    let mut first = Process::start(&args);
    // A client that sends its request and never reads the answer.
    let mut silent = std::net::TcpStream::connect(&first.addr).expect("connect");
    silent
        .write_all(
            b"POST /orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\nIdempotency-Key: crash-after\r\ncontent-type: application/json\r\nContent-Length: 14\r\n\r\n{\"sku\":\"book\"}",
        )
        .expect("write");
    // Wait for the store to say the outcome is recorded: the signal is the record itself.
    wait_until(
        Duration::from_secs(10),
        "the outcome to be recorded",
        async || {
            redis
                .cli(&["--scan", "--pattern", "idem:*"])
                .lines()
                .any(|key| redis.record_state(key) == "completed")
        },
    )
    .await;
    first.kill();
    drop(silent);

    let second = Process::start(&args);
    let replay = post(&second, "/orders", "crash-after").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(
        replay.body, "{\"id\":1,\"bytes\":14}",
        "the bytes the upstream produced"
    );
    assert_eq!(upstream.runs(), 1);
}

/// Every setting given as an `IDEM_*` environment variable, through the
/// process, each checked by what it changes: `--require-key`, `--methods`,
/// `--tenant-header` with `--allow-anonymous`, `--records-prefix`,
/// `--in-flight wait:`, `--fail-open` (and its count in `/metrics`), and
/// the request log on stderr, which never holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_from_the_environment_take_effect() {
    let Some(mut redis) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let log = Log::new("env");
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .env("IDEM_LISTEN", "127.0.0.1:0")
            .env("IDEM_UPSTREAM", format!("http://{}", server.addr))
            .env("IDEM_STORE", redis.url())
            .env("IDEM_TENANT_HEADER", "x-tenant")
            .env("IDEM_ALLOW_ANONYMOUS", "true")
            .env("IDEM_REQUIRE_KEY", "true")
            .env("IDEM_METHODS", "POST,PUT")
            .env("IDEM_RECORDS_PREFIX", "/ops")
            .env("IDEM_IN_FLIGHT", "wait:20s")
            .env("IDEM_FAIL_OPEN", "true")
            // Read from the environment like the rest; long enough that a
            // loaded machine never fails a store call open by accident.
            .env("IDEM_STORE_TIMEOUT", "3s")
            .env("RUST_LOG", "info")
            .stderr(log.file()),
    );
    let http = client();
    let request = |method: &str, path: &str, key: Option<&str>, tenant: Option<&str>| {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("http://{}{}", gateway.addr, path))
            .header("content-type", "application/json");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", key);
        }
        if let Some(tenant) = tenant {
            builder = builder.header("x-tenant", tenant);
        }
        builder
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    // IDEM_REQUIRE_KEY
    let keyless = send(&http, request("POST", "/orders", None, Some("a"))).await;
    assert_eq!(keyless.code().as_deref(), Some("idempotency_key_missing"));
    // IDEM_TENANT_HEADER: one key, two tenants, two executions.
    let secret = "secret-key-4711";
    for tenant in ["a", "b"] {
        let first = send(
            &http,
            request("POST", "/orders", Some(secret), Some(tenant)),
        )
        .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(!first.replayed(), "tenant {tenant} runs its own");
    }
    assert_eq!(upstream.runs(), 2);
    // IDEM_ALLOW_ANONYMOUS: no tenant is the anonymous tenant, not 401.
    let anonymous = send(&http, request("POST", "/orders", Some("anon-1"), None)).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert!(
        send(&http, request("POST", "/orders", Some("anon-1"), None))
            .await
            .replayed()
    );
    // IDEM_METHODS: PUT is protected (its stored 405 replays), PATCH is not.
    for _ in 0..2 {
        send(&http, request("PUT", "/orders", Some("put-1"), Some("a"))).await;
    }
    assert!(
        send(&http, request("PUT", "/orders", Some("put-1"), Some("a")))
            .await
            .replayed()
    );
    let patch = send(
        &http,
        request("PATCH", "/orders", Some("patch-1"), Some("a")),
    )
    .await;
    assert!(!patch.replayed());
    assert!(
        !send(
            &http,
            request("PATCH", "/orders", Some("patch-1"), Some("a"))
        )
        .await
        .replayed()
    );
    // IDEM_RECORDS_PREFIX
    let record = send(
        &http,
        Request::get(format!(
            "http://{}/ops/records?method=POST&path=/orders&key={secret}",
            gateway.addr
        ))
        .header("x-tenant", "a")
        .body(Full::new(Bytes::new()))
        .expect("request"),
    )
    .await;
    assert_eq!(record.status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_slice(&record.body).expect("json");
    assert_eq!(json["state"], "completed");
    // IDEM_IN_FLIGHT=wait: a duplicate waits for the running attempt and
    // gets its replay instead of an immediate 409.
    let before = upstream.runs();
    let first = tokio::spawn(send(
        &http,
        request("POST", "/slow", Some("wait-1"), Some("a")),
    ));
    upstream.wait_runs(before + 1).await;
    let reserves = reserve_count(&gateway.metrics().await);
    let duplicate = tokio::spawn(send(
        &http,
        request("POST", "/slow", Some("wait-1"), Some("a")),
    ));
    // The duplicate has found the first attempt in flight once its
    // reservation is counted; without wait mode it is answered 409 at once.
    wait_until(
        Duration::from_secs(20),
        "the duplicate's reservation",
        async || reserve_count(&gateway.metrics().await) > reserves,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!duplicate.is_finished(), "the duplicate waits (no 409)");
    upstream.gate.add_permits(1);
    assert_eq!(first.await.expect("join").status, StatusCode::CREATED);
    let waited = duplicate.await.expect("join");
    assert_eq!(waited.status, StatusCode::CREATED);
    assert!(waited.replayed());
    // IDEM_FAIL_OPEN: with Redis gone, a keyed request runs unprotected and
    // is counted.
    let runs = upstream.runs();
    redis.kill();
    let open = send(&http, request("POST", "/orders", Some("open-1"), Some("a"))).await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(upstream.runs(), runs + 1);
    let text = gateway.metrics().await;
    for expected in [
        "idem_requests_total{outcome=\"fail_open\"} 1",
        "idem_requests_total{outcome=\"executed\"}",
        "idem_requests_total{outcome=\"replayed\"}",
        "idem_store_duration_seconds_bucket{op=\"reserve\",le=\"0.001\"}",
        "idem_store_duration_seconds_count{op=\"reserve\"}",
        "idem_replay_age_seconds_bucket{le=\"60\"}",
    ] {
        assert!(text.contains(expected), "{expected} missing from:\n{text}");
    }
    // SIGINT stops it cleanly too.
    gateway.signal("-INT");
    assert!(gateway.exited_cleanly().await);
    let log = log.text();
    assert!(log.contains("/orders") && log.contains("201"), "{log}");
    assert!(!log.contains(secret), "the key leaked into the log:\n{log}");
}

/// The value of the sample `name` (its labels included, as written) in
/// a `/metrics` text.
fn sample<'a>(metrics: &'a str, name: &str) -> Option<&'a str> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
}

/// How many reservations the gateway's `/metrics` text counts.
fn reserve_count(metrics: &str) -> u64 {
    sample(metrics, "idem_store_duration_seconds_count{op=\"reserve\"}")
        .map_or(0, |count| count.trim().parse().expect("a count"))
}

/// Every flag of `--help` is bound to its `IDEM_*` variable (upper snake
/// case of the flag), so the environment can set each of them.
#[test]
fn every_flag_has_its_environment_variable() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
        .arg("--help")
        .output()
        .expect("run");
    let help = String::from_utf8_lossy(&output.stdout).into_owned();
    let flags: Vec<&str> = help
        .split_whitespace()
        .filter(|word| word.starts_with("--") && *word != "--help" && *word != "--version")
        .collect();
    assert!(flags.len() >= 20, "{help}");
    for flag in flags {
        let flag = flag.trim_end_matches([',', '.', ';', ')']);
        let variable = format!(
            "[env: IDEM_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        assert!(help.contains(&variable), "{flag} has no {variable}]");
    }
}

/// A full memory store says so: new keys get 503 with a `Retry-After` of
/// the time until the earliest record expires, `/healthz` answers 503
/// `store full`, and `idem_store_full` is 1 in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_store_says_so() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let gateway = Process::start(&[
        "--upstream",
        &upstream_url,
        "--memory-capacity",
        "3",
        "--memory-tenant-quota",
        "0",
        "--retention",
        "10m",
    ]);
    let http = client();
    let post = |key: &str| {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let get = |path: &str| {
        Request::get(format!("http://{}{path}", gateway.addr))
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    assert_eq!(send(&http, get("/healthz")).await.status, StatusCode::OK);
    for key in ["f-1", "f-2", "f-3"] {
        assert_eq!(send(&http, post(key)).await.status, StatusCode::CREATED);
    }
    let refused = send(&http, post("f-4")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    let wait: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((590..=600).contains(&wait), "Retry-After {wait}");
    let health = send(&http, get("/healthz")).await;
    assert_eq!(health.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(&health.body[..], b"store full\n");
    // The gauge is refreshed every second.
    let full =
        |text: &String| text.contains("idem_store_full 1") && text.contains("idem_store_records 3");
    let text = poll_until(
        Duration::from_secs(20),
        async || String::from_utf8_lossy(&send(&http, get("/metrics")).await.body).into_owned(),
        full,
    )
    .await;
    assert!(full(&text), "no full gauge in:\n{text}");
    assert_eq!(upstream.runs(), 3);
}

/// One log line per request, naming its outcome: executed, replayed, the
/// layer's problem code, passed through, and the gateway's own refusal of
/// a `Connection` that names the key (before the layer sees it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_logs_one_line_with_its_outcome() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let log = Log::new("outcomes");
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0", "--upstream", &upstream_url])
            .env("RUST_LOG", "info")
            .stderr(log.file()),
    );
    let http = client();
    let order = |key: &str, body: &'static [u8]| {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body)))
            .expect("request")
    };
    let statuses = [
        send(&http, order("log-1", b"{\"a\":1}")).await.status,
        send(&http, order("log-1", b"{\"a\":1}")).await.status,
        send(&http, order("log-1", b"{\"a\":2}")).await.status,
        send(
            &http,
            Request::get(format!("http://{}/healthz", gateway.addr))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
        .status,
        send(&http, {
            let mut refused = order("log-2", b"{}");
            refused.headers_mut().insert(
                "connection",
                http::HeaderValue::from_static("idempotency-key"),
            );
            refused
        })
        .await
        .status,
    ];
    assert_eq!(statuses.map(|s| s.as_u16()), [201, 201, 422, 200, 400]);
    let expected = [
        ("POST", "/orders", 201, "executed"),
        ("POST", "/orders", 201, "replayed"),
        ("POST", "/orders", 422, "idempotency_conflict"),
        ("GET", "/healthz", 200, "passthrough"),
        ("POST", "/orders", 400, "connection_header_invalid"),
    ];
    // The log's request lines, without the terminal's colour codes.
    let requests = |text: &str| -> Vec<String> {
        let plain = text
            .split('\u{1b}')
            .map(|part| match part.strip_prefix('[') {
                Some(code) => code.split_once('m').map_or(code, |(_, rest)| rest),
                None => part,
            })
            .collect::<String>();
        plain
            .lines()
            .filter(|line| line.contains("idem_gateway: request "))
            .map(str::to_owned)
            .collect()
    };
    let text = poll_until(
        Duration::from_secs(20),
        async || log.text(),
        |text| requests(text).len() >= expected.len(),
    )
    .await;
    let lines = requests(&text);
    assert_eq!(lines.len(), expected.len(), "{text}");
    for (line, (method, path, status, outcome)) in lines.iter().zip(expected) {
        for field in [
            format!("method={method} "),
            format!("path=\"{path}\" "),
            format!("status={status} "),
            format!("outcome=\"{outcome}\" "),
        ] {
            assert!(line.contains(&field), "{field} missing from {line}");
        }
    }
    assert_eq!(upstream.runs(), 1);
}

/// Many tenants flood the memory store with a 64 KiB byte bound: new keys
/// beyond it are refused (503), what was accepted still replays, and the
/// store's own count of its bytes never passes the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_byte_bound_holds_while_tenants_flood() {
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let gateway = Process::start(&["--upstream", &upstream_url, "--memory-max-bytes", "64KiB"]);
    let http = client();
    let post = |n: usize| {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", "flood")
            .header("authorization", format!("Bearer tenant-{n}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let (mut created, mut refused) = (Vec::new(), 0);
    for n in 0..300 {
        let reply = send(&http, post(n)).await;
        match reply.status {
            StatusCode::CREATED => created.push(n),
            StatusCode::SERVICE_UNAVAILABLE => refused += 1,
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert!(created.len() >= 50, "only {} accepted", created.len());
    assert!(refused > 0, "nothing was refused at the bound");
    for n in &created {
        assert!(
            send(&http, post(*n)).await.replayed(),
            "tenant-{n} lost its record"
        );
    }
    let gauge = |text: &String| {
        sample(text, "idem_store_bytes")
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|bytes| *bytes > 0.0)
    };
    let text = poll_until(
        Duration::from_secs(20),
        async || gateway.metrics().await,
        |text| gauge(text).is_some(),
    )
    .await;
    let bytes = gauge(&text).unwrap_or_else(|| panic!("no bytes gauge in:\n{text}"));
    assert!(bytes <= 65_536.0, "{bytes} bytes over the bound");
    assert_eq!(upstream.runs(), created.len());
}

/// On a cluster whose failover can outlast the lease, the gateway says so
/// at start (the node timeout is read from the cluster); with a lease above
/// the bound it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_shorter_than_the_cluster_failover_is_warned_about() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    // Node timeout 5 s: the failover bound is 10 s.
    let store = idem_redis::RedisStore::from_url(&cluster.url()).expect("store");
    assert_eq!(
        store.cluster_node_timeout().await,
        Some(Duration::from_secs(5))
    );
    assert_eq!(
        idem_redis::failover_bound(Duration::from_secs(5)),
        Duration::from_secs(10)
    );
    let url = cluster.url();
    for (lease, warned) in [("5s", true), ("15s", false)] {
        let log = Log::new(&format!("failover-{lease}"));
        let mut gateway = Process::spawn(
            Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
                .args(["--listen", "127.0.0.1:0", "--store", &url, "--lease", lease])
                .args(["--tenant-secret", SECRET])
                .env("RUST_LOG", "warn")
                .stderr(log.file()),
        );
        gateway.kill();
        let text = log.text();
        assert_eq!(
            text.contains("shorter than this cluster's failover"),
            warned,
            "lease {lease}:\n{text}"
        );
    }
}

/// `rediss://` to a redis-server with TLS on: the certificate is verified
/// (against the CA in `SSL_CERT_FILE`), the records work through it; a
/// gateway that does not trust the CA gets no store (503), never a
/// connection to an unverified server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_redis_verifies_the_server() {
    let Some(ca) = idem_tests::tls::TestCa::new() else {
        return;
    };
    let tls_port = idem_tests::redis_server::free_port();
    let (cert, key, ca_file) = (ca.cert(), ca.key(), ca.ca());
    let Some(_redis) = RedisServer::spawn_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &cert.display().to_string(),
        "--tls-key-file",
        &key.display().to_string(),
        "--tls-ca-cert-file",
        &ca_file.display().to_string(),
        "--tls-auth-clients",
        "no",
    ]) else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let store = format!("rediss://127.0.0.1:{tls_port}");
    let start = |trusting: bool| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem-gateway"));
        command
            .args(["--listen", "127.0.0.1:0", "--upstream", &upstream_url])
            .args(["--store", &store, "--tenant-secret", SECRET])
            // The first call also makes the TLS connection.
            .args(["--store-timeout", "3s"])
            .env("RUST_LOG", "error")
            .stderr(Stdio::null());
        if trusting {
            command.env("SSL_CERT_FILE", &ca_file);
        } else {
            command.env("SSL_CERT_FILE", "/nonexistent");
        }
        Process::spawn(&mut command)
    };
    let post = |addr: &str| {
        Request::post(format!("http://{addr}/orders"))
            .header("idempotency-key", "tls-1")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let http = client();
    let trusting = start(true);
    let first = send(&http, post(&trusting.addr)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&http, post(&trusting.addr)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(upstream.runs(), 1);
    let doubting = start(false);
    let refused = send(&http, post(&doubting.addr)).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(upstream.runs(), 1);
}

/// `--wait-for-replicas`: a reservation no replica acknowledged is released
/// and answered 503 (the upstream never runs on it); a completion that
/// reached too few replicas is kept (the action ran: its client gets the
/// answer, a retry replays it) and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_short_of_the_requested_are_reported() {
    let Some(master) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let log = Log::new("replicas");
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0", "--upstream", &upstream_url])
            .args(["--store", &master.url(), "--tenant-secret", SECRET])
            // Long enough for a replica's acknowledgement on a loaded
            // machine: the first request has no replica and waits it out.
            .args(["--wait-for-replicas", "1", "--replica-timeout", "2s"])
            .env("RUST_LOG", "warn")
            .stderr(log.file()),
    );
    let http = client();
    let post = |path: &str, key: &str| {
        Request::post(format!("http://{}{path}", gateway.addr))
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let alone = send(&http, post("/orders", "no-replica")).await;
    assert_eq!(alone.status, StatusCode::SERVICE_UNAVAILABLE, "{alone:?}");
    assert_eq!(
        alone.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(upstream.runs(), 0);

    let port = master.port.to_string();
    let Some(mut replica) = RedisServer::spawn_with(&["--replicaof", "127.0.0.1", &port]) else {
        return;
    };
    wait_until(Duration::from_secs(20), "the replica to sync", async || {
        master
            .cli(&["INFO", "replication"])
            .contains("state=online")
    })
    .await;
    let running = tokio::spawn(send(&http, post("/slow", "replica-lost")));
    upstream.wait_runs(1).await;
    replica.kill();
    upstream.gate.add_permits(1);
    let answered = running.await.expect("join");
    assert_eq!(answered.status, StatusCode::CREATED, "{answered:?}");
    let replay = send(&http, post("/slow", "replica-lost")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(upstream.runs(), 1);
    let text = log.text();
    assert!(text.contains("fewer replicas than requested"), "{text}");
}

/// `--wait-for-replicas` with `--fail-open`: a reservation short of
/// replicas is an answer of the store, not an outage, so it is never run
/// unprotected: 503, and the upstream never runs, duplicates included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_never_covers_a_reservation_short_of_replicas() {
    let Some(master) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0", "--upstream", &upstream_url])
            .args(["--store", &master.url(), "--tenant-secret", SECRET])
            .args(["--wait-for-replicas", "1", "--replica-timeout", "100ms"])
            .arg("--fail-open"),
    );
    let http = client();
    for _ in 0..2 {
        let answer = send(&http, gateway.post("/orders", "no-replica-open")).await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        assert_eq!(
            answer.code().as_deref(),
            Some("idempotency_store_unavailable")
        );
    }
    assert_eq!(upstream.runs(), 0, "never run unprotected");
}

/// `rediss+cluster://` to a 3-node cluster serving TLS (TLS on the cluster
/// bus too): records work through it, the certificates verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_a_redis_cluster() {
    let Some(ca) = idem_tests::tls::TestCa::new() else {
        return;
    };
    let Some((_cluster, tls_ports)) = RedisCluster::spawn_tls(&ca) else {
        return;
    };
    let nodes: Vec<String> = tls_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let store = format!("rediss+cluster://{}", nodes.join(","));
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let gateway = Process::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0", "--upstream", &upstream_url])
            .args(["--store", &store, "--tenant-secret", SECRET])
            .env("SSL_CERT_FILE", ca.ca())
            .env("RUST_LOG", "error")
            .stderr(Stdio::inherit()),
    );
    let post = || {
        Request::post(format!("http://{}/orders", gateway.addr))
            .header("idempotency-key", "tls-cluster-1")
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let http = client();
    let first = send(&http, post()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = send(&http, post()).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(upstream.runs(), 1);
}

/// Without a tenant secret the gateway generates one and says at start
/// what that means on a shared store; with one it says nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_tenant_secret_is_announced() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let url = redis.url();
    for (secret, announced) in [(None, true), (Some(SECRET), false)] {
        if secret.is_some() {
            // The generated secret's gateway claimed the store: another
            // secret is refused, naming the way to take it over.
            let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
                .args(["--listen", "127.0.0.1:0", "--store", &url])
                .args(["--tenant-secret", SECRET])
                .output()
                .expect("run");
            assert_eq!(output.status.code(), Some(2));
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(stderr.contains("--replace-store-identity"), "{stderr}");
        }
        let log = Log::new(&format!("secret-{announced}"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem-gateway"));
        command
            .args(["--listen", "127.0.0.1:0", "--store", &url])
            .env("RUST_LOG", "warn")
            .stderr(log.file());
        if let Some(secret) = secret {
            // Another identity than the generated secret's, which claimed
            // the store: this one takes it over.
            command.args(["--tenant-secret", secret, "--replace-store-identity"]);
        }
        let mut gateway = Process::spawn(&mut command);
        gateway.kill();
        let text = log.text();
        assert_eq!(
            text.contains("secret generated at start") && text.contains("Another gateway"),
            announced,
            "{text}"
        );
    }
}

/// Of two gateways on one Redis, one counts the lapsed records (a Redis
/// store reads every record it holds to find them) and the other shows 0:
/// the fleet's sum or maximum of `idem_records_lapsed` is the store's
/// count, and Redis pays for one sweep, not one per gateway. (The claim
/// itself, and its handover once it lapses, are tested on the store:
/// `redis_layer::a_duty_is_held_by_one_holder_at_a_time`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gateway_of_a_fleet_counts_the_lapsed_records() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let url = redis.url();
    // A processing record whose owner died: its lease lapsed.
    let store = idem_redis::RedisStore::from_url(&url).expect("store");
    let stuck = idem_core::ReserveRequest {
        scope: idem_core::Scope::new("t", "POST /orders", "stuck".parse().expect("key")),
        fingerprint: idem_core::Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_millis(100),
        retention: Duration::from_secs(3600),
    };
    let reserved = idem_core::Store::reserve(&store, &stuck)
        .await
        .expect("reserve");
    assert!(matches!(reserved, idem_core::Reservation::Acquired(_)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let args = [
        "--upstream",
        upstream_url.as_str(),
        "--store",
        url.as_str(),
        "--tenant-secret",
        SECRET,
    ];
    let gateways = [Process::start(&args), Process::start(&args)];
    let lapsed = async |gateway: &Process| {
        sample(&gateway.metrics().await, "idem_records_lapsed").map(str::to_owned)
    };
    let both = poll_until(
        Duration::from_secs(20),
        async || (lapsed(&gateways[0]).await, lapsed(&gateways[1]).await),
        // Both show the gauge from the start (0); the one that counts
        // shows the record once it has counted.
        |(a, b)| {
            a.is_some() && b.is_some() && (a.as_deref() == Some("1") || b.as_deref() == Some("1"))
        },
    )
    .await;
    let mut shown = [both.0, both.1];
    shown.sort();
    assert_eq!(
        shown,
        [Some("0".to_owned()), Some("1".to_owned())],
        "one gateway counts, the other shows 0"
    );
}

/// A Redis that persists nothing is accepted with a warning that says what
/// a restart would cost; one with an append-only file gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_aof_is_warned_about() {
    let Some(volatile) = RedisServer::spawn() else {
        return;
    };
    let Some(durable) = RedisServer::spawn_with(&["--appendonly", "yes"]) else {
        return;
    };
    let warning = "Redis runs without appendonly: a restart can forget records";
    for (redis, warned) in [(&volatile, true), (&durable, false)] {
        let log = Log::new(if warned { "volatile" } else { "durable" });
        let gateway = Process::spawn(
            Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
                .args(["--listen", "127.0.0.1:0", "--store", &redis.url()])
                .env("RUST_LOG", "warn")
                .stderr(log.file()),
        );
        // The checks run before the gateway says where it listens.
        assert_eq!(
            log.text().contains(warning),
            warned,
            "appendonly {}: {}",
            if warned { "no" } else { "yes" },
            log.text()
        );
        drop(gateway);
    }
}

/// A rolling upgrade on one Redis: a gateway writing record format 1 and
/// one writing format 2 (the default before format 3) take the same keys at the same
/// moment. Each key runs once, each gateway replays the other's records
/// byte for byte, and the records show both formats. A record of a format
/// newer than the gateways read is refused (503, nothing run), never
/// misread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_1_and_2_share_one_redis_through_a_rolling_upgrade() {
    let Some(setup) = OnRedis::start(&["--lease", LEASE, "--retention", "1h"]).await else {
        return;
    };
    let older = Process::start(&[setup.args(), vec!["--redis-record-format", "1"]].concat());
    let newer = Process::start(&[setup.args(), vec!["--redis-record-format", "2"]].concat());
    let gateways = [&older, &newer];
    const KEYS: usize = 12;
    let mut firsts = Vec::new();
    for i in 0..KEYS {
        let key = format!("upgrade-{i}");
        // The first third reach the older gateway first, the second third
        // the newer one, so both formats write records; the rest reach
        // both at once.
        let (a, b) = match i * 3 / KEYS {
            0 => {
                let a = post(&older, "/orders", &key).await;
                (a, post(&newer, "/orders", &key).await)
            }
            1 => {
                let b = post(&newer, "/orders", &key).await;
                (post(&older, "/orders", &key).await, b)
            }
            _ => tokio::join!(post(&older, "/orders", &key), post(&newer, "/orders", &key)),
        };
        let mut created = Vec::new();
        for reply in [a, b] {
            match reply.status {
                StatusCode::CREATED => created.push(reply),
                StatusCode::CONFLICT => {
                    assert_eq!(reply.code().as_deref(), Some("idempotency_in_progress"));
                }
                other => panic!("{key}: {other} {:?}", reply.body),
            }
        }
        let first = created.into_iter().next().unwrap_or_else(|| {
            panic!("{key}: neither gateway answered 201");
        });
        firsts.push((key, first));
    }
    assert_eq!(setup.upstream.runs(), KEYS, "each key ran once");
    for (key, first) in &firsts {
        for gateway in gateways {
            let replay = until_not_in_progress(gateway, "/orders", key).await;
            assert_eq!(replay.status, StatusCode::CREATED, "{key}");
            assert_eq!(replay.body, first.body, "{key}");
            assert_eq!(
                replay.headers.get("location"),
                first.headers.get("location")
            );
        }
    }
    assert_eq!(setup.upstream.runs(), KEYS, "replays ran nothing");
    // Both formats are on the store: a format 2 record says so in its v
    // field, a format 1 record carries none and is not packed.
    let redis = &setup.redis;
    let records: Vec<String> = redis
        .cli(&["--scan", "--pattern", "idem:{*}"])
        .lines()
        .filter(|key| key.ends_with('}'))
        .map(str::to_owned)
        .collect();
    // (A format 2 record answered as in progress is kept expanded since.)
    let version = |key: &str| redis.cli(&["HGET", key, "v"]).trim().to_owned();
    let packed = |key: &str| !redis.cli(&["HGET", key, "n"]).trim().is_empty();
    let (v2, v1): (Vec<&String>, Vec<&String>) =
        records.iter().partition(|key| version(key) == "2");
    assert!(!v2.is_empty() && !v1.is_empty(), "v2 {v2:?}, v1 {v1:?}");
    assert!(v1.iter().all(|key| version(key).is_empty() && !packed(key)));
    // A record of a newer format: refused by both, nothing run. (A record
    // neither gateway has replayed yet: a replay kept in a gateway's cache
    // answers for up to a minute, as the store answered.)
    let newer_key = "upgrade-newer";
    let created = post(&older, "/orders", newer_key).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let record = redis
        .cli(&["--scan", "--pattern", "idem:{*}"])
        .lines()
        .find(|key| key.ends_with('}') && redis.cli(&["HGET", key, "key"]).trim() == newer_key)
        .expect("its record")
        .to_owned();
    redis.cli(&["HSET", &record, "v", "4"]);
    for gateway in gateways {
        let reply = post(gateway, "/orders", newer_key).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            reply.code().as_deref(),
            Some("idempotency_store_unavailable")
        );
    }
    assert_eq!(
        setup.upstream.runs(),
        KEYS + 1,
        "a newer record ran nothing"
    );
}

/// `-h` shows the handful of flags a first run needs; `--help` shows every
/// flag, by group.
#[test]
fn short_help_shows_the_first_run_and_long_help_every_group() {
    let help = |flag: &str| {
        let output = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .arg(flag)
            .output()
            .expect("run");
        assert!(output.status.success(), "{flag}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let short = help("-h");
    for essential in [
        "--listen",
        "--upstream",
        "--store",
        "--tenant-secret",
        "--records-admin-token",
    ] {
        assert!(short.contains(essential), "{essential} in -h:\n{short}");
    }
    assert!(!short.contains("--sealing-opening-keys"), "{short}");
    assert!(short.lines().count() < 40, "{short}");
    let long = help("--help");
    for group in [
        "Upstream:",
        "Store:",
        "Tenants and secrets:",
        "Lease and waiting:",
        "Records and operators:",
        "Observability:",
    ] {
        assert!(long.lines().any(|line| line == group), "{group} in --help");
    }
    assert!(long.contains("--sealing-opening-keys"));
}
