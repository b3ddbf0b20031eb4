//! Real `redis-server` processes for tests, on free loopback ports.
//!
//! Each server runs with `--save "" --appendonly no` in its own temporary
//! directory, is killed and waited for on drop, and prints its log when the
//! test that owned it panicked. A missing `redis-server` fails the test when
//! `CI` is set to anything non-empty (`.ci/run` sets it), and elsewhere
//! skips it with a notice written straight to stderr, past the test
//! harness's output capture, so it shows in the test summary.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU16, Ordering},
    time::{Duration, Instant},
};

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A free loopback port below 55536 whose cluster bus port (+10000) is free
/// too.
pub fn free_port() -> u16 {
    if NEXT_PORT.load(Ordering::SeqCst) == 0 {
        // Spread concurrent test binaries over the range.
        let base = 20_000 + (std::process::id() % 2_000) as u16 * 15;
        let _ = NEXT_PORT.compare_exchange(0, base, Ordering::SeqCst, Ordering::SeqCst);
    }
    loop {
        let port = NEXT_PORT.fetch_add(1, Ordering::SeqCst);
        if port >= 55_000 {
            NEXT_PORT.store(20_000, Ordering::SeqCst);
            continue;
        }
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

/// Whether `redis-server` can be run. In CI its absence is a failure.
pub fn redis_available() -> bool {
    binary_available("redis-server")
}

/// Whether `binary --version` runs; if not, a failure in CI and a skip
/// with a notice elsewhere ([`skip_or_fail`]).
pub fn binary_available(binary: &str) -> bool {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        skip_or_fail(binary);
    }
    found
}

/// Whether this run is CI: `CI` set to anything but empty (`true`, `1`).
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// A test whose server binary is missing: a failure in CI; elsewhere a
/// skip, announced on stderr directly (`eprintln!` would be captured and
/// hidden from the summary of a passing test).
pub fn skip_or_fail(binary: &str) {
    assert!(
        !in_ci(),
        "{binary} is not installed, and CI is set: the tests that need it must run"
    );
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: {binary} is not installed (set CI=true to make this a failure)"
    );
}

