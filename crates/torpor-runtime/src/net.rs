//! A warm worker's network: two namespaces, two veth pairs and an nftables table.
//!
//! ```text
//!  sandbox ns  <w>-s          router ns  <w>-r                      root ns
//!  eth0 169.254.0.2/30 ──veth── sb0 169.254.0.1/30
//!                               up0 10.x.y.(4n+2)/30 ──veth── t<tag><n> 10.x.y.(4n+1)/30
//! ```
//!
//! The sandbox namespace holds only the sandbox's link (runsc takes every link of the namespace
//! it is given), with the same address on every worker, so a checkpoint taken on one worker
//! restores on any other. The router namespace forwards, masquerades egress behind its uplink
//! address, applies the egress policy (chain `tp_egress` of table `ip torpor`) and DNATs
//! connections to its uplink address onto the sandbox (ingress: the proxy connects to
//! [`WorkerNet::ingress_addr`]). Nothing is changed in the root namespace but the host end of
//! the uplink veth. Deleting the router namespace removes both veth pairs.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use torpor_core::network::{parse_cidr, AllowRule, NetworkMode};
use torpor_core::NetworkPolicy;

use crate::relay::{EgressRelay, RELAY_PORT};

/// The sandbox's own address, the same on every worker.
pub const SANDBOX_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 2);
/// Its gateway (the router namespace's end).
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
/// Uplink subnets are /22 blocks (256 workers each) of this /12.
const UPLINK_BASE: u32 = u32::from_be_bytes([10, 192, 0, 0]);
const BLOCKS: u32 = 1024;
const SLOTS_PER_BLOCK: u32 = 256;

#[derive(Debug, thiserror::Error)]
#[error("network setup: `{command}` failed: {stderr}")]
pub struct NetError {
    pub command: String,
    pub stderr: String,
}

/// Hands out uplink subnets within this daemon's /22 block.
pub struct NetAlloc {
    block: u32,
    used: Mutex<BTreeSet<u32>>,
    /// Uplink names are this prefix and the slot.
    link_prefix: String,
}

impl NetAlloc {
    /// Picks a /22 block from `tag` (stable per data directory), skipping blocks that already
    /// have an address on this host (another daemon's workers). Uplinks of this tag still on
    /// the host are networks a previous run left to sandboxes that outlived it (live restore:
    /// everything else was removed before): their slots stay taken, in their block.
    pub fn new(tag: &str) -> Arc<NetAlloc> {
        let mut h: u32 = 0x811c_9dc5;
        for b in tag.bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
        let link_prefix = format!("t{}", tag.trim_start_matches('p'));
        let (ours, others): (Vec<_>, Vec<_>) = host_addresses()
            .into_iter()
            .partition(|(link, _)| link.starts_with(&link_prefix));
        let taken: Vec<u32> = others.into_iter().map(|(_, a)| a).collect();
        let used: BTreeSet<u32> = ours
            .iter()
            .filter_map(|(link, _)| link.strip_prefix(&link_prefix)?.parse().ok())
            .collect();
        let mut block = ours
            .first()
            .map(|(_, a)| (a - UPLINK_BASE) / (SLOTS_PER_BLOCK * 4))
            .unwrap_or(h % BLOCKS);
        for _ in 0..BLOCKS {
            let start = UPLINK_BASE + block * SLOTS_PER_BLOCK * 4;
            let end = start + SLOTS_PER_BLOCK * 4;
            if !taken.iter().any(|a| (start..end).contains(a)) {
                break;
            }
            block = (block + 1) % BLOCKS;
        }
        Arc::new(NetAlloc {
            block,
            used: Mutex::new(used),
            link_prefix,
        })
    }

    /// The slot of uplink `link`, if it is one of this allocator's names.
    fn slot_of(&self, link: &str) -> Option<u32> {
        link.strip_prefix(&self.link_prefix)?.parse().ok()
    }

    fn take(&self) -> Option<u32> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let slot = (0..SLOTS_PER_BLOCK).find(|s| !used.contains(s))?;
        used.insert(slot);
        Some(slot)
    }

    fn give_back(&self, slot: u32) {
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&slot);
    }

    fn addrs(&self, slot: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = UPLINK_BASE + self.block * SLOTS_PER_BLOCK * 4 + slot * 4;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }
}

/// The IPv4 addresses of the root namespace, with their links' names.
fn host_addresses() -> Vec<(String, u32)> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let link = it.nth(1)?.to_string();
            it.position(|w| w == "inet")?;
            let a = it.next()?.split('/').next()?;
            a.parse::<Ipv4Addr>().ok().map(|a| (link, u32::from(a)))
        })
        .collect()
}

/// One destination on the host the operator lets sandboxes reach (`torpor up
/// --sandbox-reach-host ADDR[:PORT]`): an address, on every port or on one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostReach {
    pub addr: Ipv4Addr,
    pub port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not ADDR or ADDR:PORT (an IPv4 address, a port 1-65535)")]
pub struct HostReachError {
    pub input: String,
}

impl std::str::FromStr for HostReach {
    type Err = HostReachError;

    fn from_str(s: &str) -> Result<HostReach, HostReachError> {
        let bad = || HostReachError {
            input: s.to_string(),
        };
        let (addr, port) = match s.trim().split_once(':') {
            Some((a, p)) => (
                a,
                Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?),
            ),
            None => (s.trim(), None),
        };
        Ok(HostReach {
            addr: addr.parse().map_err(|_| bad())?,
            port,
        })
    }
}

/// What no sandbox reaches unless the operator lists it: set once at daemon start.
#[derive(Debug, Clone, Default)]
struct HostGuard {
    reach: Vec<HostReach>,
    /// The daemon's own TCP listeners' ports: closed on every host address even when the
    /// address is listed without a port.
    daemon_ports: Vec<u16>,
}

static GUARD: OnceLock<HostGuard> = OnceLock::new();

