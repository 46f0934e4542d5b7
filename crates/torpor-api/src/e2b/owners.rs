//! Owner and group names of entries, as envd reports them (`owner`, `group` of an
//! `EntryInfo`): the agent's listing carries numeric ids, named here from the sandbox's own
//! `/etc/passwd` and `/etc/group` (read through the agent only when an id is not one torpor
//! knows: root everywhere, `user` in E2B's `base`). An id with no name is reported as its
//! number, as Go's `user.LookupId` fallback in envd does.

use std::collections::BTreeMap;

use torpor_runtime::proto::DirEntry;

use super::envd::Ctx;
use super::E2b;

/// The most of `/etc/passwd` or `/etc/group` read.
const MAX_DB: u64 = 1 << 20;

/// uid → user name and gid → group name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Names {
    users: BTreeMap<u32, String>,
    groups: BTreeMap<u32, String>,
}

impl Names {
    /// What is known without asking the sandbox: root, and `user` (1000) in `base`.
    pub fn builtin(base: bool) -> Names {
        let mut n = Names::default();
        n.users.insert(0, "root".into());
        n.groups.insert(0, "root".into());
        if base {
            let u = super::base::USER;
            n.users.insert(u.uid, super::base::USER_NAME.into());
            n.groups.insert(u.gid, super::base::USER_NAME.into());
        }
        n
    }

    /// Whether every owner and group of `entries` has a name here.
    pub fn knows_all<'a>(&self, entries: impl IntoIterator<Item = &'a DirEntry>) -> bool {
        entries
            .into_iter()
            .all(|e| self.users.contains_key(&e.uid) && self.groups.contains_key(&e.gid))
    }

    /// Adds the names of `passwd` and `group` (the sandbox's own win over the built-in ones).
    pub fn add_databases(&mut self, passwd: &str, group: &str) {
        self.users.extend(parse_db(passwd));
        self.groups.extend(parse_db(group));
    }

    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

/// `name:x:id:...` lines (passwd and group share the first three fields); the first line
/// naming an id wins, as getpwuid's scan does. Malformed lines are skipped.
pub fn parse_db(text: &str) -> BTreeMap<u32, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut f = line.split(':');
        let (Some(name), Some(_), Some(id)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let Ok(id) = id.parse::<u32>() else { continue };
        if !name.is_empty() {
            out.entry(id).or_insert_with(|| name.to_string());
        }
    }
    out
}

/// The names for `entries`: the built-in ones, plus the sandbox's databases when an id is
/// not among them (unreadable databases leave numbers).
pub async fn names_for<'a>(
    st: &E2b,
    c: &Ctx,
    entries: impl IntoIterator<Item = &'a DirEntry>,
) -> Names {
    let mut names = Names::builtin(c.base);
    if names.knows_all(entries) {
        return names;
    }
    let read = |path: &'static str| async move {
        match st
            .api
            .engine
            .read_file(&c.tenant, &c.id, path, MAX_DB)
            .await
        {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) => {
                tracing::debug!(sandbox = %c.id, path, error = %e, "cannot read a user database");
                String::new()
            }
        }
    };
    let (passwd, group) = tokio::join!(read("/etc/passwd"), read("/etc/group"));
    names.add_databases(&passwd, &group);
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_runtime::proto::FileKind;

    fn entry(uid: u32, gid: u32) -> DirEntry {
        DirEntry {
            name: "f".into(),
            kind: FileKind::File,
            size: 0,
            mode: 0o644,
            modified_ms: 0,
            uid,
            gid,
        }
    }

    #[test]
    fn ids_are_named_from_the_databases_or_left_as_numbers() {
        let base = Names::builtin(true);
        assert!(base.knows_all([&entry(0, 0), &entry(1000, 1000)]));
        assert!(!base.knows_all([&entry(0, 0), &entry(65534, 0)]));
        assert!(!Names::builtin(false).knows_all([&entry(1000, 1000)]));
        assert_eq!(
            (base.user(1000), base.group(1000)),
            ("user".into(), "user".into())
        );
        let mut n = Names::builtin(false);
        n.add_databases(
            "root:x:0:0:root:/root:/bin/sh\n# comment\nbroken\nnobody:x:65534:65534::/:/x\nalias:x:65534:1::/:/x\n",
            "root:x:0:\nnogroup:x:65534:\nbad:x:notanumber:\n",
        );
        assert_eq!(n.user(0), "root");
        assert_eq!(n.user(65534), "nobody", "the first line naming an id wins");
        assert_eq!(n.group(65534), "nogroup");
        assert_eq!(n.user(4242), "4242");
        assert_eq!(n.group(4243), "4243");
    }
}
