//! A private PostgreSQL server for tests, on a free loopback port.
//!
//! One server per test binary, started on first use (`initdb` into a
//! temporary directory, `fsync` off); each test takes a database of its own
//! ([`PgServer::database`]). The server runs under a small shell that
//! waits on a pipe from the test process: when the test binary exits,
//! however it exits, the pipe closes and the shell stops the server and
//! removes its directory. PostgreSQL refuses to run as root, so as root the
//! server runs as the `postgres` user (through `runuser`).
//!
//! Without PostgreSQL's binaries the tests skip with a notice, except in
//! CI, where that fails (see [`skip_or_fail`]).

use std::{
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use crate::redis_server::{free_port, skip_or_fail};

/// The shared server of this test binary.
#[derive(Debug)]
pub struct PgServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    bin: PathBuf,
    dir: PathBuf,
    as_postgres: bool,
    durable: bool,
    _shell: Mutex<(Child, ChildStdin)>,
}

static SHARED: OnceLock<Option<PgServer>> = OnceLock::new();

/// The directory holding `initdb`, `postgres` and `psql`.
fn bin_dir() -> Option<PathBuf> {
    let on_path = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .and_then(|dirs| {
            let mut versions: Vec<PathBuf> = dirs.flatten().map(|d| d.path().join("bin")).collect();
            versions.sort();
            versions.pop()
        });
    [on_path, debian]
        .into_iter()
        .flatten()
        .find(|dir| dir.join("initdb").exists() && dir.join("postgres").exists())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

impl PgServer {
    /// The server of this test binary, started on first use; `None` when
    /// PostgreSQL is not installed (outside CI).
    pub fn shared() -> Option<&'static PgServer> {
        SHARED.get_or_init(|| Self::spawn(false)).as_ref()
    }

    /// Starts a server; `durable` keeps every commit across a crash
    /// (`synchronous_commit` on), which [`crash`](Self::crash) needs.
    fn spawn(durable: bool) -> Option<PgServer> {
        let Some(bin) = bin_dir() else {
            skip_or_fail("PostgreSQL (initdb, postgres)");
            return None;
        };
        let as_postgres = is_root();
        // A port found free may be taken before the postmaster binds it
        // (another test's server, or an outgoing connection's ephemeral
        // port): then a new one, in a new directory, a few times.
        for attempt in 1.. {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!("idem-pg-{}-{port}", std::process::id()));
            Self::make_dir(&dir, as_postgres);
            let data = dir.join("data");
            let initdb = Self::command(as_postgres, &bin.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
                .output()
                .expect("run initdb");
            assert!(
                initdb.status.success(),
                "initdb failed: {}",
                String::from_utf8_lossy(&initdb.stderr)
            );
            let server = Self::launch_unchecked(bin.clone(), dir, port, as_postgres, durable);
            match server.ready() {
                Ok(()) => return Some(server),
                Err(log) if attempt < 4 && log.contains("Address already in use") => continue,
                Err(log) => panic!("postgres on port {port} did not start:\n{log}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// Starts the postmaster on `dir`'s data under the stopping shell
    /// (see the module's docs) and waits until it answers.
    fn launch(bin: PathBuf, dir: PathBuf, port: u16, as_postgres: bool, durable: bool) -> Self {
        let server = Self::launch_unchecked(bin, dir, port, as_postgres, durable);
        server.wait_ready();
        server
    }

    /// [`launch`](Self::launch) without waiting: the server may not have
    /// started (see [`ready`](Self::ready)).
    fn launch_unchecked(
        bin: PathBuf,
        dir: PathBuf,
        port: u16,
        as_postgres: bool,
        durable: bool,
    ) -> Self {
        let data = dir.join("data");
        // The shell stops the server when the test binary's end of the
        // pipe closes (whichever postmaster runs on the data directory
        // then: a test may have stopped and started it again).
        let script = format!(
            "'{postgres}' {options} >'{dir}/log' 2>&1 &\n\
             cat >/dev/null\n'{pg_ctl}' -D '{data}' -m immediate -w stop >/dev/null 2>&1\n\
             rm -rf '{dir}'\n",
            postgres = bin.join("postgres").display(),
            options = Self::options(&data, port, &dir, durable),
            pg_ctl = bin.join("pg_ctl").display(),
            data = data.display(),
            dir = dir.display(),
        );
        let mut shell = Self::command(as_postgres, Path::new("sh"))
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start postgres");
        let stdin = shell.stdin.take().expect("the shell's stdin");
        PgServer {
            port,
            bin,
            dir,
            as_postgres,
            durable,
            _shell: Mutex::new((shell, stdin)),
        }
    }

    /// A streaming standby of this server (which must be durable: a
    /// [`private`](Self::private) one), on a port of its own, named
    /// `standby` to the primary (for `synchronous_standby_names`).
    pub fn standby(&self) -> PgServer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("idem-pg-{}-{port}", std::process::id()));
        Self::make_dir(&dir, self.as_postgres);
        let backup = Self::command(self.as_postgres, &self.bin.join("pg_basebackup"))
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres application_name=standby",
                self.port
            ))
            .args(["-R", "-X", "stream", "--no-sync"])
            .output()
            .expect("run pg_basebackup");
        assert!(
            backup.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&backup.stderr)
        );
        Self::launch(self.bin.clone(), dir, port, self.as_postgres, true)
    }

    /// Promotes this standby to a primary and waits until it takes writes.
    pub fn promote(&self) {
        self.pg_ctl(&["-w", "promote"]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self
            .psql("postgres", "SELECT pg_is_in_recovery()")
            .as_deref()
            != Ok("f")
        {
            assert!(
                Instant::now() < deadline,
                "the standby did not leave recovery"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The postmaster's command-line options. `fsync` is off either way
    /// (the machine does not crash under the tests); without `durable`,
    /// commits are not waited for (a crash of the server loses the last).
    fn options(data: &Path, port: u16, dir: &Path, durable: bool) -> String {
        format!(
            "-D '{data}' -p {port} -k '{dir}' -c listen_addresses=127.0.0.1 \
             -c fsync=off -c synchronous_commit={commit} -c full_page_writes=off \
             -c max_connections=300 -c shared_buffers=64MB",
            data = data.display(),
            dir = dir.display(),
            commit = if durable { "on" } else { "off" },
        )
    }

    /// A server of the caller's own, for a test that stops and starts it
    /// (the shared one serves other tests of the binary); stopped and
    /// removed when dropped. `None` when PostgreSQL is not installed
    /// (outside CI).
    pub fn private() -> Option<PgServer> {
        Self::spawn(true)
    }

    /// Stops the server as a crash would (`pg_ctl -m immediate`: no
    /// shutdown checkpoint; committed data is kept, the start recovers).
    pub fn crash(&self) {
        self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }

    /// Starts the server again on its data and port, and waits until it
    /// answers: a new postmaster start.
    pub fn start_again(&self) {
        let data = self.dir.join("data");
        let options = Self::options(&data, self.port, &self.dir, self.durable);
        let log = self.dir.join("log");
        let log = log.to_string_lossy();
        self.pg_ctl(&["-o", &options, "-l", &log, "-w", "start"]);
        self.wait_ready();
    }

    /// Runs `pg_ctl` on the data directory with `args`; fails the test
    /// when it fails.
    fn pg_ctl(&self, args: &[&str]) {
        let ran = Self::command(self.as_postgres, &self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(args)
            .output()
            .expect("run pg_ctl");
        assert!(
            ran.status.success(),
            "pg_ctl {args:?}: {}",
            String::from_utf8_lossy(&ran.stderr)
        );
    }

    /// Creates `dir`, owned by the `postgres` user when the server runs
    /// as it.
    pub(crate) fn make_dir(dir: &Path, as_postgres: bool) {
        std::fs::create_dir_all(dir).expect("temp dir");
        if as_postgres {
            let chown = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir)
                .status();
            assert!(chown.is_ok_and(|s| s.success()), "chown {}", dir.display());
        }
    }

    pub(crate) fn command(as_postgres: bool, program: &Path) -> Command {
        if as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    fn wait_ready(&self) {
        if let Err(log) = self.ready() {
            panic!("postgres on port {} did not start:\n{log}", self.port);
        }
    }

    /// Waits (at most 30 s) until the server answers; its log if it does
    /// not (at once when the log says it could not bind its port).
    fn ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let log = || std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
        while Instant::now() < deadline {
            if self.psql("postgres", "SELECT 1").is_ok() {
                return Ok(());
            }
            let said = log();
            if said.contains("could not create any TCP/IP sockets") {
                return Err(said);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(log())
    }

    /// Runs one SQL command with `psql` on `database`; its output, or its
    /// error text.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String, String> {
        let output = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", database, "-X", "-q", "-A", "-t"])
            .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .map_err(|error| error.to_string())?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    }

    /// A new, empty database for one test: its URL.
    pub fn database(&self) -> String {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        self.psql("postgres", &format!("CREATE DATABASE {name}"))
            .expect("create a database");
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Whether the server runs as the `postgres` user.
    pub fn runs_as_postgres(&self) -> bool {
        self.as_postgres
    }
}
