//! NVIDIA devices in a container: the OCI `linux.devices` entries and device cgroup rules for
//! a GPU share's device nodes, and whether runsc can pass them through (`--nvproxy`).
//!
//! gVisor gives a sandbox a GPU only through nvproxy: the sentry opens the host's
//! `/dev/nvidia*` nodes listed in the spec and proxies the driver's ioctls. A runsc without
//! the flag (Debian's 20221219 build) cannot, and a GPU sandbox must then be refused rather
//! than started without its GPU.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// runsc's flag that turns nvproxy on.
pub const NVPROXY_FLAG: &str = "--nvproxy=true";

/// One character device given to a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode {
    pub path: PathBuf,
    pub major: u32,
    pub minor: u32,
    /// Permission bits of the host node (0o666 for the NVIDIA nodes).
    pub file_mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Why a device node could not be given to a container.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{path}: {source}")]
    Stat {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a character device")]
    NotCharDevice { path: PathBuf },
}

impl DeviceError {
    pub fn code(&self) -> &'static str {
        match self {
            DeviceError::Stat { .. } => "gpu_device_missing",
            DeviceError::NotCharDevice { .. } => "gpu_device_invalid",
        }
    }
}

/// Reads a host device node's numbers (it must exist and be a character device).
pub fn device_node(path: &Path) -> Result<DeviceNode, DeviceError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).map_err(|source| DeviceError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_char_device() {
        return Err(DeviceError::NotCharDevice {
            path: path.to_path_buf(),
        });
    }
    let rdev = meta.rdev();
    Ok(DeviceNode {
        path: path.to_path_buf(),
        major: libc::major(rdev),
        minor: libc::minor(rdev),
        file_mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
    })
}

/// Reads every node of `paths`, all or nothing.
pub fn device_nodes(paths: &[PathBuf]) -> Result<Vec<DeviceNode>, DeviceError> {
    paths.iter().map(|p| device_node(p)).collect()
}

/// The OCI `linux.devices` entries for `nodes` (same path inside as outside).
pub fn oci_devices(nodes: &[DeviceNode]) -> Vec<serde_json::Value> {
    nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "path": n.path,
                "type": "c",
                "major": n.major,
                "minor": n.minor,
                "fileMode": n.file_mode,
                "uid": n.uid,
                "gid": n.gid,
            })
        })
        .collect()
}

/// The device cgroup rules (`linux.resources.devices`) that let the container read and write
/// `nodes` (and nothing more is opened up).
pub fn oci_device_rules(nodes: &[DeviceNode]) -> Vec<serde_json::Value> {
    nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "allow": true,
                "type": "c",
                "major": n.major,
                "minor": n.minor,
                "access": "rw",
            })
        })
        .collect()
}

/// Whether runsc's `runsc flags` output offers nvproxy.
pub fn flags_have_nvproxy(flags_output: &str) -> bool {
    flags_output.lines().any(|l| {
        let l = l.trim_start();
        l.starts_with("-nvproxy ")
            || l.starts_with("-nvproxy=")
            || l == "-nvproxy"
            || l.starts_with("--nvproxy ")
            || l.starts_with("--nvproxy=")
            || l == "--nvproxy"
    })
}

/// The extra runsc flags for a container given `devices`: none without devices, `--nvproxy`
/// with them; `Err` when runsc has no nvproxy (the container must not start without its GPU).
pub fn runsc_gpu_flags(has_devices: bool, nvproxy: bool) -> Result<Vec<String>, NoNvproxy> {
    match (has_devices, nvproxy) {
        (false, _) => Ok(Vec::new()),
        (true, true) => Ok(vec![NVPROXY_FLAG.to_owned()]),
        (true, false) => Err(NoNvproxy),
    }
}

/// runsc cannot give a sandbox a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the installed runsc has no --nvproxy flag, so a sandbox cannot be given a GPU; install a runsc release with nvproxy (2023 or later)")]
pub struct NoNvproxy;

#[cfg(test)]
mod tests {
    use super::*;

    fn node(path: &str, major: u32, minor: u32) -> DeviceNode {
        DeviceNode {
            path: path.into(),
            major,
            minor,
            file_mode: 0o666,
            uid: 0,
            gid: 0,
        }
    }

    #[test]
    fn oci_entries_and_rules_for_nvidia_nodes() {
        let nodes = vec![
            node("/dev/nvidiactl", 195, 255),
            node("/dev/nvidia3", 195, 3),
            node("/dev/nvidia-caps/nvidia-cap21", 237, 21),
        ];
        let devices = oci_devices(&nodes);
        assert_eq!(
            devices[1],
            serde_json::json!({"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3,
                "fileMode": 0o666, "uid": 0, "gid": 0})
        );
        assert_eq!(devices[2]["path"], "/dev/nvidia-caps/nvidia-cap21");
        let rules = oci_device_rules(&nodes);
        assert_eq!(
            rules[0],
            serde_json::json!({"allow": true, "type": "c", "major": 195, "minor": 255, "access": "rw"})
        );
        assert_eq!(rules.len(), 3);
    }

    #[test]
    fn reads_a_real_character_device_and_refuses_others() {
        let null = device_node(Path::new("/dev/null")).unwrap();
        assert_eq!((null.major, null.minor), (1, 3));
        let err = device_node(Path::new("/dev/nvidia-torpor-test-absent")).unwrap_err();
        assert_eq!(err.code(), "gpu_device_missing");
        let err = device_node(Path::new("/")).unwrap_err();
        assert_eq!(err.code(), "gpu_device_invalid");
        assert!(device_nodes(&["/dev/null".into(), "/nope".into()]).is_err());
    }

    #[test]
    fn nvproxy_detection_from_runsc_flags() {
        // `runsc flags` of a 2024 release (excerpt) and of Debian's 20221219 (excerpt).
        let new = "  -network string\n    \tspecifies which network to use\n  -nvproxy\n    \tEXPERIMENTAL: enable support for Nvidia GPUs\n  -nvproxy-docker\n    \tDEPRECATED\n";
        let old = "  -network string\n    \tspecifies which network to use\n  -num-network-channels int\n";
        assert!(flags_have_nvproxy(new));
        assert!(!flags_have_nvproxy(old));
        assert!(!flags_have_nvproxy("  -nvproxy-docker\n"));
        assert_eq!(runsc_gpu_flags(false, false), Ok(vec![]));
        assert_eq!(
            runsc_gpu_flags(true, true),
            Ok(vec!["--nvproxy=true".to_owned()])
        );
        assert_eq!(runsc_gpu_flags(true, false), Err(NoNvproxy));
    }
}
