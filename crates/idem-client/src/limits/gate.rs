//! The [`Gate`] trait and what it keeps: rates, turns, budgets.

use std::{future::Future, pin::Pin, time::Duration};

/// A boxed future, for the [`Gate`] trait.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A rate: `per_second` requests a second, bursts of `burst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    /// Sustained requests per second (more than zero).
    pub per_second: f64,
    /// How many requests may go at once after an idle period (at least 1).
    pub burst: u32,
}

impl Limit {
    /// `per_second` requests a second with bursts of `burst`.
    pub fn new(per_second: f64, burst: u32) -> Self {
        Self {
            per_second: if per_second > 0.0 { per_second } else { 1.0 },
            burst: burst.max(1),
        }
    }

    /// The time between two requests at the sustained rate.
    pub fn interval(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.per_second)
    }
}

/// A shared retry budget: retries may be at most `percent` of the
/// boundary's requests in each `window`, plus `min_retries`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedBudget {
    /// The counting window.
    pub window: Duration,
    /// Retries always allowed per window.
    pub min_retries: u32,
    /// Retries allowed as a share of requests (0.2 for 20 %).
    pub percent: f64,
}

/// What a gate answers to a request for a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// The turn is taken: go after `wait`.
    Go {
        /// How long to wait first.
        wait: Duration,
    },
    /// The boundary is cooling down for `wait`: ask again then.
    CoolingDown {
        /// Time left of the cooldown.
        wait: Duration,
    },
    /// The turn would come after the caller's bound; nothing was taken.
    TooLate {
        /// How long the caller would have had to wait.
        wait: Duration,
    },
}

/// A gate's store failed.
#[derive(Debug, thiserror::Error)]
#[error("the limit gate is unavailable: {0}")]
pub struct GateError(pub Box<dyn std::error::Error + Send + Sync>);

/// Keeps the rates, cooldowns and retry budgets of boundaries. Every
/// method is atomic per boundary, measured on the gate's own clock.
pub trait Gate: Send + Sync + 'static {
    /// Takes the next turn of `boundary` under `limit` if it comes within
    /// `max_wait` and the boundary is not cooling down.
    fn take<'a>(
        &'a self,
        boundary: &'a str,
        limit: Limit,
        max_wait: Duration,
    ) -> BoxFuture<'a, Result<Turn, GateError>>;

    /// Holds the boundary back for `period` from the gate's now (a longer
    /// cooldown already set stays).
    fn cool_down<'a>(
        &'a self,
        boundary: &'a str,
        period: Duration,
    ) -> BoxFuture<'a, Result<(), GateError>>;

    /// Counts a first attempt (`retry` false, always allowed) or asks for a
    /// retry (`retry` true): whether the boundary's shared budget allows it.
    fn budget<'a>(
        &'a self,
        boundary: &'a str,
        budget: SharedBudget,
        retry: bool,
    ) -> BoxFuture<'a, Result<bool, GateError>>;
}
