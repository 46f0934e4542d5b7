//! Between the node seam's types and the protocol's messages, and between runtime errors and
//! gRPC statuses (an error's kind travels in the `torpor-error` metadata entry, so the
//! controller gets back the same `RuntimeError` variant the worker's node returned).

use std::path::PathBuf;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use torpor_runtime::conn::ConnError;
use torpor_runtime::gpu::DeviceNode;
use torpor_runtime::net::NetStats;
use torpor_runtime::node::{Launch, LaunchGpu, StoreAccess, StoredFiles};
use torpor_runtime::runsc::{ExitInfo, RuntimeError};
use torpor_runtime::spec::{ContainerSpec, Mount};
use torpor_runtime::warm::WarmStats;

use crate::pb;

/// The metadata entry naming a runtime error's kind.
pub const ERROR_KIND: &str = "torpor-error";

/// A protocol message the other side sent that does not decode.
pub fn bad(what: &str, e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{what}: {e}"))
}

pub fn launch_to_pb(l: &Launch) -> pb::LaunchRequest {
    let s = &l.spec;
    pb::LaunchRequest {
        container_id: l.container_id.clone(),
        spec: Some(pb::ContainerSpec {
            rootfs: s.rootfs.to_string_lossy().into_owned(),
            mounts: s
                .mounts
                .iter()
                .map(|m| pb::Mount {
                    destination: m.destination.clone(),
                    kind: m.kind.clone(),
                    source: m.source.clone(),
                    options: m.options.clone(),
                })
                .collect(),
            agent_dir: s.agent_dir.to_string_lossy().into_owned(),
            argv: s.argv.clone(),
            env: s.env.clone().into_iter().collect(),
            cwd: s.cwd.clone(),
            limits_json: serde_json::to_string(&s.limits).unwrap_or_default(),
            hostname: s.hostname.clone(),
            devices: s
                .devices
                .iter()
                .map(|d| pb::DeviceNode {
                    path: d.path.to_string_lossy().into_owned(),
                    major: d.major,
                    minor: d.minor,
                    file_mode: d.file_mode,
                    uid: d.uid,
                    gid: d.gid,
                })
                .collect(),
        }),
        network_json: l
            .network
            .as_ref()
            .map(|n| serde_json::to_string(n).unwrap_or_default())
            .unwrap_or_default(),
        ready_timeout_ms: l.ready_timeout.as_millis() as u64,
        stored: Some(pb::StoredFiles {
            rootfs: l.stored.rootfs.clone(),
            image: l.stored.image.clone(),
            keep_image: l.stored.keep_image,
            access: Some(access_to_pb(&l.stored.access)),
        }),
        gpu_request_json: l.gpu.as_ref().map(|g| g.request.clone()),
        gpu_quota_json: l.gpu.as_ref().and_then(|g| g.quota.clone()),
    }
}

pub fn access_to_pb(a: &StoreAccess) -> pb::StoreAccess {
    pb::StoreAccess {
        namespace: a.namespace.clone(),
        key: a.key.map(|k| k.to_vec()),
    }
}

pub fn access_from_pb(a: Option<pb::StoreAccess>) -> Result<StoreAccess, Status> {
    let a = a.unwrap_or_default();
    let key = match a.key {
        None => None,
        Some(k) => {
            Some(<[u8; 32]>::try_from(k.as_slice()).map_err(|_| bad("store key", "not 32 bytes"))?)
        }
    };
    Ok(StoreAccess {
        namespace: a.namespace,
        key,
    })
}

pub fn launch_from_pb(l: pb::LaunchRequest) -> Result<Launch, Status> {
    let s = l.spec.ok_or_else(|| bad("launch", "no spec"))?;
    let limits = serde_json::from_str(&s.limits_json).map_err(|e| bad("limits", e))?;
    let network = if l.network_json.is_empty() {
        None
    } else {
        Some(serde_json::from_str(&l.network_json).map_err(|e| bad("network policy", e))?)
    };
    Ok(Launch {
        container_id: l.container_id,
        spec: ContainerSpec {
            rootfs: PathBuf::from(s.rootfs),
            mounts: s
                .mounts
                .into_iter()
                .map(|m| Mount {
                    destination: m.destination,
                    kind: m.kind,
                    source: m.source,
                    options: m.options,
                })
                .collect(),
            agent_dir: PathBuf::from(s.agent_dir),
            argv: s.argv,
            env: s.env.into_iter().collect(),
            cwd: s.cwd,
            limits,
            hostname: s.hostname,
            netns: None,
            devices: s
                .devices
                .into_iter()
                .map(|d| DeviceNode {
                    path: PathBuf::from(d.path),
                    major: d.major,
                    minor: d.minor,
                    file_mode: d.file_mode,
                    uid: d.uid,
                    gid: d.gid,
                })
                .collect(),
        },
        network,
        ready_timeout: Duration::from_millis(l.ready_timeout_ms),
        stored: match l.stored {
            None => StoredFiles::default(),
            Some(st) => StoredFiles {
                rootfs: st.rootfs,
                image: st.image,
                keep_image: st.keep_image,
                image_on: None,
                access: access_from_pb(st.access)?,
            },
        },
        gpu: match (l.gpu_request_json, l.gpu_quota_json) {
            (Some(request), quota) => Some(LaunchGpu { request, quota }),
            (None, Some(_)) => return Err(bad("launch", "a GPU quota without a GPU request")),
            (None, None) => None,
        },
    })
}

