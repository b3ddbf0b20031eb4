//! The protocol's vocabulary, shared by the server side (`idem-layer`, the
//! gateway) and the calling side (`idem-client`): header names (lower
//! case, as HTTP/2 sends them) and the problem `code`s a client acts on.

/// The request header that carries the idempotency key (an RFC 8941
/// sf-string or token).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header on a replayed outcome: `true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The header the gateway adds toward its upstream: the attempt's lease
/// generation (1 for the first attempt, higher after a takeover).
pub const IDEMPOTENCY_ATTEMPT: &str = "idempotency-attempt";

/// The media type of every refusal.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Problem `code`s a client acts on.
pub mod codes {
    /// 409: another attempt with this key is running; retry after
    /// `Retry-After`.
    pub const IN_PROGRESS: &str = "idempotency_in_progress";
    /// 422: the key was used with another payload; never retry.
    pub const CONFLICT: &str = "idempotency_conflict";
    /// 410: the request with this key was cancelled.
    pub const CANCELLED: &str = "idempotency_cancelled";
    /// 503: the store failed; retry after `Retry-After`.
    pub const STORE_UNAVAILABLE: &str = "idempotency_store_unavailable";
    /// 409: an answer fetched by its key whose attempt's outcome is
    /// unknown (it may have acted); ask again after `Retry-After`.
    pub const OUTCOME_UNKNOWN: &str = "idempotency_outcome_unknown";
    /// 413 (gRPC `RESOURCE_EXHAUSTED`): the request body is over the
    /// layer's limit; the same request never fits, so never retry it.
    pub const BODY_TOO_LARGE: &str = "request_body_too_large";
}

/// The metadata entry in which a gRPC caller gets a refusal's problem
/// `code` (the layer answers gRPC calls with gRPC statuses).
pub const GRPC_PROBLEM: &str = "idem-problem";

/// Whether `headers` describe a gRPC message: a `content-type` of
/// `application/grpc`, with or without a `+format` or parameters; not
/// gRPC-Web, whose trailers travel in its body.
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| {
            let value = value.as_bytes();
            value.len() >= GRPC.len()
                && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
                && matches!(value.get(GRPC.len()), None | Some(b'+' | b';' | b' '))
        })
}

/// The `grpc-status` header's name (a constant: looked up without parsing
/// the name per request).
pub const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// The `grpc-timeout` header's name.
pub const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// The `grpc-status` in `headers` (a trailers block, or the head of a
/// trailers-only answer), when there is a readable one.
pub fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
    headers.get(GRPC_STATUS)?.to_str().ok()?.trim().parse().ok()
}

/// The caller's deadline in a gRPC request's `grpc-timeout` header: 1 to 8
/// digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`), as the gRPC over
/// HTTP/2 specification writes it. `None` when absent or unreadable.
pub fn grpc_timeout(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let value = headers.get(GRPC_TIMEOUT)?.as_bytes();
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// `bound` as a `grpc-timeout` value: whole milliseconds (at least 1) while
/// they fit the 8 digits the specification allows, else whole seconds,
/// minutes or hours (rounded down, at most 99,999,999 hours).
pub fn grpc_timeout_value(bound: std::time::Duration) -> String {
    const MAX: u128 = 99_999_999;
    let millis = bound.as_millis().max(1);
    if millis <= MAX {
        return format!("{millis}m");
    }
    let seconds = bound.as_secs();
    for (unit, per) in [('S', 1), ('M', 60), ('H', 3600)] {
        if u128::from(seconds / per) <= MAX {
            return format!("{}{unit}", seconds / per);
        }
    }
    format!("{MAX}H")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn timeout(value: &'static str) -> Option<Duration> {
        let mut headers = http::HeaderMap::new();
        headers.insert(GRPC_TIMEOUT, http::HeaderValue::from_static(value));
        grpc_timeout(&headers)
    }

    #[test]
    fn grpc_timeouts_read_as_the_specification_writes_them() {
        assert_eq!(timeout("300m"), Some(Duration::from_millis(300)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("5M"), Some(Duration::from_secs(300)));
        assert_eq!(timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for unreadable in ["", "m", "123456789m", "12x", "-1m", "1.5S", " 1S"] {
            assert_eq!(timeout(unreadable), None, "{unreadable:?}");
        }
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
    }

    proptest::proptest! {
        /// Any header value is read or refused, never a panic.
        #[test]
        fn any_grpc_timeout_value_is_read_or_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..16)) {
            let mut headers = http::HeaderMap::new();
            if let Ok(value) = http::HeaderValue::from_bytes(&bytes) {
                headers.insert(GRPC_TIMEOUT, value);
                let _ = grpc_timeout(&headers);
            }
        }

        /// A bound written and read again is the bound, to its unit.
        #[test]
        fn a_written_bound_reads_back(millis in 1u64..10_000_000_000) {
            let bound = Duration::from_millis(millis);
            let mut headers = http::HeaderMap::new();
            headers.insert(GRPC_TIMEOUT, grpc_timeout_value(bound).parse().expect("value"));
            let read = grpc_timeout(&headers).expect("read");
            proptest::prop_assert!(read <= bound);
            proptest::prop_assert!(bound - read < Duration::from_secs(1), "{read:?} for {bound:?}");
        }
    }

    #[test]
    fn a_bound_is_written_in_the_finest_unit_that_fits() {
        assert_eq!(grpc_timeout_value(Duration::from_secs(30)), "30000m");
        assert_eq!(grpc_timeout_value(Duration::ZERO), "1m");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        assert_eq!(grpc_timeout_value(Duration::MAX), "99999999H");
        for bound in [Duration::from_millis(1), Duration::from_secs(86_400 * 365)] {
            let mut headers = http::HeaderMap::new();
            let value = grpc_timeout_value(bound);
            headers.insert(GRPC_TIMEOUT, value.parse().expect("value"));
            assert!(
                grpc_timeout(&headers).is_some_and(|read| read <= bound),
                "{value}"
            );
        }
    }
}
