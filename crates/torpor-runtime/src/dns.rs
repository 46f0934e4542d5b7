//! The DNS responder networked sandboxes use (their /etc/resolv.conf names 169.254.0.1, which
//! each worker's router forwards to this responder): it answers the host names on the
//! querying sandbox's `hosts` list (exact names and `*.suffix` wildcards), resolving them with
//! the host's resolver, and adds the answers to that worker's allowed-address set before
//! replying, so the connection that follows is let through. A sandbox whose policy lets
//! unnamed destinations through (`full`, `"default": "allow"`) gets every name resolved.
//! Any other name is NXDOMAIN. Queries are told apart by their source address
//! (the worker's router address, unique per worker).
//!
//! A small hand-rolled responder: one question per query, A answers (AAAA and other types get
//! an empty NOERROR answer for an allowed name), no recursion of its own.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Adds resolved addresses to a worker's allowed set.
pub type AllowFn = Arc<dyn Fn(&[Ipv4Addr]) + Send + Sync>;

/// What one worker's sandbox may resolve, and how to open the door for an answer.
#[derive(Clone)]
pub struct DnsClient {
    /// Names (or `*.suffix` wildcards) whose addresses are added to the allowed set.
    pub hosts: Vec<String>,
    /// Resolve names not on `hosts` too (their addresses are not added).
    pub any_name: bool,
    /// Adds resolved addresses to the worker's allowed set (nftables).
    pub allow: AllowFn,
}

/// Turns a name into IPv4 addresses; blocking (the host's resolver is `getaddrinfo`).
pub trait Resolve: Send + Sync + 'static {
    fn resolve(&self, name: &str) -> Vec<Ipv4Addr>;
}

/// The host's own resolver.
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, name: &str) -> Vec<Ipv4Addr> {
        let mut out: Vec<Ipv4Addr> = (name, 0)
            .to_socket_addrs()
            .map(|it| {
                it.filter_map(|a| match a {
                    SocketAddr::V4(v4) => Some(*v4.ip()),
                    SocketAddr::V6(_) => None,
                })
                .collect()
            })
            .unwrap_or_default();
        out.sort();
        out.dedup();
        out
    }
}

/// How many lookups run at once, for one sandbox and for all, and how long a sandbox waits for
/// one. A lookup over either bound, or past the deadline, is answered SERVFAIL at once (the
/// sandbox's resolver retries); a lookup past its deadline keeps its places until the host's
/// resolver returns, so one sandbox's slow names hold at most `per_client` of the `total`.
#[derive(Debug, Clone, Copy)]
pub struct DnsLimits {
    pub total: usize,
    pub per_client: usize,
    pub timeout: Duration,
}

impl Default for DnsLimits {
    fn default() -> Self {
        DnsLimits {
            total: 64,
            per_client: 4,
            timeout: Duration::from_secs(4),
        }
    }
}

struct Responder {
    port: u16,
    clients: Mutex<HashMap<Ipv4Addr, DnsClient>>,
    resolver: Arc<dyn Resolve>,
    limits: DnsLimits,
    total: Arc<Semaphore>,
    per_client: Mutex<HashMap<Ipv4Addr, Arc<Semaphore>>>,
}

