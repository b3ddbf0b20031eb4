//! What a Redis server says about keeping records: its eviction policy and
//! persistence.

use idem_core::StoreError;
use redis::Value;

use crate::{RedisStore, decode::collect_text};

/// What a Redis server says about keeping idem's records.
///
/// idem's records carry a TTL (their retention), so every eviction policy
/// but `noeviction` can remove a live record under memory pressure,
/// including the `volatile-*` ones; a removed record lets a retry execute
/// again, silently. Without persistence (no AOF, no RDB snapshots) a
/// restart forgets every record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSafety {
    /// Every `maxmemory_policy` the nodes reported (one per node).
    pub eviction_policies: Vec<String>,
    /// Whether every node that reported runs with `appendonly yes`.
    pub append_only: bool,
}

impl ServerSafety {
    fn from_info(info: &str) -> Self {
        let mut eviction_policies = Vec::new();
        let mut aof = Vec::new();
        for line in info.lines() {
            let line = line.trim();
            if let Some(policy) = line.strip_prefix("maxmemory_policy:") {
                eviction_policies.push(policy.to_owned());
            } else if let Some(enabled) = line.strip_prefix("aof_enabled:") {
                aof.push(enabled == "1");
            }
        }
        Self {
            eviction_policies,
            append_only: !aof.is_empty() && aof.iter().all(|on| *on),
        }
    }

    /// The rule the gateway and [`RedisStoreBuilder::connect`](crate::RedisStoreBuilder::connect)
    /// apply: `Err` with why when a policy can evict records and
    /// `allow_eviction` is false; otherwise the warnings to log (an allowed
    /// evicting policy, no append-only file).
    pub fn verdict(&self, allow_eviction: bool) -> Result<Vec<String>, String> {
        let mut warnings = Vec::new();
        let evicting = self.evicting_policies();
        if !evicting.is_empty() {
            let message = format!(
                "Redis maxmemory-policy {} can evict idempotency records, and a retry of an \
                 evicted key runs again; set maxmemory-policy noeviction, or allow eviction \
                 (--allow-redis-eviction, RedisStoreBuilder::allow_eviction)",
                evicting.join(", ")
            );
            if !allow_eviction {
                return Err(message);
            }
            warnings.push(format!("{message} (allowed)"));
        }
        if !self.append_only {
            warnings.push(
                "Redis runs without appendonly: a restart can forget records, and retries of \
                 forgotten keys run again; enable appendonly yes"
                    .to_owned(),
            );
        }
        Ok(warnings)
    }

    /// The policies that can evict idem's records (anything but
    /// `noeviction`); empty when the server is safe.
    pub fn evicting_policies(&self) -> Vec<&str> {
        self.eviction_policies
            .iter()
            .map(String::as_str)
            .filter(|policy| *policy != "noeviction")
            .collect()
    }
}

// ===== impl Store =====

impl RedisStore {
    /// Reads what the server (every node of a cluster that answers) says
    /// about keeping records: its `maxmemory-policy` and persistence, from
    /// `INFO`. See [`ServerSafety`].
    pub async fn server_safety(&self) -> Result<ServerSafety, StoreError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("memory").arg("persistence");
        let info: Value = self.command(cmd).await?;
        let mut text = String::new();
        collect_text(&info, &mut text);
        Ok(ServerSafety::from_info(&text))
    }
}
