//! E2B's egress options mapped onto torpor's network policy.
//!
//! E2B takes `allow_internet_access` and `network: {allowOut, denyOut, dnsServers}` at create,
//! and the same lists in `PUT /sandboxes/{id}/network`. Its rules: an allowed entry (a CIDR, a
//! bare IPv4 address or a host name, `*.example.com` included) always wins over a denied one
//! (CIDRs and addresses only); anything neither names is allowed; `allow_internet_access:
//! false` is `denyOut: ["0.0.0.0/0"]`; when `allowOut` holds a name, the `dnsServers`
//! (default 8.8.8.8) are allowed too. torpor's rule list has the same order (allow, then deny,
//! then the default), so the mapping is exact:
//!
//! | E2B | torpor |
//! |---|---|
//! | no `denyOut` | `"full"` (`allowOut` adds nothing) |
//! | `denyOut` holds a /0 | `{"allow": allowOut's CIDRs, "hosts": allowOut's names}` |
//! | other `denyOut` | the same plus `"deny": denyOut, "default": "allow"` |
//!
//! The template's policy is the operator's ceiling: with a template whose network is `full`
//! the mapping applies as it is; with a template that restricts egress (an allowlist, or no
//! network: ingress only), only `allow_internet_access: false` / `denyOut: ["0.0.0.0/0"]`
//! without `allowOut` (no egress at all) is accepted, and anything else is refused with 400
//! rather than widened or silently dropped. What E2B offers beyond filtering (`egressProxy`,
//! per-host `rules` that rewrite HTTPS requests, `httpsPorts`) is refused with 400 too.
//!
//! The E2B form is kept in the sandbox's metadata ([`META_EGRESS`]) so that `GET
//! /sandboxes/{id}` answers it back.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};
use torpor_core::network::{check_host_pattern, parse_cidr, AllowList, AllowRule, Verdict};
use torpor_core::NetworkPolicy;

use super::E2bError;

/// Metadata key: the E2B egress options as JSON ([`Egress`]).
pub const META_EGRESS: &str = "torpor.e2b.egress";
/// E2B's default DNS server, allowed when `allowOut` names a host.
const DEFAULT_DNS: &str = "8.8.8.8";
/// E2B accepts at most this many DNS servers.
const MAX_DNS_SERVERS: usize = 10;

/// E2B's egress options, as sent at create (`network` plus the top-level
/// `allow_internet_access`) or in `PUT /sandboxes/{id}/network`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Egress {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
}

impl Egress {
    /// Whether no filtering is asked for, so that the template's policy applies unchanged
    /// (`allow_internet_access: true` alone asks for what the template allows; `dnsServers`
    /// matter only with names in `allowOut`).
    pub fn is_empty(&self) -> bool {
        self.allow_out.is_none()
            && self.deny_out.is_none()
            && self.allow_internet_access != Some(false)
    }
}

/// Options E2B has and torpor does not implement: refused with a message, never ignored.
pub fn refuse_unsupported(
    egress_proxy: Option<&serde_json::Value>,
    rules: Option<&serde_json::Value>,
    https_ports: Option<&serde_json::Value>,
) -> Result<(), E2bError> {
    let set = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Object(m)) => !m.is_empty(),
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if set(egress_proxy) {
        return Err(E2bError::bad_request(
            "network.egressProxy is not supported by torpor: egress leaves through the worker's own NAT",
        ));
    }
    if set(rules) {
        return Err(E2bError::bad_request(
            "network.rules (per-host HTTPS request transforms) is not supported by torpor",
        ));
    }
    if set(https_ports) {
        return Err(E2bError::bad_request(
            "network.httpsPorts is not supported by torpor: its proxy reaches sandbox ports over plain HTTP",
        ));
    }
    Ok(())
}

