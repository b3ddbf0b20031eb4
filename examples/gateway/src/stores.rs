//! The store the flags name: built, checked (eviction, persistence, failover
//! bound), claimed for this gateway's identity, and its router.

use crate::{
    StartError,
    config::{Config, is_postgres},
    router::{Drain, Health, router},
    tenants::{Tenants, hmac_sha256},
};

use std::time::Duration;

use axum::{Router, http::Uri};
use idem_core::Fleet;
use idem_memory::MemoryStore;
use idem_redis::{RecordFormat, RedisStore};

/// The memory store the flags describe, with its gauges kept up to date.
pub(crate) fn memory_store(config: &Config) -> MemoryStore {
    let quota = match config.memory_tenant_quota {
        Some(0) => None,
        Some(quota) => Some(quota),
        None => Some((config.memory_capacity / 10).max(1)),
    };
    let store = MemoryStore::builder()
        .capacity(config.memory_capacity)
        .max_bytes(config.memory_max_bytes)
        .tenant_quota(quota)
        .build();
    // Gauges of the memory store, set now (the recorder first: gauges set
    // before it is installed are lost) and every second after.
    crate::metrics::prometheus();
    let set = |store: &MemoryStore| {
        metrics::gauge!("idem_store_records").set(store.len() as f64);
        metrics::gauge!("idem_store_bytes").set(store.bytes() as f64);
        metrics::gauge!("idem_store_full").set(f64::from(u8::from(store.is_full())));
    };
    set(&store);
    let watched = store.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            set(&watched);
        }
    });
    store
}

/// `/healthz` of a memory store: 503 while it is full (new keys get 503
/// until records expire: a balancer should send them elsewhere).
pub(crate) fn memory_health(store: &MemoryStore) -> Health {
    let store = store.clone();
    std::sync::Arc::new(move || {
        let full = store.is_full();
        Box::pin(async move {
            if full {
                Err("store full".to_owned())
            } else {
                Ok("ok".to_owned())
            }
        })
    })
}

/// `/healthz` of Redis: every slot served by a master that answers.
pub(crate) fn redis_health(store: &std::sync::Arc<RedisStore>) -> Health {
    let store = std::sync::Arc::clone(store);
    std::sync::Arc::new(move || {
        let store = std::sync::Arc::clone(&store);
        Box::pin(async move {
            match store.health().await {
                Ok(health) if health.is_ok() => Ok(health.to_string()),
                Ok(health) => Err(health.to_string()),
                Err(error) => Err(format!("store unavailable: {error}")),
            }
        })
    })
}

/// The store the flags name (checked and prepared), and the router on it.
pub(crate) async fn store_router(
    config: &Config,
    tenants: &Tenants,
    upstream: Uri,
    spans: Option<crate::trace::Spans>,
) -> Result<(Router, Drain), StartError> {
    if config.store == "memory" {
        let store = memory_store(config);
        let health = memory_health(&store);
        let guard = idem_layer::StoreGuard::default();
        return router(config, tenants, store, Some(health), upstream, spans, guard);
    }
    if is_postgres(&config.store) {
        let store = idem_postgres::PgStore::from_url(&config.store)
            .map_err(|error| StartError::Postgres(error.to_string()))?;
        store.migrate().await.map_err(|error| {
            StartError::Postgres(format!("could not create the records table: {error}"))
        })?;
        crate::metrics::watch_pool(store.pool().clone());
        let place = format!("the table {}_identity", store.table());
        let store = std::sync::Arc::new(store);
        let guard = idem_layer::StoreGuard::default();
        claim_store(&store, place, config, tenants, guard.clone()).await?;
        return router(config, tenants, store, None, upstream, spans, guard);
    }
    let mut builder = RedisStore::builder(&config.store)
        .timeout(config.store_timeout)
        .record_format(
            // The flag's parser admits only the formats this version knows.
            RecordFormat::from_number(config.redis_record_format).unwrap_or_default(),
        );
    if config.wait_for_replicas > 0 {
        builder = builder.wait_for_replicas(config.wait_for_replicas, config.replica_timeout);
    }
    // Checked now if Redis answers (an evicting policy refused unless
    // allowed, a version too old for the record format refused, no
    // persistence warned about), and on every connection the store makes
    // from then on: the first one if Redis is down at start, and each
    // after a restart or a failover.
    let store = match builder
        .allow_eviction(config.allow_redis_eviction)
        .check_lazily(true)
        .connect()
        .await
    {
        Ok(store) => std::sync::Arc::new(store),
        Err(idem_redis::BuildError::Unsafe(refusal)) => {
            return Err(StartError::UnsafeStore(refusal));
        }
        Err(other) => return Err(other.into()),
    };
    let place = format!("the Redis key {}", store.identity_key());
    let guard = idem_layer::StoreGuard::default();
    claim_store(&store, place, config, tenants, guard.clone()).await?;
    check_failover(&store, config.lease).await;
    let health = redis_health(&store);
    router(config, tenants, store, Some(health), upstream, spans, guard)
}