/// Sets the host destinations sandboxes may reach and the daemon's own listeners (once, at
/// daemon start, before any worker network is made).
pub fn set_host_guard(reach: Vec<HostReach>, daemon_listeners: &[std::net::SocketAddr]) {
    let mut daemon_ports: Vec<u16> = daemon_listeners.iter().map(|a| a.port()).collect();
    daemon_ports.sort_unstable();
    daemon_ports.dedup();
    let _ = GUARD.set(HostGuard {
        reach,
        daemon_ports,
    });
}

fn guard() -> &'static HostGuard {
    GUARD.get_or_init(HostGuard::default)
}

/// Ranges that are the host whatever its interfaces: `0.0.0.0/8` (connecting to it reaches
/// the local host), loopback and link-local (cloud metadata services live at 169.254.169.254).
const ALWAYS_HOST: [(u32, u32); 3] = [
    (0x0000_0000, 0x00ff_ffff),
    (0x7f00_0000, 0x7fff_ffff),
    (0xa9fe_0000, 0xa9fe_ffff),
];

/// The host's addresses as merged inclusive ranges: every address the root namespace delivers
/// locally (its `local` routing table: each interface's addresses and broadcast addresses,
/// loopback, any `local` route), its default gateways, and [`ALWAYS_HOST`].
fn read_host_ranges() -> Vec<(u32, u32)> {
    let local = Command::new("ip")
        .args(["-4", "-o", "route", "show", "table", "local"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let main = Command::new("ip")
        .args(["-4", "-o", "route", "show", "default"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mut ranges: Vec<(u32, u32)> = ALWAYS_HOST.to_vec();
    // host_addresses() too: should `ip route` fail, the interface addresses still count.
    ranges.extend(host_addresses().into_iter().map(|(_, a)| (a, a)));
    ranges.extend(parse_host_routes(&local, &main));
    merge_ranges(ranges)
}

/// Parses `ip -4 -o route show table local` (`local 10.0.0.1 dev ...`, `broadcast ...`,
/// `local 127.0.0.0/8 dev lo ...`) and `ip -4 -o route show default` (`default via 10.0.0.254
/// dev ...`, ECMP `nexthop via ...`).
fn parse_host_routes(local: &str, default: &str) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for line in local.lines() {
        let mut w = line.split_whitespace();
        if !matches!(w.next(), Some("local" | "broadcast" | "anycast")) {
            continue;
        }
        if let Some(Ok((net, len))) = w.next().map(parse_cidr) {
            let start = u32::from(net);
            let size = if len == 0 {
                u32::MAX
            } else {
                (1u32 << (32 - u32::from(len))) - 1
            };
            out.push((start, start | size));
        }
    }
    for line in default.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        for pair in w.windows(2) {
            if pair[0] == "via" {
                if let Ok(a) = pair[1].parse::<Ipv4Addr>() {
                    out.push((u32::from(a), u32::from(a)));
                }
            }
        }
    }
    out
}

fn merge_ranges(mut ranges: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    ranges.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1.saturating_add(1) => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The host's addresses as last read, and what reads them again when they change.
struct HostAddrs {
    ranges: std::sync::RwLock<Arc<Vec<(u32, u32)>>>,
}

/// How often the host's addresses are read again (a new interface address is closed to
/// sandboxes within this time; the relay and every worker's `host_addrs` set follow).
const HOST_REFRESH: std::time::Duration = std::time::Duration::from_secs(2);

fn host_addrs() -> &'static HostAddrs {
    static H: OnceLock<HostAddrs> = OnceLock::new();
    H.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("host-addrs".into())
            .spawn(|| loop {
                std::thread::sleep(HOST_REFRESH);
                let fresh = read_host_ranges();
                let h = host_addrs();
                let changed = {
                    let cur = h.ranges.read().unwrap_or_else(|p| p.into_inner());
                    **cur != fresh
                };
                if changed {
                    tracing::info!(
                        ranges = fresh.len(),
                        "host addresses changed; closing the new ones to sandboxes"
                    );
                    *h.ranges.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh.clone());
                    let routers: Vec<String> = routers()
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .values()
                        .map(|r| r.ns.clone())
                        .collect();
                    for ns in routers {
                        if let Err(e) = nft_in(&ns, &host_set_script(&fresh)) {
                            tracing::warn!(error = %e, ns, "cannot update the host address set");
                        }
                    }
                }
            });
        HostAddrs {
            ranges: std::sync::RwLock::new(Arc::new(read_host_ranges())),
        }
    })
}

fn host_ranges() -> Arc<Vec<(u32, u32)>> {
    host_addrs()
        .ranges
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

/// Whether a sandbox may not reach `dst`: one of the host's addresses (see
/// [`read_host_ranges`]) that the operator did not list, or a daemon listener's port on one
/// that the operator did not list with that port. The egress relay asks before every
/// connection; the router's `tp_host` chain drops the same for every packet.
pub fn host_blocked(dst: std::net::SocketAddrV4) -> bool {
    let a = u32::from(*dst.ip());
    if !host_ranges().iter().any(|(s, e)| (*s..=*e).contains(&a)) {
        return false;
    }
    let g = guard();
    if g.reach
        .iter()
        .any(|r| r.addr == *dst.ip() && r.port == Some(dst.port()))
    {
        return false;
    }
    if g.daemon_ports.contains(&dst.port()) {
        return true;
    }
    !g.reach
        .iter()
        .any(|r| r.addr == *dst.ip() && r.port.is_none())
}

/// `flush` and refill of a router's `host_addrs` set (one transaction).
fn host_set_script(ranges: &[(u32, u32)]) -> String {
    format!(
        "flush set ip torpor host_addrs\nadd element ip torpor host_addrs {{ {} }}\n",
        range_elements(ranges)
    )
}

fn range_elements(ranges: &[(u32, u32)]) -> String {
    let els: Vec<String> = ranges
        .iter()
        .map(|(s, e)| {
            if s == e {
                Ipv4Addr::from(*s).to_string()
            } else {
                format!("{}-{}", Ipv4Addr::from(*s), Ipv4Addr::from(*e))
            }
        })
        .collect();
    els.join(", ")
}

/// The `tp_host` chain: the operator's exceptions, then the daemon's listeners and the host's
/// addresses dropped (counted as denied).
fn host_chain(guard: &HostGuard) -> String {
    let mut rules = String::new();
    for r in guard.reach.iter() {
        if let Some(p) = r.port {
            rules.push_str(&format!(
                "    ip daddr {} meta l4proto {{ tcp, udp }} th dport {p} return\n",
                r.addr
            ));
        }
    }
    if !guard.daemon_ports.is_empty() {
        let ports: Vec<String> = guard.daemon_ports.iter().map(|p| p.to_string()).collect();
        rules.push_str(&format!(
            "    ip daddr @host_addrs tcp dport {{ {} }} goto tp_host_drop\n",
            ports.join(", ")
        ));
    }
    for r in guard.reach.iter().filter(|r| r.port.is_none()) {
        rules.push_str(&format!("    ip daddr {} return\n", r.addr));
    }
    rules.push_str("    ip daddr @host_addrs goto tp_host_drop\n");
    rules
}

/// Every worker's router namespace by its uplink address: where the proxy connects from, and
/// where host address changes are pushed.
struct Router {
    ns: String,
}

fn routers() -> &'static Mutex<std::collections::HashMap<Ipv4Addr, Router>> {
    static R: OnceLock<Mutex<std::collections::HashMap<Ipv4Addr, Router>>> = OnceLock::new();
    R.get_or_init(Mutex::default)
}

