//! A NATS JetStream consumer of `charge` commands that runs each charge
//! once, whatever the broker redelivers.
//!
//! A message is `{"id": "...", "account": "...", "cents": 1299}` on the
//! `charges` subject. The account is the tenant. The idempotency key is the
//! message id (`Nats-Msg-Id`) when the message has one (an event published
//! by `outbox-relay` from idem's PostgreSQL outbox: its event id, the same
//! on every re-publish, so a copy the broker delivers again past its
//! duplicate window is still charged once), else the business id. Each charge runs through
//! [`IdempotencyLayer::run`](idem_layer::IdempotencyLayer::run): the first
//! delivery executes it (here: appends a line to the ledger file) and the
//! outcome is recorded; the message is acknowledged only after that (when
//! the store did not take the outcome at once, the consumer tells the
//! broker the work is in progress until the layer has recorded it). A
//! redelivery (the acknowledgement was lost, the consumer died after
//! executing) is answered from the record and acknowledged, without
//! charging again. A consumer that died between charging and recording
//! leaves the charge's outcome unknown: once its lease (`IDEM_LEASE`)
//! lapses, the redelivery takes the charge over, finds the charge in the
//! ledger ([`CommandContext::superseded`](idem_layer::CommandContext) says
//! to reconcile) and records it without charging again. A charge in
//! progress elsewhere is NAKed with a delay, a
//! temporary failure is NAKed for redelivery, and a changed payload under
//! a known id is terminated (never charged).
//!
//! Run with `cargo run -p charge-consumer` next to a `nats-server -js`
//! (`src/main.rs` calls [`run`]).
//! Environment: `NATS_URL` (`nats://127.0.0.1:4222`), `IDEM_STORE`
//! (`memory`, a `redis://` or a `postgres://` URL; use Redis or PostgreSQL
//! so records outlive the process), `LEDGER` (`charges.ledger`), `ACK_WAIT` (`30s`), `IDEM_LEASE`
//! (`30s`: how long a charge whose consumer died waits before a
//! redelivery takes it over and reconciles it against the ledger), `STREAM`
//! (`CHARGES`), `CONSUMER` (`charge-consumer`).

use std::{io::Write, time::Duration};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures_util::StreamExt;
use idem_core::{IdempotencyKey, Store};
use idem_layer::{ActionError, Command, CommandContext, CommandError, Done, IdempotencyLayer};
use serde::{Deserialize, Serialize};

/// A charge command as it arrives.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    id: String,
    account: String,
    cents: u64,
}

/// What a charge produced, stored and replayed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Receipt {
    charge: String,
    cents: u64,
    attempt: u64,
}

/// Why consuming stopped.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Appends one execution to the ledger and syncs it: the side effect whose
/// count the tests check. The ledger may be a named pipe.
fn record_charge(ledger: &str, charge: &Charge, attempt: u64) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ledger)?;
    writeln!(
        file,
        "charged {} {} cents (attempt {attempt})",
        charge.id, charge.cents
    )?;
    // A ledger that is a pipe (the tests read one) has nothing to sync.
    if file.metadata()?.is_file() {
        file.sync_data()?;
    }
    Ok(())
}

/// Whether the ledger holds a charge of `id` (how a takeover reconciles:
/// the charge itself is the evidence of an attempt that died before its
/// outcome was recorded). A ledger that is a pipe holds nothing to read.
fn charged_before(ledger: &str, id: &str) -> bool {
    let Ok(metadata) = std::fs::metadata(ledger) else {
        return false;
    };
    if !metadata.is_file() {
        return false;
    }
    let prefix = format!("charged {id} ");
    std::fs::read_to_string(ledger)
        .is_ok_and(|text| text.lines().any(|line| line.starts_with(&prefix)))
}

/// The key a charge runs under: an outbox event's id, else the business
/// id; `None` (logged) when it is no valid key.
fn key_of(message: &jetstream::Message, charge: &Charge) -> Option<IdempotencyKey> {
    let id = message
        .headers
        .as_ref()
        .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
        .map_or(charge.id.as_str(), |id| id.as_str());
    let key = IdempotencyKey::parse(id.as_bytes()).ok();
    if key.is_none() {
        eprintln!("charge-consumer: {id:?} is no valid key, terminated");
    }
    key
}

