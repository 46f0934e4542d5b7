//! A sandbox's network policy: what it may reach.
//!
//! JSON shapes: `"none"` (no network interface at all, the default), `"full"` (any
//! destination), or a rule list `{"allow": [{"cidr": "10.0.0.0/8", "ports": [443]}],
//! "hosts": ["api.example.com", "*.example.org"]}`. A rule list is read in order: a
//! destination in `allow` (or an address one of `hosts` resolved to) is let through; else one
//! in `deny` is refused; else `default` decides (`"deny"` unless given). So
//! `{"default": "allow", "deny": [{"cidr": "10.0.0.0/8"}]}` is "anything but 10/8".
//! Only IPv4 destinations are modelled.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// One allowed destination range, optionally limited to some ports (TCP and UDP).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    pub cidr: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowList {
    #[serde(default)]
    pub allow: Vec<AllowRule>,
    /// Host names (or `*.suffix` wildcards: any name below the suffix, not the suffix itself)
    /// whose resolved addresses are let through.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Destinations refused unless `allow` or `hosts` lets them through; only meaningful with
    /// `"default": "allow"`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<AllowRule>,
    /// What happens to a destination no rule names.
    #[serde(default, skip_serializing_if = "Verdict::is_deny")]
    pub default: Verdict,
}

/// The verdict for destinations no rule names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    #[default]
    Deny,
    Allow,
}

