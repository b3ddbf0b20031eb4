//! What a cluster serves: health, the failover bound, every record key.

use std::time::Duration;

use idem_core::{ScopeHash, StoreError};
use redis::Value;

impl RedisStore {
    /// Whether every hash slot is served by a node that answers: on a
    /// cluster, the slot map (`CLUSTER SLOTS`, from any node that answers)
    /// and a `PING` to each master it names; on a single node, a `PING`.
    /// Each call is bounded by the store timeout.
    pub async fn health(&self) -> Result<Health, StoreError> {
        let (lane, conn) = self.bounded(self.timeout, self.connection()).await?;
        let Conn::Cluster(mut conn) = conn else {
            self.ping().await?;
            return Ok(Health {
                slots_served: SLOTS,
                masters_answering: 1,
                masters: 1,
            });
        };
        let ranges = match self.slot_map(&mut conn).await {
            Ok(ranges) => ranges,
            Err(error) => {
                self.failed(lane);
                return Err(error);
            }
        };
        let masters = masters_of(&ranges);
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let mut answering = Vec::new();
        for (host, port) in &masters {
            let ping = conn.route_command(
                redis::cmd("PING"),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                }),
            );
            if self
                .bounded(self.timeout, async { ping.await.map_err(unavailable) })
                .await
                .is_ok()
            {
                answering.push((host.clone(), *port));
            }
        }
        let slots_served = ranges
            .iter()
            .filter(|(_, _, master)| answering.contains(master))
            .map(|(start, end, _)| end.saturating_sub(*start) + 1)
            .sum();
        Ok(Health {
            slots_served,
            masters_answering: answering.len(),
            masters: masters.len(),
        })
    }

    /// The `SCAN … MATCH` pattern of the store's record keys: the prefix
    /// with the pattern's special characters escaped (a prefix such as
    /// `app[1]:` matches only itself), then `{*}`.
    pub(crate) fn record_pattern(&self) -> String {
        let mut pattern = String::with_capacity(self.prefix.len() + 4);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push_str("{*}");
        pattern
    }

    /// The scopes of every record, a `SCAN` page at a time (of each node;
    /// on a cluster, of each master), however many there are: the pages
    /// are read as the stream is, so a listing holds one page of keys at
    /// a time. A key may come twice (`SCAN` promises every key that lives
    /// throughout at least once).
    pub(crate) fn record_scopes(
        &self,
    ) -> impl futures_util::Stream<Item = Result<Vec<ScopeHash>, StoreError>> + Send + '_ {
        /// Where the walk is: the connection, the nodes left, the cursor.
        struct Walk {
            lane: usize,
            conn: Conn,
            nodes: Vec<Option<Address>>,
            cursor: u64,
        }
        let pattern = self.record_pattern();
        futures_util::stream::try_unfold(None, move |walk: Option<Walk>| {
            let pattern = pattern.clone();
            async move {
                let mut walk = match walk {
                    Some(walk) => walk,
                    None => {
                        let (lane, conn) = self.bounded(self.timeout, self.connection()).await?;
                        let mut nodes: Vec<Option<Address>> = match &conn {
                            Conn::Single(_) => vec![None],
                            Conn::Cluster(cluster) => {
                                masters_of(&self.slot_map(&mut cluster.clone()).await?)
                                    .into_iter()
                                    .map(Some)
                                    .collect()
                            }
                        };
                        // Taken from the end.
                        nodes.reverse();
                        Walk {
                            lane,
                            conn,
                            nodes,
                            cursor: 0,
                        }
                    }
                };
                let Some(node) = walk.nodes.last() else {
                    return Ok(None);
                };
                let page = self.scan_page(&walk.conn, node.as_ref(), walk.cursor, &pattern);
                let (next, keys) = match page.await {
                    Ok(page) => page,
                    Err(error) => {
                        self.failed(walk.lane);
                        return Err(error);
                    }
                };
                if next == 0 {
                    walk.nodes.pop();
                }
                walk.cursor = next;
                let scopes = keys
                    .iter()
                    .filter_map(|key| {
                        key.strip_prefix(&self.prefix)
                            .and_then(|rest| rest.strip_prefix('{'))
                            .and_then(|rest| rest.strip_suffix('}'))
                            .and_then(scope_from_hex)
                    })
                    .collect();
                Ok(Some((scopes, Some(walk))))
            }
        })
    }

    /// The slot map (`CLUSTER SLOTS`), from a node that answers: up to
    /// three random nodes are asked.
    async fn slot_map(
        &self,
        cluster: &mut redis::cluster_async::ClusterConnection,
    ) -> Result<Vec<(u32, u32, Address)>, StoreError> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        for _ in 0..3 {
            let asked = cluster.route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            );
            match self
                .bounded(self.timeout, async { asked.await.map_err(unavailable) })
                .await
            {
                Ok(slots) => return slot_ranges(&slots),
                Err(error) => tracing::debug!(%error, "CLUSTER SLOTS failed; asking another node"),
            }
        }
        Err(unavailable("no cluster node answered CLUSTER SLOTS"))
    }

    /// One page of `SCAN … MATCH pattern` on a node (`None`: the single
    /// node): the next cursor and the keys.
    async fn scan_page(
        &self,
        conn: &Conn,
        node: Option<&Address>,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<String>), StoreError> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        // Bounded like every call of the store (its connections have no
        // reply timeout of their own).
        let page = async {
            let page = match (conn, node) {
                (Conn::Single(c), _) => {
                    scan.query_async::<(u64, Vec<String>)>(&mut c.clone()).await
                }
                (Conn::Cluster(c), Some((host, port))) => {
                    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    });
                    match c.clone().route_command(scan, routing).await {
                        Ok(value) => {
                            redis::from_redis_value(value).map_err(redis::RedisError::from)
                        }
                        Err(error) => Err(error),
                    }
                }
                (Conn::Cluster(_), None) => Ok((0, Vec::new())),
            };
            page.map_err(unavailable)
        };
        self.bounded(self.timeout, page).await
    }

    /// A cluster's `cluster-node-timeout` (`CONFIG GET`, from any node);
    /// `None` on a single node or where `CONFIG` is not allowed.
    pub async fn cluster_node_timeout(&self) -> Option<Duration> {
        if let Pool::Single(_) = self.pool {
            return None;
        }
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("cluster-node-timeout");
        let reply: Value = self.command(cmd).await.ok()?;
        let mut text = String::new();
        collect_text(&reply, &mut text);
        text.split_whitespace()
            .filter_map(|word| word.parse::<u64>().ok())
            .next()
            .map(Duration::from_millis)
    }
}

