//! The store contract on Redis: `Store` (reservations, renewals,
//! completions, releases, cancels, reads), each a script call on the
//! record's slot (the records API's calls are in `admin`).

use std::time::Duration;

use idem_core::{
    Attempt, AttemptId, Cancellation, Completion, Current, Fingerprint, Lease, Outcome, OwnerToken,
    Record, Release, Renewal, Reservation, ReserveRequest, ScopeHash, Store, StoreError,
};
use redis::Value;

use crate::{
    RedisStore,
    abandon::Abandon,
    decode::{self, *},
    errors::corrupt,
    invocation::{Answer, Invocation},
    keys::millis,
    string_record::{self, Found},
};

/// The reserve script's answer; `lease` makes the lease of a generation.
/// A new key's hot path answers the integer 1 (acquired, generation 1), a
/// replay one string, every other path a table led by its kind.
fn decode_reservation(
    reply: Value,
    lease: impl Fn(u64) -> Lease,
) -> Result<Reservation, StoreError> {
    if hot_path(&reply) {
        return Ok(Reservation::Acquired(lease(1)));
    }
    if let Value::BulkString(raw) = reply {
        return Ok(Reservation::Completed(decode_replay(raw)?));
    }
    let reply = items(reply)?;
    let field = |i: usize| reply.get(i).ok_or_else(|| corrupt("short reply"));
    Ok(match decode::tag(reply.first())? {
        "acquired" => Reservation::Acquired(lease(int(field(1)?)?)),
        "taken_over" => {
            let superseded: Attempt = serde_json::from_slice(&bytes(field(2)?)?)
                .map_err(|e| corrupt(format!("superseded attempt: {e}")))?;
            Reservation::TakenOver {
                lease: lease(int(field(1)?)?),
                superseded,
            }
        }
        "in_progress" => Reservation::InProgress {
            retry_after: Duration::from_millis(int(field(1)?)?),
        },
        "conflict" => Reservation::Conflict,
        _ => match decode_current(reply)? {
            Current::Completed(replay) => Reservation::Completed(replay),
            Current::Cancelled => Reservation::Cancelled,
            other => return Err(corrupt(format!("unexpected reservation reply {other:?}"))),
        },
    })
}

/// Where a reservation is (see [`Store::reserve`] on [`RedisStore`]): the
/// small state of its loop, one call per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Format 3's `SET … NX PX … GET`: a new key, or the record it found.
    Native,
    /// Its `GET`, when Redis refused the `SET` for want of memory (a
    /// replay still needs no write).
    Read,
    /// The reserve script: a hash, or a lease that ran out.
    Script,
    /// Reading the remaining time (`PTTL`) of a string record held by
    /// another owner, whose lease ends when that time falls to
    /// `lease_ends_at` (the retention less the lease, in ms).
    LeaseLeft { lease_ends_at: i64 },
}

/// What one answer of a reservation's loop settles: the next call, or the
/// reservation.
enum Next {
    Call(Step),
    Done(Reservation),
}

