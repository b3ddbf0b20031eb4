//! The gateway's own paths, by property: generated spellings of every
//! gateway-owned path (under the configured records prefix, `/healthz`,
//! `/metrics`), with percent-escapes of any byte (reserved ones such as
//! `%2F` included, escaped twice too), dot segments, doubled and trailing
//! slashes, `\`, `;parameters`, other letter cases, raw non-ASCII and query
//! strings, sent as raw request targets to a gateway in front of a
//! recording upstream. Whatever reads as a gateway-owned path is answered
//! by the gateway and never forwarded; and no forwarded request carries the
//! gateway's credentials (the admin token, the operator cookie).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{Router, extract::Request, http::StatusCode};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ADMIN_TOKEN: &str = "the-admin-token-of-this-test";
const OPERATOR_COOKIE: &str = "idem_operator=0123456789abcdef";

/// What the upstream received: the raw path and query, and the headers
/// that could carry a gateway credential.
#[derive(Debug, Clone)]
struct Received {
    target: String,
    cookies: Vec<String>,
    admin_token: Option<String>,
    body: Vec<u8>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Received>>>);

impl Recorder {
    fn count(&self) -> usize {
        self.0.lock().expect("recorder").len()
    }

    fn last(&self) -> Option<Received> {
        self.0.lock().expect("recorder").last().cloned()
    }
}

async fn upstream(recorder: Recorder) -> SocketAddr {
    let app = Router::new().fallback(move |request: Request| {
        let recorder = recorder.clone();
        async move {
            let (parts, body) = request.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20)
                .await
                .unwrap_or_default();
            let text = |v: &http::HeaderValue| String::from_utf8_lossy(v.as_bytes()).into_owned();
            recorder.0.lock().expect("recorder").push(Received {
                target: parts.uri.to_string(),
                cookies: parts.headers.get_all("cookie").iter().map(text).collect(),
                // Under any name a server could read as the admin header.
                admin_token: parts
                    .headers
                    .iter()
                    .find(|(name, _)| name.as_str().replace('_', "-") == "x-idem-admin-token")
                    .map(|(_, value)| text(value)),
                body: body.to_vec(),
            });
            (StatusCode::CREATED, [("x-from-upstream", "1")], "upstream")
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// One request with a raw target; the status and whether the upstream's
/// marker came back.
async fn send(gateway: SocketAddr, method: &str, target: &[u8]) -> (u16, bool) {
    let mut stream = tokio::net::TcpStream::connect(gateway)
        .await
        .expect("connect");
    let body = format!("token={ADMIN_TOKEN}");
    let mut request = Vec::new();
    request.extend_from_slice(method.as_bytes());
    request.push(b' ');
    request.extend_from_slice(target);
    request.extend_from_slice(
        format!(
            " HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\nauthorization: Bearer caller\r\n\
             idempotency-key: k-{}\r\ncookie: theme=dark; {OPERATOR_COOKIE}; lang=en\r\n\
             x-idem-admin-token: {ADMIN_TOKEN}\r\n\
             content-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n\r\n{body}",
            uuid::Uuid::new_v4(),
            body.len()
        )
        .as_bytes(),
    );
    stream.write_all(&request).await.expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        stream.read_to_end(&mut answer),
    )
    .await
    .expect("the gateway answers");
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (
        status,
        text.to_ascii_lowercase().contains("x-from-upstream: 1"),
    )
}

/// One way of writing a byte of a path.
#[derive(Debug, Clone, Copy)]
enum Spelling {
    Plain,
    Upper,
    Escaped { lower_hex: bool },
    EscapedTwice,
}

fn spell(byte: u8, how: Spelling, out: &mut Vec<u8>) {
    match how {
        Spelling::Plain => out.push(byte),
        Spelling::Upper => out.push(byte.to_ascii_uppercase()),
        Spelling::Escaped { lower_hex } => {
            let escaped = format!("%{byte:02X}");
            out.extend(
                if lower_hex {
                    escaped.to_ascii_lowercase()
                } else {
                    escaped
                }
                .bytes(),
            );
        }
        Spelling::EscapedTwice => out.extend(format!("%25{byte:02X}").bytes()),
    }
}

/// A change to the path's segments that reads the same.
#[derive(Debug, Clone)]
enum Detour {
    None,
    DoubledSlash,
    Dot,
    UpAndBack(String),
    Parameter,
    Backslash,
}

fn spelling() -> impl Strategy<Value = Spelling> {
    prop_oneof![
        6 => Just(Spelling::Plain),
        1 => Just(Spelling::Upper),
        2 => any::<bool>().prop_map(|lower_hex| Spelling::Escaped { lower_hex }),
        1 => Just(Spelling::EscapedTwice),
    ]
}

fn detour() -> impl Strategy<Value = Detour> {
    prop_oneof![
        6 => Just(Detour::None),
        1 => Just(Detour::DoubledSlash),
        1 => Just(Detour::Dot),
        1 => "[a-z]{1,5}".prop_map(Detour::UpAndBack),
        1 => Just(Detour::Parameter),
        1 => Just(Detour::Backslash),
    ]
}

/// The longest path respelled.
const LONGEST: usize = 40;

/// How a path is respelled: each byte its own way, each segment boundary
/// with its own detour, maybe a trailing slash and a query.
#[derive(Debug, Clone)]
struct Respelling {
    spellings: Vec<Spelling>,
    detours: Vec<Detour>,
    trailing: bool,
    query: Option<String>,
}

fn respelling() -> impl Strategy<Value = Respelling> {
    (
        proptest::collection::vec(spelling(), LONGEST),
        proptest::collection::vec(detour(), LONGEST),
        any::<bool>(),
        proptest::option::of("[a-z=&%0-9]{0,12}"),
    )
        .prop_map(|(spellings, detours, trailing, query)| Respelling {
            spellings,
            detours,
            trailing,
            query,
        })
}

/// `path` as `how` spells it.
fn respell(path: &str, how: &Respelling) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, byte) in path.bytes().enumerate() {
        let spelling = how.spellings[i % LONGEST];
        if byte != b'/' {
            spell(byte, spelling, &mut out);
            continue;
        }
        // The target's first byte stays a plain `/`.
        if i == 0 {
            out.push(b'/');
            continue;
        }
        match &how.detours[i % LONGEST] {
            Detour::None => {}
            Detour::DoubledSlash => out.push(b'/'),
            Detour::Dot => out.extend(b"/."),
            Detour::UpAndBack(segment) => {
                out.push(b'/');
                out.extend(segment.bytes());
                out.extend(b"/..");
            }
            Detour::Parameter => out.extend(b";v=1"),
            Detour::Backslash => {
                out.push(b'\\');
                continue;
            }
        }
        // A slash escaped (`%2F`, `%252F`) reads as one too.
        spell(b'/', spelling, &mut out);
    }
    if how.trailing {
        out.push(b'/');
    }
    if let Some(query) = &how.query {
        out.push(b'?');
        out.extend(query.bytes());
    }
    out
}

