//! How tenants derived from credentials are hashed: the keyed hash, its
//! key, and the few recent values kept to skip it.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::recent::Recent;

/// The hash function of a keyed tenant: what [`TenantFromAuthorization::keyed_as`](super::TenantFromAuthorization::keyed_as),
/// [`TenantFromHeader::hashed_as`](super::TenantFromHeader::hashed_as) and [`TenantHasher`] store.
///
/// The tenant is the first part of every scope, so the two forms name
/// different records for the same caller: a retry whose record was written
/// under the other form does not find it and runs again. Choose one when a
/// deployment starts, or switch every instance sharing a store at once when
/// no retry of a request made before the switch can come (as for
/// [`ScopeFormat`](idem_core::ScopeFormat)). A memory store's records live
/// in one process only: there the choice is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TenantHash {
    /// HMAC-SHA256 under the secret: the default, and what every earlier
    /// version stores.
    #[default]
    HmacSha256,
    /// BLAKE3's keyed mode, under a key derived from the secret
    /// (`blake3::derive_key("idem 2026-12-01 tenant hash key v1", secret)`).
    /// A short credential costs one BLAKE3 compression instead of HMAC's
    /// two SHA-256 ones: about a fifth of the instructions on a CPU without
    /// SHA extensions.
    Blake3,
}

/// The context BLAKE3 derives a tenant key from a secret with.
const BLAKE3_TENANT_CONTEXT: &str = "idem 2026-12-01 tenant hash key v1";

/// How credential-derived tenants are hashed: plain SHA-256, HMAC-SHA256
/// or keyed BLAKE3 under a secret. A keyed form carries the number of its
/// key ([`next_key_number`]): the thread's [`RECENT`] tenants are found
/// again under the key that made them only.
#[derive(Clone)]
pub(crate) enum Hashing {
    Plain,
    /// HMAC-SHA256 keyed once: each tenant clones the keyed state, so the
    /// key's two padding blocks are not hashed again per request.
    Keyed(Hmac<Sha256>, u64),
    /// BLAKE3's keyed mode under this key.
    Blake3([u8; 32], u64),
}

/// A number for a key just prepared, never given to another (0 is the
/// plain form's, which has no key).
fn next_key_number() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// How many values each thread keeps with their tenants.
pub(crate) const RECENT_KEPT: usize = 4;

/// The longest value kept: a longer one is hashed every time.
pub(crate) const RECENT_VALUE_MAX: usize = 512;

/// One value a thread hashed lately, and its tenant.
pub(crate) struct RecentTenant {
    /// The number of the hashing's key (0: plain).
    pub(crate) key: u64,
    pub(crate) prefix: &'static str,
    pub(crate) value: Box<[u8]>,
    pub(crate) tenant: Arc<str>,
}

thread_local! {
    /// The values a thread hashed lately: a caller sends the same
    /// credential with request after request, and its tenant is then
    /// hashed once per thread, not once per request.
    pub(crate) static RECENT: std::cell::RefCell<Recent<RecentTenant, RECENT_KEPT>> =
        const { std::cell::RefCell::new(Recent::new()) };
}

impl std::fmt::Debug for Hashing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Hashing::Plain => "Plain",
            Hashing::Keyed(..) => "Keyed(<secret>)",
            Hashing::Blake3(..) => "Blake3(<secret>)",
        })
    }
}

impl Hashing {
    pub(crate) fn keyed(secret: &[u8]) -> Self {
        Self::keyed_as(TenantHash::HmacSha256, secret)
    }

