//! Scopes and the hashes stores index records by.

use std::{fmt, sync::Arc};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::IdempotencyKey;

/// The identity of a record (IDEM-01): tenant, operation and key.
///
/// Tenant comes from the authenticated caller, operation is the method plus
/// the route. Stores index records by [`Scope::hash`], never by the raw parts.
#[derive(Clone, PartialEq, Eq)]
pub struct Scope {
    tenant: Arc<str>,
    operation: Arc<str>,
    key: IdempotencyKey,
    hash: ScopeHash,
}

impl Scope {
    /// Builds a scope and computes its unkeyed hash ([`ScopeHash::of`]).
    pub fn new(
        tenant: impl Into<Arc<str>>,
        operation: impl Into<Arc<str>>,
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
        tenant: impl Into<Arc<str>>,
        operation: impl Into<Arc<str>>,
        key: IdempotencyKey,
    ) -> Self {
        Self::hashed_as(ScopeFormat::Sha256, secret, tenant, operation, key)
    }

    /// Builds a scope and computes its hash in `format`, keyed under
    /// `secret` when there is one (see [`ScopeFormat`]). The tenant and
    /// operation may be given as `Arc<str>` to share them without a copy.
    pub fn hashed_as(
        format: ScopeFormat,
        secret: Option<&ScopeSecret>,
        tenant: impl Into<Arc<str>>,
        operation: impl Into<Arc<str>>,
        key: IdempotencyKey,
    ) -> Self {
        let tenant = tenant.into();
        let operation = operation.into();
        let hash = format.hash(secret, &tenant, &operation, key.as_str());
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

    /// The tenant part, to share (a clone is a reference count, not a
    /// copy: a record and the handler's context keep it so).
    pub fn shared_tenant(&self) -> &Arc<str> {
        &self.tenant
    }

    /// The operation part, to share as [`shared_tenant`](Self::shared_tenant).
    pub fn shared_operation(&self) -> &Arc<str> {
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
        self.rehashed_as(ScopeFormat::Sha256, secret)
    }

    /// This scope's parts hashed in `format`, keyed under `secret` when
    /// there is one (see [`Scope::hashed_as`]).
    pub fn rehashed_as(&self, format: ScopeFormat, secret: Option<&ScopeSecret>) -> Self {
        Self::hashed_as(
            format,
            secret,
            self.tenant.clone(),
            self.operation.clone(),
            self.key.clone(),
        )
    }
}

/// The hash function of scope hashes, the records' identities in a store.
///
/// Each format gives every scope another hash, so a store holds one
/// scope's records under each: every instance sharing a store must hash
/// alike, and switching an existing deployment makes the records written
/// before the switch unreachable (a retry of an earlier request runs
/// again). Choose the format when a deployment starts, as with a
/// [`ScopeSecret`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ScopeFormat {
    /// SHA-256 ([`ScopeHash::of`]), or HMAC-SHA256 under a secret
    /// ([`ScopeHash::keyed`]): the default, and what every version before
    /// this one wrote.
    #[default]
    Sha256,
    /// BLAKE3 ([`ScopeHash::blake3`]), or BLAKE3's keyed mode under a key
    /// derived from a secret ([`ScopeHash::blake3_keyed`]): about a tenth of
    /// SHA-256's instructions on a CPU without SHA extensions (a typical
    /// scope is three SHA-256 blocks, plus one for HMAC), no slower on one
    /// with them.
    Blake3,
}

impl ScopeFormat {
    /// Its name: `sha256` or `blake3`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Blake3 => "blake3",
        }
    }

    /// The hash of a scope's parts in this format.
    pub fn hash(
        self,
        secret: Option<&ScopeSecret>,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> ScopeHash {
        match (self, secret) {
            (Self::Sha256, None) => ScopeHash::of(tenant, operation, key),
            (Self::Sha256, Some(secret)) => ScopeHash::keyed(secret, tenant, operation, key),
            (Self::Blake3, None) => ScopeHash::blake3(tenant, operation, key),
            (Self::Blake3, Some(secret)) => ScopeHash::blake3_keyed(secret, tenant, operation, key),
        }
    }
}

/// The secret key of keyed scope hashes ([`ScopeHash::keyed`]): the same on
/// every instance sharing a store. Its `Debug` form never shows it.
#[derive(Clone)]
pub struct ScopeSecret {
    hmac: Hmac<Sha256>,
    /// The key of BLAKE3's keyed mode, derived from the secret (never the
    /// secret itself, which also keys HMAC).
    blake3: [u8; 32],
}

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
        let hmac = <Hmac<Sha256> as Mac>::new_from_slice(secret).ok()?;
        Some(Self {
            hmac,
            blake3: Self::blake3_key(secret),
        })
    }

    fn blake3_key(secret: &[u8]) -> [u8; 32] {
        blake3::derive_key("idem 2026-12-01 scope hash key v2", secret)
    }

    /// Keys scope hashes with 32 secret bytes (a key drawn at random or
    /// derived from another secret), which are always long enough.
    pub fn from_bytes(secret: &[u8; 32]) -> Self {
        // HMAC pads a key shorter than its block with zeros.
        let mut block = [0u8; 64];
        block[..32].copy_from_slice(secret);
        Self {
            hmac: <Hmac<Sha256> as Mac>::new(&block.into()),
            blake3: Self::blake3_key(secret),
        }
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
        for (pair, &byte) in hex.as_chunks_mut::<2>().0.iter_mut().zip(chunk) {
            *pair = HEX_PAIRS[usize::from(byte)];
        }
        // Hex digits are ASCII, so this always succeeds.
        if let Ok(text) = std::str::from_utf8(hex) {
            out.push_str(text);
        }
    }
}