fn nft_in(ns: &str, script: &str) -> Result<String, NetError> {
    run(&["ip", "netns", "exec", ns, "nft", "-f", "-"], Some(script))
}

/// Connects to `port` of the sandbox behind the worker whose router address is `router` (what
/// [`WorkerNet::ingress_addr`] gave), from inside that router namespace: the only path to a
/// sandbox's ports. Nothing from outside the router reaches them (no DNAT, the router's
/// forward chain drops anything entering from its uplink toward the sandbox), so this is how
/// torpor's proxy, with its checks, gets there and nothing else does.
pub async fn connect_ingress(
    router: Ipv4Addr,
    port: u16,
) -> std::io::Result<tokio::net::TcpStream> {
    let ns = routers()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&router)
        .map(|r| PathBuf::from("/run/netns").join(&r.ns))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no worker router at this address",
            )
        })?;
    crate::relay::connect_in(&ns, std::net::SocketAddrV4::new(SANDBOX_ADDR, port)).await
}

/// One worker's network, made by [`WorkerNet::prepare`] and removed by [`WorkerNet::teardown`].
pub struct WorkerNet {
    /// Namespace names (under /run/netns).
    pub sandbox_ns: String,
    pub router_ns: String,
    /// The root namespace's end of the uplink.
    pub host_link: String,
    pub host_addr: Ipv4Addr,
    pub router_addr: Ipv4Addr,
    /// Its uplink subnet in `alloc` (`None` only for an adopted network whose uplink name is
    /// not the allocator's: never given back).
    slot: Option<u32>,
    alloc: Arc<NetAlloc>,
    /// Every outbound TCP connection of the sandbox goes through it (crate::relay).
    relay: Option<EgressRelay>,
    /// Whether the sandbox's link has its address now (given while the worker was prepared or
    /// reset, off any create's path); a take uses it up ([`WorkerNet::ready_sandbox_addr`]).
    addr_ready: AtomicBool,
    /// The egress script in force in the router (`None`: not known, e.g. after a failure), so
    /// that a policy already in place (most often the reset's `none`) costs no `nft` run.
    applied: Mutex<Option<String>>,
}

fn run(args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
    let fail = |stderr: String| NetError {
        command: args.join(" "),
        stderr,
    };
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let mut msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if let Some(input) = stdin {
            msg.push_str(&format!(" (input: {})", input.trim()));
        }
        Err(fail(msg))
    }
}

impl WorkerNet {
    /// Makes the namespaces, links, addresses and the base nftables table for worker `name`.
    /// The relay's tasks run on `rt`.
    pub fn prepare(
        name: &str,
        alloc: &Arc<NetAlloc>,
        rt: &tokio::runtime::Handle,
    ) -> Result<WorkerNet, NetError> {
        let slot = alloc.take().ok_or_else(|| NetError {
            command: "allocate".into(),
            stderr: format!("all {SLOTS_PER_BLOCK} uplink subnets of this daemon are in use"),
        })?;
        let (host_addr, router_addr) = alloc.addrs(slot);
        let net = WorkerNet {
            sandbox_ns: format!("{name}-s"),
            router_ns: format!("{name}-r"),
            host_link: format!("{}{slot}", alloc.link_prefix),
            host_addr,
            router_addr,
            slot: Some(slot),
            alloc: alloc.clone(),
            relay: None,
            addr_ready: AtomicBool::new(false),
            applied: Mutex::new(None),
        };
        let mut net = net;
        if let Err(e) = net.build() {
            net.remove();
            return Err(e);
        }
        net.serve(rt)?;
        // The base table's egress chain and hosts set are empty: policy `none`.
        *net.lock_applied() = Some(policy_script(&NetworkPolicy::none()));
        if let Err(e) = net.set_sandbox_addr() {
            net.teardown();
            return Err(e);
        }
        Ok(net)
    }

    /// Takes back the network of worker `name` that a previous run of the daemon made and
    /// left to a sandbox that outlived it (live restore): its namespaces, links and addresses
    /// are as they were; its rules are made again (the DNS responder's port is this run's)
    /// and its egress relay started again. The sandbox's policy is the caller's to apply.
    pub fn adopt(
        name: &str,
        host_link: &str,
        host_addr: Ipv4Addr,
        router_addr: Ipv4Addr,
        alloc: &Arc<NetAlloc>,
        rt: &tokio::runtime::Handle,
    ) -> Result<WorkerNet, NetError> {
        let mut net = WorkerNet {
            sandbox_ns: format!("{name}-s"),
            router_ns: format!("{name}-r"),
            host_link: host_link.to_string(),
            host_addr,
            router_addr,
            slot: alloc.slot_of(host_link),
            alloc: alloc.clone(),
            relay: None,
            addr_ready: AtomicBool::new(false),
            applied: Mutex::new(None),
        };
        if !PathBuf::from("/run/netns").join(&net.router_ns).exists() {
            return Err(NetError {
                command: "adopt".into(),
                stderr: format!("namespace {} is gone", net.router_ns),
            });
        }
        let rules = net.nft(&format!(
            "delete table ip torpor\n{}",
            base_table(
                net.host_addr,
                crate::dns::port(),
                egress_limits(),
                guard(),
                &host_ranges(),
            )
        ));
        if let Err(e) = rules {
            net.remove();
            return Err(e);
        }
        net.serve(rt)?;
        Ok(net)
    }

