//! The default request fingerprint.
//!
//! A hash (SHA-256 by default, or BLAKE3: see [`FingerprintFormat`]) over,
//! each part length-prefixed: the operation, the request path,
//! the query string, the configured headers (default `content-type`; every value, in order)
//! and the body. A body whose `content-type` is `application/json` or ends
//! in `+json` is canonicalized first (RFC 8785), so key order, whitespace
//! and number spelling do not matter; a body that claims JSON but does not
//! parse is hashed as raw bytes.
//!
//! The JSON body is hashed in its canonical form without writing the
//! canonical text out: one pass over serde_json's parser writes tagged,
//! length-prefixed tokens with object members in RFC 8785 order (UTF-16
//! code units of the key) and numbers in their RFC 8785 spelling
//! (ECMAScript `Number.prototype.toString`, via `ryu-js`), with one
//! exception: RFC 8785 rounds every number to an IEEE 754 double, so
//! `10000000000000001` and `10000000000000000` would be one payload and a
//! changed amount would replay the first. A number literal whose exact
//! value is not the exact value of its double's RFC 8785 spelling (it has
//! more digits than a double keeps) is hashed by its exact decimal value,
//! under a tag no RFC 8785 spelling gets. So two numbers that differ in
//! value never share a fingerprint, `1.0000000000000001e16` and
//! `10000000000000001` do, and every number a JSON serializer writes (its
//! own shortest spelling) is hashed as before: fingerprints made before
//! this rule stay valid. Otherwise two bodies get the same fingerprint
//! exactly when their RFC 8785 forms are equal; the tests check this
//! against the `serde_json_canonicalizer` crate, which [`canonical_json`]
//! uses to produce the canonical text itself. A repeated
//! key, which RFC 8785 does not allow, makes the body raw bytes, as the
//! canonicalizer does. Skipping the text and the `Value` tree makes this
//! several times faster than canonicalizing.
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

mod json;

pub use json::{canonical_json, is_json};
pub(crate) use json::{canonical_tokens, canonical_tokens_into};

pub(crate) fn update_part(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// How the default fingerprint hashes a request: the same length-prefixed
/// parts (see the module docs) under one of two hash functions.
///
/// Every version that knows [`Blake3`](Self::Blake3) *reads* both: a layer
/// whose reservation meets a record with another fingerprint tries the
/// other format before it answers `422`, so records written in either
/// format replay. What a layer *writes* is its
/// [`Fingerprints::format`](crate::settings::Fingerprints::format).
/// A version before this one reads only [`Sha256`](Self::Sha256) and
/// answers `422 idempotency_conflict` to a retry whose record is in
/// BLAKE3, so switch writers to BLAKE3 only once every instance sharing
/// the store runs a version that reads it.
///
/// The contract (SPEC §2) names SHA-256, the default; BLAKE3 replaces it
/// the way a custom fingerprint function may, over the same parts, so
/// every equivalence the contract asks for holds in both formats (the
/// tests run its vectors in each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FingerprintFormat {
    /// SHA-256 over `idem-fingerprint-v1` and the parts: what every version
    /// writes by default.
    #[default]
    Sha256,
    /// BLAKE3 over `idem-fingerprint-v2` and the same parts. Hashing a
    /// typical request (about 250 bytes of parts) takes about an eighth of
    /// SHA-256's instructions on a CPU without SHA extensions, and no more
    /// time than SHA-256 on one with them.
    Blake3,
}

impl FingerprintFormat {
    /// The format a reader tries when a record does not match this one.
    pub(crate) fn other(self) -> Self {
        match self {
            Self::Sha256 => Self::Blake3,
            Self::Blake3 => Self::Sha256,
        }
    }

