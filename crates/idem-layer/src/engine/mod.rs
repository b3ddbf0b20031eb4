//! The engine: what every way into the layer (the HTTP service, commands)
//! shares, written once. A request is admitted ([`admit`]: the reservation
//! loop), its action runs under a kept lease ([`renewing`]), and its
//! outcome is settled ([`settle`]: stored or released, in the background
//! when the store does not take it at once). The HTTP service and the
//! command API only translate what the engine answers.

mod admit;
mod lease;
mod settle;

use std::time::Duration;

pub(crate) use crate::found::Found;
pub(crate) use admit::{Admission, admit};
pub(crate) use lease::{Lapse, renewing};
pub(crate) use settle::settle;

/// `now + bound`, saturating far in the future instead of overflowing.
pub(crate) fn deadline_after(bound: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(bound)
        .unwrap_or_else(|| now + crate::MAX_DURATION)
}