impl Responder {
    /// Serves `sock` on a thread of its own (with a small runtime whose blocking pool runs the
    /// lookups).
    fn start(
        sock: UdpSocket,
        resolver: Arc<dyn Resolve>,
        limits: DnsLimits,
    ) -> std::io::Result<Arc<Responder>> {
        let port = sock.local_addr()?.port();
        sock.set_nonblocking(true)?;
        let r = Arc::new(Responder {
            port,
            clients: Mutex::default(),
            resolver,
            limits,
            total: Arc::new(Semaphore::new(limits.total)),
            per_client: Mutex::default(),
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(limits.total.max(1))
            .thread_name("dns-lookup")
            .build()?;
        let served = r.clone();
        std::thread::Builder::new()
            .name("dns".into())
            .spawn(move || {
                rt.block_on(async move {
                    match tokio::net::UdpSocket::from_std(sock) {
                        Ok(sock) => served.serve(Arc::new(sock)).await,
                        Err(e) => tracing::warn!(error = %e, "dns responder cannot start"),
                    }
                })
            })?;
        Ok(r)
    }

    fn set_client(&self, router: Ipv4Addr, client: Option<DnsClient>) {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        match client {
            Some(c) => {
                clients.insert(router, c);
            }
            None => {
                clients.remove(&router);
                self.per_client
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&router);
            }
        }
    }

    async fn serve(self: Arc<Self>, sock: Arc<tokio::net::UdpSocket>) {
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                continue;
            };
            let SocketAddr::V4(from4) = from else {
                continue;
            };
            let client = self
                .clients
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(from4.ip())
                .cloned();
            // Unknown sources get no answer at all.
            let Some(client) = client else { continue };
            let q = buf[..n].to_vec();
            match plan(&q, &client) {
                None => {}
                Some(Plan::Answer(reply)) => {
                    let _ = sock.send_to(&reply, from).await;
                }
                Some(Plan::Lookup(name)) => self.lookup(*from4.ip(), name, q, client, &sock, from),
            }
        }
    }

    /// Starts one lookup in the blocking pool, or answers SERVFAIL when this sandbox (or
    /// everyone) has the most lookups running already.
    fn lookup(
        self: &Arc<Self>,
        source: Ipv4Addr,
        name: String,
        q: Vec<u8>,
        client: DnsClient,
        sock: &Arc<tokio::net::UdpSocket>,
        from: SocketAddr,
    ) {
        let mine = self
            .per_client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(source)
            .or_insert_with(|| Arc::new(Semaphore::new(self.limits.per_client)))
            .clone();
        let permits: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> = mine
            .try_acquire_owned()
            .ok()
            .and_then(|a| Some((a, self.total.clone().try_acquire_owned().ok()?)));
        let sock = sock.clone();
        let Some(permits) = permits else {
            tracing::debug!(%source, "dns: too many lookups in flight; SERVFAIL");
            let reply = servfail(&q);
            tokio::spawn(async move {
                if let Some(reply) = reply {
                    let _ = sock.send_to(&reply, from).await;
                }
            });
            return;
        };
        let resolver = self.resolver.clone();
        let timeout = self.limits.timeout;
        tokio::spawn(async move {
            let blocking = tokio::task::spawn_blocking(move || {
                // The places are given back when the host's resolver returns, not earlier.
                let _permits = permits;
                resolver.resolve(&name)
            });
            let reply = match tokio::time::timeout(timeout, blocking).await {
                Ok(Ok(addrs)) => finish(&q, &client, &addrs),
                Ok(Err(_)) | Err(_) => servfail(&q),
            };
            if let Some(reply) = reply {
                let _ = sock.send_to(&reply, from).await;
            }
        });
    }
}

fn responder() -> Option<&'static Arc<Responder>> {
    static R: OnceLock<Option<Arc<Responder>>> = OnceLock::new();
    R.get_or_init(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").ok()?;
        Responder::start(sock, Arc::new(SystemResolver), DnsLimits::default())
            .map_err(|e| tracing::warn!(error = %e, "dns responder cannot start"))
            .ok()
    })
    .as_ref()
}

/// The UDP port the responder listens on (all addresses), starting it on first use.
pub fn port() -> Option<u16> {
    responder().map(|r| r.port)
}

/// Sets (or with `None` removes) what the sandbox behind `router` may resolve.
pub fn set_client(router: Ipv4Addr, client: Option<DnsClient>) {
    if let Some(r) = responder() {
        r.set_client(router, client);
    }
}

/// A parsed question: the name (lower case, no trailing dot), its type, and where it ends.
fn question(q: &[u8]) -> Option<(String, u16, usize)> {
    if q.len() < 12 || u16::from_be_bytes([q[4], q[5]]) != 1 {
        return None;
    }
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        labels.push(
            std::str::from_utf8(q.get(i..i + len)?)
                .ok()?
                .to_ascii_lowercase(),
        );
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    q.get(i + 3)?;
    Some((labels.join("."), qtype, i + 4))
}

/// What to do with one query: answer it now, or look the name up first.
enum Plan {
    Answer(Vec<u8>),
    Lookup(String),
}

