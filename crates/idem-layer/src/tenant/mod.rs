//! Where the tenant of a request comes from.
//!
//! The tenant is the first part of every scope (IDEM-01): two tenants using
//! the same key never see each other's records. It must come from the
//! authenticated caller, never from the key.
//!
//! What each extractor keeps (the tenant is stored in every record, shown
//! by the records API and put in [`IdempotencyContext`](crate::IdempotencyContext)):
//!
//! | extractor | the tenant stored | use it when |
//! |---|---|---|
//! | [`TenantFromExtension`] (default) | the extension's `Display` form | your auth middleware resolved the caller to an id |
//! | [`TenantFromHeader::new`] / [`from_static`](TenantFromHeader::from_static) | the header value as sent | a trusted proxy sets a plain account id |
//! | [`TenantFromHeader::hashed`] | `hdr:` + a keyed hash of the value | the header is a credential (an API key) |
//! | [`TenantFromAuthorization`] | `auth:` + a hash of the normalized `Authorization` value, keyed with [`keyed`](TenantFromAuthorization::keyed) (HMAC-SHA256) or [`keyed_as`](TenantFromAuthorization::keyed_as) ([`TenantHash`]) | the credential is the caller |
//! | a closure `Fn(&http::request::Parts) -> Option<String>` | what it returns | anything else |
//!
//! A header that carries a secret must not be stored as it is: use the
//! hashed forms, with a secret key shared by every instance (a plain
//! SHA-256 of a short password is reversible by a dictionary).
//!
//! The hashing extractors ([`TenantFromAuthorization`] in each form and
//! [`TenantFromHeader::hashed`]) hash a caller's credential once per
//! thread, not once per request: each thread keeps the last four values
//! it hashed (of at most 512 bytes each) with their tenants, found again
//! only by the same bytes under the same key. Those few values stay in the
//! process's memory until newer ones replace them, as the requests that
//! carried them did while they were served.
//!
//! ```
//! use http::request::Parts;
//! use idem_layer::{IdempotencyLayer, TenantFromHeader};
//! use idem_memory::MemoryStore;
//!
//! // A header with an API key: stored only as a keyed hash.
//! let secret = b"a deployment secret shared by every instance".to_vec();
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .tenant(TenantFromHeader::hashed("x-api-key", secret));
//!
//! // A closure: write the argument's type out, or inference fails (E0282).
//! let layer = IdempotencyLayer::new(MemoryStore::new()).tenant(|parts: &Parts| {
//!     parts.headers.get("x-account").and_then(|v| v.to_str().ok()).map(str::to_owned)
//! });
//! ```

use std::{fmt::Display, sync::Arc};

use http::{HeaderName, request::Parts};

mod hash;

pub(crate) use hash::Hashing;
pub use hash::{TenantHash, TenantHasher};

/// The tenant used for keyed requests without one, when anonymous callers
/// are allowed. It cannot be produced by the built-in extractors (they
/// never return text with a NUL).
pub const ANONYMOUS_TENANT: &str = "\0anonymous";

/// Determines the tenant of a request.
///
/// Return `None` when the caller is not identified: the layer then answers
/// `401 idempotency_tenant_missing`, or uses [`ANONYMOUS_TENANT`] when
/// anonymous callers are allowed. Any `Fn(&Parts) -> Option<String>`
/// closure is an extractor.
pub trait TenantExtractor: Send + Sync + 'static {
    /// The tenant of the request, if the caller is identified.
    fn tenant(&self, parts: &Parts) -> Option<String>;

    /// [`tenant`](Self::tenant) as shared text, which is what the layer
    /// asks for: the scope, the record and the handler's context share it.
    /// The default wraps `tenant`'s answer; the built-in extractors answer
    /// a caller's repeated credential without a copy.
    fn shared_tenant(&self, parts: &Parts) -> Option<Arc<str>> {
        self.tenant(parts).map(Arc::from)
    }

    /// Whether the request names its caller more than once (a header the
    /// extractor reads, repeated): the layer then treats the caller as
    /// unidentified (`401 idempotency_tenant_missing`), never as the first
    /// value's tenant nor as the anonymous one, since a server behind it may
    /// read another copy. The built-in header extractors say so; the
    /// default says no.
    fn ambiguous(&self, parts: &Parts) -> bool {
        let _ = parts;
        false
    }
}

