//! `idem-gateway`: a reverse proxy that puts the idem idempotency layer in
//! front of any HTTP upstream.
//!
//! The binary (`src/main.rs`) parses [`Config`] from flags and `IDEM_*`
//! environment variables and calls [`run`]; tests call [`start`] to run a
//! gateway in-process on a real listener.

mod answer;
mod config;
mod demo;
mod error;
mod jwt;
mod lapsed;
mod metrics;
mod operator;
mod owned;
mod protection;
mod proxy;
mod router;
mod stores;
mod tenants;
mod trace;

use std::{future::Future, net::SocketAddr, time::Duration};

use axum::{Router, extract::Request, http::Uri};
use tokio::net::TcpListener;

pub use config::{Config, SealingKey, Secret};
pub use error::StartError;
pub use proxy::{Forwarded, IDEMPOTENCY_ATTEMPT, PeerAddr, Proxy, tls_config};
pub use tenants::scope_secret;

use crate::{config::is_postgres, stores::store_router, tenants::Tenants};

/// What a running gateway reports about itself.
#[derive(Debug, Clone)]
pub struct Started {
    /// Where it serves.
    pub addr: SocketAddr,
    /// Where it forwards.
    pub upstream: Uri,
    /// Whether the upstream is the built-in demo.
    pub demo: bool,
}

/// Builds the gateway and serves on `listener` until `shutdown` resolves,
/// then lets in-flight requests finish. `on_start` is called once the
/// gateway is ready.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_start: impl FnOnce(&Started),
) -> Result<(), StartError> {
    let (upstream, demo) = match &config.upstream {
        Some(uri) => (uri.clone(), None),
        None => {
            let demo = demo::start().await?;
            (demo.uri.clone(), Some(demo))
        }
    };
    let tenants = Tenants::resolve(&config)?;
    // Settings of the Redis store alone.
    let on_redis = config.store != "memory" && !is_postgres(&config.store);
    for (set, flag) in [
        (config.wait_for_replicas > 0, "--wait-for-replicas"),
        (config.redis_record_format != 3, "--redis-record-format"),
    ] {
        if set && !on_redis {
            return Err(StartError::Setting(format!("{flag} needs a Redis store")));
        }
    }
    if config.keyed_scopes && config.store != "memory" && tenants.generated {
        return Err(StartError::Setting(
            "--keyed-scopes needs --tenant-secret or --tenant-secret-file: a secret generated \
             at start changes at every start, and every record would be lost with it"
                .to_owned(),
        ));
    }
    // An https collector is verified against the system's roots.
    let spans = match &config.otlp_endpoint {
        Some(endpoint) => Some(trace::Spans::start(
            endpoint,
            proxy::tls_config(None).map_err(StartError::Setting)?,
        )?),
        None => None,
    };
    let (router, drain) = store_router(&config, &tenants, upstream.clone(), spans.clone()).await?;
    let started = Started {
        addr: listener.local_addr()?,
        upstream,
        demo: demo.is_some(),
    };
    on_start(&started);
    serve(
        listener,
        router,
        config.header_timeout,
        shutdown,
        &*drain.close,
    )
    .await;
    // Connections are closed; what outlives its request (handlers whose
    // client left, completions being retried, late upstream answers) gets
    // up to the drain timeout to record its outcome.
    let left = (drain.wait)(config.drain_timeout).await;
    if left == 0 {
        tracing::info!("shutdown: every outcome recorded");
    } else {
        tracing::warn!(
            "shutdown: {left} background task(s) still running after the drain timeout \
             (requests whose upstream has not answered, outcomes not yet recorded); \
             their records stay processing until their leases lapse"
        );
    }
    if let Some(spans) = spans {
        spans.shutdown().await;
    }
    drop(demo);
    Ok(())
}

/// Accepts connections until `shutdown`, then waits for in-flight requests.
/// A client must send its request head within `header_timeout` (no
/// slow-loris connections); heads are limited to hyper's defaults (100
/// headers, about 400 KiB; beyond that the answer is 431). HTTP/1.1, and
/// HTTP/2 with prior knowledge.
async fn serve(
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
    closing: &(dyn Fn() + Send + Sync),
) {
    use hyper_util::{
        rt::{TokioExecutor, TokioIo, TokioTimer},
        server::{conn::auto, graceful::GracefulShutdown},
        service::TowerToHyperService,
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(tower::ServiceExt::map_request(
            router.clone(),
            move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(proxy::PeerAddr(peer));
                request
            },
        ));
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Requests that would wait on (answers fetched by key) answer now, so
    // that the connections close.
    closing();
    graceful.shutdown().await;
}

/// Starts a gateway in the background on `127.0.0.1:0` (for tests):
/// returns what it reports, a trigger that shuts it down, and its task.
pub async fn start(
    config: Config,
) -> Result<
    (
        Started,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), StartError>>,
    ),
    StartError,
> {
    let listener = TcpListener::bind(config.listen).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, is_ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(run(
        config,
        listener,
        async {
            let _ = stopped.await;
        },
        move |started| {
            let _ = ready.send(started.clone());
        },
    ));
    match is_ready.await {
        Ok(started) => Ok((started, stop, task)),
        Err(_) => match task.await {
            Ok(Err(error)) => Err(error),
            _ => Err(StartError::Io(std::io::Error::other(
                "the gateway stopped before it started",
            ))),
        },
    }
}
