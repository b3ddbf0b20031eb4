//! [`LocalGate`]: the limits of one process, kept in memory.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use super::gate::{BoxFuture, Gate, GateError, Limit, SharedBudget, Turn};

/// One boundary's state in a [`LocalGate`].
#[derive(Debug, Default)]
struct LocalBoundary {
    /// The theoretical arrival time of the next request (GCRA).
    tat: Option<Instant>,
    cool_until: Option<Instant>,
    window_start: Option<Instant>,
    requests: u64,
    retries: u64,
}

/// A gate for one process, on tokio's clock.
#[derive(Debug, Default, Clone)]
pub struct LocalGate {
    boundaries: Arc<Mutex<HashMap<String, LocalBoundary>>>,
}

impl LocalGate {
    /// An empty gate.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, boundary: &str, f: impl FnOnce(&mut LocalBoundary, Instant) -> T) -> T {
        let now = Instant::now();
        let mut all = match self.boundaries.lock() {
            Ok(all) => all,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(all.entry(boundary.to_owned()).or_default(), now)
    }
}

impl Gate for LocalGate {
    fn take<'a>(
        &'a self,
        boundary: &'a str,
        limit: Limit,
        max_wait: Duration,
    ) -> BoxFuture<'a, Result<Turn, GateError>> {
        let turn = self.with(boundary, |state, now| {
            if let Some(until) = state.cool_until.filter(|until| *until > now) {
                return Turn::CoolingDown { wait: until - now };
            }
            let interval = limit.interval();
            let tolerance = interval * (limit.burst - 1);
            let tat = state.tat.map_or(now, |tat| tat.max(now));
            let allowed_at = tat.checked_sub(tolerance).unwrap_or(now);
            let wait = allowed_at.saturating_duration_since(now);
            if wait > max_wait {
                return Turn::TooLate { wait };
            }
            state.tat = Some(tat + interval);
            Turn::Go { wait }
        });
        Box::pin(async move { Ok(turn) })
    }

    fn cool_down<'a>(
        &'a self,
        boundary: &'a str,
        period: Duration,
    ) -> BoxFuture<'a, Result<(), GateError>> {
        self.with(boundary, |state, now| {
            let until = now + period;
            state.cool_until = Some(state.cool_until.map_or(until, |at| at.max(until)));
        });
        Box::pin(async { Ok(()) })
    }

    fn budget<'a>(
        &'a self,
        boundary: &'a str,
        budget: SharedBudget,
        retry: bool,
    ) -> BoxFuture<'a, Result<bool, GateError>> {
        let allowed = self.with(boundary, |state, now| {
            if state
                .window_start
                .is_none_or(|start| now.duration_since(start) >= budget.window)
            {
                state.window_start = Some(now);
                state.requests = 0;
                state.retries = 0;
            }
            if !retry {
                state.requests += 1;
                return true;
            }
            let allowed =
                u64::from(budget.min_retries) + (state.requests as f64 * budget.percent) as u64;
            if state.retries < allowed {
                state.retries += 1;
                true
            } else {
                false
            }
        });
        Box::pin(async move { Ok(allowed) })
    }
}
