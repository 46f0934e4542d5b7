//! envd's file metadata (envd 0.6.2): user-defined key/value pairs kept on a file as
//! `user.e2b.<key>` extended attributes inside the sandbox.
//!
//! - An upload (`POST /files`) carries them as `X-Metadata-<key>: <value>` headers, the same
//!   set for every file of the request; keys are lowercased (HTTP header names are), an empty
//!   key is dropped, a repeated header counts once (its first value). The set is checked as
//!   envd checks it ([`proto::validate_metadata`]: printable ASCII, a key of at most 246
//!   bytes, 4096 bytes in all counting the prefix of every key) and refused with 400 otherwise,
//!   before anything is written.
//! - The agent writes them ([`Request::SetMetadata`]): it names every attribute itself, the
//!   fixed `user.e2b.` prefix followed by the key, so no header can reach another namespace
//!   (`trusted.`, `security.`, `system.`): a key `trusted.x` is stored as `user.e2b.trusted.x`.
//! - `Stat`, `ListDir`, `Move` and `MakeDir` entries carry them as `metadata` (the agent reads
//!   them within [`proto::MAX_METADATA_READ_ENTRY`] per entry, whatever a process in the
//!   sandbox stored by other means, and within [`MAX_LISTED_METADATA`] per `ListDir`).
//! - Rename keeps them (the inode moves); an upload over a file replaces it (the agent writes
//!   a new file and renames it into place), so the old set is gone and only the new one stays.
//!
//! A sandbox restored from an older torpor's snapshot may run an agent that predates these
//! requests (it could not even parse them): its hello is asked first, and only an agent of at
//! least [`proto::METADATA_SINCE`] is sent them. Such a sandbox lists no metadata, and an
//! upload with metadata to it is refused (400) rather than written without it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use axum::http::HeaderMap;
use torpor_core::SandboxId;
use torpor_runtime::proto::{self, MetaEntry, Reply, Request};

use super::super::connect::{Code, RpcError};
use super::super::envd::Ctx;
use super::super::{E2b, E2bError};

/// The header prefix of envd's file metadata on an upload (header names are lowercase here).
pub const METADATA_HEADER_PREFIX: &str = "x-metadata-";

/// The message of an upload with metadata to a sandbox whose agent cannot keep it.
pub const AGENT_TOO_OLD: &str = "file metadata needs a newer sandbox agent: this sandbox was \
     restored from an older torpor's snapshot (write without metadata, or use a new sandbox)";

/// The most metadata one `ListDir` answers, over all the directories it walks
/// (`resource_exhausted` past it): the agent bounds each directory's, this the whole answer.
pub const MAX_LISTED_METADATA: usize = 16 << 20;

/// What an entry's metadata costs against [`MAX_LISTED_METADATA`].
pub(crate) fn cost(m: &MetaEntry) -> usize {
    m.metadata
        .iter()
        .map(|(k, v)| proto::read_metadata_budget(k, v))
        .sum()
}

/// How many sandboxes' agent versions are remembered; past it the memory starts over (each is
/// asked again once).
const MAX_KNOWN: usize = 65_536;

/// Sandboxes whose agent is known to keep metadata (its hello said at least
/// [`proto::METADATA_SINCE`]). Only a yes is remembered: an agent's version never drops for a
/// sandbox (it is checkpointed with it), and one that is older is asked again, as a sandbox
/// rebooted without its memory runs this torpor's agent.
#[derive(Default)]
pub struct MetadataAgents(Mutex<HashSet<SandboxId>>);

impl MetadataAgents {
    fn knows(&self, id: &SandboxId) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    fn remember(&self, id: &SandboxId) {
        let mut known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= MAX_KNOWN {
            known.clear();
        }
        known.insert(id.clone());
    }
}

/// Whether the sandbox's agent keeps metadata: remembered, or asked (its hello).
pub(crate) async fn agent_keeps_metadata(st: &E2b, c: &Ctx) -> Result<bool, RpcError> {
    if st.metadata_agents.knows(&c.id) {
        return Ok(true);
    }
    let (reply, _) = st
        .api
        .engine
        .agent_call(&c.tenant, &c.id, Request::Hello, &[])
        .await?;
    let keeps = matches!(reply, Reply::Hello { version, .. } if version >= proto::METADATA_SINCE);
    if keeps {
        st.metadata_agents.remember(&c.id);
    }
    Ok(keeps)
}

