//! The formats idem's layers use in the peer bench, read from the
//! environment (see run.sh and inproc.sh).

/// IDEM_FINGERPRINT=blake3: idem's layers write BLAKE3 fingerprints
/// (`fingerprint_format`); otherwise the default, SHA-256.
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
