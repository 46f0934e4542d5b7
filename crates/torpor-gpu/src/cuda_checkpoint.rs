//! `cuda-checkpoint` around a sandbox checkpoint: where the tool is, which processes hold a
//! GPU context, and the exact commands run inside the sandbox.
//!
//! With gVisor's nvproxy the CUDA processes run inside the sandbox, so the tool runs there
//! too (through the agent's exec): before the gVisor checkpoint,
//! `cuda-checkpoint --toggle --pid P` for every process holding a `/dev/nvidia*` file moves
//! its GPU state into host memory (which the gVisor checkpoint then saves); after the restore
//! the same command for the same pids (gVisor keeps pids) moves it back onto the GPU.
//!
//! The tool is looked for, in order: the configured path (`torpor up --cuda-checkpoint`,
//! `TORPOR_CUDA_CHECKPOINT`, a host file bind-mounted into the sandbox), the sandbox's own
//! root filesystem (its usual bin directories, through the template's bind mounts), then the
//! host `PATH` (bind-mounted like a configured one).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where a host `cuda-checkpoint` is mounted inside a sandbox (read-only).
pub const MOUNTED_TOOL: &str = "/.torpor-gpu/cuda-checkpoint";

/// Directories of a sandbox's root filesystem searched for `cuda-checkpoint`.
pub const SANDBOX_BIN_DIRS: [&str; 5] = [
    "/usr/local/cuda/bin",
    "/usr/local/bin",
    "/usr/bin",
    "/bin",
    "/opt/nvidia/bin",
];

/// How long one toggle may take (a large context copies gigabytes).
pub const TOGGLE_TIMEOUT_MS: u64 = 300_000;

/// A `cuda-checkpoint` a sandbox can run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    /// The path inside the sandbox.
    pub in_sandbox: String,
    /// A host file to bind-mount at `in_sandbox` (none when it is in the rootfs).
    pub host_mount: Option<PathBuf>,
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The host path behind `inside` for a sandbox whose root is `rootfs` with `mounts`
/// (`(host source, destination)` bind mounts; the longest matching destination wins).
pub fn host_path_of(inside: &str, rootfs: &Path, mounts: &[(PathBuf, String)]) -> PathBuf {
    let best = mounts
        .iter()
        .filter(|(_, dest)| {
            let dest = dest.trim_end_matches('/');
            inside == dest || inside.starts_with(&format!("{dest}/"))
        })
        .max_by_key(|(_, dest)| dest.len());
    match best {
        Some((source, dest)) => {
            let rest = inside[dest.trim_end_matches('/').len()..].trim_start_matches('/');
            if rest.is_empty() {
                source.clone()
            } else {
                source.join(rest)
            }
        }
        None => rootfs.join(inside.trim_start_matches('/')),
    }
}

/// Finds the `cuda-checkpoint` a sandbox would run, or `None` (the checkpoint of a sandbox
/// with a live GPU context is then refused with `checkpoint_gpu_context`).
pub fn locate(
    configured: Option<&Path>,
    rootfs: &Path,
    mounts: &[(PathBuf, String)],
    host_path_list: Option<&OsStr>,
) -> Option<Tool> {
    let mounted = |host: PathBuf| Tool {
        in_sandbox: MOUNTED_TOOL.to_owned(),
        host_mount: Some(host),
    };
    if let Some(path) = configured {
        return is_executable(path).then(|| mounted(path.to_path_buf()));
    }
    for dir in SANDBOX_BIN_DIRS {
        let inside = format!("{dir}/cuda-checkpoint");
        if is_executable(&host_path_of(&inside, rootfs, mounts)) {
            return Some(Tool {
                in_sandbox: inside,
                host_mount: None,
            });
        }
    }
    host_path_list
        .and_then(crate::sleep::find_cuda_checkpoint)
        .map(mounted)
}

/// The command (run inside the sandbox) that prints the pid of every process with an open
/// `/dev/nvidia*` file, one a line.
pub fn holders_command() -> Vec<String> {
    vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        "for d in /proc/[0-9]*; do for f in \"$d\"/fd/*; do case \"$(readlink \"$f\" 2>/dev/null)\" in /dev/nvidia*) echo \"${d#/proc/}\"; break;; esac; done; done".to_owned(),
    ]
}

