//! What a record costs on Redis: gateway-shaped records (a hashed tenant
//! of 69 characters, a response larger than 64 bytes) stay in Redis'
//! compact hash encoding within a kilobyte, and records written in the
//! layout before it are still replayed and listed. Packed records (record
//! format 2) are smaller still, and gateways that pack and
//! gateways that do not (format 1) replay each other's records exactly. A listing of
//! processing records reads no completed record's response.

use idem_core::RecordsAdmin as _;
use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, extract::State, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::Full;
use idem_tests::{TestServer, client, redis_server::RedisServer, send, start_gateway};

/// An upstream whose answer is gateway-shaped: two headers and a JSON
/// body of about a hundred bytes.
fn upstream(runs: Arc<AtomicUsize>) -> Router {
    async fn order(State(runs): State<Arc<AtomicUsize>>) -> impl axum::response::IntoResponse {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        let body = format!(
            "{{\"id\":\"ord_{n:020}\",\"status\":\"accepted\",\"amount\":1999,\"currency\":\"eur\",\"sku\":\"book-0001\"}}"
        );
        (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/json".to_owned()),
                (header::LOCATION, format!("/orders/ord_{n:020}")),
            ],
            body,
        )
    }
    Router::new().route("/orders", post(order)).with_state(runs)
}

fn order(gateway: std::net::SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{gateway}/orders"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer a-token-of-some-length-0123456789")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            b"{\"sku\":\"book\",\"qty\":1}",
        )))
        .expect("request")
}

fn record_keys(redis: &RedisServer) -> Vec<String> {
    let keys = redis.cli(&["--scan", "--pattern", "idem:{*}"]);
    keys.lines().map(|k| k.trim().to_owned()).collect()
}

fn memory_usage(redis: &RedisServer, key: &str) -> u64 {
    let usage = redis.cli(&["MEMORY", "USAGE", key, "SAMPLES", "0"]);
    usage.trim().parse().unwrap_or(0)
}

/// A reservation of `key` by the tenant named "tenant" for `POST /orders`
/// (a fixed fingerprint, 10 minutes' retention), its lease `lease`.
fn reserve_request(key: &str, lease: std::time::Duration) -> idem_core::ReserveRequest {
    idem_core::ReserveRequest {
        scope: idem_core::Scope::new(
            "tenant",
            "POST /orders",
            idem_core::IdempotencyKey::parse(key.as_bytes()).expect("key"),
        ),
        fingerprint: idem_core::Fingerprint::from_bytes([7; 32]),
        lease,
        retention: std::time::Duration::from_secs(600),
    }
}

