//! Record format 3 on a real redis-server: a new key's record kept as one
//! string, what each hot path costs Redis (commands counted in
//! `INFO commandstats`), and the rewrite into the format 2 hash that every
//! other path works on. The whole conformance suite runs on format 3 in
//! `redis_conformance.rs`.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Cancellation, Completion, Fingerprint, IdempotencyKey, Outcome, RecordQuery, RecordState,
    RecordsAdmin, Renewal, Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse,
};
use idem_redis::{RecordFormat, RedisStore};
use idem_tests::redis_server::{RedisServer, commands_between};

fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(&server.url())
        .record_format(RecordFormat::V3)
        .build()
        .expect("store")
}

fn request(key: &str, fingerprint: u8, lease: Duration) -> ReserveRequest {
    ReserveRequest {
        scope: Scope::new(
            format!("auth:{}", "5e".repeat(32)),
            "POST /orders",
            IdempotencyKey::parse(key.as_bytes()).expect("key"),
        ),
        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
        lease,
        retention: Duration::from_secs(600),
    }
}

/// A response of `body_length` bytes, with two headers.
fn response(body_length: usize) -> Outcome {
    Outcome::Stored(StoredResponse {
        status: 201,
        headers: vec![
            (
                idem_core::HeaderName::from_static("content-type"),
                Bytes::from_static(b"application/json"),
            ),
            (
                idem_core::HeaderName::from_static("location"),
                Bytes::from_static(b"/orders/100001"),
            ),
        ],
        body: Bytes::from(vec![b'x'; body_length]),
    })
}

async fn acquire(store: &RedisStore, request: &ReserveRequest) -> idem_core::Lease {
    match store.reserve(request).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn replayed(reservation: Reservation) -> Outcome {
    match reservation {
        Reservation::Completed(replay) => replay.outcome,
        other => panic!("expected a replay, got {other:?}"),
    }
}

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.cli(&["PTTL", key]).trim().parse().expect("pttl")
}

fn kind(server: &RedisServer, key: &str) -> String {
    server.cli(&["TYPE", key]).trim().to_owned()
}

/// A new key is one native `SET`, its completion one script that reads the
/// record and sets it (keeping its expiry), a replay and a conflict one
/// `SET` each: no script, no clock. The replay is the stored response
/// byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_and_its_replay_are_native_commands() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = store(&server);
    // Loads the completion's script, so that no NOSCRIPT is counted below.
    let warm = request("warm-up", 1, Duration::from_secs(30));
    let lease = acquire(&store, &warm).await;
    assert_eq!(
        store
            .complete(&lease, &response(10))
            .await
            .expect("complete"),
        Completion::Recorded
    );

    let request = request("order-1", 1, Duration::from_secs(30));
    let key = store.record_key(request.scope.hash());
    let before = server.command_stats();
    let lease = acquire(&store, &request).await;
    let reserved = server.command_stats();
    assert_eq!(
        commands_between(&before, &reserved),
        [("set".to_owned(), 1)].into()
    );
    assert_eq!(kind(&server, &key), "string");
    let left = pttl(&server, &key);
    assert!(left > 590_000 && left <= 600_000, "{left} ms");
    // Past this test's own TYPE and PTTL.
    let reserved = server.command_stats();

    let outcome = response(300);
    assert_eq!(
        store.complete(&lease, &outcome).await.expect("complete"),
        Completion::Recorded
    );
    let completed = server.command_stats();
    assert_eq!(
        commands_between(&reserved, &completed),
        [
            ("evalsha".to_owned(), 1),
            ("get".to_owned(), 1),
            ("set".to_owned(), 1)
        ]
        .into()
    );
    assert_eq!(kind(&server, &key), "string");
    // Retention counts from the reservation: the expiry stayed.
    let after = pttl(&server, &key);
    assert!(after <= left && after > left - 30_000, "{after} ms");
    let completed = server.command_stats();

    let replay = replayed(store.reserve(&request).await.expect("replay"));
    assert_eq!(replay, outcome);
    let changed = ReserveRequest {
        fingerprint: Fingerprint::from_bytes([2; 32]),
        ..request.clone()
    };
    assert!(matches!(
        store.reserve(&changed).await.expect("conflict"),
        Reservation::Conflict
    ));
    let answered = server.command_stats();
    assert_eq!(
        commands_between(&completed, &answered),
        [("set".to_owned(), 2)].into(),
        "a replay and a conflict: one native SET each"
    );
    assert_eq!(kind(&server, &key), "string", "a replay writes nothing");
}

