//! A tonic payments service whose `Charge` call runs once per
//! idempotency key, behind [`IdempotencyLayer`].
//!
//! The messages are derived with prost directly (no `.proto` compiler on
//! the build machine); the service and the client are what `tonic-build`
//! would generate, written out for one unary method:
//!
//! ```text
//! package payments.v1;
//! service Payments { rpc Charge(ChargeRequest) returns (ChargeReply); }
//! message ChargeRequest { string account = 1; int64 amount_cents = 2; }
//! message ChargeReply { string charge_id = 1; int64 amount_cents = 2; uint64 attempt = 3; }
//! ```
//!
//! A client sends its key in the `idempotency-key` metadata entry. The
//! layer runs the first call, stores its message, status and trailers, and
//! replays them to every retry with `idempotent-replayed: true`; a retry
//! with another message gets `FAILED_PRECONDITION` with
//! `idem-problem: idempotency_conflict`. A call the bank refused for now
//! (`UNAVAILABLE`) releases the key, so its retry runs. After a crash
//! between the charge and the answer, the retry after the lease runs as
//! attempt 2: the handler finds the charge in its ledger and answers it
//! instead of charging again.
//!
//! ```no_run
//! use grpc_payments::{Ledger, Payments, serve};
//! use idem_layer::IdempotencyLayer;
//! use idem_memory::MemoryStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:50051").await?;
//! let payments = Payments::new(Ledger::in_memory());
//! serve(listener, payments, IdempotencyLayer::new(MemoryStore::new())).await?;
//! # Ok(()) }
//! ```

use std::{
    convert::Infallible,
    io::Write,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use idem_core::Store;
use idem_layer::{IdempotencyContext, IdempotencyLayer, TenantFromHeader};
use tonic::{
    Request, Response, Status,
    body::Body,
    codegen::{BoxFuture, http},
    server::NamedService,
};

/// The messages of `payments.v1`.
pub mod proto {
    /// A charge to make once.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ChargeRequest {
        /// The account charged.
        #[prost(string, tag = "1")]
        pub account: String,
        /// How much, in cents; must be positive.
        #[prost(int64, tag = "2")]
        pub amount_cents: i64,
    }

    /// The charge made.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ChargeReply {
        /// The charge's id in the ledger.
        #[prost(string, tag = "1")]
        pub charge_id: String,
        /// How much was charged.
        #[prost(int64, tag = "2")]
        pub amount_cents: i64,
        /// The attempt (lease generation) that answered.
        #[prost(uint64, tag = "3")]
        pub attempt: u64,
    }
}

use proto::{ChargeReply, ChargeRequest};

/// The service's name.
pub const SERVICE: &str = "payments.v1.Payments";
/// The path of the `Charge` method.
pub const CHARGE: &str = "/payments.v1.Payments/Charge";
/// The tenant metadata entry (a trusted proxy sets it in production).
pub const TENANT: &str = "x-tenant";

/// One charge in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// Its id.
    pub id: String,
    /// The idempotency key it was made under.
    pub key: String,
    /// The account.
    pub account: String,
    /// The amount in cents.
    pub amount_cents: i64,
}

/// The bank's ledger: every charge made, in memory or appended to a file
/// (one line per charge, synced before the charge counts as made, so a
/// crash right after it leaves it in the file).
#[derive(Debug)]
pub struct Ledger {
    charges: Mutex<Vec<Charge>>,
    file: Option<PathBuf>,
}

impl Ledger {
    /// A ledger in memory.
    pub fn in_memory() -> Self {
        Self {
            charges: Mutex::new(Vec::new()),
            file: None,
        }
    }

    /// A ledger kept in `path`, with the charges the file already holds.
    pub fn in_file(path: PathBuf) -> std::io::Result<Self> {
        let charges = match std::fs::read_to_string(&path) {
            Ok(text) => text.lines().filter_map(Self::parse).collect(),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(error) => return Err(error),
        };
        Ok(Self {
            charges: Mutex::new(charges),
            file: Some(path),
        })
    }

