//! The handler's transaction, committed together with the outcome.

use std::ops::{Deref, DerefMut};

use bytes::Bytes;
use idem_core::{
    Completion, CompletionSlot, Current, DeferredCompletion, Lease, Outcome, Release, Store,
    StoreError, handoff::BoxFuture,
};
use sqlx::{PgConnection, Postgres, Transaction};

use crate::{
    PgStore, failed,
    outbox::{self, Emitted},
};

/// A transaction on the store's database for a handler's own writes.
///
/// Under the idempotency layer (the request carries the layer's
/// [`CompletionSlot`]), [`commit`](Self::commit) does not commit yet: it
/// hands the transaction to the layer, which writes the outcome in it once
/// the response is read and commits both with one `COMMIT`. Without the
/// layer, `commit` commits at once. Dropped without `commit`, it rolls
/// back.
///
/// Write through it as through any sqlx transaction:
/// `sqlx::query("…").execute(&mut *tx)`.
///
/// With axum, take it as an extractor; the router's state must give the
/// [`PgStore`] (`PgStore: FromRef<S>`):
///
/// ```no_run
/// use axum::{Json, Router, http::StatusCode, routing::post};
/// use idem_layer::{IdempotencyLayer, TenantFromHeader};
/// use idem_postgres::{IdemTransaction, PgStore};
///
/// async fn create(mut tx: IdemTransaction, Json(sku): Json<String>) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO orders (sku) VALUES ($1)")
///         .bind(sku)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     // Commits with the recorded response, once it is recorded.
///     tx.commit().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
///
/// # fn app(store: PgStore) -> Router {
/// Router::new()
///     .route("/orders", post(create))
///     .with_state(store.clone())
///     .layer(IdempotencyLayer::new(store).tenant(TenantFromHeader::from_static("x-tenant-id")))
/// # }
/// ```
pub struct IdemTransaction {
    tx: Transaction<'static, Postgres>,
    slot: Option<CompletionSlot>,
    store: PgStore,
    /// The events [`emit`](Self::emit) added, written when it commits.
    events: Vec<Emitted>,
}

impl std::fmt::Debug for IdemTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemTransaction")
            .field("deferred", &self.slot.is_some())
            .field("events", &self.events.len())
            .finish_non_exhaustive()
    }
}

/// [`IdemTransaction::commit`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// The database refused the commit (without the layer).
    #[error("commit failed: {0}")]
    Database(#[from] sqlx::Error),
    /// The attempt already handed a transaction to the layer; one outcome
    /// commits with one transaction. This one was rolled back.
    #[error("the attempt already handed a transaction to the idempotency layer")]
    AlreadyHandedOver,
}

/// [`IdemTransaction::emit`] refused an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EmitError {
    /// The subject is no NATS subject an event can be published on: empty,
    /// with whitespace or an empty token (`a..b`, a leading or trailing
    /// `.`), or with a wildcard token (`*`, `>`).
    #[error("{0:?} is not a subject an event can be published on")]
    Subject(String),
}

/// Whether `subject` is one an event can be published on (see
/// [`EmitError::Subject`]).
fn publishable(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token
                    .bytes()
                    .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        })
}

impl IdemTransaction {
    /// Begins a transaction for a request: `slot` is the layer's
    /// [`CompletionSlot`] from the request extensions (`None` when the layer
    /// did not run for it).
    pub async fn begin(store: &PgStore, slot: Option<CompletionSlot>) -> Result<Self, sqlx::Error> {
        let tx = store.pool().begin().await?;
        if let Some(slot) = &slot {
            slot.began();
        }
        Ok(Self {
            tx,
            slot,
            store: store.clone(),
            events: Vec::new(),
        })
    }