/// A gateway on `redis` (writing record format `format`) in front of the
/// upstream, and its first order under `key`, answered 201.
async fn one_order(
    redis: &RedisServer,
    key: &str,
    format: &str,
) -> (
    Arc<AtomicUsize>,
    TestServer,
    idem_gateway::Started,
    idem_tests::Reply,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let server = TestServer::start(upstream(Arc::clone(&runs))).await;
    let url = redis.url();
    let gateway = start_gateway(&server, &["--store", &url, "--redis-record-format", format]).await;
    let first = send(&client(), order(gateway.addr, key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    (runs, server, gateway, first)
}

/// The key's retry replays `first`: same status, body and location, and
/// the upstream ran once.
async fn replays_exactly(
    gateway: std::net::SocketAddr,
    key: &str,
    first: &idem_tests::Reply,
    runs: &AtomicUsize,
) {
    let replay = send(&client(), order(gateway, key)).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(
        replay.headers.get(header::LOCATION),
        first.headers.get(header::LOCATION)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_records_are_compact_and_replay_exactly() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (runs, _server, gateway, first) = one_order(&redis, "order-1", "2").await;
    assert!(first.body.len() > 64, "the body is larger than 64 bytes");

    let keys = record_keys(&redis);
    assert_eq!(keys.len(), 1, "one record: {keys:?}");
    let record = &keys[0];
    assert_eq!(
        redis.cli(&["OBJECT", "ENCODING", record]).trim(),
        "listpack",
        "every field fits the compact encoding: {}",
        redis.cli(&["HGETALL", record])
    );
    let response = format!("{record}:r");
    assert_eq!(redis.cli(&["EXISTS", &response]).trim(), "1");
    // The response key expires with the record.
    let record_ttl: i64 = redis.cli(&["PTTL", record]).trim().parse().expect("ttl");
    let response_ttl: i64 = redis.cli(&["PTTL", &response]).trim().parse().expect("ttl");
    assert!(record_ttl > 0 && (record_ttl - response_ttl).abs() < 2_000);
    let fields = redis.cli(&["HKEYS", record]);
    for repeated in ["created", "updated", "completed", "cur_status", "tenant"] {
        assert!(
            !fields.lines().any(|f| f.trim() == repeated),
            "{repeated} is not kept: {fields}"
        );
    }
    let bytes = memory_usage(&redis, record) + memory_usage(&redis, &response);
    assert!(bytes > 0 && bytes <= 1024, "{bytes} bytes for one record");

    replays_exactly(gateway.addr, "order-1", &first, &runs).await;
}

/// A record in the layout written before the compact one (every time in
/// its own field, the tenant as text, the response inline), rewritten from
/// a format 1 record, is replayed byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_the_older_layout_still_replay() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let (runs, _server, gateway, first) = one_order(&redis, "order-old", "1").await;
    let record = record_keys(&redis).pop().expect("one record");
    let response = format!("{record}:r");

    // Rewrite it as the older scripts wrote it.
    let mut conn = redis::Client::open(redis.url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let field = async |conn: &mut redis::aio::MultiplexedConnection, name: &str| -> Vec<u8> {
        redis::cmd("HGET")
            .arg(&record)
            .arg(name)
            .query_async(conn)
            .await
            .expect("HGET")
    };
    let raw: Vec<u8> = redis::cmd("GET")
        .arg(&response)
        .query_async(&mut conn)
        .await
        .expect("GET");
    let split: usize = String::from_utf8_lossy(&field(&mut conn, "split").await)
        .parse()
        .expect("split");
    let (headers, body) = raw.split_at(split);
    let tenant_bin = field(&mut conn, "tenant_bin").await;
    let (prefix, hash) = tenant_bin.split_at(tenant_bin.len() - 32);
    let tenant = format!("{}{}", String::from_utf8_lossy(prefix), hex::encode(hash));
    assert_eq!(tenant.len(), 69, "the gateway's tenant is a hash: {tenant}");
    let ended = field(&mut conn, "cur_end").await;
    let started = field(&mut conn, "cur_start").await;
    let _: () = redis::pipe()
        .cmd("HDEL")
        .arg(&record)
        .arg("split")
        .arg("tenant_bin")
        .ignore()
        .cmd("DEL")
        .arg(&response)
        .ignore()
        .cmd("HSET")
        .arg(&record)
        .arg("tenant")
        .arg(&tenant)
        .arg("headers")
        .arg(headers)
        .arg("body")
        .arg(body)
        .arg("created")
        .arg(&started)
        .arg("updated")
        .arg(&ended)
        .arg("completed")
        .arg(&ended)
        .arg("cur_status")
        .arg("201")
        .ignore()
        .query_async(&mut conn)
        .await
        .expect("older layout");
    assert_eq!(
        redis.cli(&["OBJECT", "ENCODING", &record]).trim(),
        "hashtable"
    );

    replays_exactly(gateway.addr, "order-old", &first, &runs).await;
}

/// The fields of `record`, sorted.
fn field_names(redis: &RedisServer, record: &str) -> Vec<String> {
    let mut names: Vec<String> = redis
        .cli(&["HKEYS", record])
        .lines()
        .map(|f| f.trim().to_owned())
        .collect();
    names.sort();
    names
}

/// A gateway that packs records (format 2) and one that does
/// not (format 1), on one Redis: the packed record keeps eleven fields
/// (its format among them) in the compact encoding and takes fewer
/// bytes than the expanded one of the same order; each gateway replays the
/// other's record byte for byte, and the upstream ran once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_records_are_smaller_and_either_gateway_replays_them() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let server = TestServer::start(upstream(Arc::clone(&runs))).await;
    // One tenant secret: both gateways see the caller as one tenant.
    let shared = ["--tenant-secret", "a-secret-both-gateways-share"];
    let url = redis.url();
    let packing = start_gateway(
        &server,
        &[
            &["--store", &url, "--redis-record-format", "2"][..],
            &shared,
        ]
        .concat(),
    )
    .await;
    let expanding = start_gateway(
        &server,
        &[
            &["--store", &url, "--redis-record-format", "1"][..],
            &shared,
        ]
        .concat(),
    )
    .await;

    let packed = send(&client(), order(packing.addr, "order-packed")).await;
    assert_eq!(packed.status, StatusCode::CREATED);
    let packed_record = record_keys(&redis).pop().expect("one record");
    let expanded = send(&client(), order(expanding.addr, "order-expanded")).await;
    assert_eq!(expanded.status, StatusCode::CREATED);
    let expanded_record = record_keys(&redis)
        .into_iter()
        .find(|k| *k != packed_record && !k.ends_with(":r"))
        .expect("a second record");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    assert_eq!(
        field_names(&redis, &packed_record),
        [
            "cur_id",
            "d",
            "fp",
            "key",
            "n",
            "op",
            "owner",
            "split",
            "state",
            "tenant_bin",
            "v"
        ],
        "{}",
        redis.cli(&["HGETALL", &packed_record])
    );
    assert_eq!(
        redis.cli(&["OBJECT", "ENCODING", &packed_record]).trim(),
        "listpack"
    );
    assert!(
        !field_names(&redis, &expanded_record).contains(&"n".to_owned()),
        "a gateway that does not pack writes the expanded layout"
    );
    // The record expires with the retention (24 h by default) counted from
    // its reservation, and its response key with it.
    let ttl = |key: &str| -> i64 { redis.cli(&["PTTL", key]).trim().parse().expect("ttl") };
    let (record_ttl, response_ttl) = (ttl(&packed_record), ttl(&format!("{packed_record}:r")));
    let day: i64 = 24 * 3600 * 1000;
    assert!(
        record_ttl > day - 60_000 && record_ttl <= day,
        "record TTL {record_ttl} ms"
    );
    assert!(
        (record_ttl - response_ttl).abs() < 2_000,
        "response TTL {response_ttl} ms"
    );
    let packed_bytes = memory_usage(&redis, &packed_record);
    let expanded_bytes = memory_usage(&redis, &expanded_record);
    assert!(
        packed_bytes > 0 && packed_bytes < expanded_bytes,
        "packed {packed_bytes} bytes, expanded {expanded_bytes}"
    );

    // Each gateway replays both records exactly; nothing runs again.
    for gateway in [packing.addr, expanding.addr] {
        for (key, first) in [("order-packed", &packed), ("order-expanded", &expanded)] {
            let replay = send(&client(), order(gateway, key)).await;
            assert_eq!(replay.status, StatusCode::CREATED, "{key} via {gateway}");
            assert!(replay.replayed(), "{key} via {gateway}: {replay:?}");
            assert_eq!(replay.body, first.body, "{key} via {gateway}");
            assert_eq!(
                replay.headers.get(header::LOCATION),
                first.headers.get(header::LOCATION)
            );
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // A replay reads without rewriting: the packed record stays packed.
    assert!(field_names(&redis, &packed_record).contains(&"n".to_owned()));
}

/// Bytes Redis has sent to its clients so far (`INFO stats`).
fn bytes_sent(redis: &RedisServer) -> u64 {
    redis
        .info_field("stats", "total_net_output_bytes")
        .and_then(|n| n.parse().ok())
        .expect("total_net_output_bytes in INFO stats")
}

/// A listing only processing records can match (the gateway's gauge of
/// stuck records runs one every few seconds) reads the other records no
/// further than their state: twenty completed records with 16 KiB
/// responses cost it a few kilobytes, where a listing of every record
/// carries all their responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_processing_records_reads_no_completed_response() {
    use idem_core::{
        Outcome, RecordQuery, RecordState, RecordsAdmin, Reservation, Store, StoredResponse,
    };
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let store = idem_redis::RedisStore::from_url(&redis.url()).expect("store");
    let reserve = |key: String| {
        let request = reserve_request(&key, std::time::Duration::from_secs(30));
        let store = &store;
        async move {
            match store.reserve(&request).await.expect("reserve") {
                Reservation::Acquired(lease) => lease,
                other => panic!("expected Acquired, got {other:?}"),
            }
        }
    };
    let body = Bytes::from(vec![b'x'; 16 * 1024]);
    for n in 0..20 {
        let lease = reserve(format!("done-{n}")).await;
        let outcome = Outcome::Stored(StoredResponse {
            status: 201,
            headers: vec![(
                http::header::CONTENT_TYPE,
                Bytes::from_static(b"text/plain"),
            )],
            body: body.clone(),
        });
        let _ = store.complete(&lease, &outcome).await.expect("complete");
    }
    let _running = reserve("running".to_owned()).await;
    let query = |state| RecordQuery {
        state,
        limit: 100,
        ..RecordQuery::default()
    };

    let before = bytes_sent(&redis);
    let processing = store
        .list(&query(Some(RecordState::Processing)))
        .await
        .expect("list");
    let filtered = bytes_sent(&redis) - before;
    let keys: Vec<&str> = processing.iter().map(|r| &*r.key).collect();
    assert_eq!(keys, ["running"]);

    let before = bytes_sent(&redis);
    let every = store.list(&query(None)).await.expect("list");
    let unfiltered = bytes_sent(&redis) - before;
    assert_eq!(every.len(), 21);
    assert!(
        unfiltered > 20 * 16 * 1024,
        "a listing of every record carries the responses: {unfiltered} bytes"
    );
    assert!(
        filtered < 16 * 1024,
        "the listing of processing records read completed responses: {filtered} bytes"
    );
}

/// A tenant's listing (the records API lists the caller's own records)
/// reads other tenants' records no further than their tenant: twenty
/// records of another tenant with 16 KiB responses cost it a few
/// kilobytes. It finds the tenant's records in either form the tenant is
/// kept in: `tenant_bin` (a hashed tenant, as the gateway's) and the
/// `tenant` text of records written before that form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_listing_reads_no_other_tenants_record() {
    use idem_core::{
        Fingerprint, IdempotencyKey, Outcome, RecordQuery, RecordsAdmin, Reservation,
        ReserveRequest, Scope, Store, StoredResponse,
    };
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    for packed in [false, true] {
        let prefix = format!("t{}:", u8::from(packed));
        let store = idem_redis::RedisStore::builder(&redis.url())
            .prefix(prefix.clone())
            .record_format(idem_tests::redis_server::format_of(packed))
            .build()
            .expect("store");
        let hashed = format!("auth:{}", "5e".repeat(32));
        let complete = async |tenant: &str, key: &str, body: &'static [u8]| {
            let request = ReserveRequest {
                scope: Scope::new(
                    tenant,
                    "POST /orders",
                    IdempotencyKey::parse(key.as_bytes()).expect("key"),
                ),
                fingerprint: Fingerprint::from_bytes([7; 32]),
                lease: std::time::Duration::from_secs(30),
                retention: std::time::Duration::from_secs(600),
            };
            let Reservation::Acquired(lease) = store.reserve(&request).await.expect("reserve")
            else {
                panic!("expected a new key");
            };
            let outcome = Outcome::Stored(StoredResponse {
                status: 201,
                headers: vec![],
                body: Bytes::from_static(body),
            });
            let _ = store.complete(&lease, &outcome).await.expect("complete");
            *request.scope.hash()
        };
        static LARGE: [u8; 16 * 1024] = [b'x'; 16 * 1024];
        for n in 0..20 {
            complete("auth:other", &format!("theirs-{n}"), &LARGE).await;
        }
        complete(&hashed, "mine", b"ok").await;
        // A record of the same tenant in the layout before `tenant_bin`.
        let older = complete(&hashed, "older", b"ok").await;
        let record = format!("{prefix}{{{}}}", older.to_hex());
        redis.cli(&["HDEL", &record, "tenant_bin"]);
        redis.cli(&["HSET", &record, "tenant", &hashed]);

        let query = |tenant: &str| RecordQuery {
            tenant: Some(tenant.to_owned()),
            limit: 100,
            ..RecordQuery::default()
        };
        let before = bytes_sent(&redis);
        let mine = store.list(&query(&hashed)).await.expect("list");
        let filtered = bytes_sent(&redis) - before;
        let mut keys: Vec<&str> = mine.iter().map(|r| &*r.key).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["mine", "older"], "packed {packed}");
        assert!(mine.iter().all(|r| *r.tenant == *hashed));
        assert!(
            filtered < 16 * 1024,
            "a tenant's listing read another tenant's responses: {filtered} bytes (packed {packed})"
        );
        let theirs = store.list(&query("auth:other")).await.expect("list");
        assert_eq!(theirs.len(), 20, "packed {packed}");
        assert!(
            store
                .list(&query("auth:nobody"))
                .await
                .expect("list")
                .is_empty()
        );
    }
}