/// A duplicate of a held string record is answered in progress by two
/// native commands (`SET … GET`, `PTTL`), with the lease's remaining time
/// as its retry hint; once the lease lapsed, the reserve script takes the
/// record over (generation 2, the first attempt superseded), as on a hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_a_held_string_is_answered_natively() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = store(&server);
    let lease = Duration::from_millis(1_500);
    let request = request("held", 1, lease);
    let key = store.record_key(request.scope.hash());
    let first = acquire(&store, &request).await;
    let before = server.command_stats();
    let Reservation::InProgress { retry_after } = store.reserve(&request).await.expect("dup")
    else {
        panic!("expected InProgress");
    };
    assert!(
        retry_after <= lease && retry_after > Duration::ZERO,
        "{retry_after:?}"
    );
    assert_eq!(
        commands_between(&before, &server.command_stats()),
        [("set".to_owned(), 1), ("pttl".to_owned(), 1)].into()
    );
    assert_eq!(kind(&server, &key), "string");

    // The lease lapses by Redis' clock; the retry takes over.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let taken = loop {
        match store.reserve(&request).await.expect("retry") {
            Reservation::TakenOver { lease, superseded } => break (lease, superseded),
            Reservation::InProgress { .. } => {
                assert!(std::time::Instant::now() < deadline, "never taken over");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(taken.0.generation, 2);
    assert_eq!(taken.1.id, first.attempt);
    assert_eq!(kind(&server, &key), "hash");
    // The first owner's completion is fenced; the new one's is recorded.
    assert!(matches!(
        store.complete(&first, &response(5)).await.expect("fenced"),
        Completion::Fenced(_)
    ));
    assert_eq!(
        store.complete(&taken.0, &response(5)).await.expect("done"),
        Completion::Recorded
    );
    assert_eq!(
        replayed(store.reserve(&request).await.expect("replay")),
        response(5)
    );
}

/// Any path that may write rewrites a string record as the format 2 hash
/// it stands for, with the same expiry (a renewal then expands it, as it
/// does a packed record): a renewal of a held one, a cancel of a completed
/// one (whose 300-byte response then moves to a key of its own, as format
/// 2 keeps it). A read leaves it a string. Nothing a caller sees changes:
/// the lease, the owner's completion, the record read, the replay byte for
/// byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_record_becomes_the_hash_it_stands_for() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = store(&server);
    let request = request("renewed", 1, Duration::from_secs(30));
    let key = store.record_key(request.scope.hash());
    let lease = acquire(&store, &request).await;
    let before = pttl(&server, &key);
    assert_eq!(store.renew(&lease).await.expect("renew"), Renewal::Renewed);
    assert_eq!(kind(&server, &key), "hash");
    let fields = server.cli(&["HKEYS", &key]);
    for field in [
        "state",
        "lease_until",
        "owner",
        "fp",
        "cur_id",
        "tenant_bin",
        "op",
        "key",
    ] {
        assert!(
            fields.lines().any(|f| f.trim() == field),
            "{field}: {fields}"
        );
    }
    let after = pttl(&server, &key);
    assert!(after <= before && after > before - 30_000, "{after} ms");
    let record = store
        .get(request.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.state, RecordState::Processing);
    assert_eq!(record.owner, Some(lease.token));
    assert_eq!(record.key.to_string(), "renewed");
    assert_eq!(*record.tenant, format!("auth:{}", "5e".repeat(32)));
    assert_eq!(
        store.complete(&lease, &response(300)).await.expect("done"),
        Completion::Recorded
    );
    assert_eq!(
        replayed(store.reserve(&request).await.expect("replay")),
        response(300)
    );

    // Completed as a string, read through the records API as it is, then
    // met by a cancel (which has nothing to cancel).
    let request = self::request("read", 1, Duration::from_secs(30));
    let key = store.record_key(request.scope.hash());
    let lease = acquire(&store, &request).await;
    assert_eq!(
        store.complete(&lease, &response(300)).await.expect("done"),
        Completion::Recorded
    );
    assert_eq!(kind(&server, &key), "string");
    let record = store
        .get(request.scope.hash())
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.outcome, Some(response(300)));
    assert_eq!(record.attempts.len(), 1);
    assert_eq!(record.owner, None);
    assert_eq!(record.key.to_string(), "read");
    assert_eq!(kind(&server, &key), "string", "a read writes nothing");
    let Cancellation::AlreadyCompleted(cancelled) =
        store.cancel(request.scope.hash()).await.expect("cancel")
    else {
        panic!("expected AlreadyCompleted");
    };
    assert_eq!(cancelled.outcome, record.outcome);
    assert_eq!(cancelled.attempts, record.attempts);
    assert_eq!(kind(&server, &key), "hash");
    let response_key = pttl(&server, &format!("{key}:r"));
    assert!(
        (pttl(&server, &key) - response_key).abs() < 2_000,
        "{response_key} ms"
    );
    assert_eq!(
        replayed(store.reserve(&request).await.expect("replay")),
        response(300)
    );
}

