//! torpor's side of the agent channel: a connection over a container's stdin and stdout.
//!
//! One task reads replies and routes each to the request that waits for it, by id; writers share
//! the stdin pipe under a lock, one whole frame at a time. When the container goes away the reader
//! sees EOF, every waiting request gets [`ConnError::Closed`], and [`AgentConn::closed`] fires.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

use crate::proto::{self, FrameError, Header, Reply, Request};

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("the sandbox's agent is gone")]
    Closed,
    #[error("agent channel")]
    Frame(#[from] FrameError),
}

type Routes = Arc<Mutex<HashMap<u64, mpsc::Sender<(Reply, Vec<u8>)>>>>;

pub struct AgentConn {
    writer: tokio::sync::Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
    routes: Routes,
    next_id: AtomicU64,
    closed: watch::Receiver<bool>,
    /// The protocol version the agent said hello with (0 until it has).
    version: std::sync::atomic::AtomicU32,
}

impl AgentConn {
    pub fn new(
        writer: impl AsyncWrite + Send + Unpin + 'static,
        reader: impl AsyncRead + Send + Unpin + 'static,
    ) -> Arc<Self> {
        Self::with_first_id(writer, reader, 1)
    }

    /// A connection whose request ids start at `first_id` (through a shim, which drops replies
    /// to lower ids: requests of an earlier daemon; see [`crate::shim`]).
    pub fn with_first_id(
        writer: impl AsyncWrite + Send + Unpin + 'static,
        reader: impl AsyncRead + Send + Unpin + 'static,
        first_id: u64,
    ) -> Arc<Self> {
        let routes: Routes = Arc::default();
        let (closed_tx, closed) = watch::channel(false);
        tokio::spawn(read_replies(reader, routes.clone(), closed_tx));
        Arc::new(AgentConn {
            writer: tokio::sync::Mutex::new(Box::new(writer)),
            routes,
            next_id: AtomicU64::new(first_id),
            closed,
            version: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// The protocol version the agent said hello with; 0 before its hello.
    pub fn agent_version(&self) -> u32 {
        self.version.load(Ordering::Relaxed)
    }

    pub fn set_agent_version(&self, v: u32) {
        self.version.store(v, Ordering::Relaxed);
    }

    /// Sends a request; replies to it arrive on the returned channel (several for a streamed
    /// exec, one otherwise). The channel ends when the agent goes away.
    pub async fn send(
        &self,
        req: &Request,
        body: &[u8],
    ) -> Result<mpsc::Receiver<(Reply, Vec<u8>)>, ConnError> {
        if *self.closed.borrow() {
            return Err(ConnError::Closed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = proto::encode(id, req, body)?;
        let (tx, rx) = mpsc::channel(64);
        self.routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        let mut w = self.writer.lock().await;
        let written = async {
            w.write_all(&frame).await?;
            w.flush().await
        }
        .await;
        if written.is_err() {
            self.routes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            return Err(ConnError::Closed);
        }
        Ok(rx)
    }

    /// Sends a request and waits for its one reply.
    pub async fn call(&self, req: &Request, body: &[u8]) -> Result<(Reply, Vec<u8>), ConnError> {
        let mut rx = self.send(req, body).await?;
        rx.recv().await.ok_or(ConnError::Closed)
    }

    /// Resolves once the agent's channel has closed.
    pub async fn closed(&self) {
        let mut c = self.closed.clone();
        let _ = c.wait_for(|closed| *closed).await;
    }

    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }
}

async fn read_replies(
    mut reader: impl AsyncRead + Unpin,
    routes: Routes,
    closed: watch::Sender<bool>,
) {
    let result: Result<(), FrameError> = async {
        loop {
            let mut prefix = [0u8; 8];
            if let Err(e) = reader.read_exact(&mut prefix).await {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    return Ok(());
                }
                return Err(e.into());
            }
            let (hlen, blen) = proto::parse_prefix(prefix)?;
            let mut header = vec![0u8; hlen];
            reader.read_exact(&mut header).await?;
            let mut body = vec![0u8; blen];
            reader.read_exact(&mut body).await?;
            let header: Header<Reply> = match serde_json::from_slice(&header) {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "agent sent a malformed reply; dropped");
                    continue;
                }
            };
            let tx = {
                let mut routes = routes.lock().unwrap_or_else(|p| p.into_inner());
                let last = !matches!(header.msg, Reply::Output { .. } | Reply::Spawned { .. });
                if last {
                    routes.remove(&header.id)
                } else {
                    routes.get(&header.id).cloned()
                }
            };
            if let Some(tx) = tx {
                // A caller that gave up has dropped its receiver; that is fine.
                let _ = tx.send((header.msg, body)).await;
            }
        }
    }
    .await;
    if let Err(e) = result {
        tracing::warn!(error = %e, "agent channel broken");
    }
    let _ = closed.send(true);
    routes.lock().unwrap_or_else(|p| p.into_inner()).clear();
}
