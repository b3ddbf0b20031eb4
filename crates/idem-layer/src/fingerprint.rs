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

pub(crate) fn update_part(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// Whether a `content-type` value names JSON (`application/json` or any
/// `+json` type), ignoring parameters and case.
pub fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    const APPLICATION: &[u8] = b"application/";
    if std::str::from_utf8(essence).is_err() {
        return false;
    }
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() >= APPLICATION.len() + 5
            && essence[..APPLICATION.len()].eq_ignore_ascii_case(APPLICATION)
            && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// The canonical RFC 8785 text of a JSON body, or `None` if it does not
/// parse. The fingerprint does not need the text (see the module docs);
/// this is for inspection and tests.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// The RFC 8785 form of a JSON text as a tagged, length-prefixed token
/// stream, or `None` when the text is not JSON (or repeats a key, which
/// RFC 8785 forbids). Written in one pass over serde_json's parser: no
/// `Value` tree, keys borrowed from the input where possible.
pub(crate) fn canonical_tokens(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len() + 64);
    canonical_tokens_into(&mut out, body).then_some(out)
}

/// [`canonical_tokens`] appended to `out`; `false` (and `out` as it was)
/// when the text is not JSON. A text in the plain form most API bodies
/// take is tokenized by [`Plain`]; any other goes through serde_json's
/// parser. Both write the same tokens for the texts `Plain` takes (the
/// tests compare them on generated texts).
fn canonical_tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
    let start = out.len();
    if Plain::tokens_into(out, body) {
        return true;
    }
    out.truncate(start);
    serde_tokens_into(out, body)
}

/// A tokenizer for JSON texts in a plain form: strings of printable ASCII
/// without escapes, integers of at most 15 digits, `true`, `false`, `null`,
/// arrays, and objects of at most [`Plain::MEMBERS`] members without a
/// repeated key, nested at most [`Plain::DEPTH`] deep. For such a text
/// the canonical tokens need neither UTF-8 or escape decoding, nor a
/// double (such an integer is its own RFC 8785 spelling), nor UTF-16 key
/// order (ASCII byte order is the same). Anything else, valid JSON or
/// not, makes it give up, and serde_json's parser decides.
struct Plain<'b> {
    body: &'b [u8],
    at: usize,
}

