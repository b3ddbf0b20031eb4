//! The `idem_records_lapsed` gauge: one gateway of a fleet counts the
//! processing records past their lease, within a share of the time.

use std::time::Duration;

use idem_core::{Fleet, RecordsAdmin};

/// How often the gauge of lapsed records is refreshed, at most.
pub(crate) const LAPSED_EVERY: Duration = Duration::from_secs(5);

/// The gauge's sweep runs at most one part in this many of the time: a
/// sweep that took longer than `LAPSED_EVERY / LAPSED_IDLE_PARTS` (a Redis
/// store looks at every record key) waits this many times its own
/// length before the next.
pub(crate) const LAPSED_IDLE_PARTS: u32 = 50;

/// How long a count of the lapsed records may take (a Redis store reads
/// every record it holds to count them); a count that fails or takes
/// longer is logged and the gauge keeps its last value.
pub(crate) const LAPSED_COUNT_BOUND: Duration = Duration::from_secs(30);

/// The gauge of lapsed records counts no further than this.
pub(crate) const LAPSED_COUNTED: usize = 10_000;

/// The wait before the next sweep of lapsed records, after one that took
/// `took`.
pub(crate) fn lapsed_wait(took: Duration) -> Duration {
    LAPSED_EVERY.max(took.saturating_mul(LAPSED_IDLE_PARTS))
}

/// The chore of counting lapsed records, which one gateway of a fleet
/// sharing a store does ([`Fleet::claim_duty`](idem_core::Fleet::claim_duty)).
pub(crate) const LAPSED_DUTY: &str = "lapsed-records";

/// How long a gateway's claim on [`LAPSED_DUTY`] lasts past its next
/// round: a gateway that stopped hands the chore on after this.
pub(crate) const LAPSED_CLAIM_SLACK: Duration = Duration::from_secs(15);

/// Keeps `idem_records_lapsed` (processing records past their lease, with
/// no retry yet: stuck, for an operator) up to date. Of the gateways
/// sharing a store, the one that holds the chore counts them (a Redis
/// store looks at every record key to find them) and the others show
/// 0, so the gauge's sum or maximum over a fleet is the store's count.
pub(crate) fn watch_lapsed<S: RecordsAdmin + Fleet>(store: std::sync::Arc<S>) {
    tokio::spawn(async move {
        let holder = idem_core::OwnerToken::new().0.to_string();
        let bound = Duration::from_secs(10);
        let mut wait = LAPSED_EVERY;
        loop {
            let claim = store.claim_duty(LAPSED_DUTY, &holder, wait + LAPSED_CLAIM_SLACK);
            wait = match tokio::time::timeout(bound, claim).await {
                Ok(Ok(true)) => {
                    let wait = count_lapsed(&*store).await;
                    if wait > LAPSED_EVERY {
                        // A long sweep waits longer: keep the chore for it.
                        let ttl = wait.saturating_add(LAPSED_CLAIM_SLACK);
                        let _ = tokio::time::timeout(
                            bound,
                            store.claim_duty(LAPSED_DUTY, &holder, ttl),
                        )
                        .await;
                    }
                    wait
                }
                Ok(Ok(false)) => {
                    metrics::gauge!("idem_records_lapsed").set(0.0);
                    LAPSED_EVERY
                }
                // The claim failed (a store down, or a PostgreSQL schema
                // from before the duties table): count as every gateway
                // did before; a store that is down fails the count too,
                // and the gauge keeps its value.
                _ => count_lapsed(&*store).await,
            };
            tokio::time::sleep(wait).await;
        }
    });
}

/// Counts the lapsed records into `idem_records_lapsed` (unless the
/// store fails within [`LAPSED_COUNT_BOUND`]); the wait before the next
/// count.
pub(crate) async fn count_lapsed<S: RecordsAdmin>(store: &S) -> Duration {
    let bound = LAPSED_COUNT_BOUND;
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(bound, store.count_lapsed(LAPSED_COUNTED)).await {
        Ok(Ok(lapsed)) => metrics::gauge!("idem_records_lapsed").set(lapsed as f64),
        Ok(Err(error)) => tracing::warn!(
            %error,
            "could not count the lapsed records; idem_records_lapsed keeps its last value"
        ),
        Err(_) => tracing::warn!(
            ?bound,
            "counting the lapsed records took too long; idem_records_lapsed keeps its last value"
        ),
    }
    lapsed_wait(started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sweep_of_lapsed_records_waits_fifty_times_its_length() {
        assert_eq!(lapsed_wait(Duration::ZERO), LAPSED_EVERY);
        assert_eq!(lapsed_wait(Duration::from_millis(100)), LAPSED_EVERY);
        assert_eq!(
            lapsed_wait(Duration::from_secs(2)),
            Duration::from_secs(100)
        );
        assert_eq!(lapsed_wait(Duration::MAX), Duration::MAX);
    }
}
