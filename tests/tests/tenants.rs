//! Tenants through the real gateway, tried as an attacker would: spellings
//! of one credential are one caller, a refreshed JWT keeps its tenant and a
//! forged or expired one is refused, no record holds a value a dictionary
//! can reverse, and a flooding tenant leaves the others working.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{
    Reply, TestServer, client, redis_server::RedisServer, send, start_gateway, upstream::Upstream,
};
use jsonwebtoken::{Algorithm, EncodingKey, Header};

/// A keyed POST of `/orders` with this `Authorization` value.
async fn post(addr: std::net::SocketAddr, key: &str, authorization: &str) -> Reply {
    let request = Request::post(format!("http://{addr}/orders"))
        .header("idempotency-key", key)
        .header("authorization", authorization)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
        .expect("request");
    send(&client(), request).await
}

/// A keyed JSON POST of `/orders` from the tenant `acme` (`x-tenant`).
fn acme_order(addr: std::net::SocketAddr, key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/orders"))
        .header("idempotency-key", key)
        .header("x-tenant", "acme")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

/// The equivalent spellings of one credential are one tenant: the second
/// and later spellings replay.
#[tokio::test]
async fn spellings_of_one_credential_are_one_tenant() {
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &[]).await;
    let first = post(gateway.addr, "spell", "Bearer token-x").await;
    assert_eq!(first.status, StatusCode::CREATED);
    for spelling in ["bearer token-x", "BEARER   token-x", " Bearer\ttoken-x "] {
        let reply = post(gateway.addr, "spell", spelling).await;
        assert!(reply.replayed(), "{spelling:?} was another tenant");
        assert_eq!(reply.body, first.body);
    }
    assert_eq!(upstream.runs(), 1);
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

fn token(
    key: &EncodingKey,
    alg: Algorithm,
    kid: Option<&str>,
    claims: &serde_json::Value,
) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_owned);
    format!(
        "Bearer {}",
        jsonwebtoken::encode(&header, claims, key).expect("encode")
    )
}

/// A directory for one test's key files, removed on drop.
struct Files(std::path::PathBuf);