    fn parse(line: &str) -> Option<Charge> {
        let mut fields = line.split('\t');
        Some(Charge {
            id: fields.next()?.to_owned(),
            key: fields.next()?.to_owned(),
            account: fields.next()?.to_owned(),
            amount_cents: fields.next()?.parse().ok()?,
        })
    }

    /// Makes a charge.
    pub fn charge(&self, key: &str, account: &str, amount_cents: i64) -> std::io::Result<Charge> {
        let charge = Charge {
            id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
            key: key.to_owned(),
            account: account.to_owned(),
            amount_cents,
        };
        let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(path) = &self.file {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            writeln!(
                file,
                "{}\t{}\t{}\t{}",
                charge.id, charge.key, charge.account, charge.amount_cents
            )?;
            file.sync_all()?;
        }
        charges.push(charge.clone());
        Ok(charge)
    }

    /// The charge made under `key`, if one was.
    pub fn find(&self, key: &str) -> Option<Charge> {
        let charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        charges.iter().find(|charge| charge.key == key).cloned()
    }

    /// Every charge made.
    pub fn charges(&self) -> Vec<Charge> {
        self.charges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The `Payments` service.
#[derive(Debug, Clone)]
pub struct Payments {
    ledger: Arc<Ledger>,
    runs: Arc<AtomicUsize>,
    unavailable: Arc<AtomicU32>,
    hold: Arc<Mutex<Duration>>,
}

impl Payments {
    /// The service over `ledger`.
    pub fn new(ledger: Ledger) -> Self {
        Self {
            ledger: Arc::new(ledger),
            runs: Arc::default(),
            unavailable: Arc::default(),
            hold: Arc::default(),
        }
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// How many times `Charge` ran.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// The next `calls` charges find the bank unavailable (`UNAVAILABLE`,
    /// nothing charged).
    pub fn bank_unavailable_for(&self, calls: u32) {
        self.unavailable.store(calls, Ordering::SeqCst);
    }

    /// Each charge takes `hold` between the charge and the answer.
    pub fn hold_answers(&self, hold: Duration) {
        *self.hold.lock().unwrap_or_else(|e| e.into_inner()) = hold;
    }

    /// Waits what [`hold_answers`](Self::hold_answers) set.
    async fn hold(&self) {
        let hold = *self.hold.lock().unwrap_or_else(|e| e.into_inner());
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
    }

    /// `Charge`: charges the account once per key.
    pub async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let context = request.extensions().get::<IdempotencyContext>().cloned();
        // The benchmarks' baseline charges without the layer.
        #[cfg(not(feature = "bench"))]
        let Some(context) = context else {
            return Err(Status::failed_precondition(
                "Charge runs behind the idempotency layer with a key",
            ));
        };
        #[cfg(feature = "test-hooks")]
        let crash = hooks::crash_asked(request.metadata());
        let charge = request.into_inner();
        if charge.amount_cents <= 0 {
            return Err(Status::invalid_argument("amount_cents must be positive"));
        }
        let taken = self
            .unavailable
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            });
        if taken.is_ok() {
            return Err(Status::unavailable(
                "the bank is unavailable; nothing was charged",
            ));
        }
        #[cfg(feature = "bench")]
        let Some(context) = context else {
            let made = self
                .ledger
                .charge("", &charge.account, charge.amount_cents)
                .map_err(|error| Status::internal(format!("the ledger failed: {error}")))?;
            self.hold().await;
            return Ok(Response::new(ChargeReply {
                charge_id: made.id,
                amount_cents: made.amount_cents,
                attempt: 0,
            }));
        };
        let key = context.key.as_str();
        // A takeover: the attempt before may have charged and crashed
        // before answering. The ledger says whether it did.
        let found = context
            .superseded
            .is_some()
            .then(|| self.ledger.find(key))
            .flatten();
        let made = match found {
            Some(charge) => charge,
            None => self
                .ledger
                .charge(key, &charge.account, charge.amount_cents)
                .map_err(|error| Status::internal(format!("the ledger failed: {error}")))?,
        };
        #[cfg(feature = "test-hooks")]
        if crash {
            // Held between the charge and the answer until the test kills
            // the process.
            eprintln!("grpc-payments: charged {}, holding the answer", made.id);
            std::future::pending::<()>().await;
        }
        self.hold().await;
        let mut response = Response::new(ChargeReply {
            charge_id: made.id.clone(),
            amount_cents: made.amount_cents,
            attempt: context.generation,
        });
        if let Ok(id) = made.id.parse() {
            response.metadata_mut().insert("x-charge-id", id);
        }
        Ok(response)
    }
}

