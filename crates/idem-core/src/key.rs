//! Parsing of the `Idempotency-Key` field value.

use std::fmt;

/// Why an `Idempotency-Key` field value was refused.
///
/// Every variant maps to the problem code `idempotency_key_invalid`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty, or an empty sf-string.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`IdempotencyKey::MAX_LEN`] characters.
    #[error("the idempotency key is {0} characters long; at most 255 are allowed")]
    TooLong(usize),
    /// A bare key holds a byte outside visible ASCII (0x21..=0x7E).
    #[error("the idempotency key holds a character outside visible ASCII")]
    InvalidCharacter,
    /// A value starting with `"` is not a valid RFC 8941 sf-string item.
    #[error("the idempotency key is not a valid RFC 8941 string: {0}")]
    Malformed(String),
    /// The request carries more than one `Idempotency-Key` field.
    #[error("the request carries more than one Idempotency-Key field")]
    Repeated,
}

/// A validated idempotency key: 1 to 255 characters of printable ASCII.
///
/// Two spellings name the same key: an RFC 8941 sf-string (`"abc"`) and, for
/// compatibility, a bare value (`abc`). See [`IdempotencyKey::parse`].
/// Clones share the text (the handler's context holds one).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(std::sync::Arc<str>);

impl IdempotencyKey {
    /// The key's text, to share (a clone is a reference count: a
    /// record keeps it so).
    pub fn shared(&self) -> &std::sync::Arc<str> {
        &self.0
    }

    /// The longest key accepted, in characters, after unquoting.
    pub const MAX_LEN: usize = 255;

    /// Parses an `Idempotency-Key` field value.
    ///
    /// Surrounding spaces and tabs are not part of the value. A value that
    /// starts with `"` is parsed as an RFC 8941 Item that must be a String
    /// (its parameters are ignored); any other value is taken literally and
    /// must consist of bytes 0x21..=0x7E. Either way the key holds 1 to 255
    /// characters.
    ///
    /// ```
    /// use idem_core::IdempotencyKey;
    /// assert_eq!(IdempotencyKey::parse(b"\"abc\"").unwrap().as_str(), "abc");
    /// assert_eq!(IdempotencyKey::parse(b"abc").unwrap().as_str(), "abc");
    /// assert!(IdempotencyKey::parse(b"a b").is_err());
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = value.trim_ascii();
        if value.first() == Some(&b'"') {
            let item = sfv::Parser::new(value)
                .parse::<sfv::Item>()
                .map_err(|e| KeyError::Malformed(e.to_string()))?;
            let string = item
                .bare_item
                .as_string()
                .ok_or_else(|| KeyError::Malformed("the item is not a string".to_owned()))?;
            Self::checked(string.as_str())
        } else {
            if !value.iter().all(|b| (0x21..=0x7E).contains(b)) {
                return Err(KeyError::InvalidCharacter);
            }
            // Visible ASCII is valid UTF-8.
            let text = std::str::from_utf8(value).map_err(|_| KeyError::InvalidCharacter)?;
            Self::checked(text)
        }
    }

    fn checked(text: &str) -> Result<Self, KeyError> {
        match text.len() {
            0 => Err(KeyError::Empty),
            n if n > Self::MAX_LEN => Err(KeyError::TooLong(n)),
            _ => Ok(Self(text.into())),
        }
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an RFC 8941 sf-string (`"abc"`, with `"` and `\\`
    /// escaped): the one header form that carries every key, and the form
    /// the gateway forwards upstream whatever spelling the client sent.
    pub fn to_sf_string(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        // Copied a run at a time between the characters to escape (both
        // ASCII: a byte search finds them).
        let escaped = |b: &u8| matches!(b, b'"' | b'\\');
        let mut rest: &str = &self.0;
        while let Some(at) = rest.as_bytes().iter().position(escaped) {
            out.push_str(&rest[..at]);
            out.push('\\');
            out.push_str(&rest[at..=at]);
            rest = &rest[at + 1..];
        }
        out.push_str(rest);
        out.push('"');
        out
    }
}

/// The key as text. `Debug` redacts it (keys may be guessable business
/// identifiers, kept out of logs by default); `Display` is for code that
/// means to show it.
impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keys may be guessable business identifiers; keep them out of logs by default.
        f.debug_tuple("IdempotencyKey")
            .field(&"<redacted>")
            .finish()
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}