/// Whether `headers` hold more than one `name` field.
fn repeated(parts: &Parts, name: &http::HeaderName) -> bool {
    parts.headers.get_all(name).iter().nth(1).is_some()
}

impl<F> TenantExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn tenant(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// A tenant identity for request extensions: put it there in your
/// authentication middleware (before the layer) and the default extractor,
/// [`TenantFromExtension<Tenant>`], finds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

impl Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads the tenant from a request extension of type `T` (its `Display`
/// form). The layer's default is `TenantFromExtension<Tenant>`.
#[derive(Debug)]
pub struct TenantFromExtension<T>(std::marker::PhantomData<fn() -> T>);

impl<T> TenantFromExtension<T> {
    /// An extractor for extension type `T`.
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T> Default for TenantFromExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Display + Send + Sync + 'static> TenantExtractor for TenantFromExtension<T> {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        parts
            .extensions
            .get::<T>()
            .map(ToString::to_string)
            .filter(|t| !t.is_empty())
    }
}

/// Reads the tenant from a request header set by a trusted proxy or
/// authentication layer. An empty or non-UTF-8 value counts as missing.
/// [`new`](Self::new) keeps the value as it is; [`hashed`](Self::hashed)
/// keeps only a keyed hash of it (for headers that carry a credential).
#[derive(Debug, Clone)]
pub struct TenantFromHeader {
    name: HeaderName,
    hashing: Option<Hashing>,
}

impl TenantFromHeader {
    /// An extractor for header `name`; the tenant is the value as sent.
    pub fn new(name: HeaderName) -> Self {
        Self {
            name,
            hashing: None,
        }
    }

    /// [`new`](Self::new) with a header name known when the program is
    /// written. Panics if `name` is not a valid lowercase header name, as
    /// [`HeaderName::from_static`] does.
    pub fn from_static(name: &'static str) -> Self {
        Self::new(HeaderName::from_static(name))
    }

    /// An extractor for a header that carries a credential (an API key):
    /// the tenant is `hdr:` + the HMAC-SHA256 of the value under `secret`,
    /// so no record, log line or records API answer holds the credential or
    /// a hash a dictionary could reverse. Every instance serving the same
    /// records must use the same secret. Panics if `name` is not a valid
    /// lowercase header name.
    pub fn hashed(name: &'static str, secret: impl Into<Vec<u8>>) -> Self {
        Self::hashed_as(name, TenantHash::HmacSha256, secret)
    }

    /// [`hashed`](Self::hashed) with the keyed hash `hash` (see
    /// [`TenantHash`] before changing it on a store that holds records).
    pub fn hashed_as(name: &'static str, hash: TenantHash, secret: impl Into<Vec<u8>>) -> Self {
        Self {
            name: HeaderName::from_static(name),
            hashing: Some(Hashing::keyed_as(hash, &secret.into())),
        }
    }
}

impl TenantExtractor for TenantFromHeader {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        self.shared_tenant(parts).map(|tenant| tenant.to_string())
    }

    fn ambiguous(&self, parts: &Parts) -> bool {
        repeated(parts, &self.name)
    }

    fn shared_tenant(&self, parts: &Parts) -> Option<Arc<str>> {
        let value = parts.headers.get(&self.name)?.to_str().ok()?.trim();
        if value.is_empty() {
            return None;
        }
        Some(match &self.hashing {
            None => value.into(),
            Some(hashing) => hashing.recent("hdr:", value.as_bytes(), || {
                hashing.tenant("hdr:", value.as_bytes())
            }),
        })
    }
}

/// Uses a hash of the `Authorization` value as the tenant, so each
/// credential gets its own records without the layer keeping the
/// credential itself.
///
/// The value is normalized first: the scheme is case-insensitive and the
/// whitespace between scheme and credentials does not matter, so
/// `bearer x` and `Bearer  x` are one caller. The hash is a plain SHA-256;
/// [`keyed`](Self::keyed) gives an extractor whose hash is an HMAC under a
/// deployment secret, which a dictionary cannot reverse (recommended: a
/// Basic password or a short token is otherwise recoverable from a record).
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantFromAuthorization;

impl TenantFromAuthorization {
    /// The plain SHA-256 form.
    pub fn new() -> Self {
        Self
    }

    /// The HMAC-SHA256 form under `secret`, shared by every instance that
    /// serves the same records.
    pub fn keyed(secret: impl Into<Vec<u8>>) -> TenantFromKeyedAuthorization {
        Self::keyed_as(TenantHash::HmacSha256, secret)
    }

