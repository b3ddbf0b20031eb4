//! The fleet's claims on a Redis store: which way of deriving record
//! identities holds the store, and which instance does a fleet-wide chore.

use std::time::Duration;

use idem_core::{Fleet, IdentityClaim, StoreError};
use redis::Value;

use crate::{RedisStore, keys::px};

impl RedisStore {
    /// The Redis key of the store's identity marker (see
    /// [`claim_identity`](Self::claim_identity)); no record key looks like
    /// it.
    pub fn identity_key(&self) -> String {
        format!("{}identity", self.prefix)
    }

    /// Claims the store for `marker`, a short text naming how the
    /// instances sharing it derive tenants and scopes (see
    /// [`IdentityClaim`]), in the key [`identity_key`](Self::identity_key).
    ///
    /// An unclaimed store, or one claimed with the same marker, is
    /// claimed for `ttl` (the retention: as long as the newest record may
    /// live), extended and never shortened. With `replace`, the marker
    /// takes the store whatever it held.
    pub async fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> Result<IdentityClaim, StoreError> {
        let key = self.identity_key();
        if replace {
            let mut set = redis::cmd("SET");
            set.arg(&key).arg(marker).arg("PX").arg(px(ttl));
            self.command::<Value>(set).await?;
            return Ok(IdentityClaim::Held);
        }
        // Extended, never shortened.
        Ok(match self.claim_key(&key, marker, ttl, &["GT"]).await? {
            None => IdentityClaim::Held,
            Some(other) => IdentityClaim::Other(other),
        })
    }

    /// Claims `key` for `holder` for `ttl`: a free key is taken
    /// (`SET NX GET`), one `holder` holds is given `ttl` from now again
    /// (`PEXPIRE`, with `extend_flags`). Answers the other holder, if
    /// another holds it.
    async fn claim_key(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        extend_flags: &[&str],
    ) -> Result<Option<String>, StoreError> {
        let millis = px(ttl);
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(holder)
            .arg("PX")
            .arg(millis)
            .arg("NX")
            .arg("GET");
        let held: Option<String> = self.command(set).await?;
        match held {
            Some(held) if held == holder => {
                // Should the claim lapse between the two commands and
                // another holder take it, this lengthens theirs: they
                // hold it a little longer.
                let mut extend = redis::cmd("PEXPIRE");
                extend.arg(key).arg(millis).arg(extend_flags);
                self.command::<Value>(extend).await?;
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// The key that holds who does the fleet-wide chore `duty`.
    pub fn duty_key(&self, duty: &str) -> String {
        format!("{}duty:{duty}", self.prefix)
    }

    /// Claims the chore `duty` for `holder` for `ttl` in
    /// [`duty_key`](Self::duty_key) (see [`Fleet::claim_duty`]): taken
    /// when no one holds it, extended to `ttl` from now when `holder` does.
    pub async fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = self.duty_key(duty);
        Ok(self.claim_key(&key, holder, ttl, &[]).await?.is_none())
    }
}

impl Fleet for RedisStore {
    fn claim_identity(
        &self,
        marker: &str,
        ttl: Duration,
        replace: bool,
    ) -> impl Future<Output = Result<IdentityClaim, StoreError>> + Send {
        RedisStore::claim_identity(self, marker, ttl, replace)
    }

    fn claim_duty(
        &self,
        duty: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        RedisStore::claim_duty(self, duty, holder, ttl)
    }
}