impl Step {
    /// The step after `answer` to this step's call, for a request of
    /// `fingerprint` reserving under `token` (`lease` makes its lease at a
    /// generation).
    fn answered(
        self,
        answer: Answer,
        fingerprint: &Fingerprint,
        token: &uuid::Uuid,
        lease: impl Fn(u64) -> Lease,
    ) -> Result<Next, StoreError> {
        let found = match (self, answer) {
            (Step::Script, answer) => {
                return Ok(Next::Done(decode_reservation(answer.into_reply()?, lease)?));
            }
            (Step::LeaseLeft { lease_ends_at }, Answer::Reply(Value::Int(pttl))) => {
                return Ok(match Found::lease_left(lease_ends_at, pttl) {
                    0 => Next::Call(Step::Script),
                    left => Next::Done(Reservation::InProgress {
                        retry_after: Duration::from_millis(left),
                    }),
                });
            }
            (Step::Native, Answer::OutOfMemory) => return Ok(Next::Call(Step::Read)),
            (Step::Read, Answer::Reply(Value::Nil)) => {
                return Err(StoreError::Refused(
                    "Redis is out of memory (OOM under noeviction): a new key cannot be reserved"
                        .into(),
                ));
            }
            (Step::Native, Answer::Reply(Value::Nil)) => Found::Ours,
            (Step::Native | Step::Read, Answer::Reply(Value::BulkString(raw))) => {
                string_record::found(raw, fingerprint, token)?
            }
            (_, Answer::HashRecord) => return Ok(Next::Call(Step::Script)),
            (_, other) => {
                return Err(corrupt(format!("unexpected reservation reply {other:?}")));
            }
        };
        Ok(match found {
            Found::Ours => Next::Done(Reservation::Acquired(lease(1))),
            Found::Replay(replay) => Next::Done(Reservation::Completed(replay)),
            Found::Conflict => Next::Done(Reservation::Conflict),
            Found::Held { lease_ends_at } => Next::Call(Step::LeaseLeft { lease_ends_at }),
        })
    }
}