impl Files {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("idem-jwt-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        Self(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, bytes).expect("write");
        path.display().to_string()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Tenants from a verified HMAC-signed JWT's `sub`: a refreshed token keeps
/// the tenant, another subject is another tenant, and a forged, expired,
/// unsigned or claimless token is 401 and never runs the upstream.
#[tokio::test]
async fn a_refreshed_jwt_keeps_its_tenant_and_bad_ones_are_refused() {
    let secret = b"the issuer's HMAC secret, 32 bytes or more";
    let files = Files::new();
    let keys = files.write("hmac.key", &[&secret[..], b"\n"].concat());
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &["--tenant-jwt-keys", &keys]).await;
    let signing = EncodingKey::from_secret(secret);
    let alice = |issued: u64| {
        token(
            &signing,
            Algorithm::HS256,
            None,
            &serde_json::json!({ "sub": "alice", "iat": issued, "exp": issued + 3600 }),
        )
    };
    let first = post(gateway.addr, "jwt-1", &alice(now())).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // A refreshed token (issued later, another expiry) is the same caller.
    let refreshed = post(gateway.addr, "jwt-1", &alice(now() + 60)).await;
    assert!(refreshed.replayed(), "{refreshed:?}");
    assert_eq!(refreshed.body, first.body);
    // Another subject is another tenant: the same key runs again.
    let bob = token(
        &signing,
        Algorithm::HS512,
        None,
        &serde_json::json!({ "sub": "bob", "exp": now() + 3600 }),
    );
    let other = post(gateway.addr, "jwt-1", &bob).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(upstream.runs(), 2);

    let forged = token(
        &EncodingKey::from_secret(b"somebody else's secret, also long enough"),
        Algorithm::HS256,
        None,
        &serde_json::json!({ "sub": "alice", "exp": now() + 3600 }),
    );
    let expired = token(
        &signing,
        Algorithm::HS256,
        None,
        &serde_json::json!({ "sub": "alice", "exp": now() - 3600 }),
    );
    let no_subject = token(
        &signing,
        Algorithm::HS256,
        None,
        &serde_json::json!({ "exp": now() + 3600 }),
    );
    // {"alg":"none"} with the claims and no signature.
    let unsigned = format!(
        "Bearer {}.{}.",
        base64_url_free(br#"{"alg":"none","typ":"JWT"}"#),
        base64_url_free(format!(r#"{{"sub":"alice","exp":{}}}"#, now() + 3600).as_bytes())
    );
    for (what, bad) in [
        ("forged", forged.as_str()),
        ("expired", expired.as_str()),
        ("without sub", no_subject.as_str()),
        ("unsigned", unsigned.as_str()),
        ("not a JWT", "Bearer not-a-token"),
        ("Basic", "Basic YWxpY2U6cGFzcw=="),
    ] {
        let reply = post(gateway.addr, "jwt-1", bad).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{what}: {reply:?}");
        assert_eq!(
            reply.code().as_deref(),
            Some("idempotency_tenant_invalid"),
            "{what}"
        );
    }
    assert_eq!(upstream.runs(), 2, "a refused token reached the upstream");
    // Unkeyed requests are not the gateway's to authenticate.
    let unkeyed = Request::post(format!("http://{}/orders", gateway.addr))
        .header("authorization", "Bearer not-a-token")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    assert_eq!(send(&client(), unkeyed).await.status, StatusCode::CREATED);
}

/// `--tenant-jwt-leeway` and `--tenant-jwt-claim`: a token expired (or
/// not yet valid) by less than the leeway is accepted, by more refused;
/// the tenant is the named claim, so two subjects of one organisation are
/// one caller.
#[tokio::test]
async fn jwt_leeway_and_the_tenant_claim() {
    let secret = b"the issuer's HMAC secret, 32 bytes or more";
    let files = Files::new();
    let keys = files.write("hmac.key", secret);
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(
        &origin,
        &[
            "--tenant-jwt-keys",
            &keys,
            "--tenant-jwt-claim",
            "org",
            "--tenant-jwt-leeway",
            "60s",
        ],
    )
    .await;
    let signing = EncodingKey::from_secret(secret);
    let signed = |claims: serde_json::Value| token(&signing, Algorithm::HS256, None, &claims);
    // Inside the leeway: expired 20 s ago, valid from 20 s on.
    let late = signed(serde_json::json!({ "sub": "alice", "org": "acme", "exp": now() - 20 }));
    let early = signed(
        serde_json::json!({ "sub": "bob", "org": "acme", "nbf": now() + 20, "exp": now() + 3600 }),
    );
    let first = post(gateway.addr, "lee-1", &late).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // Another subject of the same `org` is the same tenant: a replay.
    let again = post(gateway.addr, "lee-1", &early).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    // Another organisation is another tenant.
    let other = signed(serde_json::json!({ "sub": "alice", "org": "globex", "exp": now() + 3600 }));
    let other = post(gateway.addr, "lee-1", &other).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    // Outside the leeway, or without the claim: refused.
    for (what, claims) in [
        (
            "expired past the leeway",
            serde_json::json!({ "org": "acme", "exp": now() - 120 }),
        ),
        (
            "not valid before the leeway",
            serde_json::json!({ "org": "acme", "nbf": now() + 120, "exp": now() + 3600 }),
        ),
        (
            "without the claim",
            serde_json::json!({ "sub": "acme", "exp": now() + 3600 }),
        ),
    ] {
        let reply = post(gateway.addr, "lee-1", &signed(claims)).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{what}");
        assert_eq!(
            reply.code().as_deref(),
            Some("idempotency_tenant_invalid"),
            "{what}"
        );
    }
    assert_eq!(upstream.runs(), 2);
}

/// An Ed25519 public key in PEM verifies EdDSA tokens; a token signed by
/// another Ed25519 key is refused.
#[tokio::test]
async fn jwt_with_an_ed25519_key() {
    let files = Files::new();
    let openssl = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .current_dir(&files.0)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !openssl(&["genpkey", "-algorithm", "ed25519", "-out", "ed.pem"]) {
        idem_tests::redis_server::skip_or_fail("openssl");
        return;
    }
    assert!(openssl(&[
        "pkey",
        "-in",
        "ed.pem",
        "-pubout",
        "-out",
        "ed.pub.pem"
    ]));
    assert!(openssl(&[
        "genpkey",
        "-algorithm",
        "ed25519",
        "-out",
        "other.pem"
    ]));
    let read = |name: &str| std::fs::read(files.0.join(name)).expect("key");
    let signing = EncodingKey::from_ed_pem(&read("ed.pem")).expect("Ed25519 key");
    let other = EncodingKey::from_ed_pem(&read("other.pem")).expect("Ed25519 key");
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let public = files.0.join("ed.pub.pem").display().to_string();
    let gateway = start_gateway(&origin, &["--tenant-jwt-keys", &public]).await;
    let claims = serde_json::json!({ "sub": "dave", "exp": now() + 3600 });
    let good = token(&signing, Algorithm::EdDSA, None, &claims);
    assert_eq!(
        post(gateway.addr, "ed", &good).await.status,
        StatusCode::CREATED
    );
    assert!(post(gateway.addr, "ed", &good).await.replayed());
    let forged = post(
        gateway.addr,
        "ed",
        &token(&other, Algorithm::EdDSA, None, &claims),
    )
    .await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED);
    assert_eq!(forged.code().as_deref(), Some("idempotency_tenant_invalid"));
    assert_eq!(upstream.runs(), 1);
}

/// Base64url without padding, for the hand-made unsigned token.
fn base64_url_free(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// Keys as an EC or RSA public key in PEM, and as a JWKS document whose
/// `kid` picks the key.
#[tokio::test]
async fn jwt_keys_from_a_pem_file_and_a_jwks_document() {
    let files = Files::new();
    let private = files.0.join("ec.pem");
    let public = files.0.join("ec.pub.pem");
    let generated = std::process::Command::new("openssl")
        .args([
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
        ])
        .arg(&private)
        .status();
    if !generated.is_ok_and(|s| s.success()) {
        idem_tests::redis_server::skip_or_fail("openssl");
        return;
    }
    let exported = std::process::Command::new("openssl")
        .args(["ec", "-pubout", "-in"])
        .arg(&private)
        .arg("-out")
        .arg(&public)
        .output()
        .expect("openssl ec");
    assert!(exported.status.success());
    // openssl writes SEC1; the encoder wants PKCS#8.
    let pkcs8 = std::process::Command::new("openssl")
        .args(["pkcs8", "-topk8", "-nocrypt", "-in"])
        .arg(&private)
        .output()
        .expect("openssl pkcs8");
    assert!(pkcs8.status.success());
    let signing = EncodingKey::from_ec_pem(&pkcs8.stdout).expect("EC key");

    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let public = public.display().to_string();
    let gateway = start_gateway(&origin, &["--tenant-jwt-keys", &public]).await;
    let claims = serde_json::json!({ "sub": "carol", "exp": now() + 3600 });
    let good = token(&signing, Algorithm::ES256, None, &claims);
    assert_eq!(
        post(gateway.addr, "ec", &good).await.status,
        StatusCode::CREATED
    );
    assert!(post(gateway.addr, "ec", &good).await.replayed());
    // An HMAC token "signed" with the public key's text is refused.
    let confused = token(
        &EncodingKey::from_secret(&std::fs::read(&public).expect("pem")),
        Algorithm::HS256,
        None,
        &claims,
    );
    assert_eq!(
        post(gateway.addr, "ec", &confused).await.status,
        StatusCode::UNAUTHORIZED
    );

    // An RSA public key in PEM: RS256 tokens verify.
    let rsa_private = files.0.join("rsa.pem");
    let rsa_public = files.0.join("rsa.pub.pem");
    let made = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&rsa_private)
        .status()
        .expect("openssl genpkey");
    assert!(made.success());
    let exported = std::process::Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&rsa_private)
        .arg("-out")
        .arg(&rsa_public)
        .status()
        .expect("openssl pkey");
    assert!(exported.success());
    let rsa_signing =
        EncodingKey::from_rsa_pem(&std::fs::read(&rsa_private).expect("rsa key")).expect("RSA key");
    let rsa_public = rsa_public.display().to_string();
    let gateway = start_gateway(&origin, &["--tenant-jwt-keys", &rsa_public]).await;
    let erin = token(
        &rsa_signing,
        Algorithm::RS256,
        None,
        &serde_json::json!({ "sub": "erin", "exp": now() + 3600 }),
    );
    assert_eq!(
        post(gateway.addr, "rsa", &erin).await.status,
        StatusCode::CREATED
    );
    assert!(post(gateway.addr, "rsa", &erin).await.replayed());

    // A JWKS document with two symmetric keys: the kid picks one.
    let jwks = serde_json::json!({ "keys": [
        { "kty": "oct", "kid": "old", "alg": "HS256", "k": base64_url_free(b"the old key of the issuer, 32 bytes+") },
        { "kty": "oct", "kid": "new", "alg": "HS256", "k": base64_url_free(b"the new key of the issuer, 32 bytes+") },
    ]});
    let jwks = files.write("keys.json", jwks.to_string().as_bytes());
    let gateway = start_gateway(&origin, &["--tenant-jwt-keys", &jwks]).await;
    let dave = serde_json::json!({ "sub": "dave", "exp": now() + 3600 });
    let by_old = token(
        &EncodingKey::from_secret(b"the old key of the issuer, 32 bytes+"),
        Algorithm::HS256,
        Some("old"),
        &dave,
    );
    let by_new = token(
        &EncodingKey::from_secret(b"the new key of the issuer, 32 bytes+"),
        Algorithm::HS256,
        Some("new"),
        &dave,
    );
    let wrong_kid = token(
        &EncodingKey::from_secret(b"the new key of the issuer, 32 bytes+"),
        Algorithm::HS256,
        Some("old"),
        &dave,
    );
    assert_eq!(
        post(gateway.addr, "jwks", &by_old).await.status,
        StatusCode::CREATED
    );
    assert!(post(gateway.addr, "jwks", &by_new).await.replayed());
    assert_eq!(
        post(gateway.addr, "jwks", &wrong_kid).await.status,
        StatusCode::UNAUTHORIZED
    );
}

/// Every key and every field Redis holds, as text.
/// The Redis key of the record with scope `hash` (the gateway's default
/// prefix).
fn record_key(hash: idem_core::ScopeHash) -> String {
    format!("idem:{{{hash}}}")
}

/// Whether Redis holds a record under scope `hash`.
fn stored_under(redis: &RedisServer, hash: idem_core::ScopeHash) -> bool {
    redis.cli(&["EXISTS", &record_key(hash)]).trim() == "1"
}

fn redis_contents(server: &RedisServer) -> Vec<String> {
    let mut out = Vec::new();
    for key in server.cli(&["--scan"]).lines().filter(|k| !k.is_empty()) {
        out.push(key.to_owned());
        // A hash's fields, or a string record (format 3) whole.
        let read = if server.cli(&["TYPE", key]).trim() == "string" {
            "GET"
        } else {
            "HGETALL"
        };
        out.push(server.cli(&["--no-raw", read, key]));
        out.push(server.cli(&["--raw", read, key]));
    }
    out
}

fn sha256_hex(value: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(value))
}

/// With Basic auth, nothing in Redis is a value a dictionary can reverse:
/// not the credential, its parts, or a plain SHA-256 of any of them, with a
/// configured secret or the generated one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_record_field_is_an_unkeyed_hash_of_a_credential() {
    let Some((redis, _upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let password = "hunter2";
    let basic = "YWxpY2U6aHVudGVyMg=="; // alice:hunter2
    let authorization = format!("Basic {basic}");
    let url = redis.url();
    for flags in [
        vec![
            "--store",
            url.as_str(),
            "--tenant-secret",
            "a deployment secret of the test",
        ],
        // A generated secret: another identity, which must take the store.
        vec!["--store", url.as_str(), "--replace-store-identity"],
    ] {
        let gateway = start_gateway(&origin, &flags).await;
        let key = format!("basic-{}", flags.len());
        assert_eq!(
            post(gateway.addr, &key, &authorization).await.status,
            StatusCode::CREATED
        );
    }
    let contents = redis_contents(&redis).join("\n");
    assert!(
        contents.contains("auth:"),
        "no tenant found in:\n{contents}"
    );
    let forbidden = [
        authorization.clone(),
        basic.to_owned(),
        password.to_owned(),
        "alice:hunter2".to_owned(),
        sha256_hex(authorization.as_bytes()),
        sha256_hex(format!("basic {basic}").as_bytes()),
        sha256_hex(basic.as_bytes()),
        sha256_hex(b"alice:hunter2"),
        sha256_hex(password.as_bytes()),
    ];
    for value in &forbidden {
        assert!(
            !contents.to_lowercase().contains(&value.to_lowercase()),
            "Redis holds {value:?}:\n{contents}"
        );
    }
}

/// With `--keyed-scopes`, a gateway on Redis stores each record under the
/// keyed hash of its scope (HMAC-SHA256 under a key derived from the
/// tenant secret) and under no unkeyed one; another gateway with the same
/// secret replays it. One without the flag is refused; made to take the
/// store over, it does not find the record and runs the request again
/// (why every gateway on a store must agree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_scopes_hide_where_records_live() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let secret = "a deployment secret of the test";
    let common = ["--store", url.as_str(), "--tenant-header", "x-tenant"];
    let keyed_flags = [&common[..], &["--tenant-secret", secret, "--keyed-scopes"]].concat();
    let keyed = start_gateway(&origin, &keyed_flags).await;
    let order = |addr| acme_order(addr, "keyed-1", r#"{"sku":"book"}"#);
    let first = send(&client(), order(keyed.addr)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(upstream.runs(), 1);

    let scope_secret = idem_gateway::scope_secret(secret.as_bytes());
    let keyed_hash = idem_core::ScopeHash::keyed(&scope_secret, "acme", "POST /orders", "keyed-1");
    let unkeyed_hash = idem_core::ScopeHash::of("acme", "POST /orders", "keyed-1");
    assert!(
        stored_under(&redis, keyed_hash),
        "{:?}",
        redis_contents(&redis)
    );
    assert!(!stored_under(&redis, unkeyed_hash));

    let again = start_gateway(&origin, &keyed_flags).await;
    let replay = send(&client(), order(again.addr)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);

    let unkeyed_flags = [&common[..], &["--tenant-secret", secret]].concat();
    let refused = try_start(&origin, &unkeyed_flags).await;
    assert!(refused.is_err(), "an unkeyed gateway joined a keyed store");
    let replacing = [&unkeyed_flags[..], &["--replace-store-identity"]].concat();
    let unkeyed = start_gateway(&origin, &replacing).await;
    let ran = send(&client(), order(unkeyed.addr)).await;
    assert_eq!(ran.status, StatusCode::CREATED);
    assert!(!ran.replayed());
    assert_eq!(upstream.runs(), 2);
    assert!(stored_under(&redis, unkeyed_hash));
}

/// `--blake3-fingerprints` writes BLAKE3 fingerprints and both kinds of
/// gateway read both: gateways with and without it share a Redis (no
/// identity to refuse), a retry moving between them replays whichever
/// wrote the record, and another payload is a conflict either way. The
/// upstream runs once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blake3_fingerprints_and_sha256_ones_share_a_store() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let common = ["--store", url.as_str(), "--tenant-header", "x-tenant"];
    let sha = start_gateway(&origin, &common).await;
    let blake_flags = [&common[..], &["--blake3-fingerprints"]].concat();
    let blake = start_gateway(&origin, &blake_flags).await;
    let stored = |key: &str| {
        let hash = idem_core::ScopeHash::of("acme", "POST /orders", key);
        redis.record_field(&record_key(hash), "fp")
    };
    let body = r#"{"sku":"book","n":1}"#;
    let expected = |format| idem_tests::layer_suite::orders_fingerprint(format, body).to_hex();
    use idem_layer::fingerprint::FingerprintFormat::{Blake3, Sha256};
    for (runs, (writer, reader, format, key)) in [
        (sha.addr, blake.addr, Sha256, "fmt-1"),
        (blake.addr, sha.addr, Blake3, "fmt-2"),
    ]
    .into_iter()
    .enumerate()
    {
        let first = send(&client(), acme_order(writer, key, body)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}");
        assert_eq!(upstream.runs(), runs + 1);
        assert_eq!(stored(key).trim(), expected(format), "{key}");
        let retry = send(
            &client(),
            acme_order(reader, key, r#"{"n":1, "sku":"book"}"#),
        )
        .await;
        assert!(retry.replayed(), "{key}: {retry:?}");
        assert_eq!(retry.body, first.body);
        let changed = send(&client(), acme_order(reader, key, r#"{"sku":"pen","n":1}"#)).await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY, "{key}");
        assert_eq!(upstream.runs(), runs + 1);
    }
}

/// `--blake3-scopes` stores each record under the BLAKE3 hash of its
/// scope (keyed with `--keyed-scopes`); another gateway with the same
/// flags replays it, and one hashing scopes with SHA-256 is refused the
/// store (it would not find the record and would run the request again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blake3_scopes_are_claimed_like_keyed_ones() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let secret = "a deployment secret of the test";
    let common = ["--store", url.as_str(), "--tenant-header", "x-tenant"];
    let flags = [
        &common[..],
        &[
            "--tenant-secret",
            secret,
            "--keyed-scopes",
            "--blake3-scopes",
        ],
    ]
    .concat();
    let first_gateway = start_gateway(&origin, &flags).await;
    let order = |addr| acme_order(addr, "b3-1", r#"{"sku":"book"}"#);
    let first = send(&client(), order(first_gateway.addr)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let scope_secret = idem_gateway::scope_secret(secret.as_bytes());
    let hash = idem_core::ScopeHash::blake3_keyed(&scope_secret, "acme", "POST /orders", "b3-1");
    assert!(stored_under(&redis, hash), "{:?}", redis_contents(&redis));
    assert!(!stored_under(
        &redis,
        idem_core::ScopeHash::keyed(&scope_secret, "acme", "POST /orders", "b3-1")
    ));

    let again = start_gateway(&origin, &flags).await;
    let replay = send(&client(), order(again.addr)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);

    let sha_flags = [&common[..], &["--tenant-secret", secret, "--keyed-scopes"]].concat();
    let refused = try_start(&origin, &sha_flags).await;
    assert!(refused.is_err(), "a SHA-256 gateway joined a BLAKE3 store");
    assert_eq!(upstream.runs(), 1);
}

/// `--blake3-tenants` stores each caller as the keyed BLAKE3 hash of its
/// normalized `Authorization` value (so under another scope than the HMAC
/// form's); another gateway with the same flags replays the record, and
/// one hashing tenants with HMAC-SHA256 is refused the store (it would not
/// find the record and would run the request again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blake3_tenants_are_claimed_like_blake3_scopes() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let secret = "a deployment secret of the test";
    let hmac_flags = ["--store", url.as_str(), "--tenant-secret", secret];
    let flags = [&hmac_flags[..], &["--blake3-tenants"]].concat();
    let first_gateway = start_gateway(&origin, &flags).await;
    let first = post(first_gateway.addr, "t3-1", "Bearer  abc").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let tenant = |hash| {
        idem_layer::TenantHasher::new(hash, secret.as_bytes()).tenant("auth:", b"bearer abc")
    };
    let scope = |hash| idem_core::ScopeHash::of(&tenant(hash), "POST /orders", "t3-1");
    assert!(
        stored_under(&redis, scope(idem_layer::TenantHash::Blake3)),
        "{:?}",
        redis_contents(&redis)
    );
    assert!(!stored_under(
        &redis,
        scope(idem_layer::TenantHash::HmacSha256)
    ));

    let again = start_gateway(&origin, &flags).await;
    let replay = post(again.addr, "t3-1", "bearer abc").await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.runs(), 1);

    let refused = try_start(&origin, &hmac_flags).await;
    assert!(
        refused.is_err(),
        "an HMAC-SHA256 gateway joined a BLAKE3-tenant store"
    );
    assert_eq!(upstream.runs(), 1);
}

/// A private Redis and a counting upstream for gateways to stand before
/// (`None`, after a notice, where `redis-server` is missing outside CI).
async fn redis_and_origin() -> Option<(RedisServer, Upstream, TestServer)> {
    let redis = RedisServer::spawn()?;
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    Some((redis, upstream, origin))
}

/// The gateway on Redis: the start or error of a gateway with these flags.
async fn try_start(
    origin: &TestServer,
    flags: &[&str],
) -> Result<idem_gateway::Started, idem_gateway::StartError> {
    let config = idem_tests::gateway_config(origin.addr, flags);
    let (started, stop, _task) = idem_gateway::start(config).await?;
    std::mem::forget(stop);
    Ok(started)
}

/// Gateways that derive tenants or scopes differently cannot share a
/// Redis: the first claims it (a marker living as long as the retention),
/// and one with another tenant secret, another tenant source or other
/// scope hashing refuses to start, since a retry moving between them would
/// run again. With tenants from a header and unkeyed scopes the secret
/// still keys the fingerprints and derives sealing key 0: another secret
/// is refused too (a genuine retry between them met 422, or 503 sealed).
/// `--replace-store-identity` takes the store over; the old settings are
/// then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_that_derive_tenants_differently_cannot_share_a_store() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let store = ["--store", url.as_str()];
    let with = |extra: &[&'static str]| -> Vec<&str> { [&store[..], extra].concat() };
    let first_flags = with(&["--tenant-secret", "the fleet's secret, 0001"]);
    let first = try_start(&origin, &first_flags)
        .await
        .expect("the first claims the store");
    let ttl: i64 = redis
        .cli(&["PTTL", "idem:identity"])
        .trim()
        .parse()
        .expect("ttl");
    let day: i64 = 24 * 3600 * 1000;
    assert!(ttl > day - 60_000 && ttl <= day, "identity TTL {ttl} ms");
    let created = post(first.addr, "fleet-1", "Bearer token-f").await;
    assert_eq!(created.status, StatusCode::CREATED);

    // The same settings join; their records are shared.
    let same = try_start(&origin, &first_flags)
        .await
        .expect("same settings start");
    assert!(
        post(same.addr, "fleet-1", "Bearer token-f")
            .await
            .replayed()
    );
    for (refused, why) in [
        (
            with(&["--tenant-secret", "another secret, 00000002"]),
            "another secret",
        ),
        (with(&[]), "a generated secret"),
        (
            with(&[
                "--tenant-secret",
                "the fleet's secret, 0001",
                "--keyed-scopes",
            ]),
            "keyed scopes",
        ),
        (
            with(&[
                "--tenant-secret",
                "the fleet's secret, 0001",
                "--tenant-header",
                "x-t",
            ]),
            "another tenant source",
        ),
    ] {
        let error = try_start(&origin, &refused).await.expect_err(why);
        assert!(
            error.to_string().contains("--replace-store-identity"),
            "{why}: {error}"
        );
    }
    assert_eq!(upstream.runs(), 1);

    // Header tenants with unkeyed scopes: the secret still keys the
    // fingerprints (and derives sealing key 0), so another one is refused.
    let other = RedisServer::spawn().expect("a second redis");
    let other_url = other.url();
    let header_fleet = |secret| {
        [
            "--store",
            other_url.as_str(),
            "--tenant-header",
            "x-t",
            "--tenant-secret",
            secret,
        ]
    };
    let header_first = try_start(&origin, &header_fleet("one secret of the header fleet"))
        .await
        .expect("the first of the header fleet");
    let error = try_start(&origin, &header_fleet("another secret of the fleet"))
        .await
        .expect_err("the secret keys the fingerprints");
    assert!(
        error.to_string().contains("--replace-store-identity"),
        "{error}"
    );
    drop(header_first);

    // Taking the store over; then the old settings are refused.
    let replacing = with(&[
        "--tenant-secret",
        "another secret, 00000002",
        "--replace-store-identity",
    ]);
    let taken = try_start(&origin, &replacing).await.expect("replaced");
    let ran = post(taken.addr, "fleet-1", "Bearer token-f").await;
    assert!(!ran.replayed(), "another secret is another tenant");
    assert_eq!(upstream.runs(), 2);
    let error = try_start(&origin, &first_flags)
        .await
        .expect_err("the old settings");
    assert!(
        error.to_string().contains("--replace-store-identity"),
        "{error}"
    );
}

/// One tenant floods the memory store: it is held to its quota (429 with
/// a Retry-After of about the retention), while another tenant's new keys
/// keep working.
#[tokio::test]
async fn a_flooding_tenant_leaves_other_tenants_working() {
    let upstream = Upstream::default();
    let origin = TestServer::start(upstream.router()).await;
    let gateway = start_gateway(&origin, &["--memory-capacity", "100", "--retention", "1h"]).await;
    let mut quota_hits = 0;
    for n in 0..40 {
        let reply = post(gateway.addr, &format!("flood-{n}"), "Bearer flood").await;
        match reply.status {
            StatusCode::CREATED => {}
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(reply.code().as_deref(), Some("idempotency_quota_exceeded"));
                let wait: u64 = reply
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .expect("Retry-After");
                assert!((3500..=3600).contains(&wait), "Retry-After {wait}");
                quota_hits += 1;
            }
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    // The default quota is a tenth of the capacity.
    assert_eq!(quota_hits, 30);
    assert_eq!(upstream.runs(), 10);
    // Counted as quota refusals, not as a store failing (an alert on store
    // errors must not fire for one busy tenant).
    let metrics = send(
        &client(),
        Request::get(format!("http://{}/metrics", gateway.addr))
            .body(Full::new(Bytes::new()))
            .expect("request"),
    )
    .await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.contains("idem_requests_total{outcome=\"quota_exceeded\"} 30\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idem_requests_total{outcome=\"store_error\"} 0\n"),
        "{metrics}"
    );
    for n in 0..10 {
        let reply = post(gateway.addr, &format!("calm-{n}"), "Bearer calm").await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
}

/// A gateway that started while its store was down claims the store at
/// the first refresh that reaches it: if gateways that derive identities
/// otherwise hold it then, it refuses every keyed request from then on
/// (`503`, nothing run), as its start would have been refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_at_start_is_claimed_and_checked_when_it_answers() {
    use idem_tests::cutter::ReplyCutter;
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    // Another fleet's identity on the store.
    redis.cli(&["SET", "idem:identity", "v2:another-fleet", "PX", "600000"]);
    let cutter = ReplyCutter::start(([127, 0, 0, 1], redis.port).into()).await;
    cutter.refuse_new_connections(true);
    let url = format!("redis://{}", cutter.addr);
    // Retention 8 s: the claim is refreshed every 2 s.
    let gateway = try_start(
        &origin,
        &[
            "--store",
            &url,
            "--tenant-secret",
            "the fleet's secret, 0001",
            "--retention",
            "8s",
            "--lease",
            "2s",
            "--store-timeout",
            "500ms",
        ],
    )
    .await
    .expect("starts while its store is down");
    cutter.refuse_new_connections(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    loop {
        n += 1;
        let answer = post(gateway.addr, &format!("down-{n}"), "Bearer token-f").await;
        if answer.status == StatusCode::SERVICE_UNAVAILABLE
            && String::from_utf8_lossy(&answer.body).contains("derive record identities otherwise")
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never refused: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let runs = upstream.runs();
    for m in 0..5 {
        let refused = post(gateway.addr, &format!("after-{m}"), "Bearer token-f").await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(upstream.runs(), runs, "nothing runs once refused");
}

/// A rolling key rotation without a `503`: the new key is added as an
/// opening key (`--sealing-opening-keys`) on every gateway first; a
/// gateway that already seals with it (`--sealing-key`) stores answers
/// the others open. Without the opening key the other gateway cannot open
/// them (`503`), which is what the first step avoids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_key_rotation_opens_everywhere_at_every_step() {
    let Some((redis, upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let key = format!("2:{}", "ab".repeat(32));
    let secret = "the fleet's secret, 0001";
    let base = ["--store", url.as_str(), "--tenant-secret", secret];
    let sealing = try_start(&origin, &[&base[..], &["--sealing-key", &key]].concat())
        .await
        .expect("seals with key 2");
    let opening = try_start(
        &origin,
        &[&base[..], &["--sealing-opening-keys", &key]].concat(),
    )
    .await
    .expect("opens with key 2");
    let behind = try_start(&origin, &base).await.expect("not updated yet");
    let created = post(sealing.addr, "rotated-1", "Bearer token-r").await;
    assert_eq!(created.status, StatusCode::CREATED);
    let replayed = post(opening.addr, "rotated-1", "Bearer token-r").await;
    assert!(replayed.replayed(), "{replayed:?}");
    assert_eq!(replayed.body, created.body);
    let unopened = post(behind.addr, "rotated-1", "Bearer token-r").await;
    assert_eq!(unopened.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(upstream.runs(), 1);
}

/// The identity a gateway of the version before claimed (`v1:`, without
/// fingerprint keying), as that version computed it.
fn v1_identity(secret: &str) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(secret.as_bytes()).expect("key");
    mac.update(b"idem-gateway identity v1\ntenants authorization\nscopes unkeyed");
    let digest = mac.finalize().into_bytes();
    format!("v1:{}", hex::encode(&digest[..16]))
}

/// A store that holds this gateway's own identity as the version before
/// wrote it is upgraded at start (the marker becomes `v2:`); one that
/// holds another gateway's earlier identity is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_claimed_by_the_version_before_is_upgraded() {
    let Some((redis, _upstream, origin)) = redis_and_origin().await else {
        return;
    };
    let url = redis.url();
    let secret = "the fleet's secret, 0001";
    let flags = ["--store", url.as_str(), "--tenant-secret", secret];
    redis.cli(&["SET", "idem:identity", &v1_identity(secret), "PX", "600000"]);
    try_start(&origin, &flags)
        .await
        .expect("its own earlier identity");
    let held = redis.cli(&["GET", "idem:identity"]);
    assert!(held.trim().starts_with("v2:"), "{held}");

    redis.cli(&[
        "SET",
        "idem:identity",
        &v1_identity("another secret, 00000002"),
        "PX",
        "600000",
    ]);
    let error = try_start(&origin, &flags)
        .await
        .expect_err("another gateway's earlier identity");
    assert!(
        error.to_string().contains("--replace-store-identity"),
        "{error}"
    );
}
