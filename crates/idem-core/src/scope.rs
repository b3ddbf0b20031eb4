//! Scopes and the hashes stores index records by.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::IdempotencyKey;

/// The identity of a record (IDEM-01): tenant, operation and key.
///
/// Tenant comes from the authenticated caller, operation is the method plus
/// the route. Stores index records by [`Scope::hash`], never by the raw parts.
#[derive(Clone, PartialEq, Eq)]
pub struct Scope {
    tenant: String,
    operation: String,
    key: IdempotencyKey,
    hash: ScopeHash,
}

impl Scope {
    /// Builds a scope and computes its unkeyed hash ([`ScopeHash::of`]).
    pub fn new(
        tenant: impl Into<String>,
        operation: impl Into<String>,
        key: IdempotencyKey,
    ) -> Self {
        Self::hashed(None, tenant, operation, key)
    }

    /// Builds a scope and computes its hash: keyed under `secret`
    /// ([`ScopeHash::keyed`]) when there is one, else unkeyed
    /// ([`ScopeHash::of`]). The two hashes of one scope differ, so a store
    /// holds one scope's records under each: every instance sharing a
    /// store must hash alike.
    pub fn hashed(
        secret: Option<&ScopeSecret>,
        tenant: impl Into<String>,
        operation: impl Into<String>,
        key: IdempotencyKey,
    ) -> Self {
        let tenant = tenant.into();
        let operation = operation.into();
        let hash = match secret {
            Some(secret) => ScopeHash::keyed(secret, &tenant, &operation, key.as_str()),
            None => ScopeHash::of(&tenant, &operation, key.as_str()),
        };
        Self {
            tenant,
            operation,
            key,
            hash,
        }
    }

    /// The tenant part.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The operation part (`"POST /orders"`).
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The idempotency key part.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The fixed-length hash that stores use as the record's identity.
    pub fn hash(&self) -> &ScopeHash {
        &self.hash
    }

    /// This scope's parts hashed as `secret` says (see [`Scope::hashed`]).
    pub fn rehashed(&self, secret: Option<&ScopeSecret>) -> Self {
        Self::hashed(
            secret,
            self.tenant.clone(),
            self.operation.clone(),
            self.key.clone(),
        )
    }
}

/// The secret key of keyed scope hashes ([`ScopeHash::keyed`]): the same on
/// every instance sharing a store. Its `Debug` form never shows it.
#[derive(Clone)]
pub struct ScopeSecret(Hmac<Sha256>);

impl ScopeSecret {
    /// The fewest bytes a secret may have: shorter ones are refused.
    pub const MIN_BYTES: usize = 16;

    /// Keys scope hashes with `secret` (at least [`MIN_BYTES`](Self::MIN_BYTES)
    /// random bytes; 32 are plenty), or `None` when it is shorter.
    pub fn new(secret: &[u8]) -> Option<Self> {
        if secret.len() < Self::MIN_BYTES {
            return None;
        }
        // HMAC takes keys of every length.
        <Hmac<Sha256> as Mac>::new_from_slice(secret).ok().map(Self)
    }

    /// Keys scope hashes with 32 secret bytes (a key drawn at random or
    /// derived from another secret), which are always long enough.
    pub fn from_bytes(secret: &[u8; 32]) -> Self {
        // HMAC pads a key shorter than its block with zeros.
        let mut block = [0u8; 64];
        block[..32].copy_from_slice(secret);
        Self(<Hmac<Sha256> as Mac>::new(&block.into()))
    }
}

impl fmt::Debug for ScopeSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScopeSecret(<secret>)")
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("tenant", &self.tenant)
            .field("operation", &self.operation)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// Appends the lower-case hex of `bytes` to `out` (the spelling of scope
