//! Limits at the provider's boundary, shared by every worker.
//!
//! A provider limits an account, an app or a credential, not a process:
//! ten processes that each keep "their" limit overload the shared
//! credential ten times over. [`Limits`] puts every outgoing request of a
//! [`RetryLayer`](crate::RetryLayer) on a *boundary* the caller names (a
//! function of the request: the provider's host and the account, say) and
//! holds it until the boundary's turn:
//!
//! * **A shared rate**: `rate` requests a second with bursts of `burst`
//!   (GCRA), kept by a [`Gate`]: [`LocalGate`] for one process, or a gate
//!   on a shared store (`idem_redis::RedisGate`: one atomic script on the
//!   Redis clock) for every process that shares it. A request waits for
//!   its turn within its deadline, or fails at once with
//!   [`Error::Limited`](crate::Error::Limited) when its turn would come
//!   after the deadline.
//! * **A shared cooldown**: a `429` or `503` for a boundary holds back every
//!   worker sharing it until the `Retry-After` (either form), or a backoff
//!   without one, not only the worker that was told.
//! * **A shared retry budget** per boundary, beside the per-process one.
//! * **Fair queueing**: requests waiting for one boundary are served round
//!   robin across their *owners* (a tenant, a user; a function of the
//!   request), so one owner's burst cannot starve another's.
//! * **Visibility**: [`RetryInfo::held`](crate::RetryInfo::held) says how
//!   long a request was held; metrics give queue depth and wait per
//!   boundary (`idem_client_limit_queue_depth`,
//!   `idem_client_limit_wait_seconds`).
//!
//! When the gate's store cannot be reached, [`OnGateError`] decides: hold
//! the request back (it fails with the store's error) or fall back to a
//! local limit.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use http::request::Parts;
use tokio::{sync::oneshot, time::Instant};

mod gate;
mod local;

pub use gate::{BoxFuture, Gate, GateError, Limit, SharedBudget, Turn};
pub use local::LocalGate;

/// What to do when the gate's store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnGateError {
    /// Hold the request back: it fails with
    /// [`Error::Limited`](crate::Error::Limited) naming the gate's error.
    HoldBack,
    /// Go on under a limit kept in this process alone.
    FallBackLocal,
}

/// Names a request's boundary; `None` leaves the request unlimited.
pub type BoundaryFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Names a request's owner, for fair queueing.
pub type OwnerFn = dyn Fn(&Parts) -> String + Send + Sync;

/// The limits of a [`RetryLayer`](crate::RetryLayer) (see the [module
/// docs](self)).
#[derive(Clone)]
pub struct Limits {
    gate: Arc<dyn Gate>,
    fallback: LocalGate,
    boundary: Arc<BoundaryFn>,
    owner: Arc<OwnerFn>,
    limit: Limit,
    budget: Option<SharedBudget>,
    on_error: OnGateError,
    queues: Arc<Mutex<HashMap<String, Queue>>>,
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limits")
            .field("limit", &self.limit)
            .field("budget", &self.budget)
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

/// Why a request may not go.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Its turn would come after its deadline.
    TooLate(Duration),
    /// The gate failed and the policy holds requests back.
    Gate(GateError),
}

/// Requests waiting for one boundary, by owner, served round robin.
#[derive(Default)]
struct Queue {
    owners: VecDeque<String>,
    waiting: HashMap<String, VecDeque<Waiter>>,
    serving: bool,
}

impl Queue {
    /// Sets the boundary's queue-depth gauge to the requests waiting now.
    fn report_depth(&self, boundary: &str) {
        let depth: usize = self.waiting.values().map(VecDeque::len).sum();
        metrics::gauge!("idem_client_limit_queue_depth", "boundary" => boundary.to_owned())
            .set(depth as f64);
    }
}

struct Waiter {
    deadline: Option<Instant>,
    answer: oneshot::Sender<Result<(), Refusal>>,
}