/// The metadata of an upload, from its `X-Metadata-*` headers, checked as envd checks it
/// (400 with the reason otherwise). Empty when there is none.
pub fn from_headers(headers: &HeaderMap) -> Result<BTreeMap<String, String>, E2bError> {
    let mut out = BTreeMap::new();
    for name in headers.keys() {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else {
            continue;
        };
        if key.is_empty() || out.contains_key(key) {
            continue;
        }
        // The first value, as envd's `values[0]`.
        let value = headers.get(name).map(|v| v.as_bytes()).unwrap_or_default();
        let value = std::str::from_utf8(value)
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..=0x7e).contains(&b)))
            .ok_or_else(|| {
                E2bError::bad_request(format!(
                    "invalid metadata: {}",
                    proto::MetadataError::ValueNotPrintable { key: key.into() }
                ))
            })?;
        out.insert(key.to_string(), value.to_string());
    }
    proto::validate_metadata(&out)
        .map_err(|e| E2bError::bad_request(format!("invalid metadata: {e}")))?;
    Ok(out)
}

/// Replaces the metadata of the file at `path`; answers what it holds afterwards.
pub(crate) async fn set(
    st: &E2b,
    c: &Ctx,
    path: &str,
    metadata: BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, RpcError> {
    let req = Request::SetMetadata {
        path: path.into(),
        metadata,
    };
    match st.api.engine.agent_call(&c.tenant, &c.id, req, &[]).await? {
        (Reply::Metadata { metadata }, _) => Ok(metadata),
        (other, _) => Err(unexpected(c, &other)),
    }
}

/// The entries of `dir` with their metadata (only `name`, when given: none if it does not
/// exist). The agent must keep metadata ([`agent_keeps_metadata`]).
pub(crate) async fn list(
    st: &E2b,
    c: &Ctx,
    dir: &str,
    name: Option<&str>,
) -> Result<Vec<MetaEntry>, RpcError> {
    let req = Request::ListWithMetadata {
        path: dir.into(),
        name: name.map(str::to_string),
    };
    match st.api.engine.agent_call(&c.tenant, &c.id, req, &[]).await? {
        (Reply::MetaEntries { .. }, body) => serde_json::from_slice(&body).map_err(|e| {
            tracing::warn!(sandbox = %c.id, error = %e, "malformed entries from the agent");
            RpcError::new(Code::Internal, "unexpected reply from the sandbox's agent")
        }),
        (other, _) => Err(unexpected(c, &other)),
    }
}

fn unexpected(c: &Ctx, reply: &Reply) -> RpcError {
    tracing::warn!(sandbox = %c.id, ?reply, "unexpected agent reply to a metadata request");
    RpcError::new(Code::Internal, "unexpected reply from the sandbox's agent")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderName, HeaderValue, StatusCode};

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn upload_headers_become_metadata_as_envd_reads_them() {
        let m = from_headers(&headers(&[
            ("X-Metadata-Author", b"mish"),
            ("x-metadata-purpose", b"upload"),
            ("X-Metadata-Author", b"second"),
            ("X-Metadata-", b"dropped"),
            ("Content-Type", b"application/octet-stream"),
        ]))
        .unwrap();
        assert_eq!(
            m,
            BTreeMap::from([
                ("author".to_string(), "mish".to_string()),
                ("purpose".to_string(), "upload".to_string()),
            ])
        );
        assert!(from_headers(&HeaderMap::new()).unwrap().is_empty());
        // Another namespace's name is only a key (stored under `user.e2b.`).
        let m = from_headers(&headers(&[("X-Metadata-trusted.x", b"v")])).unwrap();
        assert_eq!(m.get("trusted.x").map(String::as_str), Some("v"));
    }

    #[test]
    fn metadata_envd_would_refuse_is_refused_with_400() {
        for h in [
            headers(&[("X-Metadata-k", b"caf\xc3\xa9")]),
            headers(&[("X-Metadata-k", b"\xff")]),
            headers(&[("X-Metadata-k", "v".repeat(4090).as_bytes())]),
            headers(&[(&format!("X-Metadata-{}", "k".repeat(247)), b"v")]),
        ] {
            let e = from_headers(&h).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.starts_with("invalid metadata: "), "{}", e.message);
        }
    }

    #[test]
    fn the_fuzz_entry_point_holds_on_hostile_headers() {
        use super::super::fuzzing::files_metadata;
        assert_eq!(
            files_metadata(b"Author: mish\ntrusted.x: y\n: empty"),
            Ok(2)
        );
        assert!(files_metadata("k: caf\u{e9}".as_bytes()).is_err());
        assert!(files_metadata(b"k: a\tb").is_err());
        assert_eq!(files_metadata(b"k\0: v\nsecurity.selinux\r: v"), Ok(0));
        let many: Vec<u8> = (0..500)
            .flat_map(|i| format!("k{i}: v\n").into_bytes())
            .collect();
        assert!(files_metadata(&many).is_err());
    }

    #[test]
    fn only_yes_is_remembered_and_the_memory_is_bounded() {
        let m = MetadataAgents::default();
        let a = SandboxId::generate();
        assert!(!m.knows(&a));
        m.remember(&a);
        assert!(m.knows(&a));
        for _ in 0..MAX_KNOWN {
            m.remember(&SandboxId::generate());
        }
        assert!(m.0.lock().unwrap().len() <= MAX_KNOWN);
    }
}