/// One `redis-server` process.
#[derive(Debug)]
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a standalone server, or `None` when Redis is not installed
    /// (outside CI).
    pub fn spawn() -> Option<Self> {
        Self::spawn_with(&[])
    }

    /// Starts a server with extra arguments.
    pub fn spawn_with(extra: &[&str]) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        // A port found free may be taken before the server binds it (an
        // outgoing connection's ephemeral port, say): then a new one, a
        // few times.
        for attempt in 1.. {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("idem-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let mut server = Self {
                port,
                child: None,
                dir,
                extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            };
            server.launch();
            match server.ready() {
                Ok(()) => return Some(server),
                Err(log) if attempt < 4 && log.contains("Address already in use") => continue,
                Err(log) => panic!("redis-server on port {port} did not start:\n{log}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    fn start(&mut self) {
        self.launch();
        self.wait_ready();
    }

    /// Starts the process, without waiting for it.
    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            // A replica syncs at once, not after the default 5 s a primary
            // waits for more replicas to share one transfer.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
    }

    fn wait_ready(&self) {
        if let Err(log) = self.ready() {
            panic!("redis-server on port {} did not start:\n{log}", self.port);
        }
    }

    /// Waits (at most 10 s) until the server answers; its log if it does
    /// not (at once when it could not bind its port).
    fn ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            // A server with a password answers NOAUTH: it is up.
            if self
                .command("PING")
                .is_ok_and(|reply| reply.starts_with("+PONG") || reply.starts_with("-NOAUTH"))
            {
                return Ok(());
            }
            let log = self.log();
            if log.contains("Address already in use") {
                return Err(log);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(self.log())
    }

    /// Sends one inline command and returns the raw first reply chunk.
    pub fn command(&self, command: &str) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.write_all(format!("{command}\r\n").as_bytes())?;
        let mut buffer = vec![0u8; 64 * 1024];
        let n = stream.read(&mut buffer)?;
        Ok(String::from_utf8_lossy(&buffer[..n]).into_owned())
    }

    /// Runs `redis-cli -p PORT args...` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// One field of `INFO section` (`used_memory`, say), as Redis wrote it.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let prefix = format!("{field}:");
        self.cli(&["INFO", section]).lines().find_map(|line| {
            line.strip_prefix(prefix.as_str())
                .map(|v| v.trim().to_owned())
        })
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
            assert!(status.is_ok_and(|s| s.success()), "kill {signal} failed");
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Resumes a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the server (SIGKILL) and waits for it; its data is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.start();
    }

    /// The state of the record kept at `record`, whatever its format: a
    /// hash's `state` field, or a format 3 string's state byte (`p` and `a`
    /// processing, `c` completed); empty when there is none.
    pub fn record_state(&self, record: &str) -> String {
        const STATE: &str = "local kind = redis.call('TYPE', KEYS[1]).ok \
            if kind == 'hash' then return redis.call('HGET', KEYS[1], 'state') or '' end \
            if kind ~= 'string' then return '' end \
            local byte = string.sub(redis.call('GET', KEYS[1]), 2, 2) \
            if byte == 'c' then return 'completed' end \
            if byte == 'p' or byte == 'a' then return 'processing' end \
            return ''";
        self.cli(&["EVAL", STATE, "1", record]).trim().to_owned()
    }

    /// A field of the record kept at `record`, whatever its format: a
    /// hash's field, or the same part of a format 3 string (`fp`, `owner`,
    /// `cur_id`, `tenant` or `tenant_bin`, `op`, `key`); empty when there
    /// is none.
    pub fn record_field(&self, record: &str, field: &str) -> String {
        const FIELD: &str = "local kind = redis.call('TYPE', KEYS[1]).ok \
            if kind == 'hash' then return redis.call('HGET', KEYS[1], ARGV[1]) or '' end \
            if kind ~= 'string' then return '' end \
            local raw = redis.call('GET', KEYS[1]) \
            if ARGV[1] == 'owner' then return string.sub(raw, 3, 38) end \
            if ARGV[1] == 'cur_id' then return string.sub(raw, 39, 74) end \
            if ARGV[1] == 'fp' then return string.sub(raw, 75, 138) end \
            local _, at, form, length = string.find(raw, '^%d+:%d+:%d+:([tb])(%d+):', 139) \
            local fields = {} \
            fields[form == 'b' and 'tenant_bin' or 'tenant'] = string.sub(raw, at + 1, at + length) \
            at = at + length + 1 \
            for _, name in ipairs({'op', 'key'}) do \
              local _, ended, n = string.find(raw, '^(%d+):', at) \
              fields[name] = string.sub(raw, ended + 1, ended + n) \
              at = ended + n + 1 \
            end \
            return fields[ARGV[1]] or ''";
        self.cli(&["EVAL", FIELD, "1", record, field])
            .trim_end_matches('\n')
            .to_owned()
    }

    /// The key of the record (under the prefix `idem:`) whose idempotency
    /// key is `key`, whatever its format: a hash's `key` field, or the
    /// length-led key of a format 3 string.
    pub fn record_with_key(&self, key: &str) -> Option<String> {
        const FIND: &str = "for _, k in ipairs(redis.call('KEYS', 'idem:{*}')) do \
            local kind = redis.call('TYPE', k).ok \
            if kind == 'hash' and redis.call('HGET', k, 'key') == ARGV[1] then return k end \
            if kind == 'string' and string.find(redis.call('GET', k), #ARGV[1] .. ':' .. ARGV[1], 139, true) then return k end \
            end return ''";
        let found = self.cli(&["EVAL", FIND, "0", key]).trim().to_owned();
        (!found.is_empty()).then_some(found)
    }

    /// Total calls per command from `INFO commandstats`, and the
    /// microseconds per call.
    pub fn command_stats(&self) -> std::collections::HashMap<String, (u64, f64)> {
        let info = self.cli(&["INFO", "commandstats"]);
        let mut stats = std::collections::HashMap::new();
        for line in info.lines() {
            let Some(rest) = line.strip_prefix("cmdstat_") else {
                continue;
            };
            let Some((name, fields)) = rest.split_once(':') else {
                continue;
            };
            let mut calls = 0;
            let mut usec_per_call = 0.0;
            for field in fields.trim().split(',') {
                match field.split_once('=') {
                    Some(("calls", v)) => calls = v.parse().unwrap_or(0),
                    Some(("usec_per_call", v)) => usec_per_call = v.parse().unwrap_or(0.0),
                    _ => {}
                }
            }
            stats.insert(name.to_owned(), (calls, usec_per_call));
        }
        stats
    }
}