/// `None` for a query that cannot be parsed (no answer).
fn plan(q: &[u8], client: &DnsClient) -> Option<Plan> {
    let (name, qtype, _) = question(q)?;
    let allowed = client.any_name
        || client
            .hosts
            .iter()
            .any(|h| torpor_core::network::host_matches(h, &name));
    if allowed && qtype == 1 {
        return Some(Plan::Lookup(name));
    }
    finish(q, client, &[]).map(Plan::Answer)
}

/// The answer to `q` once its name resolved to `addrs`; the addresses of a listed name join
/// the worker's allowed set first.
fn finish(q: &[u8], client: &DnsClient, addrs: &[Ipv4Addr]) -> Option<Vec<u8>> {
    let (name, qtype, end) = question(q)?;
    let listed = client
        .hosts
        .iter()
        .any(|h| torpor_core::network::host_matches(h, &name));
    let allowed = listed || client.any_name;
    let addrs: &[Ipv4Addr] = if allowed && qtype == 1 { addrs } else { &[] };
    if listed && !addrs.is_empty() {
        (client.allow)(addrs);
    }
    // NXDOMAIN for a name not on the list (or that does not resolve), else NOERROR.
    let rcode: u8 = if allowed && (qtype != 1 || !addrs.is_empty()) {
        0
    } else {
        3
    };
    Some(reply(q, end, rcode, addrs))
}

/// SERVFAIL: the lookup could not be made now (too many in flight, or too slow).
fn servfail(q: &[u8]) -> Option<Vec<u8>> {
    let (_, _, end) = question(q)?;
    Some(reply(q, end, 2, &[]))
}

fn reply(q: &[u8], end: usize, rcode: u8, addrs: &[Ipv4Addr]) -> Vec<u8> {
    let mut r = Vec::with_capacity(end + addrs.len() * 16);
    r.extend_from_slice(&q[0..2]); // id
    r.push(0x80 | (q[2] & 0x01)); // QR, copy RD
    r.push(0x80 | rcode); // RA
    r.extend_from_slice(&[0, 1]); // one question
    r.extend_from_slice(&(addrs.len() as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(&q[12..end]);
    for a in addrs {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]); // name pointer, A, IN
        r.extend_from_slice(&60u32.to_be_bytes()); // TTL
        r.extend_from_slice(&[0, 4]);
        r.extend_from_slice(&a.octets());
    }
    r
}

