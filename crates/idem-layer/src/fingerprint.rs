//! The default request fingerprint.
//!
//! SHA-256 over, each part length-prefixed: the operation, the request path,
//! the query string, the configured headers (default `content-type`; every value, in order)
//! and the body. A body whose `content-type` is `application/json` or ends
//! in `+json` is canonicalized first (RFC 8785), so key order, whitespace
//! and number spelling do not matter; a body that claims JSON but does not
//! parse is hashed as raw bytes.
//!
//! The JSON body is hashed in its canonical form without writing the
//! canonical text out: the parsed value is walked with object members in
//! RFC 8785 order (UTF-16 code units of the key) and numbers in their
//! RFC 8785 spelling (ECMAScript `Number.prototype.toString`, via
//! `ryu-js`), each part tagged and length-prefixed. Two bodies get the same
//! fingerprint exactly when their RFC 8785 forms are equal; the tests check
//! this against the `serde_json_canonicalizer` crate, which
//! [`canonical_json`] uses to produce the canonical text itself. Hashing the
//! walk is several times faster than producing the text.
//!
//! The request path is included because the operation is the route
//! template (`POST /accounts/{id}/charges`): the same key sent to another
//! account is a different request and answers `422`, never another
//! account's replay.

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

/// The canonical RFC 8785 text of a JSON body, or `None` if it does not
/// parse. The fingerprint does not need the text (see the module docs);
/// this is for inspection and tests.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// Feeds the RFC 8785 form of `value` into `hasher`, structurally.
fn hash_json(hasher: &mut Sha256, value: &serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Null => hasher.update(b"n"),
        Value::Bool(true) => hasher.update(b"t"),
        Value::Bool(false) => hasher.update(b"f"),
        Value::Number(number) => {
            hasher.update(b"d");
            let mut buffer = ryu_js::Buffer::new();
            // RFC 8785 numbers are IEEE 754 doubles; serde_json yields a
            // finite f64 for every number it parses.
            let text = buffer.format(number.as_f64().unwrap_or(f64::NAN));
            update_part(hasher, text.as_bytes());
        }
        Value::String(text) => {
            hasher.update(b"s");
            update_part(hasher, text.as_bytes());
        }
        Value::Array(items) => {
            hasher.update(b"a");
            hasher.update((items.len() as u64).to_be_bytes());
            items.iter().for_each(|item| hash_json(hasher, item));
        }
        Value::Object(members) => {
            hasher.update(b"o");
            hasher.update((members.len() as u64).to_be_bytes());
            // Without serde_json's `preserve_order` the map iterates in UTF-8
            // byte order, which is UTF-16 order for ASCII keys; anything else
            // is sorted here.
            if members.keys().all(|k| k.is_ascii()) && members.keys().is_sorted() {
                for (key, member) in members {
                    update_part(hasher, key.as_bytes());
                    hash_json(hasher, member);
                }
            } else {
                let mut sorted: Vec<_> = members.iter().collect();
                sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
                for (key, member) in sorted {
                    update_part(hasher, key.as_bytes());
                    hash_json(hasher, member);
                }
            }
        }
    }
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
    update_part(&mut hasher, parts.uri.path().as_bytes());
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
    let json = parts
        .headers
        .get(header::CONTENT_TYPE)
        .filter(|ct| is_json(ct.as_bytes()))
        .and_then(|_| serde_json::from_slice::<serde_json::Value>(body).ok());
    match json {
        Some(value) => {
            hasher.update(b"json");
            hash_json(&mut hasher, &value);
        }
        None => {
            hasher.update(b"raw");
            update_part(&mut hasher, body);
        }
    }
    Fingerprint::from_bytes(hasher.finalize().into())
}