/// A listing reads every record key, however many the store holds: with
/// 100,000 other keys under the prefix, all 2,000 lapsed reservations are
/// found. (A listing used to stop after the first 100,000 keys it
/// scanned and answer from those alone: the lapsed-records gauge of a
/// large store showed some of its stuck records, or none.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_reads_past_a_hundred_thousand_keys() {
    use idem_core::{RecordQuery, Reservation, Store};
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    // Keys under the store's prefix that hold no record (a listing skips
    // them after the scan, as it does any key not named by a scope hash).
    let filled = redis.cli(&[
        "EVAL",
        "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'idem:{filler-' .. i .. '}', '1') end return redis.call('DBSIZE')",
        "0",
        "100000",
    ]);
    assert_eq!(filled.trim(), "100000");
    let store = idem_redis::RedisStore::from_url(&redis.url()).expect("store");
    const STUCK: usize = 2_000;
    for n in 0..STUCK {
        let request = reserve_request(&format!("stuck-{n}"), std::time::Duration::from_millis(20));
        let reserved = store.reserve(&request).await.expect("reserve");
        assert!(matches!(reserved, Reservation::Acquired(_)), "{reserved:?}");
    }
    let lapsed = RecordQuery::stuck(10_000);
    // The leases lapse 20 ms after their reservations, by Redis' clock.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let found = store.list(&lapsed).await.expect("list").len();
        if found == STUCK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the listing found {found} of {STUCK} lapsed records"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Counted inside Redis, past the same 100,000 other keys (one of them
    // a string as long as a record key, which the count skips).
    redis.cli(&["SET", &format!("idem:{{{}}}", "f".repeat(64)), "1"]);
    assert_eq!(store.count_lapsed(10_000).await.expect("count"), STUCK);
    assert_eq!(
        store.count_lapsed(500).await.expect("count"),
        500,
        "counted up to its limit"
    );
}