/// hashes, fingerprints and hashed tenants).
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    // Written a chunk at a time through a stack buffer: pushing the digits
    // one `char` at a time costs several times as much.
    let mut buf = [0u8; 64];
    for chunk in bytes.chunks(buf.len() / 2) {
        let hex = &mut buf[..chunk.len() * 2];
        for (pair, &byte) in hex.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&hex_pair(byte));
        }
        // Hex digits are ASCII, so this always succeeds.
        if let Ok(text) = std::str::from_utf8(hex) {
            out.push_str(text);
        }
    }
}

/// The two lower-case hex digits of `byte`, as ASCII.
fn hex_pair(byte: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [
        DIGITS[usize::from(byte >> 4)],
        DIGITS[usize::from(byte & 0xf)],
    ]
}

/// The methods and formatting shared by the 32-byte digests: raw bytes in
/// and out, lower-case hex out (`Display`, `Debug`).
macro_rules! digest_type {
    ($name:ident, $debug:literal) => {
        impl $name {
            /// Wraps raw digest bytes.
            pub const fn from_bytes(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }

            /// The raw digest bytes.
            pub const fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// Lower-case hex, 64 characters.
            pub fn to_hex(&self) -> String {
                let mut out = String::with_capacity(64);
                push_hex(&mut out, &self.0);
                out
            }

            /// The lower-case hex as 64 ASCII bytes, without allocating.
            pub fn hex_bytes(&self) -> [u8; 64] {
                let mut out = [0u8; 64];
                for (pair, &byte) in out.chunks_exact_mut(2).zip(&self.0) {
                    pair.copy_from_slice(&hex_pair(byte));
                }
                out
            }

            /// Appends the lower-case hex (64 characters) to `out`.
            pub fn write_hex(&self, out: &mut String) {
                push_hex(out, &self.0);
            }

            /// Parses 64 hex characters.
            pub fn from_hex(text: &str) -> Option<Self> {
                let mut bytes = [0u8; 32];
                hex::decode_to_slice(text, &mut bytes).ok()?;
                Some(Self(bytes))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($debug, "({})"), self.to_hex())
            }
        }
    };
}

/// A fixed-length hash of a scope's three parts, each length-prefixed, so
/// that no key can collide with or reach into another tenant's records or
/// the store's key syntax: HMAC-SHA256 under a [`ScopeSecret`]
/// ([`keyed`](Self::keyed)), or SHA-256 ([`of`](Self::of)).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeHash([u8; 32]);

impl ScopeHash {
    /// Hashes the three parts of a scope with SHA-256, unkeyed: anyone who
    /// knows the parts can compute it (the form of every version before
    /// keyed hashes, and still the default).
    pub fn of(tenant: &str, operation: &str, key: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-scope-v1");
        for part in [tenant, operation, key] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        Self(hasher.finalize().into())
    }

    /// Hashes the three parts of a scope with HMAC-SHA256 under `secret`:
    /// without the secret nobody can compute a scope's hash, so nobody can
    /// aim keys at one shard, table bucket or cluster slot, nor test a
    /// guess of a tenant against what is stored.
    pub fn keyed(secret: &ScopeSecret, tenant: &str, operation: &str, key: &str) -> Self {
        let mut mac = secret.0.clone();
        mac.update(b"idem-scope-keyed-v1");
        for part in [tenant, operation, key] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part.as_bytes());
        }
        Self(mac.finalize().into_bytes().into())
    }
}

/// SHA-256 over what makes two requests "the same request" (see the layer's
/// fingerprinting).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

