//! The default request fingerprint.
//!
//! SHA-256 over, each part length-prefixed: the operation, the query string,
//! the configured headers (default `content-type`; every value, in order)
//! and the body. A body whose `content-type` is `application/json` or ends
//! in `+json` is canonicalized first (RFC 8785), so key order, whitespace
//! and number spelling do not matter; a body that claims JSON but does not
//! parse is hashed as raw bytes.

use http::{HeaderName, header, request::Parts};
use idem_core::Fingerprint;
use sha2::{Digest, Sha256};

/// A replacement fingerprint function: `(operation, request head, body)`.
pub type FingerprintFn = dyn Fn(&str, &Parts, &[u8]) -> Fingerprint + Send + Sync;

fn update_part(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// Whether a `content-type` value names JSON (`application/json` or any
/// `+json` type), ignoring parameters and case.
pub fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    let Ok(essence) = std::str::from_utf8(essence) else {
        return false;
    };
    let essence = essence.to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The canonical RFC 8785 form of a JSON body, or `None` if it does not parse.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// The default fingerprint of a request.
pub fn fingerprint(
    operation: &str,
    parts: &Parts,
    headers: &[HeaderName],
    body: &[u8],
) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-fingerprint-v1");
    update_part(&mut hasher, operation.as_bytes());
    update_part(
        &mut hasher,
        parts.uri.query().unwrap_or_default().as_bytes(),
    );
    for name in headers {
        update_part(&mut hasher, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        hasher.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            update_part(&mut hasher, value.as_bytes());
        }
    }
    let canonical = parts
        .headers
        .get(header::CONTENT_TYPE)
        .filter(|ct| is_json(ct.as_bytes()))
        .and_then(|_| canonical_json(body));
    update_part(&mut hasher, canonical.as_deref().unwrap_or(body));
    Fingerprint::from_bytes(hasher.finalize().into())
}
