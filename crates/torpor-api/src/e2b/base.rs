//! E2B's `base` template on torpor: the operator's template that E2B code gets by default.
//!
//! It is a `host`-kind template (the host's `/usr` read-only, an `/etc` torpor writes, whose
//! `passwd` has `user`, uid 1000) whose main process is the agent's sudo broker
//! (`torpor_runtime::agent::sudo`): at boot it makes `/home/user` (owned by `user`), puts
//! `sudo` and, when the host has no `python`, a `python` link to `python3` into
//! `/opt/torpor/bin` (first on the template's `PATH`), and serves `sudo` for `user`. The
//! agent's [`FILE_OWNER`](torpor_runtime::agent::FILE_OWNER) makes files written through the
//! SDK belong to `user`. Commands run as `user` unless the SDK names `root`.
//!
//! It is registered for the admin the first time an E2B sandbox asks for it (one boot and
//! golden checkpoint, a second or two), and found as it is after a restart.
//!
//! Egress: `base`'s network policy, the ceiling of its sandboxes' egress (enforced by the
//! engine, as every template's), is the operator's `torpor up --e2b-egress-ceiling`
//! ([`set_egress_ceiling`]); without it, ingress only. The host's addresses stay closed
//! whatever it says (torpor's host guard, `--sandbox-reach-host` only).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use torpor_core::{NetworkPolicy, TemplateName, TemplateSource, TemplateSpec, TenantId};
use torpor_runtime::agent::sudo;
use torpor_runtime::proto::RunAs;

use super::{E2b, E2bError};

/// E2B's default template name.
pub const BASE: &str = "base";
/// The user E2B's `base` runs commands as (torpor's `/etc/passwd` has it).
pub const USER: RunAs = RunAs {
    uid: 1000,
    gid: 1000,
};
pub const USER_NAME: &str = "user";
pub const USER_HOME: &str = "/home/user";

/// How long the template's boot may run before its golden checkpoint: the broker's layout
/// takes a few milliseconds.
const WARMUP_MS: u64 = 300;

/// The template's spec, under egress ceiling `network` (`None`: ingress only).
pub fn spec(network: Option<NetworkPolicy>) -> TemplateSpec {
    let env: BTreeMap<String, String> = [
        ("PATH".to_string(), sudo::SECURE_PATH.to_string()),
        (
            torpor_runtime::agent::FILE_OWNER.to_string(),
            format!("{}:{}", USER.uid, USER.gid),
        ),
    ]
    .into();
    TemplateSpec {
        name: TemplateName::new(BASE).expect("valid name"),
        source: TemplateSource::Host,
        command: torpor_runtime::rootfs::agent_argv(&[
            sudo::SERVER_FLAG.to_string(),
            USER_NAME.to_string(),
        ]),
        env,
        cwd: None,
        limits: Default::default(),
        idle: Default::default(),
        warmup_ms: WARMUP_MS,
        gpu: None,
        network,
    }
}

/// Where `base` stands for this daemon.
#[derive(Debug, Default, PartialEq)]
pub enum BaseState {
    /// Not looked at yet.
    #[default]
    Unchecked,
    /// Built under another ceiling and still used by sandboxes: looked at again at each
    /// create, rebuilt once they are gone.
    InUseUnderOldCeiling,
    /// Built under the operator's current ceiling.
    Current,
}

/// Makes sure `base` exists for the admin under the operator's current ceiling before an E2B
/// create uses it: built the first time (callers wait for it), rebuilt when it was built
/// under another ceiling and no sandbox uses it any more (until then it keeps its former
/// ceiling, logged once). A failed build is tried again by the next create.
pub async fn ensure(st: &E2b) -> Result<(), E2bError> {
    let mut state = st.base_state.lock().await;
    if *state == BaseState::Current {
        return Ok(());
    }
    let admin = TenantId::admin();
    let name = TemplateName::new(BASE).expect("valid name");
    let want = egress_ceiling().filter(|p| !p.is_none());
    match st.api.engine.template(&admin, &name) {
        Ok(t) if t.spec.network == want => {
            *state = BaseState::Current;
            return Ok(());
        }
        Ok(t) => match st.api.engine.delete_template(&admin, &name).await {
            Ok(()) => tracing::info!(
                was = ?t.spec.network, now = ?want,
                "rebuilding E2B's base template under the new egress ceiling"
            ),
            Err(torpor_control::ControlError::TemplateInUse(_, n)) => {
                if *state != BaseState::InUseUnderOldCeiling {
                    tracing::warn!(
                        sandboxes = n, kept = ?t.spec.network, wanted = ?want,
                        "E2B's base keeps its former egress ceiling while sandboxes use it"
                    );
                }
                *state = BaseState::InUseUnderOldCeiling;
                return Ok(());
            }
            Err(e) => return Err(E2bError::from(e)),
        },
        Err(torpor_control::ControlError::NotFound { .. }) => {}
        Err(e) => return Err(E2bError::from(e)),
    }
    tracing::info!("building E2B's base template");
    st.api
        .engine
        .register_template(&admin, spec(want), &|_| {})
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "the base template could not be built");
            E2bError::from(e)
        })?;
    *state = BaseState::Current;
    Ok(())
}