struct Gateways {
    runtime: tokio::runtime::Runtime,
    recorder: Recorder,
    /// (gateway, its records prefix)
    gateways: Vec<(SocketAddr, &'static str)>,
}

fn gateways() -> Gateways {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let recorder = Recorder::default();
    let gateways = runtime.block_on(async {
        let up = upstream(recorder.clone()).await;
        let mut gateways = Vec::new();
        for (prefix, admin) in [
            ("/_idempotency", true),
            ("/ops/idem", false),
            ("/_idempotency", false),
        ] {
            let mut flags = vec!["--records-prefix", prefix];
            if admin {
                flags.extend(["--records-admin-token", ADMIN_TOKEN]);
            }
            let config = idem_tests::gateway_config(up, &flags);
            let (started, stop, _task) = idem_gateway::start(config).await.expect("gateway starts");
            std::mem::forget(stop);
            gateways.push((started.addr, prefix));
        }
        gateways
    });
    Gateways {
        runtime,
        recorder,
        gateways,
    }
}

/// The gateway-owned paths of a gateway whose records prefix is `prefix`.
fn owned_path() -> impl Strategy<Value = (usize, &'static str)> {
    prop_oneof![
        Just((0, "/records")),
        Just((0, "/operator")),
        Just((0, "/operator/sign-in")),
        Just((0, "/operator/release")),
        Just((0, "/operator/anything/else")),
        Just((0, "")),
        Just((0, "/not-a-route")),
        Just((1, "/healthz")),
        Just((1, "/metrics")),
    ]
}

#[test]
fn no_spelling_of_a_gateway_path_is_forwarded() {
    let setup = gateways();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    // The path under the prefix (or a path of its own), which gateway,
    // which method, and how the path is spelled.
    let strategy = (
        owned_path(),
        0..setup.gateways.len(),
        prop_oneof![Just("GET"), Just("POST"), Just("DELETE")],
        respelling(),
    );
    runner
        .run(&strategy, |((kind, rest), which, method, how)| {
            let (gateway, prefix) = setup.gateways[which];
            let path = if kind == 0 {
                format!("{prefix}{rest}")
            } else {
                rest.to_owned()
            };
            let target = respell(&path, &how);
            let before = setup.recorder.count();
            let (status, from_upstream) = setup.runtime.block_on(send(gateway, method, &target));
            let shown = String::from_utf8_lossy(&target).into_owned();
            prop_assert!(status != 0, "{method} {shown}: no answer");
            prop_assert!(
                !from_upstream && setup.recorder.count() == before,
                "{method} {shown} (reads as {path} on the gateway with prefix {prefix}) \
                 was forwarded: {status}, upstream saw {:?}",
                setup.recorder.last()
            );
            Ok(())
        })
        .expect("no gateway path is forwarded");
}

/// Upstream paths, some close to the gateway's: each is forwarded once,
/// stripped of the gateway's credentials and nothing else.
#[test]
fn forwarded_requests_carry_no_gateway_credential() {
    let setup = gateways();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 100,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let upstream_paths = prop_oneof![
        Just("/orders"),
        Just("/orders/_idempotency/records"),
        Just("/_idempotency-not/records"),
        Just("/healthz-not"),
        Just("/ops/idempotent"),
        Just("/v1/metrics/usage"),
    ];
    runner
        .run(
            &(
                upstream_paths,
                0..setup.gateways.len(),
                prop_oneof![Just("POST"), Just("GET")],
            ),
            |(path, which, method)| {
                let (gateway, _) = setup.gateways[which];
                let before = setup.recorder.count();
                let (status, from_upstream) =
                    setup
                        .runtime
                        .block_on(send(gateway, method, path.as_bytes()));
                prop_assert!(from_upstream, "{method} {path}: not forwarded ({status})");
                prop_assert_eq!(setup.recorder.count(), before + 1);
                let seen = setup.recorder.last().expect("seen");
                prop_assert_eq!(&seen.target, path);
                prop_assert_eq!(seen.admin_token, None);
                prop_assert_eq!(seen.cookies, vec!["theme=dark; lang=en".to_owned()]);
                prop_assert_eq!(seen.body, format!("token={ADMIN_TOKEN}").into_bytes());
                Ok(())
            },
        )
        .expect("no gateway credential is forwarded");
}

/// A raw non-ASCII byte in a target is refused by the gateway's HTTP
/// parser, never forwarded.
#[test]
fn raw_non_ascii_targets_are_not_forwarded() {
    let setup = gateways();
    for target in [&b"/_idempotency/rec\xc3\xb6rds"[..], b"/_idempotency/\xff"] {
        let before = setup.recorder.count();
        let (status, from_upstream) =
            setup
                .runtime
                .block_on(send(setup.gateways[0].0, "POST", target));
        assert!(!from_upstream, "{target:?} forwarded ({status})");
        assert_eq!(setup.recorder.count(), before);
    }
}

/// One request with raw header lines; what the upstream saw, if anything.
async fn send_raw(
    setup: &Gateways,
    gateway: SocketAddr,
    lines: &[&str],
) -> Option<(Vec<String>, Option<String>)> {
    let before = setup.recorder.count();
    let mut request = "POST /orders HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\
                       content-length: 0\r\n"
        .to_owned();
    for line in lines {
        request.push_str(line);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    let mut stream = tokio::net::TcpStream::connect(gateway)
        .await
        .expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    (setup.recorder.count() > before).then(|| {
        let seen = setup.recorder.last().expect("seen");
        (seen.cookies, seen.admin_token)
    })
}

/// Near misses of the gateway's credentials, as servers behind it might
/// still read them, never reach the upstream: the operator cookie's name
/// in another case, escaped, padded with a no-break space, after a `,`, in
/// `Cookie2`; the admin token under `x_idem_admin_token`. Other cookies
/// arrive intact, and several `Cookie` fields arrive joined into one.
#[test]
fn near_misses_of_the_gateways_credentials_never_reach_the_upstream() {
    let setup = gateways();
    let gateway = setup.gateways[0].0;
    let seen = |lines: &[&str]| {
        setup
            .runtime
            .block_on(send_raw(&setup, gateway, lines))
            .expect("forwarded")
    };
    for cookie in [
        "cookie: a=1; IDEM_OPERATOR=V; b=2",
        "cookie: a=1; Idem_Operator=V; b=2",
        "cookie: a=1, idem_operator=V; b=2",
        "cookie: a=1,idem_operator=V; b=2",
        "cookie: a=1; %69dem_operator=V; b=2",
        "cookie: a=1; idem_operator%3DV; b=2",
        "cookie: a=1;\u{a0}idem_operator=V; b=2",
    ] {
        let (cookies, _) = seen(&[cookie]);
        assert_eq!(cookies, ["a=1; b=2"], "{cookie}");
    }
    let (cookies, _) = seen(&["cookie: a=1", "cookie: b=2"]);
    assert_eq!(cookies, ["a=1; b=2"], "joined");
    let (_, admin) = seen(&["x_idem_admin_token: T"]);
    assert_eq!(admin, None);
}

/// A request with two `Host` headers, or an HTTP/1.1 request with none, is
/// answered `400 host_header_invalid` and never forwarded.
#[test]
fn a_missing_or_repeated_host_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let setup = gateways();
    let gateway = setup.gateways[0].0;
    for head in [
        "POST /orders HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\n",
        "POST /orders HTTP/1.1\r\n",
    ] {
        let before = setup.recorder.count();
        let answer = setup.runtime.block_on(async {
            let mut stream = tokio::net::TcpStream::connect(gateway)
                .await
                .expect("connect");
            let request = format!("{head}connection: close\r\ncontent-length: 0\r\n\r\n");
            stream.write_all(request.as_bytes()).await.expect("write");
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer).into_owned()
        });
        assert!(answer.starts_with("HTTP/1.1 400"), "{head:?}: {answer}");
        assert_eq!(setup.recorder.count(), before, "{head:?}: forwarded");
    }
}
