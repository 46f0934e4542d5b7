//! `GET /v2/sandboxes` and `GET /sandboxes`: E2B's list, with its filters (state, metadata,
//! `startedAfter`, template), its order (by start time, newest first unless `order=asc`) and
//! its paging (`limit`, `nextToken` → `x-next-token`) across running and paused sandboxes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_control::SandboxRecord;

use super::control::{authenticate, detail_json, SandboxDetailJson};
use super::{e2b_running, E2b, E2bError, META_PREFIX};

type E2bResult<T> = Result<T, E2bError>;

/// The filters of a list, parsed from the query.
#[derive(Debug, Default, PartialEq)]
pub struct ListFilter {
    pub running: bool,
    pub paused: bool,
    pub metadata: BTreeMap<String, String>,
    pub limit: usize,
    pub next_token: Option<String>,
    /// Only sandboxes started at or after this time (ms since the epoch).
    pub started_after: Option<i64>,
    /// Only sandboxes of this template (its E2B name: `base` is torpor's `host`).
    pub template: Option<String>,
    /// Oldest first (`order=asc`); newest first otherwise.
    pub ascending: bool,
}

pub const MAX_PAGE: usize = 100;

/// Parses `state=running,paused`, `metadata=k%3Dv%26k2%3Dv2` (a URL-encoded query string,
/// itself URL-encoded), `startedAfter` (RFC 3339), `template`, `order`, `limit`, `nextToken`.
pub fn parse_list_query(
    q: &HashMap<String, String>,
    default_paused: bool,
) -> E2bResult<ListFilter> {
    let mut f = ListFilter {
        running: true,
        paused: default_paused,
        limit: MAX_PAGE,
        ..Default::default()
    };
    if let Some(states) = q.get("state") {
        f.running = false;
        f.paused = false;
        for s in states.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match s {
                "running" => f.running = true,
                "paused" => f.paused = true,
                other => {
                    return Err(E2bError::bad_request(format!(
                        "state must be running or paused, got {other:?}"
                    )))
                }
            }
        }
    }
    if let Some(m) = q.get("metadata") {
        for pair in m.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let dec = |s: &str| {
                percent_decode(s)
                    .ok_or_else(|| E2bError::bad_request("metadata filter is not valid UTF-8"))
            };
            f.metadata.insert(dec(k)?, dec(v)?);
        }
    }
    if let Some(l) = q.get("limit") {
        f.limit = l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_PAGE).contains(l))
            .ok_or_else(|| E2bError::bad_request(format!("limit must be 1..={MAX_PAGE}")))?;
    }
    if let Some(t) = q.get("startedAfter").filter(|t| !t.is_empty()) {
        f.started_after = Some(parse_time(t).ok_or_else(|| {
            E2bError::bad_request(format!("startedAfter must be an RFC 3339 time, got {t:?}"))
        })?);
    }
    f.template = q.get("template").filter(|t| !t.is_empty()).cloned();
    f.ascending = match q.get("order").map(String::as_str) {
        None | Some("") | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            return Err(E2bError::bad_request(format!(
                "order must be asc or desc, got {other:?}"
            )))
        }
    };
    f.next_token = q.get("nextToken").filter(|t| !t.is_empty()).cloned();
    Ok(f)
}

/// An RFC 3339 / ISO 8601 time as Python's `isoformat()` writes it (`Z`, an offset such as
/// `+02:00`, or none: UTC), in ms since the epoch.
pub fn parse_time(s: &str) -> Option<i64> {
    let s = s.trim();
    let (local, offset_s) = if let Some(l) = s.strip_suffix('Z').or_else(|| s.strip_suffix('z')) {
        (l, 0i64)
    } else if s.len() > 6 && matches!(&s.as_bytes()[s.len() - 6], b'+' | b'-') {
        let (l, off) = s.split_at(s.len() - 6);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let h: i64 = off.get(1..3)?.parse().ok()?;
        let m: i64 = off.get(4..6)?.parse().ok()?;
        if off.as_bytes().get(3) != Some(&b':') {
            return None;
        }
        (l, sign * (h * 3600 + m * 60))
    } else {
        (s, 0)
    };
    let t = humantime::parse_rfc3339_weak(local).ok()?;
    let ms = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
    Some(ms - offset_s * 1000)
}

/// Decodes `%XX` escapes and `+` (as a space) once.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'%' => return None,
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// A sandbox's place in the list order: (start time, id).
fn cursor(r: &SandboxRecord) -> String {
    format!("{}.{}", r.created_at, r.id)
}

fn parse_cursor(t: &str) -> Option<(i64, &str)> {
    let (at, id) = t.split_once('.')?;
    Some((at.parse().ok()?, id))
}

