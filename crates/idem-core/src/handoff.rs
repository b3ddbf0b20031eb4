//! Completion inside a transaction the handler holds.
//!
//! A store that keeps records in the same database as the handler's own
//! data (PostgreSQL, say) can make the outcome and the handler's writes
//! durable in one commit. For such a store
//! ([`Store::completes_in_transactions`](crate::Store::completes_in_transactions))
//! the layer puts a [`CompletionSlot`] in the request extensions of every
//! attempt it runs; the handler writes its rows
//! in a transaction and puts that transaction into the slot as a
//! [`DeferredCompletion`] instead of committing it. When the handler's
//! response has been read and is to be recorded, the layer hands the
//! outcome to the deferred completion, which writes it in the same
//! transaction, fenced like any completion, and commits both at once. The
//! layer then does not call [`Store::complete`](crate::Store::complete).
//!
//! When the response is not to be recorded (a temporary failure, a panic, a
//! failed body) the layer drops the deferred completion: the transaction
//! rolls back with everything the handler wrote, and the key is released.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
};

use crate::{Completion, Lease, Outcome, StoreError};

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A transaction that commits together with the attempt's outcome.
pub trait DeferredCompletion: Send + 'static {
    /// Records `outcome` as the completion of `lease` inside the held
    /// transaction, fenced on the lease's generation and owner token, and
    /// commits.
    ///
    /// * [`Completion::Recorded`]: one commit made the outcome and the
    ///   handler's writes durable.
    /// * [`Completion::Fenced`]: the lease was lost; nothing of the
    ///   transaction was committed.
    /// * An error: the commit may or may not have happened (the outcome and
    ///   the writes are durable together or not at all); a retry replays or
    ///   runs again accordingly.
    fn commit(
        self: Box<Self>,
        lease: Lease,
        outcome: Outcome,
    ) -> BoxFuture<Result<Completion, StoreError>>;
}

/// Where a handler leaves its [`DeferredCompletion`] for the layer.
///
/// Present in the request extensions of every attempt the layer executes
/// on a store that completes in transactions
/// ([`Store::completes_in_transactions`](crate::Store::completes_in_transactions));
/// absent when the layer did not run (an unkeyed request, say) or runs on
/// another store, in which case the handler commits its transaction
/// itself.
#[derive(Clone, Default)]
pub struct CompletionSlot(Arc<Mutex<Slot>>);

/// What a slot holds: the deferred completion, and how many transactions
/// the handler began on it and did not settle (commit or roll back).
#[derive(Default)]
struct Slot {
    deferred: Option<Box<dyn DeferredCompletion>>,
    open: usize,
}

impl CompletionSlot {
    /// An empty slot.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leaves `completion` for the layer. A slot holds one: if it is
    /// taken, `completion` is given back.
    pub fn put(
        &self,
        completion: Box<dyn DeferredCompletion>,
    ) -> Result<(), Box<dyn DeferredCompletion>> {
        let mut slot = self.lock();
        if slot.deferred.is_some() {
            return Err(completion);
        }
        slot.deferred = Some(completion);
        Ok(())
    }

    /// Takes what the handler left, if anything.
    pub fn take(&self) -> Option<Box<dyn DeferredCompletion>> {
        self.lock().deferred.take()
    }

    /// Notes that the handler began a transaction meant for this slot
    /// (`idem_postgres::IdemTransaction::begin`); [`settled`](Self::settled)
    /// notes its end, by a commit handed over or a rollback.
    pub fn began(&self) {
        self.lock().open += 1;
    }

    /// Notes that a transaction [`began`](Self::began) on this slot was
    /// settled: handed over by its commit, or rolled back on purpose.
    pub fn settled(&self) {
        let mut slot = self.lock();
        slot.open = slot.open.saturating_sub(1);
    }

    /// Whether a transaction began on this slot and was dropped unsettled:
    /// neither committed nor rolled back, so its writes rolled back with
    /// it, and a success the handler answered is not backed by them.
    pub fn dropped_uncommitted(&self) -> bool {
        self.lock().open > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl fmt::Debug for CompletionSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let full = self.lock().deferred.is_some();
        f.debug_struct("CompletionSlot")
            .field("full", &full)
            .finish()
    }
}