digest_type!(ScopeHash, "ScopeHash");
digest_type!(Fingerprint, "Fingerprint");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lower_case_and_complete() {
        let bytes: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(5));
        assert_eq!(ScopeHash::from_bytes(bytes).to_hex(), hex::encode(bytes));
        assert_eq!(Fingerprint::from_bytes(bytes).to_hex(), hex::encode(bytes));
        assert_eq!(
            &Fingerprint::from_bytes(bytes).hex_bytes()[..],
            hex::encode(bytes).as_bytes()
        );
        // Any length, across the 32-byte chunks push_hex writes in.
        for len in [0, 1, 31, 32, 33, 64, 65, 100] {
            let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(91)).collect();
            let mut out = "x".to_owned();
            push_hex(&mut out, &bytes);
            assert_eq!(out, format!("x{}", hex::encode(&bytes)), "{len} bytes");
        }
        let mut out = "prefix:".to_owned();
        ScopeHash::from_bytes([0xff; 32]).write_hex(&mut out);
        assert_eq!(out, format!("prefix:{}", "ff".repeat(32)));
        assert_eq!(
            Fingerprint::from_hex(&Fingerprint::from_bytes(bytes).to_hex()),
            Some(Fingerprint::from_bytes(bytes))
        );
    }

    fn key(text: &str) -> IdempotencyKey {
        IdempotencyKey::parse(text.as_bytes()).expect("key")
    }

    /// Both forms are stored as record identities: a change to either
    /// makes every record written before it unreachable, so each is pinned
    /// to a value computed elsewhere (Python's `hashlib` and `hmac` over
    /// the label and the three parts, each after its length as a big-endian
    /// u64).
    #[test]
    fn scope_hashes_are_pinned() {
        let unkeyed = Scope::new("acme", "POST /orders", key("order-1"));
        assert_eq!(
            unkeyed.hash().to_hex(),
            "f25f62b7ae0cd1627293e55048b4c4ccf7c64dd44f4c0f7dadbe55655d019da6"
        );
        let secret = ScopeSecret::new(b"0123456789abcdef0123456789abcdef").expect("secret");
        let keyed = Scope::hashed(Some(&secret), "acme", "POST /orders", key("order-1"));
        assert_eq!(
            keyed.hash().to_hex(),
            "238b1e7fc6d126915aa9177dac9e6b7ff7ab951a59c54a6dc4f653cfc71d51d1"
        );
        assert_eq!(
            ScopeHash::keyed(&secret, "acme", "POST /orders", "order-2").to_hex(),
            "a4ea1c1c9117672f59963a0bc9b7e6946c514b5b2bacdf41941e183f528e7205"
        );
        assert_eq!(unkeyed.rehashed(Some(&secret)).hash(), keyed.hash());
        assert_eq!(keyed.rehashed(None).hash(), unkeyed.hash());
        assert_eq!(keyed.tenant(), "acme");
        assert_eq!(keyed.key().as_str(), "order-1");
    }

    #[test]
    fn secrets_are_long_distinct_and_never_shown() {
        assert!(ScopeSecret::new(&[7; ScopeSecret::MIN_BYTES - 1]).is_none());
        assert!(ScopeSecret::new(b"").is_none());
        let one = ScopeSecret::new(&[7; ScopeSecret::MIN_BYTES]).expect("secret");
        let other = ScopeSecret::new(&[8; ScopeSecret::MIN_BYTES]).expect("secret");
        let parts = ("acme", "POST /orders", "order-1");
        assert_ne!(
            ScopeHash::keyed(&one, parts.0, parts.1, parts.2),
            ScopeHash::keyed(&other, parts.0, parts.1, parts.2)
        );
        assert_eq!(format!("{one:?}"), "ScopeSecret(<secret>)");
        let bytes = [9u8; 32];
        assert_eq!(
            ScopeHash::keyed(&ScopeSecret::from_bytes(&bytes), parts.0, parts.1, parts.2),
            ScopeHash::keyed(
                &ScopeSecret::new(&bytes).expect("secret"),
                parts.0,
                parts.1,
                parts.2
            )
        );
        // Length prefixes keep the parts apart: moving a byte from one
        // part to the next is another scope.
        assert_ne!(
            ScopeHash::keyed(&one, "ab", "c", "k"),
            ScopeHash::keyed(&one, "a", "bc", "k")
        );
    }
}