/// Who an envd call acts as: the process's uid and gid (`None`: the agent's root), its name
/// and home.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Identity {
    pub run_as: Option<RunAs>,
    pub name: &'static str,
    pub home: &'static str,
}

/// The identity of a call: in a `base` sandbox `user` unless `root` is named (E2B's default
/// user); elsewhere root, with E2B's home unless `root` is named (the former behaviour).
pub fn identity(base: bool, user: Option<&str>) -> Identity {
    match (base, user) {
        (_, Some("root")) => Identity {
            run_as: None,
            name: "root",
            home: "/root",
        },
        (true, _) => Identity {
            run_as: Some(USER),
            name: USER_NAME,
            home: USER_HOME,
        },
        (false, _) => Identity {
            run_as: None,
            name: "root",
            home: USER_HOME,
        },
    }
}

/// The command prefix that runs a helper as `id`'s user (util-linux `setpriv`, from the
/// host's `/usr`), empty for root.
pub fn as_user(id: &Identity) -> Vec<String> {
    match id.run_as {
        Some(u) => vec![
            "setpriv".into(),
            format!("--reuid={}", u.uid),
            format!("--regid={}", u.gid),
            "--clear-groups".into(),
            "--".into(),
        ],
        None => Vec::new(),
    }
}

static CEILING: OnceLock<NetworkPolicy> = OnceLock::new();

/// Sets the egress ceiling of `base` (`torpor up --e2b-egress-ceiling`); once, at start.
pub fn set_egress_ceiling(policy: NetworkPolicy) {
    let _ = CEILING.set(policy);
}

/// `base`'s ceiling: the operator's, else none (ingress only).
pub fn egress_ceiling() -> Option<NetworkPolicy> {
    CEILING.get().cloned()
}

/// Parses `--e2b-egress-ceiling`: `none` (ingress only), `full`, or comma-separated CIDRs
/// (IPv4 addresses or networks) a sandbox may at most reach.
pub fn parse_ceiling(s: &str) -> Result<NetworkPolicy, String> {
    match s.trim() {
        "none" => Ok(NetworkPolicy::Allow(Default::default())),
        "full" => Ok(NetworkPolicy::full()),
        list => {
            let mut allow = Vec::new();
            for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (addr, len) = torpor_core::network::parse_cidr(part)
                    .map_err(|m| format!("{part:?}: {m} (none, full or CIDRs)"))?;
                allow.push(torpor_core::network::AllowRule {
                    cidr: format!("{addr}/{len}"),
                    ports: Vec::new(),
                });
            }
            if allow.is_empty() {
                return Err("none, full or a comma-separated list of CIDRs".into());
            }
            Ok(NetworkPolicy::Allow(torpor_core::network::AllowList {
                allow,
                ..Default::default()
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_act_as_user_in_base_unless_root_is_named() {
        let id = identity(true, None);
        assert_eq!((id.run_as, id.home), (Some(USER), "/home/user"));
        assert_eq!(identity(true, Some("user")).run_as, Some(USER));
        let root = identity(true, Some("root"));
        assert_eq!((root.run_as, root.home), (None, "/root"));
        assert_eq!(identity(false, None).run_as, None);
        assert_eq!(as_user(&identity(true, None))[0], "setpriv");
        assert!(as_user(&root).is_empty());
    }

    #[test]
    fn the_ceiling_flag_parses() {
        assert_eq!(parse_ceiling("full").unwrap(), NetworkPolicy::full());
        assert_eq!(
            parse_ceiling("none").unwrap(),
            NetworkPolicy::Allow(Default::default())
        );
        let NetworkPolicy::Allow(l) = parse_ceiling("10.0.0.0/8, 192.0.2.7").unwrap() else {
            panic!()
        };
        assert_eq!(l.allow[1].cidr, "192.0.2.7/32");
        assert!(parse_ceiling("example.com").is_err());
        assert!(parse_ceiling("").is_err());
    }

    #[test]
    fn the_spec_runs_the_sudo_broker_as_its_main_process() {
        let s = spec(None);
        assert!(s.validate().is_ok());
        assert!(s.command.iter().any(|a| a == sudo::SERVER_FLAG));
        assert_eq!(s.env["PATH"], sudo::SECURE_PATH);
    }
}