/// The charge itself, once per key: on a takeover (the attempt before
/// died with its outcome unknown, after charging or before), reconciled by
/// the charge's id against the ledger before charging again.
async fn charge_once(
    ledger: &str,
    charge: Charge,
    ctx: CommandContext,
) -> Result<Receipt, ActionError<String>> {
    if ctx.superseded.is_some() && charged_before(ledger, &charge.id) {
        eprintln!(
            "charge-consumer: {} was charged by the attempt before; not again",
            charge.id
        );
        return Ok(Receipt {
            charge: charge.id,
            cents: charge.cents,
            attempt: ctx.generation,
        });
    }
    eprintln!(
        "charge-consumer: charging {} (attempt {})",
        charge.id, ctx.generation
    );
    record_charge(ledger, &charge, ctx.generation)
        .map_err(|error| ActionError::Temporary(error.to_string()))?;
    #[cfg(feature = "test-hooks")]
    crash_point_before_record(&charge.id).await;
    Ok(Receipt {
        charge: charge.id,
        cents: charge.cents,
        attempt: ctx.generation,
    })
}

/// Handles one message: runs the charge once, then acknowledges, NAKs or
/// terminates it.
async fn handle<S: Store>(
    layer: &IdempotencyLayer<S>,
    ledger: &str,
    ack_wait: Duration,
    message: &jetstream::Message,
) -> Result<(), Error> {
    let charge: Charge = match serde_json::from_slice(&message.payload) {
        Ok(charge) => charge,
        Err(error) => {
            eprintln!("charge-consumer: unreadable message, terminated: {error}");
            return message.ack_with(AckKind::Term).await;
        }
    };
    let Some(key) = key_of(message, &charge) else {
        return message.ack_with(AckKind::Term).await;
    };
    let command = Command::new(charge.account.clone(), "charge", key, &charge)?;
    let result = layer
        .run(&command, |ctx| charge_once(ledger, charge.clone(), ctx))
        .await;
    let kind = ack_kind(result, &charge.id, message, ack_wait).await?;
    message.ack_with(kind).await
}

/// How the message of `charge` is answered to the broker, by what running
/// it under its key settled: acknowledged once its outcome is recorded,
/// NAKed for a redelivery, or terminated.
async fn ack_kind(
    result: Result<Done<Receipt>, CommandError<String>>,
    charge: &str,
    message: &jetstream::Message,
    ack_wait: Duration,
) -> Result<AckKind, Error> {
    Ok(match result {
        Ok(Done::Ran(receipt)) => {
            eprintln!(
                "charge-consumer: executed {} (attempt {})",
                receipt.charge, receipt.attempt
            );
            #[cfg(feature = "test-hooks")]
            crash_point(&receipt.charge).await;
            AckKind::Ack
        }
        Ok(Done::Unrecorded { value, recording }) => {
            eprintln!(
                "charge-consumer: executed {} (attempt {}); acknowledging once it is recorded",
                value.charge, value.attempt
            );
            acknowledge_once_recorded(message, &recording, ack_wait).await?
        }
        Ok(Done::Replayed(receipt)) => {
            eprintln!(
                "charge-consumer: answered {} from the record",
                receipt.charge
            );
            AckKind::Ack
        }
        Err(CommandError::Failed {
            error, recording, ..
        }) => {
            eprintln!("charge-consumer: {} failed for good: {error}", charge);
            match recording {
                Some(recording) => acknowledge_once_recorded(message, &recording, ack_wait).await?,
                None => AckKind::Ack,
            }
        }
        Err(CommandError::InProgress { retry_after }) => AckKind::Nak(Some(retry_after)),
        Err(CommandError::ResultNotStored { status }) => {
            // Ran on an earlier delivery; its result was not kept. It must
            // not run again: acknowledged.
            eprintln!(
                "charge-consumer: {} ran before (status {status}); its result was not stored",
                charge
            );
            AckKind::Ack
        }
        Err(CommandError::Conflict) => {
            eprintln!(
                "charge-consumer: {} arrived with another payload, terminated",
                charge
            );
            AckKind::Term
        }
        Err(CommandError::Cancelled) => AckKind::Term,
        Err(error) => {
            eprintln!("charge-consumer: {} will be redelivered: {error}", charge);
            AckKind::Nak(Some(Duration::from_secs(1)))
        }
        Ok(other) => {
            eprintln!("charge-consumer: {} settled: {other:?}", charge);
            AckKind::Nak(Some(Duration::from_secs(1)))
        }
    })
}

