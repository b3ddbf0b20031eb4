//! Idempotent commands without HTTP: a message consumer, a job, a CLI.
//!
//! [`IdempotencyLayer::run`] runs an async action at most once per scope
//! (tenant, operation, key) and otherwise answers from the record, with the
//! same machinery as the HTTP layer: the state machine, leases renewed
//! while the action runs, fenced completions, takeovers with the next
//! generation, the attempt history, a record made again if a failover lost
//! it. The layer's settings apply (lease, retention, store timeout,
//! in-flight waiting), so one configured layer serves routes and commands.
//!
//! The result round-trips as the caller's type: it is stored as JSON (a
//! `200` outcome), and a permanent error as JSON too (a `422` outcome), so
//! a redelivered command gets the same answer, typed. A temporary error
//! releases the key: the next delivery runs the action again. A result
//! that does not encode as JSON is still an action that ran: the delivery
//! that ran it gets it, and the record keeps the outcome without the value,
//! so later deliveries get [`CommandError::ResultNotStored`] and nothing
//! runs twice.
//!
//! ```
//! use idem_core::IdempotencyKey;
//! use idem_layer::{ActionError, Command, Done, IdempotencyLayer};
//! use idem_memory::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let commands = IdempotencyLayer::new(MemoryStore::new());
//! let key = IdempotencyKey::parse(b"charge-42").unwrap();
//! let charge = Command::new("shop-1", "charge", key, &serde_json::json!({ "cents": 1299 })).unwrap();
//!
//! let first = commands
//!     .run(&charge, |_ctx| async { Ok::<_, ActionError<String>>(String::from("receipt-1")) })
//!     .await;
//! assert_eq!(first.unwrap(), Done::Ran("receipt-1".to_owned()));
//!
//! // A redelivery: the action does not run; the stored result comes back.
//! let again = commands
//!     .run(&charge, |_ctx| async { Ok::<_, ActionError<String>>(String::from("receipt-2")) })
//!     .await;
//! assert_eq!(again.unwrap(), Done::Replayed("receipt-1".to_owned()));
//! # }
//! ```

use std::{future::Future, panic::AssertUnwindSafe, time::Duration};

use bytes::Bytes;
use futures_util::FutureExt;
use http::StatusCode;
use idem_core::{
    Attempt, AttemptId, Current, Fingerprint, IdempotencyKey, Lease, Outcome, Replay,
    ReserveRequest, Scope, ScopeFormat, Store, StoreError, StoredResponse,
};
use serde::{Serialize, de::DeserializeOwned};
use sha2::{Digest, Sha256};

use crate::{
    IdempotencyLayer,
    engine::{Admission, Found, Lapse, admit, renewing, settle},
    fingerprint::{canonical_tokens, update_part},
    metrics::{self as m, Outcome as Counted},
    pending::Recording,
};

/// The status a successful command's result is stored with.
const SUCCEEDED: u16 = 200;

/// The status a permanently failed command's error is stored with.
const FAILED: u16 = 422;

/// One command: where its record lives (tenant, operation, key) and what
/// makes two deliveries the same command (the fingerprint of its payload).
#[derive(Debug, Clone)]
pub struct Command {
    scope: Scope,
    fingerprint: Fingerprint,
}

impl Command {
    /// A command whose fingerprint is its payload as canonical JSON (keys
    /// sorted, numbers by exact value), so re-encoding the same payload is
    /// the same command and a changed one is a conflict.
    pub fn new(
        tenant: impl Into<String>,
        operation: impl Into<String>,
        key: IdempotencyKey,
        payload: &impl Serialize,
    ) -> Result<Self, serde_json::Error> {
        let operation = operation.into();
        let json = serde_json::to_vec(payload)?;
        let canonical = canonical_tokens(&json).unwrap_or(json);
        let mut hasher = Sha256::new();
        hasher.update(b"idem-command-v1");
        update_part(&mut hasher, operation.as_bytes());
        update_part(&mut hasher, &canonical);
        let fingerprint = Fingerprint::from_bytes(hasher.finalize().into());
        Ok(Self::with_fingerprint(
            Scope::new(tenant.into(), operation, key),
            fingerprint,
        ))
    }