/// The two lower-case hex digits of every byte, as ASCII: one lookup a
/// byte instead of two digits worked out apart (a third of the
/// instructions per digest).
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut table = [[0u8; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0xf]];
        byte += 1;
    }
    table
};

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
                for (pair, &byte) in out.as_chunks_mut::<2>().0.iter_mut().zip(&self.0) {
                    *pair = HEX_PAIRS[usize::from(byte)];
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
        with_scope_bytes(b"idem-scope-v1", [tenant, operation, key], |bytes| {
            Self(Sha256::digest(bytes).into())
        })
    }

    /// Hashes the three parts of a scope with HMAC-SHA256 under `secret`:
    /// without the secret nobody can compute a scope's hash, so nobody can
    /// aim keys at one shard, table bucket or cluster slot, nor test a
    /// guess of a tenant against what is stored.
    pub fn keyed(secret: &ScopeSecret, tenant: &str, operation: &str, key: &str) -> Self {
        with_scope_bytes(b"idem-scope-keyed-v1", [tenant, operation, key], |bytes| {
            let mut mac = secret.hmac.clone();
            mac.update(bytes);
            Self(mac.finalize().into_bytes().into())
        })
    }

    /// BLAKE3 over `idem-scope-v2` and the three parts, each
    /// length-prefixed as in [`ScopeHash::of`].
    pub fn blake3(tenant: &str, operation: &str, key: &str) -> Self {
        let hash = with_scope_bytes(b"idem-scope-v2", [tenant, operation, key], blake3::hash);
        Self(*hash.as_bytes())
    }

    /// BLAKE3 in its keyed mode, under a key derived from `secret`, over
    /// `idem-scope-keyed-v2` and the three length-prefixed parts: as
    /// [`ScopeHash::keyed`], nobody without the secret can compute it.
    pub fn blake3_keyed(secret: &ScopeSecret, tenant: &str, operation: &str, key: &str) -> Self {
        let hash = with_scope_bytes(b"idem-scope-keyed-v2", [tenant, operation, key], |bytes| {
            blake3::keyed_hash(&secret.blake3, bytes)
        });
        Self(*hash.as_bytes())
    }
}

/// Calls `f` with `label` and the three parts, each as a big-endian u64
/// length and its bytes: the layout every scope hash hashes, in one
/// buffer (the hash gets it in one call), on the stack when it fits, as
/// a typical scope does.
fn with_scope_bytes<T>(label: &[u8], parts: [&str; 3], f: impl FnOnce(&[u8]) -> T) -> T {
    let len = label.len() + parts.iter().map(|part| 8 + part.len()).sum::<usize>();
    let mut stack = [0u8; 256];
    let mut heap = Vec::new();
    let buf = if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap[..]
    };
    buf[..label.len()].copy_from_slice(label);
    let mut at = label.len();
    for part in parts {
        buf[at..at + 8].copy_from_slice(&(part.len() as u64).to_be_bytes());
        at += 8;
        buf[at..at + part.len()].copy_from_slice(part.as_bytes());
        at += part.len();
    }
    f(buf)
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
        // Every byte value, through the table.
        let every: Vec<u8> = (0..=255).collect();
        let mut out = String::new();
        push_hex(&mut out, &every);
        assert_eq!(out, hex::encode(&every));
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

    /// The BLAKE3 format, pinned to values computed with Python's `blake3`
    /// package over the documented layout (the keyed one under
    /// `derive_key("idem 2026-12-01 scope hash key v2", secret)`), with a
    /// tenant long enough to leave the stack buffer.
    #[test]
    fn blake3_scope_hashes_are_pinned() {
        let secret = ScopeSecret::new(b"0123456789abcdef0123456789abcdef").expect("secret");
        let hex = |secret: Option<&ScopeSecret>, tenant: &str| {
            Scope::hashed_as(
                ScopeFormat::Blake3,
                secret,
                tenant,
                "POST /orders",
                key("order-1"),
            )
            .hash()
            .to_hex()
        };
        assert_eq!(
            hex(None, "acme"),
            "60b0789eff87dbd2d50f12506a3076235fcb215b1c3e03a7f49ff8b983af90d7"
        );
        assert_eq!(
            hex(Some(&secret), "acme"),
            "d56730045180aa5895ef63a3befaa1d0bab7a73404c45d82e8d8941d42777561"
        );
        assert_eq!(
            hex(None, &"t".repeat(300)),
            "af799dd75b199255b225eb09671b0826ba098b8e85d72d3cff3e74313cba11f1"
        );
        let from_bytes = ScopeSecret::from_bytes(b"0123456789abcdef0123456789abcdef");
        assert_eq!(hex(Some(&from_bytes), "acme"), hex(Some(&secret), "acme"));
        // Every format and keying gives a scope another hash.
        let scope = Scope::new("acme", "POST /orders", key("order-1"));
        let hashes = [
            *scope.hash(),
            *scope.rehashed(Some(&secret)).hash(),
            *scope.rehashed_as(ScopeFormat::Blake3, None).hash(),
            *scope.rehashed_as(ScopeFormat::Blake3, Some(&secret)).hash(),
        ];
        for (i, a) in hashes.iter().enumerate() {
            for b in &hashes[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(
            scope.rehashed_as(ScopeFormat::Sha256, Some(&secret)).hash(),
            scope.rehashed(Some(&secret)).hash()
        );
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