/// The torpor policy for `egress` under a template whose policy is `template` (`None`: the
/// template has no network). Bad entries are refused naming the field.
pub fn policy(
    template_name: &str,
    template: Option<&NetworkPolicy>,
    egress: &Egress,
) -> Result<NetworkPolicy, E2bError> {
    let dns = egress.dns_servers.clone();
    if dns.as_ref().is_some_and(|d| d.len() > MAX_DNS_SERVERS) {
        return Err(E2bError::bad_request(format!(
            "network.dnsServers: at most {MAX_DNS_SERVERS} servers"
        )));
    }
    for (i, s) in dns.iter().flatten().enumerate() {
        if s.trim().parse::<Ipv4Addr>().is_err() {
            return Err(E2bError::bad_request(format!(
                "network.dnsServers[{i}]: {s:?} is not an IPv4 address"
            )));
        }
    }
    let base = super::ports::ingress_policy(template);
    if egress.is_empty() {
        return Ok(base);
    }
    let mut allow = Vec::new();
    let mut hosts = Vec::new();
    for (i, entry) in egress.allow_out.iter().flatten().enumerate() {
        let entry = entry.trim();
        if let Ok((addr, len)) = parse_cidr(entry) {
            allow.push(cidr_rule(addr, len));
        } else {
            check_host_pattern(entry).map_err(|m| {
                E2bError::bad_request(format!(
                    "network.allowOut[{i}]: {m} (expected a CIDR, an IPv4 address or a host name)"
                ))
            })?;
            hosts.push(entry.to_ascii_lowercase());
        }
    }
    let mut deny = Vec::new();
    let mut deny_all = egress.allow_internet_access == Some(false);
    for (i, entry) in egress.deny_out.iter().flatten().enumerate() {
        let (addr, len) = parse_cidr(entry.trim()).map_err(|m| {
            E2bError::bad_request(format!(
                "network.denyOut[{i}]: {m} (deny rules take CIDRs or IPv4 addresses, not names)"
            ))
        })?;
        deny_all |= len == 0;
        deny.push(cidr_rule(addr, len));
    }
    if !hosts.is_empty() {
        let servers = dns.unwrap_or_else(|| vec![DEFAULT_DNS.into()]);
        for s in servers {
            if let Ok(a) = s.trim().parse::<Ipv4Addr>() {
                allow.push(cidr_rule(a, 32));
            }
        }
    }
    let wanted = if deny_all {
        NetworkPolicy::Allow(AllowList {
            allow,
            hosts,
            ..AllowList::default()
        })
    } else if deny.is_empty() {
        NetworkPolicy::full()
    } else {
        NetworkPolicy::Allow(AllowList {
            allow,
            hosts,
            deny,
            default: Verdict::Allow,
        })
    };
    let ingress_only = NetworkPolicy::Allow(AllowList::default());
    let template_full = matches!(template, Some(p) if *p == NetworkPolicy::full());
    if template_full || wanted == ingress_only || within(&wanted, &base) {
        return Ok(wanted);
    }
    Err(E2bError::bad_request(format!(
        "template {template_name:?} limits egress (its network policy is {}); under it allowOut \
         and denyOut may only narrow it (denyOut 0.0.0.0/0 with allowOut addresses or CIDRs \
         inside it, or allow_internet_access=false); a template whose network is \"full\" \
         takes any",
        serde_json::to_string(&base).unwrap_or_default()
    )))
}

/// Whether `wanted` lets through nothing `ceiling` does not: an allowlist of CIDRs (no
/// names, no deny rules, nothing by default) each inside a CIDR the ceiling allows on every
/// port. (Names are not: what a name resolves to is known only when it is looked up.)
pub fn within(wanted: &NetworkPolicy, ceiling: &NetworkPolicy) -> bool {
    let (NetworkPolicy::Allow(w), NetworkPolicy::Allow(c)) = (wanted, ceiling) else {
        return false;
    };
    let plain = |l: &AllowList| l.default == Verdict::Deny && l.deny.is_empty();
    if !plain(w) || !plain(c) || !w.hosts.is_empty() {
        return false;
    }
    w.allow.iter().all(|r| {
        let Ok(inner) = parse_cidr(&r.cidr) else {
            return false;
        };
        c.allow.iter().any(|o| {
            o.ports.is_empty() && parse_cidr(&o.cidr).is_ok_and(|outer| cidr_contains(outer, inner))
        })
    })
}

/// Whether network `outer` holds network `inner`.
fn cidr_contains((a, l): (Ipv4Addr, u8), (b, m): (Ipv4Addr, u8)) -> bool {
    let mask = |len: u8| {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - len as u32)
        }
    };
    m >= l && (u32::from(a) & mask(l)) == (u32::from(b) & mask(l))
}

