//! A stored response's headers as a record keeps them, in the four-byte
//! form or the compact one.

use bytes::Bytes;
use idem_core::{HeaderName, StoreError};

use crate::errors::corrupt;

/// A stored response's headers as a record keeps them: each name and
/// value led by its length (four bytes, big-endian).
#[cfg(test)]
pub(crate) fn encode_headers(headers: &[(HeaderName, Bytes)]) -> Vec<u8> {
    encode_headers_as(headers, false)
}

/// [`encode_headers`], or with `compact` in the compact form (see
/// [`COMPACT_HEADERS`]).
#[cfg(test)]
pub(crate) fn encode_headers_as(headers: &[(HeaderName, Bytes)], compact: bool) -> Vec<u8> {
    // Sized once: growing from empty reallocates four or five times.
    let size = headers
        .iter()
        .map(|(name, value)| 8 + name.as_str().len() + value.len());
    let mut out = Vec::with_capacity(size.sum::<usize>() + 1);
    let _ = write_headers(&mut out, headers, compact);
    out
}

/// The first byte of a headers field in the compact form: each name and
/// value led by its length in one byte, or by 255 and then four bytes
/// (big-endian) when it is 255 or longer. Gateway-shaped headers
/// (`content-type` and `location`) take 10 bytes fewer than in the
/// four-byte form and so stay within the 64 bytes a value of Redis'
/// compact hash may take. A field in the four-byte form never begins with
/// this byte: it begins with the high byte of a header name's length,
/// and a header name is far shorter than 16 MiB (an empty field is empty
/// in either form).
pub(crate) const COMPACT_HEADERS: u8 = 1;

/// Writes a response's headers into `out` as a record keeps them: in the
/// four-byte form of [`encode_headers`], or with `compact` in the form of
/// [`COMPACT_HEADERS`].
pub(crate) fn write_headers(
    out: &mut dyn std::io::Write,
    headers: &[(HeaderName, Bytes)],
    compact: bool,
) -> std::io::Result<()> {
    if compact && !headers.is_empty() {
        out.write_all(&[COMPACT_HEADERS])?;
    }
    for (name, value) in headers {
        for part in [name.as_str().as_bytes(), value.as_ref()] {
            let length = u32::try_from(part.len()).unwrap_or(u32::MAX);
            match u8::try_from(length) {
                Ok(short) if compact && short < u8::MAX => out.write_all(&[short])?,
                _ => {
                    if compact {
                        out.write_all(&[u8::MAX])?;
                    }
                    out.write_all(&length.to_be_bytes())?;
                }
            }
            out.write_all(part)?;
        }
    }
    Ok(())
}

/// A record's headers field, in either form (see [`COMPACT_HEADERS`]).
pub(crate) fn decode_headers(raw: &[u8]) -> Result<Vec<(HeaderName, Bytes)>, StoreError> {
    fn four_bytes(raw: &mut &[u8]) -> Result<usize, StoreError> {
        let (length, rest) = raw
            .split_first_chunk::<4>()
            .ok_or_else(|| corrupt("truncated headers"))?;
        *raw = rest;
        Ok(u32::from_be_bytes(*length) as usize)
    }
    fn take<'a>(raw: &mut &'a [u8], compact: bool) -> Result<&'a [u8], StoreError> {
        let length = match raw.split_first() {
            Some((&short, rest)) if compact && short < u8::MAX => {
                *raw = rest;
                usize::from(short)
            }
            Some((_, rest)) if compact => {
                *raw = rest;
                four_bytes(raw)?
            }
            _ => four_bytes(raw)?,
        };
        if raw.len() < length {
            return Err(corrupt("truncated headers"));
        }
        let (part, rest) = raw.split_at(length);
        *raw = rest;
        Ok(part)
    }
    let (compact, mut raw) = match raw.split_first() {
        Some((&COMPACT_HEADERS, rest)) => (true, rest),
        _ => (false, raw),
    };
    let mut headers = Vec::new();
    while !raw.is_empty() {
        let (name, value) = (take(&mut raw, compact)?, take(&mut raw, compact)?);
        // Only names a header map held are stored; one that does not
        // parse is left out of the replay, as the layer always did.
        if let Ok(name) = HeaderName::from_bytes(name) {
            headers.push((name, Bytes::copy_from_slice(value)));
        }
    }
    Ok(headers)
}