    /// A command with a fingerprint of the caller's making.
    pub fn with_fingerprint(scope: Scope, fingerprint: Fingerprint) -> Self {
        Self { scope, fingerprint }
    }

    /// Its scope, with the unkeyed hash: a layer with a
    /// [`scope_secret`](IdempotencyLayer::scope_secret) runs it under the
    /// keyed hash of the same parts.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// Its fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

/// What the action learns about its execution.
#[derive(Debug, Clone)]
pub struct CommandContext {
    /// This attempt's id.
    pub attempt: AttemptId,
    /// This attempt's generation (1 for the first).
    pub generation: u64,
    /// On a takeover, the attempt whose lease lapsed: it may or may not
    /// have acted. Reconcile (by the key) before acting again.
    pub superseded: Option<Attempt>,
}

/// How an action failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionError<E> {
    /// Worth retrying: the key is released and the next delivery runs the
    /// action again. Nothing is stored.
    Temporary(E),
    /// Final: stored, and every later delivery gets the same error.
    Permanent(E),
}

/// A command's result.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Done<T> {
    /// The action ran now and its result was recorded.
    Ran(T),
    /// The action had run before; this is its stored result.
    Replayed(T),
    /// The action ran now, but the store did not take its result yet: the
    /// layer records it in the background. Until `recording` says it is
    /// recorded, do not acknowledge the delivery (a crash now would leave
    /// the record processing, and a redelivery could run the action again
    /// once its lease lapsed); tell the broker the work is in progress
    /// meanwhile.
    Unrecorded {
        /// The action's result.
        value: T,
        /// Resolves once the store took the result.
        recording: Recording,
    },
}

impl<T> Done<T> {
    /// The result, however it came.
    pub fn into_inner(self) -> T {
        match self {
            Done::Ran(value) | Done::Replayed(value) | Done::Unrecorded { value, .. } => value,
        }
    }

    /// Whether the result was replayed from the record.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Done::Replayed(_))
    }

    /// Whether the result is in the record now (a replay, or an action
    /// whose result the store took).
    pub fn is_recorded(&self) -> bool {
        match self {
            Done::Ran(_) | Done::Replayed(_) => true,
            Done::Unrecorded { recording, .. } => recording.is_recorded(),
        }
    }
}