    /// The fingerprint of a request in this format.
    pub fn fingerprint(
        self,
        operation: &str,
        parts: &Parts,
        headers: &[HeaderName],
        body: &[u8],
    ) -> Fingerprint {
        let bytes = with_buffer(|head| match self {
            Self::Sha256 => {
                let tail = request_bytes(
                    head,
                    b"idem-fingerprint-v1",
                    operation,
                    parts,
                    headers,
                    body,
                );
                let mut hasher = Sha256::new();
                hasher.update(&*head);
                hasher.update(tail);
                hasher.finalize().into()
            }
            Self::Blake3 => {
                let tail = request_bytes(
                    head,
                    b"idem-fingerprint-v2",
                    operation,
                    parts,
                    headers,
                    body,
                );
                let hash = if tail.is_empty() {
                    blake3::hash(head)
                } else {
                    let mut hasher = blake3::Hasher::new();
                    hasher.update(head);
                    hasher.update(tail);
                    hasher.finalize()
                };
                *hash.as_bytes()
            }
        });
        Fingerprint::from_bytes(bytes)
    }

    /// `fingerprint` (of this format) keyed with `key`: HMAC-SHA256 for
    /// SHA-256, BLAKE3's keyed hash for BLAKE3. Without the key, nobody
    /// can confirm a guess of a short request body by hashing it.
    pub(crate) fn keyed(self, key: &[u8; 32], fingerprint: &Fingerprint) -> Fingerprint {
        const LABEL: &[u8] = b"idem-fingerprint-keyed-v1";
        let bytes: [u8; 32] = match self {
            Self::Sha256 => {
                use hmac::{Hmac, Mac};
                match <Hmac<Sha256> as Mac>::new_from_slice(key) {
                    Ok(mut mac) => {
                        mac.update(LABEL);
                        mac.update(fingerprint.as_bytes());
                        mac.finalize().into_bytes().into()
                    }
                    // HMAC takes keys of every length: not reached.
                    Err(_) => *fingerprint.as_bytes(),
                }
            }
            Self::Blake3 => {
                let mut hasher = blake3::Hasher::new_keyed(key);
                hasher.update(LABEL);
                hasher.update(fingerprint.as_bytes());
                *hasher.finalize().as_bytes()
            }
        };
        Fingerprint::from_bytes(bytes)
    }

    /// The request's fingerprint in this format, keyed with `key` when
    /// there is one.
    pub(crate) fn of(
        self,
        key: Option<&[u8; 32]>,
        operation: &str,
        parts: &Parts,
        headers: &[HeaderName],
        body: &[u8],
    ) -> Fingerprint {
        let plain = self.fingerprint(operation, parts, headers, body);
        match key {
            Some(key) => self.keyed(key, &plain),
            None => plain,
        }
    }
}

thread_local! {
    /// The buffer each thread gathers a fingerprint's bytes in, kept
    /// between requests so that a fingerprint allocates nothing.
    static BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The most a thread keeps of its buffer after a large body.
const BUFFER_KEPT: usize = 16 * 1024;

/// Calls `f` with the thread's empty buffer (a new one if it is in use).
fn with_buffer<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    let mut buffer = BUFFER.take();
    buffer.clear();
    let result = f(&mut buffer);
    if buffer.capacity() <= BUFFER_KEPT {
        BUFFER.set(buffer);
    }
    result
}

/// Appends a length-prefixed part.
fn push_part(out: &mut Vec<u8>, part: &[u8]) {
    out.extend_from_slice(&(part.len() as u64).to_be_bytes());
    out.extend_from_slice(part);
}

/// The bytes a fingerprint hashes: `label` and the request's parts,
/// gathered in `out` (a JSON body's tokens too), and a raw body, which
/// follows them (returned; empty for JSON). A hash fed many small pieces
/// spends more on the pieces than on the bytes.
fn request_bytes<'b>(
    out: &mut Vec<u8>,
    label: &[u8],
    operation: &str,
    parts: &Parts,
    headers: &[HeaderName],
    body: &'b [u8],
) -> &'b [u8] {
    let json = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| is_json(ct.as_bytes()));
    out.reserve(256 + if json { body.len() + 64 } else { 0 });
    out.extend_from_slice(label);
    push_part(out, operation.as_bytes());
    push_part(out, parts.uri.path().as_bytes());
    push_part(out, parts.uri.query().unwrap_or_default().as_bytes());
    for name in headers {
        push_part(out, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        out.extend_from_slice(&(values.iter().count() as u64).to_be_bytes());
        for value in values {
            push_part(out, value.as_bytes());
        }
    }
    if json {
        out.extend_from_slice(b"json");
        let length_at = out.len();
        out.extend_from_slice(&[0; 8]);
        if canonical_tokens_into(out, body) {
            let length = (out.len() - length_at - 8) as u64;
            out[length_at..length_at + 8].copy_from_slice(&length.to_be_bytes());
            return &[];
        }
        out.truncate(length_at - 4);
    }
    out.extend_from_slice(b"raw");
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    body
}

