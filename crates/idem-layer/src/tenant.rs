//! Where the tenant of a request comes from.
//!
//! The tenant is the first part of every scope (IDEM-01): two tenants using
//! the same key never see each other's records. It must come from the
//! authenticated caller, never from the key.

use std::fmt::Display;

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

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
#[derive(Debug, Clone)]
pub struct TenantFromHeader(HeaderName);

impl TenantFromHeader {
    /// An extractor for header `name`.
    pub fn new(name: HeaderName) -> Self {
        Self(name)
    }
}

impl TenantExtractor for TenantFromHeader {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        let value = parts.headers.get(&self.0)?.to_str().ok()?.trim();
        (!value.is_empty()).then(|| value.to_owned())
    }
}

/// Uses the SHA-256 (hex) of the `Authorization` value as the tenant, so
/// each credential gets its own records without the layer keeping the
/// credential itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantFromAuthorization;

impl TenantExtractor for TenantFromAuthorization {
    fn tenant(&self, parts: &Parts) -> Option<String> {
        let value = parts.headers.get(http::header::AUTHORIZATION)?.as_bytes();
        if value.trim_ascii().is_empty() {
            return None;
        }
        let digest = Sha256::digest(value);
        let mut hex = String::with_capacity(64);
        for byte in digest {
            hex.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
            hex.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
        }
        Some(format!("auth:{hex}"))
    }
}