    /// Starts the egress relay in the router namespace and lists the router for the ingress
    /// proxy.
    fn serve(&mut self, rt: &tokio::runtime::Handle) -> Result<(), NetError> {
        let net = self;
        match EgressRelay::start(
            &PathBuf::from("/run/netns").join(&net.router_ns),
            GATEWAY_ADDR,
            rt,
        ) {
            Ok(r) => net.relay = Some(r),
            Err(e) => {
                net.remove();
                return Err(NetError {
                    command: "egress relay".into(),
                    stderr: e.to_string(),
                });
            }
        }
        routers().lock().unwrap_or_else(|p| p.into_inner()).insert(
            net.router_addr,
            Router {
                ns: net.router_ns.clone(),
            },
        );
        Ok(())
    }

    fn build(&self) -> Result<(), NetError> {
        let (s, r) = (self.sandbox_ns.as_str(), self.router_ns.as_str());
        run(&["ip", "netns", "add", s], None)?;
        run(&["ip", "netns", "add", r], None)?;
        run(
            &[
                "ip", "link", "add", "eth0", "netns", s, "type", "veth", "peer", "name", "sb0",
                "netns", r,
            ],
            None,
        )?;
        run(
            &[
                "ip",
                "link",
                "add",
                "up0",
                "netns",
                r,
                "type",
                "veth",
                "peer",
                "name",
                &self.host_link,
            ],
            None,
        )?;
        let host_cidr = format!("{}/30", self.host_addr);
        run(
            &["ip", "addr", "add", &host_cidr, "dev", &self.host_link],
            None,
        )?;
        run(&["ip", "link", "set", &self.host_link, "up"], None)?;
        let batch = format!(
            "link set lo up\naddr add {GATEWAY_ADDR}/30 dev sb0\nlink set sb0 up\n\
             addr add {}/30 dev up0\nlink set up0 up\nroute add default via {}\n",
            self.router_addr, self.host_addr
        );
        run(&["ip", "-n", r, "-batch", "-"], Some(&batch))?;
        run(&["ip", "-n", s, "link", "set", "lo", "up"], None)?;
        run(
            &[
                "ip",
                "netns",
                "exec",
                r,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
            None,
        )?;
        self.nft(&base_table(
            self.host_addr,
            crate::dns::port(),
            egress_limits(),
            guard(),
            &host_ranges(),
        ))?;
        Ok(())
    }

    /// Runs an nftables script in the router namespace.
    fn nft(&self, script: &str) -> Result<String, NetError> {
        run(
            &["ip", "netns", "exec", &self.router_ns, "nft", "-f", "-"],
            Some(script),
        )
    }

    /// The spec's network namespace path for the sandbox.
    pub fn sandbox_ns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.sandbox_ns)
    }

    /// The address that names this worker's router to [`connect_ingress`], the proxy's only
    /// way to the sandbox's ports (not reachable from the host: no DNAT).
    pub fn ingress_addr(&self) -> Ipv4Addr {
        self.router_addr
    }

    /// Gives the sandbox's link its address and route (runsc moves them into the sandbox it
    /// starts, so a link that served one has none): when the worker's network is made and each
    /// time the worker is reset, so that a take finds them in place.
    fn set_sandbox_addr(&self) -> Result<(), NetError> {
        self.addr_ready.store(false, Ordering::SeqCst);
        let batch = format!(
            "addr flush dev eth0\naddr add {SANDBOX_ADDR}/30 dev eth0\nlink set eth0 up\n\
             route replace default via {GATEWAY_ADDR}\n"
        );
        run(&["ip", "-n", &self.sandbox_ns, "-batch", "-"], Some(&batch))?;
        self.addr_ready.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Makes sure the sandbox's link has its address before a run or restore: given already
    /// when the worker was made or reset (then nothing runs here), else given now. Each call
    /// uses the address up: the next sandbox on this worker gets it from the reset.
    pub fn ready_sandbox_addr(&self) -> Result<(), NetError> {
        if self.addr_ready.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        self.set_sandbox_addr()?;
        self.addr_ready.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn lock_applied(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the egress policy (one nftables transaction; live connections already
    /// established stay, new ones follow the new policy). A policy already in force (the same
    /// script) runs no `nft`.
    pub fn apply_policy(&self, policy: &NetworkPolicy) -> Result<(), NetError> {
        let script = policy_script(policy);
        let mut applied = self.lock_applied();
        if applied.as_deref() != Some(script.as_str()) {
            *applied = None;
            self.nft(&script)?;
            *applied = Some(script);
        }
        drop(applied);
        // The DNS responder answers the names this policy lets through: every name under
        // `full` or a default-allow list, else only those on `hosts`. Addresses of a listed
        // name join the allowed set before the answer is sent.
        let (hosts, any_name) = match policy {
            NetworkPolicy::Mode(NetworkMode::Full) => (Vec::new(), true),
            NetworkPolicy::Allow(list) => (list.hosts.clone(), !list.default.is_deny()),
            NetworkPolicy::Mode(NetworkMode::None) | NetworkPolicy::Unset => (Vec::new(), false),
        };
        let client = (any_name || !hosts.is_empty()).then(|| {
            let ns = self.router_ns.clone();
            crate::dns::DnsClient {
                hosts,
                any_name,
                allow: Arc::new(move |addrs: &[Ipv4Addr]| {
                    let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
                    let script = format!("add element ip torpor hosts {{ {} }}\n", list.join(", "));
                    if let Err(e) = run(
                        &["ip", "netns", "exec", &ns, "nft", "-f", "-"],
                        Some(&script),
                    ) {
                        tracing::warn!(error = %e, "cannot allow resolved addresses");
                    }
                }),
            }
        });
        crate::dns::set_client(self.router_addr, client);
        Ok(())
    }

    /// Traffic counters since the sandbox came to this worker.
    pub fn stats(&self) -> NetStats {
        let counters = self
            .nft("list counters table ip torpor\n")
            .unwrap_or_default();
        let denied = self
            .nft("list set ip torpor denied_dst\n")
            .unwrap_or_default();
        let mut st = parse_stats(&counters, &denied);
        if let Some(r) = &self.relay {
            let rs = r.stats();
            st.tx_bytes += rs.tx_bytes;
            st.rx_bytes += rs.rx_bytes;
        }
        st
    }

    /// Resets every TCP connection the sandbox has open through the relay and waits for them
    /// to end: before a checkpoint (which gVisor refuses while a connection is open). Returns
    /// how many there were; the sandbox must run a moment to take the resets in.
    pub async fn reset_connections(&self) -> usize {
        match &self.relay {
            Some(r) => r.reset_all().await,
            None => 0,
        }
    }

    /// Back to a blank state for the next sandbox: no egress, counters at zero.
    pub fn reset(&self) -> Result<(), NetError> {
        if let Some(r) = &self.relay {
            r.reset_now();
            r.reset_stats();
        }
        self.apply_policy(&NetworkPolicy::none())?;
        self.nft("reset counters table ip torpor\nflush set ip torpor denied_dst\n")?;
        self.set_sandbox_addr()
    }

    fn remove(&self) {
        for ns in [&self.router_ns, &self.sandbox_ns] {
            let _ = run(&["ip", "netns", "delete", ns], None);
        }
        // Normally gone with the router namespace (its peer); make sure.
        let _ = run(&["ip", "link", "delete", &self.host_link], None);
    }

    pub fn teardown(mut self) {
        routers()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.router_addr);
        self.relay.take();
        crate::dns::set_client(self.router_addr, None);
        self.remove();
        if let Some(slot) = self.slot {
            self.alloc.give_back(slot);
        }
    }
}

/// Counters of one worker's traffic (from the sandbox's point of view: tx leaves it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetStats {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub egress_connections: u64,
    pub ingress_connections: u64,
    pub denied_packets: u64,
    /// Packets dropped by the egress rate limits.
    pub limited_packets: u64,
    /// Denied attempts by destination (`address:port`).
    pub denied_by_destination: Vec<(String, u64)>,
}

fn parse_stats(counters: &str, denied_set: &str) -> NetStats {
    let mut st = NetStats::default();
    let mut current = String::new();
    for line in counters.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("counter ") {
            current = name.trim_end_matches(" {").to_string();
        } else if line.starts_with("packets ") {
            let w: Vec<&str> = line.split_whitespace().collect();
            let packets: u64 = w.get(1).and_then(|n| n.parse().ok()).unwrap_or(0);
            let bytes: u64 = w.get(3).and_then(|n| n.parse().ok()).unwrap_or(0);
            match current.as_str() {
                "tx" => st.tx_bytes = bytes,
                "rx" => st.rx_bytes = bytes,
                "egress_conns" => st.egress_connections = packets,
                "ingress_conns" => st.ingress_connections = packets,
                "denied" => st.denied_packets = packets,
                "limited" => st.limited_packets = packets,
                _ => {}
            }
        }
    }
    // elements = { 10.1.2.3 . 8443 counter packets 1 bytes 60 expires 59m58s, ... }
    let flat = denied_set.replace('\n', " ");
    if let Some(start) = flat.find("elements = {") {
        let body = &flat[start + 12..];
        let body = &body[..body.find('}').unwrap_or(body.len())];
        for el in body.split(',') {
            let w: Vec<&str> = el.split_whitespace().collect();
            if let (Some(addr), Some(port), Some(pos)) =
                (w.first(), w.get(2), w.iter().position(|x| *x == "packets"))
            {
                let n = w.get(pos + 1).and_then(|n| n.parse().ok()).unwrap_or(0);
                st.denied_by_destination.push((format!("{addr}:{port}"), n));
            }
        }
    }
    st
}