/// The default fingerprint of a request in the default format
/// ([`FingerprintFormat::Sha256`]).
pub fn fingerprint(
    operation: &str,
    parts: &Parts,
    headers: &[HeaderName],
    body: &[u8],
) -> Fingerprint {
    FingerprintFormat::Sha256.fingerprint(operation, parts, headers, body)
}

#[cfg(test)]
mod tests {
    use super::{
        json::{Plain, serde_tokens_into},
        *,
    };
    use proptest::prelude::*;

    /// A fingerprint's buffer stays with its thread for the next request,
    /// unless a large body grew it past what a thread keeps; either way
    /// the fingerprint is the same.
    #[test]
    fn the_buffer_is_kept_only_while_small() {
        let (parts, ()) = http::Request::post("/orders")
            .header(header::CONTENT_TYPE, "application/json")
            .body(())
            .expect("request")
            .into_parts();
        let kept = || {
            BUFFER.with(|cell| {
                let buffer = cell.take();
                let capacity = buffer.capacity();
                cell.set(buffer);
                capacity
            })
        };
        let small = br#"{"amount":100}"#;
        let once = FingerprintFormat::Blake3.fingerprint("POST /orders", &parts, &[], small);
        assert!(kept() > 0, "the buffer is kept");
        let large = format!("[{}1]", "1,".repeat(BUFFER_KEPT));
        let _ =
            FingerprintFormat::Blake3.fingerprint("POST /orders", &parts, &[], large.as_bytes());
        assert_eq!(
            kept(),
            0,
            "a buffer grown past {BUFFER_KEPT} bytes is dropped"
        );
        let again = FingerprintFormat::Blake3.fingerprint("POST /orders", &parts, &[], small);
        assert_eq!(once, again);
        assert!(kept() > 0);
    }

    fn serde_tokens(body: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        serde_tokens_into(&mut out, body).then_some(out)
    }

    fn plain_tokens(body: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        Plain::tokens_into(&mut out, body).then_some(out)
    }

    /// The plain form takes the bodies APIs usually get, and gives up on
    /// everything it does not decode itself.
    #[test]
    fn the_plain_form_takes_plain_bodies_only() {
        for body in [
            r#"{"amount":100,"currency":"eur","items":[1,2,3]}"#,
            r#" { "b" : -0 , "a" : [ true , null , { "c" : "x y" } ] , "" : [] } "#,
            r#"[{},[],"",-123456789012345]"#,
            "17",
        ] {
            let plain = plain_tokens(body.as_bytes());
            assert!(plain.is_some(), "{body}");
            assert_eq!(plain, serde_tokens(body.as_bytes()), "{body}");
        }
        for body in [
            r#"{"a":1.5}"#,
            r#"{"a":1e3}"#,
            r#"{"a":1234567890123456}"#,
            r#"{"a":01}"#,
            r#"{"a":"\u00e9"}"#,
            r#"{"a":"é"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"b":1,"a":2,"b":3}"#,
            r#"{"a":1,}"#,
            r#"[1 2]"#,
            r#"{"a":1} x"#,
            "",
            "tru",
        ] {
            assert_eq!(plain_tokens(body.as_bytes()), None, "{body}");
        }
        let deep = format!("{}{}", "[".repeat(30), "]".repeat(30));
        assert_eq!(plain_tokens(deep.as_bytes()), None);
        assert!(serde_tokens(deep.as_bytes()).is_some());
        let wide: Vec<String> = (0..17).map(|i| format!("\"k{i:02}\":{i}")).collect();
        let wide = format!("{{{}}}", wide.join(","));
        assert_eq!(plain_tokens(wide.as_bytes()), None);
    }

