//! The router around the layer the flags describe (see
//! [`protection`](crate::protection)): the proxy, the records API,
//! `/healthz`, `/metrics`, the operator page, and the front middleware
//! (log line, `Connection` check, JWT tenant).

use crate::{
    StartError,
    answer::{GatewayCode, problem},
    config::Config,
    jwt,
    lapsed::watch_lapsed,
    metrics::prometheus,
    protection::layer,
    proxy::{self, Proxy},
    tenants::{Tenants, generated_secret_warning, tenant_hash},
    trace::{Spans, traced},
};

use std::{future::Future, time::Duration};

use axum::{
    Router,
    extract::{Request, State},
    http::{HeaderName, Method, StatusCode, Uri},
    middleware::{self, Next},
    response::Response,
    routing::get,
};
use idem_core::{Fleet, RecordsAdmin, ScopeHash, Store};
use idem_layer::{IdempotencyLayer, ProblemCode, Tenant};

/// A store's own health check for `/healthz`: `Ok` with what it found
/// (200), or `Err` with what is wrong (503). Without one, a read of an
/// empty scope proves the store answers.
pub(crate) type Health = std::sync::Arc<
    dyn Fn() -> futures_util::future::BoxFuture<'static, Result<String, String>> + Send + Sync,
>;

/// `/healthz`: the store's own check if it has one, else a read of an
/// empty scope; 200 or 503 with one line.
pub(crate) async fn health_answer<S: Store>(
    health: Option<Health>,
    store: std::sync::Arc<S>,
    timeout: Duration,
) -> (StatusCode, String) {
    let checked = match health {
        Some(check) => tokio::time::timeout(timeout * 4, check())
            .await
            .unwrap_or_else(|_| Err("health check timed out".to_owned())),
        None => {
            // Any read proves the store answers; this scope holds nothing.
            let nothing = ScopeHash::from_bytes([0; 32]);
            match tokio::time::timeout(timeout, store.get(&nothing)).await {
                Ok(Ok(_)) => Ok("ok".to_owned()),
                _ => Err("store unavailable".to_owned()),
            }
        }
    };
    match checked {
        Ok(text) => (StatusCode::OK, format!("{text}\n")),
        Err(text) => (StatusCode::SERVICE_UNAVAILABLE, format!("{text}\n")),
    }
}

pub(crate) fn router<S: RecordsAdmin + Fleet>(
    config: &Config,
    tenants: &Tenants,
    store: S,
    health: Option<Health>,
    upstream: Uri,
    spans: Option<Spans>,
    guard: idem_layer::StoreGuard,
) -> Result<(Router, Drain), StartError> {
    let layer = layer(config, tenants, store)?.store_guard(guard);
    if tenants.generated && config.tenant_header.is_none() {
        generated_secret_warning(&config.store);
    }
    watch_lapsed(std::sync::Arc::clone(layer.store()));
    let health_store = std::sync::Arc::clone(layer.store());
    let timeout = config.store_timeout;
    let unknowns = crate::operator::Unknowns::default();
    let proxy = upstream_proxy(config, upstream, &unknowns)?;
    let protected = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(proxy);
    // What no gateway route matched and any reading names as the
    // gateway's is refused here, before the layer could read it its own way.
    let protected = crate::owned::RefuseOwned::new(
        crate::owned::OwnedPaths::new(&config.records_prefix),
        protected,
    );
    let metrics = prometheus().clone();
    let drain = Drain::of(&layer);
    let protected_headers: Vec<HeaderName> = [
        http::header::AUTHORIZATION,
        idem_layer::IDEMPOTENCY_KEY,
        proxy::IDEMPOTENCY_ATTEMPT,
    ]
    .into_iter()
    .chain(config.tenant_header.clone())
    .collect();
    let records_path = format!("{}/records", config.records_prefix);
    let jwt = tenants.jwt.clone().map(|jwt| JwtState {
        jwt,
        tenants: idem_layer::TenantHasher::new(tenant_hash(config), &tenants.secret),
        methods: std::sync::Arc::new(config.methods.clone()),
        records_path: std::sync::Arc::from(records_path.as_str()),
    });
    let operator = operator_routes(config, &layer, unknowns);
    let router = Router::new()
        .merge(operator)
        .route(
            "/healthz",
            get(move || {
                health_answer(
                    health.clone(),
                    std::sync::Arc::clone(&health_store),
                    timeout,
                )
            }),
        )
        .route("/metrics", get(move || async move { metrics.render() }))
        .route_service(&records_path, layer.records_service())
        .fallback_service(protected)
        .layer(middleware::from_fn_with_state(
            Front {
                type_base: config
                    .problem_type_base
                    .as_deref()
                    .map(std::sync::Arc::from),
                should_retry: config.should_retry_header.clone(),
                error_member: config.problem_error_member,
                guard: ConnectionGuard(std::sync::Arc::new(protected_headers)),
                jwt,
                spans,
            },
            front,
        ));
    Ok((router, drain))
}