    pub(crate) fn keyed_as(hash: TenantHash, secret: &[u8]) -> Self {
        match hash {
            TenantHash::HmacSha256 => match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
                Ok(mac) => Hashing::Keyed(mac, next_key_number()),
                // HMAC takes keys of every length: not reached.
                Err(_) => Hashing::Plain,
            },
            TenantHash::Blake3 => Hashing::Blake3(
                blake3::derive_key(BLAKE3_TENANT_CONTEXT, secret),
                next_key_number(),
            ),
        }
    }

    /// The number of this hashing's key (0: plain, which has none).
    pub(crate) fn key_number(&self) -> u64 {
        match self {
            Hashing::Plain => 0,
            Hashing::Keyed(_, number) | Hashing::Blake3(_, number) => *number,
        }
    }

    /// The tenant `make` makes of the raw `value` under `prefix`, taken
    /// from the thread's recent tenants when this hashing's key made it
    /// from the same bytes lately. `make` must be a function of the value,
    /// the prefix and this hashing only.
    pub(crate) fn recent(
        &self,
        prefix: &'static str,
        value: &[u8],
        make: impl FnOnce() -> String,
    ) -> Arc<str> {
        let key = self.key_number();
        // A thread past its thread-locals' end (a future dropped while the
        // thread exits) hashes every time.
        let found = RECENT.try_with(|recent| {
            recent.borrow().iter().find_map(|entry| {
                (entry.key == key && entry.prefix == prefix && *entry.value == *value)
                    .then(|| entry.tenant.clone())
            })
        });
        if let Ok(Some(tenant)) = found {
            return tenant;
        }
        let tenant: Arc<str> = make().into();
        if value.len() <= RECENT_VALUE_MAX {
            let _ = RECENT.try_with(|recent| {
                recent.borrow_mut().push(RecentTenant {
                    key,
                    prefix,
                    value: value.into(),
                    tenant: tenant.clone(),
                });
            });
        }
        tenant
    }

    /// `prefix` + the hex digest of `value`.
    pub(crate) fn tenant(&self, prefix: &str, value: &[u8]) -> String {
        self.tenant_of_pieces(prefix, &[value])
    }

    /// `prefix` + the hex digest of the concatenated `pieces`.
    pub(crate) fn tenant_of_pieces(&self, prefix: &str, pieces: &[&[u8]]) -> String {
        let digest: [u8; 32] = match self {
            Hashing::Plain => {
                let mut hasher = Sha256::new();
                pieces.iter().for_each(|piece| hasher.update(piece));
                hasher.finalize().into()
            }
            Hashing::Keyed(keyed, _) => {
                let mut mac = keyed.clone();
                pieces.iter().for_each(|piece| mac.update(piece));
                mac.finalize().into_bytes().into()
            }
            Hashing::Blake3(key, _) => {
                // Short pieces (a typical credential) are joined on the
                // stack and hashed in one call: each `update` has a fixed
                // cost of its own.
                let mut joined = [0u8; 256];
                let total: usize = pieces.iter().map(|piece| piece.len()).sum();
                if total <= joined.len() {
                    let mut at = 0;
                    for piece in pieces {
                        joined[at..at + piece.len()].copy_from_slice(piece);
                        at += piece.len();
                    }
                    *blake3::keyed_hash(key, &joined[..total]).as_bytes()
                } else {
                    let mut hasher = blake3::Hasher::new_keyed(key);
                    pieces.iter().for_each(|piece| {
                        hasher.update(piece);
                    });
                    *hasher.finalize().as_bytes()
                }
            }
        };
        let mut out = String::with_capacity(prefix.len() + 64);
        out.push_str(prefix);
        idem_core::push_hex(&mut out, &digest);
        out
    }
}

/// A keyed tenant hash, its key prepared once: for tenants resolved
/// elsewhere (a verified token's claim, say) that should be stored the way
/// the keyed extractors store theirs.
#[derive(Debug, Clone)]
pub struct TenantHasher(Hashing);

impl TenantHasher {
    /// The `hash` form under `secret`, shared by every instance that serves
    /// the same records.
    pub fn new(hash: TenantHash, secret: &[u8]) -> Self {
        Self(Hashing::keyed_as(hash, secret))
    }

    /// `prefix` + the hex keyed hash of `value`.
    pub fn tenant(&self, prefix: &str, value: &[u8]) -> String {
        self.0.tenant(prefix, value)
    }
}
