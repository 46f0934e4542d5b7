//! TCP between a sandbox and the world without leaving endpoints that block its checkpoint.
//!
//! gVisor (this runsc build) refuses to checkpoint a sandbox whose network stack holds any TCP
//! endpoint other than a listener, and the refused checkpoint stops the container. Two kinds of
//! endpoint outlive the program that made them:
//!
//! - an open connection (an HTTP client's keep-alive pool, a database connection);
//! - the 60 s TIME_WAIT left on the side that closed first.
//!
//! torpor owns the other end of every TCP connection a sandbox has: the ingress proxy's
//! connections (crates/torpor-api/src/proxy.rs) and, through [`EgressRelay`], every outbound
//! one (the router namespace redirects the sandbox's TCP to a listener of the relay, which
//! connects to the original destination). Holding the other end, torpor can leave nothing
//! behind:
//!
//! - when the sandbox closed first, torpor answers its FIN with a RST instead of a FIN
//!   ([`PeerCloseAware`]); a RST in FIN-WAIT-2 closes the endpoint at once, so there is no
//!   TIME_WAIT (the data torpor sent before is acknowledged first);
//! - when torpor closes first, the sandbox is the passive closer and ends in CLOSED;
//! - when both close at once (the FINs cross), the router's nftables turn torpor's ACK of the
//!   sandbox's FIN into a RST (`CT_BOTH_FIN` in crate::net), which gVisor takes in CLOSING or
//!   LAST-ACK but would ignore in TIME_WAIT;
//! - before a checkpoint, [`EgressRelay::reset_all`] resets every connection still open: the
//!   program sees `ECONNRESET`, as after any network move, and reconnects after its wake.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::oneshot;

/// The relay's port on the router namespace's sandbox-side address.
pub const RELAY_PORT: u16 = 15001;

/// Default for [`set_max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

static MAX_CONNECTIONS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// How many relayed TCP connections one sandbox may have open at once (`torpor up
/// --max-sandbox-connections`; once, at daemon start). A connection over it is reset as soon as
/// it is accepted, so a sandbox holds at most this many connections' descriptors (two each) in
/// the daemon.
pub fn set_max_connections(n: usize) {
    let _ = MAX_CONNECTIONS.set(n.max(1));
}

fn max_connections() -> usize {
    *MAX_CONNECTIONS.get_or_init(|| DEFAULT_MAX_CONNECTIONS)
}

