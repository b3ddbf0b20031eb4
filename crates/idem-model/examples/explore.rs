//! Explores the model with idem's design and prints what it found.
//!
//! Run with `cargo run --release -p idem-model --example explore -- [OWNERS REQUESTS TICKS
//! OWNER_CRASHES STORE_CRASHES OUTAGES LOST_REPLIES CANCELS FORCE_RELEASES DELAYED
//! STALLS [always|everysec|both]]` (`Bounds::DEEP` on a durable store by default).

use idem_model::{Bounds, IdemModel, Persistence};
use stateright::{Checker, Model};

fn main() {
    let args: Vec<u8> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let arg = |i: usize, default: u8| args.get(i).copied().unwrap_or(default);
    let bounds = Bounds {
        owners: arg(0, Bounds::DEEP.owners),
        requests: arg(1, Bounds::DEEP.requests),
        ticks: arg(2, Bounds::DEEP.ticks),
        owner_crashes: arg(3, Bounds::DEEP.owner_crashes),
        store_crashes: arg(4, Bounds::DEEP.store_crashes),
        outages: arg(5, Bounds::DEEP.outages),
        lost_replies: arg(6, Bounds::DEEP.lost_replies),
        cancels: arg(7, Bounds::DEEP.cancels),
        force_releases: arg(8, Bounds::DEEP.force_releases),
        delayed: arg(9, Bounds::DEEP.delayed),
        stalls: arg(10, Bounds::DEEP.stalls),
        expiry_changes: Bounds::DEEP.expiry_changes,
        erasures: Bounds::DEEP.erasures,
    };
    let persistences: &[Persistence] = match std::env::args().nth(12).as_deref() {
        Some("everysec") => &[Persistence::EverySecond],
        Some("both") => &[Persistence::Always, Persistence::EverySecond],
        _ => &[Persistence::Always],
    };
    for &persistence in persistences {
        let started = std::time::Instant::now();
        let checker = IdemModel::idem(persistence, bounds)
            .checker()
            .threads(std::thread::available_parallelism().map_or(1, usize::from))
            .spawn_bfs()
            .join();
        println!(
            "{persistence:?} {bounds:?}: {} states, {} unique, {:?}, done {}",
            checker.state_count(),
            checker.unique_state_count(),
            started.elapsed(),
            checker.is_done()
        );
        for (name, path) in checker.discoveries() {
            println!("  counterexample of \"{name}\": {:?}", path.into_actions());
        }
    }
}
