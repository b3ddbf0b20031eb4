//! A replay never sends a content coding the retry cannot read.
//!
//! The first request's `Accept-Encoding` may have let the handler (or an
//! upstream) compress its answer; the retry may accept less (`identity`,
//! or no `Accept-Encoding` at all: a client that names no coding is taken
//! to read none, as `curl` without `--compressed` does). A stored response
//! whose `Content-Encoding` the retry does not accept is decoded when the
//! coding is `gzip` (or `x-gzip`) or `deflate`, never past the storable
//! limit; otherwise the retry gets `406 idempotency_replay_not_acceptable`
//! (the action ran and is not run again).

use std::io::Read;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, header};

/// What a stored response may be replayed as to a retry with `accept`.
pub(crate) enum Fit {
    /// As it is.
    AsIs,
    /// Decoded: its body, without `Content-Encoding`.
    Decoded(Bytes),
    /// Neither: the coding it carries.
    Refused(String),
}

/// Whether `coding` is acceptable by an `Accept-Encoding` field's values
/// (RFC 9110 section 12.5.3: a listed coding or `*` with a non-zero
/// weight; no field at all accepts only `identity`).
fn accepted(coding: &str, accept: &HeaderMap) -> bool {
    let mut star = None;
    for item in accept
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
    {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or_default().trim();
        let weight = parts
            .filter_map(|param| {
                let (key, value) = param.split_once('=')?;
                key.trim()
                    .eq_ignore_ascii_case("q")
                    .then(|| value.trim().parse::<f32>().ok())?
            })
            .next()
            .unwrap_or(1.0);
        if name.eq_ignore_ascii_case(coding)
            || (coding == "gzip" && name.eq_ignore_ascii_case("x-gzip"))
        {
            return weight > 0.0;
        }
        if name == "*" {
            star = Some(weight > 0.0);
        }
    }
    star.unwrap_or(false)
}

/// How the stored response with `headers` and `body` fits a retry whose
/// request headers are `request`; `limit` bounds a decoded body.
pub(crate) fn fit(
    headers: &[(HeaderName, Bytes)],
    body: &Bytes,
    request: &HeaderMap,
    limit: usize,
) -> Fit {
    let codings: Vec<String> = headers
        .iter()
        .filter(|(name, _)| *name == header::CONTENT_ENCODING)
        .filter_map(|(_, value)| std::str::from_utf8(value).ok())
        .flat_map(|value| value.split(','))
        .map(|coding| coding.trim().to_ascii_lowercase())
        .filter(|coding| !coding.is_empty() && coding != "identity")
        .collect();
    if codings.is_empty() || codings.iter().all(|coding| accepted(coding, request)) {
        return Fit::AsIs;
    }
    // Codings apply in the order listed: undone last to first.
    let mut decoded = body.clone();
    for coding in codings.iter().rev() {
        match decode(coding, &decoded, limit) {
            Some(plain) => decoded = plain,
            None => return Fit::Refused(codings.join(", ")),
        }
    }
    Fit::Decoded(decoded)
}

/// `body` decoded from `coding`, at most `limit` bytes; `None` for a coding
/// it cannot decode, a body that does not decode, or one beyond the limit.
fn decode(coding: &str, body: &[u8], limit: usize) -> Option<Bytes> {
    let reader: Box<dyn Read + '_> = match coding {
        "gzip" | "x-gzip" => Box::new(flate2::read::MultiGzDecoder::new(body)),
        "deflate" => Box::new(flate2::read::ZlibDecoder::new(body)),
        _ => return None,
    };
    let mut plain = Vec::new();
    let bound = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    reader.take(bound).read_to_end(&mut plain).ok()?;
    (plain.len() <= limit).then(|| Bytes::from(plain))
}

/// Whether a stored header describes the coded body, so that a decoded
/// replay drops it: `Content-Encoding`, its `Content-Length`, and an
/// `ETag` (a validator of the coded representation).
pub(crate) fn describes_coding(name: &HeaderName) -> bool {
    *name == header::CONTENT_ENCODING || *name == header::CONTENT_LENGTH || *name == header::ETAG
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn request(accept: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(accept) = accept {
            headers.insert(header::ACCEPT_ENCODING, accept.parse().expect("value"));
        }
        headers
    }

    fn gzip(text: &[u8]) -> Bytes {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(text).expect("write");
        Bytes::from(encoder.finish().expect("finish"))
    }

    fn coded(coding: &str) -> Vec<(HeaderName, Bytes)> {
        vec![(
            header::CONTENT_ENCODING,
            Bytes::copy_from_slice(coding.as_bytes()),
        )]
    }

    #[test]
    fn accept_encoding_is_read_with_weights() {
        let accepts = |value: Option<&str>| accepted("gzip", &request(value));
        assert!(accepts(Some("gzip")));
        assert!(accepts(Some("br, GZIP;q=0.5")));
        assert!(accepts(Some("x-gzip")));
        assert!(accepts(Some("*")));
        assert!(!accepts(Some("gzip;q=0")));
        assert!(!accepts(Some("*, gzip;q=0")));
        assert!(!accepts(Some("identity")));
        assert!(!accepts(Some("*;q=0")));
        assert!(!accepts(None), "no field: identity only");
    }

    #[test]
    fn a_coding_the_retry_does_not_accept_is_decoded_within_the_limit() {
        let body = gzip(b"{\"order\":1}");
        assert!(matches!(
            fit(&coded("gzip"), &body, &request(Some("gzip")), 1024),
            Fit::AsIs
        ));
        match fit(&coded("gzip"), &body, &request(Some("identity")), 1024) {
            Fit::Decoded(plain) => assert_eq!(&plain[..], b"{\"order\":1}"),
            _ => panic!("decoded"),
        }
        // A body that inflates past the limit is refused, not decoded.
        let bomb = gzip(&vec![b'0'; 100_000]);
        assert!(matches!(
            fit(&coded("gzip"), &bomb, &request(None), 1024),
            Fit::Refused(_)
        ));
        assert!(matches!(
            fit(&coded("br"), &body, &request(None), 1024),
            Fit::Refused(coding) if coding == "br"
        ));
        assert!(matches!(
            fit(
                &coded("gzip"),
                &Bytes::from_static(b"not gzip"),
                &request(None),
                1024
            ),
            Fit::Refused(_)
        ));
        assert!(matches!(
            fit(&coded("identity"), &body, &request(None), 1024),
            Fit::AsIs
        ));
    }
}