    /// Adds an event for the relay to publish on `subject` (the
    /// transactional outbox; the `relay` module, feature `relay`, publishes it).
    ///
    /// The event is written to the outbox table in this transaction when it
    /// commits: under the layer, with the completed record, only if the
    /// attempt still holds its lease (a fenced attempt's events never
    /// leave), carrying the record's scope and the attempt's generation;
    /// without the layer, with the handler's writes. A transaction that
    /// rolls back, or a response the layer does not record, takes its
    /// events with it. The events of one transaction are published in the
    /// order they were emitted, each with a message id derived from scope,
    /// generation, attempt and position, so a re-publish is the same
    /// message.
    ///
    /// ```no_run
    /// # async fn charge(mut tx: idem_postgres::IdemTransaction) -> Result<(), Box<dyn std::error::Error>> {
    /// sqlx::query("INSERT INTO ledger (account, cents) VALUES ('acme', 1299)")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.emit("charges", r#"{"account":"acme","cents":1299}"#)?;
    /// tx.commit().await?; // the row, the event and the record, together
    /// # Ok(()) }
    /// ```
    pub fn emit(
        &mut self,
        subject: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Result<(), EmitError> {
        let subject = subject.into();
        if !publishable(&subject) {
            return Err(EmitError::Subject(subject));
        }
        self.events.push(Emitted {
            subject,
            payload: payload.into(),
        });
        Ok(())
    }

    /// How many events [`emit`](Self::emit) has added so far.
    pub fn emitted(&self) -> usize {
        self.events.len()
    }

    /// Whether the layer will commit this transaction with the outcome
    /// (`false`: [`commit`](Self::commit) commits at once).
    pub fn is_deferred(&self) -> bool {
        self.slot.is_some()
    }

    /// Commits the handler's writes: under the layer, together with the
    /// outcome after the handler returns; otherwise now.
    ///
    /// Under the layer the writes become durable only if the outcome is
    /// recorded: a response the layer does not record (a 5xx, a failed
    /// body) rolls them back and releases the key, and an attempt that lost
    /// its lease commits nothing (its client gets what the record says, or
    /// `503` to retry).
    ///
    /// **Forgetting `commit`.** A transaction dropped without `commit` or
    /// [`rollback`](Self::rollback) rolls back. If the handler then answers
    /// a success (2xx or 3xx), the layer never records it (the writes it
    /// stands for are gone): the caller gets `500
    /// idempotency_transaction_not_committed`, the key is released so the
    /// retry runs, and an error is logged. A 4xx with a dropped
    /// transaction is a refusal whose writes rightly rolled back (a `?`
    /// on a validation error, say): it is recorded as usual.
    pub async fn commit(self) -> Result<(), CommitError> {
        let Self {
            mut tx,
            slot,
            store,
            events,
        } = self;
        match slot {
            None => {
                let sql = &store.inner.sql.emit;
                outbox::write(&mut tx, sql, store.pooled(), None, &events).await?;
                Ok(tx.commit().await?)
            }
            Some(slot) => {
                // Settled either way: handed over, or refused and rolled
                // back as it is dropped (the handler is told).
                slot.settled();
                slot.put(Box::new(Deferred { tx, store, events }))
                    .map_err(|_| CommitError::AlreadyHandedOver)
            }
        }
    }

    /// Rolls the writes back now. Under the layer, a success the handler
    /// answers after an explicit rollback is its own decision (nothing to
    /// write, say) and is recorded; only a transaction dropped without
    /// `commit` or `rollback` keeps a success from being recorded (see
    /// [`commit`](Self::commit)).
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        if let Some(slot) = &self.slot {
            slot.settled();
        }
        self.tx.rollback().await
    }
}

impl Deref for IdemTransaction {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for IdemTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

/// A handler's transaction, waiting for the outcome.
struct Deferred {
    tx: Transaction<'static, Postgres>,
    store: PgStore,
    events: Vec<Emitted>,
}

impl DeferredCompletion for Deferred {
    fn commit(
        self: Box<Self>,
        lease: Lease,
        outcome: Outcome,
    ) -> BoxFuture<Result<Completion, StoreError>> {
        Box::pin(async move {
            let Deferred {
                mut tx,
                store,
                events,
            } = *self;
            // The fenced completion, then (the attempt holds its lease)
            // its events: both in the handler's transaction.
            let written = async {
                let completed = store
                    .complete_query(&lease, &outcome)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if completed == 1 {
                    let sql = &store.inner.sql.emit;
                    outbox::write(&mut tx, sql, store.pooled(), Some(&lease), &events).await?;
                }
                Ok::<_, sqlx::Error>(completed)
            }
            .await;
            match written {
                Ok(1) => {}
                Ok(_) => {
                    // Fenced: the writes go, and the record says why. The
                    // attempt's history keeps that it gave its work up.
                    let _ = tx.rollback().await;
                    return Ok(match store.release(&lease).await? {
                        Release::Fenced(current) => Completion::Fenced(current),
                        Release::Released => Completion::Fenced(Current::Vacant),
                    });
                }
                Err(error) => {
                    // Nothing was committed: free the key for a retry.
                    drop(tx);
                    if let Err(release) = store.release(&lease).await {
                        tracing::warn!(%release, "could not release after a failed completion");
                    }
                    return Err(failed(error));
                }
            }
            // An error here leaves the commit unknown: the lease lapses and
            // a retry finds either the completed record or a vacant one.
            tx.commit().await.map_err(failed)?;
            Ok(Completion::Recorded)
        })
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::{
        body::Body,
        extract::{FromRef, FromRequestParts},
        response::Response,
    };
    use http::{HeaderValue, StatusCode, header, request::Parts};

    use super::*;

    /// Begins an [`IdemTransaction`] for the request. A database that
    /// cannot begin one is `503 idempotency_store_unavailable`.
    impl<S> FromRequestParts<S> for IdemTransaction
    where
        S: Send + Sync,
        PgStore: FromRef<S>,
    {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
            let store = PgStore::from_ref(state);
            let slot = parts.extensions.get::<CompletionSlot>().cloned();
            IdemTransaction::begin(&store, slot).await.map_err(|error| {
                tracing::warn!(%error, "could not begin a transaction");
                // idem's problem type, as every other refusal has it
                // (idem_layer::problem::DEFAULT_TYPE_BASE and the code).
                let body = serde_json::json!({
                    "type": "urn:idem:problem:idempotency_store_unavailable",
                    "title": "Idempotency store unavailable",
                    "status": 503,
                    "code": "idempotency_store_unavailable",
                    "detail": "the database could not begin a transaction; retry shortly",
                });
                let mut response = Response::new(Body::from(body.to_string()));
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                let headers = response.headers_mut();
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/problem+json"),
                );
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            })
        }
    }
}