impl NamedService for Payments {
    const NAME: &'static str = SERVICE;
}

/// One unary method as tonic's server runs it.
struct ChargeMethod(Payments);

impl tonic::server::UnaryService<ChargeRequest> for ChargeMethod {
    type Response = ChargeReply;
    type Future = BoxFuture<Response<ChargeReply>, Status>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move { payments.charge(request).await })
    }
}

impl<B> tower::Service<http::Request<B>> for Payments
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let payments = self.clone();
        Box::pin(async move {
            if request.uri().path() != CHARGE {
                let status = Status::unimplemented(request.uri().path().to_owned());
                return Ok(status.into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(ChargeMethod(payments), request).await)
        })
    }
}

/// A `Payments` client over any tonic channel (or a channel behind
/// middleware, such as `idem_client`'s retry layer).
#[derive(Debug, Clone)]
pub struct PaymentsClient<T> {
    inner: tonic::client::Grpc<T>,
}

impl<T> PaymentsClient<T>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    /// A client over `channel`.
    pub fn new(channel: T) -> Self {
        Self {
            inner: tonic::client::Grpc::new(channel),
        }
    }

    /// Calls `Charge`.
    pub async fn charge(
        &mut self,
        request: impl tonic::IntoRequest<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|error| Status::unknown(format!("service not ready: {}", error.into())))?;
        let path = http::uri::PathAndQuery::from_static(CHARGE);
        let codec = tonic_prost::ProstCodec::default();
        self.inner.unary(request.into_request(), path, codec).await
    }
}

/// The layer for `Payments`: the tenant from the `x-tenant` metadata entry,
/// a key required (a charge without one is refused, never run twice).
pub fn payments_layer<S: Store>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store)
        .tenant(TenantFromHeader::from_static(TENANT))
        .require_key(true)
}

/// A retried request with tonic's body.
type ToTonic = fn(http::Request<idem_client::ReplayBody<Body>>) -> http::Request<Body>;
/// A tonic channel behind `idem_client`'s retry layer: one
/// `idempotency-key` for every attempt of a call (the caller's own, or a
/// fresh one), and the statuses an idempotency layer releases
/// (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, and
/// `ABORTED` for a call in progress) retried with backoff and gRPC's
/// retry pushback. Streaming calls belong on a channel without it.
pub fn retrying<T>(
    channel: T,
    retry: idem_client::RetryLayer,
) -> idem_client::Retry<tower::util::MapRequest<T, ToTonic>> {
    let to_tonic: ToTonic = |request| request.map(Body::new);
    tower::ServiceBuilder::new()
        .layer(retry)
        .map_request(to_tonic)
        .service(channel)
}

/// Serves `payments` behind `layer` on `listener` until the process ends.
pub async fn serve<S: Store>(
    listener: tokio::net::TcpListener,
    payments: Payments,
    layer: IdempotencyLayer<S>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(layer.for_any_body())
        .add_service(payments)
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
}

/// Crash points for the process tests.
#[cfg(feature = "test-hooks")]
mod hooks {
    /// Whether the call asks the process to hold its answer after the
    /// charge, for the test to kill it there (`x-test-crash:
    /// after-charge`, with `PAYMENTS_TEST_HOOKS=1`).
    pub(crate) fn crash_asked(metadata: &tonic::metadata::MetadataMap) -> bool {
        std::env::var("PAYMENTS_TEST_HOOKS").is_ok_and(|v| v == "1")
            && metadata
                .get("x-test-crash")
                .is_some_and(|value| value == "after-charge")
    }
}
