//! The stores read as an attacker would: after a replayable POST whose
//! answer carries a marker, no key, field or row of Redis, Redis Cluster
//! or PostgreSQL holds the marker or the answer's headers in clear. A
//! gateway with `--no-sealing` on the same store is the control: its
//! record shows its marker, so the read would see one.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{
    Reply, TestServer, client, postgres_server::PgServer, redis_server::RedisCluster,
    redis_server::RedisServer, send, start_gateway, upstream::Upstream,
};

const SECRET: &str = "a tenant secret shared by the fleet, 0001";

/// `POST /echo` with a body carrying `marker`: the answer echoes it.
async fn echo(addr: std::net::SocketAddr, key: &str, marker: &str) -> Reply {
    let request = Request::post(format!("http://{addr}/echo"))
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!("{{\"sku\":\"{marker}\"}}"))))
        .expect("request");
    send(&client(), request).await
}

/// Everything the Redis nodes at `ports` hold: every key and every value
/// of every field, member or element, raw.
fn redis_bytes(ports: &[u16]) -> Vec<u8> {
    use redis::Commands;
    let mut all = Vec::new();
    for port in ports {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("client");
        let mut connection = client.get_connection().expect("connect");
        let keys: Vec<Vec<u8>> = connection
            .scan::<Vec<u8>>()
            .expect("scan")
            .collect::<Result<_, _>>()
            .expect("scan");
        for key in keys {
            all.extend_from_slice(&key);
            let kind: String = redis::cmd("TYPE")
                .arg(&key)
                .query(&mut connection)
                .expect("type");
            let values: Vec<Vec<u8>> = match kind.as_str() {
                "hash" => connection
                    .hgetall::<_, Vec<Vec<u8>>>(&key)
                    .expect("hgetall"),
                "string" => vec![connection.get(&key).expect("get")],
                "set" => connection.smembers(&key).expect("smembers"),
                "zset" => connection.zrange(&key, 0, -1).expect("zrange"),
                "list" => connection.lrange(&key, 0, -1).expect("lrange"),
                other => panic!("a key of type {other}"),
            };
            for value in values {
                all.extend_from_slice(&value);
            }
        }
    }
    all
}

/// Every row of every idem table of the database at `url`, as text
/// (`bytea` as hex).
async fn postgres_text(url: &str) -> Vec<u8> {
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE tablename LIKE 'idem%'")
            .fetch_all(&pool)
            .await
            .expect("tables");
    assert!(tables.iter().any(|t| t == "idem_records"), "{tables:?}");
    let mut all = Vec::new();
    for table in tables {
        let rows: Vec<String> = sqlx::query_scalar(&format!("SELECT t::text FROM {table} t"))
            .fetch_all(&pool)
            .await
            .expect("rows");
        for row in rows {
            all.extend_from_slice(row.as_bytes());
        }
    }
    all
}

fn holds(haystack: &[u8], needle: &str) -> bool {
    let plain = needle.as_bytes();
    let hex = hex::encode(plain);
    haystack.windows(plain.len()).any(|w| w == plain)
        || haystack.windows(hex.len()).any(|w| w == hex.as_bytes())
}