/// How much one sandbox may send: bytes and packets per second, over everything it sends
/// (a flooding sandbox is dropped at its own router; its neighbours' routers are untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EgressLimits {
    pub mbit_per_s: u32,
    pub packets_per_s: u32,
}

impl Default for EgressLimits {
    fn default() -> Self {
        EgressLimits {
            mbit_per_s: 1000,
            packets_per_s: 50_000,
        }
    }
}

static LIMITS: OnceLock<EgressLimits> = OnceLock::new();

/// Sets the limits for every worker network made from now on (once, at daemon start).
pub fn set_egress_limits(limits: EgressLimits) {
    let _ = LIMITS.set(limits);
}

fn egress_limits() -> EgressLimits {
    LIMITS.get().copied().unwrap_or_default()
}

/// Conntrack mark bits on a sandbox's TCP connections with torpor (the egress relay, the
/// ingress proxy): the sandbox sent its FIN / torpor sent its FIN.
///
/// gVisor refuses to checkpoint, and stops, a sandbox holding a TCP endpoint in TIME_WAIT, and
/// ignores a RST in TIME_WAIT (RFC 1337). The relay answers a sandbox that closes first with a
/// RST (crate::relay::PeerCloseAware), but when both ends close at once (torpor's FIN is on its
/// way while the program closes: a client that stops reading after the answer it wanted) the
/// sandbox's FIN crosses torpor's, and the ACK of it would put the sandbox in TIME_WAIT for 60 s.
/// So once both FINs were seen, every further packet from torpor to the sandbox (that ACK, or
/// torpor's FIN after the sandbox's) leaves as a RST: the sandbox's endpoint closes at once,
/// whichever order the FINs crossed in; torpor's own socket is untouched.
const CT_SANDBOX_FIN: u32 = 0x1;
const CT_TORPOR_FIN: u32 = 0x2;
const CT_BOTH_FIN: u32 = CT_SANDBOX_FIN | CT_TORPOR_FIN;

