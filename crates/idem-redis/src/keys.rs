//! Keys and the numbers written with them: where a record lives, and
//! durations in the milliseconds Redis takes.

use std::time::Duration;

/// The Redis key of a scope's record under `prefix`, in the pieces it is
/// written from: the scope hash's hex (`hex`, its
/// [`ScopeHash::hex_bytes`]) inside a hash tag, so that every key of one
/// record lands in one cluster slot.
pub(crate) fn record_key_pieces<'a>(prefix: &'a str, hex: &'a [u8; 64]) -> [&'a [u8]; 4] {
    [prefix.as_bytes(), b"{", hex, b"}"]
}

/// A claim's time to live in whole milliseconds, at least one (`PX`).
pub(crate) fn px(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A duration in whole milliseconds (saturating).
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
