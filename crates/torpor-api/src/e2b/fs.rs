//! envd's `filesystem.Filesystem` service (the `/files` upload and download are in
//! [`super::files`]).
//!
//! Entries are described as envd describes them: a symlink reports its target's type and mode
//! plus `symlinkTarget` (absolute, every link resolved); `ListDir` walks depth first in name
//! order, as Go's `filepath.WalkDir` does, without descending into symlinked directories.
//! Entries carry the file's user metadata as `metadata` ([`metadata`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::Response;
use serde::Deserialize;
use serde_json::json;
use torpor_runtime::proto::{DirEntry, FileKind, MetaEntry};

use super::connect::{self, Code, RpcError};
use super::envd::{rpc_call, run, AutoResume, Ctx};
use super::owners::{names_for, Names};
pub(crate) use super::paths::basic_user;
pub use super::paths::resolve;
use super::E2b;

/// Entries one ListDir (all depths) or one watcher snapshot may hold.
const MAX_ENTRIES: usize = 10_000;

pub(crate) fn parent_and_name(path: &str) -> (String, String) {
    match path.rsplit_once('/') {
        Some(("", name)) => ("/".into(), name.into()),
        Some((parent, name)) => (parent.into(), name.into()),
        None => ("/".into(), path.into()),
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// `-rw-r--r--` from a mode (Go's `FileMode.String()`, which envd reports: `L` for a link).
pub fn permissions(kind: FileKind, mode: u32) -> String {
    let t = match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(t);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// What a symlink resolves to: its absolute target (every link followed) and the target's
/// kind and permission bits; `None` when it dangles or loops.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkTarget {
    pub path: String,
    pub kind: FileKind,
    pub mode: u32,
}

fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// An envd `EntryInfo` in proto JSON. A symlink (`link` is what it resolved to, if it did)
/// reports its target's type and mode, and `symlinkTarget`: the target, or the link's own path
/// when it dangles (envd's rule, type then unspecified).
pub fn entry_info(
    dir: &str,
    e: &DirEntry,
    link: Option<&Option<LinkTarget>>,
    names: &Names,
) -> serde_json::Value {
    let path = join(dir, &e.name);
    let t = std::time::UNIX_EPOCH + Duration::from_millis(e.modified_ms.max(0) as u64);
    let (ty, mode) = match (e.kind, link) {
        (FileKind::Symlink, Some(Some(target))) => (file_type(target.kind), target.mode),
        (FileKind::Symlink, _) => ("FILE_TYPE_UNSPECIFIED", 0),
        (kind, _) => (file_type(kind), e.mode),
    };
    let mut v = json!({
        "name": e.name,
        "type": ty,
        "path": path,
        "size": e.size.to_string(),
        "mode": mode & 0o7777,
        "permissions": permissions(e.kind, e.mode),
        "owner": names.user(e.uid),
        "group": names.group(e.gid),
        "modifiedTime": humantime::format_rfc3339_millis(t).to_string(),
    });
    if e.kind == FileKind::Symlink {
        let target = match link {
            Some(Some(t)) => t.path.clone(),
            _ => path,
        };
        v["symlinkTarget"] = json!(target);
    }
    v
}

/// Resolves symlinks in the sandbox with one helper run (`readlink -e`, then the target's kind
/// and mode); answers one element per path, in order.
pub(crate) const RESOLVE_LINKS: &str = r#"for p; do
  if t=$(readlink -e -- "$p" 2>/dev/null) && [ -n "$t" ]; then
    if [ -d "$t" ]; then k=d; elif [ -f "$t" ]; then k=f; else k=o; fi
    m=$(stat -Lc %a -- "$t" 2>/dev/null)
    printf '%s\0%s\0%s\0' "$t" "$k" "$m"
  else
    printf '\0\0\0'
  fi
done"#;

/// Parses [`RESOLVE_LINKS`]' output: NUL-separated (target, kind, octal mode) triples.
pub fn parse_links(out: &str, count: usize) -> Vec<Option<LinkTarget>> {
    let fields: Vec<&str> = out.split('\0').collect();
    (0..count)
        .map(|i| {
            let target = *fields.get(3 * i)?;
            if !target.starts_with('/') {
                return None;
            }
            let kind = match *fields.get(3 * i + 1)? {
                "d" => FileKind::Dir,
                "f" => FileKind::File,
                _ => FileKind::Other,
            };
            let mode = u32::from_str_radix(fields.get(3 * i + 2)?, 8).unwrap_or(0);
            Some(LinkTarget {
                path: target.to_string(),
                kind,
                mode,
            })
        })
        .collect()
}

async fn resolve_links(st: &E2b, c: &Ctx, paths: &[String]) -> Vec<Option<LinkTarget>> {
    if paths.is_empty() {
        return Vec::new();
    }
    let mut cmd = vec!["sh", "-c", RESOLVE_LINKS, "sh"];
    cmd.extend(paths.iter().map(String::as_str));
    match run(st, c, &cmd, Vec::new()).await {
        Ok((_, out, _)) => parse_links(&out, paths.len()),
        Err(e) => {
            tracing::debug!(sandbox = %c.id, error = %e.message, "cannot resolve symlinks");
            vec![None; paths.len()]
        }
    }
}

/// Adds an entry's user metadata to its `EntryInfo` (absent when it has none, as envd's
/// proto JSON leaves an empty map out).
fn with_metadata(
    mut v: serde_json::Value,
    metadata: &BTreeMap<String, String>,
) -> serde_json::Value {
    if !metadata.is_empty() {
        v["metadata"] = json!(metadata);
    }
    v
}

/// Describes entries (as (directory, entry with its metadata)), resolving the symlinks among
/// them.
async fn describe(st: &E2b, c: &Ctx, entries: &[(String, MetaEntry)]) -> Vec<serde_json::Value> {
    let links: Vec<String> = entries
        .iter()
        .filter(|(_, e)| e.entry.kind == FileKind::Symlink)
        .map(|(d, e)| join(d, &e.entry.name))
        .collect();
    let (resolved, names) = tokio::join!(
        resolve_links(st, c, &links),
        names_for(st, c, entries.iter().map(|(_, e)| &e.entry))
    );
    let mut resolved = resolved.into_iter();
    entries
        .iter()
        .map(|(d, m)| {
            let e = &m.entry;
            let v = if e.kind == FileKind::Symlink {
                let link = resolved.next().unwrap_or(None);
                entry_info(d, e, Some(&link), &names)
            } else {
                entry_info(d, e, None, &names)
            };
            with_metadata(v, &m.metadata)
        })
        .collect()
}

async fn list(st: &E2b, c: &Ctx, dir: &str) -> Result<Vec<DirEntry>, RpcError> {
    Ok(st.api.engine.list_files(&c.tenant, &c.id, dir).await?)
}

/// The entries of `dir`, with their metadata when `with_meta` (the agent keeps it), else
/// without.
async fn list_meta(
    st: &E2b,
    c: &Ctx,
    dir: &str,
    with_meta: bool,
) -> Result<Vec<MetaEntry>, RpcError> {
    if with_meta {
        return metadata::list(st, c, dir, None).await;
    }
    Ok(list(st, c, dir)
        .await?
        .into_iter()
        .map(|entry| MetaEntry {
            entry,
            metadata: BTreeMap::new(),
        })
        .collect())
}

/// The entry at `path` (not followed if it is a symlink) with its metadata, or not_found.
async fn lstat(st: &E2b, c: &Ctx, path: &str) -> Result<(String, MetaEntry), RpcError> {
    let (parent, name) = parent_and_name(path);
    let missing = || RpcError::new(Code::NotFound, format!("path {path:?} does not exist"));
    if metadata::agent_keeps_metadata(st, c).await? {
        let found = metadata::list(st, c, &parent, Some(&name))
            .await
            .map_err(|e| not_found_as(e, path))?;
        return found
            .into_iter()
            .find(|e| e.entry.name == name)
            .map(|e| (parent, e))
            .ok_or_else(missing);
    }
    let entries = list(st, c, &parent)
        .await
        .map_err(|e| not_found_as(e, path))?;
    entries
        .into_iter()
        .find(|e| e.name == name)
        .map(|entry| {
            (
                parent,
                MetaEntry {
                    entry,
                    metadata: BTreeMap::new(),
                },
            )
        })
        .ok_or_else(missing)
}

/// The envd entry at `path`, or not_found.
async fn stat(st: &E2b, c: &Ctx, path: &str) -> Result<serde_json::Value, RpcError> {
    if path == "/" {
        return Ok(
            json!({"name": "", "type": "FILE_TYPE_DIRECTORY", "path": "/",
            "size": "0", "mode": 0o755, "permissions": "drwxr-xr-x", "owner": "root", "group": "root"}),
        );
    }
    let found = lstat(st, c, path).await?;
    Ok(describe(st, c, std::slice::from_ref(&found))
        .await
        .pop()
        .expect("one entry"))
}

pub(crate) fn not_found_as(e: RpcError, path: &str) -> RpcError {
    if e.code == Code::NotFound {
        RpcError::new(Code::NotFound, format!("path {path:?} does not exist"))
    } else {
        e
    }
}

/// Entries under `root` down to `depth` levels, as (directory, entry), in envd's order: depth
/// first, each directory's entries by name, a directory's contents right after it. Symlinks
/// are not descended into. With `with_meta`, each entry carries its user metadata.
async fn walk(
    st: &E2b,
    c: &Ctx,
    root: &str,
    depth: usize,
    with_meta: bool,
) -> Result<Vec<(String, MetaEntry)>, RpcError> {
    let mut out = Vec::new();
    let sorted = |mut v: Vec<MetaEntry>| {
        v.sort_by(|a, b| a.entry.name.cmp(&b.entry.name));
        VecDeque::from(v)
    };
    let first = list_meta(st, c, root, with_meta)
        .await
        .map_err(|e| not_found_as(e, root))?;
    // (directory, its level below root, the entries of it not yet visited)
    let mut stack: Vec<(String, usize, VecDeque<MetaEntry>)> =
        vec![(root.to_string(), 1, sorted(first))];
    let mut metadata_left = metadata::MAX_LISTED_METADATA;
    while let Some((dir, level, rest)) = stack.last_mut() {
        let Some(e) = rest.pop_front() else {
            stack.pop();
            continue;
        };
        let (dir, level) = (dir.clone(), *level);
        metadata_left = metadata_left
            .checked_sub(metadata::cost(&e))
            .ok_or_else(|| {
                RpcError::new(
                    Code::ResourceExhausted,
                    format!(
                        "the entries under {root:?} carry more than {} bytes of metadata",
                        metadata::MAX_LISTED_METADATA
                    ),
                )
            })?;
        let child =
            (e.entry.kind == FileKind::Dir && level < depth).then(|| join(&dir, &e.entry.name));
        out.push((dir, e));
        if out.len() > MAX_ENTRIES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("more than {MAX_ENTRIES} entries under {root:?}"),
            ));
        }
        if let Some(child) = child {
            // Vanished or unreadable below the root: skipped.
            if let Ok(entries) = list_meta(st, c, &child, with_meta).await {
                stack.push((child, level + 1, sorted(entries)));
            }
        }
    }
    Ok(out)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PathRequest {
    path: String,
    depth: Option<u32>,
    recursive: bool,
    source: String,
    destination: String,
    #[serde(rename = "watcherId", alias = "watcher_id")]
    watcher_id: String,
    #[serde(rename = "includeEntry", alias = "include_entry")]
    include_entry: bool,
}

