//! Crash points of the transactional completion, through the real
//! `axum-orders` process on a private PostgreSQL, killed with SIGKILL: the
//! `orders` table ends with exactly one row for a key whatever the crash.

use std::{process::Command, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{Reply, client, postgres_server::PgServer, process::Spawned, send};

/// The lease of these tests: long enough for a debug build's handler, short
/// enough that the retry after a crash does not wait long.
const LEASE: &str = "3s";

/// One `axum-orders` process on a database; killed on drop.
struct Orders {
    process: Spawned,
    addr: String,
}

impl Orders {
    fn start(database: &str) -> Self {
        let process = Spawned::start(
            Command::new(env!("CARGO_BIN_EXE_axum-orders"))
                .env("IDEM_LISTEN", "127.0.0.1:0")
                .env("IDEM_STORE", database)
                .env("IDEM_LEASE", LEASE)
                .env("ORDERS_TEST_HOOKS", "1"),
        );
        let addr = process.address();
        Self { process, addr }
    }

    fn wait_for_line(&self, what: &str) {
        self.process.wait_for_line(what);
    }

    fn kill(&mut self) {
        self.process.kill();
    }

    fn post(&self, key: &str, hold: Option<&str>) -> Request<Full<Bytes>> {
        let mut request = Request::post(format!("http://{}/orders", self.addr))
            .header("idempotency-key", key)
            .header("x-tenant-id", "acme")
            .header("content-type", "application/json");
        if let Some(point) = hold {
            request = request.header("x-test-hold", point);
        }
        request
            .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
            .expect("request")
    }

    /// Posts `key` until the answer is not `409 in progress` (bounded).
    async fn post_until_done(&self, key: &str) -> Reply {
        let reply = idem_tests::poll_until(
            Duration::from_secs(30),
            async || send(&client(), self.post(key, None)).await,
            |reply| reply.status != StatusCode::CONFLICT,
        )
        .await;
        assert_ne!(reply.status, StatusCode::CONFLICT, "still in progress");
        reply
    }
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// A database for one test, and a pool on it.
async fn database() -> Option<(String, sqlx::PgPool)> {
    let url = PgServer::shared()?.database();
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    Some((url, pool))
}

/// Killed after inserting the order, before the commit: nothing of the
/// order exists; the retry after the lease runs once more (attempt 2) and
/// the table ends with one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_commit_leaves_nothing_and_the_retry_runs_once() {
    let Some((url, pool)) = database().await else {
        return;
    };
    let mut first = Orders::start(&url);
    let lost = tokio::spawn(client().request(first.post("before", Some("before-commit"))));
    first.wait_for_line("holding before commit");
    first.kill();
    let _ = lost.await;
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idem_records WHERE state = 'processing'"
        )
        .await,
        1
    );

    let second = Orders::start(&url);
    let retry = second.post_until_done("before").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        count(&pool, "SELECT generation FROM idem_records").await,
        2,
        "the retry did not take over as attempt 2"
    );
    let replay = send(&client(), second.post("before", None)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

/// Killed after the commit, before the client read its response: the order
/// and the completed record are both durable; the retry replays the
/// committed response and inserts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_commit_replays_the_committed_order() {
    let Some((url, pool)) = database().await else {
        return;
    };
    let mut first = Orders::start(&url);
    let lost = tokio::spawn(client().request(first.post("after", Some("after-commit"))));
    first.wait_for_line("holding after commit");
    first.kill();
    let _ = lost.await;
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idem_records WHERE state = 'completed'"
        )
        .await,
        1
    );
    let id = count(&pool, "SELECT id FROM orders").await;

    let second = Orders::start(&url);
    let retry = send(&client(), second.post("after", None)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    let order: serde_json::Value = serde_json::from_slice(&retry.body).expect("json");
    assert_eq!(order["id"], id);
    assert_eq!(
        retry.header("location"),
        Some(format!("/orders/{id}").as_str())
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

/// 100 concurrent duplicates: one order; every 201 has the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_duplicates_make_one_order() {
    let Some((url, pool)) = database().await else {
        return;
    };
    let orders = Orders::start(&url);
    let http = client();
    let replies: Vec<Reply> = futures_join(
        (0..100)
            .map(|_| tokio::spawn(send(&http, orders.post("many", None))))
            .collect(),
    )
    .await;
    let mut bodies = Vec::new();
    for reply in &replies {
        match reply.status {
            StatusCode::CREATED => bodies.push(reply.body.clone()),
            StatusCode::CONFLICT => {
                assert_eq!(reply.code().as_deref(), Some("idempotency_in_progress"));
            }
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    let last = orders.post_until_done("many").await;
    assert_eq!(last.status, StatusCode::CREATED);
    bodies.push(last.body);
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "different bodies");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

async fn futures_join(tasks: Vec<tokio::task::JoinHandle<Reply>>) -> Vec<Reply> {
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        replies.push(task.await.expect("task"));
    }
    replies
}
