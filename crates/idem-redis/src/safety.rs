//! What a Redis server says about keeping records: its eviction policy and
//! persistence.

use idem_core::StoreError;
use redis::Value;

use crate::{RedisStore, decode::collect_text, pool::Conn};

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
    /// Every `redis_version` the nodes reported (one per node).
    pub versions: Vec<String>,
}

impl ServerSafety {
    fn from_info(info: &str) -> Self {
        let mut eviction_policies = Vec::new();
        let mut aof = Vec::new();
        let mut versions = Vec::new();
        for line in info.lines() {
            let line = line.trim();
            if let Some(version) = line.strip_prefix("redis_version:") {
                versions.push(version.to_owned());
            } else if let Some(policy) = line.strip_prefix("maxmemory_policy:") {
                eviction_policies.push(policy.to_owned());
            } else if let Some(enabled) = line.strip_prefix("aof_enabled:") {
                aof.push(enabled == "1");
            }
        }
        Self {
            eviction_policies,
            append_only: !aof.is_empty() && aof.iter().all(|on| *on),
            versions,
        }
    }

    /// `Err` with why when a node is too old for the record `format`:
    /// format 3 needs Redis 7.0 or later (`SET … NX … GET`,
    /// `PEXPIRETIME`); an older server would refuse every reservation
    /// (`503`). A version that does not parse is not held against the
    /// server.
    pub fn supports(&self, format: crate::RecordFormat) -> Result<(), String> {
        if format < crate::RecordFormat::V3 {
            return Ok(());
        }
        let older = |version: &&String| {
            let mut parts = version.split('.').map(|part| part.parse::<u32>());
            matches!(parts.next(), Some(Ok(major)) if major < 7)
        };
        match self.versions.iter().find(older) {
            Some(version) => Err(format!(
                "Redis {version} cannot keep record format 3 (SET NX GET and PEXPIRETIME need \
                 Redis 7.0 or later); write record format 2 (--redis-record-format 2, \
                 RedisStoreBuilder::record_format), or upgrade Redis"
            )),
            None => Ok(()),
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
    /// about keeping records: its `maxmemory-policy`, persistence and
    /// version, from `INFO`. See [`ServerSafety`].
    pub async fn server_safety(&self) -> Result<ServerSafety, StoreError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server").arg("memory").arg("persistence");
        let info: Value = self.command(cmd).await?;
        let mut text = String::new();
        collect_text(&info, &mut text);
        Ok(ServerSafety::from_info(&text))
    }

    /// Checks the server behind a connection just made (the store's first,
    /// or one after a restart or a failover moved the server): too old for
    /// the record format written, or, for a store from `connect`, with an
    /// eviction policy it refuses, is [`StoreError::Refused`], and the
    /// connection is not kept. A server whose `INFO` is refused (renamed)
    /// is accepted, as at start.
    pub(crate) async fn check_connection(&self, conn: &mut Conn) -> Result<(), StoreError> {
        let eviction = self.eviction_checked == Some(false);
        if !self.format.string_records() && !eviction {
            return Ok(());
        }
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server").arg("memory");
        let asked = async {
            match conn {
                Conn::Single(c) => cmd.query_async::<Value>(c).await,
                Conn::Cluster(c) => cmd.query_async::<Value>(c).await,
            }
        };
        let info = match self
            .bounded(self.timeout, async { Ok(asked.await) })
            .await?
        {
            Ok(info) => info,
            Err(error) if crate::errors::answered_by_the_server(&error) => {
                tracing::warn!(%error, "could not read the Redis server's version and eviction policy");
                return Ok(());
            }
            Err(error) => return Err(crate::errors::unavailable(error)),
        };
        let mut text = String::new();
        collect_text(&info, &mut text);
        let safety = ServerSafety::from_info(&text);
        safety.supports(self.format).map_err(StoreError::refused)?;
        if eviction {
            safety.verdict(false).map_err(StoreError::refused)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RecordFormat;

    /// Format 3 needs Redis 7.0 on every node: a 6.2 node refuses it (and
    /// nothing older than format 3), a version that does not parse is not
    /// held against the server.
    #[test]
    fn format_3_needs_redis_7_on_every_node() {
        let info = |versions: &[&str]| {
            ServerSafety::from_info(
                &versions
                    .iter()
                    .map(|version| {
                        format!(
                            "# Server\r\nredis_version:{version}\r\n# Memory\r\nmaxmemory_policy:noeviction\r\n"
                        )
                    })
                    .collect::<String>(),
            )
        };
        let current = info(&["7.0.15", "7.2.4"]);
        assert_eq!(current.versions, ["7.0.15", "7.2.4"]);
        assert_eq!(current.eviction_policies, ["noeviction", "noeviction"]);
        assert!(current.supports(RecordFormat::V3).is_ok());
        let mixed = info(&["7.0.15", "6.2.14"]);
        let refusal = mixed.supports(RecordFormat::V3).expect_err("6.2");
        assert!(refusal.contains("Redis 6.2.14"), "{refusal}");
        assert!(refusal.contains("--redis-record-format 2"), "{refusal}");
        assert!(mixed.supports(RecordFormat::V2).is_ok());
        assert!(mixed.supports(RecordFormat::V1).is_ok());
        assert!(info(&["unknown"]).supports(RecordFormat::V3).is_ok());
        assert!(info(&[]).supports(RecordFormat::V3).is_ok());
    }
}