/// The proxy to the upstream the flags name (its CA, HTTP/2, forwarded
/// fields), noting its unknown outcomes for the operator page.
fn upstream_proxy(
    config: &Config,
    upstream: Uri,
    unknowns: &crate::operator::Unknowns,
) -> Result<Proxy, StartError> {
    let tls = proxy::tls_config(config.upstream_ca.as_deref()).map_err(StartError::Setting)?;
    let mut proxy = Proxy::new(upstream, config.upstream_timeout, tls.clone());
    if config.upstream_http2 {
        proxy = proxy.http2(tls);
    }
    Ok(proxy
        .forwarded(config.forwarded)
        .noting_unknowns(unknowns.clone()))
}

/// The operator page, behind the records admin token; without the token,
/// its paths answer `404 operator_page_off` (never forwarded: they are the
/// gateway's).
fn operator_routes<S: RecordsAdmin>(
    config: &Config,
    layer: &IdempotencyLayer<S>,
    unknowns: crate::operator::Unknowns,
) -> Router {
    match &config.records_admin_token {
        Some(token) => crate::operator::routes(
            std::sync::Arc::clone(layer.store()),
            token.as_bytes(),
            unknowns,
            &format!("{}/operator", config.records_prefix),
            !config.operator_plain_http,
        ),
        // Not forwarded to the upstream either: the path is the gateway's.
        None => {
            let off = || async {
                problem(
                    StatusCode::NOT_FOUND,
                    "operator_page_off",
                    "No operator page",
                    "the operator page is served only with --records-admin-token",
                )
            };
            let path = format!("{}/operator", config.records_prefix);
            Router::new()
                .route(&path, axum::routing::any(off))
                .route(&format!("{path}/{{*rest}}"), axum::routing::any(off))
        }
    }
}

/// What the gateway does in front of every route, in this order: the
/// trace context and the exported span ([`traced`]), the log
/// line ([`log_request`]), the `Connection` check
/// ([`refuse_connection_naming`]) and the JWT tenant ([`tenant_from_jwt`]).
/// One middleware, not three: each layer of axum's middleware clones and
/// boxes the services behind it on every request.
#[derive(Clone)]
pub(crate) struct Front {
    /// `--problem-type-base`, for the gateway's own problem answers.
    type_base: Option<std::sync::Arc<str>>,
    /// `--should-retry-header`, for the gateway's own problem answers.
    should_retry: Option<HeaderName>,
    /// `--problem-error-member`, for the gateway's own problem answers.
    error_member: bool,
    guard: ConnectionGuard,
    jwt: Option<JwtState>,
    spans: Option<Spans>,
}

pub(crate) async fn front(State(front): State<Front>, request: Request, next: Next) -> Response {
    let response = traced(
        front.spans.as_ref(),
        request,
        |request| {
            log_request(request, |request| async move {
                refuse_connection_naming(&front.guard, request, |request| {
                    tenant_from_jwt(front.jwt.as_ref(), request, next)
                })
                .await
            })
        },
        outcome_of,
    )
    .await;
    crate::answer::shaped(
        response,
        front.type_base.as_deref(),
        front.should_retry.as_ref(),
        front.error_member,
    )
    .await
}

/// What the JWT tenant middleware needs.
#[derive(Clone)]
pub(crate) struct JwtState {
    jwt: jwt::JwtTenants,
    tenants: idem_layer::TenantHasher,
    methods: std::sync::Arc<Vec<Method>>,
    records_path: std::sync::Arc<str>,
}

/// With `--tenant-jwt-keys`: a request that needs a tenant (a keyed request
/// of a protected method, or the records API) and carries a bearer token
/// gets the keyed hash of the verified claim as its tenant; a token that
/// fails verification is `401 idempotency_tenant_invalid`, never a tenant
/// of its own. Without `Authorization` the layer decides (401 or the
/// anonymous tenant).
pub(crate) async fn tenant_from_jwt(
    state: Option<&JwtState>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(state) = state else {
        return next.run(request).await;
    };
    let method = request.method().as_str();
    let needs_tenant = request.uri().path() == &*state.records_path
        || (request.headers().contains_key(idem_layer::IDEMPOTENCY_KEY)
            && state
                .methods
                .iter()
                .any(|m| m.as_str().eq_ignore_ascii_case(method)));
    // A token given twice names no caller: the upstream may read the
    // other copy.
    let mut tokens = request
        .headers()
        .get_all(http::header::AUTHORIZATION)
        .iter();
    let first = tokens.next();
    if needs_tenant && first.is_some() && tokens.next().is_some() {
        return problem(
            StatusCode::UNAUTHORIZED,
            "idempotency_tenant_invalid",
            "Caller's token could not be verified",
            "the request carries more than one Authorization header",
        );
    }
    let verified = first
        .filter(|_| needs_tenant)
        .map(|authorization| state.jwt.claim(authorization.as_bytes()));
    if let Some(verified) = verified {
        match verified {
            Ok(claim) => {
                let tenant = state.tenants.tenant("jwt:", claim.as_bytes());
                request.extensions_mut().insert(Tenant(tenant));
            }
            Err(why) => {
                tracing::info!(why, "refused a bearer token");
                return problem(
                    StatusCode::UNAUTHORIZED,
                    "idempotency_tenant_invalid",
                    "Caller's token could not be verified",
                    &format!("the bearer token could not be verified: {why}"),
                );
            }
        }
    }
    next.run(request).await
}

