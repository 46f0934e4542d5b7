//! A real PostgreSQL server for the store's tests: one per test process, started from the
//! Debian package's binaries (scripts/deps.sh installs them) into a private data directory, on
//! a free loopback port with password (SCRAM) authentication, no Unix socket, and stopped when
//! the test process exits. Each test gets a database of its own.
//!
//! Runs as the test's user (scripts/test.sh runs torpor-control's tests as `nobody`); as root
//! (PostgreSQL refuses to run as root) the server runs as the `postgres` user.
//!
//! When no PostgreSQL binaries are installed the PostgreSQL tests are skipped with a message on
//! stderr, unless `TORPOR_TEST_POSTGRES=required` (scripts/test.sh sets it), where they fail.
//! A server that is installed but does not start always fails them.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

/// The superuser's password (the server listens on loopback only, for this process's tests).
pub const PASSWORD: &str = "torpor-test-pw";

pub struct Server {
    pub port: u16,
    /// The watchdog shell: its stdin closes when this process exits, and it then stops the
    /// server and removes its directory.
    _watchdog: Mutex<Child>,
}

impl Server {
    /// The URL of database `db` as the superuser.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres:{PASSWORD}@127.0.0.1:{}/{db}",
            self.port
        )
    }
}

/// The process's server; `None` (after a message) when PostgreSQL is not installed and not
/// required.
pub fn server() -> Option<&'static Server> {
    static SERVER: OnceLock<Option<Server>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let required = std::env::var("TORPOR_TEST_POSTGRES").as_deref() == Ok("required");
            let Some(bin) = bindir() else {
                assert!(
                    !required,
                    "TORPOR_TEST_POSTGRES=required but no PostgreSQL binaries (initdb) were found \
                     under /usr/lib/postgresql/*/bin, $TORPOR_PG_BINDIR or PATH: run scripts/deps.sh"
                );
                // Written past the test harness's capture, so a passing run shows it.
                let _ = writeln!(
                    std::io::stderr(),
                    "store tests: PostgreSQL tests SKIPPED: no PostgreSQL binaries (initdb) found. \
                     scripts/deps.sh installs them; scripts/test.sh runs these tests with \
                     TORPOR_TEST_POSTGRES=required."
                );
                return None;
            };
            Some(start(&bin).unwrap_or_else(|e| panic!("cannot start PostgreSQL for the tests: {e}")))
        })
        .as_ref()
}

fn bindir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TORPOR_PG_BINDIR") {
        return Some(dir.into());
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|d| d.join("initdb").exists() && d.join("postgres").exists())
    })
}

/// The uid and gid to run the server as: the `postgres` user when this process is root.
fn run_as() -> Result<Option<(u32, u32)>, String> {
    // SAFETY: getuid(2) has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new("postgres").unwrap();
    // SAFETY: getpwnam(3) with a NUL-terminated name; the record is copied out at once (the
    // tests start one server per process, under a OnceLock).
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err("running as root and there is no `postgres` user to run the server as".into());
    }
    // SAFETY: pw is non-null and points at getpwnam's static record.
    Ok(Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) }))
}

fn command(program: &Path, user: Option<(u32, u32)>) -> Command {
    let mut c = Command::new(program);
    if let Some((uid, gid)) = user {
        c.uid(uid).gid(gid);
    }
    c
}

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

fn start(bin: &Path) -> Result<Server, String> {
    let user = run_as()?;
    let root = tempfile::Builder::new()
        .prefix("torpor-pg-")
        .tempdir()
        .map_err(|e| format!("temporary directory: {e}"))?
        // The watchdog removes it.
        .keep();
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&root, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
    }
    let pwfile = root.join("pw");
    std::fs::write(&pwfile, PASSWORD).map_err(|e| e.to_string())?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
    }
    let out = command(&bin.join("initdb"), user)
        .arg("-D")
        .arg(root.join("data"))
        .args(["-U", "postgres", "-A", "scram-sha-256", "-E", "UTF8"])
        .args(["--locale=C", "--no-sync"])
        .arg(format!("--pwfile={}", pwfile.display()))
        .output()
        .map_err(|e| format!("initdb: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let port = free_port();
    // The server runs under a shell that waits for its stdin (our pipe) to close, which
    // happens when this process exits however it exits; it then stops the server
    // (SIGQUIT: immediate shutdown) and removes the directory.
    let script = r#"
        "$0" -D "$1/data" -p "$2" -c listen_addresses=127.0.0.1 -c unix_socket_directories= \
          -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
          -c max_connections=400 >"$1/pg.log" 2>&1 </dev/null &
        pid=$!
        cat >/dev/null
        kill -QUIT "$pid"; wait "$pid"; rm -rf "$1"
    "#;
    let watchdog = command(Path::new("/bin/sh"), user)
        .arg("-c")
        .arg(script)
        .arg(bin.join("postgres"))
        .arg(&root)
        .arg(port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting postgres: {e}"))?;
    let server = Server {
        port,
        _watchdog: Mutex::new(watchdog),
    };
    // Ready when it answers a query (it accepts connections before it can serve them).
    let deadline = Instant::now() + Duration::from_secs(60);
    let url = server.url("postgres");
    loop {
        match Admin::try_connect(&url) {
            Ok(_) => return Ok(server),
            Err(e) if Instant::now() > deadline => {
                let log = std::fs::read_to_string(root.join("pg.log")).unwrap_or_default();
                return Err(format!("postgres did not start: {e}\n{log}"));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A plain client on its own runtime, for what tests do beside the store: create databases,
/// read and corrupt rows, hold locks, end other sessions.
pub struct Admin {
    rt: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
}

impl Admin {
    fn try_connect(url: &str) -> Result<Admin, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let client = rt.block_on(async {
            let (client, conn) = tokio_postgres::connect(url, NoTls)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(client)
        })?;
        Ok(Admin { rt, client })
    }

    pub fn connect(url: &str) -> Admin {
        Admin::try_connect(url).unwrap_or_else(|e| panic!("admin connection: {e}"))
    }

    /// Runs `sql` (statements separated by `;`, no parameters).
    pub fn batch(&self, sql: &str) {
        self.rt
            .block_on(self.client.batch_execute(sql))
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    /// Runs `sql` with text parameters `$1…`; the rows it wrote.
    pub fn exec(&self, sql: &str, args: &[&str]) -> u64 {
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            args.iter().map(|a| a as _).collect();
        self.rt
            .block_on(self.client.execute(sql, &params))
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
    }

    /// The first column of each row of `sql`, as text (NULL as "").
    pub fn texts(&self, sql: &str, args: &[&str]) -> Vec<String> {
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            args.iter().map(|a| a as _).collect();
        let rows = self
            .rt
            .block_on(self.client.query(sql, &params))
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        rows.iter()
            .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
            .collect()
    }
}

/// A fresh database on the process's server: its name.
pub fn new_database(server: &Server) -> String {
    static ADMIN: OnceLock<Mutex<Admin>> = OnceLock::new();
    let name = format!("t_{:016x}", rand::random::<u64>());
    ADMIN
        .get_or_init(|| Mutex::new(Admin::connect(&server.url("postgres"))))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .batch(&format!("CREATE DATABASE {name}"));
    name
}
