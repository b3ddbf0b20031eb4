//! Retry storms: what keeps duplicates of one key from each costing the
//! store a call. Completed records this process was answered with are
//! replayed from memory ([`ReplayCache`]), and duplicates that arrive
//! together share one reservation round ([`flight`]).

mod cache;
mod flight;

pub(crate) use cache::ReplayCache;
pub(crate) use flight::{Flight, Flights, Role, Shared, follow};
