//! envd's process messages (requests as the SDKs send them) and the events streamed back.

use super::*;

// ------------------------------------------------------------------ messages

#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct StartRequest {
    pub(super) process: Option<ProcessConfig>,
    pub(super) pty: Option<PtyRequest>,
    pub(super) tag: Option<String>,
    pub(super) stdin: Option<bool>,
}

/// `{"size": {"cols": 80, "rows": 24}}`
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct PtyRequest {
    pub(super) size: Option<PtySizeJson>,
}

#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
#[serde(default)]
pub(super) struct PtySizeJson {
    pub(super) cols: u32,
    pub(super) rows: u32,
}

impl PtyRequest {
    pub(super) fn size(&self) -> Result<PtySize, RpcError> {
        let s = self.size.unwrap_or(PtySizeJson { cols: 80, rows: 24 });
        let ok = |n: u32| (1..=u16::MAX as u32).contains(&n);
        if !ok(s.cols) || !ok(s.rows) {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "pty.size: cols and rows must be 1-65535, got {}x{}",
                    s.cols, s.rows
                ),
            ));
        }
        Ok(PtySize {
            cols: s.cols as u16,
            rows: s.rows as u16,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct UpdateRequest {
    pub(super) process: Option<Selector>,
    pub(super) pty: Option<PtyRequest>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct Selector {
    pub(super) pid: Option<u32>,
    pub(super) tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct SelectorRequest {
    pub(super) process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct SendInputRequest {
    pub(super) process: Option<Selector>,
    pub(super) input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ProcessInput {
    pub(super) stdin: Option<String>,
    pub(super) pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct SendSignalRequest {
    pub(super) process: Option<Selector>,
    pub(super) signal: Option<serde_json::Value>,
}

/// What the supervisor records about a process (its `config` file).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub(super) struct Recorded {
    pub(super) config: ProcessConfig,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tag: Option<String>,
    /// Run on a terminal (its output is `pty` data).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(super) pty: bool,
}

pub fn event_start(pid: u32) -> serde_json::Value {
    json!({"event": {"start": {"pid": pid}}})
}

/// A data event: fd 1 stdout, 2 stderr, [`PTY_FD`] a terminal's output.
pub fn event_data(fd: u8, bytes: &[u8]) -> serde_json::Value {
    let b = base64::engine::general_purpose::STANDARD.encode(bytes);
    match fd {
        1 => json!({"event": {"data": {"stdout": b}}}),
        PTY_FD => json!({"event": {"data": {"pty": b}}}),
        _ => json!({"event": {"data": {"stderr": b}}}),
    }
}

/// The pseudo-fd of a terminal's output in [`event_data`].
pub const PTY_FD: u8 = 3;

/// The end event, as Go's envd words it.
pub fn event_end(status: &ExitStatus) -> serde_json::Value {
    match status {
        ExitStatus::Code(c) => json!({"event": {"end": {
            "exitCode": c, "exited": true, "status": format!("exit status {c}")
        }}}),
        ExitStatus::Signal(name) => json!({"event": {"end": {
            "exitCode": -1, "exited": false, "status": format!("signal: {name}")
        }}}),
    }
}

pub fn event_keepalive() -> serde_json::Value {
    json!({"event": {"keepalive": {}}})
}

#[derive(Debug, Clone, PartialEq)]
pub enum ExitStatus {
    Code(i32),
    Signal(String),
}
