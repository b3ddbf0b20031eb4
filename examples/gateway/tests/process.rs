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
use idem_tests::{Reply, TestServer, client, redis_server::RedisServer, send, upstream::Upstream};

struct Process {
    child: Child,
    addr: String,
}

impl Process {
    /// Starts the binary and waits for the line that says where it listens.
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-gateway"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn idem-gateway");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let addr = first
            .strip_prefix("idem-gateway listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_owned();
        // Keep draining stdout so the process never blocks on it.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        assert!(status.is_ok_and(|s| s.success()));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_request_then_restarted_on_the_same_redis() {
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
        "--lease",
        "2s",
        "--retention",
        "1h",
    ];

    let mut first = Process::start(&args);
    let lost = tokio::spawn(send(&client(), first.post("/slow", "crash-1")));
    upstream.wait_runs(1).await;
    first.kill(); // SIGKILL while the upstream is executing
    let _ = lost.await;

    let second = Process::start(&args);
    let busy = post(&second, "/slow", "crash-1").await;
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

    tokio::time::sleep(Duration::from_millis(2200)).await;
    let takeover = tokio::spawn(send(&client(), second.post("/slow", "crash-1")));
    upstream.wait_runs(2).await;
    upstream.gate.add_permits(2);
    let takeover = takeover.await.expect("join");
    assert_eq!(takeover.status, StatusCode::CREATED);
    {
        let seen = upstream.seen.lock().expect("seen");
        assert_eq!(seen[0].attempt.as_deref(), Some("1"));
        assert_eq!(
            seen[1].key.as_deref(),
            Some("crash-1"),
            "the same key reaches the upstream"
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
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let upstream = Upstream::default();
    let server = TestServer::start(upstream.router()).await;
    let upstream_url = format!("http://{}", server.addr);
    let redis_url = redis.url();
    let args = ["--upstream", &upstream_url, "--store", &redis_url];

    let mut gateway = Process::start(&args);
    let in_flight = tokio::spawn(send(&client(), gateway.post("/slow", "drain-1")));
    upstream.wait_runs(1).await;
    gateway.terminate();
    tokio::time::sleep(Duration::from_millis(200)).await;
    upstream.gate.add_permits(1);
    let reply = in_flight.await.expect("join");
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "the in-flight request finished"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = gateway.child.wait();
        drop(gateway);
        status
    })
    .await
    .expect("join")
    .expect("wait");
    assert!(status.success(), "exits cleanly: {status:?}");

    let restarted = Process::start(&args);
    let replay = post(&restarted, "/slow", "drain-1").await;
    assert!(replay.replayed(), "its outcome was recorded before exit");
    assert_eq!(replay.body, reply.body);
    assert_eq!(upstream.runs(), 1);
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
}