impl Plain<'_> {
    /// The most members an object may have here.
    const MEMBERS: usize = 16;
    /// The deepest nesting handled here (serde_json's own limit is 128).
    const DEPTH: usize = 24;

    /// Appends the tokens of `body` to `out`; `false` (with `out` partly
    /// written) when the text is not in the plain form.
    fn tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
        let mut plain = Plain { body, at: 0 };
        plain.skip_whitespace();
        if !plain.value(out, 0) {
            return false;
        }
        plain.skip_whitespace();
        plain.at == body.len()
    }

    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> bool {
        match self.peek() {
            Some(b'"') => match self.string() {
                Some(text) => {
                    put_part(out, b's', text);
                    true
                }
                None => false,
            },
            Some(b'-' | b'0'..=b'9') => self.integer(out),
            Some(b't') => self.literal(b"true", b't', out),
            Some(b'f') => self.literal(b"false", b'f', out),
            Some(b'n') => self.literal(b"null", b'n', out),
            Some(b'[') if depth < Self::DEPTH => self.array(out, depth + 1),
            Some(b'{') if depth < Self::DEPTH => self.object(out, depth + 1),
            _ => false,
        }
    }

    fn literal(&mut self, word: &[u8], tag: u8, out: &mut Vec<u8>) -> bool {
        if !self.body[self.at..].starts_with(word) {
            return false;
        }
        self.at += word.len();
        out.push(tag);
        true
    }

    /// A string's bytes, between its quotes, if it is printable ASCII
    /// without escapes.
    fn string(&mut self) -> Option<&[u8]> {
        let start = self.at + 1;
        let length = self
            .body
            .get(start..)?
            .iter()
            .position(|b| !matches!(b, 0x20..=0x7e) || *b == b'"' || *b == b'\\')?;
        let end = start + length;
        if self.body[end] != b'"' {
            return None;
        }
        self.at = end + 1;
        Some(&self.body[start..end])
    }

    /// An integer of at most 15 digits, without fraction or exponent: the
    /// literal is its own canonical spelling, but `-0`, which is `0`.
    fn integer(&mut self, out: &mut Vec<u8>) -> bool {
        let start = self.at;
        let negative = self.peek() == Some(b'-');
        let digits_at = start + usize::from(negative);
        let digits = self.body[digits_at..]
            .iter()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(self.body.len() - digits_at);
        let end = digits_at + digits;
        let leading_zero = digits > 1 && self.body[digits_at] == b'0';
        if digits == 0
            || digits > 15
            || leading_zero
            || matches!(self.body.get(end), Some(b'.' | b'e' | b'E'))
        {
            return false;
        }
        self.at = end;
        let literal = &self.body[start..end];
        put_part(out, b'd', if literal == b"-0" { b"0" } else { literal });
        true
    }

    /// After an array element or object member: `Some(true)` past a
    /// comma (another follows), `Some(false)` past `close`, `None` for
    /// anything else.
    fn after_item(&mut self, close: u8) -> Option<bool> {
        self.skip_whitespace();
        let next = self.peek()?;
        self.at += 1;
        if next == b',' {
            self.skip_whitespace();
            Some(true)
        } else {
            (next == close).then_some(false)
        }
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> bool {
        self.at += 1;
        out.push(b'a');
        let count_at = out.len();
        out.extend_from_slice(&[0; 8]);
        self.skip_whitespace();
        let mut count = 0u64;
        if self.peek() == Some(b']') {
            self.at += 1;
        } else {
            loop {
                if !self.value(out, depth) {
                    return false;
                }
                count += 1;
                match self.after_item(b']') {
                    Some(true) => {}
                    Some(false) => break,
                    None => return false,
                }
            }
        }
        out[count_at..count_at + 8].copy_from_slice(&count.to_be_bytes());
        true
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> bool {
        self.at += 1;
        out.push(b'o');
        let count_at = out.len();
        out.extend_from_slice(&[0; 8]);
        let first = out.len();
        // Each member's key (in the body) and tokens (in `out`), as 32-bit
        // offsets (a text whose offsets do not fit goes to serde_json).
        let mut members = [(0u32, 0u32, 0u32, 0u32); Self::MEMBERS];
        let mut count = 0;
        let mut sorted = true;
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.at += 1;
        } else {
            loop {
                if count == Self::MEMBERS || self.peek() != Some(b'"') {
                    return false;
                }
                let key_at = self.at + 1;
                let Some(key) = self.string() else {
                    return false;
                };
                let key_len = key.len();
                let tokens_at = out.len();
                put_part(out, b'k', key);
                self.skip_whitespace();
                if self.peek() != Some(b':') {
                    return false;
                }
                self.at += 1;
                self.skip_whitespace();
                if !self.value(out, depth) {
                    return false;
                }
                if count > 0 {
                    let previous = member_key(self.body, &members[count - 1]);
                    match previous.cmp(&self.body[key_at..key_at + key_len]) {
                        std::cmp::Ordering::Less => {}
                        // A repeated key: serde_json's path refuses it.
                        std::cmp::Ordering::Equal => return false,
                        std::cmp::Ordering::Greater => sorted = false,
                    }
                }
                // Every offset is within the body or `out`: if both lengths
                // fit in 32 bits, so do the offsets.
                if u32::try_from(out.len().max(self.body.len())).is_err() {
                    return false;
                }
                members[count] = (
                    key_at as u32,
                    key_len as u32,
                    tokens_at as u32,
                    out.len() as u32,
                );
                count += 1;
                match self.after_item(b'}') {
                    Some(true) => {}
                    Some(false) => break,
                    None => return false,
                }
            }
        }
        out[count_at..count_at + 8].copy_from_slice(&(count as u64).to_be_bytes());
        if !sorted {
            let members = &mut members[..count];
            let body = self.body;
            let key = |member: &Member| member_key(body, member);
            members.sort_unstable_by(|a, b| key(a).cmp(key(b)));
            if members
                .windows(2)
                .any(|pair| key(&pair[0]) == key(&pair[1]))
            {
                return false;
            }
            // The members' tokens, as written, are put back in key order
            // from a copy: on the stack when they are short (most
            // bodies), else on the heap.
            let mut stack = [0u8; 512];
            let mut heap = Vec::new();
            let written: &[u8] = match stack.get_mut(..out.len() - first) {
                Some(copy) => {
                    copy.copy_from_slice(&out[first..]);
                    copy
                }
                None => {
                    heap.extend_from_slice(&out[first..]);
                    &heap
                }
            };
            out.truncate(first);
            for &(_, _, start, end) in members.iter() {
                out.extend_from_slice(&written[start as usize - first..end as usize - first]);
            }
        }
        true
    }
}

/// An object member as [`Plain`] notes it: its key's offset and length in
/// the body, and where its tokens begin and end in the output.
type Member = (u32, u32, u32, u32);

/// A member's key, from the body.
fn member_key<'b>(body: &'b [u8], &(at, len, ..): &Member) -> &'b [u8] {
    &body[at as usize..at as usize + len as usize]
}

