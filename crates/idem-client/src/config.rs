//! A retry layer's settings, shared by its services.

use std::{sync::Arc, time::Duration};

use http::Method;
use tower::retry::budget::TpsBudget;

use crate::limits::Limits;

/// What a [`RetryLayer`](crate::RetryLayer) was set up with.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) max_attempts: u32,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) deadline: Duration,
    pub(crate) body_limit: usize,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) key_methods: Vec<Method>,
    pub(crate) budget: Arc<TpsBudget>,
    pub(crate) limits: Option<Limits>,
}
