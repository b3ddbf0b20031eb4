//! The store the layer calls: the store it was given, wrapped once when
//! the layer is built in what every call of it needs, so that the code
//! that uses it never seals, times or classifies a call by hand.
//!
//! [`LayerStore`] is [`Sealed`] around [`Bounded`] around the given store:
//!
//! * [`Bounded`] gives each call the layer's store timeout (or, for a
//!   records listing, at least [`LISTING_TIMEOUT`]), records its latency
//!   in `idem_store_duration_seconds`, and says what a timeout means
//!   (behind a pooler that queues calls, busy; else a timeout);
//! * [`Sealed`] seals the response a completion stores with the layer's
//!   keyring, bound to the record and the attempt that produced it, and
//!   opens every stored response in an answer that the request path
//!   replays (a reservation's, a completion's or a release's), so a
//!   response that does not open is an error, never bytes sent.
//!
//! Both implement the store traits the wrapped store implements
//! ([`Store`](idem_core::Store), [`RecordsAdmin`](idem_core::RecordsAdmin),
//! [`Fleet`](idem_core::Fleet)), so the records API, the gateway's
//! operator page and a test all get them through
//! [`IdempotencyLayer::store`](crate::IdempotencyLayer::store). Reads for
//! inspection ([`Store::get`](idem_core::Store::get), listings) and an
//! operator's acts (cancellations, forced releases, erasures) hand the
//! record out as it is kept, sealed or not: an operator can still read,
//! cancel, release or erase a record whose response no key here opens.

mod bounded;
mod sealed;

use std::sync::Arc;

pub use bounded::{Bounded, LISTING_TIMEOUT};
pub use sealed::Sealed;

use crate::config::Config;

/// The store as the layer calls it: `S` with every call bounded and
/// timed, and responses sealed at rest when the layer has a keyring.
pub type LayerStore<S> = Sealed<Bounded<S>>;

/// `store` wrapped for `config` (made again whenever a setting changes
/// while the layer is built).
pub(crate) fn wrap<S: idem_core::Store>(store: &Arc<S>, config: &Config) -> Arc<LayerStore<S>> {
    let bounded = Bounded::new(Arc::clone(store), config.timing.store_timeout);
    Arc::new(Sealed::new(bounded, config.sealing.clone()))
}