/// Every path a sandbox's own `cuda-checkpoint` may have, in the order they are tried:
/// [`MOUNTED_TOOL`] (where a host's is mounted), then each of [`SANDBOX_BIN_DIRS`].
pub fn sandbox_candidates() -> Vec<String> {
    std::iter::once(MOUNTED_TOOL.to_owned())
        .chain(
            SANDBOX_BIN_DIRS
                .iter()
                .map(|dir| format!("{dir}/cuda-checkpoint")),
        )
        .collect()
}

/// The command (run inside the sandbox) that prints the first of [`sandbox_candidates`] it
/// can run, or nothing: how a controller finds the tool of a sandbox on a cluster worker,
/// whose files it cannot read.
pub fn locate_command() -> Vec<String> {
    vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        format!(
            "for p in {}; do if [ -f \"$p\" ] && [ -x \"$p\" ]; then echo \"$p\"; exit 0; fi; done",
            sandbox_candidates().join(" ")
        ),
    ]
}

/// The tool [`locate_command`] printed. The output comes from inside the sandbox, so only one
/// of the [`sandbox_candidates`] is taken; anything else finds none.
pub fn parse_located(stdout: &str) -> Option<Tool> {
    let line = stdout.lines().map(str::trim).find(|l| !l.is_empty())?;
    sandbox_candidates()
        .into_iter()
        .find(|c| c == line)
        .map(|in_sandbox| Tool {
            in_sandbox,
            host_mount: None,
        })
}