/// The identity of this gateway's records: a keyed hash of what derives
/// their tenants and scopes (the tenant source; the tenant secret where
/// it is used). Gateways whose identities differ find no record of each
/// other.
pub(crate) fn store_identity(config: &Config, tenants: &Tenants) -> String {
    identity_of(config, tenants, true)
}

/// The identity gateways before fingerprint keying was part of it claimed
/// (`v1:`): a store that holds this gateway's own is upgraded to
/// [`store_identity`] at start.
pub(crate) fn legacy_store_identity(config: &Config, tenants: &Tenants) -> String {
    identity_of(config, tenants, false)
}

/// The identity: a keyed digest of what derives records' identities (the
/// tenant source, the scope hashing and, from `v2:`, the fingerprints'
/// format and keying), keyed by the tenant secret wherever it derives any
/// of them, so gateways with other secrets tell apart without the marker
/// showing a secret.
fn identity_of(config: &Config, tenants: &Tenants, fingerprints: bool) -> String {
    let (source, hashed) = match (&config.tenant_header, &tenants.jwt) {
        (Some(name), _) => (format!("header {name}"), false),
        (None, Some(_)) => (format!("jwt {}", config.tenant_jwt_claim), true),
        (None, None) => ("authorization".to_owned(), true),
    };
    // HMAC-SHA256 tenants keep the marker of the gateways before BLAKE3.
    let source = if hashed && config.blake3_tenants {
        format!("{source} blake3")
    } else {
        source
    };
    let keyed = if config.keyed_scopes {
        "keyed"
    } else {
        "unkeyed"
    };
    // SHA-256 scopes keep the marker of the gateways before BLAKE3.
    let scopes = if config.blake3_scopes {
        format!("{keyed} blake3")
    } else {
        keyed.to_owned()
    };
    // Fingerprints are keyed (or read keyed) by the tenant secret wherever
    // it is shared (crate::protection::layer). Their format and whether new
    // ones are keyed do not matter: every gateway reads both formats and
    // both kinds; the key does.
    let keyed_fingerprints = crate::protection::shares_a_key(config, tenants);
    let fingerprint_text = if keyed_fingerprints {
        "keyed"
    } else {
        "unkeyed"
    };
    // A secret that derives nothing is left out: gateways may differ in it.
    let derives = hashed || config.keyed_scopes || (fingerprints && keyed_fingerprints);
    let secret: &[u8] = if derives { &tenants.secret } else { b"" };
    let (version, text) = if fingerprints {
        (
            "v2:",
            format!(
                "idem-gateway identity v2\ntenants {source}\nscopes {scopes}\n\
                 fingerprints {fingerprint_text}"
            ),
        )
    } else {
        (
            "v1:",
            format!("idem-gateway identity v1\ntenants {source}\nscopes {scopes}"),
        )
    };
    let digest = hmac_sha256(secret, text.as_bytes());
    let mut marker = version.to_owned();
    idem_core::push_hex(&mut marker, &digest[..16]);
    marker
}

/// Claims the store for this gateway's identity at start, or refuses to
/// start when gateways that derive tenants or scopes differently hold it
/// (a retry moving between them would run again); then keeps the claim
/// alive as long as the retention. A store that cannot be asked at start
/// is logged and accepted, and claimed on the next refresh. `place` says
/// where the claim lives, for an operator.
pub(crate) async fn claim_store<S: Fleet>(
    store: &std::sync::Arc<S>,
    place: String,
    config: &Config,
    tenants: &Tenants,
    guard: idem_layer::StoreGuard,
) -> Result<(), StartError> {
    // Gateways of the version before held this gateway's own identity
    // without its fingerprint keying: it is upgraded (they log, at their
    // next refresh, that the store changed hands).
    let claimed = idem_layer::keep_claimed_guarded(
        store,
        store_identity(config, tenants),
        Some(legacy_store_identity(config, tenants)),
        config.retention,
        config.replace_store_identity,
        guard,
    )
    .await;
    match claimed {
        Ok(idem_core::IdentityClaim::Other(_)) => Err(StartError::UnsafeStore(format!(
            "this store holds records of gateways that derive tenants, scopes or fingerprints \
             differently (another tenant secret, tenant source, --blake3-tenants, \
             --keyed-scopes or --blake3-scopes; {place} \
             says so): a retry that moves between them and this gateway does not find its \
             record and runs again. Start it with their settings, or pass \
             --replace-store-identity to make this gateway's the store's"
        ))),
        Ok(_) => Ok(()),
        Err(error) => {
            tracing::warn!(%error, "could not claim the store's identity at start");
            Ok(())
        }
    }
}

/// Warns when the lease could lapse during a cluster failover (where the
/// cluster's node timeout can be read).
pub(crate) async fn check_failover(store: &RedisStore, lease: Duration) {
    let Some(node_timeout) = store.cluster_node_timeout().await else {
        return;
    };
    let bound = idem_redis::failover_bound(node_timeout);
    if lease <= bound {
        tracing::warn!(
            lease = ?lease,
            node_timeout = ?node_timeout,
            failover_bound = ?bound,
            "the lease is shorter than this cluster's failover can take: a request running \
             while its master fails can lose its lease, and a retry may run while it still \
             acts. Set --lease above the failover bound (1.6 × cluster-node-timeout + 2 s)"
        );
    }
}
