//! A sandbox's network policy: what it may reach.
//!
//! JSON shapes: `"none"` (no network interface at all, the default), `"full"` (any
//! destination), or an allowlist `{"allow": [{"cidr": "10.0.0.0/8", "ports": [443]}],
//! "hosts": ["api.example.com"]}`. Only IPv4 destinations are modelled.

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
    #[serde(default)]
    pub hosts: Vec<String>,
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
        for (i, rule) in list.allow.iter().enumerate() {
            parse_cidr(&rule.cidr).map_err(|m| err(format!("network.allow[{i}].cidr"), m))?;
            for (j, p) in rule.ports.iter().enumerate() {
                if *p == 0 || *p > 65535 {
                    return Err(err(
                        format!("network.allow[{i}].ports[{j}]"),
                        format!("port {p} is outside 1-65535"),
                    ));
                }
            }
        }
        for (i, h) in list.hosts.iter().enumerate() {
            check_host(h).map_err(|m| err(format!("network.hosts[{i}]"), m))?;
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
        for bad in ["nope", "1.2.3/8", "1.2.3.4/x", "300.1.1.1/8"] {
            assert!(parse_cidr(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_cidr("10.1.2.3/8").unwrap(),
            ("10.0.0.0".parse().unwrap(), 8)
        );
    }
}
