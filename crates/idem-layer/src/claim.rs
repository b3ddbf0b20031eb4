//! Claiming a shared store for how a layer derives its records'
//! identities, and keeping the claim alive.

use std::sync::Arc;

use idem_core::Fleet;

use crate::{IdempotencyLayer, config::StoreGuard};

impl<S: Fleet> IdempotencyLayer<S> {
    /// Claims the store for this layer's [`store_identity`](Self::store_identity)
    /// for as long as the retention ([`Fleet::claim_identity`]): call it
    /// at start, and again at least every quarter of the retention (say
    /// every minute) while the instance serves. An answer of
    /// [`IdentityClaim::Other`](idem_core::IdentityClaim) means instances
    /// that hash scopes otherwise (another secret or format) use the store:
    /// a retry moving between them would run again, so do not serve until
    /// the deployment agrees, or pass `replace` once to take the store over
    /// for this layer's settings. A memory store answers
    /// [`Held`](idem_core::IdentityClaim): nothing outside its process can
    /// find its records.
    pub async fn claim_store(
        &self,
        replace: bool,
    ) -> Result<idem_core::IdentityClaim, idem_core::StoreError> {
        let marker = self.store_identity();
        let legacy = self.legacy_store_identity();
        let ttl = self.runtime.config.timing.retention;
        claim_upgrading(&*self.runtime.store, &marker, Some(&legacy), ttl, replace).await
    }

    /// [`claim_store`](Self::claim_store) now, and kept alive while the
    /// store lives (see [`keep_claimed`]): what a service calls once at
    /// start. On [`Other`](idem_core::IdentityClaim::Other) nothing is
    /// kept: do not serve.
    pub async fn keep_store_claimed(
        &self,
        replace: bool,
    ) -> Result<idem_core::IdentityClaim, idem_core::StoreError> {
        let ttl = self.runtime.config.timing.retention;
        let guard = self.runtime.config.store_guard.clone();
        let (marker, legacy) = (self.store_identity(), self.legacy_store_identity());
        keep_claimed_guarded(self.store(), marker, Some(legacy), ttl, replace, guard).await
    }
}

/// Claims `store` for `marker` for `ttl` ([`Fleet::claim_identity`]) and,
/// unless another marker holds it, keeps the claim alive in a task of its
/// own while the store lives: claimed again every quarter of `ttl` (at
/// least every second, at most every minute), a failed refresh tried at
/// the next, a store another marker took over logged as an error (retries
/// moving between the two run again). The first claim's answer; a store
/// that could not be asked now is claimed at the first refresh that
/// reaches it. [`keep_claimed_guarded`] also refuses requests when that
/// first refresh finds another marker.
pub async fn keep_claimed<S: Fleet>(
    store: &Arc<S>,
    marker: String,
    ttl: std::time::Duration,
    replace: bool,
) -> Result<idem_core::IdentityClaim, idem_core::StoreError> {
    keep_claimed_guarded(store, marker, None, ttl, replace, StoreGuard::default()).await
}

/// Claims `store` for `marker`; a store held by `legacy` (this process's
/// own identity as the version before wrote it) is taken over for the
/// current one, since the two derive records alike.
async fn claim_upgrading<S: Fleet + ?Sized>(
    store: &S,
    marker: &str,
    legacy: Option<&str>,
    ttl: std::time::Duration,
    replace: bool,
) -> Result<idem_core::IdentityClaim, idem_core::StoreError> {
    match store.claim_identity(marker, ttl, replace).await {
        Ok(idem_core::IdentityClaim::Other(held)) if legacy == Some(held.as_str()) => {
            tracing::info!("the store's identity is upgraded from this process's earlier marker");
            store.claim_identity(marker, ttl, true).await
        }
        other => other,
    }
}

/// [`keep_claimed`], checking the claim again on the first connection
/// that reaches the store when it could not be asked at start: if another
/// marker holds it then, `guard` is thrown (the layer holding it refuses
/// every protected request, as a start would have been refused). A store
/// held by `legacy` (this process's own identity as the version before
/// wrote it) is upgraded to `marker`, at start or at that first refresh.
pub async fn keep_claimed_guarded<S: Fleet>(
    store: &Arc<S>,
    marker: String,
    legacy: Option<String>,
    ttl: std::time::Duration,
    replace: bool,
    guard: StoreGuard,
) -> Result<idem_core::IdentityClaim, idem_core::StoreError> {
    use std::time::Duration;
    let first = claim_upgrading(&**store, &marker, legacy.as_deref(), ttl, replace).await;
    if let Ok(idem_core::IdentityClaim::Other(_)) = first {
        return first;
    }
    let mut checked = first.is_ok();
    let every = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let store = Arc::downgrade(store);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(store) = store.upgrade() else {
                return;
            };
            // Until the first claim, as at start: `replace`, and an
            // earlier marker of this process's upgraded.
            let legacy = legacy.as_deref().filter(|_| !checked);
            match claim_upgrading(&*store, &marker, legacy, ttl, replace && !checked).await {
                Ok(idem_core::IdentityClaim::Other(other)) if !checked => {
                    checked = true;
                    guard.refuse();
                    tracing::error!(
                        other,
                        "the store, unreachable at start, belongs to instances that derive \
                         record identities otherwise: every protected request is refused"
                    );
                }
                Ok(idem_core::IdentityClaim::Other(other)) => tracing::error!(
                    other,
                    "instances that derive record identities otherwise made this store \
                     their own: requests that move between them and this one run again"
                ),
                Ok(_) => checked = true,
                Err(error) => tracing::debug!(%error, "could not refresh the store's claim"),
            }
        }
    });
    first
}
