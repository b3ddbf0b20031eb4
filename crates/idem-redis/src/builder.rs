//! Building a store from its URL and settings.

use std::time::Duration;

use deadpool_redis::{Runtime, Timeouts};

use crate::{RecordFormat, RedisStore, connection::Lane, pool::Pool, scripts::Scripts};

/// The store could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The URL is not `redis://…`, `rediss://…`, `redis+cluster://h:p,…` or
    /// `rediss+cluster://h:p,…`.
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The connection pool could not be created.
    #[error("could not create the Redis pool: {0}")]
    Pool(String),
    /// The server can lose records silently: a `maxmemory-policy` that can
    /// evict them (see [`ServerSafety`](crate::ServerSafety)), refused by
    /// [`RedisStoreBuilder::connect`] unless
    /// [`allow_eviction`](RedisStoreBuilder::allow_eviction).
    #[error("{0}")]
    Unsafe(String),
    /// [`RedisStoreBuilder::connect`] could not reach the server to check
    /// it (unless [`check_lazily`](RedisStoreBuilder::check_lazily)).
    #[error("could not reach Redis to check it: {0}")]
    Unreachable(String),
}

/// Builder for [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) pool_size: usize,
    pub(crate) lanes: usize,
    pub(crate) timeout: Duration,
    pub(crate) wait_replicas: Option<(usize, Duration)>,
    pub(crate) format: RecordFormat,
    pub(crate) allow_eviction: bool,
    pub(crate) check_lazily: bool,
}

