//! Loopback ports for another process to listen on.
//!
//! Binding port 0 and handing the number to a child races with every outbound connection on
//! the host: the kernel picks both from its ephemeral range (`net.ipv4.ip_local_port_range`),
//! and a client socket that takes the port between the check and the child's own bind makes
//! the child fail with `EADDRINUSE` (CI saw it: a daemon's `--metrics-listen` refused while
//! other tests of the same binary made connections). The ports here come from below that
//! range, where the kernel never picks one on its own. Each process walks the window from an
//! offset derived from its pid, never hands out a port twice, and returns a port only once a
//! bind of it on 127.0.0.1 succeeds (so one a service already holds is skipped).

use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The lowest port handed out: above the well-known and most registered service ports.
const LOWEST: u16 = 10_000;

/// How many ports this process has tried: each is tried once.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// The kernel's default start of its ephemeral range, used when /proc cannot be read.
const EPHEMERAL_DEFAULT: u16 = 32_768;

/// The window `[LOWEST, start of the ephemeral range)`, or `None` when the range starts too
/// low to leave a useful one (then a port is picked by binding port 0, as before).
fn window() -> Option<(u16, u32)> {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(EPHEMERAL_DEFAULT);
    let span = u32::from(first_ephemeral.checked_sub(LOWEST)?);
    (span >= 1_000).then_some((LOWEST, span))
}

/// A loopback TCP port nothing listens on now and that the kernel will not give an outbound
/// connection, for a process about to be started to listen on.
pub fn loopback_port() -> std::io::Result<u16> {
    static WINDOW: OnceLock<Option<(u16, u32)>> = OnceLock::new();
    let Some((lowest, span)) = *WINDOW.get_or_init(window) else {
        return Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()?
            .port());
    };
    // Processes started together (test binaries, benchmark drivers) start far apart.
    let offset = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = lowest + ((offset + n) % span) as u16;
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "every loopback port from {lowest} to {} is in use",
            u32::from(lowest) + span - 1
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let (lowest, span) = window().expect("this host leaves a window");
        let ports: Vec<u16> = (0..64).map(|_| loopback_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "handed out twice: {ports:?}");
        for p in &ports {
            assert!(
                *p >= lowest && u32::from(*p) < u32::from(lowest) + span,
                "{p}"
            );
        }
        // A port in use is skipped: hold the next candidate, then ask again.
        let n = NEXT.load(Ordering::Relaxed);
        let offset = std::process::id().wrapping_mul(7_919) % span;
        let held_port = lowest + ((offset + n) % span) as u16;
        let _held = TcpListener::bind((Ipv4Addr::LOCALHOST, held_port));
        let next = loopback_port().unwrap();
        assert_ne!(next, held_port);
        TcpListener::bind((Ipv4Addr::LOCALHOST, next)).expect("the port given is free");
    }
}