/// Makes the next close of `fd` send a RST instead of a FIN (SO_LINGER with a zero timeout).
pub fn set_reset_on_close(fd: RawFd) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a valid linger.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes sent on `fd` that the peer has not acknowledged yet (SIOCOUTQ).
fn unacked(fd: RawFd) -> io::Result<i32> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (== SIOCOUTQ) writes one int.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    if rc == 0 {
        Ok(n)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A stream to a sandbox that answers the sandbox's close with a RST when the sandbox closed
/// first (see the module doc): on end of stream before our own shutdown, the socket is set to
/// reset on close, and our shutdown becomes a no-op (a FIN now would put the sandbox in
/// TIME_WAIT).
pub struct PeerCloseAware {
    inner: TcpStream,
    we_shut: bool,
    peer_closed_first: bool,
}

impl PeerCloseAware {
    pub fn new(inner: TcpStream) -> PeerCloseAware {
        PeerCloseAware {
            inner,
            we_shut: false,
            peer_closed_first: false,
        }
    }

    /// Whether the sandbox closed before we did.
    pub fn peer_closed_first(&self) -> bool {
        self.peer_closed_first
    }

    /// Resets the connection when dropped, whoever closed.
    pub fn reset_on_drop(&self) {
        let _ = set_reset_on_close(self.inner.as_raw_fd());
    }

    /// Waits (up to `limit`) until the peer acknowledged everything sent: a RST discards what
    /// is still queued.
    pub async fn flushed(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while unacked(self.inner.as_raw_fd()).is_ok_and(|n| n > 0)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl AsyncRead for PeerCloseAware {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let eof = buf.filled().len() == before && buf.remaining() > 0;
            if eof && !self.we_shut && !self.peer_closed_first {
                self.peer_closed_first = true;
                let _ = set_reset_on_close(self.inner.as_raw_fd());
            }
        }
        r
    }
}

impl AsyncWrite for PeerCloseAware {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.peer_closed_first {
            return Poll::Ready(Ok(()));
        }
        self.we_shut = true;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Runs `f` on a thread inside the network namespace at `ns` (sockets made there stay in it).
fn in_netns<T: Send>(ns: &Path, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(ns)?;
            // SAFETY: setns on this short-lived thread only; it ends right after `f`.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    })
}

/// A new non-blocking TCP socket owned by the caller.
fn tcp_socket() -> io::Result<std::net::TcpStream> {
    // SAFETY: plain socket(2); the fd is wrapped at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    Ok(unsafe { std::net::TcpStream::from_raw_fd(fd) })
}

/// Where a redirected connection was going (SO_ORIGINAL_DST).
fn original_dst(s: &TcpStream) -> io::Result<SocketAddrV4> {
    // SAFETY: sockaddr_in is plain data; the kernel fills at most `len` bytes.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

struct Conn {
    kill: oneshot::Sender<()>,
    done: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    conns: Mutex<HashMap<u64, Conn>>,
    next: AtomicU64,
    tx: AtomicU64,
    rx: AtomicU64,
    opened: AtomicU64,
    /// Connections reset because the sandbox had [`max_connections`] open already.
    over_cap: AtomicU64,
    /// Connections refused because they went to the host (crate::net::host_blocked).
    to_host: AtomicU64,
}

/// The relay of one worker: a listener in the router namespace that the sandbox's outbound TCP
/// is redirected to, and one task per connection. Policy is enforced by nftables before the
/// redirect: only connections the policy allows reach the relay.
pub struct EgressRelay {
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

/// Traffic through the relay since the last reset (the sandbox's point of view: tx leaves it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub connections: u64,
    /// Reset at once: the sandbox had its most connections open.
    pub over_cap: u64,
    /// Refused: the destination is the host's (not listed by the operator).
    pub to_host: u64,
}

impl EgressRelay {
    /// Listens on `addr`:[`RELAY_PORT`] inside the router namespace `router_ns` (a path under
    /// /run/netns); outbound sockets are made there too, so they leave through the router.
    /// Its tasks run on `handle`.
    pub fn start(
        router_ns: &Path,
        addr: Ipv4Addr,
        handle: &tokio::runtime::Handle,
    ) -> io::Result<EgressRelay> {
        let std_listener = in_netns(router_ns, || {
            let l = std::net::TcpListener::bind(SocketAddr::from((addr, RELAY_PORT)))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })?;
        let listener = {
            let _g = handle.enter();
            TcpListener::from_std(std_listener)?
        };
        let shared = Arc::new(Shared::default());
        let ns = router_ns.to_path_buf();
        let accept = handle.spawn(accept_loop(listener, ns, shared.clone()));
        Ok(EgressRelay { shared, accept })
    }

    /// Resets every open connection (the sandbox sees `ECONNRESET`) and waits for them to end;
    /// returns how many there were.
    pub async fn reset_all(&self) -> usize {
        let conns: Vec<Conn> = {
            let mut m = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
            m.drain().map(|(_, c)| c).collect()
        };
        let n = conns.len();
        for c in conns {
            let _ = c.kill.send(());
            let _ = tokio::time::timeout(Duration::from_secs(2), c.done).await;
        }
        n
    }

    /// Resets every connection without waiting (the sandbox has left the worker).
    pub fn reset_now(&self) {
        let mut m = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        for (_, c) in m.drain() {
            let _ = c.kill.send(());
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    pub fn stats(&self) -> RelayStats {
        RelayStats {
            tx_bytes: self.shared.tx.load(Ordering::Relaxed),
            rx_bytes: self.shared.rx.load(Ordering::Relaxed),
            connections: self.shared.opened.load(Ordering::Relaxed),
            over_cap: self.shared.over_cap.load(Ordering::Relaxed),
            to_host: self.shared.to_host.load(Ordering::Relaxed),
        }
    }

    /// Counters back to zero (a new sandbox on the worker).
    pub fn reset_stats(&self) {
        for c in [
            &self.shared.tx,
            &self.shared.rx,
            &self.shared.opened,
            &self.shared.over_cap,
            &self.shared.to_host,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl Drop for EgressRelay {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_now();
    }
}

async fn accept_loop(listener: TcpListener, ns: PathBuf, shared: Arc<Shared>) {
    loop {
        let (sandbox, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "egress relay: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        if conns.len() >= max_connections() {
            drop(conns);
            // Reset at once: the descriptor is closed now, nothing is connected upstream.
            let n = shared.over_cap.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::info!(
                    open = max_connections(),
                    refused = n,
                    "egress relay: sandbox at its connection cap; resetting new connections"
                );
            }
            let _ = set_reset_on_close(sandbox.as_raw_fd());
            drop(sandbox);
            continue;
        }
        let id = shared.next.fetch_add(1, Ordering::Relaxed);
        shared.opened.fetch_add(1, Ordering::Relaxed);
        let (kill, killed) = oneshot::channel();
        let task_shared = shared.clone();
        let ns = ns.clone();
        let done = tokio::spawn(async move {
            relay_one(sandbox, &ns, killed, &task_shared).await;
            task_shared
                .conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        });
        conns.insert(id, Conn { kill, done });
    }
}

/// Connects to `dst` from a socket made inside the network namespace at `ns`.
pub(crate) async fn connect_in(ns: &Path, dst: SocketAddrV4) -> io::Result<TcpStream> {
    let ns = ns.to_path_buf();
    let std = tokio::task::spawn_blocking(move || in_netns(&ns, tcp_socket))
        .await
        .map_err(io::Error::other)??;
    let socket = TcpSocket::from_std_stream(std);
    tokio::time::timeout(Duration::from_secs(15), socket.connect(dst.into()))
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
}

async fn relay_one(sandbox: TcpStream, ns: &Path, killed: oneshot::Receiver<()>, shared: &Shared) {
    let _ = sandbox.set_nodelay(true);
    let mut s = PeerCloseAware::new(sandbox);
    let dst = match original_dst(&s.inner) {
        Ok(d) => d,
        Err(e) => {
            tracing::debug!(error = %e, "egress relay: no original destination");
            s.reset_on_drop();
            return;
        }
    };
    // The router's nftables drop these too; the relay checks for itself (the host's addresses
    // are read again every few seconds, the rules are not the only guard).
    if crate::net::host_blocked(dst) {
        shared.to_host.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%dst, "egress relay: destination is the host's; refused");
        s.reset_on_drop();
        return;
    }
    let mut u = match connect_in(ns, dst).await {
        Ok(u) => u,
        Err(e) => {
            // The sandbox's connect already succeeded (the relay answered): it sees a reset.
            tracing::debug!(%dst, error = %e, "egress relay: upstream connect failed");
            s.reset_on_drop();
            return;
        }
    };
    let _ = u.set_nodelay(true);
    tokio::select! {
        r = tokio::io::copy_bidirectional(&mut s, &mut u) => {
            if let Ok((tx, rx)) = r {
                shared.tx.fetch_add(tx, Ordering::Relaxed);
                shared.rx.fetch_add(rx, Ordering::Relaxed);
            }
            if s.peer_closed_first() {
                s.flushed(Duration::from_secs(2)).await;
            } else if r.is_err() {
                s.reset_on_drop();
            }
        }
        _ = killed => s.reset_on_drop(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The peer (standing in for the sandbox) closes first: it gets a RST, not a FIN, and the
    /// data sent before arrived.
    #[tokio::test]
    async fn a_peer_that_closes_first_is_answered_with_a_reset() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut s = PeerCloseAware::new(s);
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.unwrap();
            assert!(s.peer_closed_first());
            s.write_all(b"late").await.unwrap();
            s.shutdown().await.unwrap(); // a no-op: no FIN after the peer's
            s.flushed(Duration::from_secs(1)).await;
            buf
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        c.shutdown().await.unwrap();
        assert_eq!(server.await.unwrap(), b"hello");
        let mut got = Vec::new();
        let err = c.read_to_end(&mut got).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "got {got:?}");
    }

    /// We close first: a plain FIN, the peer reads to the end without error.
    #[tokio::test]
    async fn closing_first_is_a_plain_close() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut s = PeerCloseAware::new(s);
            s.write_all(b"bye").await.unwrap();
            s.shutdown().await.unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            assert!(!s.peer_closed_first());
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
    }
}