fn base_table(
    host_addr: Ipv4Addr,
    dns_port: Option<u16>,
    limits: EgressLimits,
    guard: &HostGuard,
    host: &[(u32, u32)],
) -> String {
    let host_elements = range_elements(host);
    let host_chain = host_chain(guard);
    // DNS: the sandbox asks its gateway; the router forwards to torpor's responder.
    let (dns_dnat, dns_fwd) = match dns_port {
        Some(p) => (
            format!("iifname \"sb0\" ip daddr {GATEWAY_ADDR} udp dport 53 dnat to {host_addr}:{p}"),
            format!("iifname \"sb0\" oifname \"up0\" ip daddr {host_addr} udp dport {p} accept"),
        ),
        None => (String::new(), String::new()),
    };
    // Rates: nftables takes bytes; a tenth of a second of burst.
    let kbytes = u64::from(limits.mbit_per_s.max(1)) * 125;
    let burst_kbytes = (kbytes / 10).max(64);
    let pps = limits.packets_per_s.max(1);
    let burst_packets = (pps / 10).max(16);
    format!(
        r#"table ip torpor {{
  counter denied {{ }}
  counter limited {{ }}
  counter tx {{ }}
  counter rx {{ }}
  counter egress_conns {{ }}
  counter ingress_conns {{ }}
  set hosts {{ type ipv4_addr; }}
  set host_addrs {{ type ipv4_addr; flags interval; elements = {{ {host_elements} }} }}
  set denied_dst {{ type ipv4_addr . inet_service; flags dynamic,timeout; timeout 1h; size 4096; counter; }}
  chain tp_limit {{
    type filter hook prerouting priority mangle; policy accept;
    iifname "sb0" limit rate over {kbytes} kbytes/second burst {burst_kbytes} kbytes counter name "limited" drop
    iifname "sb0" limit rate over {pps}/second burst {burst_packets} packets counter name "limited" drop
    iifname "sb0" meta l4proto tcp ct state new jump tp_tcp_new
  }}
  chain tp_tcp_new {{
    ip daddr {GATEWAY_ADDR} counter name "denied" drop
    ip daddr 10.192.0.0/12 ip daddr != {host_addr} counter name "denied" drop
    jump tp_host
    jump tp_egress
    update @denied_dst {{ ip daddr . th dport }} counter name "denied" drop
  }}
  chain tp_pre {{
    type nat hook prerouting priority dstnat;
    {dns_dnat}
    iifname "sb0" meta l4proto tcp redirect to :{RELAY_PORT}
  }}
  chain tp_nat {{
    type nat hook postrouting priority srcnat;
    oifname "up0" masquerade
  }}
  chain tp_egress {{
  }}
  chain tp_host {{
{host_chain}  }}
  chain tp_host_drop {{
    meta l4proto {{ tcp, udp }} update @denied_dst {{ ip daddr . th dport }} counter name "denied" drop
    counter name "denied" drop
  }}
  chain tp_fwd {{
    type filter hook forward priority filter; policy drop;
    iifname "sb0" counter name "tx"
    oifname "sb0" counter name "rx"
    ct state established,related accept
    {dns_fwd}
    iifname "sb0" ip daddr 10.192.0.0/12 ip daddr != {host_addr} counter name "denied" drop
    iifname "sb0" jump tp_host
    iifname "sb0" oifname "up0" jump tp_egress
    iifname "sb0" meta l4proto {{ tcp, udp }} update @denied_dst {{ ip daddr . th dport }} counter name "denied" drop
    iifname "sb0" counter name "denied" drop
  }}
  chain tp_in {{
    type filter hook input priority filter; policy accept;
    iifname "sb0" tcp flags & fin == fin ct mark set ct mark or {CT_SANDBOX_FIN}
    iifname "sb0" ct direction reply counter name "tx"
    iifname "sb0" ct state established,related accept
    iifname "sb0" tcp dport {RELAY_PORT} ct status dnat accept
    iifname "sb0" drop
    iifname "up0" ct state established,related accept
    iifname "up0" meta l4proto tcp reject with tcp reset
    iifname "up0" drop
  }}
  chain tp_out {{
    type filter hook output priority filter; policy accept;
    oifname "sb0" tcp flags & fin == fin ct mark set ct mark or {CT_TORPOR_FIN}
    oifname "sb0" ct mark & {CT_BOTH_FIN} == {CT_BOTH_FIN} tcp flags & rst == 0 counter tcp flags set rst | ack
    oifname "sb0" ct state new counter name "ingress_conns"
    oifname "sb0" ct direction original counter name "rx"
  }}
}}
table ip6 torpor6 {{
  chain tp6_in {{
    type filter hook input priority filter; policy accept;
    iifname {{ "sb0", "up0" }} drop
  }}
  chain tp6_fwd {{
    type filter hook forward priority filter; policy drop;
  }}
}}
"#
    )
}

fn policy_script(policy: &NetworkPolicy) -> String {
    let mut s = String::from("flush chain ip torpor tp_egress\nflush set ip torpor hosts\n");
    match policy {
        NetworkPolicy::Mode(NetworkMode::Full) => {
            s.push_str("add rule ip torpor tp_egress counter name \"egress_conns\" accept\n");
        }
        NetworkPolicy::Allow(list) => {
            if !list.hosts.is_empty() {
                s.push_str("add rule ip torpor tp_egress ip daddr @hosts counter name \"egress_conns\" accept\n");
            }
            // Allowed first, then refused (a `return` goes back to the caller, which drops
            // and counts), then the default.
            for rule in &list.allow {
                push_rule(&mut s, rule, "counter name \"egress_conns\" accept");
            }
            for rule in &list.deny {
                push_rule(&mut s, rule, "return");
            }
            if !list.default.is_deny() {
                s.push_str("add rule ip torpor tp_egress counter name \"egress_conns\" accept\n");
            }
        }
        NetworkPolicy::Mode(NetworkMode::None) | NetworkPolicy::Unset => {}
    }
    s
}

