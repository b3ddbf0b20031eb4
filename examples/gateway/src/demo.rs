//! The built-in demo upstream: the `axum-orders` API, without the layer, on
//! an ephemeral loopback port, so the gateway works out of the box.

use axum::http::Uri;

/// The running demo upstream; stops when dropped.
pub(crate) struct Demo {
    pub(crate) uri: Uri,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) async fn start() -> std::io::Result<Demo> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum_orders::orders();
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "demo upstream stopped");
        }
    });
    let uri = format!("http://{addr}")
        .parse()
        .map_err(std::io::Error::other)?;
    Ok(Demo { uri, task })
}
