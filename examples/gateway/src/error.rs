//! Why the gateway did not start.

/// The gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The layer's configuration is invalid (for example retention not
    /// longer than the lease).
    #[error("{0}")]
    Config(#[from] idem_layer::ConfigError),
    /// The store URL could not be used.
    #[error("{0}")]
    Store(#[from] idem_redis::BuildError),
    /// A setting cannot be used: a file it names (the tenant secret, the
    /// JWT keys, the upstream's CA) could not be read or used, or it does
    /// not fit the store (`--wait-for-replicas` without Redis).
    #[error("{0}")]
    Setting(String),
    /// The PostgreSQL store could not be built or its table created.
    #[error("{0}")]
    Postgres(String),
    /// Binding or serving failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The store could lose records silently (a Redis eviction policy that
    /// can evict them), and that was not explicitly allowed.
    #[error("{0}")]
    UnsafeStore(String),
}