/// The page of `all` that `f` selects, in E2B's order (by start time, newest first unless
/// ascending; ties by id), and the token of the next page: the position of the page's last
/// sandbox, so paging is stable while sandboxes come, go, pause or wake.
pub fn page<'a>(
    all: &'a [SandboxRecord],
    f: &ListFilter,
) -> E2bResult<(Vec<&'a SandboxRecord>, Option<String>)> {
    let after = match f.next_token.as_deref() {
        Some(t) => {
            Some(parse_cursor(t).ok_or_else(|| E2bError::bad_request("nextToken is not valid"))?)
        }
        None => None,
    };
    let key = |r: &SandboxRecord| (r.created_at, r.id.to_string());
    let mut selected: Vec<&SandboxRecord> = all
        .iter()
        .filter(|r| !super::is_snapshot(r))
        .filter(|r| {
            let running = e2b_running(r);
            (running && f.running) || (!running && f.paused)
        })
        .filter(|r| f.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
        .filter(|r| f.started_after.is_none_or(|t| r.created_at >= t))
        .filter(|r| {
            f.template
                .as_deref()
                .is_none_or(|t| t == r.template.as_str())
        })
        .filter(|r| {
            after.is_none_or(|(at, id)| {
                let k = key(r);
                let pos = (at, id.to_string());
                if f.ascending {
                    k > pos
                } else {
                    k < pos
                }
            })
        })
        .collect();
    selected.sort_by_key(|r| key(r));
    if !f.ascending {
        selected.reverse();
    }
    let next = (selected.len() > f.limit).then(|| cursor(selected[f.limit - 1]));
    selected.truncate(f.limit);
    Ok((selected, next))
}

fn list(
    st: &E2b,
    headers: &HeaderMap,
    q: &HashMap<String, String>,
    v2: bool,
) -> E2bResult<Response> {
    let tenant = authenticate(st, headers)?;
    if q.get("metadata")
        .is_some_and(|m| m.contains(META_PREFIX) || m.contains(torpor_control::Engine::WAKE_PREFIX))
    {
        return Err(E2bError::bad_request(format!(
            "metadata keys starting with {META_PREFIX:?} are reserved"
        )));
    }
    let f = parse_list_query(q, v2)?;
    let all = st.api.engine.sandboxes(&tenant)?;
    let (items, next) = page(&all, &f)?;
    let body: Vec<SandboxDetailJson> = items.iter().map(|r| detail_json(st, r, false)).collect();
    let mut resp = Json(body).into_response();
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", next);
    }
    Ok(resp)
}

/// GET /v2/sandboxes (running and paused by default).
pub async fn list_v2(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> E2bResult<Response> {
    list(&st, &headers, &q, true)
}

/// GET /sandboxes (E2B's v1 list: running ones).
pub async fn list_v1(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> E2bResult<Response> {
    list(&st, &headers, &q, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query_parses_states_metadata_and_paging() {
        let q: HashMap<String, String> = [
            ("state".to_string(), "paused".to_string()),
            // the SDK's double encoding of {"a b": "c&d"}
            ("metadata".to_string(), "a%2520b=c%2526d&x=y".to_string()),
            ("limit".to_string(), "2".to_string()),
            (
                "startedAfter".to_string(),
                "2026-01-02T03:04:05+01:00".to_string(),
            ),
            ("template".to_string(), "base".to_string()),
            ("order".to_string(), "asc".to_string()),
        ]
        .into();
        // axum's Query decodes one level; what is left is the SDK's own quoting.
        let mut q2 = q.clone();
        q2.insert("metadata".into(), percent_decode(&q["metadata"]).unwrap());
        let f = parse_list_query(&q2, true).unwrap();
        assert!(!f.running && f.paused && f.ascending);
        assert_eq!(f.limit, 2);
        assert_eq!(f.metadata.get("a b").map(String::as_str), Some("c&d"));
        assert_eq!(f.metadata.get("x").map(String::as_str), Some("y"));
        assert_eq!(f.template.as_deref(), Some("base"));
        assert_eq!(f.started_after, parse_time("2026-01-02T02:04:05Z"));
        assert!(parse_list_query(&[("state".into(), "zombie".into())].into(), true).is_err());
        assert!(parse_list_query(&[("limit".into(), "0".into())].into(), true).is_err());
        assert!(parse_list_query(&[("metadata".into(), "%ZZ=1".into())].into(), true).is_err());
        assert!(parse_list_query(&[("order".into(), "up".into())].into(), true).is_err());
        assert!(
            parse_list_query(&[("startedAfter".into(), "yesterday".into())].into(), true).is_err()
        );
        assert_eq!(percent_decode("%"), None);
        assert_eq!(percent_decode("a%2"), None);
    }

    #[test]
    fn times_parse_as_isoformat_writes_them() {
        let z = parse_time("2026-12-01T10:00:00Z").unwrap();
        assert_eq!(parse_time("2026-12-01T10:00:00+00:00"), Some(z));
        assert_eq!(parse_time("2026-12-01T10:00:00"), Some(z));
        assert_eq!(parse_time("2026-12-01T12:30:00+02:30"), Some(z));
        assert_eq!(parse_time("2026-12-01T07:00:00-03:00"), Some(z));
        assert_eq!(
            parse_time("2026-12-01T10:00:00.250000+00:00"),
            Some(z + 250)
        );
        assert_eq!(parse_time("2026-12-01T10:00:00+0000"), None);
    }
}
