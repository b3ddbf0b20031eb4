//! The connections: a pool of a single node or of a cluster, and one
//! connection taken from it.

use idem_core::StoreError;

#[derive(Clone)]
pub(crate) enum Pool {
    Single(deadpool_redis::Pool),
    Cluster(deadpool_redis::cluster::Pool),
}

impl Pool {
    /// A connection taken from the pool for good.
    pub(crate) async fn fresh(&self) -> Result<Conn, StoreError> {
        Ok(match self {
            // Made without a reply timeout: the store bounds each call
            // itself (see the builder).
            Self::Single(pool) => Conn::Single(deadpool_redis::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
            Self::Cluster(pool) => Conn::Cluster(deadpool_redis::cluster::Connection::take(
                pool.get().await.map_err(unavailable)?,
            )),
        })
    }
}

use crate::errors::unavailable;

/// A connection checked out of the pool for good, shared by cloning.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}
