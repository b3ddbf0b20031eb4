//! PgBouncer in transaction pooling mode in front of a test's PostgreSQL
//! server, on a free loopback port.
//!
//! Started from the distribution's `pgbouncer` (as the `postgres` user
//! when the tests run as root: PgBouncer refuses to run as root), with
//! every database of the server behind it, trust authentication and
//! `pool_mode = transaction`: each transaction may run on another server
//! connection, so nothing may outlive a transaction (prepared statements
//! among them). Like [`PgServer`], it runs under a small shell that waits
//! on a pipe from the test process and stops it when that closes.
//!
//! Without the binary the tests skip with a notice, except in CI, where
//! that fails (see [`skip_or_fail`]).

use std::{
    path::PathBuf,
    process::{Child, ChildStdin, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    postgres_server::PgServer,
    redis_server::{binary_available, free_port, skip_or_fail},
};

/// A running PgBouncer.
#[derive(Debug)]
pub struct PgBouncer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    server_port: u16,
    dir: PathBuf,
    _shell: Mutex<(Child, ChildStdin)>,
}

impl PgBouncer {
    /// PgBouncer in front of `server`, with at most `pool_size` server
    /// connections per database; `None` when it is not installed (outside
    /// CI).
    pub fn spawn(server: &PgServer, pool_size: u32) -> Option<Self> {
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|path| std::path::Path::new(path).exists())
            .map(str::to_owned)
            .or_else(|| binary_available("pgbouncer").then(|| "pgbouncer".to_owned()));
        let Some(binary) = binary else {
            skip_or_fail("pgbouncer");
            return None;
        };
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("idem-pgb-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ini = format!(
            "[databases]\n* = host=127.0.0.1 port={server}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/users.txt\npool_mode = transaction\n\
             max_client_conn = 500\ndefault_pool_size = {pool_size}\n\
             logfile = {dir}/log\npidfile = {dir}/pid\n\
             ignore_startup_parameters = extra_float_digits,application_name\n",
            server = server.port,
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("users.txt");
        let as_postgres = server.runs_as_postgres();
        PgServer::make_dir(&dir, as_postgres);
        let script = format!(
            "'{binary}' -d '{dir}/pgbouncer.ini' >'{dir}/out' 2>&1\n\
             cat >/dev/null\nkill \"$(cat '{dir}/pid')\" 2>/dev/null\nsleep 0.2\nrm -rf '{dir}'\n",
            dir = dir.display(),
        );
        let mut shell = PgServer::command(as_postgres, std::path::Path::new("sh"))
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let stdin = shell.stdin.take().expect("the shell's stdin");
        let bouncer = Self {
            port,
            server_port: server.port,
            dir,
            _shell: Mutex::new((shell, stdin)),
        };
        bouncer.wait_ready();
        Some(bouncer)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "pgbouncer on port {} did not start:\n{}\n{}",
            self.port,
            std::fs::read_to_string(self.dir.join("out")).unwrap_or_default(),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        );
    }

    /// `url` (a database of the server behind it) through PgBouncer.
    pub fn url(&self, url: &str) -> String {
        url.replace(
            &format!("127.0.0.1:{}/", self.server_port),
            &format!("127.0.0.1:{}/", self.port),
        )
    }

    /// A store on a fresh database of `server` through PgBouncer, set up
    /// for it (`transaction_pooler`), with a pool of 8: more connections
    /// than PgBouncer's own to the server when spawned with fewer.
    pub fn store(&self, server: &PgServer) -> idem_postgres::PgStore {
        idem_postgres::PgStore::builder()
            .url(self.url(&server.database()))
            .transaction_pooler(true)
            .max_connections(8)
            .build()
            .expect("store")
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// A guard that, dropped while its test fails, prints what PgBouncer
    /// logged (server logins that failed, waits, timeouts): the evidence
    /// when a call through the pooler stalled.
    pub fn log_on_failure(&'static self) -> LogOnFailure {
        LogOnFailure(self)
    }
}

/// See [`PgBouncer::log_on_failure`].
#[derive(Debug)]
pub struct LogOnFailure(&'static PgBouncer);

impl Drop for LogOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- pgbouncer on port {} logged:\n{}--- end of pgbouncer's log",
                self.0.port,
                self.0.log()
            );
        }
    }
}