pub fn net_to_pb(n: &NetStats) -> pb::NetStats {
    pb::NetStats {
        tx_bytes: n.tx_bytes,
        rx_bytes: n.rx_bytes,
        egress_connections: n.egress_connections,
        ingress_connections: n.ingress_connections,
        denied_packets: n.denied_packets,
        limited_packets: n.limited_packets,
        denied_by_destination: n
            .denied_by_destination
            .iter()
            .map(|(d, p)| pb::DeniedDestination {
                destination: d.clone(),
                packets: *p,
            })
            .collect(),
    }
}

pub fn net_from_pb(n: pb::NetStats) -> NetStats {
    NetStats {
        tx_bytes: n.tx_bytes,
        rx_bytes: n.rx_bytes,
        egress_connections: n.egress_connections,
        ingress_connections: n.ingress_connections,
        denied_packets: n.denied_packets,
        limited_packets: n.limited_packets,
        denied_by_destination: n
            .denied_by_destination
            .into_iter()
            .map(|d| (d.destination, d.packets))
            .collect(),
    }
}

pub fn warm_to_pb(w: &WarmStats) -> pb::WarmStatsReply {
    pb::WarmStatsReply {
        target: w.target as u64,
        ready: w.ready as u64,
        warm_takes: w.warm_takes,
        cold_takes: w.cold_takes,
        discarded: w.discarded,
    }
}

pub fn warm_from_pb(w: &pb::WarmStatsReply) -> WarmStats {
    WarmStats {
        target: w.target as usize,
        ready: w.ready as usize,
        warm_takes: w.warm_takes,
        cold_takes: w.cold_takes,
        discarded: w.discarded,
    }
}

pub fn exit_to_pb(e: &ExitInfo) -> pb::ExitInfo {
    pb::ExitInfo {
        code: e.code,
        signal: e.signal,
        oom_killed: e.oom_killed,
    }
}

pub fn exit_from_pb(e: Option<pb::ExitInfo>) -> ExitInfo {
    let e = e.unwrap_or_default();
    ExitInfo {
        code: e.code,
        signal: e.signal,
        oom_killed: e.oom_killed,
    }
}

/// A node's error as a status: its kind in [`ERROR_KIND`], its text as the message (the
/// controller logs it; its API turns runtime errors into a generic client message).
pub fn status_of(e: &RuntimeError) -> Status {
    let (code, kind) = match e {
        RuntimeError::Conn(ConnError::Closed) => (Code::Unavailable, "conn_closed"),
        RuntimeError::Conn(_) => (Code::Unavailable, "conn"),
        RuntimeError::AgentTimeout(..) => (Code::DeadlineExceeded, "agent_timeout"),
        RuntimeError::ExitedEarly(_) => (Code::Aborted, "exited_early"),
        RuntimeError::RunscMissing { .. } => (Code::FailedPrecondition, "runsc_missing"),
        RuntimeError::NoCapacity(_) => (Code::ResourceExhausted, "no_capacity"),
        RuntimeError::ImageLost(_) => (Code::NotFound, "image_lost"),
        RuntimeError::Gpu { code, message } => {
            // The GPU layer's code travels as the kind's suffix, its message as the message.
            let mut st = Status::new(Code::ResourceExhausted, message.clone());
            if let Ok(v) = MetadataValue::try_from(format!("gpu:{code}")) {
                st.metadata_mut().insert(ERROR_KIND, v);
            }
            return st;
        }
        _ => (Code::Internal, "runtime"),
    };
    let mut st = Status::new(code, e.to_string());
    st.metadata_mut()
        .insert(ERROR_KIND, MetadataValue::from_static(kind));
    st
}

