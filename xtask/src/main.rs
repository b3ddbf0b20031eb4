//! The repository's own commands, run through the `cargo xtask` alias
//! (`.cargo/config.toml`), so that they need nothing but a stock Rust
//! toolchain.
//!
//! `cargo xtask test` runs the whole suite as CI does: it installs
//! `cargo-nextest` once when it is missing (`cargo install cargo-nextest
//! --locked`, into cargo's own bin folder), says which of the servers the
//! tests start are not installed (their tests pass with a `SKIPPED` line
//! outside CI, and fail with `CI=true`), then runs every test in a
//! process of its own under nextest (`.config/nextest.toml`) and the
//! doctests, which nextest does not run. Arguments after `test` go to
//! nextest (`cargo xtask test -p idem-layer`).

use std::process::{Command, ExitCode};

/// A program the suite starts, and what a missing one leaves unchecked.
const SERVERS: [(&str, &[&str], &str); 7] = [
    (
        "redis-server",
        &["--version"],
        "the Redis and Redis Cluster tests",
    ),
    (
        "pgbouncer",
        &["--version"],
        "the PostgreSQL tests behind PgBouncer",
    ),
    (
        "nats-server",
        &["--version"],
        "the message consumer's tests",
    ),
    ("promtool", &["--version"], "the alert rules' tests"),
    (
        "chromedriver",
        &["--version"],
        "the operator page's browser test",
    ),
    (
        "valgrind",
        &["--version"],
        "the cost budget (bench/budget.sh, CI only)",
    ),
    (
        "python3",
        &["-c", "import stripe"],
        "the Stripe SDK test (pip install -r tests/sdk/requirements.txt)",
    ),
];

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("test") => test(&args.collect::<Vec<_>>()),
        _ => {
            eprintln!("usage: cargo xtask test [nextest arguments]");
            ExitCode::from(2)
        }
    }
}

/// Whether `program args` runs and succeeds.
fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The cargo that runs this program.
fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Runs `cargo args`, telling what it runs; whether it succeeded.
fn cargo(args: &[&str]) -> bool {
    eprintln!("xtask: cargo {}", args.join(" "));
    Command::new(cargo_program())
        .args(args)
        .status()
        .is_ok_and(|status| status.success())
}

/// Whether PostgreSQL's server programs are installed (`initdb` on the
/// path, or in Debian's versioned folder).
fn postgres_installed() -> bool {
    runs("initdb", &["--version"])
        || std::fs::read_dir("/usr/lib/postgresql").is_ok_and(|versions| {
            versions
                .flatten()
                .any(|version| version.path().join("bin/initdb").exists())
        })
}

fn test(nextest_args: &[String]) -> ExitCode {
    if !runs(&cargo_program(), &["nextest", "--version"]) {
        eprintln!(
            "xtask: cargo-nextest is missing; installing it once with \
             `cargo install cargo-nextest --locked` (a few minutes)"
        );
        if !cargo(&["install", "cargo-nextest", "--locked"]) {
            eprintln!("xtask: could not install cargo-nextest");
            return ExitCode::FAILURE;
        }
    }
    let mut missing: Vec<&str> = SERVERS
        .iter()
        .filter(|(program, args, _)| !runs(program, args))
        .map(|(_, _, unchecked)| *unchecked)
        .collect();
    if !postgres_installed() {
        missing.push("the PostgreSQL tests (initdb and postgres)");
    }
    if !missing.is_empty() {
        // The tests' own rule (`idem_tests::redis_server::in_ci`): any
        // non-empty `CI`.
        let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
        let outcome = if ci {
            "fail (CI is set)"
        } else {
            "are skipped"
        };
        eprintln!("xtask: not installed here, so these {outcome}:");
        for unchecked in &missing {
            eprintln!("  - {unchecked}");
        }
    }
    // With arguments (`-p idem-layer`), they choose the tests.
    let mut nextest = vec!["nextest", "run", "--locked"];
    if nextest_args.is_empty() {
        nextest.push("--workspace");
    }
    nextest.extend(nextest_args.iter().map(String::as_str));
    let tests = cargo(&nextest);
    // The doctests (the README's examples among them) run even when a
    // test failed, so one run reports both; not when arguments chose the
    // tests.
    let doctests = !nextest_args.is_empty() || cargo(&["test", "--workspace", "--doc", "--locked"]);
    if tests && doctests {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