impl Verdict {
    pub fn is_deny(&self) -> bool {
        *self == Verdict::Deny
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NetworkPolicy {
    /// `"none"` or `"full"`.
    Mode(NetworkMode),
    Allow(AllowList),
    #[default]
    #[serde(skip)]
    Unset,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    None,
    Full,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct NetworkPolicyError {
    pub field: String,
    pub message: String,
}

/// Most allow rules and host names one policy may carry.
pub const MAX_RULES: usize = 256;

impl NetworkPolicy {
    pub fn none() -> Self {
        NetworkPolicy::Mode(NetworkMode::None)
    }

    pub fn full() -> Self {
        NetworkPolicy::Mode(NetworkMode::Full)
    }

    /// Whether the sandbox gets a network interface at all.
    pub fn is_none(&self) -> bool {
        matches!(
            self,
            NetworkPolicy::Unset | NetworkPolicy::Mode(NetworkMode::None)
        )
    }

    /// Checks every CIDR, port and host name; the error names the offending field.
    pub fn validate(&self) -> Result<(), NetworkPolicyError> {
        let NetworkPolicy::Allow(list) = self else {
            return Ok(());
        };
        let err = |field: String, message: String| NetworkPolicyError { field, message };
        if list.allow.len() > MAX_RULES || list.hosts.len() > MAX_RULES {
            return Err(err(
                "network".into(),
                format!("at most {MAX_RULES} rules and {MAX_RULES} hosts"),
            ));
        }
        if list.deny.len() > MAX_RULES {
            return Err(err(
                "network.deny".into(),
                format!("at most {MAX_RULES} rules"),
            ));
        }
        if !list.deny.is_empty() && list.default.is_deny() {
            return Err(err(
                "network.deny".into(),
                "deny rules need \"default\": \"allow\" (everything else is already refused)"
                    .into(),
            ));
        }
        for (key, rules) in [("allow", &list.allow), ("deny", &list.deny)] {
            for (i, rule) in rules.iter().enumerate() {
                parse_cidr(&rule.cidr).map_err(|m| err(format!("network.{key}[{i}].cidr"), m))?;
                for (j, p) in rule.ports.iter().enumerate() {
                    if *p == 0 || *p > 65535 {
                        return Err(err(
                            format!("network.{key}[{i}].ports[{j}]"),
                            format!("port {p} is outside 1-65535"),
                        ));
                    }
                }
            }
        }
        for (i, h) in list.hosts.iter().enumerate() {
            check_host_pattern(h).map_err(|m| err(format!("network.hosts[{i}]"), m))?;
        }
        Ok(())
    }
}

/// A set of destination ports: only these, or all but these. Port 0 stands for traffic that has
/// no port (ICMP): a rule with a port list never matches it, a rule without one does.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ports {
    Only(BTreeSet<u16>),
    AllBut(BTreeSet<u16>),
}

impl Ports {
    fn none() -> Ports {
        Ports::Only(BTreeSet::new())
    }

    fn all() -> Ports {
        Ports::AllBut(BTreeSet::new())
    }

    fn of_rule(rule: &AllowRule) -> Ports {
        if rule.ports.is_empty() {
            return Ports::all();
        }
        // Validated to 1-65535; anything else matches nothing.
        Ports::Only(
            rule.ports
                .iter()
                .filter_map(|p| u16::try_from(*p).ok())
                .collect(),
        )
    }

    fn union(&self, o: &Ports) -> Ports {
        use Ports::*;
        match (self, o) {
            (Only(a), Only(b)) => Only(a | b),
            (Only(a), AllBut(b)) | (AllBut(b), Only(a)) => AllBut(b - a),
            (AllBut(a), AllBut(b)) => AllBut(a & b),
        }
    }

    fn minus(&self, o: &Ports) -> Ports {
        use Ports::*;
        match (self, o) {
            (Only(a), Only(b)) => Only(a - b),
            (Only(a), AllBut(b)) => Only(a & b),
            (AllBut(a), Only(b)) => AllBut(a | b),
            (AllBut(a), AllBut(b)) => Only(b - a),
        }
    }

    fn subset_of(&self, o: &Ports) -> bool {
        use Ports::*;
        match (self, o) {
            (Only(a), Only(b)) => a.is_subset(b),
            (Only(a), AllBut(b)) => a.is_disjoint(b),
            (AllBut(a), AllBut(b)) => b.is_subset(a),
            // Every port missing from `a` must be in `b`: only possible when the two lists
            // together name all 65536.
            (AllBut(a), Only(b)) => {
                a.len() + b.len() >= 1 << 16
                    && (0..=u16::MAX).all(|p| a.contains(&p) || b.contains(&p))
            }
        }
    }

    fn is_all(&self) -> bool {
        Ports::all().subset_of(self)
    }
}

/// A policy as address ranges with port sets, read the way the router reads it (allow, then
/// deny, then the default); host names apart (what they resolve to is not known here).
struct Ranges {
    allow: Vec<(u32, u32, Ports)>,
    deny: Vec<(u32, u32, Ports)>,
    default_allow: bool,
    hosts: Vec<String>,
}

impl Ranges {
    /// `None` when a CIDR does not parse (`validate` refuses such a policy first).
    fn of(p: &NetworkPolicy) -> Option<Ranges> {
        let mut r = Ranges {
            allow: Vec::new(),
            deny: Vec::new(),
            default_allow: false,
            hosts: Vec::new(),
        };
        match p {
            NetworkPolicy::Mode(NetworkMode::Full) => r.default_allow = true,
            NetworkPolicy::Mode(NetworkMode::None) | NetworkPolicy::Unset => {}
            NetworkPolicy::Allow(list) => {
                let range = |rule: &AllowRule| -> Option<(u32, u32, Ports)> {
                    let (addr, len) = parse_cidr(&rule.cidr).ok()?;
                    let start = u32::from(addr);
                    let size = if len == 0 {
                        u32::MAX
                    } else {
                        (1u32 << (32 - u32::from(len))) - 1
                    };
                    Some((start, start | size, Ports::of_rule(rule)))
                };
                r.allow = list.allow.iter().map(range).collect::<Option<_>>()?;
                r.deny = list.deny.iter().map(range).collect::<Option<_>>()?;
                r.default_allow = !list.default.is_deny();
                r.hosts = list.hosts.clone();
            }
        }
        Some(r)
    }

    /// The ports allowed to `addr` by the address rules (hosts apart).
    fn ports_to(&self, addr: u32) -> Ports {
        let covering = |rules: &[(u32, u32, Ports)]| {
            rules
                .iter()
                .filter(|(s, e, _)| (*s..=*e).contains(&addr))
                .fold(Ports::none(), |acc, (_, _, p)| acc.union(p))
        };
        let allowed = covering(&self.allow);
        if self.default_allow {
            allowed.union(&Ports::all().minus(&covering(&self.deny)))
        } else {
            allowed
        }
    }

    /// Every start of a range where some rule begins or ends.
    fn boundaries(&self, into: &mut BTreeSet<u32>) {
        for (s, e, _) in self.allow.iter().chain(&self.deny) {
            into.insert(*s);
            if let Some(next) = e.checked_add(1) {
                into.insert(next);
            }
        }
    }
}

/// Whether host pattern `outer` lets through every name `inner` does: the same name, or a
/// wildcard `*.s` over a name below `s` or over a narrower wildcard.
fn pattern_covers(outer: &str, inner: &str) -> bool {
    let inner = inner.trim_end_matches('.');
    match inner.strip_prefix("*.") {
        Some(suffix) => {
            let outer = outer.trim_end_matches('.');
            outer.eq_ignore_ascii_case(inner) || host_matches(outer, suffix)
        }
        None => host_matches(outer, inner),
    }
}

/// Whether `child` lets a sandbox reach nothing that `ceiling` (its template's policy, the
/// operator's ceiling) does not: every address and port `child` allows is allowed by
/// `ceiling`, and every host name on `child`'s list is on `ceiling`'s (or under one of its
/// wildcards), unless `ceiling` allows every address anyway. `none` narrows anything; a
/// ceiling of `none` (a template without a network) allows ingress only (`{"allow": []}`).
/// Exact: the address space is cut where any rule of either policy begins or ends, and each
/// piece compared as a whole.
pub fn narrows(child: &NetworkPolicy, ceiling: &NetworkPolicy) -> bool {
    if child.is_none() {
        return true;
    }
    let (Some(c), Some(top)) = (Ranges::of(child), Ranges::of(ceiling)) else {
        return false;
    };
    let mut cuts = BTreeSet::from([0u32]);
    c.boundaries(&mut cuts);
    top.boundaries(&mut cuts);
    let mut top_allows_all = true;
    for &start in &cuts {
        let top_ports = top.ports_to(start);
        top_allows_all &= top_ports.is_all();
        if !c.ports_to(start).subset_of(&top_ports) {
            return false;
        }
    }
    top_allows_all
        || c.hosts
            .iter()
            .all(|h| top.hosts.iter().any(|t| pattern_covers(t, h)))
}

/// Parses `a.b.c.d/len` (or a bare address, a /32) into the network address and prefix.
pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, l),
        None => (s, "32"),
    };
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|_| format!("{s:?} is not an IPv4 CIDR (a.b.c.d/len)"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| *l <= 32)
        .ok_or_else(|| format!("{s:?}: prefix length must be 0-32"))?;
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    Ok((Ipv4Addr::from(u32::from(addr) & mask), len))
}

