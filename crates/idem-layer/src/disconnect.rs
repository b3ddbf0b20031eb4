//! Keeping or dropping an attempt when its client goes away.

use std::{
    cell::Cell,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use idem_core::{Lease, Store};
use tokio_util::task::TaskTracker;

use crate::runtime::Runtime;

thread_local! {
    /// Set by [`attempt_started`] during a poll of a [`ResponseFuture`]'s
    /// request: the attempt (the inner service's run) begins in this poll,
    /// and this is where the rest of the request goes if it is dropped.
    static ATTEMPT_STARTED: Cell<Option<TaskTracker>> = const { Cell::new(None) };
}

/// Marks, from inside the request a [`ResponseFuture`] is polling, that the
/// attempt begins (on-disconnect `Detach`): from here on, dropping the
/// response future unfinished moves the rest of the request to a task of
/// `tasks`, so the attempt runs to completion and its outcome is recorded.
pub(crate) fn attempt_started(tasks: &TaskTracker) {
    ATTEMPT_STARTED.with(|started| started.set(Some(tasks.clone())));
}

/// A request on its way through the layer, boxed once.
type Request<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// An enclosing response future's mark, put back when dropped.
struct Enclosing(Option<TaskTracker>);

impl Drop for Enclosing {
    fn drop(&mut self) {
        ATTEMPT_STARTED.with(|started| started.set(self.0.take()));
    }
}

/// The future of [`Idempotency`](crate::Idempotency)'s responses.
///
/// It owns the request's one allocation. Dropped before it finished (the
/// client went away) once the request's attempt has begun in on-disconnect
/// `Detach` mode, it moves the rest of the request to a task of its own,
/// tracked for [`IdempotencyLayer::drain`](crate::IdempotencyLayer::drain),
/// so a client disconnect never cancels a handler half-way and its outcome
/// is still recorded. Dropped before that (while the body arrives, the key
/// is reserved, or a duplicate waits), nothing runs on: the handler never
/// started. A request that runs to completion costs no task.
pub struct ResponseFuture<T: 'static, E: 'static> {
    request: Option<Request<T, E>>,
    /// Once the attempt has begun: where the rest of the request goes if
    /// dropped unfinished.
    started: Option<TaskTracker>,
}

impl<T: 'static, E: 'static> ResponseFuture<T, E> {
    pub(crate) fn new(request: impl Future<Output = Result<T, E>> + Send + 'static) -> Self {
        Self::new_with(|| request)
    }

    /// The future `make` returns, made in its box: a request's future is
    /// several kilobytes, and one made first and boxed after is copied
    /// into the box whole.
    #[inline(always)]
    pub(crate) fn new_with<F>(make: impl FnOnce() -> F) -> Self
    where
        F: Future<Output = Result<T, E>> + Send + 'static,
    {
        let request: Box<F> = Box::write(Box::new_uninit(), make());
        Self {
            request: Some(Box::into_pin(request)),
            started: None,
        }
    }
}

impl<T: 'static, E: 'static> std::fmt::Debug for ResponseFuture<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("finished", &self.request.is_none())
            .field("attempt_started", &self.started.is_some())
            .finish()
    }
}

impl<T: 'static, E: 'static> Future for ResponseFuture<T, E> {
    type Output = Result<T, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(request) = this.request.as_mut() else {
            return Poll::Pending;
        };
        // The mark of an enclosing response future (a layer in front of
        // this one, polling it from its own attempt) is kept aside and put
        // back, even if the request panics (the enclosing layer catches its
        // handler's panics and goes on), so each sees only its own
        // request's attempt.
        let enclosing = Enclosing(ATTEMPT_STARTED.with(Cell::take));
        let poll = request.as_mut().poll(cx);
        if let Some(tasks) = ATTEMPT_STARTED.with(Cell::take) {
            this.started = Some(tasks);
        }
        drop(enclosing);
        if poll.is_ready() {
            this.request = None;
        }
        poll
    }
}

impl<T: 'static, E: 'static> Drop for ResponseFuture<T, E> {
    fn drop(&mut self) {
        let (Some(request), Some(tasks)) = (self.request.take(), self.started.take()) else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            tracing::info!("client went away; the attempt runs on and records its outcome");
            tasks.spawn_on(
                async move {
                    let _ = request.await;
                },
                &runtime,
            );
        }
    }
}

/// Releases the reservation if the response future is dropped before the
/// attempt finished (on-disconnect `Release` mode).
pub(crate) struct ReleaseOnDrop<S: Store> {
    pub(crate) rt: Runtime<S>,
    pub(crate) lease: Option<Lease>,
}

impl<S: Store> ReleaseOnDrop<S> {
    pub(crate) fn disarm(mut self) {
        self.lease = None;
    }
}

impl<S: Store> Drop for ReleaseOnDrop<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let rt = self.rt.clone();
        let tasks = rt.tasks.clone();
        tasks.spawn_on(
            async move {
                rt.release(&lease).await;
            },
            &runtime,
        );
    }
}