impl Limits {
    /// Limits on `gate`: every request whose `boundary` is named is held to
    /// `limit` (no owners: one queue per boundary; no shared retry budget;
    /// [`OnGateError::HoldBack`]).
    pub fn new(
        gate: impl Gate,
        limit: Limit,
        boundary: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            gate: Arc::new(gate),
            fallback: LocalGate::new(),
            boundary: Arc::new(boundary),
            owner: Arc::new(|_: &Parts| String::new()),
            limit,
            budget: None,
            on_error: OnGateError::HoldBack,
            queues: Arc::default(),
        }
    }

    /// Serves waiting requests round robin across the owners this names.
    pub fn owner(mut self, owner: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.owner = Arc::new(owner);
        self
    }

    /// A retry budget per boundary, shared through the gate.
    pub fn shared_budget(mut self, budget: SharedBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// What to do when the gate's store fails.
    pub fn on_gate_error(mut self, policy: OnGateError) -> Self {
        self.on_error = policy;
        self
    }

    /// The request's boundary and owner.
    pub(crate) fn place(&self, parts: &Parts) -> Option<(String, String)> {
        let boundary = (self.boundary)(parts)?;
        Some((boundary, (self.owner)(parts)))
    }

    /// Whether a gate error falls back to the local gate (and says so).
    fn falls_back(&self, error: &GateError) -> bool {
        let falls_back = self.on_error == OnGateError::FallBackLocal;
        if falls_back {
            tracing::warn!(%error, "limit gate unavailable; limiting in this process alone");
        }
        falls_back
    }

    async fn take(&self, boundary: &str, max_wait: Duration) -> Result<Turn, GateError> {
        match self.gate.take(boundary, self.limit, max_wait).await {
            Err(error) if self.falls_back(&error) => {
                self.fallback.take(boundary, self.limit, max_wait).await
            }
            other => other,
        }
    }

    /// Waits for the boundary's turn, fairly across owners, within
    /// `deadline`; answers how long the request was held.
    pub(crate) async fn admit(
        &self,
        boundary: &str,
        owner: &str,
        deadline: Option<Instant>,
    ) -> Result<Duration, Refusal> {
        let started = Instant::now();
        let (answer, answered) = oneshot::channel();
        let serve = {
            let mut queues = match self.queues.lock() {
                Ok(queues) => queues,
                Err(poisoned) => poisoned.into_inner(),
            };
            let queue = queues.entry(boundary.to_owned()).or_default();
            let owners = &mut queue.owners;
            let waiting = queue.waiting.entry(owner.to_owned()).or_insert_with(|| {
                owners.push_back(owner.to_owned());
                VecDeque::new()
            });
            waiting.push_back(Waiter { deadline, answer });
            queue.report_depth(boundary);
            !std::mem::replace(&mut queue.serving, true)
        };
        if serve {
            let limits = self.clone();
            let boundary = boundary.to_owned();
            tokio::spawn(async move { limits.serve(boundary).await });
        }
        let result = answered
            .await
            .unwrap_or_else(|_| Err(Refusal::TooLate(Duration::ZERO)));
        let held = started.elapsed();
        metrics::histogram!("idem_client_limit_wait_seconds", "boundary" => boundary.to_owned())
            .record(held.as_secs_f64());
        result.map(|()| held)
    }

    /// The next waiter of a boundary, round robin across owners; `None`
    /// (and the boundary no longer served) when none is left.
    fn next(&self, boundary: &str) -> Option<Waiter> {
        let mut queues = match self.queues.lock() {
            Ok(queues) => queues,
            Err(poisoned) => poisoned.into_inner(),
        };
        let queue = queues.get_mut(boundary)?;
        while let Some(owner) = queue.owners.pop_front() {
            let Some(waiting) = queue.waiting.get_mut(&owner) else {
                continue;
            };
            let Some(waiter) = waiting.pop_front() else {
                queue.waiting.remove(&owner);
                continue;
            };
            if waiting.is_empty() {
                queue.waiting.remove(&owner);
            } else {
                queue.owners.push_back(owner);
            }
            queue.report_depth(boundary);
            return Some(waiter);
        }
        queues.remove(boundary);
        None
    }

    /// Hands out a boundary's turns to its waiters, one at a time.
    async fn serve(self, boundary: String) {
        while let Some(waiter) = self.next(&boundary) {
            let answer = self.turn(&boundary, waiter.deadline).await;
            let _ = waiter.answer.send(answer);
        }
    }

    /// One waiter's turn: waits out cooldowns and the rate, within its
    /// deadline.
    async fn turn(&self, boundary: &str, deadline: Option<Instant>) -> Result<(), Refusal> {
        loop {
            let max_wait = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            let turn = self.take(boundary, max_wait).await.map_err(Refusal::Gate)?;
            match turn {
                Turn::Go { wait } => {
                    tokio::time::sleep(wait).await;
                    return Ok(());
                }
                Turn::CoolingDown { wait } if wait <= max_wait => {
                    tokio::time::sleep(wait).await;
                }
                Turn::CoolingDown { wait } | Turn::TooLate { wait } => {
                    return Err(Refusal::TooLate(wait));
                }
            }
        }
    }

    /// Tells every worker of the boundary to hold back for `period`.
    pub(crate) async fn cool_down(&self, boundary: &str, period: Duration) {
        metrics::counter!("idem_client_limit_cooldowns_total", "boundary" => boundary.to_owned())
            .increment(1);
        let shared = match self.gate.cool_down(boundary, period).await {
            Err(error) if self.falls_back(&error) => {
                self.fallback.cool_down(boundary, period).await
            }
            other => other,
        };
        if let Err(error) = shared {
            tracing::warn!(%error, "could not share a cooldown");
        }
    }

    /// Counts a first attempt, or asks the shared budget for a retry
    /// (allowed when no shared budget is set; refused if the gate fails
    /// and the policy holds back).
    pub(crate) async fn budget(&self, boundary: &str, retry: bool) -> bool {
        let Some(budget) = self.budget else {
            return true;
        };
        let allowed = match self.gate.budget(boundary, budget, retry).await {
            Err(error) if self.falls_back(&error) => {
                self.fallback.budget(boundary, budget, retry).await
            }
            other => other,
        };
        allowed.unwrap_or(!retry)
    }
}