/// How many calls of `command` two [`RedisServer::command_stats`]
/// snapshots are apart.
pub fn calls_between(
    before: &std::collections::HashMap<String, (u64, f64)>,
    after: &std::collections::HashMap<String, (u64, f64)>,
    command: &str,
) -> u64 {
    let calls = |stats: &std::collections::HashMap<String, (u64, f64)>| {
        stats.get(command).map_or(0, |stat| stat.0)
    };
    calls(after) - calls(before)
}

/// Every command's calls between two [`RedisServer::command_stats`]
/// snapshots, but `INFO` (the snapshots' own), by command, those with
/// none left out.
pub fn commands_between(
    before: &std::collections::HashMap<String, (u64, f64)>,
    after: &std::collections::HashMap<String, (u64, f64)>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .keys()
        .filter(|name| name.as_str() != "info")
        .map(|name| (name.clone(), calls_between(before, after, name)))
        .filter(|(_, calls)| *calls > 0)
        .collect()
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A stopped process must be continued to die cleanly.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        if std::thread::panicking() {
            eprintln!("---- redis-server :{} log ----\n{}", self.port, self.log());
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster formed with `redis-cli --cluster create`: 3 masters,
/// and replicas where asked.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts and forms a 3-node cluster without replicas (node timeout
    /// 5 s), or `None` when Redis is not installed (outside CI).
    pub fn spawn() -> Option<Self> {
        Self::spawn_with(0, 5_000)
    }

    /// Starts and forms a cluster of 3 masters with `replicas` replicas
    /// each and this `cluster-node-timeout`, and waits until every node
    /// says `cluster_state:ok` and every replica is in sync.
    pub fn spawn_with(replicas: usize, node_timeout_ms: u64) -> Option<Self> {
        Self::spawn_nodes(replicas, node_timeout_ms, |_| Vec::new())
    }

    /// A 3-node cluster whose nodes also serve TLS (and talk TLS on the
    /// cluster bus) with `ca`'s server certificate: `tls_url` names the TLS
    /// ports. Plain ports stay open for the harness.
    pub fn spawn_tls(ca: &crate::tls::TestCa) -> Option<(Self, Vec<u16>)> {
        let ports = std::cell::RefCell::new(Vec::new());
        let (cert, key, ca_file) = (
            ca.cert().display().to_string(),
            ca.key().display().to_string(),
            ca.ca().display().to_string(),
        );
        let cluster = Self::spawn_nodes(0, 5_000, |_| {
            let port = free_port();
            ports.borrow_mut().push(port);
            vec![
                "--tls-port".to_owned(),
                port.to_string(),
                "--tls-cluster".to_owned(),
                "yes".to_owned(),
                "--tls-cert-file".to_owned(),
                cert.clone(),
                "--tls-key-file".to_owned(),
                key.clone(),
                "--tls-ca-cert-file".to_owned(),
                ca_file.clone(),
                "--tls-auth-clients".to_owned(),
                "no".to_owned(),
            ]
        })?;
        Some((cluster, ports.into_inner()))
    }

    fn spawn_nodes(
        replicas: usize,
        node_timeout_ms: u64,
        mut extra: impl FnMut(usize) -> Vec<String>,
    ) -> Option<Self> {
        let mut nodes = Vec::new();
        let timeout = node_timeout_ms.to_string();
        for n in 0..3 * (1 + replicas) {
            let port = NEXT_PORT.load(Ordering::SeqCst);
            let conf = format!("nodes-{}-{port}.conf", std::process::id());
            let mut args: Vec<String> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &conf,
                "--cluster-node-timeout",
                &timeout,
            ]
            .iter()
            .map(|a| (*a).to_owned())
            .collect();
            args.extend(extra(n));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(RedisServer::spawn_with(&args)?);
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = nodes.iter().all(|n| {
                n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
                    && (!n.cli(&["ROLE"]).starts_with("slave")
                        || n.cli(&["INFO", "replication"])
                            .contains("master_link_status:up"))
            });
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(Self { nodes })
    }

    /// The index of a node that is a master now.
    pub fn a_master(&self) -> usize {
        self.nodes
            .iter()
            .position(|n| n.cli(&["ROLE"]).starts_with("master"))
            .expect("a master")
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

/// The record format of a test that runs once per layout: format 2 (packed
/// new keys, compact headers) when `packed`, else format 1 (expanded,
/// four-byte headers).
pub fn format_of(packed: bool) -> idem_redis::RecordFormat {
    if packed {
        idem_redis::RecordFormat::V2
    } else {
        idem_redis::RecordFormat::V1
    }
}
