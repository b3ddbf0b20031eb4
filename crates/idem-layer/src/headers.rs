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

/// The name under which a response's trailers are kept in its stored
/// headers: one entry per trailer field, its value `name:value` (a field
/// name holds no colon). A handler's own header of this name is never
/// stored, so no stored header is taken for a trailer.
pub(crate) const STORED_TRAILER: HeaderName = HeaderName::from_static("idem-trailer");

/// Appends `trailers` to stored headers, as [`STORED_TRAILER`] entries.
pub(crate) fn store_trailers(trailers: &HeaderMap, stored: &mut Vec<(HeaderName, bytes::Bytes)>) {
    for (name, value) in trailers {
        let mut entry = Vec::with_capacity(name.as_str().len() + 1 + value.len());
        entry.extend_from_slice(name.as_str().as_bytes());
        entry.push(b':');
        entry.extend_from_slice(value.as_bytes());
        stored.push((STORED_TRAILER, bytes::Bytes::from(entry)));
    }
}

/// Takes the [`STORED_TRAILER`] entries out of stored headers: the
/// trailers they keep, in order (`None` when there are none).
pub(crate) fn take_trailers(stored: &mut Vec<(HeaderName, bytes::Bytes)>) -> Option<HeaderMap> {
    if !stored.iter().any(|(name, _)| *name == STORED_TRAILER) {
        return None;
    }
    let mut trailers = HeaderMap::new();
    stored.retain(|(name, entry)| {
        if *name != STORED_TRAILER {
            return true;
        }
        let split = entry.iter().position(|byte| *byte == b':');
        if let Some(at) = split
            && let Ok(name) = HeaderName::from_bytes(&entry[..at])
            && let Ok(value) = http::HeaderValue::from_maybe_shared(entry.slice(at + 1..))
        {
            trailers.append(name, value);
        }
        false
    });
    Some(trailers)
}

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

/// A response header of idem's own by which a handler (or an upstream
/// behind the gateway) opts its response out of storage, whatever its
/// value: the layer removes it before the client sees the response,
/// records the outcome as not stored (the action ran, so the key stays
/// taken), and answers a retry `idempotency_response_not_stored`. The
/// response extension [`NoStore`] does the same. `Cache-Control: no-store`
/// does not: frameworks set it on every response.
pub const NO_STORE: HeaderName = HeaderName::from_static("idem-no-store");

/// A response extension that opts a response out of storage, as the
/// [`NO_STORE`] header does (for a handler behind the library layer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoStore;

/// Whether the response opted out of storage ([`NO_STORE`] or
/// [`NoStore`]); the header is removed either way, and so is
/// [`NOTHING_RAN`] (both are idem's own, never meant for the client).
pub(crate) fn opted_out(parts: &mut http::response::Parts) -> bool {
    parts.headers.remove(NOTHING_RAN);
    let header = parts.headers.remove(NO_STORE).is_some();
    header || parts.extensions.get::<NoStore>().is_some()
}

/// A response header of idem's own by which a handler, an extractor or an
/// upstream behind the gateway says **nothing ran**: the request was
/// refused before its endpoint began executing (a body that did not parse,
/// a field that failed validation). Whatever its value and status, the
/// layer releases the key and stores nothing, so a corrected retry with
/// the same key runs (Stripe's rule); the header is removed before the
/// client sees the response. Unmarked, a 4xx is an outcome and is stored.
/// The response extension [`NothingRan`] does the same; [`Validated`]
/// marks an axum extractor's rejections.
///
/// After a takeover (the attempt before may have acted), the key is
/// released for the same request only: the record stays bound to its
/// payload, and a corrected retry with another payload gets `422`.
pub const NOTHING_RAN: HeaderName = HeaderName::from_static("idem-nothing-ran");

/// A response extension that says nothing ran, as the [`NOTHING_RAN`]
/// header does (for a handler behind the library layer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NothingRan;

/// Whether the response says nothing ran ([`NOTHING_RAN`] or
/// [`NothingRan`]).
pub(crate) fn nothing_ran(parts: &http::response::Parts) -> bool {
    parts.headers.contains_key(NOTHING_RAN) || parts.extensions.get::<NothingRan>().is_some()
}

/// An axum extractor that marks the rejection of the extractor it wraps
/// as [`NothingRan`]: a request whose body does not parse (`Json`'s `422`
/// or `400`) releases its key instead of spending it, so the corrected
/// retry with the same key runs. The rejection also carries the
/// [`NOTHING_RAN`] header, so a gateway in front of the service hears it
/// too (the layer and the gateway remove it before the client sees the
/// answer).
///
/// ```
/// use axum::{Json, http::StatusCode};
/// use idem_layer::Validated;
///
/// async fn create(Validated(Json(order)): Validated<Json<serde_json::Value>>) -> StatusCode {
///     let _ = order;
///     StatusCode::CREATED
/// }
/// ```
#[cfg(feature = "axum")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Validated<E>(pub E);

#[cfg(feature = "axum")]
impl<S, E> axum::extract::FromRequest<S> for Validated<E>
where
    S: Send + Sync,
    E: axum::extract::FromRequest<S>,
{
    type Rejection = axum::response::Response;

    async fn from_request(
        request: http::Request<axum::body::Body>,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        use axum::response::IntoResponse;
        match E::from_request(request, state).await {
            Ok(inner) => Ok(Self(inner)),
            Err(rejection) => {
                let mut response = rejection.into_response();
                response.extensions_mut().insert(NothingRan);
                response
                    .headers_mut()
                    .insert(NOTHING_RAN, http::HeaderValue::from_static("1"));
                Err(response)
            }
        }
    }
}

/// The request header that carries the records API's admin credential. A
/// proxy in front of an upstream removes it before forwarding: the
/// credential is the proxy's own.
pub const ADMIN_TOKEN: HeaderName = HeaderName::from_static("x-idem-admin-token");
