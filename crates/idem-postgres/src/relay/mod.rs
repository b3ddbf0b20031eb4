//! The outbox relay: publishes the events handlers committed (see
//! [`IdemTransaction::emit`](crate::IdemTransaction::emit)) to NATS
//! JetStream, in order, each once within the broker's duplicate window.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_postgres::{PgStore, relay::Relay};
//!
//! let store = PgStore::from_url("postgres://app@127.0.0.1/app")?;
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let relay = Relay::new(&store, async_nats::jetstream::new(nats));
//! relay.run(std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! # How a batch leaves
//!
//! One transaction per batch: `SELECT … WHERE published_at_ms IS NULL
//! ORDER BY seq LIMIT n FOR UPDATE` locks the oldest unpublished events;
//! each is published with its id as the message id (`Nats-Msg-Id`), the
//! broker's acknowledgements are awaited, the rows are marked published,
//! and the transaction commits.
//!
//! * **No cursor.** The relay never remembers "everything up to `seq` is
//!   out": a transaction that drew a lower `seq` but commits after a higher
//!   one would be skipped for good. It reads what is unpublished, whatever
//!   its `seq`, so a late commit leaves with the next batch.
//! * **A transaction's events in order.** A batch is sent in waves: each
//!   wave sends the next event of every transaction in it and awaits the
//!   acknowledgements, so a failed event holds back the ones after it in
//!   its transaction (never published ahead of it), and the other
//!   transactions go on. What the broker acknowledged is marked even when
//!   the batch failed, so it is not sent again. An event the broker
//!   refuses for good (larger than its `max_payload`) is set aside
//!   (`refused_at_ms`, `refusal`) and the rest goes on.
//! * **Several relays keep a scope's order.** The batch's rows stay locked
//!   until they are marked: a second relay's `FOR UPDATE` waits for them,
//!   then skips them (now published) and takes the rows after. Two relays
//!   never publish parts of one batch side by side, so the events of a
//!   scope (one transaction's, consecutive in `seq`) leave in the order
//!   they were emitted. A second relay is a standby, not more throughput.
//! * **Exactly once within the duplicate window.** A relay that dies after
//!   publishing and before its commit leaves the rows unpublished; the next
//!   batch publishes them again with the same message ids, and JetStream
//!   drops the copies it sees inside the stream's `duplicate_window`
//!   (two minutes by default). Beyond the window a copy is delivered
//!   again: the consumer deduplicates by event id (the message id), as
//!   `examples/charge-consumer` does with the idem layer.
//!
//! The relay wakes on `NOTIFY` (sent by the committing transaction) through
//! a connection of its own that `LISTEN`s, and polls besides. Behind a
//! transaction pooler no session can `LISTEN`: give it a direct URL with
//! [`Relay::listen_on`], or it polls only.
//!
//! Published events are kept for [`Relay::keep_published`] (an hour by
//! default), then swept in batches.
//!
//! # Metrics
//!
//! Through the `metrics` facade: `idem_outbox_published_total` (events
//! marked published, re-publishes the broker dropped among them),
//! `idem_outbox_duplicates_total` (those re-publishes),
//! `idem_outbox_publish_failures_total` (failed batches),
//! `idem_outbox_refused_total` (events set aside: the broker refuses them
//! for good), `idem_outbox_swept_total`, the gauge
//! `idem_outbox_refused_waiting` (those still set aside), the
//! histogram `idem_outbox_lag_seconds` (from the event's write in the
//! committing transaction to its mark, on the database's clock), and the
//! gauges `idem_outbox_backlog` (events not yet published) and
//! `idem_outbox_oldest_unpublished_seconds`.

use std::{pin::Pin, sync::Arc, time::Duration};

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use sqlx::{PgPool, Row, postgres::PgConnectOptions};
use tokio::sync::Notify;
use tokio_util::task::AbortOnDropHandle;

mod listen;
mod waves;

use listen::listen;
use waves::{Pending, Waves};

use crate::{PgStore, outbox, sql::NOW_MS};

/// Events published.
pub const PUBLISHED: &str = "idem_outbox_published_total";
/// Re-publishes the broker recognised by message id and dropped.
pub const DUPLICATES: &str = "idem_outbox_duplicates_total";
/// Batches that failed (database or broker); they are tried again.
pub const FAILURES: &str = "idem_outbox_publish_failures_total";
/// Events the broker refused for good (larger than its `max_payload`):
/// set aside, never published (see the [module](self)).
pub const REFUSED: &str = "idem_outbox_refused_total";
/// Events set aside (refused for good) still in the outbox, waiting for
/// an operator.
pub const SET_ASIDE: &str = "idem_outbox_refused_waiting";
/// Published events deleted by the sweep.
pub const SWEPT: &str = "idem_outbox_swept_total";
/// From an event's write (in its committing transaction) to its mark as
/// published, in seconds.
pub const LAG: &str = "idem_outbox_lag_seconds";
/// Events committed and not yet published.
pub const BACKLOG: &str = "idem_outbox_backlog";
/// The age of the oldest unpublished event, in seconds (0 when none).
pub const OLDEST: &str = "idem_outbox_oldest_unpublished_seconds";