/// The lapsed-records count, made inside Redis, counts what a listing of
/// lapsed records finds: processing records past their lease, in the
/// packed layout and the expanded one (a packed record that was renewed
/// is expanded), and not a live lease, a completed record or a released
/// one; each store only its own prefix. A record whose lease lapsed and
/// whose retry took it over holds a live lease again and is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lapsed_count_is_what_a_listing_of_lapsed_records_finds() {
    use idem_core::{Outcome, RecordQuery, Renewal, Reservation, Store, StoredResponse};
    use std::time::Duration;
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    // Prefixes with a character special in SCAN's patterns: unescaped,
    // `c?:{*}` would match the other store's keys too.
    let prefix = |packed: bool| if packed { "c1:" } else { "c?:" };
    let stores = [false, true].map(|packed| {
        let store = idem_redis::RedisStore::builder(&redis.url())
            .prefix(prefix(packed))
            .record_format(idem_tests::redis_server::format_of(packed))
            .build()
            .expect("store");
        (packed, store)
    });
    let request = reserve_request;
    let short = Duration::from_millis(50);
    for (packed, store) in &stores {
        let reserve = async |key: &str, lease: Duration| match store
            .reserve(&request(key, lease))
            .await
            .expect("reserve")
        {
            Reservation::Acquired(lease) => lease,
            other => panic!("expected Acquired, got {other:?} (packed {packed})"),
        };
        let _live = reserve("live", Duration::from_secs(60)).await;
        let _ = reserve("lapsed-1", short).await;
        let _ = reserve("lapsed-2", short).await;
        let renewed = reserve("renewed", short).await;
        assert!(matches!(
            store.renew(&renewed).await.expect("renew"),
            Renewal::Renewed
        ));
        let done = reserve("done", short).await;
        let outcome = Outcome::Stored(StoredResponse {
            status: 201,
            headers: vec![],
            body: Bytes::from_static(b"ok"),
        });
        let _ = store.complete(&done, &outcome).await.expect("complete");
        let released = reserve("released", short).await;
        let _ = store.release(&released).await.expect("release");
        // Lapsed, then taken over by its retry: a live lease again.
        let _ = reserve("retried", short).await;
        // Which layout each record is in: a packed store's new record is
        // packed (n), a renewed one expanded (lease_until).
        let fields = |key: &str| {
            let hash = request(key, short).scope.hash().to_hex();
            field_names(&redis, &format!("{}{{{hash}}}", prefix(*packed)))
        };
        for (key, packed_layout) in [("lapsed-1", *packed), ("renewed", false)] {
            let names = fields(key);
            assert_eq!(
                names.iter().any(|n| n == "n"),
                packed_layout,
                "{key}: {names:?}"
            );
            assert_eq!(
                !names.iter().any(|n| n == "lease_until"),
                packed_layout,
                "{key}: {names:?}"
            );
        }
    }
    let lapsed = RecordQuery::stuck(100);
    // The short leases lapse 50 ms after their reservations, by Redis' clock.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for (packed, store) in &stores {
        loop {
            let found = store.list(&lapsed).await.expect("list").len();
            if found == 4 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the listing found {found} of 4 lapsed records (packed {packed})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let taken_over = store
            .reserve(&request("retried", Duration::from_secs(60)))
            .await
            .expect("reserve");
        assert!(
            matches!(taken_over, Reservation::TakenOver { .. }),
            "{taken_over:?} (packed {packed})"
        );
        let mut keys: Vec<String> = store
            .list(&lapsed)
            .await
            .expect("list")
            .iter()
            .map(|record| record.key.to_string())
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["lapsed-1", "lapsed-2", "renewed"], "packed {packed}");
        assert_eq!(
            store.count_lapsed(100).await.expect("count"),
            3,
            "packed {packed}"
        );
        assert_eq!(
            store.count_lapsed(2).await.expect("count"),
            2,
            "packed {packed}"
        );
    }
}

