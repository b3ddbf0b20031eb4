//! The store contract on Redis: `Store` (reservations, renewals,
//! completions, releases, cancels, reads) and `RecordsAdmin` (listings,
//! the lapsed count, force releases), each a script call on the record's
//! slot.

use std::time::Duration;

use idem_core::{
    Attempt, AttemptId, Cancellation, Completion, Current, Erasure, ForceRelease, Lease,
    OldestRecords, Outcome, OwnerToken, Record, RecordQuery, RecordState, RecordsAdmin, Release,
    Renewal, Reservation, ReserveRequest, ScopeHash, Store, StoreError,
};
use redis::Value;

use crate::{
    RedisStore,
    abandon::Abandon,
    decode::{self, *},
    errors::corrupt,
    invocation::{Answer, Invocation},
    keys::{millis, record_key_pieces},
    pool::Pool,
    string_record::{self, Found},
};

/// How many record reads [`RecordsAdmin::list`](idem_core::RecordsAdmin::list) keeps in
/// flight at once.
const LIST_READS_AT_ONCE: usize = 32;

/// How many keys one call of the lapsed-records count asks `SCAN` for
/// (`count_lapsed.lua`): each call holds Redis for its page (about 5 µs a
/// key on a small machine, the `SCAN` included), so a call stays under a
/// millisecond.
const COUNT_LAPSED_PAGE: usize = 100;

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
            let found = match (step, answer) {
                (Step::Script, answer) => {
                    break (decode_reservation(answer.into_reply()?, lease)?, acked);
                }
                (Step::LeaseLeft { lease_ends_at }, Answer::Reply(Value::Int(pttl))) => {
                    match Found::lease_left(lease_ends_at, pttl) {
                        0 => {
                            step = Step::Script;
                            continue;
                        }
                        left => {
                            let retry_after = Duration::from_millis(left);
                            break (Reservation::InProgress { retry_after }, acked);
                        }
                    }
                }
                (Step::Native, Answer::OutOfMemory) => {
                    step = Step::Read;
                    continue;
                }
                (Step::Read, Answer::Reply(Value::Nil)) => {
                    return Err(StoreError::Refused(
                        "Redis is out of memory (OOM under noeviction): a new key cannot be reserved"
                            .into(),
                    ));
                }
                (Step::Native, Answer::Reply(Value::Nil)) => Found::Ours,
                (Step::Native | Step::Read, Answer::Reply(Value::BulkString(raw))) => {
                    string_record::found(raw, &request.fingerprint, &guard.token)?
                }
                (_, Answer::HashRecord) => {
                    step = Step::Script;
                    continue;
                }
                (_, other) => {
                    return Err(corrupt(format!("unexpected reservation reply {other:?}")));
                }
            };
            break (
                match found {
                    Found::Ours => Reservation::Acquired(lease(1)),
                    Found::Replay(replay) => Reservation::Completed(replay),
                    Found::Conflict => Reservation::Conflict,
                    Found::Held { lease_ends_at } => {
                        step = Step::LeaseLeft { lease_ends_at };
                        continue;
                    }
                },
                acked,
            );
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

/// An operator's act on one record (force release, erasure): the kind
/// its script answered, and the record when it sent one.
async fn operator_act(
    store: &RedisStore,
    script: &redis::Script,
    scope: &ScopeHash,
) -> Result<(String, Option<Record>), StoreError> {
    let invocation = Invocation::on_record(script, &store.prefix, scope);
    operator_reply(store, invocation, scope).await
}

/// The kind and the record an operator's script answered.
async fn operator_reply(
    store: &RedisStore,
    invocation: Invocation<'_>,
    scope: &ScopeHash,
) -> Result<(String, Option<Record>), StoreError> {
    let reply = items(store.run(invocation, false).await?.0)?;
    let Some((kind, pairs)) = reply.split_first() else {
        return Err(corrupt("an operator's script answered nothing"));
    };
    let record = if pairs.is_empty() {
        None
    } else {
        Some(decode_record(*scope, pairs)?)
    };
    Ok((text(kind)?, record))
}