/// POST /filesystem.Filesystem/{method}
pub async fn filesystem_rpc(
    State(st): State<Arc<E2b>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // A watcher's poll leaves a sandbox asleep, even one that auto-resumes (see `watch`).
    let resume = if method == "GetWatcherEvents" {
        AutoResume::Leave
    } else {
        AutoResume::Wake
    };
    let (framing, c) = match rpc_call(&st, &headers, crate::ratelimit::RouteClass::Files, resume) {
        Ok(fc) => fc,
        Err(resp) => return *resp,
    };
    // Read once the call is authorised: one message at most.
    let body = match connect::read_message_body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return connect::error_response(framing, &e),
    };
    let streaming = method == "WatchDir";
    let known = streaming
        || matches!(
            method.as_str(),
            "Stat"
                | "MakeDir"
                | "Move"
                | "ListDir"
                | "Remove"
                | "CreateWatcher"
                | "GetWatcherEvents"
                | "RemoveWatcher"
        );
    if let Err(e) =
        connect::check_method("filesystem.Filesystem", &method, known, streaming, framing)
    {
        return connect::error_response(framing, &e);
    }
    let user = basic_user(&headers);
    let result = async {
        let req: PathRequest = connect::parse_request(framing, &body)?;
        match method.as_str() {
            "Stat" => {
                let p = resolve(&req.path, user.as_deref())?;
                Ok(connect::unary_ok(
                    &json!({"entry": stat(&st, &c, &p).await?}),
                ))
            }
            "ListDir" => {
                let p = resolve(&req.path, user.as_deref())?;
                let depth = req.depth.unwrap_or(1).clamp(1, 32) as usize;
                let with_meta = metadata::agent_keeps_metadata(&st, &c).await?;
                let found = walk(&st, &c, &p, depth, with_meta).await?;
                let entries = describe(&st, &c, &found).await;
                Ok(connect::unary_ok(&json!({"entries": entries})))
            }
            "MakeDir" => {
                let p = resolve(&req.path, user.as_deref())?;
                match stat(&st, &c, &p).await {
                    Ok(_) => {
                        return Err(RpcError::new(
                            Code::AlreadyExists,
                            format!("path {p:?} already exists"),
                        ))
                    }
                    Err(e) if e.code == Code::NotFound => {}
                    Err(e) => return Err(e),
                }
                let cmd = as_caller(&c, user.as_deref(), &["mkdir", "-p", "--", &p]);
                let (code, _, err) = run(&st, &c, &cmd, Vec::new()).await?;
                if code != 0 {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        format!("cannot make {p:?}: {}", err.trim()),
                    ));
                }
                Ok(connect::unary_ok(
                    &json!({"entry": stat(&st, &c, &p).await?}),
                ))
            }
            "Move" => {
                let src = resolve(&req.source, user.as_deref())?;
                let dst = resolve(&req.destination, user.as_deref())?;
                stat(&st, &c, &src).await?;
                let cmd = as_caller(&c, user.as_deref(), &["mv", "-f", "--", &src, &dst]);
                let (code, _, err) = run(&st, &c, &cmd, Vec::new()).await?;
                if code != 0 {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        format!("cannot move {src:?} to {dst:?}: {}", err.trim()),
                    ));
                }
                Ok(connect::unary_ok(
                    &json!({"entry": stat(&st, &c, &dst).await?}),
                ))
            }
            "Remove" => {
                let p = resolve(&req.path, user.as_deref())?;
                if p == "/" {
                    return Err(RpcError::new(Code::InvalidArgument, "cannot remove /"));
                }
                // As envd's os.RemoveAll: removing what does not exist succeeds.
                match st.api.engine.remove_file(&c.tenant, &c.id, &p, true).await {
                    Ok(()) => {}
                    Err(e) => {
                        let e = RpcError::from(e);
                        if e.code != Code::NotFound {
                            return Err(e);
                        }
                    }
                }
                Ok(connect::unary_ok(&json!({})))
            }
            "CreateWatcher" => {
                let p = resolve(&req.path, user.as_deref())?;
                room_for_watcher(&st, &c)?;
                let w = WatchState::new(&st, &c, p, req.recursive, req.include_entry).await?;
                let w = Watcher::start(&st, &c, w);
                let id = format!("w{}", torpor_core::SandboxId::generate());
                let mut all = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
                // Checked again under the lock: watchers made meanwhile count too.
                check_watcher_caps(&all, &c)?;
                all.insert(id.clone(), w);
                Ok(connect::unary_ok(&json!({"watcherId": id})))
            }
            "GetWatcherEvents" => {
                let state = watch_state(&st, &c, &req.watcher_id)?;
                let mut state = state.lock().await;
                state.poll(&st, &c, watch::Look::Client).await?;
                Ok(connect::unary_ok(&json!({"events": state.drain()})))
            }
            "RemoveWatcher" => {
                remove_watcher(&st, &c, &req.watcher_id)?;
                Ok(connect::unary_ok(&json!({})))
            }
            "WatchDir" => {
                let p = resolve(&req.path, user.as_deref())?;
                let w = WatchState::new(&st, &c, p, req.recursive, req.include_entry).await?;
                let st = st.clone();
                Ok(connect::stream_response(move |tx| {
                    watch::watch_stream(st, c, w, tx)
                }))
            }
            _ => unreachable!("checked above"),
        }
    }
    .await;
    result.unwrap_or_else(|e| connect::error_response(framing, &e))
}