/// A point of a batch, for [`Relay::on_stage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// The batch's rows are locked; nothing is published yet.
    Selected {
        /// How many events the batch holds.
        events: usize,
    },
    /// The broker acknowledged every event of the batch it can take (an
    /// event it refuses for good is set aside); they are not marked yet.
    Published {
        /// How many events the batch holds.
        events: usize,
    },
}

/// What [`Relay::on_stage`] calls.
type StageHook = Arc<dyn Fn(Stage) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Why a batch was not published.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The database failed or refused a statement.
    #[error("outbox database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The broker refused a publish or did not acknowledge it.
    #[error("publishing an outbox event failed: {0}")]
    Publish(String),
}

/// The unpublished events and the oldest one's age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Events committed and not yet published (those set aside apart).
    pub events: u64,
    /// How long the oldest of them has waited (zero when none).
    pub oldest: Duration,
    /// Events set aside because the broker refuses them for good, waiting
    /// for an operator (see the [module](self)).
    pub refused: u64,
}

/// The relay's statements for one records table.
struct Statements {
    select: String,
    refuse: String,
    mark: String,
    sweep: String,
    backlog: String,
    channel: String,
}

impl Statements {
    fn new(records: &str) -> Self {
        let outbox = outbox::table(records);
        Self {
            select: format!(
                "SELECT seq, id, subject, payload FROM {outbox} \
                 WHERE published_at_ms IS NULL AND refused_at_ms IS NULL \
                 ORDER BY seq LIMIT $1 FOR UPDATE"
            ),
            refuse: format!(
                "UPDATE {outbox} SET refused_at_ms = {NOW_MS}, refusal = $2 WHERE seq = $1"
            ),
            mark: format!(
                "UPDATE {outbox} SET published_at_ms = {NOW_MS} WHERE seq = ANY($1) \
                 RETURNING published_at_ms - created_at_ms AS lag_ms"
            ),
            sweep: format!(
                "DELETE FROM {outbox} WHERE seq IN (SELECT seq FROM {outbox} \
                 WHERE published_at_ms IS NOT NULL AND published_at_ms <= {NOW_MS} - $1 \
                 ORDER BY published_at_ms LIMIT $2)"
            ),
            backlog: format!(
                "SELECT count(*) AS events, \
                   COALESCE({NOW_MS} - min(created_at_ms), 0) AS oldest_ms, \
                   (SELECT count(*) FROM {outbox} WHERE refused_at_ms IS NOT NULL \
                     AND published_at_ms IS NULL) AS refused \
                 FROM {outbox} WHERE published_at_ms IS NULL AND refused_at_ms IS NULL"
            ),
            channel: outbox::channel(records),
        }
    }
}

/// Publishes a store's outbox to JetStream. See the [module](self).
pub struct Relay {
    pool: PgPool,
    pooled: bool,
    jetstream: jetstream::Context,
    sql: Statements,
    batch: u32,
    poll: Option<Duration>,
    keep: Duration,
    listen: Option<PgConnectOptions>,
    stages: Option<StageHook>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("channel", &self.sql.channel)
            .field("batch", &self.batch)
            .field("listening", &self.listen.is_some())
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay of `store`'s outbox (its pool and table; behind a
    /// transaction pooler when the store is) publishing through
    /// `jetstream`. The streams that take the events' subjects must
    /// exist; their `duplicate_window` bounds exactly-once (see the
    /// [module](self)).
    pub fn new(store: &PgStore, jetstream: jetstream::Context) -> Self {
        let pooled = store.pooled();
        // A store on a direct connection can listen through its own
        // options; behind a pooler only a direct URL can.
        let listen = (!pooled).then(|| store.pool().connect_options().as_ref().clone());
        Self {
            pool: store.pool().clone(),
            pooled,
            jetstream,
            sql: Statements::new(store.table()),
            batch: 512,
            poll: None,
            keep: Duration::from_secs(3600),
            listen,
            stages: None,
        }
    }

    /// At most this many events per batch (default 512, at least 1).
    pub fn batch(mut self, events: u32) -> Self {
        self.batch = events.max(1);
        self
    }

    /// How often an idle relay looks for events besides being woken by
    /// `NOTIFY` (default 1 s when listening, 100 ms when not).
    pub fn poll_every(mut self, every: Duration) -> Self {
        self.poll = Some(every.max(Duration::from_millis(1)));
        self
    }

