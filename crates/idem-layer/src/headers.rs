//! The protocol's header names and the reading of `Idempotency-Key`.

use http::{HeaderMap, HeaderName, header};
use idem_core::{IdempotencyKey, KeyError};

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY: HeaderName =
    HeaderName::from_static(idem_core::protocol::IDEMPOTENCY_KEY);
/// Added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName =
    HeaderName::from_static(idem_core::protocol::IDEMPOTENT_REPLAYED);

/// Hop-by-hop header fields (RFC 9110 section 7.6.1): they describe one
/// connection, so they are neither replayed nor forwarded by a proxy.
pub const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The request's key: `None` without one; a repeated or malformed key
/// is an error.
pub(crate) fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).into_iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse(value.as_bytes()).map(Some)
}

/// The request header that carries the records API's admin credential. A
/// proxy in front of an upstream removes it before forwarding: the
/// credential is the proxy's own.
pub const ADMIN_TOKEN: HeaderName = HeaderName::from_static("x-idem-admin-token");
