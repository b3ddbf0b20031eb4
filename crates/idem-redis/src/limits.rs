//! The shared limit gate of `idem-client` on Redis: every process that
//! shares a Redis (or a cluster) shares each boundary's rate, cooldown and
//! retry budget. One atomic script per call, on the Redis clock; a
//! boundary's keys share one hash slot.

use std::time::Duration;

use idem_client::limits::{BoxFuture, Gate, GateError, Limit, SharedBudget, Turn};
use redis::{Script, Value};

use crate::{
    RedisStore,
    decode::{int, items},
    errors::corrupt,
    invocation::Invocation,
    keys::millis,
};

/// The gate's scripts.
#[derive(Debug)]
pub(crate) struct LimitScripts {
    take: Script,
    cool: Script,
    budget: Script,
}

impl LimitScripts {
    pub(crate) fn new() -> Self {
        Self {
            take: Script::new(include_str!("lua/limits/take.lua")),
            cool: Script::new(include_str!("lua/limits/cool.lua")),
            budget: Script::new(include_str!("lua/limits/budget.lua")),
        }
    }
}

fn micros(duration: Duration) -> u64 {
    // Bounds beyond a century are no bound (and stay exact in Lua).
    u64::try_from(duration.as_micros())
        .unwrap_or(u64::MAX)
        .min(3_155_760_000_000_000)
}

fn gate_error(error: idem_core::StoreError) -> GateError {
    GateError(Box::new(error))
}

impl RedisStore {
    /// The keys of a boundary: `{prefix}limit:{<hash>}:<part>`, in one slot.
    fn limit_key(&self, boundary: &str, part: &str) -> String {
        let hash = idem_core::ScopeHash::of("limit", "", boundary);
        format!("{}limit:{{{}}}:{part}", self.prefix, hash.to_hex())
    }
}

/// The [`RedisStore`] is a [`Gate`]: `Limits::new(store, limit, boundary)`.
impl Gate for RedisStore {
    fn take<'a>(
        &'a self,
        boundary: &'a str,
        limit: Limit,
        max_wait: Duration,
    ) -> BoxFuture<'a, Result<Turn, GateError>> {
        Box::pin(async move {
            let interval = limit.interval();
            let (tat, cool) = (
                self.limit_key(boundary, "tat"),
                self.limit_key(boundary, "cool"),
            );
            let mut invocation = Invocation::new(&self.limit_scripts.take, &[&tat, &cool]);
            invocation
                .arg(micros(interval))
                .arg(micros(interval * (limit.burst - 1)))
                .arg(micros(max_wait));
            let reply = items(self.run(invocation, false).await.map_err(gate_error)?.0)
                .map_err(gate_error)?;
            let answer = |i: usize| -> Result<u64, GateError> {
                let value = reply
                    .get(i)
                    .ok_or_else(|| gate_error(corrupt("short reply")))?;
                match value {
                    Value::Int(n) => Ok(u64::try_from(*n).unwrap_or(0)),
                    other => int(other).map_err(gate_error),
                }
            };
            let kind = match reply.first() {
                Some(Value::Int(n)) => *n,
                _ => return Err(gate_error(corrupt("unexpected take reply"))),
            };
            let wait = Duration::from_micros(answer(1)?);
            Ok(match kind {
                1 => Turn::Go { wait },
                0 => Turn::CoolingDown { wait },
                _ => Turn::TooLate { wait },
            })
        })
    }

    fn cool_down<'a>(
        &'a self,
        boundary: &'a str,
        period: Duration,
    ) -> BoxFuture<'a, Result<(), GateError>> {
        Box::pin(async move {
            let key = self.limit_key(boundary, "cool");
            let mut invocation = Invocation::new(&self.limit_scripts.cool, &[&key]);
            invocation.arg(micros(period).max(1));
            self.run(invocation, false).await.map_err(gate_error)?;
            Ok(())
        })
    }

    fn budget<'a>(
        &'a self,
        boundary: &'a str,
        budget: SharedBudget,
        retry: bool,
    ) -> BoxFuture<'a, Result<bool, GateError>> {
        Box::pin(async move {
            let key = self.limit_key(boundary, "budget");
            let mut invocation = Invocation::new(&self.limit_scripts.budget, &[&key]);
            invocation
                .arg(millis(budget.window).max(1))
                .arg(budget.min_retries)
                .arg(budget.percent)
                .arg(u8::from(retry));
            let (reply, _) = self.run(invocation, false).await.map_err(gate_error)?;
            Ok(matches!(reply, Value::Int(1)))
        })
    }
}
