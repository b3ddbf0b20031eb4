//! What a newcomer meets: the context extractor, tenants that keep no
//! secret, problem answers that leak nothing and can be shaped.

mod common;

use axum::{Router, routing::post};
use bytes::Bytes;
use common::{Answer, send};
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use idem_core::{
    Cancellation, Completion, Lease, Outcome, Record, Release, Renewal, Reservation,
    ReserveRequest, Scope, Store, StoreError,
};
use idem_layer::{
    IdempotencyContext, IdempotencyKey, IdempotencyLayer, Problem, ScopeHash,
    TenantFromAuthorization, TenantFromHeader,
};
use idem_memory::MemoryStore;

async fn pay(ctx: IdempotencyContext) -> String {
    format!(
        "key={} generation={} tenant={}",
        ctx.key, ctx.generation, ctx.tenant
    )
}

async fn note(ctx: Option<IdempotencyContext>) -> &'static str {
    if ctx.is_some() { "keyed" } else { "unkeyed" }
}

fn app(layer: IdempotencyLayer<MemoryStore>) -> Router {
    let protected = Router::new()
        .route("/payments", post(pay))
        .route("/notes", post(note))
        .route_service("/records", layer.records_service())
        .layer(layer);
    // A route outside the layer that still asks for the context.
    protected.merge(Router::new().route("/unprotected", post(pay)))
}

fn request(path: &str, key: Option<&str>, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut builder = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

fn code(answer: &Answer) -> Option<String> {
    answer.code()
}

#[tokio::test]
async fn the_context_extractor_says_what_happened() {
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).tenant(TenantFromHeader::from_static("x-tenant"));
    let app = app(layer);
    let tenant = [("x-tenant", "acme")];
    let keyed = send(&app, request("/payments", Some("p-1"), &tenant)).await;
    assert_eq!(keyed.status, StatusCode::OK);
    assert_eq!(&keyed.body[..], b"key=p-1 generation=1 tenant=acme");
    // Unkeyed, on a route that needs the context: 400, not an opaque 500.
    let unkeyed = send(&app, request("/payments", None, &tenant)).await;
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);
    assert_eq!(code(&unkeyed).as_deref(), Some("idempotency_key_missing"));
    assert_eq!(unkeyed.content_type(), Some("application/problem+json"));
    // Keyed, but the layer does not cover the route: a clear 500.
    let uncovered = send(&app, request("/unprotected", Some("p-2"), &tenant)).await;
    assert_eq!(uncovered.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        code(&uncovered).as_deref(),
        Some("idempotency_layer_missing")
    );
    // The optional form takes both.
    let keyed = send(&app, request("/notes", Some("n-1"), &tenant)).await;
    assert_eq!(&keyed.body[..], b"keyed");
    let unkeyed = send(&app, request("/notes", None, &tenant)).await;
    assert_eq!(&unkeyed.body[..], b"unkeyed");
}

