//! The model checked: idem's design holds every property under each fault
//! (and under pairs of them), each bad-day design is needed (without it
//! the checker finds the counterexample kept here), and each documented
//! limit is a counterexample the checker prints.

use idem_model::{Action, Bounds, Design, Excuses, IdemModel, Persistence, Ran, property};
use stateright::{Checker, Model};

/// Explores `model` completely (breadth first) and answers the names of
/// the properties with a counterexample, printing each path.
fn explore(what: &str, model: IdemModel) -> Vec<&'static str> {
    let checker = model.checker().threads(2).spawn_bfs().join();
    assert!(checker.is_done(), "{what}: the exploration ended early");
    println!(
        "{what}: {} states ({} unique)",
        checker.state_count(),
        checker.unique_state_count()
    );
    let mut found: Vec<&'static str> = checker.discoveries().keys().copied().collect();
    found.sort_unstable();
    for name in &found {
        if let Some(path) = checker.discovery(name) {
            println!("{what}: counterexample of \"{name}\":");
            for action in path.into_actions() {
                println!("  {action:?}");
            }
        }
    }
    found
}

const NONE: Vec<&str> = Vec::new();

/// Adds a fault to the base bounds.
type Fault = fn(&mut Bounds);

fn with(faults: impl Fn(&mut Bounds)) -> Bounds {
    let mut bounds = Bounds::BASE;
    faults(&mut bounds);
    bounds
}

#[test]
fn idem_holds_every_property_under_each_fault() {
    let each: [(&str, Fault); 10] = [
        ("an owner crash", |b| b.owner_crashes = 1),
        ("an erasure, with replay caches", |b| b.erasures = 1),
        ("an expiry shortened from outside", |b| b.expiry_changes = 1),
        ("a stalled owner", |b| b.stalls = 1),
        ("a store crash", |b| b.store_crashes = 1),
        ("an outage", |b| b.outages = 1),
        ("a lost reply", |b| b.lost_replies = 1),
        ("a cancel", |b| b.cancels = 1),
        ("a force release", |b| b.force_releases = 1),
        ("a delayed reservation", |b| b.delayed = 1),
    ];
    for (fault, add) in each {
        let model = IdemModel::idem(Persistence::Always, with(add));
        assert_eq!(explore(fault, model), NONE, "{fault}");
    }
}

#[test]
fn idem_holds_every_property_under_a_store_crash_with_an_owner_crash() {
    let model = IdemModel::idem(
        Persistence::Always,
        with(|b| {
            b.store_crashes = 1;
            b.owner_crashes = 1;
        }),
    );
    assert_eq!(explore("store and owner crash", model), NONE);
}

#[test]
fn idem_holds_every_property_under_a_store_crash_with_a_lost_reply() {
    let model = IdemModel::idem(
        Persistence::Always,
        with(|b| {
            b.store_crashes = 1;
            b.lost_replies = 1;
        }),
    );
    assert_eq!(explore("store crash and lost reply", model), NONE);
}

/// `appendfsync everysec`: with its documented limit (what the store lost
/// is not promised), everything else holds.
#[test]
fn idem_holds_every_property_with_the_documented_limits_on_everysec() {
    let model = IdemModel::idem(
        Persistence::EverySecond,
        with(|b| {
            b.store_crashes = 1;
            b.ticks = 3;
        }),
    );
    assert_eq!(explore("everysec store crash", model), NONE);
}

fn without(design: Design, faults: Fault) -> IdemModel {
    IdemModel {
        design,
        ..IdemModel::idem(Persistence::Always, with(faults))
    }
}

/// Two owners, a store down past the lease, restarted with its data:
/// without the restart grace the second owner takes the lapsed lease over
/// and runs the action while the first holds its outcome.
#[test]
fn without_the_restart_grace_a_store_outage_runs_the_action_twice() {
    let design = Design {
        restart_grace: false,
        ..Design::IDEM
    };
    let found = explore(
        "without the restart grace",
        without(design, |b| b.store_crashes = 1),
    );
    assert!(found.contains(&property::ONCE), "{found:?}");
}

/// A release that fails while the store is down and is not retried leaves
/// a live lease nobody runs (every retry gets 409 until it lapses).
#[test]
fn without_retried_releases_a_failed_release_blocks_the_key() {
    let design = Design {
        retry_release: false,
        ..Design::IDEM
    };
    let found = explore(
        "without retried releases",
        without(design, |b| b.outages = 1),
    );
    assert!(found.contains(&property::NO_ORPHAN), "{found:?}");
}

/// A reservation whose reply was lost, freed by one try that fails, leaves
/// a live lease nobody runs.
#[test]
fn without_retried_abandons_a_lost_reservation_blocks_the_key() {
    let design = Design {
        retry_abandon: false,
        ..Design::IDEM
    };
    let model = without(design, |b| {
        b.lost_replies = 1;
        b.outages = 1;
    });
    let found = explore("without retried abandons", model);
    assert!(found.contains(&property::NO_ORPHAN), "{found:?}");
}

/// An unknown outcome released like a temporary failure lets a retry run
/// the action again while the first may have acted.
#[test]
fn without_the_unknown_outcome_wait_an_unknown_outcome_runs_twice() {
    let design = Design {
        unknown_wait: false,
        ..Design::IDEM
    };
    let found = explore("without the unknown-outcome wait", without(design, |_| {}));
    assert!(found.contains(&property::ONCE), "{found:?}");
}

