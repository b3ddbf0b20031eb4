//! The Prometheus exporter: histograms with the gateway's buckets, installed once.

use std::{sync::OnceLock, time::Duration};

use metrics_exporter_prometheus::PrometheusHandle;

/// Latency buckets, in seconds: store calls take tens of microseconds,
/// requests up to the upstream timeout.
pub(crate) const LATENCY_BUCKETS: [f64; 18] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Replay-age buckets, in seconds: from a second to a day's retention.
pub(crate) const AGE_BUCKETS: [f64; 9] = [
    1.0, 10.0, 60.0, 600.0, 3_600.0, 21_600.0, 43_200.0, 86_400.0, 604_800.0,
];

/// The exporter with Prometheus histograms (buckets), not summaries:
/// histograms from several gateways can be summed, quantiles of summaries
/// cannot.
pub(crate) fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    // The bucket lists are constant and non-empty, so neither call fails;
    // if one did, the exporter would still work, with summaries.
    PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(idem_layer::metrics::REPLAY_AGE.to_owned()),
                &AGE_BUCKETS,
            )
        })
        .unwrap_or_else(|_| PrometheusBuilder::new())
}

/// The Prometheus recorder, installed once per process.
pub(crate) fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (tests); then the
        // handle renders what this one sees: nothing.
        let _ = metrics::set_global_recorder(recorder);
        // The recorder stays for the process: the layer's metrics are
        // registered with it once, not looked up per request.
        idem_layer::metrics::register_handles();
        // The gateway's own names, and the Redis store's, exist from the
        // start too: the alert rules and the dashboard in `deploy/` query
        // them before their first event (a test reads them off `/metrics`).
        let _ = metrics::gauge!("idem_records_lapsed");
        metrics::counter!("idem_records_incomplete_total").increment(0);
        metrics::counter!(idem_layer::sealing::UNOPENED).increment(0);
        metrics::counter!(idem_layer::metrics::RECORDS_ERASED).increment(0);
        // Histogram samples are drained into their buckets on a scrape or
        // by upkeep; without upkeep, a gateway nobody scrapes would keep
        // every sample (about 27 bytes a keyed request).
        let upkeep = handle.clone();
        let _ = std::thread::Builder::new()
            .name("metrics-upkeep".to_owned())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(5));
                    upkeep.run_upkeep();
                }
            });
        handle
    })
}

/// The gauges of a PostgreSQL store's connection pool, set now and every
/// second after: `idem_store_pool_connections{state="in_use"|"idle"}` and
/// `idem_store_pool_max`. With `idem_store_pool_timeouts_total` (calls
/// that found every connection in use for the store's pool timeout, and
/// were answered 503), they show a pool too small for the load.
pub(crate) fn watch_pool(pool: sqlx::PgPool) {
    // The recorder first: gauges set before it is installed are lost.
    prometheus();
    let max = f64::from(pool.options().get_max_connections());
    let set = move |pool: &sqlx::PgPool| {
        let (size, idle) = (
            pool.size(),
            u32::try_from(pool.num_idle()).unwrap_or(u32::MAX),
        );
        metrics::gauge!("idem_store_pool_connections", "state" => "in_use")
            .set(f64::from(size.saturating_sub(idle)));
        metrics::gauge!("idem_store_pool_connections", "state" => "idle").set(f64::from(idle));
        metrics::gauge!("idem_store_pool_max").set(max);
    };
    set(&pool);
    metrics::counter!("idem_store_pool_timeouts_total").increment(0);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            set(&pool);
        }
    });
}