/// A header that carries an API key is kept only as a keyed hash: not in
/// the record, not in the records API, not in the handler's context.
#[tokio::test]
async fn a_hashed_header_tenant_keeps_no_secret() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone()).tenant(TenantFromHeader::hashed(
        "x-api-key",
        b"0123456789abcdef".to_vec(),
    ));
    let app = app(layer);
    let api_key = "sk_live_4711";
    let first = send(
        &app,
        request("/payments", Some("h-1"), &[("x-api-key", api_key)]),
    )
    .await;
    let body = String::from_utf8_lossy(&first.body).into_owned();
    assert!(!body.contains(api_key), "{body}");
    let tenant = body.split("tenant=").nth(1).expect("tenant").to_owned();
    assert!(
        tenant.starts_with("hdr:") && tenant.len() == 4 + 64,
        "{tenant}"
    );
    // The same key is the same tenant (a replay); another is another.
    let again = send(
        &app,
        request("/payments", Some("h-1"), &[("x-api-key", api_key)]),
    )
    .await;
    assert!(again.replayed());
    let other = send(
        &app,
        request("/payments", Some("h-1"), &[("x-api-key", "sk_live_4712")]),
    )
    .await;
    assert!(!other.replayed());
    // The record and the records API hold the hash only.
    let key = IdempotencyKey::parse(b"h-1").expect("key");
    let record = store
        .get(Scope::new(tenant.clone(), "POST /payments", key).hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(&*record.tenant, tenant.as_str());
    let shown = send(
        &app,
        Request::get("/records?method=POST&path=/payments&key=h-1")
            .header("x-api-key", api_key)
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(shown.status, StatusCode::OK);
    assert!(!String::from_utf8_lossy(&shown.body).contains(api_key));
    // Under another secret the same value is another tenant.
    let elsewhere = TenantFromHeader::hashed("x-api-key", b"another secret, 16+".to_vec());
    let (parts, ()) = Request::post("/")
        .header("x-api-key", api_key)
        .body(())
        .expect("request")
        .into_parts();
    use idem_layer::TenantExtractor;
    assert_ne!(elsewhere.tenant(&parts), Some(tenant));
}

/// `bearer x`, `Bearer x` and `Bearer   x` are one caller; a keyed hash
/// differs from the plain one.
#[tokio::test]
async fn authorization_tenants_are_normalized_and_keyed() {
    use idem_layer::TenantExtractor;
    fn tenant_of(extractor: &dyn TenantExtractor, value: &str) -> String {
        let (parts, ()) = Request::post("/")
            .header(header::AUTHORIZATION, value)
            .body(())
            .expect("request")
            .into_parts();
        extractor.tenant(&parts).expect("tenant")
    }
    let plain = TenantFromAuthorization::new();
    let one = tenant_of(&plain, "Bearer x");
    for spelling in ["bearer x", "BEARER x", "Bearer   x", " Bearer\tx "] {
        assert_eq!(tenant_of(&plain, spelling), one, "{spelling:?}");
    }
    assert_ne!(tenant_of(&plain, "Bearer y"), one);
    assert_ne!(
        tenant_of(&plain, "Bearer X"),
        one,
        "credentials keep their case"
    );
    let keyed = TenantFromAuthorization::keyed(b"a deployment secret".to_vec());
    assert_ne!(tenant_of(&keyed, "Bearer x"), one);
    assert_eq!(
        tenant_of(&keyed, "bearer  x"),
        tenant_of(&keyed, "Bearer x")
    );
}

/// A store that is down.
#[derive(Clone)]
struct Down;

impl Store for Down {
    async fn reserve(&self, _: &ReserveRequest) -> Result<Reservation, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
    async fn renew(&self, _: &Lease) -> Result<Renewal, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
    async fn complete(&self, _: &Lease, _: &Outcome) -> Result<Completion, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
    async fn release(&self, _: &Lease) -> Result<Release, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
    async fn cancel(&self, _: &ScopeHash) -> Result<Cancellation, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
    async fn get(&self, _: &ScopeHash) -> Result<Option<Record>, StoreError> {
        Err(StoreError::unavailable("Connection refused (os error 111)"))
    }
}

/// A 503 says the store is unavailable, not why (that is in the logs); the
/// problem `type` can point at documentation; a hook can replace the
/// answer entirely, for the layer and its records API alike.
#[tokio::test]
async fn problems_leak_nothing_and_can_be_shaped() {
    let tenant = [("x-tenant", "acme")];
    let plain = IdempotencyLayer::new(Down).tenant(TenantFromHeader::from_static("x-tenant"));
    let app = Router::new().route("/payments", post(pay)).layer(plain);
    let down = send(&app, request("/payments", Some("d-1"), &tenant)).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    let text = String::from_utf8_lossy(&down.body).into_owned();
    assert!(
        !text.contains("os error") && !text.contains("refused"),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_slice(&down.body).expect("json");
    assert_eq!(
        json["type"],
        "urn:idem:problem:idempotency_store_unavailable"
    );

    let documented = IdempotencyLayer::new(MemoryStore::new())
        .tenant(TenantFromHeader::from_static("x-tenant"))
        .problems(|p| p.type_base("https://docs.example.com/errors/"));
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(documented);
    let missing = send(&app, request("/payments", Some("bad key"), &tenant));
    let json: serde_json::Value = serde_json::from_slice(&missing.await.body).expect("json");
    assert_eq!(
        json["type"],
        "https://docs.example.com/errors/idempotency_key_invalid"
    );
    assert_eq!(json["code"], "idempotency_key_invalid");

    let hooked = IdempotencyLayer::new(MemoryStore::new())
        .tenant(TenantFromHeader::from_static("x-tenant"))
        .problems(|p| {
            p.hook(|problem: &Problem| {
                Response::builder()
                    .status(problem.status)
                    .header("content-type", "application/vnd.acme.error+json")
                    .body(Bytes::from(format!(
                        "{{\"error\":\"{}\"}}",
                        problem.code.as_str()
                    )))
                    .ok()
            })
        });
    let records = hooked.records_service();
    let app = Router::new()
        .route("/payments", post(pay))
        .route_service("/records", records)
        .layer(hooked);
    let conflict = async |body: &'static str| {
        send(
            &app,
            Request::post("/payments")
                .header("content-type", "application/json")
                .header("idempotency-key", "c-1")
                .header("x-tenant", "acme")
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .expect("request"),
        )
        .await
    };
    assert_eq!(conflict("{\"a\":1}").await.status, StatusCode::OK);
    let replaced = conflict("{\"a\":2}").await;
    assert_eq!(replaced.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        replaced.content_type(),
        Some("application/vnd.acme.error+json")
    );
    assert_eq!(&replaced.body[..], b"{\"error\":\"idempotency_conflict\"}");
    let absent = send(
        &app,
        Request::get("/records?method=POST&path=/payments&key=nothing")
            .header("x-tenant", "acme")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
    assert_eq!(
        &absent.body[..],
        b"{\"error\":\"idempotency_record_not_found\"}"
    );
}

/// One caller's records share its tenant's text, and one route's its
/// operation's, with the handler's context: a record of the memory store
/// keeps no copy of either. Another caller's records hold their own.
#[tokio::test]
async fn records_of_one_caller_share_its_tenant_and_operation() {
    let store = MemoryStore::new();
    let secret = b"a deployment secret of 32 bytes.".to_vec();
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(TenantFromAuthorization::keyed(secret.clone()));
    let app = app(layer);
    let mut records = Vec::new();
    for (key, caller) in [
        ("s-1", "Bearer one"),
        ("s-2", "Bearer one"),
        ("s-3", "Bearer two"),
    ] {
        let answer = send(
            &app,
            request("/payments", Some(key), &[("authorization", caller)]),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        let credential = caller.to_ascii_lowercase();
        let tenant = idem_layer::tenant::keyed_tenant(&secret, "auth:", credential.as_bytes());
        let body = String::from_utf8_lossy(&answer.body).into_owned();
        assert!(body.ends_with(&format!("tenant={tenant}")), "{body}");
        let scope = Scope::new(
            tenant,
            "POST /payments",
            IdempotencyKey::parse(key.as_bytes()).expect("key"),
        );
        let record = store.get(scope.hash()).await.expect("get").expect("record");
        records.push(record);
    }
    let [one, again, two] = &records[..] else {
        unreachable!("three records")
    };
    assert!(std::sync::Arc::ptr_eq(&one.tenant, &again.tenant));
    assert!(std::sync::Arc::ptr_eq(&one.operation, &again.operation));
    assert!(std::sync::Arc::ptr_eq(&one.operation, &two.operation));
    assert_ne!(one.tenant, two.tenant);
}

/// A layer built without a tenant source answers a keyed request `401`,
/// and its detail says why: the default source (the `Tenant` request
/// extension) was not set, and how to choose one. A layer whose chosen
/// source finds no tenant says the caller is not identified.
#[tokio::test]
async fn a_missing_tenant_source_says_so() {
    let detail = |answer: &Answer| -> String {
        let json: serde_json::Value = serde_json::from_slice(&answer.body).expect("problem JSON");
        json["detail"].as_str().unwrap_or_default().to_owned()
    };
    let unset = app(IdempotencyLayer::new(MemoryStore::new()));
    let answer = send(&unset, request("/payments", Some("k1"), &[])).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(code(&answer).as_deref(), Some("idempotency_tenant_missing"));
    let said = detail(&answer);
    assert!(
        said.contains("`Tenant` request extension") && said.contains("IdempotencyLayer::tenant"),
        "{said}"
    );
    let chosen =
        app(IdempotencyLayer::new(MemoryStore::new())
            .tenant(TenantFromHeader::from_static("x-tenant")));
    let answer = send(&chosen, request("/payments", Some("k1"), &[])).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(code(&answer).as_deref(), Some("idempotency_tenant_missing"));
    assert_eq!(
        detail(&answer),
        "a request with an Idempotency-Key must come from an identified caller"
    );
}

/// A problem type base that is no absolute URI is refused by `validate()`,
/// and one that would close its `Link` target and open another never gets
/// a `Link` at all, validated or not.
#[tokio::test]
async fn a_problem_type_base_can_never_add_a_link_target() {
    use http_body_util::BodyExt;
    use tower::{Layer, ServiceExt};
    let hostile = "https://docs.example/p/>; rel=\"x\", <https://evil.example/";
    for base in [
        hostile,
        "/problems/",
        "https://docs.example/a b/",
        "https://x/%zz",
    ] {
        let layer = idem_layer::IdempotencyLayer::new(MemoryStore::new())
            .allow_anonymous(true)
            .problems(|p| p.type_base(base));
        assert!(
            matches!(
                layer.validate(),
                Err(idem_layer::ConfigError::ProblemTypeBase(..))
            ),
            "{base}"
        );
        let service = layer.layer(tower::service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
        }));
        // A key that does not parse: a problem answer.
        let request = Request::post("/orders")
            .header("idempotency-key", "\"unterminated")
            .body(Full::new(Bytes::new()))
            .expect("request");
        // The layer answers every keyed request of a configuration that
        // does not validate with a problem of its own, never a `Link`.
        let response = service.oneshot(request).await.expect("answer");
        assert_eq!(response.status(), 500);
        assert!(response.headers().get("link").is_none(), "{base}");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let document: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(document["code"], "idempotency_misconfigured", "{document}");
    }
    let good = idem_layer::IdempotencyLayer::new(MemoryStore::new())
        .problems(|p| p.type_base("https://docs.example.com/errors/"));
    assert!(good.validate().is_ok());
}

/// The records service mounted under the layer, as the README shows, with
/// `records_path` set to where it is mounted: the layer never applies
/// itself to it, so `require_key(true)` does not refuse the records API's
/// own POSTs (release, erase), and a records call is never recorded.
#[tokio::test]
async fn the_records_service_under_the_layer_is_not_keyed() {
    use tower::ServiceExt;
    let idempotency = IdempotencyLayer::new(MemoryStore::new())
        .tenant(TenantFromHeader::from_static("x-tenant-id"))
        .require_key(true)
        .records(|r| r.tenant_release(true).path("/_idempotency/records"));
    let app = Router::new()
        .route("/orders", post(|| async { StatusCode::CREATED }))
        .route_service("/_idempotency/records", idempotency.records_service())
        .layer(idempotency);
    let records = |method: http::Method, query: &str| {
        Request::builder()
            .method(method)
            .uri(format!(
                "/_idempotency/records?method=POST&path=/orders&key=k-1{query}"
            ))
            .header("x-tenant-id", "acme")
            .body(axum::body::Body::empty())
            .expect("request")
    };
    for (method, query) in [
        (http::Method::POST, "&action=release"),
        (http::Method::GET, ""),
        (http::Method::DELETE, ""),
    ] {
        let answer = app
            .clone()
            .oneshot(records(method.clone(), query))
            .await
            .expect("answer");
        assert_eq!(answer.status(), StatusCode::NOT_FOUND, "{method} {query}");
        let body = http_body_util::BodyExt::collect(answer.into_body())
            .await
            .expect("body")
            .to_bytes();
        let document: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(document["code"], "idempotency_record_not_found", "{method}");
    }
    // The keyed routes are still protected.
    let keyless = Request::post("/orders")
        .header("x-tenant-id", "acme")
        .body(axum::body::Body::empty())
        .expect("request");
    let refused = app.oneshot(keyless).await.expect("answer");
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
}

/// A body the framework refuses (axum's `Json`, wrapped in `Validated`)
/// does not spend the key: nothing ran, so nothing is stored and the
/// corrected retry with the same key runs (Stripe's rule). A handler may
/// say the same with the `idem-nothing-ran` header, which the client never
/// sees. An unmarked 4xx is an outcome and is stored.
#[tokio::test]
async fn a_request_refused_before_it_ran_does_not_spend_the_key() {
    use std::sync::Arc;

    use axum::{Json, response::IntoResponse};
    use http_body_util::BodyExt;
    use idem_layer::Validated;
    use tower::ServiceExt;
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders",
            post(
                move |Validated(Json(order)): Validated<Json<serde_json::Value>>| {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async move { (StatusCode::CREATED, format!("order {order}")) }
                },
            ),
        )
        .route(
            "/checked",
            post(|body: Bytes| async move {
                if body.is_empty() {
                    return (
                        StatusCode::BAD_REQUEST,
                        [("idem-nothing-ran", "1")],
                        "empty",
                    )
                        .into_response();
                }
                (StatusCode::UNPROCESSABLE_ENTITY, "declined").into_response()
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(TenantFromHeader::from_static("x-tenant")),
        );
    let order = |path: &str, body: &'static str| {
        Request::post(path)
            .header("idempotency-key", "k-validated")
            .header("x-tenant", "acme")
            .header(header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body))
            .expect("request")
    };
    let refused = app
        .clone()
        .oneshot(order("/orders", "{"))
        .await
        .expect("answer");
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert!(!refused.headers().contains_key("idem-nothing-ran"));
    let corrected = app
        .clone()
        .oneshot(order("/orders", "{\"qty\":1}"))
        .await
        .expect("answer");
    assert_eq!(corrected.status(), StatusCode::CREATED);
    assert!(!corrected.headers().contains_key("idempotent-replayed"));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);

    let marked = app
        .clone()
        .oneshot(order("/checked", ""))
        .await
        .expect("answer");
    assert_eq!(marked.status(), StatusCode::BAD_REQUEST);
    assert!(!marked.headers().contains_key("idem-nothing-ran"));
    let declined = app
        .clone()
        .oneshot(order("/checked", "x"))
        .await
        .expect("answer");
    assert_eq!(
        declined.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "the retry ran"
    );
    let replayed = app.oneshot(order("/checked", "x")).await.expect("answer");
    assert_eq!(replayed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        replayed.headers().contains_key("idempotent-replayed"),
        "a 4xx is stored"
    );
    let body = replayed
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(&body[..], b"declined");
}