    /// How long published events are kept before the sweep deletes them
    /// (default an hour).
    pub fn keep_published(mut self, keep: Duration) -> Self {
        self.keep = keep;
        self
    }

    /// `LISTEN`s on a direct connection to this URL (needed behind a
    /// transaction pooler, where sessions cannot listen).
    pub fn listen_on(mut self, url: &str) -> Result<Self, sqlx::Error> {
        self.listen = Some(url.parse()?);
        Ok(self)
    }

    /// Never listens: polls only.
    pub fn without_listen(mut self) -> Self {
        self.listen = None;
        self
    }

    /// Calls `hook` at each [`Stage`] of every batch and waits for it (to
    /// trace batches, or to stop a relay at a chosen point in a test).
    pub fn on_stage<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(Stage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.stages = Some(Arc::new(move |stage| Box::pin(hook(stage))));
        self
    }

    async fn stage(&self, stage: Stage) {
        if let Some(hook) = &self.stages {
            hook(stage).await;
        }
    }

    /// Publishes one batch of the oldest unpublished events and marks it:
    /// how many the batch held (0: the outbox had none). On an error what
    /// the broker acknowledged is marked, and the rest is published again
    /// later (the broker drops copies within its duplicate window).
    pub async fn publish_once(&self) -> Result<usize, RelayError> {
        let result = self.publish_batch().await;
        if result.is_err() {
            metrics::counter!(FAILURES).increment(1);
        }
        result
    }

    async fn publish_batch(&self) -> Result<usize, RelayError> {
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(&self.sql.select)
            .persistent(!self.pooled)
            .bind(i64::from(self.batch))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(0);
        }
        let events = rows.len();
        self.stage(Stage::Selected { events }).await;
        let mut waves = Waves::of(rows)?;
        // In waves: each wave sends the next event of every transaction
        // (one scope's attempt, or a transaction without the layer) in the
        // batch, and awaits the broker's acknowledgements. A transaction
        // whose event failed sends nothing more (its events leave in the
        // order emitted, or not yet); the others go on. What the broker
        // acknowledged is marked, failure or not, so it is never sent
        // again.
        let mut acked = Vec::with_capacity(events);
        let mut duplicates = 0u64;
        let mut failure = None;
        while let Some(wave) = waves.next_wave() {
            let mut sent = Vec::with_capacity(wave.len());
            for (group, event) in wave {
                let Pending {
                    seq,
                    id,
                    subject,
                    payload,
                } = event;
                let message = PublishMessage::build()
                    .payload(payload.into())
                    .message_id(id);
                match self.jetstream.send_publish(subject, message).await {
                    Ok(ack) => sent.push((group, seq, ack)),
                    Err(error) if error.kind() == PublishErrorKind::MaxPayloadExceeded => {
                        // Never publishable: set aside, and its
                        // transaction's next events go on.
                        tracing::error!(seq, %error, "the broker refuses an outbox event for good; set aside");
                        sqlx::query(&self.sql.refuse)
                            .persistent(!self.pooled)
                            .bind(seq)
                            .bind(error.to_string())
                            .execute(&mut *tx)
                            .await?;
                        metrics::counter!(REFUSED).increment(1);
                    }
                    Err(error) => {
                        waves.stop(group);
                        failure.get_or_insert(RelayError::Publish(error.to_string()));
                    }
                }
            }
            for (group, seq, ack) in sent {
                match ack.await {
                    Ok(ack) => {
                        acked.push(seq);
                        duplicates += u64::from(ack.duplicate);
                    }
                    Err(error) => {
                        waves.stop(group);
                        failure.get_or_insert(RelayError::Publish(error.to_string()));
                    }
                }
            }
        }
        if failure.is_none() {
            self.stage(Stage::Published { events }).await;
        }
        let lags: Vec<i64> = sqlx::query_scalar(&self.sql.mark)
            .persistent(!self.pooled)
            .bind(&acked)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let histogram = metrics::histogram!(LAG);
        for lag in lags {
            histogram.record(Duration::from_millis(u64::try_from(lag).unwrap_or(0)).as_secs_f64());
        }
        metrics::counter!(PUBLISHED).increment(acked.len() as u64);
        metrics::counter!(DUPLICATES).increment(duplicates);
        match failure {
            Some(failure) => Err(failure),
            None => Ok(events),
        }
    }

    /// Deletes events published longer ago than
    /// [`keep_published`](Self::keep_published), in batches: how many.
    pub async fn sweep(&self) -> Result<u64, RelayError> {
        let keep = i64::try_from(self.keep.as_millis()).unwrap_or(i64::MAX / 2);
        let batch = i64::from(self.batch.max(1000));
        let mut total = 0;
        loop {
            let statement = sqlx::query(&self.sql.sweep).bind(keep).bind(batch);
            let deleted = crate::on_pool!(self, statement, execute)?.rows_affected();
            total += deleted;
            if deleted < u64::try_from(batch).unwrap_or(u64::MAX) {
                metrics::counter!(SWEPT).increment(total);
                return Ok(total);
            }
        }
    }

    /// The unpublished events and the oldest one's age; also sets the
    /// backlog gauges.
    pub async fn backlog(&self) -> Result<Backlog, RelayError> {
        let statement = sqlx::query(&self.sql.backlog);
        let row = crate::on_pool!(self, statement, fetch_one)?;
        let events: i64 = row.try_get("events")?;
        let oldest_ms: i64 = row.try_get("oldest_ms")?;
        let refused: i64 = row.try_get("refused")?;
        let backlog = Backlog {
            events: u64::try_from(events).unwrap_or(0),
            oldest: Duration::from_millis(u64::try_from(oldest_ms).unwrap_or(0)),
            refused: u64::try_from(refused).unwrap_or(0),
        };
        metrics::gauge!(BACKLOG).set(backlog.events as f64);
        metrics::gauge!(OLDEST).set(backlog.oldest.as_secs_f64());
        metrics::gauge!(SET_ASIDE).set(backlog.refused as f64);
        Ok(backlog)
    }

    /// Publishes until `shutdown` completes: a batch as soon as events
    /// are committed (woken by `NOTIFY`, or by polling), the backlog
    /// gauges every 5 s, the sweep every minute. Failures are logged,
    /// counted and retried with a growing pause (up to 5 s); only the
    /// shutdown ends it.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        register();
        let wake = Arc::new(Notify::new());
        let listener = self.listen.clone().map(|options| {
            let (wake, channel) = (wake.clone(), self.sql.channel.clone());
            AbortOnDropHandle::new(tokio::spawn(listen(options, channel, wake)))
        });
        let poll = self.poll.unwrap_or(if listener.is_some() {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(100)
        });
        // The chores run on their own schedule, busy or idle: a relay
        // behind a sustained load still reports its backlog.
        let mut chores = Chores::default();
        let mut pause = Duration::from_millis(100);
        tokio::pin!(shutdown);
        loop {
            // A relay kept busy by full batches still hears its shutdown.
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = std::future::ready(()) => {}
            }
            chores.run_due(&self).await;
            let wait = match self.publish_once().await {
                Ok(events) => {
                    pause = Duration::from_millis(100);
                    if events >= self.batch as usize {
                        continue;
                    }
                    poll
                }
                Err(error) => {
                    tracing::warn!(%error, retry_in = ?pause, "the outbox relay failed a batch");
                    // The pause holds whatever wakes the relay meanwhile
                    // (a commit's notification would retry at once).
                    tokio::select! {
                        () = &mut shutdown => return Ok(()),
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = wake.notified() => {}
                () = tokio::time::sleep(wait.min(chores.until_due())) => {}
            }
        }
    }
}