    /// The keyed form with the hash `hash` (see [`TenantHash`] before
    /// changing it on a store that holds records).
    pub fn keyed_as(hash: TenantHash, secret: impl Into<Vec<u8>>) -> TenantFromKeyedAuthorization {
        TenantFromKeyedAuthorization {
            hashing: Hashing::keyed_as(hash, &secret.into()),
        }
    }
}

/// [`TenantFromAuthorization`] with a keyed hash: the tenant is `auth:` +
/// the HMAC-SHA256 (or keyed BLAKE3, see [`TenantHash`]) of the normalized
/// `Authorization` value under a secret. Made by
/// [`TenantFromAuthorization::keyed`] and [`keyed_as`](TenantFromAuthorization::keyed_as).
#[derive(Debug, Clone)]
pub struct TenantFromKeyedAuthorization {
    hashing: Hashing,
}

/// The tenant of the `Authorization` value, hashed as `hashing` says: the
/// hash of `scheme credentials` with the scheme lowercased and one space
/// between, fed to the hash in its pieces (no copy of the value is made).
fn authorization_tenant(parts: &Parts, hashing: &Hashing) -> Option<Arc<str>> {
    let value = parts
        .headers
        .get(http::header::AUTHORIZATION)?
        .as_bytes()
        .trim_ascii();
    if value.is_empty() {
        return None;
    }
    Some(hashing.recent("auth:", value, || normalized_tenant(value, hashing)))
}

/// [`authorization_tenant`] of a trimmed, non-empty value.
fn normalized_tenant(value: &[u8], hashing: &Hashing) -> String {
    let split = value
        .iter()
        .position(|b| b.is_ascii_whitespace())
        .unwrap_or(value.len());
    let (scheme, rest) = value.split_at(split);
    let rest = rest.trim_ascii();
    // Schemes are short words (`Bearer`, `Basic`): lowercased on the stack.
    let mut short = [0u8; 32];
    let long: Vec<u8>;
    let scheme: &[u8] = match short.get_mut(..scheme.len()) {
        Some(lower) => {
            lower.copy_from_slice(scheme);
            lower.make_ascii_lowercase();
            lower
        }
        None => {
            long = scheme.to_ascii_lowercase();
            &long
        }
    };
    let separator: &[u8] = if rest.is_empty() { b"" } else { b" " };
    hashing.tenant_of_pieces("auth:", &[scheme, separator, rest])
}

impl TenantExtractor for TenantFromAuthorization {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        self.shared_tenant(parts).map(|tenant| tenant.to_string())
    }

    fn shared_tenant(&self, parts: &Parts) -> Option<Arc<str>> {
        authorization_tenant(parts, &Hashing::Plain)
    }

    fn ambiguous(&self, parts: &Parts) -> bool {
        repeated(parts, &http::header::AUTHORIZATION)
    }
}

impl TenantExtractor for TenantFromKeyedAuthorization {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        self.shared_tenant(parts).map(|tenant| tenant.to_string())
    }

    fn shared_tenant(&self, parts: &Parts) -> Option<Arc<str>> {
        authorization_tenant(parts, &self.hashing)
    }

    fn ambiguous(&self, parts: &Parts) -> bool {
        repeated(parts, &http::header::AUTHORIZATION)
    }
}

/// `prefix` + the hex HMAC-SHA256 of `value` under `secret`: the form the
/// keyed extractors store, for tenants resolved elsewhere (a verified
/// token's claim, say) that should be kept the same way.
///
/// Prepares the key at every call: [`TenantHasher`] prepares it once.
pub fn keyed_tenant(secret: &[u8], prefix: &str, value: &[u8]) -> String {
    Hashing::keyed(secret).tenant(prefix, value)
}

#[cfg(test)]
mod tests {
    use super::{
        hash::{RECENT, RECENT_KEPT, RECENT_VALUE_MAX},
        *,
    };