/// An operator shortens a format 3 record's expiry (`PEXPIRE` by hand)
/// while its owner runs: judged from the expiry alone, the lease lapses at
/// once and a retry takes it over while its owner still runs (the
/// checker stops at that takeover; the retry would then act beside it).
/// Format 3 takes the later of that start and the one the record carries,
/// so the lease stays as it was (with the rule, every property holds:
/// `idem_holds_every_property_under_each_fault`).
#[test]
fn without_the_later_start_a_shortened_expiry_runs_the_action_twice() {
    let design = Design {
        format3_later_start: false,
        ..Design::IDEM
    };
    let found = explore(
        "without format 3's later start",
        without(design, |b| b.expiry_changes = 1),
    );
    assert!(found.contains(&property::TAKEOVER), "{found:?}");
}

/// Owners keep replay caches; an operator erases the record, which makes
/// its key new. A cache that ignores the store's erasure feed answers the
/// erased answer after the feed's window (the erasing gateway meanwhile
/// runs the key again). idem's cache drops the copy when it hears the
/// erasure and empties itself once the feed has been silent for the
/// window, so a stale replay is possible only within the window after the
/// erasure (with the rule, every property holds:
/// `idem_holds_every_property_under_each_fault`).
#[test]
fn without_the_erasure_feed_a_cache_replays_an_erased_answer() {
    let design = Design {
        cache_follows_erasures: false,
        ..Design::IDEM
    };
    let found = explore(
        "without caches following the erasure feed",
        without(design, |b| b.erasures = 1),
    );
    assert_eq!(found, [property::STALE], "{found:?}");
}

fn unexcused(excuses: Excuses, persistence: Persistence, faults: Fault) -> IdemModel {
    IdemModel {
        excuses,
        ..IdemModel::idem(persistence, with(faults))
    }
}

/// The documented limit of a crashed owner: its lease lapses, and the
/// retry runs the action again (as `Idempotency-Attempt: 2`).
#[test]
fn limit_an_owner_that_crashed_after_acting_is_run_again() {
    let excuses = Excuses {
        owner_crash: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::Always, |b| b.owner_crashes = 1);
    assert!(explore("limit: owner crash", model).contains(&property::ONCE));
}

/// The documented limit of an owner that stalls past its lease (a blocked
/// thread, a long pause) and then acts: a retry took over meanwhile and
/// ran the action again. (What still holds, with the limit excused: one
/// recorded outcome, the stalled owner's late completion fenced; see
/// `idem_holds_every_property_under_each_fault`.)
#[test]
fn limit_an_owner_that_stalls_past_its_lease_runs_twice() {
    let excuses = Excuses {
        stall: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::Always, |b| b.stalls = 1);
    assert!(explore("limit: a stalled owner", model).contains(&property::ONCE));
}

/// The documented limit of an unknown outcome given up: the lease lapses
/// and the retry runs the action again.
#[test]
fn limit_an_unknown_outcome_given_up_is_run_again() {
    let excuses = Excuses {
        unknown_give_up: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::Always, |_| {});
    assert!(explore("limit: unknown outcome given up", model).contains(&property::ONCE));
}

/// The documented limit of `appendfsync everysec`: a write the store
/// acknowledged and lost in a crash; the retry runs the action again.
#[test]
fn limit_a_write_lost_by_everysec_is_run_again() {
    let excuses = Excuses {
        store_loss: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::EverySecond, |b| {
        b.store_crashes = 1;
        b.ticks = 3;
    });
    assert!(explore("limit: everysec", model).contains(&property::ONCE));
}

/// The documented limit of a partition: the store unreachable, without a
/// restart, for longer than the lease; the retry after it takes over while
/// the first owner still runs or holds its outcome.
#[test]
fn limit_a_partition_longer_than_the_lease_runs_twice() {
    let excuses = Excuses {
        partition: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::Always, |b| b.outages = 1);
    assert!(explore("limit: partition", model).contains(&property::ONCE));
}

/// The documented limit of an operator's force release: the records API
/// frees a processing record whose owner it takes to be gone; an owner
/// still running may act beside the retry that follows.
#[test]
fn limit_a_force_release_of_a_running_owner_runs_twice() {
    let excuses = Excuses {
        operator_release: false,
        ..Excuses::DOCUMENTED
    };
    let model = unexcused(excuses, Persistence::Always, |b| b.force_releases = 1);
    assert!(explore("limit: force release", model).contains(&property::ONCE));
}

/// A reservation that lands after its caller gave up (behind a paused
/// store): without retried abandons, one that fails leaves a live lease
/// nobody runs.
#[test]
fn without_retried_abandons_a_delayed_reservation_blocks_the_key() {
    let design = Design {
        retry_abandon: false,
        ..Design::IDEM
    };
    let model = without(design, |b| {
        b.delayed = 1;
        b.outages = 1;
    });
    let found = explore("without retried abandons, delayed", model);
    assert!(found.contains(&property::NO_ORPHAN), "{found:?}");
}

/// The model's steps do what they say: a payment recorded, then replayed
/// to the other owner, with one side effect.
#[test]
fn a_payment_is_recorded_and_replayed() {
    let model = IdemModel::idem(Persistence::Always, Bounds::BASE);
    let mut state = model.init_states().remove(0);
    for action in [
        Action::Request(0, false),
        Action::Execute(0, Ran::Success),
        Action::Complete(0, false),
        Action::Request(1, false),
    ] {
        state = model.next_state(&state, action).expect("a step");
    }
    assert!(state.recorded.is_some());
    assert_eq!(state.effects.len(), 1);
    assert_eq!(state.violation, None);
}
