//! The daemon's HTTP listeners: an accept loop with a connection cap, and per connection hyper
//! (HTTP/1.1 with upgrades for WebSockets, and HTTP/2 with prior knowledge, as `axum::serve`
//! served them) with a header-read timeout and an idle timeout, and the graceful stop
//! `axum::serve` had: on the stop signal no new connection is accepted, every open one is asked
//! to finish what it is doing and close, and `serve` returns when they all have.
//!
//! Why these bounds: every connection holds a descriptor and some memory. Without them a caller
//! that opens connections and sends nothing, or a request head one byte at a time (slowloris),
//! holds them forever, and about a thousand such connections exhaust the daemon's descriptors for
//! every tenant.
//!
//! - **Cap.** At most `max_connections` connections are open at once, counted by a semaphore
//!   whose permit lives with the socket (an upgraded WebSocket keeps its permit until it closes).
//!   Over the cap a new connection is accepted and closed at once rather than left in the
//!   kernel's backlog: the caller learns at once instead of hanging, the backlog never fills with
//!   an attacker's connections that would be served first when slots free, and the slot goes to
//!   whoever connects once one frees.
//! - **Header-read timeout.** A request head must arrive whole within `header_read_timeout` of
//!   the connection going idle (hyper's HTTP/1 timer, which also closes idle keep-alive
//!   connections after that long).
//! - **Idle timeout.** hyper's timer does not cover the first bytes (read before the protocol is
//!   known) nor HTTP/2, so each connection also has a watchdog: with no request in flight (a
//!   response streaming counts as in flight) for `header_read_timeout`, the connection is asked to
//!   close, and dropped if it is still idle one timeout later.
//! - **TLS.** On the HTTPS listener (`--tls-listen`, crate::tls_listen) the handshake runs in the
//!   connection's own task, holding its slot, and must finish within `header_read_timeout`; a
//!   peer that never finishes it is dropped. [`serve_api`] serves the API router on `--listen`
//!   and, when one was prepared, on the HTTPS listener too, with the same stop.
//! - **Peers.** A controller's peer listener ([`serve_peers`], `torpor controller
//!   --peer-listen`) serves the same router over mutual TLS to the other controllers only
//!   (torpor_cluster's `peer`): the handshake, also within `header_read_timeout`, refuses any
//!   client without a controller certificate of the trust domain, and every request on the
//!   connection is marked forwarded by the controller its certificate names (the one hop of
//!   torpor_api's `forward`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// The default header-read (and idle) timeout, `--header-read-timeout-ms`.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;