/// One rule of `tp_egress`: `rule`'s destination range (and ports, TCP and UDP) → `verdict`.
fn push_rule(s: &mut String, rule: &AllowRule, verdict: &str) {
    let Ok((addr, len)) = parse_cidr(&rule.cidr) else {
        return; // refused at create; never reaches here
    };
    if rule.ports.is_empty() {
        s.push_str(&format!(
            "add rule ip torpor tp_egress ip daddr {addr}/{len} {verdict}\n"
        ));
        return;
    }
    let ports: Vec<String> = rule.ports.iter().map(|p| p.to_string()).collect();
    let ports = ports.join(", ");
    for proto in ["tcp", "udp"] {
        s.push_str(&format!(
            "add rule ip torpor tp_egress ip daddr {addr}/{len} {proto} dport {{ {ports} }} {verdict}\n"
        ));
    }
}

/// Removes the namespaces (and with them the links) whose names start with `prefix`.
/// Removes worker `name`'s network (its namespaces and uplink) without a [`WorkerNet`]: one a
/// previous run made for a container nobody took back.
pub fn remove_worker_net(name: &str, host_link: &str) {
    for ns in [format!("{name}-r"), format!("{name}-s")] {
        let _ = run(&["ip", "netns", "delete", &ns], None);
    }
    let _ = run(&["ip", "link", "delete", host_link], None);
}

pub fn remove_leftovers(prefix: &str, keep: &[String]) {
    let Ok(rd) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let worker = name
            .strip_suffix("-s")
            .or_else(|| name.strip_suffix("-r"))
            .filter(|w| w.starts_with(prefix));
        if worker.is_some_and(|w| !keep.iter().any(|k| k == w)) {
            let _ = run(&["ip", "netns", "delete", &name], None);
        }
    }
}

