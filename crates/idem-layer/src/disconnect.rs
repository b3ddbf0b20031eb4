//! Keeping or dropping an attempt when its client goes away.

use std::{
    future::Future,
    task::{Context, Poll},
};

use idem_core::{Lease, Store};
use tokio_util::task::TaskTracker;

use crate::runtime::Runtime;

/// Polls a future inline; if dropped before it finished, spawns the rest
/// of it so it still runs to completion (on-disconnect `Detach` mode). This
/// costs no task per request, yet a client disconnect never cancels a
/// handler half-way.
/// The spawned rest is tracked, so a graceful shutdown waits for it.
pub(crate) struct RunToCompletion<F: Future + Send + 'static> {
    future: Option<std::pin::Pin<Box<F>>>,
    tasks: TaskTracker,
}

impl<F: Future + Send + 'static> RunToCompletion<F> {
    pub(crate) fn new(future: F, tasks: TaskTracker) -> Self {
        Self {
            future: Some(Box::pin(future)),
            tasks,
        }
    }
}

impl<F: Future + Send + 'static> Future for RunToCompletion<F> {
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F: Future + Send + 'static> Drop for RunToCompletion<F> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            tracing::info!("client went away; the attempt runs on and records its outcome");
            self.tasks.spawn_on(
                async move {
                    let _ = future.await;
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