impl RecordsAdmin for RedisStore {
    async fn list(&self, query: &RecordQuery) -> Result<Vec<Record>, StoreError> {
        let clock: Vec<u64> = self.command(redis::cmd("TIME")).await?;
        let now_ms = match clock.as_slice() {
            [secs, micros] => secs * 1000 + micros / 1000,
            _ => return Err(corrupt("TIME answered oddly")),
        };
        use futures_util::TryStreamExt;
        // A query that only processing records can match reads the others'
        // state alone (most records are completed).
        let only_processing = query.lapsed || query.state == Some(RecordState::Processing);
        // A tenant's listing reads other tenants' records no further than
        // their tenant: as the 'tenant' field holds it (every record before
        // the binary form, and every tenant without one), and as
        // 'tenant_bin' does.
        let binary = query
            .tenant
            .as_deref()
            .map(|tenant| match encode_tenant(tenant) {
                ("tenant_bin", binary) => binary,
                _ => Vec::new(),
            });
        let tenant = query.tenant.as_deref().zip(binary.as_deref());
        // The reads share the connection, LIST_READS_AT_ONCE in flight:
        // Redis takes them in batches instead of one round trip each.
        // Only the oldest matches so far are kept: a listing holds no more
        // than its answer and a page of keys, however many records it
        // reads.
        let found = self
            .record_scopes()
            .map_ok(|page| futures_util::stream::iter(page.into_iter().map(Ok)))
            .try_flatten()
            .map_ok(|scope| async move { self.read(&scope, only_processing, tenant).await })
            .try_buffer_unordered(LIST_READS_AT_ONCE)
            .try_fold(OldestRecords::new(query.limit), |mut found, record| {
                if let Some(record) = record.filter(|record| query.matches(record, now_ms)) {
                    found.offer(record);
                }
                std::future::ready(Ok(found))
            })
            .await?;
        Ok(found.into_oldest_first())
    }

    /// Counted inside Redis on a single node: `SCAN` pages of record keys,
    /// each read by `count_lapsed.lua` where it lives, so a record's fields
    /// never cross the network and the count costs Redis about a third of
    /// reading each record out (see the README's lapsed-records gauge). A
    /// key `SCAN` names twice (a table Redis resized during the count) is
    /// counted twice. On a cluster (whose scripts may touch only the keys
    /// they name) the lapsed records are listed and counted.
    async fn count_lapsed(&self, limit: usize) -> Result<usize, StoreError> {
        if matches!(self.pool, Pool::Cluster(_)) {
            let listed = self.list(&RecordQuery::stuck(limit)).await?;
            return Ok(listed.len());
        }
        let pattern = self.record_pattern();
        let key_length: usize = record_key_pieces(&self.prefix, &[0; 64])
            .iter()
            .map(|piece| piece.len())
            .sum();
        let (mut cursor, mut count) = (0u64, 0usize);
        loop {
            let mut invocation = Invocation::new(&self.scripts.count_lapsed, &[]);
            invocation
                .arg(cursor)
                .arg(&pattern)
                .arg(COUNT_LAPSED_PAGE)
                .arg(key_length);
            let reply = items(self.run(invocation, false).await?.0)?;
            let [next, lapsed] = reply.as_slice() else {
                return Err(corrupt("lapsed count answered oddly"));
            };
            count = count.saturating_add(usize::try_from(int(lapsed)?).unwrap_or(usize::MAX));
            cursor = int(next)?;
            if cursor == 0 || count >= limit {
                return Ok(count.min(limit));
            }
        }
    }

    async fn force_release(&self, scope: &ScopeHash) -> Result<ForceRelease, StoreError> {
        let (kind, record) = operator_act(self, &self.scripts.force_release, scope).await?;
        Ok(match (kind.as_str(), record) {
            ("released", Some(record)) => ForceRelease::Released(record),
            ("not_processing", Some(record)) => ForceRelease::NotProcessing(record),
            _ => ForceRelease::NotFound,
        })
    }

    async fn erase(&self, scope: &ScopeHash) -> Result<Erasure, StoreError> {
        // The erasure is published, in the script, to every process's
        // replay cache (`erasures.rs`).
        let mut invocation = Invocation::on_record(&self.scripts.erase, &self.prefix, scope);
        let hex = scope.hex_bytes();
        invocation
            .arg(crate::erasures::channel(&self.prefix))
            .arg(&hex[..]);
        let (kind, record) = operator_reply(self, invocation, scope).await?;
        Ok(match (kind.as_str(), record) {
            ("erased", Some(record)) => Erasure::Erased(record),
            ("processing", Some(record)) => Erasure::Processing(record),
            _ => Erasure::NotFound,
        })
    }
}