use crate::{
    RedisStore,
    decode::{collect_text, text},
    errors::{corrupt, unavailable},
    pool::{Conn, Pool},
};

/// A scope hash from its 64 hex characters.
pub(crate) fn scope_from_hex(hex: &str) -> Option<ScopeHash> {
    let fingerprint = idem_core::Fingerprint::from_hex(hex)?;
    Some(ScopeHash::from_bytes(*fingerprint.as_bytes()))
}

/// The most record keys [`RecordsAdmin::list`](idem_core::RecordsAdmin::list) read
/// before this version, which answered from the first keys it scanned
/// when a store held more. A listing now reads every record key, a page at
/// a time, within the listing's timeout.
#[deprecated(note = "a listing reads every record key; nothing limits it to this many")]
pub const LIST_SCAN_LIMIT: usize = 100_000;

/// The hash slots of Redis Cluster.
pub(crate) const SLOTS: u32 = 16_384;

/// How long a Redis Cluster may take to promote a replica after its master
/// dies, for a `cluster-node-timeout`: the master is marked failed after
/// the node timeout (once a majority agrees), then a replica waits 0.5 to
/// 1 s plus a second per rank before it is elected. Measured: 18 to 23 s for
/// the default 15 s. This bound is 1.6 × the node timeout + 2 s (26 s for
/// 15 s). A lease shorter than it can lapse while a failover is still
/// under way, so a running request's renewals fail, its lease is lost and a
/// retry on the promoted replica takes over while the first attempt may
/// still act: size the lease above it.
pub fn failover_bound(node_timeout: Duration) -> Duration {
    node_timeout.mul_f64(1.6) + Duration::from_secs(2)
}

/// Whether every hash slot is served by a node that answers (see
/// [`RedisStore::health`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Hash slots whose master answered (all 16,384 on a healthy cluster
    /// or a single node).
    pub slots_served: u32,
    /// Masters that answered a `PING`.
    pub masters_answering: usize,
    /// Masters the slot map names.
    pub masters: usize,
}

impl Health {
    /// Every slot is served and every master answers.
    pub fn is_ok(&self) -> bool {
        self.slots_served == SLOTS && self.masters_answering == self.masters
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{SLOTS} slots served, {}/{} masters answering",
            self.slots_served, self.masters_answering, self.masters
        )
    }
}

/// The masters a slot map names, each once.
fn masters_of(ranges: &[(u32, u32, Address)]) -> Vec<Address> {
    let mut masters: Vec<Address> = ranges.iter().map(|r| r.2.clone()).collect();
    masters.sort();
    masters.dedup();
    masters
}

/// A node's address: host and port.
pub(crate) type Address = (String, u16);

/// The slot ranges of a `CLUSTER SLOTS` reply (first slot, last slot), with
/// each range's master.
pub(crate) fn slot_ranges(reply: &Value) -> Result<Vec<(u32, u32, Address)>, StoreError> {
    let Value::Array(ranges) = reply else {
        return Err(corrupt("CLUSTER SLOTS did not answer an array"));
    };
    let number = |value: &Value| match value {
        Value::Int(n) => u32::try_from(*n).ok(),
        _ => None,
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(parts) = range else {
                return Err(corrupt("a CLUSTER SLOTS range is not an array"));
            };
            let (Some(start), Some(end), Some(Value::Array(master))) = (
                parts.first().and_then(number),
                parts.get(1).and_then(number),
                parts.get(2),
            ) else {
                return Err(corrupt("a CLUSTER SLOTS range is malformed"));
            };
            let host = master.first().map(text).transpose()?.unwrap_or_default();
            let port = master
                .get(1)
                .and_then(|p| match p {
                    Value::Int(n) => u16::try_from(*n).ok(),
                    _ => None,
                })
                .ok_or_else(|| corrupt("a CLUSTER SLOTS master has no port"))?;
            Ok((start, end, (host, port)))
        })
        .collect()
}
