//! Tracing spans carry the scope hash, never the raw key, and what the
//! handler logs is inside the request's span.

mod common;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::Full;
use idem_core::Scope;
use idem_memory::MemoryStore;
use tracing_subscriber::fmt::{MakeWriter, format::FmtSpan};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test]
async fn spans_name_the_scope_hash_not_the_key() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(captured.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let store = MemoryStore::new();
    let probe = Probe::default();
    let logging = tower::ServiceExt::map_request(inner(&probe), |request: Request<Full<Bytes>>| {
        tracing::info!("the handler runs");
        request
    });
    let svc = tower::Layer::layer(&layer(&store), logging);
    let secret = "card-4242-4242-secret-key";
    send(&svc, order(secret, "{}")).await;
    send(&svc, order(secret, "{}")).await;

    let output = String::from_utf8(captured.0.lock().expect("buffer").clone()).expect("utf8");
    let hash = Scope::new("t1", "POST /orders", secret.parse().expect("key"))
        .hash()
        .to_hex();
    assert!(
        output.contains(&hash),
        "the spans name the scope hash:\n{output}"
    );
    // The attempt is recorded on the span once it runs (the outcome after).
    let in_span = format!("idempotency{{scope={hash} operation=\"POST /orders\" attempt=1}}");
    let handler_lines: Vec<&str> = output
        .lines()
        .filter(|line| line.contains("the handler runs"))
        .collect();
    assert_eq!(handler_lines.len(), 1, "the handler ran once:\n{output}");
    assert!(
        handler_lines[0].contains(&in_span),
        "the handler's events are inside the request's span:\n{output}"
    );
    assert!(
        !output.contains(secret),
        "the raw key must never be logged:\n{output}"
    );
}