/// [`canonical_tokens_into`] through serde_json's parser, for every text.
fn serde_tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
    use serde::de::DeserializeSeed;
    let start = out.len();
    let mut numbers = NumberTexts::new(body);
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let parsed = Canon {
        out: &mut *out,
        numbers: &mut numbers,
    }
    .deserialize(&mut deserializer)
    .is_ok()
        && deserializer.end().is_ok();
    if !parsed {
        out.truncate(start);
    }
    parsed
}

/// The number literals of a JSON text, in document order. serde_json hands
/// the visitor numbers as doubles or 64-bit integers, which loses digits;
/// the parser visits values in document order, so the visitor takes each
/// number's own text from this scan instead. The scan relies on the text
/// being valid JSON, which the parser checks.
struct NumberTexts<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> NumberTexts<'a> {
    fn new(body: &'a [u8]) -> Self {
        Self { body, at: 0 }
    }

    /// The next number literal outside strings.
    fn next_number(&mut self) -> Option<&'a [u8]> {
        let body = self.body;
        let mut i = self.at;
        while i < body.len() {
            match body[i] {
                b'"' => {
                    i += 1;
                    while i < body.len() && body[i] != b'"' {
                        i += if body[i] == b'\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                b'-' | b'0'..=b'9' => {
                    // The number as JSON spells it, and no further: the
                    // parser visits a number before it reads what follows,
                    // which may make the text invalid (`10E+00-`).
                    let start = i;
                    let digits = |i: &mut usize| {
                        while body.get(*i).is_some_and(u8::is_ascii_digit) {
                            *i += 1;
                        }
                    };
                    i += usize::from(body[i] == b'-');
                    digits(&mut i);
                    if body.get(i) == Some(&b'.') {
                        i += 1;
                        digits(&mut i);
                    }
                    if matches!(body.get(i), Some(b'e' | b'E')) {
                        i += 1;
                        i += usize::from(matches!(body.get(i), Some(b'+' | b'-')));
                        digits(&mut i);
                    }
                    self.at = i;
                    return Some(&body[start..i]);
                }
                _ => i += 1,
            }
        }
        self.at = i;
        None
    }
}

/// Writes the exact value of a JSON number literal in one spelling:
/// `[-]digits e exponent` with no leading or trailing zeros in the digits
/// (zero is `0`, whatever its sign or exponent). Two literals get the same
/// spelling exactly when their values are equal.
fn exact_number(out: &mut Vec<u8>, literal: &[u8]) {
    out.clear();
    let (negative, rest) = match literal.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, literal),
    };
    let mantissa_end = rest
        .iter()
        .position(|b| matches!(b, b'e' | b'E'))
        .unwrap_or(rest.len());
    let (mantissa, exponent_text) = rest.split_at(mantissa_end);
    let (int_part, frac_part) = match mantissa.iter().position(|b| *b == b'.') {
        Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
        None => (mantissa, &mantissa[..0]),
    };
    // The exponent saturates: JSON numbers whose exponents differ by more
    // than i64 can say are beyond any real payload (serde_json refuses them
    // long before).
    let mut exponent: i64 = 0;
    let mut exponent_digits = exponent_text.get(1..).unwrap_or_default();
    let exponent_negative = match exponent_digits.first() {
        Some(b'-') => {
            exponent_digits = &exponent_digits[1..];
            true
        }
        Some(b'+') => {
            exponent_digits = &exponent_digits[1..];
            false
        }
        _ => false,
    };
    // Digits only (the scan above spells numbers as JSON does); anything
    // else is skipped rather than trusted.
    for digit in exponent_digits.iter().filter(|d| d.is_ascii_digit()) {
        exponent = exponent
            .saturating_mul(10)
            .saturating_add(i64::from(digit - b'0'));
    }
    if exponent_negative {
        exponent = -exponent;
    }
    let digits_all = int_part.iter().chain(frac_part);
    let mut digits: Vec<u8> = digits_all.copied().skip_while(|d| *d == b'0').collect();
    exponent = exponent.saturating_sub(i64::try_from(frac_part.len()).unwrap_or(i64::MAX));
    while digits.last() == Some(&b'0') {
        digits.pop();
        exponent = exponent.saturating_add(1);
    }
    if digits.is_empty() {
        out.push(b'0');
    } else {
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(&digits);
        out.push(b'e');
        out.extend_from_slice(itoa::Buffer::new().format(exponent).as_bytes());
    }
}

/// A plain integer literal of at most 15 digits: a double holds it
/// exactly, and its RFC 8785 spelling is the literal itself (JSON has no
/// leading zeros), except `-0`, which is `0`.
fn small_integer(literal: &[u8]) -> Option<&[u8]> {
    let digits = literal.strip_prefix(b"-").unwrap_or(literal);
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(if literal == b"-0" { b"0" } else { literal })
}