/// Compact headers (record format 2): a
/// typical API response (`content-type` and `location`, a 45-byte body),
/// whose headers take 66 bytes in the four-byte form, just over the 64 a
/// value of Redis' compact hash may take, stays in its record in the
/// compact form (55 bytes) instead of a key of its own, and the record
/// takes less memory than the other's two keys. A store that writes the
/// four-byte form replays it exactly, and the compacting store replays a
/// record of the four-byte form exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_headers_keep_an_api_response_in_its_record() {
    use idem_core::{Outcome, Reservation, Store, StoredResponse};
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let store = |compact: bool| {
        idem_redis::RedisStore::builder(&redis.url())
            .record_format(idem_tests::redis_server::format_of(compact))
            .build()
            .expect("store")
    };
    let stores = [("compact", store(true)), ("four-byte", store(false))];
    let request = |key: &str| reserve_request(key, std::time::Duration::from_secs(30));
    let response = |n: u32| {
        Outcome::Stored(StoredResponse {
            status: 201,
            headers: vec![
                (
                    header::CONTENT_TYPE,
                    Bytes::from_static(b"application/json"),
                ),
                (header::LOCATION, Bytes::from(format!("/orders/{n:06}"))),
            ],
            body: Bytes::from(format!(
                "{{\"id\":{n},\"order\":{{\"qty\":1,\"sku\":\"check\"}}}}"
            )),
        })
    };
    for (n, (key, store)) in (100_001..).zip(&stores) {
        let Reservation::Acquired(lease) = store.reserve(&request(key)).await.expect("reserve")
        else {
            panic!("expected a new key");
        };
        let _ = store
            .complete(&lease, &response(n))
            .await
            .expect("complete");
    }
    let record = |key: &str| format!("idem:{{{}}}", request(key).scope.hash().to_hex());
    let exists = |key: &str| redis.cli(&["EXISTS", key]).trim() == "1";
    assert!(!exists(&format!("{}:r", record("compact"))));
    assert!(exists(&format!("{}:r", record("four-byte"))));
    let headers = redis.cli(&["HGET", &record("compact"), "headers"]);
    assert!(headers.starts_with('\u{1}'), "{headers:?}");
    assert_eq!(
        redis
            .cli(&["OBJECT", "ENCODING", &record("compact")])
            .trim(),
        "listpack"
    );
    let compact_bytes = memory_usage(&redis, &record("compact"));
    let four_byte_bytes = memory_usage(&redis, &record("four-byte"))
        + memory_usage(&redis, &format!("{}:r", record("four-byte")));
    assert!(
        compact_bytes > 0 && compact_bytes < four_byte_bytes,
        "compact {compact_bytes} bytes, four-byte {four_byte_bytes}"
    );
    // Each store replays both records exactly.
    for (_, store) in &stores {
        for (n, (key, _)) in (100_001..).zip(&stores) {
            match store.reserve(&request(key)).await.expect("reserve") {
                Reservation::Completed(replay) => assert_eq!(replay.outcome, response(n), "{key}"),
                other => panic!("{key}: expected a replay, got {other:?}"),
            }
        }
    }
}
