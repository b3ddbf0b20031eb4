//! What the gateway tells the upstream about the client (`X-Forwarded-*`
//! or RFC 7239 `Forwarded`), and `Expect: 100-continue` for keyed and
//! unkeyed requests, over real sockets.

use axum::{Router, http::HeaderMap, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idem_tests::{TestServer, client, send, start_gateway};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// An upstream that answers 201 with the forwarding headers it got.
async fn echo() -> TestServer {
    TestServer::start(Router::new().route(
        "/orders",
        post(|headers: HeaderMap| async move {
            let get = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned()
            };
            (
                StatusCode::CREATED,
                serde_json::json!({
                    "x-forwarded-for": get("x-forwarded-for"),
                    "x-forwarded-proto": get("x-forwarded-proto"),
                    "x-forwarded-host": get("x-forwarded-host"),
                    "forwarded": get("forwarded"),
                    "host": get("host"),
                })
                .to_string(),
            )
        }),
    ))
    .await
}

async fn seen(gateway: std::net::SocketAddr, extra: (&str, &str)) -> serde_json::Value {
    let request = Request::post(format!("http://{gateway}/orders"))
        .header("host", "shop.example:8080")
        .header(extra.0, extra.1)
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    let reply = send(&client(), request).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    serde_json::from_slice(&reply.body).expect("json")
}

#[tokio::test]
async fn x_forwarded_headers_by_default() {
    let upstream = echo().await;
    let gateway = start_gateway(&upstream, &[]).await;
    let got = seen(gateway.addr, ("x-forwarded-for", "203.0.113.9")).await;
    assert_eq!(got["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(got["x-forwarded-proto"], "http");
    assert_eq!(got["x-forwarded-host"], "shop.example:8080");
    assert_eq!(got["forwarded"], "");
    // The upstream is addressed by its own host and port, never the
    // client's `Host`.
    assert_eq!(got["host"], upstream.addr.to_string());
    // Without one from the client, the gateway's alone.
    let fresh = seen(gateway.addr, ("x-unrelated", "1")).await;
    assert_eq!(fresh["x-forwarded-for"], "127.0.0.1");
}

#[tokio::test]
async fn rfc_7239_forwarded_when_chosen() {
    let upstream = echo().await;
    let gateway = start_gateway(&upstream, &["--forwarded", "forwarded"]).await;
    let got = seen(gateway.addr, ("forwarded", "for=198.51.100.17")).await;
    assert_eq!(
        got["forwarded"],
        "for=198.51.100.17, for=127.0.0.1;proto=http;host=\"shop.example:8080\""
    );
    assert_eq!(got["x-forwarded-for"], "");
    let fresh = seen(gateway.addr, ("x-unrelated", "1")).await;
    assert_eq!(
        fresh["forwarded"],
        "for=127.0.0.1;proto=http;host=\"shop.example:8080\""
    );
    let none = start_gateway(&upstream, &["--forwarded", "none"]).await;
    let got = seen(none.addr, ("x-unrelated", "1")).await;
    assert_eq!(got["x-forwarded-for"], "");
    assert_eq!(got["forwarded"], "");
}

/// A client that sends `Expect: 100-continue` gets `100 Continue` before it
/// sends the body, keyed or not, and then the final answer.
#[tokio::test]
async fn expect_100_continue_keyed_and_unkeyed() {
    let upstream = echo().await;
    let gateway = start_gateway(&upstream, &[]).await;
    for key in [
        "Idempotency-Key: expect-1\r\nAuthorization: Bearer a\r\n",
        "",
    ] {
        let stream = tokio::net::TcpStream::connect(gateway.addr)
            .await
            .expect("connect");
        let mut stream = BufReader::new(stream);
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: x\r\n{key}Content-Type: application/json\r\n\
             Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        );
        stream
            .get_mut()
            .write_all(head.as_bytes())
            .await
            .expect("head");
        let mut line = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_line(&mut line),
        )
        .await
        .expect("an interim answer in time")
        .expect("read");
        assert!(line.starts_with("HTTP/1.1 100"), "{key:?}: {line:?}");
        let mut blank = String::new();
        stream.read_line(&mut blank).await.expect("read");
        stream.get_mut().write_all(b"{}").await.expect("body");
        let mut rest = vec![0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), stream.read(&mut rest))
            .await
            .expect("a final answer in time")
            .expect("read");
        let text = String::from_utf8_lossy(&rest[..n]);
        assert!(text.starts_with("HTTP/1.1 201"), "{key:?}: {text}");
    }
}