/// A helper command line run as the call's user (E2B's `base`: `user` unless `root` is
/// named, so its permissions apply and what it makes is `user`'s).
fn as_caller(c: &Ctx, user: Option<&str>, cmd: &[&str]) -> Vec<String> {
    let mut v = super::base::as_user(&super::base::identity(c.base, user));
    v.extend(cmd.iter().map(|s| s.to_string()));
    v
}

#[doc(hidden)]
pub mod fuzzing;
pub mod metadata;
pub mod watch;

use watch::{check_watcher_caps, remove_watcher, room_for_watcher, watch_state, WatchState};
pub use watch::{
    expire_watchers, Watcher, MAX_WATCHERS_PER_SANDBOX, MAX_WATCHERS_PER_TENANT, WATCHER_IDLE,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_home_and_never_escape() {
        assert_eq!(resolve("a.txt", None).unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("a.txt", Some("root")).unwrap(), "/root/a.txt");
        assert_eq!(resolve("/x/./y/../z", None).unwrap(), "/x/z");
        assert_eq!(resolve("~/d", None).unwrap(), "/home/user/d");
        assert_eq!(
            resolve("../../..", None).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            resolve("/../etc", None).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            resolve("a\0b", None).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(resolve("/", None).unwrap(), "/");
    }

    #[test]
    fn entries_have_envd_json_shapes() {
        let e = DirEntry {
            name: "f".into(),
            kind: FileKind::File,
            size: 5,
            mode: 0o100644,
            modified_ms: 0,
            uid: 1000,
            gid: 0,
        };
        let v = entry_info("/home/user", &e, None, &Names::builtin(true));
        assert_eq!(
            (v["owner"].as_str(), v["group"].as_str()),
            (Some("user"), Some("root"))
        );
        assert_eq!(v["path"], "/home/user/f");
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["size"], "5");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00.000Z");
    }
}