/// Whether this host can make worker networks (`ip` and `nft` present).
pub fn available() -> bool {
    ["ip", "nft"].iter().all(|b| {
        Command::new(b)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(args: &[&str]) -> String {
        run(args, None).unwrap()
    }

    /// A worker's network between two sandboxes, on the host's real namespaces and nftables
    /// (as root, as the daemon): made with the link's address; a sandbox's start takes the
    /// address (runsc moves it into the sandbox); the reset gives it back and closes egress;
    /// a take after a reset runs nothing, one without a reset sets the address itself.
    #[test]
    fn a_reset_network_has_its_address_and_no_egress_for_the_next_sandbox() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let tag = format!("pnt{:x}", std::process::id());
        let alloc = NetAlloc::new(&tag);
        let name = format!("{tag}-w0");
        let net = WorkerNet::prepare(&name, &alloc, rt.handle()).unwrap();
        let addr = || {
            output(&[
                "ip",
                "-n",
                &net.sandbox_ns,
                "-4",
                "-o",
                "addr",
                "show",
                "eth0",
            ])
        };
        let egress = || {
            output(&[
                "ip",
                "netns",
                "exec",
                &net.router_ns,
                "nft",
                "list",
                "chain",
                "ip",
                "torpor",
                "tp_egress",
            ])
        };
        let has_addr = |s: String| s.contains(&format!("{SANDBOX_ADDR}/30"));

        assert!(
            has_addr(addr()),
            "made without the sandbox's address: {}",
            addr()
        );
        net.ready_sandbox_addr().unwrap();
        assert!(
            !net.addr_ready.load(Ordering::SeqCst),
            "a take uses the address up"
        );
        // The sandbox starts: runsc takes the address; its policy opens egress.
        output(&["ip", "-n", &net.sandbox_ns, "addr", "flush", "dev", "eth0"]);
        net.apply_policy(&NetworkPolicy::full()).unwrap();
        assert!(egress().contains("accept"), "{}", egress());
        // A policy already in force runs nothing and changes nothing.
        net.apply_policy(&NetworkPolicy::full()).unwrap();
        assert!(egress().contains("accept"), "{}", egress());

        // The sandbox is gone: the reset gives the address back and closes egress.
        net.reset().unwrap();
        assert!(has_addr(addr()), "no address after the reset: {}", addr());
        assert!(
            !egress().contains("accept"),
            "egress left open: {}",
            egress()
        );
        // The next sandbox's `none` is the reset's: its take runs nothing and finds both.
        net.ready_sandbox_addr().unwrap();
        net.apply_policy(&NetworkPolicy::none()).unwrap();
        assert!(has_addr(addr()));
        assert!(!egress().contains("accept"), "{}", egress());

        // A take that finds no address given back (no reset since the last take) sets it.
        output(&["ip", "-n", &net.sandbox_ns, "addr", "flush", "dev", "eth0"]);
        net.ready_sandbox_addr().unwrap();
        assert!(has_addr(addr()), "a take without a reset: {}", addr());
        // And a policy that differs from the one in force is applied.
        net.apply_policy(&NetworkPolicy::full()).unwrap();
        assert!(egress().contains("accept"), "{}", egress());
        net.teardown();
    }

    #[test]
    fn policy_scripts() {
        assert_eq!(
            policy_script(&NetworkPolicy::none()),
            "flush chain ip torpor tp_egress\nflush set ip torpor hosts\n"
        );
        assert!(policy_script(&NetworkPolicy::full())
            .contains("tp_egress counter name \"egress_conns\" accept"));
        let p: NetworkPolicy =
            serde_json::from_str(r#"{"allow":[{"cidr":"10.1.2.3/8","ports":[80,443]}]}"#).unwrap();
        let s = policy_script(&p);
        assert!(s.contains("ip daddr 10.0.0.0/8 tcp dport { 80, 443 } counter"));
        assert!(s.contains("udp dport"));
        // Deny rules come after the allowed ones and before the default.
        let p: NetworkPolicy = serde_json::from_str(
            r#"{"default":"allow","allow":[{"cidr":"10.1.0.0/16"}],"deny":[{"cidr":"10.0.0.0/8"}]}"#,
        )
        .unwrap();
        let s = policy_script(&p);
        let allow = s.find("ip daddr 10.1.0.0/16 counter").unwrap();
        let deny = s.find("ip daddr 10.0.0.0/8 return").unwrap();
        let default = s
            .rfind("tp_egress counter name \"egress_conns\" accept")
            .unwrap();
        assert!(allow < deny && deny < default, "{s}");
    }

    #[test]
    fn stats_parse() {
        let counters = "table ip torpor {\n\tcounter denied {\n\t\tpackets 2 bytes 120\n\t}\n\tcounter tx {\n\t\tpackets 9 bytes 900\n\t}\n\tcounter egress_conns {\n\t\tpackets 3 bytes 180\n\t}\n}\n";
        let set = "table ip torpor {\n\tset denied_dst {\n\t\telements = { 10.1.2.3 . 8443 counter packets 1 bytes 60 expires 59m58s964ms,\n\t\t\t     10.1.2.4 . 53 counter packets 4 bytes 240 expires 1m }\n\t}\n}\n";
        let st = parse_stats(counters, set);
        assert_eq!(st.denied_packets, 2);
        assert_eq!(st.tx_bytes, 900);
        assert_eq!(st.egress_connections, 3);
        assert_eq!(
            st.denied_by_destination,
            vec![
                ("10.1.2.3:8443".to_string(), 1),
                ("10.1.2.4:53".to_string(), 4)
            ]
        );
    }

    #[test]
    fn slots_map_to_distinct_subnets() {
        let a = NetAlloc {
            block: 3,
            used: Mutex::default(),
            link_prefix: "tx".into(),
        };
        let (h0, r0) = a.addrs(0);
        let (h1, _) = a.addrs(1);
        assert_eq!(u32::from(r0), u32::from(h0) + 1);
        assert_eq!(u32::from(h1), u32::from(h0) + 4);
        assert_eq!(h0.octets()[0], 10);
    }

    #[test]
    fn host_routes_and_reach_entries() {
        let local = "local 10.1.2.3 dev eth0 proto kernel scope host src 10.1.2.3 \n\
                     broadcast 10.1.2.255 dev eth0 proto kernel scope link src 10.1.2.3 \n\
                     local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1 \n\
                     unreachable 10.9.0.0/16 \n";
        let default = "default via 10.1.2.1 dev eth0 \n\
                       default proto static \\    nexthop via 10.1.3.1 dev eth1 weight 1";
        let got = merge_ranges(parse_host_routes(local, default));
        let ip = |s: &str| u32::from(s.parse::<Ipv4Addr>().unwrap());
        assert_eq!(
            got,
            vec![
                (ip("10.1.2.1"), ip("10.1.2.1")),
                (ip("10.1.2.3"), ip("10.1.2.3")),
                (ip("10.1.2.255"), ip("10.1.2.255")),
                (ip("10.1.3.1"), ip("10.1.3.1")),
                (ip("127.0.0.0"), ip("127.255.255.255")),
            ]
        );
        assert_eq!(
            merge_ranges(vec![(5, 9), (1, 4), (7, 12), (20, 20)]),
            vec![(1, 12), (20, 20)]
        );
        assert_eq!(
            range_elements(&[
                (ip("10.0.0.1"), ip("10.0.0.1")),
                (ip("127.0.0.0"), ip("127.255.255.255"))
            ]),
            "10.0.0.1, 127.0.0.0-127.255.255.255"
        );
        let r: HostReach = "10.1.2.3:8080".parse().unwrap();
        assert_eq!((r.addr, r.port), (Ipv4Addr::new(10, 1, 2, 3), Some(8080)));
        let r: HostReach = "10.1.2.3".parse().unwrap();
        assert_eq!(r.port, None);
        for bad in ["10.1.2.3:0", "10.1.2.3:70000", "host:80", "", "::1"] {
            assert!(bad.parse::<HostReach>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_host_chain_opens_listed_ports_before_closing_the_daemons() {
        let g = HostGuard {
            reach: vec![
                "10.0.0.5:7077".parse().unwrap(),
                "10.0.0.6".parse().unwrap(),
            ],
            daemon_ports: vec![7077, 9090],
        };
        let c = host_chain(&g);
        let listed = c
            .find("ip daddr 10.0.0.5 meta l4proto { tcp, udp } th dport 7077 return")
            .unwrap();
        let daemon = c
            .find("ip daddr @host_addrs tcp dport { 7077, 9090 } goto tp_host_drop")
            .unwrap();
        let whole = c.find("ip daddr 10.0.0.6 return").unwrap();
        let rest = c.find("ip daddr @host_addrs goto tp_host_drop").unwrap();
        assert!(listed < daemon && daemon < whole && whole < rest, "{c}");
        // The base table carries the chain, the set and no DNAT toward the sandbox.
        let t = base_table(
            Ipv4Addr::new(10, 192, 0, 1),
            Some(5353),
            EgressLimits::default(),
            &g,
            &[(1, 2)],
        );
        assert!(t.contains("elements = { 0.0.0.1-0.0.0.2 }"), "{t}");
        assert!(t.contains("jump tp_host\n"));
        assert!(!t.contains(&format!("dnat to {SANDBOX_ADDR}")), "{t}");
    }

    /// The relay's own check (no operator list in unit tests): every address of this host,
    /// loopback, link-local and 0.0.0.0/8 are refused; a documentation address is not.
    #[test]
    fn the_relay_refuses_the_hosts_addresses() {
        let v4 = |a: Ipv4Addr, p| std::net::SocketAddrV4::new(a, p);
        for (_, a) in host_addresses() {
            assert!(
                host_blocked(v4(Ipv4Addr::from(a), 22)),
                "{}",
                Ipv4Addr::from(a)
            );
        }
        for a in [
            "127.0.0.1",
            "127.3.4.5",
            "169.254.169.254",
            "0.0.0.0",
            "0.1.2.3",
        ] {
            assert!(host_blocked(v4(a.parse().unwrap(), 80)), "{a}");
        }
        assert!(!host_blocked(v4(Ipv4Addr::new(203, 0, 113, 77), 80)));
    }
}
