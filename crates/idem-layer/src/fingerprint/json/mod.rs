//! JSON bodies in their RFC 8785 form: the canonical text
//! ([`canonical_json`]) and the tagged token stream the fingerprint hashes
//! without writing that text out (see the [module docs](super)).

mod plain;

pub(crate) use plain::Plain;

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
pub(crate) fn canonical_tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
    let start = out.len();
    if Plain::tokens_into(out, body) {
        return true;
    }
    out.truncate(start);
    serde_tokens_into(out, body)
}

/// [`canonical_tokens_into`] through serde_json's parser, for every text.
pub(crate) fn serde_tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
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
pub(super) fn put_part(out: &mut Vec<u8>, tag: u8, part: &[u8]) {
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
