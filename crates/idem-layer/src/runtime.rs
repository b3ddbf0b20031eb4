//! The [`Runtime`]: what the request path, the commands and the records
//! API share (the store as the layer calls it, the settings, and the work
//! that outlives a request).

use std::sync::Arc;

use idem_core::Store;
use tokio_util::task::TaskTracker;

use crate::{
    config::Config,
    stores::{LayerStore, wrap},
};

/// What every part of the layer works with: the store, the settings, and
/// the work that outlives its request, behind one reference count (cloned
/// several times per request, on every core at once: one shared count
/// instead of three); the public [`IdempotencyLayer`](crate::IdempotencyLayer)
/// holds one and hands it to the services it makes.
pub(crate) struct Runtime<S>(Arc<Shared<S>>);

/// The parts of a [`Runtime`].
pub(crate) struct Shared<S> {
    /// The store as it was given (claims, and the wrapping made again
    /// when a setting changes).
    pub(crate) given: Arc<S>,
    /// The store as the layer calls it (see [`stores`](crate::stores)):
    /// `given` wrapped for the settings.
    pub(crate) store: Arc<LayerStore<S>>,
    pub(crate) config: Arc<Config>,
    /// Work that outlives its request: detached handlers, completions
    /// retried after a store error, answers awaited after an unknown
    /// outcome. Shared by clones; `IdempotencyLayer::drain` waits for it.
    pub(crate) tasks: TaskTracker,
    /// The records API's listings, shared by every records service of the
    /// layer.
    pub(crate) listings: Arc<crate::listing::ListingBudget>,
    /// Outcomes held here that a store error kept from being recorded
    /// yet, by scope (see [`pending`](crate::pending)).
    pub(crate) pending: Arc<crate::pending::Pending>,
    /// Whether `config` passed validation, decided once (a router may
    /// apply the layer per request) and again after every change.
    pub(crate) valid: std::sync::OnceLock<bool>,
    /// Completed records this process was answered with (see
    /// [`ReplayCache`](crate::storm::ReplayCache)), made at first use from
    /// the settings; none when they turn it off.
    pub(crate) replays: std::sync::OnceLock<Option<crate::storm::ReplayCache>>,
    /// The reservations in flight, by scope (single flight), shared by
    /// the clones of a layer until one's settings change.
    pub(crate) flights: Arc<crate::storm::Flights>,
    /// Cancelled when the server stops taking requests
    /// ([`IdempotencyLayer::close`](crate::IdempotencyLayer::close)):
    /// answers fetched by key stop waiting.
    pub(crate) closing: tokio_util::sync::CancellationToken,
}

impl<S> Runtime<S> {
    pub(crate) fn new(store: S, config: Config) -> Self
    where
        S: Store,
    {
        let given = Arc::new(store);
        Self(Arc::new(Shared {
            store: wrap(&given, &config),
            given,
            config: Arc::new(config),
            tasks: TaskTracker::new(),
            listings: Default::default(),
            pending: Default::default(),
            valid: std::sync::OnceLock::new(),
            replays: std::sync::OnceLock::new(),
            flights: Default::default(),
            closing: Default::default(),
        }))
    }

    /// The replay cache, if the settings keep one.
    pub(crate) fn replays(&self) -> Option<&crate::storm::ReplayCache>
    where
        S: Store,
    {
        self.0
            .replays
            .get_or_init(|| {
                let config = &self.0.config;
                let (bytes, bound) = config.replay_cache;
                let feed = || self.0.store.erasures();
                crate::storm::ReplayCache::new(bytes, bound, feed, config.timing.store_timeout)
            })
            .as_ref()
    }

    /// Changes the settings while the layer is being built (copied on
    /// write if services already share them), and wraps the store for
    /// them again.
    pub(crate) fn configure(&mut self, change: impl FnOnce(&mut Config))
    where
        S: Store,
    {
        let shared = Arc::make_mut(&mut self.0);
        shared.valid = std::sync::OnceLock::new();
        shared.replays = std::sync::OnceLock::new();
        // Reservations in flight are shared by layers of one set of
        // settings only: a duplicate that followed another layer's would
        // be answered by that layer's settings (its in-flight mode, its
        // keyring), not its own.
        shared.flights = Default::default();
        change(Arc::make_mut(&mut shared.config));
        shared.store = wrap(&shared.given, &shared.config);
    }
}

impl<S> Clone for Runtime<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self {
            given: Arc::clone(&self.given),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            tasks: self.tasks.clone(),
            listings: Arc::clone(&self.listings),
            pending: Arc::clone(&self.pending),
            valid: self.valid.clone(),
            // Made again from the settings, which a copy is taken to change.
            replays: std::sync::OnceLock::new(),
            flights: Arc::clone(&self.flights),
            closing: self.closing.clone(),
        }
    }
}

impl<S> std::ops::Deref for Runtime<S> {
    type Target = Shared<S>;

    fn deref(&self) -> &Shared<S> {
        &self.0
    }
}