/// The lapsed-records count reads a held string's lease from its remaining
/// time inside Redis, without rewriting it: two lapsed, not the live one
/// nor the completed one; a listing finds the same two, and rewrites
/// nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapsed_string_records_are_counted_as_they_are() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = store(&server);
    let short = Duration::from_millis(50);
    let _live = acquire(&store, &request("live", 1, Duration::from_secs(60))).await;
    let lapsed = ["lapsed-1", "lapsed-2"].map(|key| request(key, 1, short));
    for request in &lapsed {
        acquire(&store, request).await;
    }
    let done = acquire(&store, &request("done", 1, short)).await;
    assert_eq!(
        store.complete(&done, &response(5)).await.expect("done"),
        Completion::Recorded
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.count_lapsed(100).await.expect("count") != 2 {
        assert!(std::time::Instant::now() < deadline, "never counted 2");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for request in &lapsed {
        assert_eq!(
            kind(&server, &store.record_key(request.scope.hash())),
            "string"
        );
    }
    let mut keys: Vec<String> = store
        .list(&RecordQuery::stuck(100))
        .await
        .expect("list")
        .iter()
        .map(|record| record.key.to_string())
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["lapsed-1", "lapsed-2"]);
    for request in &lapsed {
        assert_eq!(
            kind(&server, &store.record_key(request.scope.hash())),
            "string",
            "a listing writes nothing"
        );
    }
}

/// A string record of a newer format (written by a later idem) is refused
/// on every path, never misread or rewritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_record_of_a_newer_format_is_refused() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let store = store(&server);
    let request = request("newer", 1, Duration::from_secs(30));
    let key = store.record_key(request.scope.hash());
    let lease = acquire(&store, &request).await;
    let newer = format!("4{}", &server.cli(&["GET", &key]).trim()[1..]);
    server.cli(&["SET", &key, &newer, "KEEPTTL"]);
    let refused = |error: StoreError| {
        let text = error.to_string();
        assert!(text.contains("newer"), "{text}");
    };
    refused(store.reserve(&request).await.expect_err("reserve"));
    refused(store.renew(&lease).await.expect_err("renew"));
    refused(store.get(request.scope.hash()).await.expect_err("get"));
    assert_eq!(server.cli(&["GET", &key]).trim(), newer);
}

