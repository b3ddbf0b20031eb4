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
        let task = tokio::spawn({
            let (armed, cuts) = (Arc::clone(&armed), Arc::clone(&cuts));
            let (refusing, target) = (Arc::clone(&refusing), Arc::clone(&target));
            let moved = Arc::clone(&moved);
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
            task,
        }
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
}

async fn pipe(mut client: TcpStream, mut server: TcpStream, ends: Ends) {
    let Ends { armed, cuts, moved } = ends;
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
                    if client.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}