#[derive(Debug, Clone, Copy)]
pub struct ServeConfig {
    /// Connections open at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// How long a request head may take, and how long a connection may sit idle.
    pub header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` completes and every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: ServeConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    serve_on(listener, Handshake::Plain, app, cfg, stop).await
}

/// A controller's peer listener: `app` over mutual TLS to the other controllers of its
/// trust domain (crate docs, "Peers").
pub async fn serve_peers(
    listener: TcpListener,
    acceptor: torpor_cluster::PeerAcceptor,
    app: Router,
    cfg: ServeConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    serve_on(listener, Handshake::Peers(acceptor), app, cfg, stop).await
}

/// What a listener does with a new connection before HTTP.
enum Handshake {
    Plain,
    /// `--tls-listen`: the operator's certificate, no client certificate.
    Tls(tokio_rustls::TlsAcceptor),
    /// `--peer-listen`: mutual TLS, controllers only.
    Peers(torpor_cluster::PeerAcceptor),
}

/// The API listener: [`serve`] on `listener` (plain HTTP) and, when `--tls-listen` was
/// prepared (crate::tls_listen::prepare), the same router over HTTPS on that listener, both
/// stopped by `stop`; returns when both have.
pub async fn serve_api(
    listener: TcpListener,
    app: Router,
    cfg: ServeConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let Some(tls) = crate::tls_listen::take_prepared() else {
        return serve(listener, app, cfg, stop).await;
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        stop.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    tracing::info!(listen = %tls.addr, "HTTPS listener up");
    eprintln!("torpor: HTTPS on {} (--tls-listen)", tls.addr);
    let https = tokio::spawn(serve_on(
        tls.listener,
        Handshake::Tls(tls.acceptor),
        app.clone(),
        cfg,
        stopped(stop_rx.clone()),
    ));
    serve(listener, app, cfg, stopped(stop_rx)).await;
    let _ = https.await;
}

async fn serve_on(
    listener: TcpListener,
    handshake: Handshake,
    app: Router,
    cfg: ServeConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let local = listener
        .local_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    // The stop signal reaches every connection as the closing of this channel; each connection
    // task holds a `close_rx`, so `close_tx.closed()` is "every connection has ended".
    let (signal_tx, signal_rx) = watch::channel(());
    tokio::spawn(async move {
        stop.await;
        drop(signal_rx);
    });
    let (close_tx, close_rx) = watch::channel(());
    let mut refusals = Refusals::default();
    loop {
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_error(&local, e).await;
                    continue;
                }
            },
            _ = signal_tx.closed() => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(tcp);
            refusals.note(&local, cfg.max_connections);
            continue;
        };
        // No Nagle delay: E2B's streams (Connect) write small frames one after another, and a
        // frame held back for the client's delayed ACK costs up to 40 ms.
        let _ = tcp.set_nodelay(true);
        let held = Held {
            tcp,
            _permit: permit,
        };
        let conn = Conn {
            app: app.clone(),
            cfg,
            signal_tx: signal_tx.clone(),
            close_rx: close_rx.clone(),
        };
        match &handshake {
            Handshake::Plain => {
                tokio::spawn(serve_connection(TokioIo::new(held), remote, None, conn));
            }
            Handshake::Peers(acceptor) => {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let accept = acceptor.accept(held, remote);
                    let (stream, identity) =
                        match tokio::time::timeout(cfg.header_read_timeout, accept).await {
                            Ok(Some(accepted)) => accepted,
                            Ok(None) => return, // refused, logged and counted
                            Err(_) => {
                                acceptor.timed_out(remote);
                                return;
                            }
                        };
                    tracing::debug!(%remote, %identity, "a controller connected to the peer listener");
                    let by = HeaderValue::from_str(&identity.name.to_string()).ok();
                    serve_connection(TokioIo::new(stream), remote, by, conn).await
                });
            }
            Handshake::Tls(acceptor) => {
                let handshake = acceptor.accept(held);
                tokio::spawn(async move {
                    let stream =
                        match tokio::time::timeout(cfg.header_read_timeout, handshake).await {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%remote, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%remote, "TLS handshake timed out");
                                return;
                            }
                        };
                    serve_connection(TokioIo::new(stream), remote, None, conn).await
                });
            }
        }
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
}

/// What every connection of a listener is served with.
struct Conn {
    app: Router,
    cfg: ServeConfig,
    /// Closed on the stop signal.
    signal_tx: watch::Sender<()>,
    /// Held while the connection lives ("every connection has ended" is its channel closing).
    close_rx: watch::Receiver<()>,
}

/// Serves one connection. `forwarded_by`: the peer controller's name, set as every request's
/// `x-torpor-forwarded-by` (peer listener only).
async fn serve_connection<I>(
    io: TokioIo<I>,
    remote: SocketAddr,
    forwarded_by: Option<HeaderValue>,
    conn: Conn,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Conn {
        app,
        cfg,
        signal_tx,
        close_rx,
    } = conn;
    let activity = Arc::new(Activity::new());
    let service = Tracked {
        app,
        remote,
        forwarded_by,
        activity: activity.clone(),
    };
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout);
    let mut conn = pin!(builder.serve_connection_with_upgrades(io, service));
    let mut stopping = pin!(signal_tx.closed());
    let idle = cfg.header_read_timeout;
    let mut check_at = tokio::time::Instant::now() + idle;
    // Whether the connection was asked to close (stop signal or idle).
    let mut closing = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::trace!(%remote, error = %e, "connection ended");
                }
                break;
            }
            _ = &mut stopping, if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep_until(check_at) => {
                let now = tokio::time::Instant::now();
                match activity.idle_for() {
                    None => check_at = now + idle,
                    Some(d) if d >= idle => {
                        if closing {
                            // Asked to close a while ago and still idle (a peer that never
                            // finishes its preface, an HTTP/2 peer ignoring GOAWAY): drop it.
                            break;
                        }
                        tracing::debug!(%remote, "closing an idle connection");
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                        check_at = now + idle;
                    }
                    Some(d) => check_at = now + (idle - d),
                }
            }
        }
    }
    drop(close_rx);
}

/// Logs refusals over the cap at most once a second, with how many there were.
#[derive(Default)]
struct Refusals {
    since_log: u64,
    last_log: Option<Instant>,
}

impl Refusals {
    fn note(&mut self, listener: &str, cap: usize) {
        self.since_log += 1;
        let logged_recently =
            matches!(self.last_log, Some(t) if t.elapsed() < Duration::from_secs(1));
        if !logged_recently {
            tracing::warn!(
                listener,
                max_connections = cap,
                refused = self.since_log,
                "connection cap reached; closing new connections (--max-connections)"
            );
            self.since_log = 0;
            self.last_log = Some(Instant::now());
        }
    }
}

async fn accept_error(listener: &str, e: std::io::Error) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    // Most likely EMFILE/ENFILE: the pending connection stays queued and accept would fail
    // again at once, so wait a little for descriptors to free.
    tracing::error!(listener, error = %e, "cannot accept a connection");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Requests in flight on one connection and when it was last active.
struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    last_active_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_active_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.touch();
        InFlight(self.clone())
    }

    /// How long the connection has had no request in flight; `None` while one is.
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_active_ms.load(Ordering::Relaxed));
        Some(self.start.elapsed().saturating_sub(last))
    }
}

/// One request in flight, from its head to the end of its response body.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The router as hyper's service, counting requests in flight and giving handlers the peer's
/// address (`ConnectInfo`, as `into_make_service_with_connect_info` would).
#[derive(Clone)]
struct Tracked {
    app: Router,
    remote: SocketAddr,
    forwarded_by: Option<HeaderValue>,
    activity: Arc<Activity>,
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        let in_flight = self.activity.begin();
        req.extensions_mut().insert(ConnectInfo(self.remote));
        if let Some(by) = &self.forwarded_by {
            req.headers_mut()
                .insert(torpor_api::forward::FORWARDED_BY, by.clone());
        }
        let mut app = self.app.clone();
        Box::pin(async move {
            let resp = tower_service::Service::call(&mut app, req).await?;
            Ok(resp.map(|body| {
                Body::new(Guarded {
                    body,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// A response body that keeps its request counted as in flight until it is sent or dropped.
struct Guarded {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// An accepted socket holding its slot under the connection cap.
struct Held {
    tcp: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for Held {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A hang guard for reads the server must end; far above any timeout used here.
    const GUARD: Duration = Duration::from_secs(60);

    struct Server {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<()>,
    }

    async fn start(max_connections: usize, header_read_timeout: Duration) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "ok" })).route(
            "/slow",
            get(|| async {
                // Two chunks with a pause between them longer than the idle timeouts used.
                let chunks = futures::stream::iter([0u8, 1]).then(|i| async move {
                    if i == 1 {
                        tokio::time::sleep(Duration::from_millis(600)).await;
                    }
                    Ok::<_, Infallible>(Bytes::from(format!("chunk{i};")))
                });
                Body::from_stream(chunks)
            }),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let cfg = ServeConfig {
            max_connections,
            header_read_timeout,
        };
        let task = tokio::spawn(serve(listener, app, cfg, async {
            let _ = stopped.await;
        }));
        Server {
            addr,
            stop: Some(stop),
            task,
        }
    }

    async fn get_body(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(GUARD, s.read_to_end(&mut out))
            .await
            .expect("the response ends")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Whether the server closed the connection (EOF or reset) rather than answering.
    async fn closed_by_server(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(GUARD, s.read(&mut buf))
            .await
            .expect("the server ends the connection")
        {
            Ok(0) | Err(_) => true,
            Ok(_) => false,
        }
    }

    /// A TLS server with a certificate for `*.tls.test` (and the client config trusting it).
    async fn start_tls(header_read_timeout: Duration) -> (Server, Arc<rustls::ClientConfig>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["*.tls.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        let certs = Arc::new(crate::tls_listen::CertSource::load(&c, &k).unwrap());
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(certs.server_config()));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let cfg = ServeConfig {
            max_connections: 16,
            header_read_timeout,
        };
        let task = tokio::spawn(serve_on(
            listener,
            Handshake::Tls(acceptor),
            app,
            cfg,
            async {
                let _ = stopped.await;
            },
        ));
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let srv = Server {
            addr,
            stop: Some(stop),
            task,
        };
        (srv, Arc::new(client))
    }

    #[tokio::test]
    async fn tls_serves_requests_and_drops_a_client_that_never_finishes_its_handshake() {
        let (srv, client) = start_tls(Duration::from_millis(200)).await;
        let tcp = TcpStream::connect(srv.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("8080-sb-x.tls.test").unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(client)
            .connect(name, tcp)
            .await
            .unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        tls.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(GUARD, tls.read_to_end(&mut out))
            .await
            .expect("the answer ends");
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.starts_with("HTTP/1.1 200") && out.ends_with("ok"),
            "{out}"
        );
        // Silent, and half a ClientHello: both closed after the timeout.
        let mut silent = TcpStream::connect(srv.addr).await.unwrap();
        let mut partial = TcpStream::connect(srv.addr).await.unwrap();
        partial.write_all(&[0x16, 0x03, 0x01, 0x02]).await.unwrap();
        assert!(closed_by_server(&mut silent).await);
        assert!(closed_by_server(&mut partial).await);
        // Plain HTTP gets no HTTP answer.
        let body = get_body(srv.addr, "/").await;
        assert!(!body.starts_with("HTTP/1.1"), "{body:?}");
    }

    #[tokio::test]
    async fn over_the_cap_a_connection_is_closed_at_once_and_a_freed_slot_serves_again() {
        let srv = start(2, Duration::from_secs(3600)).await;
        let held_a = TcpStream::connect(srv.addr).await.unwrap();
        let _held_b = TcpStream::connect(srv.addr).await.unwrap();
        // Accepted in order: the third finds both slots taken.
        let mut third = TcpStream::connect(srv.addr).await.unwrap();
        assert!(closed_by_server(&mut third).await);
        drop(held_a);
        // The slot frees once the server has seen the close; until then new ones are refused.
        let mut answered = false;
        for _ in 0..200 {
            let body = get_body(srv.addr, "/").await;
            if body.starts_with("HTTP/1.1 200") {
                assert!(body.ends_with("ok"), "{body}");
                answered = true;
                break;
            }
            assert!(body.is_empty(), "refused connections get no answer: {body}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(answered, "a freed slot serves again");
    }

    #[tokio::test]
    async fn a_silent_connection_a_slow_header_and_an_idle_keep_alive_are_closed() {
        let srv = start(16, Duration::from_millis(200)).await;
        let mut silent = TcpStream::connect(srv.addr).await.unwrap();
        let mut partial = TcpStream::connect(srv.addr).await.unwrap();
        partial.write_all(b"GET / HTTP/1.1\r\nHo").await.unwrap();
        let mut preface = TcpStream::connect(srv.addr).await.unwrap();
        preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let mut kept = TcpStream::connect(srv.addr).await.unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 12];
        kept.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        for (what, s) in [
            ("silent", &mut silent),
            ("partial header", &mut partial),
            ("partial HTTP/2 preface", &mut preface),
        ] {
            assert!(closed_by_server(s).await, "{what} connection closed");
        }
        // The kept-alive one: the rest of its response, then the close.
        let mut rest = Vec::new();
        tokio::time::timeout(GUARD, kept.read_to_end(&mut rest))
            .await
            .expect("the idle keep-alive connection is closed")
            .unwrap();
        assert!(String::from_utf8_lossy(&rest).ends_with("ok"));
        assert!(get_body(srv.addr, "/").await.ends_with("ok"));
    }

    #[tokio::test]
    async fn a_response_streaming_longer_than_the_idle_timeout_is_not_cut() {
        let srv = start(16, Duration::from_millis(200)).await;
        let body = get_body(srv.addr, "/slow").await;
        assert!(
            body.contains("chunk0;") && body.contains("chunk1;"),
            "{body}"
        );
    }

    #[tokio::test]
    async fn the_stop_closes_idle_connections_lets_calls_finish_and_returns() {
        let mut srv = start(16, Duration::from_secs(3600)).await;
        let mut idle = TcpStream::connect(srv.addr).await.unwrap();
        idle.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 12];
        idle.read_exact(&mut head).await.unwrap();
        let mut slow = TcpStream::connect(srv.addr).await.unwrap();
        slow.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        while !String::from_utf8_lossy(&got).contains("chunk0;") {
            let mut buf = [0u8; 256];
            let n = slow.read(&mut buf).await.unwrap();
            assert!(n > 0, "the slow call answers");
            got.extend_from_slice(&buf[..n]);
        }
        srv.stop.take().unwrap().send(()).unwrap();
        let mut rest = Vec::new();
        tokio::time::timeout(GUARD, idle.read_to_end(&mut rest))
            .await
            .expect("the idle connection is closed on stop")
            .unwrap();
        tokio::time::timeout(GUARD, slow.read_to_end(&mut got))
            .await
            .expect("the call in flight ends, then its connection")
            .unwrap();
        assert!(
            String::from_utf8_lossy(&got).contains("chunk1;"),
            "the call in flight finished"
        );
        tokio::time::timeout(GUARD, srv.task)
            .await
            .expect("serve returns once every connection has closed")
            .unwrap();
        assert!(
            TcpStream::connect(srv.addr).await.is_err(),
            "no longer listening"
        );
    }
}