impl RedisStore {
    /// `renew.lua`; with `unknown`, it keeps in the history that the
    /// attempt's caller was told its outcome is unknown instead of renewing.
    async fn renew_marking(&self, lease: &Lease, unknown: bool) -> Result<Renewal, StoreError> {
        let mut invocation = Invocation::on_record(&self.scripts.renew, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        if unknown {
            invocation.arg("unknown");
        } else {
            invocation.arg(millis(lease.ttl));
        }
        let reply = items(self.run(invocation, false).await?.0)?;
        if decode::tag(reply.first())? == "renewed" {
            return Ok(Renewal::Renewed);
        }
        Ok(Renewal::Fenced(decode_current(reply)?))
    }

    /// Logs a completion that reached fewer replicas than the store waits
    /// for (it stands: the handler ran).
    fn warn_short_of_replicas(&self, acked: Option<usize>) {
        if let Some((acked, wanted)) = self.short_of_replicas(acked) {
            tracing::warn!(
                acked,
                wanted,
                "the completion reached fewer replicas than requested"
            );
        }
    }

    /// A format 3 reservation's call: one `SET … NX PX … GET`
    /// (`string_record.rs`) under the attempt and owner token `guard`
    /// holds.
    fn reserve_native(&self, request: &ReserveRequest, guard: &Abandon<'_>) -> Invocation<'_> {
        let tenant = TenantForm::of_shared(request.scope.shared_tenant());
        let record = string_record::Reservation {
            token: &guard.token,
            attempt: &guard.attempt,
            fingerprint: &request.fingerprint.hex_bytes(),
            start_ms: unix_ms(),
            lease_ms: millis(request.lease),
            retention_ms: millis(request.retention),
            tenant: &tenant,
            operation: request.scope.operation(),
            key: request.scope.key().as_str(),
        };
        let mut invocation = Invocation::native("SET", &self.prefix, request.scope.hash());
        invocation
            .write_arg(|out| record.write(out))
            .arg("NX")
            .arg("PX")
            .arg(millis(request.retention))
            .arg("GET");
        invocation
    }

    /// The reserve script's call for `request`, under the attempt and
    /// owner token `guard` holds.
    fn reserve_script(&self, request: &ReserveRequest, guard: &Abandon<'_>) -> Invocation<'_> {
        let tenant = TenantForm::of_shared(request.scope.shared_tenant());
        let script = if tenant.field() == "tenant_bin" {
            &self.scripts.reserve_bin
        } else {
            &self.scripts.reserve
        };
        let mut invocation = Invocation::on_record(script, &self.prefix, request.scope.hash());
        invocation
            .arg(&request.fingerprint.hex_bytes()[..])
            .uuid(&guard.attempt)
            .uuid(&guard.token)
            .arg(millis(request.lease))
            .arg(millis(request.retention))
            .pieces(&tenant.pieces())
            .arg(request.scope.operation())
            .arg(request.scope.key().as_str());
        invocation
    }
}

impl Store for RedisStore {
    /// Each call is bounded by the store's timeout (plus the wait for
    /// replicas, when it waits for them): see [`RedisStoreBuilder::timeout`](crate::RedisStoreBuilder::timeout).
    fn call_bound(&self) -> Option<Duration> {
        Some(RedisStore::call_bound(self))
    }

    fn settled(&self) -> impl Future<Output = ()> + Send {
        self.given_up.wait()
    }

    fn background_tasks(&self) -> usize {
        self.given_up.len()
    }

    async fn reserve(&self, request: &ReserveRequest) -> Result<Reservation, StoreError> {
        let scope = request.scope.hash();
        // If this call is given up (it times out, or its caller's timeout
        // drops it) after the script was sent, the guard frees the
        // reservation by its owner token once the server answers. The
        // attempt's id and token live in the guard alone while the call
        // is out (a future holds what is live across an await: a copy
        // would make every reservation's future larger).
        let mut guard = Abandon {
            store: self,
            scope: *scope,
            attempt: AttemptId::new().0,
            token: OwnerToken::new().0,
            conn: None,
            within: request.retention,
        };
        let (attempt, token) = (AttemptId(guard.attempt), OwnerToken(guard.token));
        let lease = |generation: u64| Lease {
            scope: *scope,
            attempt,
            generation,
            token,
            ttl: request.lease,
        };
        // Format 3: one native command; a record it finds processing for
        // this request under another owner costs a `PTTL` more, and the
        // reserve script decides once that lease ran out, or when the
        // record is a hash. One call site, so that the reservation's
        // future holds one call's state.
        let mut step = if self.format.string_records() {
            Step::Native
        } else {
            Step::Script
        };
        let (reservation, acked) = loop {
            let invocation = match step {
                Step::Native => self.reserve_native(request, &guard),
                Step::Script => self.reserve_script(request, &guard),
                Step::Read => Invocation::native("GET", &self.prefix, request.scope.hash()),
                Step::LeaseLeft { .. } => {
                    Invocation::native("PTTL", &self.prefix, request.scope.hash())
                }
            };
            let writes = matches!(step, Step::Native | Step::Script);
            let (answer, acked) = self
                .run_on(
                    invocation,
                    self.wait_replicas.is_some() && writes,
                    Some(&mut guard.conn),
                )
                .await?;
            match step.answered(answer, &request.fingerprint, &guard.token, lease)? {
                Next::Call(next) => step = next,
                Next::Done(reservation) => break (reservation, acked),
            }
        };
        if let (
            Reservation::Acquired(lease) | Reservation::TakenOver { lease, .. },
            Some((acked, wanted)),
        ) = (&reservation, self.short_of_replicas(acked))
        {
            // The handler must not run on a reservation a failover could lose.
            // (Boxed: this rare path's future would otherwise make every
            // reservation's future as large as itself plus a release's.)
            // The store answered, so this is no outage: never fail open
            // (the primary holds the record; running unprotected could run
            // a duplicate twice).
            let _ = Box::pin(self.release(lease)).await;
            return Err(StoreError::refused(format!(
                "the reservation reached {acked} of {wanted} replicas in time"
            )));
        }
        // Answered and decoded: the caller owns what it reserved.
        guard.conn = None;
        Ok(reservation)
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        self.renew_marking(lease, false).await
    }

    async fn mark_unknown(&self, lease: &Lease) -> Result<Renewal, StoreError> {
        self.renew_marking(lease, true).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<Completion, StoreError> {
        // Format 3: a compare-and-set on the string record; complete.lua
        // answers every other case (a hash, a lease no longer held).
        if self.format.string_records() && lease.generation == 1 {
            let mut invocation =
                Invocation::on_record(&self.scripts.complete_string, &self.prefix, &lease.scope);
            invocation
                .uuid(&lease.token.0)
                .write_arg(|out| string_record::write_completion(out, outcome, unix_ms()));
            let (reply, acked) = self.run(invocation, self.wait_replicas.is_some()).await?;
            if hot_path(&reply) {
                self.warn_short_of_replicas(acked);
                return Ok(Completion::Recorded);
            }
        }
        let mut invocation =
            Invocation::on_record(&self.scripts.complete, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        invocation.uuid(&lease.attempt.0);
        // '<status>:<stored>': one argument, as a packed record keeps them.
        match outcome {
            Outcome::Stored(response) => {
                invocation
                    .write_arg(|out| write!(out, "{}:1", response.status))
                    .write_arg(|out| {
                        write_headers(out, &response.headers, self.format.compact_headers())
                    })
                    .arg(response.body.as_ref());
            }
            Outcome::NotStored { status } => {
                invocation
                    .write_arg(|out| write!(out, "{status}:0"))
                    .arg("")
                    .arg("");
            }
        }
        // The attempt's end by this process' clock (see complete.lua).
        invocation.arg(unix_ms());
        let (reply, acked) = self.run(invocation, self.wait_replicas.is_some()).await?;
        // Recorded now, or by this very call if its reply was lost and it
        // was retried (fence.lua).
        let recorded = hot_path(&reply) || led_by(&reply, "recorded");
        if recorded {
            self.warn_short_of_replicas(acked);
            return Ok(Completion::Recorded);
        }
        Ok(Completion::Fenced(decode_current(items(reply)?)?))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, StoreError> {
        let mut invocation =
            Invocation::on_record(&self.scripts.release, &self.prefix, &lease.scope);
        lease_args(&mut invocation, lease);
        invocation.uuid(&lease.attempt.0).arg(unix_ms());
        let reply = self.run(invocation, false).await?.0;
        if hot_path(&reply) || led_by(&reply, "released") {
            return Ok(Release::Released);
        }
        Ok(Release::Fenced(decode_current(items(reply)?)?))
    }

    async fn cancel(&self, scope: &ScopeHash) -> Result<Cancellation, StoreError> {
        let mut invocation = Invocation::on_record(&self.scripts.cancel, &self.prefix, scope);
        // The id lets a retried call recognise its own earlier cancel.
        invocation.uuid(&uuid::Uuid::new_v4());
        let reply = items(self.run(invocation, false).await?.0)?;
        let tag = text(reply.first().ok_or_else(|| corrupt("empty reply"))?)?;
        let record = || match reply.get(1) {
            Some(Value::Array(pairs)) => decode_record(*scope, pairs),
            _ => Err(corrupt("cancel reply without the record")),
        };
        Ok(match tag.as_str() {
            "not_found" => Cancellation::NotFound,
            "cancelled" => Cancellation::Cancelled(record()?),
            "already_completed" => Cancellation::AlreadyCompleted(record()?),
            "already_cancelled" => Cancellation::AlreadyCancelled(record()?),
            other => return Err(corrupt(format!("unexpected cancel reply {other}"))),
        })
    }

    /// A single node's erasures, heard on its pub/sub channel (the first
    /// call starts the subscriber); `None` on a cluster.
    fn erasures(&self) -> Option<idem_core::ErasureFeed> {
        self.erasures.feed()
    }

    /// Waits for the record's notification (see the crate docs on
    /// waiting); polls on a cluster.
    async fn changed(&self, scope: &ScopeHash, timeout: Duration) {
        let key = self.record_key(scope);
        let channel = format!("{key}:c");
        // Read once subscribed: marks the record as waited on (so that the
        // scripts ending its attempt publish) and answers its state.
        let state = async {
            let invocation = Invocation::on_record_key(&self.scripts.watch, &key);
            match self.run(invocation, false).await {
                Ok((Value::BulkString(state), _)) => String::from_utf8(state).ok(),
                _ => None,
            }
        };
        self.watch.changed(&channel, timeout, state).await;
    }

    async fn get(&self, scope: &ScopeHash) -> Result<Option<Record>, StoreError> {
        self.read(scope, false, None).await
    }
}