/// Orders strings by their UTF-16 code units, as RFC 8785 sorts keys.
fn utf16_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    if a.is_ascii() && b.is_ascii() {
        a.as_bytes().cmp(b.as_bytes())
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

/// A token: its tag, its length (8 bytes, big-endian) and its bytes. The
/// tag and length go in as one piece (a token is often shorter than them).
fn put_part(out: &mut Vec<u8>, tag: u8, part: &[u8]) {
    let mut head = [tag; 9];
    head[1..].copy_from_slice(&(part.len() as u64).to_be_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(part);
}

/// Writes one JSON value's canonical tokens.
struct Canon<'o, 'b> {
    out: &'o mut Vec<u8>,
    numbers: &'o mut NumberTexts<'b>,
}

/// Reads an object key, borrowed from the input when it has no escapes.
struct Key;

impl<'de> serde::de::DeserializeSeed<'de> for Key {
    type Value = std::borrow::Cow<'de, str>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Key {
    type Value = std::borrow::Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v))
    }
}

impl Canon<'_, '_> {
    /// A number, given as the double serde_json parsed: its RFC 8785
    /// spelling when that spelling has exactly the literal's value, else
    /// the literal's exact value under tag `x`. Injective: two literals of
    /// equal value get one token (their doubles, and so their spellings,
    /// are equal); of different values, either both keep their spelling,
    /// which then differ because each equals its own value, or one is
    /// tagged `x` with its exact value.
    fn number(self, double: f64) {
        let Some(literal) = self.numbers.next_number() else {
            // Not reached for valid JSON; a distinct token keeps the
            // fingerprint well defined anyway.
            self.out.push(b'?');
            return;
        };
        if let Some(spelled) = small_integer(literal) {
            put_part(self.out, b'd', spelled);
            return;
        }
        let mut buffer = ryu_js::Buffer::new();
        let spelled = buffer.format(double).as_bytes();
        let (mut exact, mut of_spelled) = (Vec::new(), Vec::new());
        exact_number(&mut exact, literal);
        exact_number(&mut of_spelled, spelled);
        if exact == of_spelled {
            put_part(self.out, b'd', spelled);
        } else {
            put_part(self.out, b'x', &exact);
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Canon<'_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Canon<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.out.push(b'n');
        Ok(())
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.out.push(if v { b't' } else { b'f' });
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.number(v as f64);
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.number(v as f64);
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        self.number(v);
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        put_part(self.out, b's', v.as_bytes());
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.out.push(b'a');
        let count_at = self.out.len();
        self.out.extend_from_slice(&[0; 8]);
        let mut count = 0u64;
        while seq
            .next_element_seed(Canon {
                out: &mut *self.out,
                numbers: &mut *self.numbers,
            })?
            .is_some()
        {
            count += 1;
        }
        self.out[count_at..count_at + 8].copy_from_slice(&count.to_be_bytes());
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.out.push(b'o');
        let count_at = self.out.len();
        self.out.extend_from_slice(&[0; 8]);
        let first = self.out.len();
        let mut members: Vec<(std::borrow::Cow<'de, str>, std::ops::Range<usize>)> = Vec::new();
        let mut sorted = true;
        while let Some(key) = map.next_key_seed(Key)? {
            let start = self.out.len();
            put_part(self.out, b'k', key.as_bytes());
            map.next_value_seed(Canon {
                out: &mut *self.out,
                numbers: &mut *self.numbers,
            })?;
            if let Some((previous, _)) = members.last() {
                match utf16_cmp(previous, &key) {
                    std::cmp::Ordering::Less => {}
                    std::cmp::Ordering::Equal => {
                        return Err(serde::de::Error::custom("duplicate object key"));
                    }
                    std::cmp::Ordering::Greater => sorted = false,
                }
            }
            members.push((key, start..self.out.len()));
        }
        self.out[count_at..count_at + 8].copy_from_slice(&(members.len() as u64).to_be_bytes());
        if !sorted {
            members.sort_by(|(a, _), (b, _)| utf16_cmp(a, b));
            if members.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err(serde::de::Error::custom("duplicate object key"));
            }
            let written = self.out.split_off(first);
            for (_, range) in &members {
                self.out
                    .extend_from_slice(&written[range.start - first..range.end - first]);
            }
        }
        Ok(())
    }
}

/// How the default fingerprint hashes a request: the same length-prefixed
/// parts (see the module docs) under one of two hash functions.
///
/// Every version that knows [`Blake3`](Self::Blake3) *reads* both: a layer
/// whose reservation meets a record with another fingerprint tries the
/// other format before it answers `422`, so records written in either
/// format replay. What a layer *writes* is its
/// [`fingerprint_format`](crate::IdempotencyLayer::fingerprint_format).
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
    use super::*;
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
