//! The formats idem's layers use in the peer bench, read from the
//! environment (see run.sh and inproc.sh).

/// IDEM_FINGERPRINT=blake3: idem's layers write BLAKE3 fingerprints
/// (`Fingerprints::format`); otherwise the default, SHA-256.
pub fn idem_fingerprint() -> idem_layer::fingerprint::FingerprintFormat {
    match std::env::var("IDEM_FINGERPRINT").as_deref() {
        Ok("blake3") => idem_layer::fingerprint::FingerprintFormat::Blake3,
        _ => idem_layer::fingerprint::FingerprintFormat::Sha256,
    }
}

/// IDEM_SCOPE=blake3: idem's layers hash scopes with BLAKE3
/// (`scope_format`); otherwise the default, SHA-256.
pub fn idem_scope() -> idem_layer::ScopeFormat {
    match std::env::var("IDEM_SCOPE").as_deref() {
        Ok("blake3") => idem_layer::ScopeFormat::Blake3,
        _ => idem_layer::ScopeFormat::Sha256,
    }
}

/// The tenant from `Authorization`, as IDEM_TENANT says: `blake3`, keyed
/// BLAKE3 (`TenantHash::Blake3`) under a bench secret; `hmac`, HMAC-SHA256
/// under it; otherwise the plain SHA-256 form.
pub enum IdemTenant {
    Plain(idem_layer::TenantFromAuthorization),
    Keyed(idem_layer::TenantFromKeyedAuthorization),
}

impl idem_layer::TenantExtractor for IdemTenant {
    fn tenant(&self, parts: &axum::http::request::Parts) -> Option<String> {
        match self {
            Self::Plain(plain) => plain.tenant(parts),
            Self::Keyed(keyed) => keyed.tenant(parts),
        }
    }

    fn shared_tenant(&self, parts: &axum::http::request::Parts) -> Option<std::sync::Arc<str>> {
        match self {
            Self::Plain(plain) => plain.shared_tenant(parts),
            Self::Keyed(keyed) => keyed.shared_tenant(parts),
        }
    }
}

pub fn idem_tenant() -> IdemTenant {
    use idem_layer::{TenantFromAuthorization, TenantHash};
    let secret = b"a bench secret of 32 bytes......".to_vec();
    match std::env::var("IDEM_TENANT").as_deref() {
        Ok("blake3") => IdemTenant::Keyed(TenantFromAuthorization::keyed_as(
            TenantHash::Blake3,
            secret,
        )),
        Ok("hmac") => IdemTenant::Keyed(TenantFromAuthorization::keyed(secret)),
        _ => IdemTenant::Plain(TenantFromAuthorization),
    }
}