    /// An object whose keys come out of order has its members' tokens put
    /// back in key order, from a copy on the stack or, past its size, on
    /// the heap: the same tokens as serde_json's path at every length
    /// around that size, nested objects included.
    #[test]
    fn unordered_members_are_sorted_at_every_length() {
        for length in (0..40).chain(440..560).chain([1_000, 5_000]) {
            let text = "x".repeat(length);
            for body in [
                format!(r#"{{"b":"{text}","a":1,"c":{{"z":2,"y":"{text}"}}}}"#),
                format!(r#"{{"z":[1,"{text}"],"m":{{}},"a":"{text}"}}"#),
            ] {
                let plain = plain_tokens(body.as_bytes());
                assert!(plain.is_some(), "{length}");
                assert_eq!(plain, serde_tokens(body.as_bytes()), "{length}");
            }
        }
    }

    /// serde_json visits a number before it reads what follows it; text
    /// that makes the body invalid right after a number (a sign, a second
    /// exponent) must leave the body raw bytes, never panic.
    #[test]
    fn a_number_followed_by_invalid_text_never_panics() {
        for body in [
            "[10E+00-,1]",
            "[1e5-]",
            "{\"a\":2E-3+}",
            "[-1.5e+7e8]",
            "[0-]",
        ] {
            assert_eq!(canonical_tokens(body.as_bytes()), None, "{body}");
            assert_eq!(serde_tokens(body.as_bytes()), None, "{body}");
        }
        // Valid numbers of every shape still tokenize.
        for body in ["[10E+00,1]", "[-0.5e-7]", "[1E5]", "[2.50]"] {
            assert!(canonical_tokens(body.as_bytes()).is_some(), "{body}");
        }
    }

    /// JSON-like texts, valid or nearly: every form the plain tokenizer
    /// takes or must refuse, with repeated and unsorted keys, odd spacing,
    /// and a cut or a stray byte now and then.
    fn text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("true".to_owned()),
            Just("false".to_owned()),
            Just("null".to_owned()),
            Just("nul".to_owned()),
            "-?[0-9]{1,17}",
            // About a double's last exact integers (2^53 has 16 digits).
            "-?9[0-9]{15}",
            "-?[1-9][0-9]{14,15}",
            "-?[0-9]{1,3}\\.[0-9]{0,3}",
            "-?[0-9]{1,2}[eE][+-]?[0-9]{1,3}",
            "\"[ -~]{0,6}\"",
            "\"[a-zé\u{7f}\u{1}\u{1F600}]{0,4}\"",
            Just(r#""\u00e9\n""#.to_owned()),
        ];
        let space = prop_oneof![
            Just(""),
            Just(""),
            Just(" "),
            Just("\n\t"),
            Just("\r"),
            Just("\u{c}"),
        ];
        let key = prop_oneof![
            Just("a"),
            Just("b"),
            Just("aa"),
            Just("B"),
            Just(""),
            Just("é"),
            Just("a\\u0062"),
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..6), space.clone()).prop_map(
                    |(items, space)| format!(
                        "[{space}{}{space}]",
                        items.join(&format!("{space},"))
                    )
                ),
                (
                    prop::collection::vec((key.clone(), inner), 0..6),
                    space.clone()
                )
                    .prop_map(|(members, space)| {
                        let members: Vec<String> = members
                            .iter()
                            .map(|(k, v)| format!("\"{k}\"{space}:{space}{v}"))
                            .collect();
                        format!("{{{space}{}}}", members.join(","))
                    }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Where the plain tokenizer takes a text, its tokens are
        /// serde_json's path's, byte for byte; so canonical tokens are the
        /// same with or without it, for every text.
        #[test]
        fn the_plain_form_writes_serde_jsons_tokens(
            text in text(),
            cut in any::<prop::sample::Index>(),
            stray in prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
            cut_it in any::<bool>(),
        ) {
            let mut body = text.into_bytes();
            if cut_it {
                body.truncate(cut.index(body.len() + 1));
            }
            if let Some((at, byte)) = stray {
                body.insert(at.index(body.len() + 1), byte);
            }
            let serde = serde_tokens(&body);
            if let Some(plain) = plain_tokens(&body) {
                prop_assert_eq!(Some(&plain), serde.as_ref());
            }
            prop_assert_eq!(canonical_tokens(&body), serde);
        }
    }
}
