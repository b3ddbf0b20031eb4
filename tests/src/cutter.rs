//! A TCP proxy on loopback that can swallow the next reply and drop the
//! connection: a reply lost after the server applied the command, as a
//! broken network does it; and that can move to another server, as a
//! virtual address moves to a promoted standby.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Notify,
};

/// The proxy; stops accepting on drop.
#[derive(Debug)]
pub struct ReplyCutter {
    /// Where clients connect.
    pub addr: SocketAddr,
    armed: Arc<AtomicBool>,
    refusing: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    target: Arc<Mutex<SocketAddr>>,
    moved: Arc<Notify>,
    version: Arc<Mutex<Option<(String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplyCutter {
    /// Proxies `127.0.0.1:0` to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let armed = Arc::new(AtomicBool::new(false));
        let refusing = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let target = Arc::new(Mutex::new(target));
        let moved = Arc::new(Notify::new());
        let version = Arc::new(Mutex::new(None));
        let task = tokio::spawn({
            let (armed, cuts) = (Arc::clone(&armed), Arc::clone(&cuts));
            let (refusing, target) = (Arc::clone(&refusing), Arc::clone(&target));
            let (moved, version) = (Arc::clone(&moved), Arc::clone(&version));
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if refusing.load(Ordering::SeqCst) {
                        // Closed at once: a server that cannot be reached.
                        drop(client);
                        continue;
                    }
                    let to = *target
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let Ok(server) = TcpStream::connect(to).await else {
                        continue;
                    };
                    let ends = Ends {
                        armed: Arc::clone(&armed),
                        cuts: Arc::clone(&cuts),
                        moved: Arc::clone(&moved),
                        version: version
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .clone(),
                    };
                    tokio::spawn(pipe(client, server, ends));
                }
            }
        });
        Self {
            addr,
            armed,
            refusing,
            cuts,
            target,
            moved,
            version,
            task,
        }
    }

    /// Connections made from now on report `reported` as the server's
    /// version where the server says `real` (`redis_version:<real>` in its
    /// replies, rewritten in place: the two must be as long), as an older
    /// server would: the real server answers everything else.
    pub fn report_version(&self, real: &str, reported: &str) {
        assert_eq!(real.len(), reported.len(), "a rewrite in place");
        *self
            .version
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((
            format!("redis_version:{real}"),
            format!("redis_version:{reported}"),
        ));
    }

    /// New connections go to `target` from now on, and the connections
    /// made before are closed: the address moved to another server.
    pub fn move_to(&self, target: SocketAddr) {
        *self
            .target
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = target;
        self.moved.notify_waiters();
    }

    /// The next reply from the server, on any connection, is dropped with
    /// its connection. Whatever the server answers next is cut: load the
    /// scripts under test first (a `NOSCRIPT` answer would be cut instead
    /// of the script's), and give the client a connection (a handshake's
    /// answer would be cut instead of the call's).
    pub fn cut_next_reply(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// While `refuse`, new connections are closed as soon as they are
    /// accepted (the connections already made go on).
    pub fn refuse_new_connections(&self, refuse: bool) {
        self.refusing.store(refuse, Ordering::SeqCst);
    }

    /// How many replies were cut.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for ReplyCutter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a connection's pipe shares with the proxy.
struct Ends {
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    moved: Arc<Notify>,
    /// The server's version as it is and as reported, when rewritten.
    version: Option<(String, String)>,
}

async fn pipe(mut client: TcpStream, mut server: TcpStream, ends: Ends) {
    let Ends {
        armed,
        cuts,
        moved,
        version,
    } = ends;
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    let moved = moved.notified();
    let mut moved = std::pin::pin!(moved);
    moved.as_mut().enable();
    loop {
        tokio::select! {
            () = moved.as_mut() => return,
            read = client.read(&mut up) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if server.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                }
            },
            read = server.read(&mut down) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if armed.swap(false, Ordering::SeqCst) {
                        cuts.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    if let Some((real, reported)) = &version {
                        rewrite(&mut down[..n], real.as_bytes(), reported.as_bytes());
                    }
                    if client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}

/// Replaces every `from` in `bytes` with `to`, as long as it.
fn rewrite(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    let mut at = 0;
    while let Some(found) = bytes[at..].windows(from.len()).position(|w| w == from) {
        let start = at + found;
        bytes[start..start + to.len()].copy_from_slice(to);
        at = start + to.len();
    }
}