fn cidr_rule(addr: Ipv4Addr, len: u8) -> AllowRule {
    AllowRule {
        cidr: format!("{addr}/{len}"),
        ports: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egress(allow: &[&str], deny: &[&str]) -> Egress {
        Egress {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            ..Egress::default()
        }
    }

    fn full() -> Option<NetworkPolicy> {
        Some(NetworkPolicy::full())
    }

    fn list(p: NetworkPolicy) -> AllowList {
        match p {
            NetworkPolicy::Allow(l) => l,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn e2b_rules_map_onto_torpor_rules() {
        // Nothing asked: the template decides.
        assert_eq!(
            policy("t", full().as_ref(), &Egress::default()).unwrap(),
            NetworkPolicy::full()
        );
        assert_eq!(
            policy("t", None, &Egress::default()).unwrap(),
            NetworkPolicy::Allow(AllowList::default())
        );
        // No deny: everything (allowOut adds nothing).
        let p = policy("t", full().as_ref(), &egress(&["1.1.1.1"], &[])).unwrap();
        assert_eq!(p, NetworkPolicy::full());
        // Deny all, allow some: an allowlist, with the default DNS server for names.
        let l = list(
            policy(
                "t",
                full().as_ref(),
                &egress(&["1.1.1.1", "8.8.4.0/24", "*.Example.com"], &["0.0.0.0/0"]),
            )
            .unwrap(),
        );
        let cidrs: Vec<&str> = l.allow.iter().map(|r| r.cidr.as_str()).collect();
        assert_eq!(cidrs, ["1.1.1.1/32", "8.8.4.0/24", "8.8.8.8/32"]);
        assert_eq!(l.hosts, ["*.example.com"]);
        assert_eq!(l.default, Verdict::Deny);
        assert!(NetworkPolicy::Allow(l).validate().is_ok());
        // allow_internet_access=false is a deny of everything.
        let e = Egress {
            allow_internet_access: Some(false),
            dns_servers: Some(vec![]),
            allow_out: Some(vec!["api.example.com".into()]),
            ..Egress::default()
        };
        let l = list(policy("t", full().as_ref(), &e).unwrap());
        assert!(l.allow.is_empty(), "dnsServers [] allows no server");
        // A partial deny: default allow, the allowed entries still win.
        let l = list(
            policy(
                "t",
                full().as_ref(),
                &egress(&["10.1.2.3"], &["10.0.0.0/8"]),
            )
            .unwrap(),
        );
        assert_eq!(l.default, Verdict::Allow);
        assert_eq!(l.deny[0].cidr, "10.0.0.0/8");
        assert_eq!(l.allow[0].cidr, "10.1.2.3/32");
        assert!(NetworkPolicy::Allow(l).validate().is_ok());
    }

    #[test]
    fn a_restricting_template_is_only_narrowed() {
        let tpl: NetworkPolicy =
            serde_json::from_str(r#"{"allow":[{"cidr":"10.0.0.0/8"}]}"#).unwrap();
        let no_internet = Egress {
            allow_internet_access: Some(false),
            ..Egress::default()
        };
        for t in [None, Some(&tpl)] {
            assert_eq!(
                policy("t", t, &no_internet).unwrap(),
                NetworkPolicy::Allow(AllowList::default())
            );
            // A narrower allowlist inside the ceiling is taken as it is.
            let inside = policy(
                "t",
                Some(&tpl),
                &egress(&["10.1.2.3", "10.9.0.0/16"], &["0.0.0.0/0"]),
            );
            let cidrs: Vec<String> = list(inside.unwrap())
                .allow
                .into_iter()
                .map(|r| r.cidr)
                .collect();
            assert_eq!(cidrs, ["10.1.2.3/32", "10.9.0.0/16"]);
            assert!(policy("t", Some(&tpl), &egress(&["10.0.0.0/7"], &["0.0.0.0/0"])).is_err());
            assert!(policy(
                "t",
                Some(&tpl),
                &egress(&["api.example.com"], &["0.0.0.0/0"])
            )
            .is_err());
            let e = policy("t", t, &egress(&["1.1.1.1"], &["0.0.0.0/0"])).unwrap_err();
            assert!(
                e.message.contains("template \"t\" limits egress"),
                "{}",
                e.message
            );
            assert!(policy("t", t, &egress(&[], &["10.0.0.0/8"])).is_err());
        }
    }

    #[test]
    fn bad_entries_name_their_field() {
        let e = policy("t", full().as_ref(), &egress(&["1.1.1.1", "no pe"], &[])).unwrap_err();
        assert!(
            e.message.starts_with("network.allowOut[1]"),
            "{}",
            e.message
        );
        let e = policy("t", full().as_ref(), &egress(&[], &["example.com"])).unwrap_err();
        assert!(e.message.starts_with("network.denyOut[0]"), "{}", e.message);
        let e = policy("t", full().as_ref(), &egress(&[], &["1.2.3.4/33"])).unwrap_err();
        assert!(e.message.starts_with("network.denyOut[0]"), "{}", e.message);
        let e = Egress {
            dns_servers: Some(vec!["dns.google".into()]),
            ..Egress::default()
        };
        let e = policy("t", full().as_ref(), &e).unwrap_err();
        assert!(
            e.message.starts_with("network.dnsServers[0]"),
            "{}",
            e.message
        );
        assert!(
            refuse_unsupported(Some(&serde_json::json!({"address": "p:1080"})), None, None)
                .is_err()
        );
        assert!(refuse_unsupported(None, Some(&serde_json::json!({})), None).is_ok());
        assert!(refuse_unsupported(None, None, Some(&serde_json::json!([8443]))).is_err());
    }
}
