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

struct Responder {
    port: u16,
    clients: Mutex<HashMap<Ipv4Addr, DnsClient>>,
}

fn responder() -> Option<&'static Responder> {
    static R: OnceLock<Option<Responder>> = OnceLock::new();
    R.get_or_init(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").ok()?;
        let port = sock.local_addr().ok()?.port();
        let spawned = std::thread::Builder::new()
            .name("dns".into())
            .spawn(move || serve(sock));
        spawned.ok()?;
        Some(Responder {
            port,
            clients: Mutex::default(),
        })
    })
    .as_ref()
}

/// The UDP port the responder listens on (all addresses), starting it on first use.
pub fn port() -> Option<u16> {
    responder().map(|r| r.port)
}

/// Sets (or with `None` removes) what the sandbox behind `router` may resolve.
pub fn set_client(router: Ipv4Addr, client: Option<DnsClient>) {
    let Some(r) = responder() else { return };
    let mut clients = r.clients.lock().unwrap_or_else(|p| p.into_inner());
    match client {
        Some(c) => clients.insert(router, c),
        None => clients.remove(&router),
    };
}

fn serve(sock: UdpSocket) {
    let mut buf = [0u8; 1500];
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let SocketAddr::V4(from4) = from else {
            continue;
        };
        let client = responder().and_then(|r| {
            r.clients
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(from4.ip())
                .cloned()
        });
        // Unknown sources get no answer at all.
        let Some(client) = client else { continue };
        if let Some(reply) = answer(&buf[..n], &client) {
            let _ = sock.send_to(&reply, from);
        }
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

fn answer(q: &[u8], client: &DnsClient) -> Option<Vec<u8>> {
    let (name, qtype, end) = question(q)?;
    let listed = client
        .hosts
        .iter()
        .any(|h| torpor_core::network::host_matches(h, &name));
    let allowed = listed || client.any_name;
    let addrs: Vec<Ipv4Addr> = if allowed && qtype == 1 {
        resolve(&name)
    } else {
        Vec::new()
    };
    if listed && !addrs.is_empty() {
        (client.allow)(&addrs);
    }
    // NXDOMAIN for a name not on the list (or that does not resolve), else NOERROR.
    let rcode: u8 = if allowed && (qtype != 1 || !addrs.is_empty()) {
        0
    } else {
        3
    };
    let mut r = Vec::with_capacity(end + addrs.len() * 16);
    r.extend_from_slice(&q[0..2]); // id
    r.push(0x80 | (q[2] & 0x01)); // QR, copy RD
    r.push(0x80 | rcode); // RA
    r.extend_from_slice(&[0, 1]); // one question
    r.extend_from_slice(&(addrs.len() as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(&q[12..end]);
    for a in &addrs {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]); // name pointer, A, IN
        r.extend_from_slice(&60u32.to_be_bytes()); // TTL
        r.extend_from_slice(&[0, 4]);
        r.extend_from_slice(&a.octets());
    }
    Some(r)
}

fn resolve(name: &str) -> Vec<Ipv4Addr> {
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
}