/// The whole answer to `q`, resolving on this thread (tests).
#[cfg(test)]
fn answer(q: &[u8], client: &DnsClient) -> Option<Vec<u8>> {
    match plan(q, client)? {
        Plan::Answer(r) => Some(r),
        Plan::Lookup(name) => finish(q, client, &SystemResolver.resolve(&name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q
    }

    #[test]
    fn answers_only_allowed_names() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let client = DnsClient {
            hosts: vec!["localhost".into()],
            any_name: false,
            allow: Arc::new(move |a: &[Ipv4Addr]| s.lock().unwrap().extend_from_slice(a)),
        };
        let r = answer(&query("LocalHost", 1), &client).unwrap();
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0x0f, 0, "NOERROR");
        assert!(u16::from_be_bytes([r[6], r[7]]) >= 1);
        assert!(seen.lock().unwrap().contains(&Ipv4Addr::LOCALHOST));
        let r = answer(&query("example.com", 1), &client).unwrap();
        assert_eq!(r[3] & 0x0f, 3, "NXDOMAIN");
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 0);
        // Garbage never panics.
        let q = query("localhost", 1);
        for n in 0..q.len() {
            let _ = answer(&q[..n], &client);
        }
    }

    #[test]
    fn wildcards_and_any_name() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let mut client = DnsClient {
            hosts: vec!["*.localhost".into()],
            any_name: false,
            allow: Arc::new(move |a: &[Ipv4Addr]| s.lock().unwrap().extend_from_slice(a)),
        };
        // The wildcard does not match its suffix.
        let r = answer(&query("localhost", 1), &client).unwrap();
        assert_eq!(r[3] & 0x0f, 3, "NXDOMAIN");
        // Any name: resolved, but its addresses do not join the allowed set.
        client.any_name = true;
        let r = answer(&query("localhost", 1), &client).unwrap();
        assert_eq!(r[3] & 0x0f, 0, "NOERROR");
        assert!(u16::from_be_bytes([r[6], r[7]]) >= 1);
        assert!(seen.lock().unwrap().is_empty());
    }

    /// Names starting with `slow` block until the gate opens; the others answer at once.
    struct GatedResolver {
        open: Mutex<bool>,
        opened: std::sync::Condvar,
    }

    impl Resolve for GatedResolver {
        fn resolve(&self, name: &str) -> Vec<Ipv4Addr> {
            if name.starts_with("slow") {
                let mut open = self.open.lock().unwrap();
                while !*open {
                    open = self.opened.wait(open).unwrap();
                }
            }
            vec![Ipv4Addr::new(192, 0, 2, 7)]
        }
    }

    fn any_name() -> DnsClient {
        DnsClient {
            hosts: Vec::new(),
            any_name: true,
            allow: Arc::new(|_: &[Ipv4Addr]| {}),
        }
    }

    /// Sends `name` from `sock` to the responder with query id `id`.
    fn ask(sock: &UdpSocket, port: u16, id: u16, name: &str) {
        let mut q = query(name, 1);
        q[0..2].copy_from_slice(&id.to_be_bytes());
        sock.send_to(&q, ("127.0.0.1", port)).unwrap();
    }

    /// The next answer: (id, rcode, answer count).
    fn next_answer(sock: &UdpSocket) -> (u16, u8, u16) {
        let mut buf = [0u8; 1500];
        let n = sock.recv(&mut buf).expect("an answer");
        assert!(n >= 12);
        (
            u16::from_be_bytes([buf[0], buf[1]]),
            buf[3] & 0x0f,
            u16::from_be_bytes([buf[6], buf[7]]),
        )
    }

    #[test]
    fn one_sandboxs_slow_lookups_do_not_stall_another() {
        let resolver = Arc::new(GatedResolver {
            open: Mutex::new(false),
            opened: std::sync::Condvar::new(),
        });
        let limits = DnsLimits {
            total: 8,
            per_client: 3,
            timeout: Duration::from_millis(300),
        };
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let r = Responder::start(sock, resolver.clone(), limits).unwrap();
        // Two sandboxes, told apart by source address.
        let slow = UdpSocket::bind("127.0.0.2:0").unwrap();
        let quick = UdpSocket::bind("127.0.0.3:0").unwrap();
        for s in [&slow, &quick] {
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        }
        r.set_client(Ipv4Addr::new(127, 0, 0, 2), Some(any_name()));
        r.set_client(Ipv4Addr::new(127, 0, 0, 3), Some(any_name()));

        // The slow sandbox asks ten slow names: three take its places, seven are refused at
        // once; the three are answered SERVFAIL at the deadline while the resolver still
        // blocks.
        for id in 0..10 {
            ask(&slow, r.port, id, &format!("slow{id}.example"));
        }
        let answers: Vec<(u16, u8, u16)> = (0..10).map(|_| next_answer(&slow)).collect();
        assert!(
            answers.iter().all(|(_, rcode, n)| *rcode == 2 && *n == 0),
            "{answers:?}"
        );
        assert!(!*resolver.open.lock().unwrap(), "the gate is still shut");

        // Meanwhile the other sandbox resolves, many times over.
        for id in 0..20 {
            ask(&quick, r.port, 100 + id, "quick.example");
            assert_eq!(next_answer(&quick), (100 + id, 0, 1));
        }
        // The slow sandbox has no place free until its lookups return.
        ask(&slow, r.port, 50, "fast-now.example");
        assert_eq!(next_answer(&slow), (50, 2, 0));
        *resolver.open.lock().unwrap() = true;
        resolver.opened.notify_all();
        // Its places come back once the resolver returns.
        let mut got = (0, 2, 0);
        for attempt in 0..200 {
            ask(&slow, r.port, 60 + attempt, "fast-now.example");
            got = next_answer(&slow);
            if got.1 == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!((got.1, got.2), (0, 1), "answered once the lookups ended");
        // Unknown sources get nothing; a parse failure gets nothing.
        r.set_client(Ipv4Addr::new(127, 0, 0, 3), None);
        quick
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        ask(&quick, r.port, 7, "quick.example");
        assert!(
            quick.recv(&mut [0u8; 64]).is_err(),
            "no answer for an unknown source"
        );
    }
}
