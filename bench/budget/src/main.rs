//! `idem-budget`: drives one request path users pay, in process and one
//! request at a time, so that `valgrind --tool=callgrind` counts its
//! instructions per request and a counting allocator its allocations.
//! `bench/budget.sh` runs every path and checks the figures against
//! `bench/budget.toml`; CI runs that check.
//!
//! usage: `idem-budget PATH REQUESTS`
//!
//! Paths (see [`Path`]): `memory-new`, `memory-replay`, `redis-new`,
//! `redis-replay` (the server from `REDIS_URL`; only this process is
//! counted), `grpc-new`, `sealed-new`, `gateway-new`.
//!
//! Each path is warmed up with [`WARM_UP`] requests first; then
//! [`budget_window`] sends `REQUESTS` more. The script runs callgrind with
//! `--toggle-collect=*budget_window*`, so only that window is counted:
//! start-up, warm-up and shutdown fall outside it. The allocations are
//! counted over the same window and printed on one line:
//! `BUDGET path=… requests=… allocations=… ok=…`.

mod paths;

use std::{alloc::System, process::ExitCode};

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

use crate::paths::{Bench, Path};

#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Requests sent before the counted window: connections opened, caches
/// and lazily built tables filled.
const WARM_UP: usize = 50;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).and_then(|name| Path::from_name(name)) else {
        eprintln!(
            "usage: idem-budget PATH REQUESTS; PATH is one of {}",
            Path::names()
        );
        return ExitCode::from(2);
    };
    let requests: usize = match args.get(2).map(|n| n.parse()) {
        Some(Ok(n)) if n > 0 => n,
        None => 1000,
        _ => {
            eprintln!("REQUESTS is a positive number");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("no runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut bench = match runtime.block_on(Bench::start(path)) {
        Ok(bench) => bench,
        Err(error) => {
            eprintln!("{}: {error}", path.name());
            return ExitCode::FAILURE;
        }
    };
    let warm = runtime.block_on(bench.send(WARM_UP));
    let region = Region::new(ALLOCATOR);
    let ok = budget_window(&runtime, &mut bench, requests);
    let allocations = region.change().allocations;
    println!(
        "BUDGET path={} requests={requests} allocations={allocations} ok={ok}",
        path.name()
    );
    if warm != WARM_UP || ok != requests {
        eprintln!(
            "{}: {ok} of {requests} answered as expected ({warm} of {WARM_UP} in the warm-up)",
            path.name()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// The counted window: `requests` requests down the path, one at a time.
/// Its name is what callgrind's `--toggle-collect` matches.
#[inline(never)]
fn budget_window(runtime: &tokio::runtime::Runtime, bench: &mut Bench, requests: usize) -> usize {
    runtime.block_on(bench.send(requests))
}
