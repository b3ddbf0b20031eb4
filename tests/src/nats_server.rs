//! A private `nats-server` with JetStream for tests, on a free loopback
//! port, its storage in a temporary directory; killed on drop. A missing
//! binary fails in CI and skips elsewhere.

use std::{
    io::Read,
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::redis_server::{binary_available, free_port};

/// One `nats-server -js` process.
#[derive(Debug)]
pub struct NatsServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl NatsServer {
    /// Starts a server, or `None` when `nats-server` is not installed
    /// (outside CI).
    pub fn spawn() -> Option<Self> {
        if !binary_available("nats-server") {
            return None;
        }
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("idem-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        let server = Self { port, child, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // A ready server greets every connection with INFO.
            if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let mut greeting = [0u8; 4];
                if stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO" {
                    return Some(server);
                }
            }
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Every message of the JetStream stream `stream` on the server at `url`,
/// in stream order: its message id (`Nats-Msg-Id`, which each must carry)
/// and its payload.
pub async fn stream_messages(url: &str, stream: &str) -> Vec<(String, bytes::Bytes)> {
    let client = async_nats::connect(url).await.expect("nats");
    let jetstream = async_nats::jetstream::new(client);
    let mut stream = jetstream.get_stream(stream).await.expect("stream");
    let state = stream.info().await.expect("info").state.clone();
    let mut messages = Vec::new();
    if state.messages == 0 {
        return messages;
    }
    for seq in state.first_sequence..=state.last_sequence {
        let message = stream.get_raw_message(seq).await.expect("message");
        let id = message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .expect("a message id")
            .as_str()
            .to_owned();
        messages.push((id, message.payload));
    }
    messages
}