    /// The head of a request with this one header.
    fn head(name: &str, value: &str) -> Parts {
        http::Request::get("/")
            .header(name, value)
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    /// The tenant of this `Authorization` value under `hashing`.
    fn tenant_of(value: &str, hashing: &Hashing) -> Option<String> {
        authorization_tenant(&head("authorization", value), hashing)
            .map(|tenant| tenant.to_string())
    }

    /// Keyed tenants are HMAC-SHA256 exactly (RFC 4231, cases 1 and 6: a
    /// short key and one longer than a block), however the keyed state is
    /// reused: stored tenants must not change between versions.
    /// The tenant of an `Authorization` value is pinned (Python's
    /// `hashlib` and `hmac`): the scheme lowercased, one space, the
    /// credentials; a scheme longer than the stack buffer hashes the same
    /// way; a value of only spaces is no tenant.
    #[test]
    fn authorization_tenants_are_pinned() {
        let plain = Hashing::Plain;
        let bearer = "auth:46e38e9ce4c432c3ca84636e27ba624263cfe0e4ad78886dcbad9942a0f3f36a";
        for spelling in ["Bearer abc", "  BEARER \t abc ", "bearer abc"] {
            assert_eq!(
                tenant_of(spelling, &plain).as_deref(),
                Some(bearer),
                "{spelling:?}"
            );
        }
        assert_eq!(
            tenant_of("Basic", &plain).as_deref(),
            Some("auth:fbb7b5bf4ca348eeeebf8cc3660712859a5a1fbf18e83217a57ce203fb51d5c2")
        );
        let long = "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX t";
        assert_eq!(
            tenant_of(long, &plain).as_deref(),
            Some("auth:c3137ac7d0bd33df55becb487e2e4c297917bfb9a777632ad0a49bd1e92f895d")
        );
        assert_eq!(
            tenant_of("Bearer abc", &Hashing::keyed(&[b'k'; 20])).as_deref(),
            Some("auth:2cf1e69c4f0007c12d01c8a518e68eb92faa044a522bb8d957671c0f0f493815")
        );
        assert_eq!(tenant_of("   ", &plain), None);
    }

    proptest::proptest! {
        /// Any spelling of one credential is one tenant (scheme in any
        /// case, any spaces or tabs around and between), and another
        /// credential is another tenant, in every hash form.
        #[test]
        fn spellings_of_a_credential_are_one_tenant(
            scheme in "[A-Za-z][A-Za-z0-9-]{0,11}",
            credential in "[!-~]{1,24}",
            other in "[!-~]{1,24}",
            (lead, mid, trail) in ("[ \t]{0,3}", "[ \t]{1,3}", "[ \t]{0,3}"),
        ) {
            let canonical = format!("{} {credential}", scheme.to_ascii_lowercase());
            let spelled = format!("{lead}{}{mid}{credential}{trail}", scheme.to_ascii_uppercase());
            for hashing in [
                Hashing::Plain,
                Hashing::keyed(b"a secret"),
                Hashing::keyed_as(TenantHash::Blake3, b"a secret"),
            ] {
                let expected = tenant_of(&canonical, &hashing);
                proptest::prop_assert!(expected.is_some());
                proptest::prop_assert_eq!(tenant_of(&spelled, &hashing), expected.clone());
                if other != credential {
                    let another = format!("{scheme} {other}");
                    proptest::prop_assert_ne!(tenant_of(&another, &hashing), expected);
                }
            }
        }
    }

    /// The keyed BLAKE3 form is BLAKE3's keyed mode over the same
    /// normalized value, under the documented derived key, and pinned:
    /// stored tenants must not change between versions.
    #[test]
    fn blake3_tenants_are_pinned() {
        let secret = [b'k'; 20];
        let hasher = TenantHasher::new(TenantHash::Blake3, &secret);
        let key = blake3::derive_key("idem 2026-12-01 tenant hash key v1", &secret);
        let expected = format!("auth:{}", blake3::keyed_hash(&key, b"bearer abc").to_hex());
        let extractor = TenantFromAuthorization::keyed_as(TenantHash::Blake3, secret);
        for spelling in ["Bearer abc", "  BEARER \t abc ", "bearer abc"] {
            assert_eq!(
                extractor.tenant(&head("authorization", spelling)),
                Some(expected.clone())
            );
        }
        assert_eq!(hasher.tenant("auth:", b"bearer abc"), expected);
        assert_eq!(
            expected,
            "auth:2462c2433026a00f581d309e2606accfc642475861615e23f424e7c37b85dd35"
        );
        // Unlike the HMAC form, and unlike another secret's.
        assert_ne!(
            TenantHasher::new(TenantHash::HmacSha256, &secret).tenant("auth:", b"bearer abc"),
            expected
        );
        assert_ne!(
            TenantHasher::new(TenantHash::Blake3, &[b'j'; 20]).tenant("auth:", b"bearer abc"),
            expected
        );
        let header = TenantFromHeader::hashed_as("x-api-key", TenantHash::Blake3, secret);
        assert_eq!(
            header.tenant(&head("x-api-key", "abc")),
            Some(hasher.tenant("hdr:", b"abc"))
        );
        // Credentials around the length where the pieces stop being joined
        // on the stack hash as one text all the same.
        for len in [240, 248, 249, 250, 256, 300, 1200] {
            let token = "t".repeat(len);
            let value = format!("bearer {token}");
            let expected = format!(
                "auth:{}",
                blake3::keyed_hash(&key, value.as_bytes()).to_hex()
            );
            assert_eq!(
                extractor.tenant(&head("authorization", &format!("Bearer {token}"))),
                Some(expected),
                "{len}"
            );
        }
    }

    /// The thread's recent tenants answer as hashing would: for each form,
    /// a value seen before gives its own tenant again, also after other
    /// values pushed it out, and only under the key that made it (two
    /// extractors keyed apart, or one key used by a header and by
    /// `Authorization` with the same bytes, each get their own).
    #[test]
    fn recent_tenants_answer_as_hashing_does() {
        let forms = [
            Hashing::Plain,
            Hashing::keyed(b"one secret"),
            Hashing::keyed(b"another secret"),
            Hashing::keyed_as(TenantHash::Blake3, b"one secret"),
            Hashing::keyed_as(TenantHash::Blake3, b"another secret"),
        ];
        let values: Vec<String> = (0..2 * RECENT_KEPT)
            .map(|n| format!("Bearer t{n}"))
            .collect();
        let mut seen = std::collections::HashSet::new();
        // Each value under every form in turn (the one before kept the
        // same bytes), twice in a row (the second found kept).
        for round in 0..2 {
            for value in &values {
                for hashing in &forms {
                    let bare = value.strip_prefix("Bearer ").expect("a bearer value");
                    let expected =
                        hashing.tenant_of_pieces("auth:", &[b"bearer", b" ", bare.as_bytes()]);
                    for _ in 0..2 {
                        assert_eq!(
                            tenant_of(value, hashing).as_deref(),
                            Some(expected.as_str()),
                            "{value} in round {round}"
                        );
                    }
                    seen.insert(expected);
                }
            }
        }
        // Every form and value made a tenant of its own.
        assert_eq!(seen.len(), forms.len() * values.len());

        // One key, the same bytes, two prefixes.
        let hashing = Hashing::keyed(b"shared");
        let header = TenantFromHeader {
            name: HeaderName::from_static("x-api-key"),
            hashing: Some(hashing.clone()),
        };
        let authorization = TenantFromKeyedAuthorization {
            hashing: hashing.clone(),
        };
        for _ in 0..2 {
            assert_eq!(
                header.tenant(&head("x-api-key", "abc")),
                Some(hashing.tenant("hdr:", b"abc"))
            );
            assert_eq!(
                authorization.tenant(&head("authorization", "abc")),
                Some(hashing.tenant("auth:", b"abc"))
            );
        }
    }

    /// A value longer than [`RECENT_VALUE_MAX`] is hashed every time and
    /// never kept; a shorter one is kept after its first use.
    #[test]
    fn long_values_are_not_kept() {
        let hashing = Hashing::keyed(b"kept or not");
        let kept = |value: &[u8]| {
            RECENT.with_borrow(|recent| {
                recent
                    .iter()
                    .any(|entry| entry.key == hashing.key_number() && *entry.value == *value)
            })
        };
        let long = format!("Bearer {}", "x".repeat(RECENT_VALUE_MAX));
        let short = "Bearer short";
        for value in [long.as_str(), short] {
            assert!(tenant_of(value, &hashing).is_some());
        }
        assert!(!kept(long.as_bytes()));
        assert!(kept(short.as_bytes()));
    }

    #[test]
    fn keyed_tenants_are_rfc_4231_hmac_sha256() {
        assert_eq!(
            keyed_tenant(&[0x0b; 20], "p:", b"Hi There"),
            "p:b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        let long = Hashing::keyed(&[0xaa; 131]);
        for _ in 0..2 {
            assert_eq!(
                long.tenant(
                    "",
                    b"Test Using Larger Than Block-Size Key - Hash Key First"
                ),
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
            );
        }
    }
}