/// Waits until the layer recorded an outcome the store did not take at
/// once, telling the broker every third of its ack wait that the message
/// is still being worked on (so it is not redelivered meanwhile): then
/// acknowledged. One the layer gave up on is NAKed, and its redelivery
/// is answered from what the store holds.
async fn acknowledge_once_recorded(
    message: &jetstream::Message,
    recording: &idem_layer::Recording,
    ack_wait: Duration,
) -> Result<AckKind, Error> {
    let mut progress = tokio::time::interval(ack_wait / 3);
    let recorded = recording.recorded();
    tokio::pin!(recorded);
    loop {
        tokio::select! {
            recorded = &mut recorded => {
                return Ok(if recorded {
                    eprintln!("charge-consumer: the outcome is recorded; acknowledged");
                    AckKind::Ack
                } else {
                    AckKind::Nak(Some(Duration::from_secs(1)))
                });
            }
            _ = progress.tick() => message.ack_with(AckKind::Progress).await?,
        }
    }
}

/// For the crash tests (feature `test-hooks`): with
/// `CONSUMER_CRASH_AFTER_EXECUTE=<id>`, the consumer stops right after
/// executing that charge, before acknowledging it, and waits to be killed.
#[cfg(feature = "test-hooks")]
async fn crash_point(id: &str) {
    if std::env::var("CONSUMER_CRASH_AFTER_EXECUTE").is_ok_and(|crash| crash == id) {
        eprintln!("charge-consumer: crash point: executed {id}, not acknowledged");
        std::future::pending::<()>().await;
    }
}

/// For the crash tests (feature `test-hooks`): with
/// `CONSUMER_CRASH_BEFORE_RECORD=<id>`, the consumer stops right after
/// charging that id, before its outcome is recorded, and waits to be
/// killed.
#[cfg(feature = "test-hooks")]
async fn crash_point_before_record(id: &str) {
    if std::env::var("CONSUMER_CRASH_BEFORE_RECORD").is_ok_and(|crash| crash == id) {
        eprintln!("charge-consumer: crash point: charged {id}, not recorded");
        std::future::pending::<()>().await;
    }
}

async fn consume<S: Store>(layer: IdempotencyLayer<S>) -> Result<(), Error> {
    let lease = humantime::parse_duration(&env("IDEM_LEASE", "30s"))
        .map_err(|error| format!("IDEM_LEASE: {error}"))?;
    if lease.is_zero() {
        return Err("IDEM_LEASE must be longer than zero".into());
    }
    let layer = layer.timing(|t| t.lease(lease));
    let url = env("NATS_URL", "nats://127.0.0.1:4222");
    let ledger = env("LEDGER", "charges.ledger");
    let ack_wait = humantime::parse_duration(&env("ACK_WAIT", "30s"))
        .map_err(|error| format!("ACK_WAIT: {error}"))?;
    if ack_wait.is_zero() {
        return Err("ACK_WAIT must be longer than zero".into());
    }
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: env("STREAM", "CHARGES"),
            subjects: vec!["charges".to_owned()],
            ..Default::default()
        })
        .await?;
    let name = env("CONSUMER", "charge-consumer");
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                ack_wait,
                ..Default::default()
            },
        )
        .await?;
    let mut messages = consumer.messages().await?;
    println!("charge-consumer consuming from {url} as {name}");
    while let Some(message) = messages.next().await {
        let message = message?;
        if let Err(error) = handle(&layer, &ledger, ack_wait, &message).await {
            eprintln!("charge-consumer: could not settle a message: {error}");
        }
    }
    Ok(())
}

/// Consumes `charge` commands until the stream ends, on the store
/// `IDEM_STORE` names (`memory`, a `redis://` or a `postgres://` URL).
pub async fn run() -> Result<(), Error> {
    let store = env("IDEM_STORE", "memory");
    if store == "memory" {
        consume(IdempotencyLayer::new(idem_memory::MemoryStore::new())).await
    } else if store.starts_with("postgres://") || store.starts_with("postgresql://") {
        let store = idem_postgres::PgStore::from_url(&store)?;
        store.migrate().await?;
        consume(IdempotencyLayer::new(store)).await
    } else {
        consume(IdempotencyLayer::new(idem_redis::RedisStore::from_url(
            &store,
        )?))
        .await
    }
}