impl RedisStoreBuilder {
    /// How many multiplexed connections calls are spread over (default 1).
    ///
    /// One connection carries any number of concurrent calls, and Redis
    /// reads and answers many of them per system call: measured with 64
    /// concurrent requests (`bench/peer/run.sh`, `IDEM_LANES`), one lane
    /// cost Redis about 10 % less CPU per request than four, and the app
    /// about 6 % less. More lanes spread very large replies, which would
    /// otherwise hold up the calls queued behind them.
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes.max(1);
        self
    }

    /// The key prefix (default `idem:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The most connections the pool holds (default 16; at least the
    /// number of lanes).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The bound on every store call, including waiting for a connection
    /// (default 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// After `reserve` and `complete`, wait until `replicas` replicas have
    /// the write, at most `timeout` (single-node deployments only; see the
    /// crate docs for what this buys). A call is then bounded by the
    /// store's timeout plus this one; give the layer's store timeout
    /// (`Timing::store_timeout`) as much, or it gives up on a
    /// reservation whose replicas are still acknowledging it (the gateway
    /// does this itself).
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait_replicas = Some((replicas, timeout));
        self
    }

    /// The format of the records this store writes (default
    /// [`RecordFormat::V3`], the newest; see [`crate::format`]).
    ///
    /// Every store reads every format this version knows, whatever it
    /// writes. Write an older format only while a rolling upgrade brings a
    /// newer one: deploy writing the format the instances not yet upgraded
    /// read, then, once every instance runs this version, the newest.
    pub fn record_format(mut self, format: RecordFormat) -> Self {
        self.format = format;
        self
    }

    /// Whether [`connect`](Self::connect) accepts a server whose eviction
    /// policy can remove records (default `false`: refused). A retry of an
    /// evicted key runs again; allow it only for data that may be lost.
    pub fn allow_eviction(mut self, allowed: bool) -> Self {
        self.allow_eviction = allowed;
        self
    }

    /// With `true`, [`connect`](Self::connect) accepts a server it cannot
    /// reach now (default `false`: [`BuildError::Unreachable`]), for a
    /// service that must start while Redis is down: the store then checks
    /// the server on its first successful connection, and a server found
    /// unsafe then has every call refused (`StoreError::Refused`, never
    /// failed open) until it is made safe and the connection is made again.
    pub fn check_lazily(mut self, lazily: bool) -> Self {
        self.check_lazily = lazily;
        self
    }

    /// Builds the store and checks the server as the gateway does at start
    /// ([`ServerSafety::verdict`](crate::ServerSafety::verdict)): a
    /// `maxmemory-policy` that can evict records is
    /// [`BuildError::Unsafe`] unless [`allow_eviction`](Self::allow_eviction);
    /// a server without an append-only file is logged as a warning (a
    /// restart forgets records); a server too old for the record format
    /// ([`ServerSafety::supports`](crate::ServerSafety::supports)) is
    /// [`BuildError::Unsafe`]. A server that cannot be reached now is
    /// [`BuildError::Unreachable`], unless [`check_lazily`](Self::check_lazily);
    /// one whose `INFO` is renamed is logged and accepted.
    ///
    /// The store then checks every connection it makes (its first, and
    /// each after a restart or a failover moved the server): a server too
    /// old for the record format, or, for a store made here, one whose
    /// eviction policy is refused, has the calls on that connection
    /// refused (`StoreError::Refused`). A store from [`build`](Self::build)
    /// checks the record format only.
    pub async fn connect(self) -> Result<RedisStore, BuildError> {
        let (allow_eviction, lazily) = (self.allow_eviction, self.check_lazily);
        let mut store = self.build()?;
        store.eviction_checked = Some(allow_eviction);
        match store.server_safety().await {
            Ok(safety) => {
                safety
                    .supports(store.record_format())
                    .map_err(BuildError::Unsafe)?;
                for warning in safety.verdict(allow_eviction).map_err(BuildError::Unsafe)? {
                    tracing::warn!("{warning}");
                }
            }
            // The connection's own check refused the server.
            Err(idem_core::StoreError::Refused(refusal)) => {
                return Err(BuildError::Unsafe(refusal.to_string()));
            }
            Err(error) if lazily => {
                tracing::warn!(
                    %error,
                    "Redis cannot be reached now; it is checked on the first connection"
                );
            }
            Err(error) => return Err(BuildError::Unreachable(error.to_string())),
        }
        Ok(store)
    }

    /// The connection pool the URL names: a cluster's, or a single
    /// node's, each connection bounded by the store's timeout.
    fn pool(&self) -> Result<Pool, BuildError> {
        let invalid = |reason: &str| BuildError::InvalidUrl {
            url: self.url.clone(),
            reason: reason.to_owned(),
        };
        let timeouts = Timeouts {
            wait: Some(self.timeout),
            create: Some(self.timeout),
            recycle: Some(self.timeout),
        };
        let pool_config = deadpool_redis::PoolConfig {
            max_size: self.pool_size,
            timeouts,
            ..Default::default()
        };
        let cluster = match (
            self.url.strip_prefix("redis+cluster://"),
            self.url.strip_prefix("rediss+cluster://"),
        ) {
            (Some(nodes), _) => Some(("redis", nodes)),
            (None, Some(nodes)) => Some(("rediss", nodes)),
            (None, None) => None,
        };
        if let Some((scheme, nodes)) = cluster {
            if self.wait_replicas.is_some() {
                return Err(invalid(
                    "waiting for replicas is supported on single-node deployments only",
                ));
            }
            let urls: Vec<String> = nodes
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(|n| format!("{scheme}://{n}"))
                .collect();
            if urls.is_empty() {
                return Err(invalid("no cluster nodes"));
            }
            let mut config = deadpool_redis::cluster::Config::from_urls(urls);
            config.pool = Some(pool_config);
            let pool = config
                .create_pool(Some(Runtime::Tokio1))
                .map_err(|e| BuildError::Pool(e.to_string()))?;
            Ok(Pool::Cluster(pool))
        } else if self.url.starts_with("redis://") || self.url.starts_with("rediss://") {
            // The store bounds each call itself (its timeout, plus the
            // wait for replicas that a `WAIT` spends on the server), so the
            // connections have no reply timeout of their own: redis-rs'
            // default (500 ms) would cut a longer `WAIT` short, and a
            // second timer per call costs CPU on every request.
            let connection = redis::AsyncConnectionConfig::new().set_response_timeout(None);
            let manager = deadpool_redis::Manager::new_with_config(self.url.as_str(), connection)
                .map_err(|e| BuildError::Pool(e.to_string()))?;
            let pool = deadpool_redis::Pool::builder(manager)
                .config(pool_config)
                .runtime(Runtime::Tokio1)
                .build()
                .map_err(|e| BuildError::Pool(e.to_string()))?;
            Ok(Pool::Single(pool))
        } else {
            Err(invalid(
                "expected redis://, rediss://, redis+cluster:// or rediss+cluster://",
            ))
        }
    }

    /// Builds the store. Connections are made lazily, on first use; the
    /// server is not checked (see [`connect`](Self::connect)).
    pub fn build(self) -> Result<RedisStore, BuildError> {
        let pool = self.pool()?;
        let single = matches!(pool, Pool::Single(_));
        let watch = crate::watch::Watch::new(single.then_some(self.url.as_str()));
        let erasures =
            crate::erasures::Erasures::new(single.then_some(self.url.as_str()), &self.prefix);
        Ok(RedisStore {
            lanes: (0..self.lanes)
                .map(|_| parking_lot::Mutex::new(Lane::default()))
                .collect(),
            last_replacement: parking_lot::Mutex::new(None),
            next_lane: std::sync::atomic::AtomicUsize::new(0),
            pool,
            scripts: Scripts::new(crate::scripts::Constants {
                notify: watch.publishes(),
                format: self.format,
            }),
            #[cfg(feature = "limits")]
            limit_scripts: crate::limits::LimitScripts::new(),
            prefix: self.prefix,
            erasures,
            format: self.format,
            timeout: self.timeout,
            wait_replicas: self.wait_replicas,
            watch,
            // Closed from the start: waiting on it ends whenever it holds
            // no task (it still tracks new ones).
            given_up: {
                let tracker = tokio_util::task::TaskTracker::new();
                tracker.close();
                tracker
            },
            eviction_checked: None,
        })
    }
}
