//! The idempotency layer the gateway's flags describe: its timing, its
//! fingerprints (keyed with a shared secret), its sealing keyring, its
//! problems and records API, its tenant and scope hashing.

use idem_core::Store;
use idem_layer::{
    IdempotencyLayer, Tenant, TenantFromAuthorization, TenantFromHeader,
    settings::{Fingerprints, Problems, RecordsApi, Sealing, Timing},
};

use crate::{
    StartError,
    config::Config,
    tenants::{Tenants, scope_secret, tenant_hash},
};

/// Whether the tenant secret is one every gateway of the store shares: given
/// (not generated at start), or the store is this process's memory.
pub(crate) fn shares_a_key(config: &Config, tenants: &Tenants) -> bool {
    !tenants.generated || config.store == "memory"
}

/// Whether stored responses are sealed: unless `--no-sealing`, with a
/// key every gateway of the store shares (the tenant secret's, or a
/// `--sealing-key`). A secret generated at start would give each gateway,
/// and each start, a key of its own, and their records would not open
/// for one another: then responses are stored in clear, with a warning.
pub(crate) fn seals(config: &Config, tenants: &Tenants) -> bool {
    if config.no_sealing {
        return false;
    }
    if !shares_a_key(config, tenants) && config.sealing_key.is_empty() {
        tracing::warn!(
            "stored responses are kept in clear: sealing them needs a key every gateway of \
             the store shares (--tenant-secret-file, or --sealing-key)"
        );
        return false;
    }
    true
}

/// The sealing keyring the flags describe: key 0 derived from the tenant
/// secret, then each `--sealing-key` in order of id, the highest sealing.
pub(crate) fn keyring(config: &Config, tenants: &Tenants) -> idem_layer::sealing::Keyring {
    let mut keyring = idem_layer::sealing::Keyring::derived(&tenants.secret);
    // Opening keys first: a key given both ways seals.
    for key in &config.sealing_opening_keys {
        keyring = keyring.opening(key.id, key.key);
    }
    let mut keys = config.sealing_key.clone();
    keys.sort_by_key(|key| key.id);
    for key in keys {
        keyring = keyring.rotated_to(key.id, key.key);
    }
    keyring
}

/// The idempotency layer the flags describe.
pub(crate) fn layer<S: Store>(
    config: &Config,
    tenants: &Tenants,
    store: S,
) -> Result<IdempotencyLayer<S>, StartError> {
    // A store that bounds its own calls (Redis: its timeout, plus the wait
    // for replicas when it waits for them) gives the layer that bound: the
    // store timeout alone would cut a reservation's `WAIT` short and answer
    // 503 for a write that reached its replicas.
    let store_timeout = store.call_bound().unwrap_or(config.store_timeout);
    let timing = Timing::default()
        .unknown_outcome_wait(config.unknown_outcome_wait)
        .lease(config.lease)
        .retention(config.retention)
        .in_flight(config.in_flight)
        .body_timeout(config.body_timeout)
        .store_timeout(store_timeout);
    let mut fingerprints = Fingerprints::default().max_body(config.max_body);
    if config.blake3_fingerprints || config.store == "memory" {
        fingerprints = fingerprints.format(idem_layer::fingerprint::FingerprintFormat::Blake3);
    }
    // Fingerprints are keyed like responses are sealed: with a key every
    // gateway of the store shares.
    if shares_a_key(config, tenants) {
        fingerprints = if config.unkeyed_fingerprints {
            fingerprints.secret_for_reading(&tenants.secret)
        } else {
            fingerprints.secret(&tenants.secret)
        };
    }
    let mut records = RecordsApi::default().path(format!("{}/records", config.records_prefix));
    if let Some(token) = &config.records_admin_token {
        records = records.admin_token(token.as_bytes());
    }
    records = records.output_by_key(config.output_by_key);
    let mut problems = Problems::default().error_member(config.problem_error_member);
    if let Some(base) = &config.problem_type_base {
        problems = problems.type_base(base.clone());
    }
    if let Some(name) = &config.should_retry_header {
        problems = problems.should_retry_header(name.clone());
    }
    // Sealed records open on every gateway that holds their key, whether
    // it seals new ones or not.
    let sealing = if seals(config, tenants) {
        Sealing::seal(keyring(config, tenants))
    } else {
        Sealing::open_only(keyring(config, tenants))
    };
    let mut layer = IdempotencyLayer::new(store)
        .timing(|_| timing)
        .methods(config.methods.clone())
        .fingerprints(|_| fingerprints)
        .answers(|answers| answers.max_response(config.max_body))
        .replay_cache(config.replay_cache_bytes, config.replay_cache_ttl)
        .records(|_| records)
        .problems(|_| problems)
        .sealing(sealing)
        .allow_anonymous(config.allow_anonymous)
        .require_key(config.require_key)
        .fail_open(config.fail_open);
    layer = match (&config.tenant_header, &tenants.jwt) {
        (Some(name), _) => layer.tenant(TenantFromHeader::new(name.clone())),
        (None, Some(_)) => layer.tenant(idem_layer::TenantFromExtension::<Tenant>::new()),
        (None, None) => layer.tenant(TenantFromAuthorization::keyed_as(
            tenant_hash(config),
            tenants.secret.clone(),
        )),
    };
    // The memory store's records live in this process only: keying their
    // scopes changes no stored identity.
    if config.keyed_scopes || config.store == "memory" {
        layer = layer.scope_secret(scope_secret(&tenants.secret));
    }
    if config.blake3_scopes || config.store == "memory" {
        layer = layer.scope_format(idem_core::ScopeFormat::Blake3);
    }
    layer.validate()?;
    Ok(layer)
}