/// The pids in [`holders_command`]'s output, sorted and without repeats.
pub fn parse_holders(stdout: &str) -> Result<Vec<u32>, String> {
    let mut pids = stdout
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.parse::<u32>().map_err(|_| format!("not a pid: {l:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// `cuda-checkpoint --toggle --pid P`: suspends P's CUDA state into host memory, or, run
/// again, brings it back onto the GPU.
pub fn toggle_command(tool: &Tool, pid: u32) -> Vec<String> {
    vec![
        tool.in_sandbox.clone(),
        "--toggle".to_owned(),
        "--pid".to_owned(),
        pid.to_string(),
    ]
}

/// What a checkpoint taken with `cuda-checkpoint` must do after its restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Toggled {
    pub tool: Tool,
    pub pids: Vec<u32>,
}

impl Toggled {
    /// The commands that bring the GPU state back, in order.
    pub fn resume_commands(&self) -> Vec<Vec<String>> {
        self.pids
            .iter()
            .map(|p| toggle_command(&self.tool, *p))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn exe(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn host_paths_follow_the_template_mounts() {
        let root = Path::new("/data/t/rootfs");
        let mounts = vec![
            (PathBuf::from("/usr"), "/usr".to_owned()),
            (PathBuf::from("/opt/cuda"), "/usr/local/cuda".to_owned()),
        ];
        assert_eq!(
            host_path_of("/usr/bin/cuda-checkpoint", root, &mounts),
            PathBuf::from("/usr/bin/cuda-checkpoint")
        );
        assert_eq!(
            host_path_of("/usr/local/cuda/bin/cuda-checkpoint", root, &mounts),
            PathBuf::from("/opt/cuda/bin/cuda-checkpoint")
        );
        assert_eq!(
            host_path_of("/bin/cuda-checkpoint", root, &mounts),
            PathBuf::from("/data/t/rootfs/bin/cuda-checkpoint")
        );
        assert_eq!(
            host_path_of("/usrx/bin/a", root, &mounts),
            PathBuf::from("/data/t/rootfs/usrx/bin/a")
        );
    }

    #[test]
    fn locates_configured_then_rootfs_then_path() {
        let dir = std::env::temp_dir().join(format!("torpor-gpu-locate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rootfs = dir.join("rootfs");
        let host_bin = dir.join("hostbin");
        std::fs::create_dir_all(&rootfs).unwrap();
        std::fs::create_dir_all(&host_bin).unwrap();
        let path_list = std::env::join_paths([&host_bin]).unwrap();
        // Nothing anywhere.
        assert_eq!(locate(None, &rootfs, &[], Some(&path_list)), None);
        // On the host PATH: mounted into the sandbox.
        exe(&host_bin.join("cuda-checkpoint"));
        assert_eq!(
            locate(None, &rootfs, &[], Some(&path_list)),
            Some(Tool {
                in_sandbox: MOUNTED_TOOL.into(),
                host_mount: Some(host_bin.join("cuda-checkpoint")),
            })
        );
        // In the rootfs: run where it is, no mount.
        exe(&rootfs.join("usr/local/bin/cuda-checkpoint"));
        assert_eq!(
            locate(None, &rootfs, &[], Some(&path_list)),
            Some(Tool {
                in_sandbox: "/usr/local/bin/cuda-checkpoint".into(),
                host_mount: None,
            })
        );
        // Configured wins; a configured path that is not executable finds nothing.
        let configured = dir.join("cc");
        assert_eq!(locate(Some(&configured), &rootfs, &[], None), None);
        exe(&configured);
        assert_eq!(
            locate(Some(&configured), &rootfs, &[], Some(&path_list))
                .unwrap()
                .host_mount,
            Some(configured)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn commands_and_holder_parsing() {
        let cmd = holders_command();
        assert_eq!(cmd[0], "/bin/sh");
        assert!(cmd[2].contains("/dev/nvidia*"));
        assert_eq!(parse_holders("12\n7\n12\n\n"), Ok(vec![7, 12]));
        assert!(parse_holders("12\nsh: boom\n").is_err());
        let tool = Tool {
            in_sandbox: "/usr/bin/cuda-checkpoint".into(),
            host_mount: None,
        };
        assert_eq!(
            toggle_command(&tool, 42),
            ["/usr/bin/cuda-checkpoint", "--toggle", "--pid", "42"]
        );
        let t = Toggled {
            tool,
            pids: vec![3, 9],
        };
        assert_eq!(t.resume_commands().len(), 2);
        assert_eq!(t.resume_commands()[1][3], "9");
    }

    #[test]
    fn the_located_tool_is_one_of_the_candidates_or_none() {
        let cmd = locate_command();
        assert_eq!(cmd[..2], ["/bin/sh", "-c"]);
        for c in sandbox_candidates() {
            assert!(cmd[2].contains(&c), "{c} searched: {}", cmd[2]);
        }
        assert_eq!(sandbox_candidates()[0], MOUNTED_TOOL);
        assert_eq!(
            parse_located("\n/usr/local/bin/cuda-checkpoint\n"),
            Some(Tool {
                in_sandbox: "/usr/local/bin/cuda-checkpoint".into(),
                host_mount: None,
            })
        );
        assert_eq!(
            parse_located(MOUNTED_TOOL).map(|t| t.in_sandbox),
            Some(MOUNTED_TOOL.to_owned())
        );
        // What a sandbox prints is not trusted: a path of its choosing finds nothing.
        assert_eq!(parse_located("/tmp/cuda-checkpoint"), None);
        assert_eq!(parse_located("/usr/bin/cuda-checkpoint; rm -rf /"), None);
        assert_eq!(parse_located(""), None);
        // Run by a real shell on this machine: the first executable candidate (none here).
        let out = std::process::Command::new(&cmd[0])
            .args(&cmd[1..])
            .output()
            .unwrap();
        assert!(out.status.success());
        let first = sandbox_candidates()
            .into_iter()
            .find(|c| is_executable(Path::new(c)));
        assert_eq!(
            parse_located(&String::from_utf8_lossy(&out.stdout)).map(|t| t.in_sandbox),
            first
        );
    }

    /// The holder scan on this machine's /proc: a process holding a file named like an
    /// NVIDIA device is not possible without one, so the scan must print nothing, run by a
    /// real shell.
    #[test]
    fn holder_scan_runs_in_a_real_shell() {
        let cmd = holders_command();
        let out = std::process::Command::new(&cmd[0])
            .args(&cmd[1..])
            .output()
            .unwrap();
        assert!(out.status.success());
        let pids = parse_holders(&String::from_utf8_lossy(&out.stdout)).unwrap();
        if !Path::new("/dev/nvidiactl").exists() {
            assert!(pids.is_empty(), "{pids:?}");
        }
    }
}
