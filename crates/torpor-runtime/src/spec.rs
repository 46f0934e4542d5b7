//! The OCI runtime spec (config.json) torpor writes for each container. Only the fields torpor
//! sets are modelled; runsc reads the rest as defaults.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use torpor_core::Limits;

use crate::cgroup;

/// Where the agent directory appears inside a sandbox.
pub const AGENT_MOUNT: &str = "/.torpor";

/// The directory of [`crate::proto::BOOT_ID_PATH`]: a tmpfs of its own in every sandbox.
pub const BOOT_ID_DIR: &str = "/proc/sys/kernel/random";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mount {
    pub destination: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

impl Mount {
    pub fn bind_ro(source: &str, destination: &str) -> Self {
        Mount {
            destination: destination.into(),
            kind: "bind".into(),
            source: source.into(),
            options: vec!["rbind".into(), "ro".into()],
        }
    }
}

/// Everything that differs between containers.
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    pub rootfs: PathBuf,
    /// Extra bind mounts (the host template's /usr, ...).
    pub mounts: Vec<Mount>,
    pub agent_dir: PathBuf,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub limits: Limits,
    pub hostname: String,
    /// The network namespace (a path under /run/netns) holding the sandbox's link; `None`
    /// runs with no network at all (runsc `--network=none`).
    pub netns: Option<PathBuf>,
    /// Host character devices given to the container (a GPU share's `/dev/nvidia*` nodes);
    /// non-empty only where runsc has nvproxy.
    pub devices: Vec<crate::gpu::DeviceNode>,
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The CFS quota and period (µs) for a CPU limit.
pub fn cpu_quota(limits: &Limits) -> (i64, u64) {
    let period: u64 = 100_000;
    ((limits.cpus * period as f64).round() as i64, period)
}

/// The config.json of a container that runs in the cgroup `torpor/<cgroup>`.
pub fn render(spec: &ContainerSpec, cgroup: &str) -> serde_json::Value {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), "/root".into());
    env.insert("LANG".into(), "C.UTF-8".into());
    env.extend(spec.env.clone());
    let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();

    let mut mounts = vec![
        serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        // gVisor's procfs has no `sys/kernel/random`: a small tmpfs there holds the boot id the
        // agent writes (`proto::BOOT_ID_PATH`), checkpointed with the sandbox like /tmp.
        serde_json::json!({"destination": BOOT_ID_DIR, "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "noexec", "nodev", "mode=755", "size=16k"]}),
        serde_json::json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        serde_json::json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"]}),
        serde_json::json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}),
    ];
    for m in &spec.mounts {
        mounts.push(serde_json::to_value(m).expect("mount serialises"));
    }
    mounts.push(
        serde_json::to_value(Mount::bind_ro(
            &spec.agent_dir.to_string_lossy(),
            AGENT_MOUNT,
        ))
        .expect("mount serialises"),
    );

    let (quota, period) = cpu_quota(&spec.limits);
    let network_ns = match &spec.netns {
        Some(path) => serde_json::json!({"type": "network", "path": path}),
        None => serde_json::json!({"type": "network"}),
    };
    let mut resources = serde_json::json!({
        "memory": {"limit": spec.limits.memory_bytes()},
        "cpu": {"quota": quota, "period": period},
        "pids": {"limit": host_pids_limit(spec.limits.pids)}
    });
    let mut linux = serde_json::json!({
        "namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
            network_ns
        ],
        "cgroupsPath": cgroup::cgroups_path(cgroup),
    });
    if !spec.devices.is_empty() {
        linux["devices"] = crate::gpu::oci_devices(&spec.devices).into();
        resources["devices"] = crate::gpu::oci_device_rules(&spec.devices).into();
    }
    linux["resources"] = resources;
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": spec.argv,
            "env": env,
            "cwd": spec.cwd,
            "capabilities": {
                "bounding": CAPS, "effective": CAPS, "permitted": CAPS, "inheritable": CAPS
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536u64, "soft": 65536u64}],
            "noNewPrivileges": true
        },
        "root": {"path": spec.rootfs, "readonly": false},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": linux
    })
}

/// The host-side pids limit for a sandbox whose guest may run `pids` tasks. The host cgroup
/// also holds gVisor's own threads (the sentry's Go runtime, the gofer) and, on the ptrace
/// platform, one stub thread per guest thread; without headroom a small limit makes the sentry
/// itself fail to clone and the whole sandbox die.
pub fn host_pids_limit(pids: u64) -> u64 {
    pids.saturating_mul(2).saturating_add(256)
}

/// The capabilities of root inside the sandbox (gVisor implements them in its own kernel).
const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_limits_and_agent_mount() {
        let spec = ContainerSpec {
            rootfs: "/r".into(),
            mounts: vec![Mount::bind_ro("/usr", "/usr")],
            agent_dir: "/data/agent/x".into(),
            argv: vec!["/.torpor/ld.so".into()],
            env: [("A".to_string(), "1".to_string())].into(),
            cwd: "/".into(),
            limits: Limits {
                memory_mib: 64,
                cpus: 0.5,
                pids: 10,
            },
            hostname: "sb".into(),
            netns: None,
            devices: Vec::new(),
        };
        let v = render(&spec, "sb-x-g1");
        assert!(v["linux"].get("devices").is_none());
        assert!(v["linux"]["resources"].get("devices").is_none());
        let mut gpu = spec.clone();
        gpu.devices = vec![crate::gpu::DeviceNode {
            path: "/dev/nvidia0".into(),
            major: 195,
            minor: 0,
            file_mode: 0o666,
            uid: 0,
            gid: 0,
        }];
        let g = render(&gpu, "sb-x-g1");
        assert_eq!(g["linux"]["devices"][0]["path"], "/dev/nvidia0");
        assert_eq!(g["linux"]["resources"]["devices"][0]["major"], 195);
        assert_eq!(
            g["linux"]["resources"]["memory"],
            v["linux"]["resources"]["memory"]
        );
        assert_eq!(v["linux"]["resources"]["memory"]["limit"], 64 << 20);
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert_eq!(v["linux"]["cgroupsPath"], "/torpor/sb-x-g1");
        let mounts = v["mounts"].as_array().unwrap();
        assert!(mounts.iter().any(|m| m["destination"] == "/.torpor"));
        // The boot id's tmpfs comes after /proc (so it lies over it) and holds the id's file.
        let at = |d: &str| mounts.iter().position(|m| m["destination"] == d).unwrap();
        assert!(at(BOOT_ID_DIR) > at("/proc"));
        assert_eq!(mounts[at(BOOT_ID_DIR)]["type"], "tmpfs");
        assert_eq!(
            std::path::Path::new(crate::proto::BOOT_ID_PATH).parent(),
            Some(std::path::Path::new(BOOT_ID_DIR))
        );
        assert!(v["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "A=1"));
    }
}
