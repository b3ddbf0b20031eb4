//! The store conformance suite through PgBouncer in transaction pooling
//! mode (the distribution's PgBouncer 1.18, which keeps no prepared
//! statement across transactions): the store set up for it
//! (`transaction_pooler`) passes it whole, as it does on a direct
//! connection.

use std::sync::OnceLock;

use idem_postgres::PgStore;
use idem_tests::{RealClock, pgbouncer::PgBouncer, postgres_server::PgServer};

static BOUNCER: OnceLock<Option<PgBouncer>> = OnceLock::new();

/// A store on a fresh database of the shared server, through this test
/// binary's PgBouncer (as many server connections as the store's pool);
/// `None` skips (no PostgreSQL or PgBouncer, outside CI).
async fn store() -> Option<(PgStore, &'static PgBouncer)> {
    let server = PgServer::shared()?;
    let bouncer = BOUNCER
        .get_or_init(|| PgBouncer::spawn(server, 8))
        .as_ref()?;
    let store = bouncer.store(server);
    store.migrate().await.expect("migrate");
    Some((store, bouncer))
}

/// The store through PgBouncer; a test that fails prints PgBouncer's log
/// (a renewal that stalled behind the pooler once failed a test here
/// after 31 s, its cause unknown).
async fn harness() -> Option<RealClock<PgStore>> {
    let (store, bouncer) = store().await?;
    Some(RealClock::new(store, bouncer.log_on_failure()))
}

idem_core::conformance_tests!(harness, records_admin);
