//! What a model explores: the design's rules, the excused limits, the
//! store's persistence and the bounds of the exploration.

/// The length of one clock tick, in store milliseconds.
pub const TICK_MS: u64 = 1_000;
/// The lease, two ticks.
pub const LEASE_MS: u64 = 2 * TICK_MS;
/// How long after an erasure an owner that has not heard it may still
/// answer from its replay cache: the feed's window, after which a silent
/// feed empties the cache (`idem_core::erasures::WINDOW`), in store
/// milliseconds.
pub fn erasure_window_ms() -> u64 {
    u64::try_from(idem_core::erasures::WINDOW.as_millis()).unwrap_or(u64::MAX)
}
/// The clock's reading at the start.
pub(crate) const START_MS: u64 = 1_000_000;

/// Which of the bad-day designs the owners and the store follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Design {
    /// SPEC section 8: after a store restart a lease counts as running
    /// until at least a lease after the start
    /// ([`machine::lease_after_start`](idem_core::machine::lease_after_start)).
    pub restart_grace: bool,
    /// A release the store could not take is kept and retried.
    pub retry_release: bool,
    /// An abandon (the reservation whose reply was lost) the store could
    /// not take is kept and retried.
    pub retry_abandon: bool,
    /// An unknown outcome keeps the lease and waits for a late answer; off,
    /// it is released like a temporary failure.
    pub unknown_wait: bool,
    /// Redis record format 3 judges a new key's lease from its key's
    /// expiry, taking the later of the start that expiry gives and the
    /// start the record carries (`string_fields` in
    /// `idem-redis/src/lua/string_record.lua`), so an expiry
    /// shortened from outside never shortens a live lease; off, the start
    /// comes from the expiry alone.
    pub format3_later_start: bool,
    /// A replay cache keeps its copies only while the store's erasure
    /// feed is healthy: it drops a copy when it hears the erasure, and
    /// everything once the feed has been silent for a window
    /// ([`idem_core::erasures::WINDOW`]); off, it answers from its copies
    /// whatever the store erased.
    pub cache_follows_erasures: bool,
}

impl Design {
    /// idem's design: every bad-day rule in force.
    pub const IDEM: Self = Self {
        restart_grace: true,
        retry_release: true,
        retry_abandon: true,
        unknown_wait: true,
        format3_later_start: true,
        cache_follows_erasures: true,
    };
}

/// The documented limits: faults after which a second side effect of one
/// scope is allowed (and the upstream sees a higher `Idempotency-Attempt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Excuses {
    /// An owner that crashed before its outcome was recorded: its lease
    /// lapses and a retry takes over.
    pub owner_crash: bool,
    /// An owner that gave up waiting for an unknown outcome.
    pub unknown_give_up: bool,
    /// A store that lost writes it had acknowledged in a restart (no
    /// persistence, or `appendfsync everysec`).
    pub store_loss: bool,
    /// A store unreachable, without a restart, for longer than a lease
    /// held across the outage.
    pub partition: bool,
    /// An operator force-released a processing record (the records API's
    /// release of a record whose owner is gone): its owner may still run.
    pub operator_release: bool,
    /// An owner that stalled past its lease (a blocked thread, a long
    /// pause) and then acted: a retry took over meanwhile.
    pub stall: bool,
}

impl Excuses {
    /// Every limit the docs name.
    pub const DOCUMENTED: Self = Self {
        owner_crash: true,
        unknown_give_up: true,
        store_loss: true,
        partition: true,
        operator_release: true,
        stall: true,
    };
}

/// What the store keeps across a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Persistence {
    /// Every write is durable before it is answered (`appendfsync always`,
    /// PostgreSQL's commit).
    Always,
    /// Writes become durable in a later step (`appendfsync everysec`).
    EverySecond,
    /// Nothing survives a restart.
    Nothing,
}

/// How far the checker explores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Owners (gateway processes).
    pub owners: u8,
    /// Client requests, over all owners.
    pub requests: u8,
    /// Clock ticks.
    pub ticks: u8,
    /// Owner crashes.
    pub owner_crashes: u8,
    /// Store crashes (each followed by a restart).
    pub store_crashes: u8,
    /// Outages without a restart.
    pub outages: u8,
    /// Replies lost after the store applied the call.
    pub lost_replies: u8,
    /// Operator cancels.
    pub cancels: u8,
    /// Operator force releases (of a processing record).
    pub force_releases: u8,
    /// Reservations that reach the store after their caller gave up.
    pub delayed: u8,
    /// Owners that stall past their lease and then act.
    pub stalls: u8,
    /// Operators who shorten a format 3 record's expiry by a lease
    /// (`PEXPIRE` by hand) while it is processing.
    pub expiry_changes: u8,
    /// Operators' erasures of a record that is not processing. With one or
    /// more, every owner keeps a replay cache of the answers it recorded or
    /// was replayed.
    pub erasures: u8,
}

impl Bounds {
    /// Two owners, three requests, four ticks (two leases), no fault: the
    /// base every CI exploration adds its faults to.
    pub const BASE: Self = Self {
        owners: 2,
        requests: 3,
        ticks: 4,
        owner_crashes: 0,
        store_crashes: 0,
        outages: 0,
        lost_replies: 0,
        cancels: 0,
        force_releases: 0,
        delayed: 0,
        stalls: 0,
        expiry_changes: 0,
        erasures: 0,
    };

    /// The deeper run documented in `docs/model.md`: an owner crash, a
    /// store crash, an outage and a lost reply together (on a durable
    /// store, 33 million states, 12.5 million distinct: about 3.5 minutes
    /// and 6 GB on two cores). Every fault at once outgrows 23 GB.
    pub const DEEP: Self = Self {
        owner_crashes: 1,
        store_crashes: 1,
        outages: 1,
        lost_replies: 1,
        ..Self::BASE
    };
}
