//! Request path normalization: one spelling per resource.
//!
//! `//orders`, `/./orders`, `/x/../orders` and `/%6Frders` name the same
//! resource as `/orders` to most servers. If they were different operations
//! to the layer, the same key sent under another spelling would start a new
//! scope and run the action again. The layer scopes a request by its
//! normalized path and, when the path changes, passes the request on with
//! the normalized path, so that what runs is exactly what was scoped.

use std::{borrow::Cow, sync::Arc};

use crate::recent::Recent;

/// Whether a byte is an RFC 3986 unreserved character.
fn unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// Appends `byte` as an upper-case percent escape.
fn push_escape(out: &mut Vec<u8>, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.extend_from_slice(&[
        b'%',
        HEX[usize::from(byte >> 4)],
        HEX[usize::from(byte & 15)],
    ]);
}

/// Whether the path is already in normal form (the common case, checked
/// without allocating).
fn is_normal(path: &[u8]) -> bool {
    if path.first() != Some(&b'/') {
        return false;
    }
    let mut previous = 0u8;
    for (i, &byte) in path.iter().enumerate() {
        match byte {
            b'/' if previous == b'/' => return false,
            b'%' => return false,
            // A raw non-ASCII byte is written as its escape.
            0x80.. => return false,
            b'.' if previous == b'/' => {
                // "/." followed by "/", "./" or the end is a dot segment.
                let rest = &path[i + 1..];
                if rest.is_empty()
                    || rest[0] == b'/'
                    || (rest[0] == b'.' && (rest.len() == 1 || rest[1] == b'/'))
                {
                    return false;
                }
            }
            _ => {}
        }
        previous = byte;
    }
    true
}

/// The normal form of a request path (RFC 3986 section 6.2.2):
///
/// * percent-encoded unreserved characters are decoded (`%7E` is `~`), and
///   the hex digits of the remaining escapes are upper-cased; a `%` that
///   starts no escape is written `%25`, so the normal form is a fixed
///   point (normalizing it again changes nothing);
/// * repeated slashes are merged (`//a///b` is `/a/b`);
/// * dot segments are removed (`/a/./b/../c` is `/a/c`; never above `/`);
/// * an empty path is `/`;
/// * raw non-ASCII bytes are percent-encoded (`/orders/é` is
///   `/orders/%C3%A9`), so both spellings are one operation.
///
/// A trailing slash is kept (`/orders/` stays a different path), as servers
/// commonly route it differently.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let bytes = path.as_bytes();
    if is_normal(bytes) {
        return Cow::Borrowed(path);
    }
    // Decode unreserved escapes, upper-case the others.
    let mut decoded = Vec::with_capacity(bytes.len() + 1);
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex_value),
                bytes.get(i + 2).copied().and_then(hex_value),
            )
        {
            let value = hi * 16 + lo;
            if unreserved(value) {
                decoded.push(value);
            } else {
                decoded.push(b'%');
                decoded.push(bytes[i + 1].to_ascii_uppercase());
                decoded.push(bytes[i + 2].to_ascii_uppercase());
            }
            i += 3;
            continue;
        }
        if byte == b'%' {
            // A '%' that starts no escape is a '%' itself: written as its
            // escape, so that no later character can complete it into
            // another (`%%616` is `%25a6`, never `%a6` and then `%A6`).
            decoded.extend_from_slice(b"%25");
        } else if byte >= 0x80 {
            // Raw UTF-8 (`/orders/é`) names what its escapes name
            // (`/orders/%C3%A9`): one operation, forwarded escaped.
            push_escape(&mut decoded, byte);
        } else {
            decoded.push(byte);
        }
        i += 1;
    }
    // Split into segments, dropping empty ones (repeated slashes) and
    // resolving dot segments; remember a trailing slash.
    let trailing = decoded.len() > 1
        && (decoded.ends_with(b"/") || decoded.ends_with(b"/.") || decoded.ends_with(b"/.."));
    let mut segments: Vec<&[u8]> = Vec::new();
    for segment in decoded.split(|b| *b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for segment in &segments {
        out.push('/');
        // Every byte is ASCII: non-ASCII bytes were escaped above.
        out.push_str(&String::from_utf8_lossy(segment));
    }
    if out.is_empty() || (trailing && !segments.is_empty()) {
        out.push('/');
    }
    Cow::Owned(out)
}

/// The operation of a scope: the method and the route (`POST /orders`).
/// The request path and the records API name operations the same way, so
/// the records API finds what the layer stored.
pub(crate) fn operation_name(method: &str, route: &str) -> String {
    let mut name = String::with_capacity(method.len() + 1 + route.len());
    name.push_str(method);
    name.push(' ');
    name.push_str(route);
    name
}

/// How many operations each thread keeps named.
const RECENT_OPERATIONS: usize = 8;

thread_local! {
    /// The operations a thread named lately, the oldest replaced first: a
    /// service has a few routes, and their names are shared, not made
    /// again for every request.
    static OPERATIONS: std::cell::RefCell<Recent<Arc<str>, RECENT_OPERATIONS>> =
        const { std::cell::RefCell::new(Recent::new()) };
}