/// A typical API response (`content-type`, `location`, a 45-byte body)
/// takes less Redis memory in format 3's one string than in format 2's
/// hash (`docs/sizing.md`: 504 against 568 bytes), and either store replays
/// the other's record byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_record_takes_less_memory_than_the_hash() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    let strings = store(&server);
    let hashes = RedisStore::builder(&server.url())
        .record_format(RecordFormat::V2)
        .build()
        .expect("store");
    let memory = |key: &str| -> u64 {
        server
            .cli(&["MEMORY", "USAGE", key])
            .trim()
            .parse()
            .expect("bytes")
    };
    let mut used = Vec::new();
    for (name, store) in [("string", &strings), ("hash", &hashes)] {
        let request = request(&format!("order-{name}"), 1, Duration::from_secs(30));
        let lease = acquire(store, &request).await;
        assert_eq!(
            store.complete(&lease, &response(45)).await.expect("done"),
            Completion::Recorded
        );
        let key = store.record_key(request.scope.hash());
        assert_eq!(kind(&server, &key), name);
        assert_eq!(
            server.cli(&["EXISTS", &format!("{key}:r")]).trim(),
            "0",
            "{name}: the response stays in its record"
        );
        used.push(memory(&key));
        for reader in [&strings, &hashes] {
            assert_eq!(
                replayed(reader.reserve(&request).await.expect("replay")),
                response(45)
            );
        }
    }
    assert!(
        used[0] < used[1],
        "string {} bytes, hash {}",
        used[0],
        used[1]
    );
}

/// An operator's `PEXPIRE` on a live record never shortens its lease: on
/// format 3, whose lease is read from the key's expiry, a duplicate from
/// another process is still in progress, the lapsed count stays 0 and a
/// listing shows no lapsed record, as on format 2 (whose lease is a field
/// of the hash). An expiry trimmed below the lease left loses the record,
/// as an eviction does: the key is then free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiry_changed_from_outside_never_shortens_a_live_lease() {
    let Some(server) = RedisServer::spawn() else {
        return;
    };
    // The lease-after-restart rule (reserve.lua) keeps every lease live
    // for a lease after Redis started: wait that out, so only the record's
    // own lease keeps it.
    let lease = Duration::from_secs(4);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let uptime = || {
        server
            .info_field("server", "uptime_in_seconds")
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    while uptime() < lease.as_secs() + 1 {
        assert!(std::time::Instant::now() < deadline, "uptime never grew");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for format in [RecordFormat::V3, RecordFormat::V2] {
        let store = |format| {
            RedisStore::builder(&server.url())
                .record_format(format)
                .build()
                .expect("store")
        };
        // Two processes on one Redis.
        let (first, second) = (store(format), store(format));
        let request = request(&format!("pexpire-{format:?}"), 1, lease);
        let key = first.record_key(request.scope.hash());
        let held = acquire(&first, &request).await;
        // Retention 600 s: an expiry of 300 s implies a start 300 s ago,
        // far past the lease.
        server.cli(&["PEXPIRE", &key, "300000"]);
        match second.reserve(&request).await.expect("duplicate") {
            Reservation::InProgress { retry_after } => {
                assert!(retry_after <= lease, "{format:?}: {retry_after:?}");
            }
            other => panic!("{format:?}: the live lease was taken over: {other:?}"),
        }
        assert_eq!(
            second.count_lapsed(100).await.expect("count"),
            0,
            "{format:?}"
        );
        let stuck = second.list(&RecordQuery::stuck(100)).await.expect("list");
        assert!(stuck.is_empty(), "{format:?}: {stuck:?}");
        assert_eq!(
            first.complete(&held, &response(5)).await.expect("complete"),
            Completion::Recorded,
            "{format:?}: the owner still records its outcome"
        );
        assert_eq!(
            replayed(second.reserve(&request).await.expect("replay")),
            response(5)
        );

        // Trimmed below what is left of the lease: the record is lost with
        // its key, as an evicted one is, and the key is free again.
        let trimmed = request_with(&format!("trimmed-{format:?}"));
        let trimmed_key = first.record_key(trimmed.scope.hash());
        acquire(&first, &trimmed).await;
        server.cli(&["PEXPIRE", &trimmed_key, "1"]);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while server.cli(&["EXISTS", &trimmed_key]).trim() != "0" {
            assert!(std::time::Instant::now() < deadline, "never expired");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(matches!(
            second.reserve(&trimmed).await.expect("reserve"),
            Reservation::Acquired(_)
        ));
    }
}

fn request_with(key: &str) -> ReserveRequest {
    request(key, 1, Duration::from_secs(30))
}
