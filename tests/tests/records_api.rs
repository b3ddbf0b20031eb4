//! The operator's records API through the gateway on a real Redis: find
//! stuck records, release one, the admin credential, and the gauge of
//! processing records whose lease lapsed.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_core::{
    IdempotencyKey, Reservation, ReserveRequest, Scope, Store, conformance::wait_until,
};
use idem_redis::RedisStore;
use idem_tests::{
    Reply, TestServer, client, redis_server::RedisServer, send, start_gateway, upstream::Upstream,
};

const ADMIN: &str = "the operators' admin token";

fn request(method: &str, url: String, tenant: &str, admin: bool) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(url)
        .header("x-tenant", tenant)
        .header("content-type", "application/json");
    if admin {
        builder = builder.header("x-idem-admin-token", ADMIN);
    }
    builder
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

fn keys(reply: &Reply) -> Vec<String> {
    let json: serde_json::Value = serde_json::from_slice(&reply.body).expect("json");
    json["records"]
        .as_array()
        .expect("records")
        .iter()
        .map(|r| {
            format!(
                "{}/{}",
                r["tenant"].as_str().unwrap_or(""),
                r["key"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// A reservation made by an owner that died (never completed), as the
/// gateway's layer would have made it for `POST /orders` by `acme`.
async fn dead_owner(store: &RedisStore, key: &str, lease: Duration) {
    let parts = Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    let fingerprint = idem_layer::fingerprint::fingerprint(
        "POST /orders",
        &parts,
        &[http::header::CONTENT_TYPE],
        b"{}",
    );
    let reserved = store
        .reserve(&ReserveRequest {
            scope: Scope::new(
                "acme",
                "POST /orders",
                IdempotencyKey::parse(key.as_bytes()).expect("key"),
            ),
            fingerprint,
            lease,
            retention: Duration::from_secs(3600),
        })
        .await
        .expect("reserve");
    assert!(matches!(reserved, Reservation::Acquired(_)));
}

/// A gateway on a private Redis, tenants from `x-tenant`, with `flags`
/// besides, before a counting upstream (`None` where `redis-server` is
/// missing outside CI). Bind `_origin` where it is taken apart: dropped,
/// the upstream stops.
struct OnRedis {
    redis: RedisServer,
    upstream: Upstream,
    _origin: TestServer,
    gateway: idem_gateway::Started,
}

async fn gateway_on_redis(flags: &[&str]) -> Option<OnRedis> {
    let redis = RedisServer::spawn()?;
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let url = redis.url();
    let common = ["--store", url.as_str(), "--tenant-header", "x-tenant"];
    let gateway = start_gateway(&origin, &[&common[..], flags].concat()).await;
    Some(OnRedis {
        redis,
        upstream,
        _origin: origin,
        gateway,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_and_releases_a_stuck_record() {
    let Some(OnRedis {
        redis,
        upstream,
        gateway,
        _origin,
    }) = gateway_on_redis(&["--records-admin-token", ADMIN]).await
    else {
        return;
    };
    let base = format!("http://{}", gateway.addr);
    let store = RedisStore::from_url(&redis.url()).expect("store");
    // One owner died holding an hour-long lease; another's short lease lapsed.
    dead_owner(&store, "stuck", Duration::from_secs(3600)).await;
    // Listed oldest first: made a little later.
    tokio::time::sleep(Duration::from_millis(20)).await;
    dead_owner(&store, "lapsed", Duration::from_millis(200)).await;
    let post = |tenant: &str, key: &str| {
        let mut post = request("POST", format!("{base}/orders"), tenant, false);
        post.headers_mut()
            .insert("idempotency-key", key.parse().expect("key"));
        post
    };
    for (tenant, key) in [("acme", "done"), ("beta", "theirs")] {
        assert_eq!(
            send(&client(), post(tenant, key)).await.status,
            StatusCode::CREATED
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = send(&client(), post("acme", "stuck")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");

    let http = client();
    let get = |query: &str, tenant: &str, admin: bool| {
        send(
            &http,
            request(
                "GET",
                format!("{base}/_idempotency/records{query}"),
                tenant,
                admin,
            ),
        )
    };
    let processing = get("?state=processing", "acme", false).await;
    assert_eq!(processing.status, StatusCode::OK, "{processing:?}");
    assert_eq!(keys(&processing), ["acme/stuck", "acme/lapsed"]);
    let lapsed = get("?lapsed=true", "acme", false).await;
    assert_eq!(keys(&lapsed), ["acme/lapsed"]);

    // Release the stuck one (an operator's act: the admin credential; the
    // tenant alone is refused): the retry runs.
    let release_as = |key: &str, admin: bool| {
        send(
            &http,
            request(
                "POST",
                format!(
                    "{base}/_idempotency/records?method=POST&path=/orders&key={key}{}&action=release",
                    if admin { "&tenant=acme" } else { "" }
                ),
                "acme",
                admin,
            ),
        )
    };
    let release = |key: &str| release_as(key, true);
    let by_tenant = release_as("stuck", false).await;
    assert_eq!(by_tenant.status, StatusCode::FORBIDDEN, "{by_tenant:?}");
    assert_eq!(
        by_tenant.code().as_deref(),
        Some("idempotency_admin_required")
    );
    let released = release("stuck").await;
    assert_eq!(released.status, StatusCode::OK, "{released:?}");
    let json: serde_json::Value = serde_json::from_slice(&released.body).expect("json");
    assert_eq!(json["result"], "released");
    assert_eq!(
        json["record"]["attempts"][0]["outcome"]["kind"],
        "released_by_operator"
    );
    let runs = upstream.runs();
    let retry = send(&client(), post("acme", "stuck")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(upstream.runs(), runs + 1);
    let not_processing = release("done").await;
    assert_eq!(not_processing.status, StatusCode::CONFLICT);
    assert_eq!(release("nothing").await.status, StatusCode::NOT_FOUND);

    // Another tenant's records need the admin credential.
    let refused = get("?tenant=beta", "acme", false).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_admin_required")
    );
    assert_eq!(
        keys(&get("?tenant=beta", "acme", true).await),
        ["beta/theirs"]
    );
    let everyone = keys(&get("", "", true).await);
    assert!(
        everyone.contains(&"beta/theirs".to_owned()) && everyone.contains(&"acme/done".to_owned()),
        "{everyone:?}"
    );

    // The gauge counts the processing record whose lease lapsed.
    let text = idem_tests::poll_until(
        Duration::from_secs(20),
        async || {
            let metrics = send(
                &client(),
                Request::get(format!("{base}/metrics"))
                    .body(Full::new(Bytes::new()))
                    .expect("request"),
            )
            .await;
            String::from_utf8_lossy(&metrics.body).into_owned()
        },
        |text| text.contains("idem_records_lapsed 1"),
    )
    .await;
    assert!(
        text.contains("idem_records_lapsed 1"),
        "no lapsed gauge in:\n{text}"
    );
}

/// A caller listing records cannot take the store: listings run one at a
/// time (the others answer `429 idempotency_listing_busy` at once, without
/// the store, here while Redis is frozen), and after a long listing the
/// next waits for the listings' twentieth of the time. Keyed requests and
/// one record's reads go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_are_budgeted() {
    // Each Redis call may wait out the freeze below (at most 11.5 s).
    let Some(OnRedis {
        redis,
        gateway,
        _origin,
        ..
    }) = gateway_on_redis(&["--store-timeout", "20s"]).await
    else {
        return;
    };
    let base = format!("http://{}", gateway.addr);
    let order = |key: &str| {
        let mut post = request("POST", format!("{base}/orders"), "acme", false);
        post.headers_mut()
            .insert("idempotency-key", key.parse().expect("key"));
        post
    };
    assert_eq!(
        send(&client(), order("listed")).await.status,
        StatusCode::CREATED
    );
    let http = client();
    let list = || {
        send(
            &http,
            request("GET", format!("{base}/_idempotency/records"), "acme", false),
        )
    };
    let busy = |reply: &Reply| {
        reply.status == StatusCode::TOO_MANY_REQUESTS
            && reply.code().as_deref() == Some("idempotency_listing_busy")
    };
    let retry_after = |reply: &Reply| -> u64 {
        reply.headers["retry-after"]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("seconds")
    };

    // Three listings at once against a frozen Redis: one waits for it,
    // the two others are refused without it.
    redis.pause();
    let frozen_at = std::time::Instant::now();
    let mut listings: Vec<_> = (0..3).map(|_| tokio::spawn(list())).collect();
    let finished = idem_tests::poll_until(
        Duration::from_secs(10),
        async || listings.iter().filter(|l| l.is_finished()).count(),
        |done| *done >= 2,
    )
    .await;
    assert_eq!(finished, 2, "two listings answer while Redis is frozen");
    // The one that waits began before the two were refused: held 1.5 s
    // more, it lists for more than the budget's first second, however
    // slowly the refusals came.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.resume();
    let mut replies = Vec::new();
    for listing in listings.drain(..) {
        replies.push(listing.await.expect("listing"));
    }
    // The listing lasted at most this long.
    let held = frozen_at.elapsed();
    let refused: Vec<&Reply> = replies.iter().filter(|r| busy(r)).collect();
    assert_eq!(refused.len(), 2, "{replies:?}");
    assert!(refused.iter().all(|r| retry_after(r) == 1), "{refused:?}");
    let listed: Vec<&Reply> = replies.iter().filter(|r| !busy(r)).collect();
    assert_eq!(listed[0].status, StatusCode::OK, "{listed:?}");
    assert_eq!(keys(listed[0]), ["acme/listed"]);

    // That listing took over a second: the next waits its share out,
    // 19 times the listing's length less the allowance (20 s), so at most
    // 19 times `held` less 20 s.
    let spaced = list().await;
    assert!(busy(&spaced), "{spaced:?}");
    let wait = retry_after(&spaced);
    let most = (19.0 * held.as_secs_f64() - 20.0).ceil() as u64 + 1;
    assert!(
        (2..=most).contains(&wait),
        "Retry-After {wait}, held {held:?}"
    );

    // Keyed requests and one record's reads are not budgeted.
    assert_eq!(
        send(&client(), order("after")).await.status,
        StatusCode::CREATED
    );
    let one = send(
        &client(),
        request(
            "GET",
            format!("{base}/_idempotency/records?method=POST&path=/orders&key=after"),
            "acme",
            false,
        ),
    )
    .await;
    assert_eq!(one.status, StatusCode::OK, "{one:?}");
}

/// A listing reads every record of the store, which takes longer than one
/// store call: it is bounded by 30 s (or the store timeout, the longer),
/// not by the store timeout, so a large store still lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_outlasts_the_store_timeout() {
    use futures_util::StreamExt;
    let timeout_ms = 300u64;
    let timeout = format!("{timeout_ms}ms");
    let Some(OnRedis {
        redis,
        gateway,
        _origin,
        ..
    }) = gateway_on_redis(&["--store-timeout", &timeout]).await
    else {
        return;
    };
    let url = redis.url();
    // 30,000 records: reading each costs Redis over 10 µs, so listing them
    // takes longer than the store timeout.
    let store = RedisStore::from_url(&url).expect("store");
    let made = futures_util::stream::iter(0..30_000)
        .map(|n| {
            let store = &store;
            async move {
                let request = ReserveRequest {
                    scope: Scope::new(
                        "acme",
                        "POST /orders",
                        IdempotencyKey::parse(format!("many-{n}").as_bytes()).expect("key"),
                    ),
                    fingerprint: idem_core::Fingerprint::from_bytes([1; 32]),
                    lease: Duration::from_secs(60),
                    retention: Duration::from_secs(600),
                };
                matches!(store.reserve(&request).await, Ok(Reservation::Acquired(_)))
            }
        })
        .buffer_unordered(64)
        .filter(|acquired| std::future::ready(*acquired))
        .count()
        .await;
    assert_eq!(made, 30_000);
    let started = std::time::Instant::now();
    let listed = send(
        &client(),
        request(
            "GET",
            format!("http://{}/_idempotency/records?limit=3", gateway.addr),
            "acme",
            false,
        ),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(listed.status, StatusCode::OK, "{listed:?} after {took:?}");
    assert_eq!(keys(&listed).len(), 3);
    assert!(
        took > Duration::from_millis(timeout_ms),
        "the listing took {took:?}: it proves nothing about the bound"
    );
}

/// A `422` names the record its key collided with: a link into the
/// records API that the caller can follow as its own tenant, the record's
/// state and when its key was first seen; a `409` links the record in
/// progress. With `--problem-type-base` a web address, the answers link
/// their documentation (`rel="describedby"`); with the default URN, not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_points_to_the_record_it_collided_with() {
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &origin,
        &[
            "--tenant-header",
            "x-tenant",
            "--problem-type-base",
            "https://docs.example.com/problems/",
        ],
    )
    .await;
    let post = |path: &'static str, key: &'static str, body: &'static str| {
        Request::post(format!("http://{}{path}", gateway.addr))
            .header("idempotency-key", key)
            .header("x-tenant", "acme")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request")
    };
    let http = client();
    let first = send(&http, post("/orders", "order-77", "{\"qty\":1}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let conflict = send(&http, post("/orders", "order-77", "{\"qty\":2}")).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        conflict.header("link"),
        Some("<https://docs.example.com/problems/idempotency_conflict>; rel=\"describedby\"")
    );
    let body: serde_json::Value = serde_json::from_slice(&conflict.body).expect("json");
    assert_eq!(body["code"], "idempotency_conflict");
    assert_eq!(
        body["type"],
        "https://docs.example.com/problems/idempotency_conflict"
    );
    // The gateway's own problem answers take the base too.
    let reserved = send(
        &http,
        Request::get(format!("http://{}/_idempotency/nothing", gateway.addr))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(reserved.status, StatusCode::NOT_FOUND);
    assert_eq!(
        reserved.header("link"),
        Some("<https://docs.example.com/problems/gateway_path_reserved>; rel=\"describedby\"")
    );
    let own: serde_json::Value = serde_json::from_slice(&reserved.body).expect("json");
    assert_eq!(
        own["type"],
        "https://docs.example.com/problems/gateway_path_reserved"
    );
    let record = &body["record"];
    assert_eq!(record["state"], "completed", "{body}");
    let first_seen = record["first_seen"].as_str().expect("first_seen");
    assert!(
        first_seen.starts_with("20") && first_seen.ends_with('Z'),
        "{first_seen}"
    );
    let href = record["href"].as_str().expect("href");
    assert!(
        href.starts_with("/_idempotency/records?method=POST&path=%2Forders&key="),
        "{href}"
    );
    // The caller follows the link as itself and finds the record.
    let followed = send(
        &http,
        Request::get(format!("http://{}{href}", gateway.addr))
            .header("x-tenant", "acme")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(followed.status, StatusCode::OK, "{followed:?}");
    let found: serde_json::Value = serde_json::from_slice(&followed.body).expect("json");
    assert_eq!(found["key"], "order-77");
    assert_eq!(found["state"], "completed");
    assert_eq!(found["status"], 201);
    // Another tenant following it finds nothing: the link is the caller's.
    let other = send(
        &http,
        Request::get(format!("http://{}{href}", gateway.addr))
            .header("x-tenant", "globex")
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(other.status, StatusCode::NOT_FOUND);

    // A request in progress: 409 with the link, no store read for it.
    let slow = tokio::spawn(send(&http, post("/slow", "slow-1", "{}")));
    upstream.wait_runs(2).await;
    let busy = send(&http, post("/slow", "slow-1", "{}")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    let body: serde_json::Value = serde_json::from_slice(&busy.body).expect("json");
    assert_eq!(body["code"], "idempotency_in_progress");
    assert_eq!(body["record"]["state"], "processing");
    assert!(
        body["record"]["href"]
            .as_str()
            .is_some_and(|href| href.contains("path=%2Fslow")),
        "{body}"
    );
    assert!(
        busy.header("link")
            .is_some_and(|l| l.contains("idempotency_in_progress"))
    );
    upstream.gate.add_permits(1);
    assert_eq!(slow.await.expect("slow").status, StatusCode::CREATED);

    // With the default type (a URN), no documentation link.
    let plain = start_gateway(&origin, &["--tenant-header", "x-tenant"]).await;
    let to_plain = |body: &'static [u8]| {
        Request::post(format!("http://{}/orders", plain.addr))
            .header("idempotency-key", "order-78")
            .header("x-tenant", "acme")
            .body(Full::new(Bytes::from_static(body)))
            .expect("request")
    };
    let created = send(&http, to_plain(b"1")).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let again = send(&http, to_plain(b"2")).await;
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(again.header("link"), None);
}

/// An operator erases one record (a 4xx stored by mistake, a
/// data-protection request) or every record of a tenant, with the admin
/// credential only: an erased key is new (its retry runs again), a
/// processing record is never erased, other tenants' records stay, and
/// each erasure is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_erases_a_record_or_a_tenants_records() {
    let Some(OnRedis {
        redis: _redis,
        upstream,
        gateway,
        _origin,
    }) = gateway_on_redis(&["--records-admin-token", ADMIN]).await
    else {
        return;
    };
    let base = format!("http://{}", gateway.addr);
    let http = client();
    let post = |tenant: &str, path: &str, key: &str| {
        let mut post = request("POST", format!("{base}{path}"), tenant, false);
        post.headers_mut()
            .insert("idempotency-key", key.parse().expect("key"));
        send(&http, post)
    };
    for (tenant, key) in [("acme", "k1"), ("acme", "k2"), ("globex", "k3")] {
        assert_eq!(
            post(tenant, "/orders", key).await.status,
            StatusCode::CREATED
        );
    }
    let slow = tokio::spawn(post("acme", "/slow", "k4"));
    upstream.wait_runs(4).await;
    let erase = |query: &str, admin: bool| {
        send(
            &http,
            request(
                "POST",
                format!("{base}/_idempotency/records?{query}&action=erase"),
                "acme",
                admin,
            ),
        )
    };
    // The caller itself may not erase: erasing needs the admin credential.
    let refused = erase("method=POST&path=/orders&key=k1", false).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    assert_eq!(
        refused.code().as_deref(),
        Some("idempotency_admin_required")
    );
    assert!(post("acme", "/orders", "k1").await.replayed());

    let one = erase("method=POST&path=/orders&key=k1&tenant=acme", true).await;
    assert_eq!(one.status, StatusCode::OK, "{one:?}");
    let json: serde_json::Value = serde_json::from_slice(&one.body).expect("json");
    assert_eq!(json["result"], "erased");
    assert_eq!(json["record"]["key"], "k1");
    // Its key is new: the retry runs again.
    let again = post("acme", "/orders", "k1").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert_eq!(upstream.runs(), 5);
    // A processing record is not erased.
    let busy = erase("method=POST&path=/slow&key=k4&tenant=acme", true).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    let json: serde_json::Value = serde_json::from_slice(&busy.body).expect("json");
    assert_eq!(json["result"], "processing");
    let absent = erase("method=POST&path=/orders&key=none&tenant=acme", true).await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);

    // Every record of acme: k1 (again) and k2 erased, k4 left processing.
    let all = erase("tenant=acme", true).await;
    assert_eq!(all.status, StatusCode::OK, "{all:?}");
    let json: serde_json::Value = serde_json::from_slice(&all.body).expect("json");
    assert_eq!(
        (json["erased"].as_u64(), json["processing"].as_u64()),
        (Some(2), Some(1))
    );
    let without_tenant = erase("x=1", true).await;
    assert_eq!(without_tenant.status, StatusCode::BAD_REQUEST);
    assert!(
        !post("acme", "/orders", "k2").await.replayed(),
        "k2 ran again"
    );
    assert_eq!(upstream.runs(), 6);
    // Another tenant's record stays.
    assert!(post("globex", "/orders", "k3").await.replayed());
    assert_eq!(upstream.runs(), 6);
    let busy = post("acme", "/slow", "k4").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    upstream.gate.add_permits(1);
    assert_eq!(slow.await.expect("slow").status, StatusCode::CREATED);

    let metrics = send(
        &http,
        Request::get(format!("{base}/metrics"))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.contains("idem_records_erased_total 3\n"),
        "{metrics}"
    );
}

/// A record erased through one gateway stops being replayed by another
/// gateway on the same store at once, however long its replay cache keeps
/// copies (the store's push channel, `docs/design.md` section 3); and when
/// the other gateway's subscription is lost, the erasure it may have missed
/// is not replayed either (its copies are dropped until it is back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_reaches_every_gateways_replay_cache() {
    let Some(OnRedis {
        redis,
        upstream,
        gateway,
        _origin,
    }) = gateway_on_redis(&["--records-admin-token", ADMIN]).await
    else {
        return;
    };
    let url = redis.url();
    let other = start_gateway(
        &_origin,
        &[
            "--store",
            url.as_str(),
            "--tenant-header",
            "x-tenant",
            "--replay-cache-ttl",
            "10m",
        ],
    )
    .await;
    let http = client();
    let post = |addr: std::net::SocketAddr| {
        let mut post = request("POST", format!("http://{addr}/orders"), "acme", false);
        post.headers_mut()
            .insert("idempotency-key", "erase-me".parse().expect("key"));
        send(&http, post)
    };
    let erase = async || {
        let erased = send(
            &http,
            request(
                "POST",
                format!(
                    "http://{}/_idempotency/records?method=POST&path=/orders&key=erase-me&tenant=acme&action=erase",
                    gateway.addr
                ),
                "acme",
                true,
            ),
        )
        .await;
        assert_eq!(erased.status, StatusCode::OK, "{erased:?}");
    };
    // The other gateway runs the key anew, once, within the bound.
    let runs_anew = async || {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let answer = post(other.addr).await;
            if !answer.replayed() {
                assert_eq!(answer.status, StatusCode::CREATED);
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the other gateway still replays the erased record"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // Replays from the other gateway's cache so far (the gateways of this
    // test share one metrics recorder; the first one is asked only once).
    let cached = async || {
        let metrics = send(
            &http,
            Request::get(format!("http://{}/metrics", other.addr))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await;
        String::from_utf8_lossy(&metrics.body)
            .lines()
            .find(|line| line.starts_with("idem_store_calls_saved_total{via=\"cache\"}"))
            .and_then(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // The other gateway replays it until a replay comes from its cache.
    let kept = async || {
        let before = cached().await;
        wait_until(
            Duration::from_secs(15),
            "a replay from the cache",
            async || {
                assert!(post(other.addr).await.replayed());
                cached().await > before
            },
        )
        .await;
    };
    assert_eq!(post(gateway.addr).await.status, StatusCode::CREATED);
    kept().await;
    erase().await;
    runs_anew().await;
    assert_eq!(upstream.runs(), 2, "the erased key ran again, once");
    // Kept again; the other gateway's subscription is lost as the erasure
    // is published.
    kept().await;
    let _ = redis.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    erase().await;
    runs_anew().await;
    assert_eq!(upstream.runs(), 3, "the erased key ran again, once");
}

/// With `--output-by-key`, a caller fetches its own answer through the
/// gateway by its key alone: the upstream's status and body, marked
/// replayed, the upstream not called again; another tenant gets `404`.
/// Without the flag it is `403 idempotency_output_refused`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_is_fetched_by_its_key_through_the_gateway() {
    for on in [true, false] {
        let flags: &[&str] = if on { &["--output-by-key"] } else { &[] };
        // Every part is kept: dropped, the server or the upstream stops.
        let Some(OnRedis {
            redis: _redis,
            upstream,
            gateway,
            _origin,
        }) = gateway_on_redis(flags).await
        else {
            return;
        };
        let base = format!("http://{}", gateway.addr);
        let http = client();
        let mut post = request("POST", format!("{base}/orders"), "acme", false);
        post.headers_mut()
            .insert("idempotency-key", "fetch-me".parse().expect("key"));
        let first = send(&http, post).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let output = format!(
            "{base}/_idempotency/records?method=POST&path=/orders&key=fetch-me&output=true"
        );
        let fetched = send(&http, request("GET", output.clone(), "acme", false)).await;
        if !on {
            assert_eq!(fetched.status, StatusCode::FORBIDDEN, "{fetched:?}");
            assert_eq!(
                fetched.code().as_deref(),
                Some("idempotency_output_refused")
            );
            continue;
        }
        assert_eq!(fetched.status, StatusCode::CREATED, "{fetched:?}");
        assert_eq!(fetched.body, first.body);
        assert!(fetched.replayed());
        assert_eq!(upstream.runs(), 1, "fetching never reaches the upstream");
        let other = send(&http, request("GET", output, "globex", false)).await;
        assert_eq!(other.status, StatusCode::NOT_FOUND);
    }
}