/// On the store at `store` (a `--store` URL): a sealed gateway's record
/// shows neither its marker nor its answer's headers; the control
/// gateway's does; both replay byte for byte. `read` reads the store.
async fn sealed_on<F, R>(store: &str, read: R)
where
    R: Fn() -> F,
    F: std::future::Future<Output = Vec<u8>>,
{
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let sealed = start_gateway(&origin, &["--store", store, "--tenant-secret", SECRET]).await;
    let clear = start_gateway(
        &origin,
        &[
            "--store",
            store,
            "--tenant-secret",
            SECRET,
            "--no-sealing",
            "--unkeyed-fingerprints",
        ],
    )
    .await;
    let hidden = echo(sealed.addr, "sealed-1", "SEALEDMARK-41c7").await;
    assert_eq!(hidden.status, StatusCode::CREATED, "{hidden:?}");
    assert_eq!(hidden.header("x-order-ref"), Some("REFMARK-1"));
    let shown = echo(clear.addr, "clear-1", "CLEARMARK-9e02").await;
    assert_eq!(shown.status, StatusCode::CREATED, "{shown:?}");

    let stored = read().await;
    assert!(
        holds(&stored, "CLEARMARK-9e02"),
        "the control's marker is readable"
    );
    assert!(
        holds(&stored, "REFMARK-2"),
        "the control's header is readable"
    );
    for secret in ["SEALEDMARK-41c7", "REFMARK-1"] {
        assert!(!holds(&stored, secret), "{secret} is stored in clear");
    }
    // Fingerprints: the control's is the plain hash of its request; the
    // sealed gateway's is keyed, so its plain hash is nowhere.
    let plain = |marker: &str| {
        let parts = Request::post("/echo")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts()
            .0;
        let body = format!("{{\"sku\":\"{marker}\"}}");
        idem_layer::fingerprint::fingerprint(
            "POST /echo",
            &parts,
            &[http::header::CONTENT_TYPE],
            body.as_bytes(),
        )
    };
    let has_fingerprint = |fingerprint: idem_core::Fingerprint| {
        let raw = fingerprint.as_bytes();
        let hex = hex::encode(raw);
        stored.windows(32).any(|w| w == raw) || stored.windows(64).any(|w| w == hex.as_bytes())
    };
    assert!(
        has_fingerprint(plain("CLEARMARK-9e02")),
        "the control's plain fingerprint"
    );
    assert!(
        !has_fingerprint(plain("SEALEDMARK-41c7")),
        "a plain fingerprint is stored"
    );
    // Both replay byte for byte, from either gateway (no replay cache
    // holds the other's record).
    for (gateway, key, marker, first) in [
        (&clear, "sealed-1", "SEALEDMARK-41c7", &hidden),
        (&sealed, "clear-1", "CLEARMARK-9e02", &shown),
    ] {
        let replay = echo(gateway.addr, key, marker).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("x-order-ref"), first.header("x-order-ref"));
    }
    assert_eq!(upstream.runs(), 2);

    // A rotation: a gateway given key 1 seals new records with it and
    // still opens key 0's; one without key 1 replays nothing of key 1's
    // and runs nothing again.
    let key = "1:".to_owned() + &"5a".repeat(32);
    let rotated = start_gateway(
        &origin,
        &[
            "--store",
            store,
            "--tenant-secret",
            SECRET,
            "--sealing-key",
            &key,
        ],
    )
    .await;
    let old = echo(rotated.addr, "sealed-1", "SEALEDMARK-41c7").await;
    assert!(old.replayed(), "{old:?}");
    assert_eq!(old.body, hidden.body);
    let new = echo(rotated.addr, "rotated-1", "ROTATEDMARK-77aa").await;
    assert_eq!(new.status, StatusCode::CREATED);
    assert!(
        echo(rotated.addr, "rotated-1", "ROTATEDMARK-77aa")
            .await
            .replayed()
    );
    let without_key = echo(sealed.addr, "rotated-1", "ROTATEDMARK-77aa").await;
    assert_eq!(
        without_key.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{without_key:?}"
    );
    assert_eq!(
        without_key.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(upstream.runs(), 3, "nothing ran again");
    assert!(!holds(&read().await, "ROTATEDMARK-77aa"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_no_response_in_clear() {
    let Some(redis) = RedisServer::spawn() else {
        return;
    };
    let port = redis.port;
    sealed_on(&redis.url(), || async move { redis_bytes(&[port]) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_holds_no_response_in_clear() {
    let Some(cluster) = RedisCluster::spawn() else {
        return;
    };
    let ports: Vec<u16> = cluster.nodes.iter().map(|node| node.port).collect();
    sealed_on(&cluster.url(), || {
        let ports = ports.clone();
        async move { redis_bytes(&ports) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_holds_no_response_in_clear() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    sealed_on(&url, || postgres_text(&url)).await;
}

/// A sealed answer is bound to the attempt that stored it, not to a
/// generation the envelope claims: after an erase the key starts again at
/// generation 1 under a new attempt, and the old record's sealed answer
/// copied into the new record (as whoever writes to the database could)
/// does not open: `503`, never the old answer replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_answer_moved_to_the_next_attempt_of_its_key_does_not_open() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let url = server.database();
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &origin,
        &[
            "--store",
            &url,
            "--tenant-secret",
            SECRET,
            "--replay-cache-bytes",
            "0",
        ],
    )
    .await;
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let first = echo(gateway.addr, "bound-1", "FIRSTMARK").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let (scope, names, values, body): (Vec<u8>, Vec<String>, Vec<Vec<u8>>, Vec<u8>) =
        sqlx::query_as(
            "SELECT scope, header_names, header_values, body FROM idem_records \
             WHERE state = 'completed'",
        )
        .fetch_one(&pool)
        .await
        .expect("the first record");
    // Erased: the key is new, and runs again as generation 1.
    sqlx::query("DELETE FROM idem_records WHERE scope = $1")
        .bind(&scope)
        .execute(&pool)
        .await
        .expect("erase");
    let second = echo(gateway.addr, "bound-1", "FIRSTMARK").await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed());
    assert_eq!(upstream.runs(), 2);
    let generation: i64 =
        sqlx::query_scalar("SELECT generation FROM idem_records WHERE scope = $1")
            .bind(&scope)
            .fetch_one(&pool)
            .await
            .expect("generation");
    assert_eq!(generation, 1);
    // The first attempt's sealed answer, moved into the second's record.
    sqlx::query(
        "UPDATE idem_records SET header_names = $2, header_values = $3, body = $4 \
         WHERE scope = $1",
    )
    .bind(&scope)
    .bind(&names)
    .bind(&values)
    .bind(&body)
    .execute(&pool)
    .await
    .expect("move");
    let moved = echo(gateway.addr, "bound-1", "FIRSTMARK").await;
    assert_eq!(moved.status, StatusCode::SERVICE_UNAVAILABLE, "{moved:?}");
    assert_eq!(
        moved.code().as_deref(),
        Some("idempotency_store_unavailable")
    );
    assert_eq!(upstream.runs(), 2, "nothing ran again");
}
