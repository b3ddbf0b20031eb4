//! The headers a request takes to the upstream: hop-by-hop fields, the
//! gateway's own credentials (its admin token, its operator cookie) and
//! the `Forwarded` or `X-Forwarded-*` fields.

use http::{HeaderMap, HeaderName, HeaderValue, header};
use idem_layer::{ADMIN_TOKEN, HOP_BY_HOP};

use super::Forwarded;

/// The header names a `Connection` field lists (it makes them hop-by-hop).
pub(crate) fn connection_names(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
}

pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none (and no `Connection` naming others): a look
    // at the few names present costs less than a removal per hop-by-hop
    // name, twice a request.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = connection_names(headers).collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(name);
    }
}

/// An upstream answer's headers as the gateway forwards them: a length
/// sent beside `Transfer-Encoding` dropped (the chunks frame the message,
/// and a proxy drops the length before it forwards it, RFC 9112, 6.3: the
/// body goes on as it was decoded), then the hop-by-hop fields.
pub(super) fn answer_headers(headers: &mut HeaderMap) {
    if headers.contains_key(http::header::TRANSFER_ENCODING) {
        headers.remove(http::header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(headers);
}

/// Removes the operator page's session from a request to be forwarded: every
/// `idem_operator` pair of its `Cookie` (and `Cookie2`) fields, however a
/// server might read the name (any case, percent-escaped, padded with any
/// whitespace, after a `,` as well as a `;`), and nothing else. Several
/// `Cookie` fields (as HTTP/2 sends them) are joined into one with `; `, as
/// an HTTP/1.1 upstream expects (RFC 9113, 8.2.3).
pub(crate) fn strip_operator_cookie(headers: &mut HeaderMap) {
    static COOKIE2: HeaderName = HeaderName::from_static("cookie2");
    let name = crate::owned::COOKIE.as_bytes();
    let suspect = |value: &HeaderValue| {
        let bytes = value.as_bytes();
        bytes.contains(&b'%')
            || bytes
                .windows(name.len())
                .any(|w| w.eq_ignore_ascii_case(name))
    };
    for field in [&header::COOKIE, &COOKIE2] {
        let values = headers.get_all(field);
        let mut iter = values.iter();
        let several = iter.next().is_some() && iter.next().is_some();
        if !several && !values.iter().any(suspect) {
            continue;
        }
        let mut kept: Vec<Vec<u8>> = Vec::new();
        for value in headers.get_all(field) {
            for pair in value.as_bytes().split(|&b| b == b';' || b == b',') {
                let pair = trim_any_space(pair);
                if pair.is_empty() || names_operator_cookie(pair, name) {
                    continue;
                }
                kept.push(pair.to_vec());
            }
        }
        headers.remove(field);
        if let Ok(joined) = HeaderValue::from_bytes(&kept.join(&b"; "[..]))
            && !kept.is_empty()
        {
            headers.insert(field, joined);
        }
    }
}

/// Whether a cookie pair's name reads as `name`: percent-decoded, trimmed
/// of any whitespace, in any case.
pub(super) fn names_operator_cookie(pair: &[u8], name: &[u8]) -> bool {
    let decoded = crate::owned::percent_decode(pair);
    let pair_name = decoded.split(|&b| b == b'=').next().unwrap_or_default();
    trim_any_space(pair_name).eq_ignore_ascii_case(name)
}

/// `bytes` without leading and trailing ASCII whitespace, and without a
/// no-break space (`0xA0`, and its UTF-8 form) that some servers trim too.
pub(super) fn trim_any_space(mut bytes: &[u8]) -> &[u8] {
    loop {
        let before = bytes.len();
        bytes = bytes.trim_ascii();
        for nbsp in [&b"\xc2\xa0"[..], &b"\xa0"[..]] {
            bytes = bytes.strip_prefix(nbsp).unwrap_or(bytes);
            bytes = bytes.strip_suffix(nbsp).unwrap_or(bytes);
        }
        if bytes.len() == before {
            return bytes;
        }
    }
}

/// Removes every field a server could read as the admin credential's
/// header (`x-idem-admin-token`, or `x_idem_admin_token`, which CGI-style
/// servers map to the same variable).
pub(super) fn strip_admin_token(headers: &mut HeaderMap) {
    headers.remove(ADMIN_TOKEN);
    let token = ADMIN_TOKEN;
    let official = token.as_str().as_bytes();
    let alias = |name: &HeaderName| {
        let name = name.as_str().as_bytes();
        name.len() == official.len()
            && name.contains(&b'_')
            && name
                .iter()
                .zip(official)
                .all(|(&a, &b)| a == b || (a == b'_' && b == b'-'))
    };
    let aliases: Vec<HeaderName> = headers.keys().filter(|name| alias(name)).cloned().collect();
    for name in aliases {
        headers.remove(name);
    }
}

pub(super) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(super) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(super) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Every value of `name`, joined with `, `, then `value`.
pub(super) fn appended(
    headers: &http::HeaderMap,
    name: &HeaderName,
    value: &str,
) -> Option<HeaderValue> {
    if !headers.contains_key(name) {
        // The usual case: nothing to join.
        return HeaderValue::from_str(value).ok();
    }
    let mut all: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    all.push(value);
    HeaderValue::from_str(&all.join(", ")).ok()
}

/// A `Forwarded` parameter value: quoted unless a plain token.
pub(super) fn forwarded_value(value: &str) -> String {
    let token = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if token {
        value.to_owned()
    } else {
        format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

/// Tells the upstream who the client is, as `style` says.
pub(super) fn add_forwarded(
    headers: &mut http::HeaderMap,
    style: Forwarded,
    peer: Option<std::net::IpAddr>,
    host: Option<&str>,
) {
    // A dual-stack listener sees an IPv4 client as `::ffff:a.b.c.d`: told
    // as the IPv4 address it is.
    let peer = peer.map(|ip| ip.to_canonical());
    match style {
        Forwarded::None => {}
        Forwarded::XForwarded => {
            if let Some(value) =
                peer.and_then(|ip| appended(headers, &X_FORWARDED_FOR, &ip_text(ip)))
            {
                headers.insert(X_FORWARDED_FOR, value);
            }
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
            if let Some(value) = host.and_then(|h| HeaderValue::from_str(h).ok()) {
                headers.insert(X_FORWARDED_HOST, value);
            }
        }
        Forwarded::Rfc7239 => {
            let mut element = Vec::new();
            if let Some(ip) = peer {
                let node = match ip {
                    std::net::IpAddr::V4(_) => ip_text(ip),
                    std::net::IpAddr::V6(v6) => format!("[{v6}]"),
                };
                element.push(format!("for={}", forwarded_value(&node)));
            }
            element.push("proto=http".to_owned());
            if let Some(host) = host {
                element.push(format!("host={}", forwarded_value(host)));
            }
            if let Some(value) = appended(headers, &header::FORWARDED, &element.join(";")) {
                headers.insert(header::FORWARDED, value);
            }
        }
    }
}

/// The `Host` header of requests to `upstream`, as the HTTP/1.1 client
/// writes it when a request has none: the host, and `:port` unless the
/// port is the scheme's default (`http` when the URL names none).
pub(super) fn upstream_host(upstream: &http::Uri) -> Option<HeaderValue> {
    let host = upstream.host()?;
    let secure = matches!(upstream.scheme_str(), Some("https" | "wss"));
    let value = match upstream.port_u16() {
        Some(443) if secure => host.to_owned(),
        Some(80) if !secure => host.to_owned(),
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    };
    HeaderValue::try_from(value).ok()
}

/// An address as `Display` writes it; an IPv4 one from its octets, without
/// the formatting machinery (every request through the gateway writes the
/// client's address).
fn ip_text(ip: std::net::IpAddr) -> String {
    let std::net::IpAddr::V4(v4) = ip else {
        return ip.to_string();
    };
    let mut text = String::with_capacity(15);
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text.push('.');
        }
        text.push_str(itoa::Buffer::new().format(octet));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `Host` an HTTP/1.1 upstream is sent is what the client would
    /// write: the host, and the port unless it is the scheme's default.
    #[test]
    fn the_upstream_host_leaves_out_the_schemes_default_port() {
        for (upstream, expected) in [
            ("http://127.0.0.1:9", Some("127.0.0.1:9")),
            ("http://api.example:80", Some("api.example")),
            ("http://api.example", Some("api.example")),
            ("https://api.example:443", Some("api.example")),
            ("https://api.example:8443", Some("api.example:8443")),
            ("https://api.example:80", Some("api.example:80")),
            ("127.0.0.1:9", Some("127.0.0.1:9")),
            ("http://[::1]:9", Some("[::1]:9")),
            ("/no-authority", None),
        ] {
            let uri: http::Uri = upstream.parse().expect("upstream");
            let host = upstream_host(&uri);
            assert_eq!(
                host.as_ref().map(|h| h.to_str().expect("text")),
                expected,
                "{upstream}"
            );
        }
    }

    proptest::proptest! {
        /// An address's text is what `Display` writes, IPv4 and IPv6.
        #[test]
        fn an_address_is_written_as_display_writes_it(
            v4 in proptest::prelude::any::<[u8; 4]>(),
            v6 in proptest::prelude::any::<[u16; 8]>(),
        ) {
            let v4 = std::net::IpAddr::from(v4);
            proptest::prop_assert_eq!(ip_text(v4), v4.to_string());
            let v6 = std::net::IpAddr::from(v6);
            proptest::prop_assert_eq!(ip_text(v6), v6.to_string());
        }
    }

    /// An IPv4 client seen through a dual-stack listener is told as its
    /// IPv4 address in `X-Forwarded-For` and in `Forwarded`; an IPv6 one
    /// as it is, bracketed in `Forwarded`.
    #[test]
    fn a_mapped_ipv4_client_is_told_as_ipv4() {
        let mapped: std::net::IpAddr = "::ffff:127.0.0.1".parse().expect("ip");
        let v6: std::net::IpAddr = "2001:db8::1".parse().expect("ip");
        for (peer, xff, forwarded) in [
            (mapped, "127.0.0.1", "for=127.0.0.1;proto=http"),
            (v6, "2001:db8::1", "for=\"[2001:db8::1]\";proto=http"),
        ] {
            let mut headers = HeaderMap::new();
            add_forwarded(&mut headers, Forwarded::XForwarded, Some(peer), None);
            assert_eq!(headers[&X_FORWARDED_FOR], xff);
            let mut headers = HeaderMap::new();
            add_forwarded(&mut headers, Forwarded::Rfc7239, Some(peer), None);
            assert_eq!(headers[&header::FORWARDED], forwarded);
        }
    }
}