/// Headers a `Connection` field must not name.
#[derive(Clone)]
pub(crate) struct ConnectionGuard(std::sync::Arc<Vec<HeaderName>>);

/// A `Connection` field makes the headers it names hop-by-hop, so the
/// gateway would strip them after the layer used them: the upstream would
/// get an anonymous, keyless request. Such a request is refused with
/// `400 connection_header_invalid`.
pub(crate) async fn refuse_connection_naming<F: Future<Output = Response>>(
    guard: &ConnectionGuard,
    request: Request,
    next: impl FnOnce(Request) -> F,
) -> Response {
    // RFC 9112, 3.2: a request with no Host (HTTP/1.1, no authority in
    // its target) or more than one is answered 400; the gateway would
    // otherwise pass a spoofed host on in X-Forwarded-Host.
    let mut hosts = request.headers().get_all(http::header::HOST).iter();
    let first_host = hosts.next();
    let no_host = first_host.is_none()
        && request.version() == http::Version::HTTP_11
        && request.uri().authority().is_none();
    // Two hosts joined in one line (`Host: a, b`) are two hosts too.
    let joined = first_host.is_some_and(|host| host.as_bytes().contains(&b','));
    if no_host || joined || hosts.next().is_some() {
        return problem(
            StatusCode::BAD_REQUEST,
            "host_header_invalid",
            "Host header missing or repeated",
            "an HTTP/1.1 request carries exactly one Host header",
        );
    }
    let names_protected =
        proxy::connection_names(request.headers()).any(|name| guard.0.contains(&name));
    if names_protected {
        return problem(
            StatusCode::BAD_REQUEST,
            "connection_header_invalid",
            "Connection header names an end-to-end header",
            "the Connection header may not name Authorization, Idempotency-Key, \
             Idempotency-Attempt or the tenant header",
        );
    }
    next(request).await
}

/// One log line per request: method, path, status, idempotency outcome and
/// latency. Never the raw key.
pub(crate) async fn log_request<F: Future<Output = Response>>(
    request: Request,
    next: impl FnOnce(Request) -> F,
) -> Response {
    // With the line filtered out (`RUST_LOG=warn`, say), nothing is
    // gathered for it: no clock read, no copy of the path.
    if !tracing::enabled!(tracing::Level::INFO) {
        return next(request).await;
    }
    let started = std::time::Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let keyed = request.headers().contains_key(idem_layer::IDEMPOTENCY_KEY);
    let response = next(request).await;
    let outcome = outcome_of(keyed, &response);
    // The crate's own target (`idem_gateway: request ...`), whichever
    // module writes the line: log pipelines match on it.
    tracing::info!(
        target: "idem_gateway",
        %method,
        path,
        status = response.status().as_u16(),
        outcome,
        latency_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
    response
}

/// How a request was answered, for its log line and its span: a problem
/// code (idem's or the gateway's), `replayed`, `executed` (keyed) or
/// `passthrough`.
pub(crate) fn outcome_of(keyed: bool, response: &Response) -> &'static str {
    if let Some(code) = response.extensions().get::<ProblemCode>() {
        code.as_str()
    } else if let Some(GatewayCode(code)) = response.extensions().get::<GatewayCode>() {
        code
    } else if response
        .headers()
        .contains_key(idem_layer::IDEMPOTENT_REPLAYED)
    {
        "replayed"
    } else if keyed {
        "executed"
    } else {
        "passthrough"
    }
}

/// The layer's part of a shutdown: `close` when the server stops taking
/// requests (answers fetched by key stop waiting), then `wait` for its
/// background work, up to a bound (answers how much was left).
pub(crate) struct Drain {
    pub(crate) close: Box<dyn Fn() + Send + Sync>,
    pub(crate) wait:
        Box<dyn Fn(Duration) -> futures_util::future::BoxFuture<'static, usize> + Send>,
}

impl Drain {
    /// Closing and draining `layer`.
    fn of<S: Store>(layer: &IdempotencyLayer<S>) -> Self {
        let (draining, closing) = (layer.clone(), layer.clone());
        Drain {
            close: Box::new(move || closing.close()),
            wait: Box::new(move |bound| {
                let layer = draining.clone();
                Box::pin(async move { layer.drain(bound).await })
            }),
        }
    }
}