/// [`operation_name`] as shared text, from the thread's recent operations
/// when it named this one lately.
pub(crate) fn shared_operation_name(method: &str, route: &str) -> Arc<str> {
    let names = |name: &str| {
        name.len() == method.len() + 1 + route.len()
            && name.as_bytes()[method.len()] == b' '
            && name.starts_with(method)
            && name.ends_with(route)
    };
    // A thread past its thread-locals' end (a future dropped while the
    // thread exits) names the operation anew.
    let found =
        OPERATIONS.try_with(|recent| recent.borrow().iter().find(|name| names(name)).cloned());
    if let Ok(Some(name)) = found {
        return name;
    }
    let name: Arc<str> = operation_name(method, route).into();
    let _ = OPERATIONS.try_with(|recent| recent.borrow_mut().push(Arc::clone(&name)));
    name
}

#[cfg(test)]
mod tests {
    use super::{RECENT_OPERATIONS, normalize_path, operation_name, shared_operation_name};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// The normal form is a fixed point: a proxy forwards the path it
        /// scoped, and the retry of that path must land in the same scope.
        /// Every spelling of a path (unreserved characters percent-encoded
        /// in either case, repeated slashes, `.` segments, a segment and
        /// `..`) normalizes to the path itself.
        #[test]
        fn aliases_normalize_to_the_path(
            segments in prop::collection::vec("[a-z0-9~._-]{1,5}", 1..5),
            spelling in prop::collection::vec(0u8..6, 40),
        ) {
            let segments: Vec<String> = segments
                .into_iter()
                .filter(|s| s != "." && s != "..")
                .collect();
            let canonical: String = segments.iter().map(|s| format!("/{s}")).collect();
            let canonical = if canonical.is_empty() { "/".to_owned() } else { canonical };
            let mut choice = spelling.iter().cycle();
            let mut alias = String::new();
            for segment in &segments {
                match choice.next() {
                    Some(1) => alias.push_str("//"),
                    Some(2) => alias.push_str("/./"),
                    Some(3) => alias.push_str("/zz/../"),
                    _ => alias.push('/'),
                }
                for c in segment.chars() {
                    match choice.next() {
                        Some(4) => alias.push_str(&format!("%{:02X}", c as u32)),
                        Some(5) => alias.push_str(&format!("%{:02x}", c as u32)),
                        _ => alias.push(c),
                    }
                }
            }
            prop_assert_eq!(normalize_path(&alias), canonical.as_str(), "{:?}", alias);
        }

        #[test]
        fn normalizing_twice_changes_nothing(path in "[/.%2Ee61FfAa9z~é-]{0,20}") {
            let once = normalize_path(&path).into_owned();
            prop_assert!(once.starts_with('/'), "{:?} -> {:?}", path, once);
            prop_assert!(once.is_ascii(), "{:?} -> {:?}", path, once);
            let twice = normalize_path(&once).into_owned();
            prop_assert_eq!(&twice, &once, "{:?}", path);
        }
    }

    #[test]
    fn aliases_name_one_path() {
        let cases = [
            ("/orders", "/orders"),
            ("//orders", "/orders"),
            ("/./orders", "/orders"),
            ("/x/../orders", "/orders"),
            ("/../orders", "/orders"),
            ("/a//b///c", "/a/b/c"),
            ("/a/./b/../c", "/a/c"),
            ("/%6Frders", "/orders"),
            ("/%7e%2D", "/~-"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%2Fb", "/a%2Fb"),
            ("/orders/", "/orders/"),
            ("/orders/é", "/orders/%C3%A9"),
            ("/orders/%c3%a9", "/orders/%C3%A9"),
            ("/caf\u{e9}//x", "/caf%C3%A9/x"),
            ("/orders/.", "/orders/"),
            ("/orders/x/..", "/orders/"),
            ("/", "/"),
            ("", "/"),
            ("/..", "/"),
            ("/%2E%2E/orders", "/orders"),
            ("/.well-known/x", "/.well-known/x"),
            ("/a/..b", "/a/..b"),
            ("/%", "/%25"),
            ("/%zz", "/%25zz"),
            ("/%%616", "/%25a6"),
            ("/a%4", "/a%254"),
            ("/caf%C3%A9", "/caf%C3%A9"),
        ];
        for (input, expected) in cases {
            assert_eq!(normalize_path(input), expected, "{input:?}");
            // Normalizing twice changes nothing.
            assert_eq!(normalize_path(expected), expected, "{expected:?} again");
        }
    }

    /// The shared name of an operation is its name, whether the thread
    /// named it lately or not: routes of one length, methods of one
    /// length, and more operations than a thread keeps, each named in
    /// turn, twice.
    #[test]
    fn shared_operation_names_are_the_names() {
        let mut operations = vec![
            ("POST", "/ab"),
            ("POST", "/cd"),
            ("PUTS", "/ab"),
            ("PUT", "/abc"),
            ("PUT", "/ab c"),
            ("POST", "/"),
            ("DELETE", "/orders/{id}"),
        ];
        operations.extend((0..RECENT_OPERATIONS).map(|n| {
            (
                "PATCH",
                ["/a", "/b", "/c", "/d", "/e", "/f", "/g", "/h"][n % 8],
            )
        }));
        for _ in 0..2 {
            for &(method, route) in &operations {
                for _ in 0..2 {
                    assert_eq!(
                        &*shared_operation_name(method, route),
                        operation_name(method, route)
                    );
                }
            }
        }
    }
}
