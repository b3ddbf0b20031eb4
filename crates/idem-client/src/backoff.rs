//! Exponential backoff with full jitter, and `Retry-After`.

use std::time::{Duration, SystemTime};

/// The upper bound of the delay before retry number `retry` (1 for the
/// first retry): `min(max, base * 2^(retry - 1))`.
pub fn ceiling(base: Duration, max: Duration, retry: u32) -> Duration {
    let factor = 2u32
        .checked_pow(retry.saturating_sub(1))
        .unwrap_or(u32::MAX);
    base.checked_mul(factor).unwrap_or(max).min(max)
}

/// Full jitter: a uniformly random delay in `[0, ceiling]`.
pub fn full_jitter(base: Duration, max: Duration, retry: u32) -> Duration {
    let ceiling = ceiling(base, max, retry);
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::random_range(0..=nanos))
}

/// Parses a `Retry-After` value (RFC 9110 section 10.2.3): delay-seconds or
/// an HTTP-date, taken relative to `now`. `None` for anything else, so the
/// caller falls back to backoff. A date in the past is a zero delay.
pub fn parse_retry_after(value: &[u8], now: SystemTime) -> Option<Duration> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // Very long digit strings saturate rather than fail.
        return Some(Duration::from_secs(text.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}
