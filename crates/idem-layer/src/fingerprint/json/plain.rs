//! The fast path: a tokenizer for JSON texts in the plain form most API
//! bodies take, writing the same tokens serde_json's path writes.

use super::put_part;

/// A tokenizer for JSON texts in a plain form: strings of printable ASCII
/// without escapes, integers of at most 15 digits, `true`, `false`, `null`,
/// arrays, and objects of at most [`Plain::MEMBERS`] members without a
/// repeated key, nested at most [`Plain::DEPTH`] deep. For such a text
/// the canonical tokens need neither UTF-8 or escape decoding, nor a
/// double (such an integer is its own RFC 8785 spelling), nor UTF-16 key
/// order (ASCII byte order is the same). Anything else, valid JSON or
/// not, makes it give up, and serde_json's parser decides.
pub(crate) struct Plain<'b> {
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
    pub(crate) fn tokens_into(out: &mut Vec<u8>, body: &[u8]) -> bool {
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
        sorted || self.sort_members(out, first, &mut members[..count])
    }

    /// Puts an object's members, written to `out` from `first` in the
    /// order they came, in key order; `false` for a repeated key.
    fn sort_members(&self, out: &mut Vec<u8>, first: usize, members: &mut [Member]) -> bool {
        let body = self.body;
        let key = |member: &Member| member_key(body, member);
        members.sort_unstable_by(|a, b| key(a).cmp(key(b)));
        if members
            .windows(2)
            .any(|pair| key(&pair[0]) == key(&pair[1]))
        {
            return false;
        }
        // The members' tokens, as written, are put back in key order from
        // a copy: on the stack when they are short (most bodies), else on
        // the heap.
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