/// The relay's chores and when each is due: the backlog gauges every 5 s,
/// the sweep every minute (the first of each at once).
struct Chores {
    gauges: tokio::time::Instant,
    sweep: tokio::time::Instant,
}

impl Default for Chores {
    fn default() -> Self {
        let now = tokio::time::Instant::now();
        Self {
            gauges: now,
            sweep: now,
        }
    }
}

impl Chores {
    const GAUGES: Duration = Duration::from_secs(5);
    const SWEEP: Duration = Duration::from_secs(60);

    async fn run_due(&mut self, relay: &Relay) {
        let now = tokio::time::Instant::now();
        if now >= self.gauges {
            self.gauges = now + Self::GAUGES;
            if let Err(error) = relay.backlog().await {
                tracing::warn!(%error, "could not read the outbox backlog");
            }
        }
        if now >= self.sweep {
            self.sweep = now + Self::SWEEP;
            match relay.sweep().await {
                Ok(0) => {}
                Ok(swept) => tracing::debug!(swept, "swept published outbox events"),
                Err(error) => tracing::warn!(%error, "sweeping the outbox failed"),
            }
        }
    }

    /// How long until the next chore.
    fn until_due(&self) -> Duration {
        self.gauges
            .min(self.sweep)
            .saturating_duration_since(tokio::time::Instant::now())
    }
}

/// Registers the relay's metrics at zero, so that dashboards and alert
/// rules find them before the first event.
pub fn register() {
    for name in [PUBLISHED, DUPLICATES, FAILURES, REFUSED, SWEPT] {
        metrics::counter!(name).increment(0);
    }
    let _ = metrics::histogram!(LAG);
    metrics::gauge!(BACKLOG).set(0.0);
    metrics::gauge!(OLDEST).set(0.0);
    metrics::gauge!(SET_ASIDE).set(0.0);
}
