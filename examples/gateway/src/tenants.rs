//! Where tenants come from (a header, `Authorization`, a verified JWT) and
//! the secret their hashes are keyed with.

use crate::{
    StartError,
    config::{Config, MIN_SECRET_BYTES},
    jwt,
};

/// Where tenants come from, with the secret their hashes are keyed with.
pub(crate) struct Tenants {
    pub(crate) secret: Vec<u8>,
    /// Whether the secret was generated at start (none was configured).
    pub(crate) generated: bool,
    pub(crate) jwt: Option<jwt::JwtTenants>,
}

impl Tenants {
    /// Reads the secret (flag, file, or generated) and the JWT keys.
    pub(crate) fn resolve(config: &Config) -> Result<Self, StartError> {
        let (secret, generated) = match (&config.tenant_secret, &config.tenant_secret_file) {
            (Some(secret), _) => (secret.as_bytes().to_vec(), false),
            (None, Some(path)) => {
                let bytes = std::fs::read(path).map_err(|error| {
                    StartError::Setting(format!(
                        "cannot read the tenant secret file {}: {error}",
                        path.display()
                    ))
                })?;
                let secret = bytes.trim_ascii_end().to_vec();
                if secret.len() < MIN_SECRET_BYTES {
                    return Err(StartError::Setting(format!(
                        "the tenant secret file {} holds fewer than {MIN_SECRET_BYTES} bytes",
                        path.display()
                    )));
                }
                (secret, false)
            }
            (None, None) => (rand::random::<[u8; 32]>().to_vec(), true),
        };
        let jwt = match &config.tenant_jwt_keys {
            Some(path) => Some(
                jwt::JwtTenants::from_file(
                    path,
                    &config.tenant_jwt_claim,
                    config.tenant_jwt_leeway,
                )
                .map_err(StartError::Setting)?,
            ),
            None => None,
        };
        Ok(Self {
            secret,
            generated,
            jwt,
        })
    }
}

/// The key of a gateway's scope hashes (`--keyed-scopes`): HMAC-SHA256 of a
/// fixed label under the tenant secret, so that one secret serves both
/// and neither hash can be computed from the other.
pub fn scope_secret(tenant_secret: &[u8]) -> idem_layer::ScopeSecret {
    idem_layer::ScopeSecret::from_bytes(&hmac_sha256(
        tenant_secret,
        b"idem-gateway scope secret v1",
    ))
}

/// HMAC-SHA256 of `message` under `key`.
pub(crate) fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    match <Hmac<sha2::Sha256> as Mac>::new_from_slice(key) {
        Ok(mut mac) => {
            mac.update(message);
            mac.finalize().into_bytes().into()
        }
        // HMAC takes keys of every length: not reached.
        Err(_) => <sha2::Sha256 as sha2::Digest>::digest(message).into(),
    }
}

/// Says what a generated tenant secret means for this store.
pub(crate) fn generated_secret_warning(store: &str) {
    if store == "memory" {
        tracing::info!(
            "no --tenant-secret-file: tenant hashes are keyed with a secret generated at start \
             (the memory store's records live in this process only, so nothing else needs it)"
        );
    } else {
        tracing::warn!(
            "no --tenant-secret-file: tenant hashes are keyed with a secret generated at start. \
             Another gateway on this store, or this one after a restart, would derive other \
             tenants, and a retry that reaches it would run again: on Redis it refuses to start \
             while this gateway's records live. Give every gateway the same --tenant-secret-file"
        );
    }
}

/// How the gateway hashes tenants from credentials (`--blake3-tenants`;
/// always BLAKE3 with the memory store, whose records live in this
/// process only).
pub(crate) fn tenant_hash(config: &Config) -> idem_layer::TenantHash {
    if config.blake3_tenants || config.store == "memory" {
        idem_layer::TenantHash::Blake3
    } else {
        idem_layer::TenantHash::HmacSha256
    }
}
