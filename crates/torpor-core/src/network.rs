//! A sandbox's network policy: what it may reach.
//!
//! JSON shapes: `"none"` (no network interface at all, the default), `"full"` (any
//! destination), or a rule list `{"allow": [{"cidr": "10.0.0.0/8", "ports": [443]}],
//! "hosts": ["api.example.com", "*.example.org"]}`. A rule list is read in order: a
//! destination in `allow` (or an address one of `hosts` resolved to) is let through; else one
//! in `deny` is refused; else `default` decides (`"deny"` unless given). So
//! `{"default": "allow", "deny": [{"cidr": "10.0.0.0/8"}]}` is "anything but 10/8".
//! Only IPv4 destinations are modelled.

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
}
