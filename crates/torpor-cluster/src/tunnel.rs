//! TCP connections to sandbox ports through the worker that runs the sandbox (`Node.Tunnel`):
//! how a controller's ingress proxy (and E2B host routing, and pools' HTTP dispatch) reaches a
//! sandbox on another machine. Nothing but the worker reaches a sandbox's ports; the worker
//! opens the connection from its router namespace, as it would for its own proxy.
//!
//! ```text
//!  controller (hyper)  ─ duplex ─▶ frames ═══ gRPC stream, mTLS ═══▶ worker ─ TCP ─▶ sandbox:port
//!                      ◀──────── frames ◀══════════════════════════        ◀──
//! ```
//!
//! Closing keeps the sandbox checkpointable, as on one machine (torpor_runtime::relay): the
//! worker holds the real connection and closes it the way the local proxy would: with a reset
//! when the sandbox closed first, else with its own FIN and a short drain. A half close travels
//! as a `close_write` frame; the controller ending the stream ends the connection.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use torpor_runtime::node::{PortIo, PortStream};

use crate::pb;

/// Bytes read at once on either side.
const CHUNK: usize = 32 * 1024;
/// Bytes buffered between hyper and the stream on the controller's side.
const DUPLEX: usize = 64 * 1024;
/// How long the worker waits for the sandbox's close after its own.
const DRAIN: Duration = Duration::from_secs(1);

fn data(bytes: &[u8]) -> pb::TunnelFrame {
    pb::TunnelFrame {
        data: bytes.to_vec(),
        ..Default::default()
    }
}

fn close_write() -> pb::TunnelFrame {
    pb::TunnelFrame {
        close_write: true,
        ..Default::default()
    }
}

/// The controller's end: a byte stream for hyper, whose bytes go to the worker as frames.
pub(crate) struct TunnelIo {
    io: DuplexStream,
    /// The worker said the sandbox closed before this side did.
    peer_closed_first: Arc<AtomicBool>,
}

impl AsyncRead for TunnelIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TunnelIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl PortIo for TunnelIo {
    fn peer_closed_first(&self) -> bool {
        self.peer_closed_first.load(Ordering::SeqCst)
    }
    /// The worker holds the connection and resets it itself when the sandbox closed first.
    fn reset_on_drop(&self) {}
}

/// The frames a tunnel sends to the worker, and the stream of them for the gRPC request; the
/// first frame names the container and the port.
pub(crate) fn outbound(
    container_id: &str,
    port: u16,
) -> (
    mpsc::Sender<pb::TunnelFrame>,
    ReceiverStream<pb::TunnelFrame>,
) {
    let (tx, rx) = mpsc::channel(16);
    let first = pb::TunnelFrame {
        container_id: container_id.to_string(),
        port: u32::from(port),
        ..Default::default()
    };
    // A fresh channel has room for the first frame.
    let _ = tx.try_send(first);
    (tx, ReceiverStream::new(rx))
}

/// Joins hyper's side to the worker's frames: `up` carries what hyper writes, `down` what the
/// worker sends. The gRPC request ends (and the worker closes the connection) once both ways
/// are closed, or hyper dropped its end.
pub(crate) fn controller_end(
    up: mpsc::Sender<pb::TunnelFrame>,
    mut down: Streaming<pb::TunnelFrame>,
) -> PortStream {
    let (mine, theirs) = tokio::io::duplex(DUPLEX);
    let peer_closed_first = Arc::new(AtomicBool::new(false));
    let flag = peer_closed_first.clone();
    tokio::spawn(async move {
        let (mut rd, mut wr) = tokio::io::split(theirs);
        let mut buf = vec![0u8; CHUNK];
        let (mut up_done, mut down_done) = (false, false);
        while !(up_done && down_done) {
            tokio::select! {
                n = rd.read(&mut buf), if !up_done => match n {
                    Ok(n) if n > 0 => {
                        if up.send(data(&buf[..n])).await.is_err() {
                            break;
                        }
                    }
                    // hyper shut its side down or dropped it.
                    _ => {
                        up_done = true;
                        let _ = up.send(close_write()).await;
                    }
                },
                frame = down.message(), if !down_done => match frame {
                    Ok(Some(f)) => {
                        if !f.data.is_empty() && wr.write_all(&f.data).await.is_err() {
                            break; // hyper dropped its end
                        }
                        if f.close_write {
                            if !up_done {
                                flag.store(true, Ordering::SeqCst);
                            }
                            down_done = true;
                            let _ = wr.shutdown().await;
                        }
                    }
                    _ => break, // the worker went away: hyper reads an end
                },
            }
        }
        // Dropping `up` ends the request stream: the worker closes the connection.
    });
    Box::new(TunnelIo {
        io: mine,
        peer_closed_first,
    })
}

/// The worker's end: `io` is the connection to the sandbox's port; frames from the controller
/// are written to it, what it sends goes back as frames. Closes it as the local proxy would.
pub(crate) async fn worker_end(
    mut io: PortStream,
    first_data: Vec<u8>,
    mut inbound: Streaming<pb::TunnelFrame>,
    out: mpsc::Sender<Result<pb::TunnelFrame, Status>>,
) {
    if !first_data.is_empty() && io.write_all(&first_data).await.is_err() {
        return;
    }
    let mut buf = vec![0u8; CHUNK];
    let (mut up_done, mut down_done) = (false, false);
    loop {
        tokio::select! {
            // Until the controller ends the stream (also once both ways are closed).
            frame = inbound.message() => match frame {
                Ok(Some(f)) if !up_done => {
                    if !f.data.is_empty() && io.write_all(&f.data).await.is_err() {
                        break;
                    }
                    if f.close_write {
                        up_done = true;
                        let _ = io.shutdown().await;
                    }
                }
                Ok(Some(_)) => {} // nothing may follow a close_write
                // The controller is done with the connection (or gone).
                _ => break,
            },
            n = io.read(&mut buf), if !down_done => match n {
                Ok(n) if n > 0 => {
                    if out.send(Ok(data(&buf[..n]))).await.is_err() {
                        break;
                    }
                }
                _ => {
                    down_done = true;
                    if out.send(Ok(close_write())).await.is_err() {
                        break;
                    }
                }
            },
        }
    }
    if io.peer_closed_first() {
        io.reset_on_drop();
        return;
    }
    let _ = io.shutdown().await;
    let _ = tokio::time::timeout(DRAIN, async {
        while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}