/// A status back into the runtime error it stands for. `worker` names the worker in the text
/// of errors that are not the node's own (the call never reached it, or timed out).
pub fn runtime_error_of(st: &Status, worker: &str, ready_timeout: Duration) -> RuntimeError {
    let kind = st
        .metadata()
        .get(ERROR_KIND)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let msg = st.message().to_string();
    match kind {
        "conn_closed" | "conn" => RuntimeError::Conn(ConnError::Closed),
        "agent_timeout" => RuntimeError::AgentTimeout(ready_timeout, msg),
        "exited_early" => RuntimeError::ExitedEarly(msg),
        "runsc_missing" => RuntimeError::RunscMissing {
            path: PathBuf::from(format!("runsc on worker {worker}")),
        },
        "no_capacity" => RuntimeError::NoCapacity(
            msg.trim_start_matches("no worker can take it: ")
                .to_string(),
        ),
        "image_lost" => RuntimeError::ImageLost(format!(
            "worker {worker}: {}",
            msg.trim_start_matches("the image is lost: ")
        )),
        "runtime" => RuntimeError::Unsupported(format!("worker {worker}: {msg}")),
        gpu if gpu.starts_with("gpu:") => RuntimeError::Gpu {
            code: gpu["gpu:".len()..].to_string(),
            message: format!("worker {worker}: {msg}"),
        },
        _ => RuntimeError::Unsupported(format!(
            "worker {worker} did not answer: {:?} {msg}",
            st.code()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use torpor_core::{Limits, NetworkPolicy};

    #[test]
    fn a_launch_survives_the_wire() {
        let mut env = BTreeMap::new();
        env.insert("A".to_string(), "1".to_string());
        let l = Launch {
            container_id: "sb-g1".into(),
            spec: ContainerSpec {
                rootfs: "/data/rootfs/x".into(),
                mounts: vec![Mount::bind_ro("/usr", "/usr")],
                agent_dir: "/data/agent/abc".into(),
                argv: vec!["sleep".into(), "1".into()],
                env,
                cwd: "/".into(),
                limits: Limits::default(),
                hostname: "h".into(),
                netns: None,
                devices: vec![],
            },
            network: Some(NetworkPolicy::full()),
            ready_timeout: Duration::from_millis(1500),
            stored: StoredFiles {
                rootfs: Some("rootfs-host-1".into()),
                image: Some("s1".into()),
                keep_image: true,
                // The pin is the controller's placement: it does not travel.
                image_on: None,
                access: StoreAccess {
                    namespace: Some("acme".into()),
                    key: Some([7; 32]),
                },
            },
            gpu: Some(LaunchGpu {
                request: r#"{"mode":"whole"}"#.into(),
                quota: Some("{}".into()),
            }),
        };
        let back = launch_from_pb(launch_to_pb(&l)).unwrap();
        assert_eq!(back.stored, l.stored);
        assert_eq!(back.gpu, l.gpu);
        assert_eq!(back.container_id, l.container_id);
        assert_eq!(back.spec.rootfs, l.spec.rootfs);
        assert_eq!(back.spec.mounts, l.spec.mounts);
        assert_eq!(back.spec.env, l.spec.env);
        assert_eq!(back.spec.limits, l.spec.limits);
        assert_eq!(back.network, l.network);
        assert_eq!(back.ready_timeout, l.ready_timeout);
    }

    #[test]
    fn runtime_errors_keep_their_kind() {
        let st = status_of(&RuntimeError::Conn(ConnError::Closed));
        assert!(matches!(
            runtime_error_of(&st, "w", Duration::ZERO),
            RuntimeError::Conn(ConnError::Closed)
        ));
        let st = status_of(&RuntimeError::ExitedEarly("log".into()));
        assert!(matches!(
            runtime_error_of(&st, "w", Duration::ZERO),
            RuntimeError::ExitedEarly(m) if m.contains("log")
        ));
        let st = status_of(&RuntimeError::Gpu {
            code: "gpu_unavailable".into(),
            message: "no free GPU".into(),
        });
        assert!(matches!(
            runtime_error_of(&st, "w", Duration::from_secs(1)),
            RuntimeError::Gpu { code, message } if code == "gpu_unavailable" && message == "worker w: no free GPU"
        ));
        let st = status_of(&RuntimeError::ImageLost("image x is not here".into()));
        assert!(matches!(
            runtime_error_of(&st, "w", Duration::ZERO),
            RuntimeError::ImageLost(m) if m == "worker w: image x is not here"
        ));
        // A bad key length is refused, not truncated.
        let short = pb::StoreAccess {
            namespace: None,
            key: Some(vec![1; 31]),
        };
        assert!(access_from_pb(Some(short)).is_err());
        // A transport failure is no node error.
        let st = Status::unavailable("connection refused");
        assert!(matches!(
            runtime_error_of(&st, "w", Duration::ZERO),
            RuntimeError::Unsupported(m) if m.contains("did not answer")
        ));
    }
}