/// Why a command has no result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError<E> {
    /// Another delivery of the command is running (its lease has this
    /// long left). Retry later; do not acknowledge a message yet.
    #[error("the command is in progress; retry in {retry_after:?}")]
    InProgress {
        /// Time left on the running attempt's lease.
        retry_after: Duration,
    },
    /// The key was used with another payload.
    #[error("the key was used with another payload")]
    Conflict,
    /// The command was cancelled.
    #[error("the command was cancelled")]
    Cancelled,
    /// The action failed permanently, now or on an earlier delivery
    /// (`replayed`); the error is stored.
    #[error("the command failed permanently")]
    Failed {
        /// The action's error.
        error: E,
        /// Whether it came from the record.
        replayed: bool,
        /// When it failed now and the store did not take the error yet:
        /// the background recording to wait on before acknowledging (see
        /// [`Done::Unrecorded`]).
        recording: Option<Recording>,
    },
    /// The action failed temporarily, or panicked (`None`); the key was
    /// released, so the next delivery runs it again.
    #[error("the command failed temporarily; it may be retried")]
    Retry(Option<E>),
    /// The stored result does not decode as the caller's type.
    #[error("the stored result does not decode: {0}")]
    Undecodable(#[source] serde_json::Error),
    /// The action ran on an earlier delivery, but its result (or its
    /// permanent error) was recorded without its value: it did not encode
    /// as JSON, or it crossed the store's size bound. It never runs again;
    /// acknowledge the delivery. (The delivery that ran it got the value.)
    #[error("the command ran on an earlier delivery; its result was not stored")]
    ResultNotStored {
        /// The status it was recorded with: 200 for a result, 422 for a
        /// permanent error.
        status: u16,
    },
    /// The layer's configuration is invalid (see
    /// [`IdempotencyLayer::validate`]); the action was not run.
    #[error("invalid idempotency configuration: {0}")]
    Misconfigured(#[source] crate::ConfigError),
    /// The store failed: nothing is known; retry later.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<S: Store> IdempotencyLayer<S> {
    /// Runs `action` at most once for `command`, and otherwise answers
    /// from its record (see the [module docs](crate::command)).
    pub async fn run<T, E, F, Fut>(
        &self,
        command: &Command,
        action: F,
    ) -> Result<Done<T>, CommandError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        F: FnOnce(CommandContext) -> Fut,
        Fut: Future<Output = Result<T, ActionError<E>>>,
    {
        let config = &*self.runtime.config;
        config.validate().map_err(CommandError::Misconfigured)?;
        let mut request = ReserveRequest {
            scope: match (&config.scope_secret, config.scope_format) {
                (None, ScopeFormat::Sha256) => command.scope.clone(),
                (secret, format) => command.scope.rehashed_as(format, secret.as_ref()),
            },
            fingerprint: command.fingerprint,
            lease: config.timing.lease,
            retention: config.timing.retention,
        };
        let (lease, superseded) = match self.reserve_command(&mut request).await? {
            Ok(reserved) => reserved,
            Err(answer) => return answer,
        };
        let context = CommandContext {
            attempt: lease.attempt,
            generation: lease.generation,
            superseded,
        };
        let work = AssertUnwindSafe(action(context)).catch_unwind();
        // Lists the attempt if its lease lapses while it runs; dropped
        // last, after its outcome was recorded or handed on.
        let lapse = Lapse::new(&self.runtime.pending);
        let produced = renewing(&*self.runtime.store, &lease, Some(&lapse), work).await;
        // The action ran: its result is recorded whatever happens to its
        // encoding. One that does not encode (a map with keys JSON cannot
        // name, a failing `Serialize`) is recorded without its value, so a
        // redelivery gets `ResultNotStored` instead of running it again.
        let (status, body, result) = match produced {
            Ok(Ok(value)) => (SUCCEEDED, serde_json::to_vec(&value), Ok(Done::Ran(value))),
            Ok(Err(ActionError::Permanent(error))) => {
                let body = serde_json::to_vec(&error);
                let failed = CommandError::Failed {
                    error,
                    replayed: false,
                    recording: None,
                };
                (FAILED, body, Err(failed))
            }
            Ok(Err(ActionError::Temporary(error))) => {
                return self.give_up(&lease, CommandError::Retry(Some(error))).await;
            }
            Err(_panic) => return self.give_up(&lease, CommandError::Retry(None)).await,
        };
        let outcome = encoded(status, body);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        // A command's result is its handler's own: never unknown by
        // default; a classifier that says so keeps the result recorded
        // (answered, as for a stored status), never released.
        let stores = self
            .runtime
            .config
            .answers
            .classify
            .verdict(status, None, false)
            != crate::classify::Verdict::Released;
        match settle(&self.runtime, &request, &lease, stores, outcome).await {
            // Fenced: a newer attempt or a cancellation owns the record;
            // its answer is the command's.
            Some(current) => answer(current),
            // Held for a background completion: the caller learns it is
            // not recorded yet, and gets a handle to wait on.
            None => match self.runtime.pending.recording(request.scope.hash()) {
                None => result,
                Some(recording) => unrecorded(result, recording),
            },
        }
    }

    /// Reserves the command's scope (see [`admit`]): the lease (and the
    /// attempt it took over from), or the answer the record already gives.
    async fn reserve_command<T, E>(
        &self,
        request: &mut ReserveRequest,
    ) -> Result<Reserved<T, E>, StoreError>
    where
        T: DeserializeOwned,
        E: DeserializeOwned,
    {
        let answer = match admit(&self.runtime, request, |_| false).await {
            Admission::Run { lease, superseded } => return Ok(Ok((lease, superseded))),
            Admission::Held(error) | Admission::Failed(error) => return Err(error),
            Admission::Found(Found::InProgress(retry_after)) => {
                m::count(Counted::InProgress);
                Err(CommandError::InProgress { retry_after })
            }
            Admission::Found(Found::Completed(replay)) => replayed(replay),
            Admission::Found(Found::Cancelled) => {
                m::count(Counted::Cancelled);
                Err(CommandError::Cancelled)
            }
            Admission::Found(Found::Conflict) => {
                m::count(Counted::Conflict);
                Err(CommandError::Conflict)
            }
        };
        Ok(Err(answer))
    }

    /// Releases the key after a failed or unrecordable action: `error`, or
    /// what the record says if the attempt lost its lease meanwhile.
    async fn give_up<T: DeserializeOwned, E: DeserializeOwned>(
        &self,
        lease: &Lease,
        error: CommandError<E>,
    ) -> Result<Done<T>, CommandError<E>> {
        match self.runtime.release(lease).await {
            Some(current) => answer(current),
            None => Err(error),
        }
    }
}

/// A command's reservation: the lease and the attempt it took over from,
/// or the answer the record already gives.
type Reserved<T, E> = Result<(Lease, Option<Attempt>), Result<Done<T>, CommandError<E>>>;

/// A stored outcome as the command's result.
fn replayed<T: DeserializeOwned, E: DeserializeOwned>(
    replay: Replay,
) -> Result<Done<T>, CommandError<E>> {
    m::count(Counted::Replayed);
    let stored = match replay.outcome {
        Outcome::Stored(stored) => stored,
        Outcome::NotStored { status } => return Err(CommandError::ResultNotStored { status }),
    };
    match stored.status {
        SUCCEEDED => serde_json::from_slice(&stored.body)
            .map(Done::Replayed)
            .map_err(CommandError::Undecodable),
        _ => match serde_json::from_slice(&stored.body) {
            Ok(error) => Err(CommandError::Failed {
                error,
                replayed: true,
                recording: None,
            }),
            Err(error) => Err(CommandError::Undecodable(error)),
        },
    }
}

/// What the record says, for an attempt that lost its lease.
fn answer<T: DeserializeOwned, E: DeserializeOwned>(
    current: Current,
) -> Result<Done<T>, CommandError<E>> {
    match current {
        Current::Completed(replay) => replayed(replay),
        Current::Processing { retry_after } => Err(CommandError::InProgress { retry_after }),
        Current::Cancelled => Err(CommandError::Cancelled),
        Current::Vacant => Err(CommandError::Retry(None)),
    }
}

/// The outcome a command's encoded result makes: stored as JSON, or, when
/// it did not encode, recorded without it (logged).
fn encoded(status: u16, body: Result<Vec<u8>, serde_json::Error>) -> Outcome {
    match body {
        Ok(body) => Outcome::Stored(StoredResponse {
            status,
            headers: vec![(
                http::header::CONTENT_TYPE,
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from(body),
        }),
        Err(error) => {
            tracing::error!(
                %error,
                status,
                "the command's result does not encode as JSON; it is recorded without it"
            );
            Outcome::NotStored { status }
        }
    }
}

/// A result whose recording a store error held up: the caller gets it
/// with a handle to wait on.
fn unrecorded<T, E>(
    result: Result<Done<T>, CommandError<E>>,
    recording: crate::Recording,
) -> Result<Done<T>, CommandError<E>> {
    match result {
        Ok(done) => Ok(Done::Unrecorded {
            value: done.into_inner(),
            recording,
        }),
        Err(CommandError::Failed {
            error, replayed, ..
        }) => Err(CommandError::Failed {
            error,
            replayed,
            recording: Some(recording),
        }),
        Err(other) => Err(other),
    }
}
