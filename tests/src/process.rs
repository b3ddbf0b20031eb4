//! A program under test as a real process: its first stdout line (a
//! banner), its stderr lines as they come, killed with SIGKILL on drop.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// A running process whose stderr is read line by line.
#[derive(Debug)]
pub struct Spawned {
    child: Child,
    /// The first line it printed on stdout.
    pub banner: String,
    lines: mpsc::Receiver<String>,
}

impl Spawned {
    /// Starts `command` and waits for its first stdout line; a process
    /// that prints none is killed and the test fails.
    pub fn start(command: &mut Command) -> Self {
        Self::start_after(command, "")
    }

    /// Starts `command` and waits for its first stdout line containing
    /// `marker` (the banner), skipping the lines before it (a test binary
    /// run as a child prints its harness's lines first).
    pub fn start_after(command: &mut Command, marker: &str) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the program under test");
        let stdout = child.stdout.take().expect("stdout");
        let mut stdout = BufReader::new(stdout);
        let mut banner = String::new();
        loop {
            banner.clear();
            let read = stdout.read_line(&mut banner).unwrap_or(0);
            if read == 0 || (banner.contains(marker) && !banner.trim().is_empty()) {
                break;
            }
        }
        // Keep draining stdout so the process never blocks on it.
        std::thread::spawn(move || stdout.lines().for_each(drop));
        let (tx, lines) = mpsc::channel();
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        if banner.trim().is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            let said: Vec<String> = lines.try_iter().collect();
            panic!("no banner; stderr said:\n{}", said.join("\n"));
        }
        Self {
            child,
            banner: banner.trim().to_owned(),
            lines,
        }
    }

    /// The `host:port` of the first `http://` address in its banner.
    pub fn address(&self) -> String {
        self.banner
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {:?}", self.banner))
            .to_owned()
    }

    /// Waits (at most 30 s) for a stderr line containing `what`.
    pub fn wait_for_line(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(what) => return,
                Ok(line) => seen.push(line),
                Err(_) => panic!(
                    "never printed {what:?}; printed meanwhile:\n{}",
                    seen.join("\n")
                ),
            }
        }
    }

    /// Kills it with SIGKILL and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
    }
}