/// A host name, or a wildcard `*.suffix` (any name below a valid host name suffix).
pub fn check_host_pattern(h: &str) -> Result<(), String> {
    match h.strip_prefix("*.") {
        Some(suffix) => check_host(suffix).map_err(|_| format!("{h:?} is not a valid host name")),
        None => check_host(h),
    }
}

/// Whether `name` (lower case, no trailing dot) matches `pattern`: the same name, or for
/// `*.suffix` any name that ends in `.suffix` (the suffix itself does not match).
pub fn host_matches(pattern: &str, name: &str) -> bool {
    let pattern = pattern.trim_end_matches('.');
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            name.len() > suffix.len() + 1
                && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
                && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        }
        None => pattern.eq_ignore_ascii_case(name),
    }
}

/// A DNS host name: dot-separated labels of letters, digits and inner hyphens.
pub fn check_host(h: &str) -> Result<(), String> {
    let name = h.strip_suffix('.').unwrap_or(h);
    let bad = || format!("{h:?} is not a valid host name");
    if name.is_empty() || name.len() > 253 || name.parse::<Ipv4Addr>().is_ok() {
        return Err(bad());
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !ok {
            return Err(bad());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> NetworkPolicy {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn shapes() {
        assert_eq!(parse(r#""none""#), NetworkPolicy::none());
        assert_eq!(parse(r#""full""#), NetworkPolicy::full());
        let p = parse(r#"{"allow":[{"cidr":"10.0.0.0/8","ports":[443]}],"hosts":["a.b"]}"#);
        assert!(p.validate().is_ok());
        assert!(!p.is_none());
        assert!(NetworkPolicy::Unset.is_none());
        assert!(serde_json::from_str::<NetworkPolicy>(r#""open""#).is_err());
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"allow":[],"x":1}"#).is_err());
        assert_eq!(
            serde_json::to_string(&NetworkPolicy::full()).unwrap(),
            "\"full\""
        );
    }

    #[test]
    fn deny_rules_and_default() {
        let p = parse(
            r#"{"default":"allow","deny":[{"cidr":"10.0.0.0/8"}],"hosts":["*.example.com"]}"#,
        );
        assert!(p.validate().is_ok());
        let NetworkPolicy::Allow(list) = &p else {
            panic!("{p:?}")
        };
        assert_eq!(list.default, Verdict::Allow);
        // A default-deny list serialises as before (no new keys).
        assert_eq!(
            serde_json::to_string(&parse(r#"{"allow":[]}"#)).unwrap(),
            r#"{"allow":[],"hosts":[]}"#
        );
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"default":"maybe"}"#).is_err());
    }

    #[test]
    fn wildcards_match_names_below_their_suffix() {
        assert!(host_matches("*.example.com", "a.example.com"));
        assert!(host_matches("*.example.com", "a.b.EXAMPLE.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
        assert!(host_matches("api.example.com.", "api.example.com"));
        assert!(!host_matches("api.example.com", "x.api.example.com"));
    }

    #[test]
    fn bad_input_names_the_field() {
        let e = parse(r#"{"allow":[{"cidr":"10.0.0.0/8"},{"cidr":"10.0.0.0/33"}]}"#)
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "network.allow[1].cidr");
        let e = parse(r#"{"allow":[{"cidr":"1.2.3.4","ports":[0]}]}"#)
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "network.allow[0].ports[0]");
        let e = parse(r#"{"hosts":["ok.example", "bad_name.example"]}"#)
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "network.hosts[1]");
        for bad in ["", "-a.b", "a..b", "1.2.3.4", &"x".repeat(64)] {
            assert!(check_host(bad).is_err(), "{bad:?}");
        }
        let e = parse(r#"{"deny":[{"cidr":"10.0.0.0/8"}]}"#)
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "network.deny");
        let e = parse(r#"{"default":"allow","deny":[{"cidr":"10.0.0.0/40"}]}"#)
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "network.deny[0].cidr");
        for bad in ["*", "*.", "**.a", "a.*.b", "*.-a"] {
            assert!(check_host_pattern(bad).is_err(), "{bad:?}");
        }
        for bad in ["nope", "1.2.3/8", "1.2.3.4/x", "300.1.1.1/8"] {
            assert!(parse_cidr(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_cidr("10.1.2.3/8").unwrap(),
            ("10.0.0.0".parse().unwrap(), 8)
        );
    }

    #[test]
    fn narrowing_examples() {
        let full = NetworkPolicy::full();
        let ingress = parse(r#"{"allow":[]}"#);
        let web =
            parse(r#"{"allow":[{"cidr":"10.0.0.0/8","ports":[443]}],"hosts":["*.example.com"]}"#);
        assert!(narrows(&web, &full));
        assert!(narrows(&ingress, &web));
        assert!(narrows(&NetworkPolicy::none(), &ingress));
        assert!(
            narrows(&ingress, &NetworkPolicy::none()),
            "no network: ingress only"
        );
        assert!(!narrows(&full, &web));
        assert!(!narrows(&web, &NetworkPolicy::Unset));
        // A narrower range, fewer ports, a name under the wildcard, a narrower wildcard.
        assert!(narrows(
            &parse(
                r#"{"allow":[{"cidr":"10.1.0.0/16","ports":[443]}],"hosts":["a.example.com","*.b.example.com"]}"#
            ),
            &web
        ));
        assert!(
            !narrows(&parse(r#"{"allow":[{"cidr":"10.1.0.0/16"}]}"#), &web),
            "all ports"
        );
        assert!(
            !narrows(&parse(r#"{"hosts":["example.com"]}"#), &web),
            "the suffix itself"
        );
        assert!(!narrows(&parse(r#"{"hosts":["other.org"]}"#), &web));
        // Under a default-allow ceiling with a deny rule, a name could resolve into the
        // denied range: refused; an address rule clear of it is fine.
        let no_ten = parse(r#"{"default":"allow","deny":[{"cidr":"10.0.0.0/8"}]}"#);
        assert!(!narrows(&parse(r#"{"hosts":["a.example.com"]}"#), &no_ten));
        assert!(narrows(
            &parse(r#"{"allow":[{"cidr":"192.168.0.0/16"}]}"#),
            &no_ten
        ));
        assert!(!narrows(
            &parse(r#"{"allow":[{"cidr":"10.2.0.0/16"}]}"#),
            &no_ten
        ));
        assert!(narrows(
            &parse(r#"{"default":"allow","deny":[{"cidr":"10.0.0.0/7"}]}"#),
            &no_ten
        ));
        assert!(!narrows(&full, &no_ten));
        // Full ceiling: any name.
        assert!(narrows(&parse(r#"{"hosts":["x.y"]}"#), &full));
        // A default-allow list without deny rules is as wide as full.
        assert!(narrows(&full, &parse(r#"{"default":"allow"}"#)));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        // A small world where a brute force over every address and port is exact: rules name
        // addresses of 10.0.0.0/28 (or all of IPv4) and ports 1-3; every address outside the
        // /28 behaves as 11.0.0.0 does, every port above 3 as port 4 does.
        fn rule() -> impl Strategy<Value = AllowRule> {
            let cidr = prop_oneof![
                (0u32..16, 28u8..=32).prop_map(|(a, l)| format!("10.0.0.{a}/{l}")),
                Just("0.0.0.0/0".to_string()),
            ];
            (cidr, proptest::collection::vec(1u32..=3, 0..3))
                .prop_map(|(cidr, ports)| AllowRule { cidr, ports })
        }

        fn policy(with_hosts: bool) -> impl Strategy<Value = NetworkPolicy> {
            let hosts = if with_hosts {
                proptest::collection::vec(
                    prop_oneof![
                        Just("a.example.com"),
                        Just("b.example.com"),
                        Just("*.example.com"),
                        Just("*.a.example.com"),
                        Just("x.a.example.com")
                    ]
                    .prop_map(String::from),
                    0..3,
                )
                .boxed()
            } else {
                Just(Vec::new()).boxed()
            };
            let list = (
                proptest::collection::vec(rule(), 0..4),
                proptest::collection::vec(rule(), 0..4),
                any::<bool>(),
                hosts,
            )
                .prop_map(|(allow, deny, default_allow, hosts)| {
                    NetworkPolicy::Allow(AllowList {
                        allow,
                        hosts,
                        deny: if default_allow { deny } else { Vec::new() },
                        default: if default_allow {
                            Verdict::Allow
                        } else {
                            Verdict::Deny
                        },
                    })
                });
            prop_oneof![
                1 => Just(NetworkPolicy::full()),
                1 => Just(NetworkPolicy::none()),
                6 => list,
            ]
        }

        /// The router's reading of a policy for one destination (hosts apart).
        fn allows(p: &NetworkPolicy, addr: Ipv4Addr, port: u16) -> bool {
            let hit = |r: &AllowRule| {
                let (net, len) = parse_cidr(&r.cidr).unwrap();
                let mask = if len == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(len))
                };
                u32::from(addr) & mask == u32::from(net)
                    && (r.ports.is_empty() || r.ports.contains(&u32::from(port)))
            };
            match p {
                NetworkPolicy::Mode(NetworkMode::Full) => true,
                NetworkPolicy::Mode(NetworkMode::None) | NetworkPolicy::Unset => false,
                NetworkPolicy::Allow(l) => {
                    l.allow.iter().any(hit) || (!l.deny.iter().any(hit) && !l.default.is_deny())
                }
            }
        }

        fn world() -> impl Iterator<Item = (Ipv4Addr, u16)> {
            (0u8..16)
                .map(|a| Ipv4Addr::new(10, 0, 0, a))
                .chain([Ipv4Addr::new(11, 0, 0, 0)])
                .flat_map(|a| (0u16..=4).map(move |p| (a, p)))
        }

        proptest! {
            #[test]
            fn narrowing_is_containment_of_what_is_reached(
                child in policy(false), ceiling in policy(false)
            ) {
                let contained = child.is_none()
                    || world().all(|(a, p)| !allows(&child, a, p) || allows(&ceiling, a, p));
                prop_assert_eq!(narrows(&child, &ceiling), contained);
            }

            #[test]
            fn a_policy_narrows_itself_and_full(p in policy(true)) {
                prop_assert!(narrows(&p, &p));
                prop_assert!(narrows(&p, &NetworkPolicy::full()));
                prop_assert!(narrows(&NetworkPolicy::none(), &p));
            }

            #[test]
            fn narrowing_is_transitive(
                a in policy(true), b in policy(true), c in policy(true)
            ) {
                if narrows(&a, &b) && narrows(&b, &c) {
                    prop_assert!(narrows(&a, &c), "{:?} < {:?} < {:?}", a, b, c);
                }
            }

            #[test]
            fn a_narrowing_child_reaches_nothing_its_ceiling_does_not(
                child in policy(true), ceiling in policy(true)
            ) {
                if narrows(&child, &ceiling) {
                    for (a, p) in world() {
                        prop_assert!(!allows(&child, a, p) || allows(&ceiling, a, p));
                    }
                }
            }
        }
    }
}
