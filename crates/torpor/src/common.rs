//! What every client command shares, and nothing else: where the daemon listens and keeps
//! its files (environment names, default address, data directory, admin token), the API
//! client built from `--url`/`--token`, the error and exit code a command returns, and the
//! output helpers. The sub-commands (`cli`, `gpu`, `pool`, `snapshot`, `audit`, `usage`) and
//! the daemon depend on this module; it depends on none of them.

use std::path::PathBuf;

use clap::Args;
use torpor_api::{Client, ClientError};

use crate::datadir;

/// Environment variables the CLI and daemon read.
pub const ENV_URL: &str = "TORPOR_URL";
pub const ENV_TOKEN: &str = "TORPOR_TOKEN";
pub const ENV_DATA_DIR: &str = "TORPOR_DATA_DIR";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7077";
pub const TOKEN_FILE: &str = datadir::ADMIN_TOKEN_FILE;

/// `/var/lib/torpor` as root, else `$XDG_DATA_HOME/torpor` (or `~/.local/share/torpor`).
pub fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(ENV_DATA_DIR) {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/torpor");
    }
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("torpor")
}

#[derive(Args, Clone)]
pub struct Conn {
    /// torpor's API address.
    #[arg(long, env = ENV_URL, global = true)]
    pub(crate) url: Option<String>,
    /// Bearer token (default: the admin token in the data directory on this machine).
    #[arg(long, env = ENV_TOKEN, global = true, hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,
}

/// An error the CLI reports; the exit code is 1 unless the command said otherwise.
#[derive(Debug)]
pub struct CliError(pub(crate) String);

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError(e.to_string())
    }
}

impl From<anyhow::Error> for CliError {
    fn from(e: anyhow::Error) -> Self {
        CliError(format!("{e:#}"))
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError(e.to_string())
    }
}

pub(crate) type CliResult = Result<i32, CliError>;

/// A client from --url/--token, the environment, or the local daemon's token file.
pub fn client(conn: &Conn) -> Result<Client, CliError> {
    let url = conn
        .url
        .clone()
        .unwrap_or_else(|| format!("http://{DEFAULT_LISTEN}"));
    let token = match &conn.token {
        Some(t) => t.clone(),
        None => {
            let path = default_data_dir().join(TOKEN_FILE);
            std::fs::read_to_string(&path)
                .map(|t| t.trim().to_string())
                .map_err(|e| {
                    CliError(format!(
                        "no token: set {ENV_TOKEN} or --token, or run on the daemon's machine ({}: {e})",
                        path.display()
                    ))
                })?
        }
    };
    Ok(Client::new(&url, &token))
}

/// Whether the CLI calls as the admin: no token given (the data directory's admin token is
/// used), or the token given is that one.
pub fn is_admin(conn: &Conn) -> bool {
    let Some(token) = &conn.token else {
        return true;
    };
    std::fs::read_to_string(default_data_dir().join(TOKEN_FILE))
        .is_ok_and(|admin| admin.trim() == token.trim())
}

pub fn print_json<T: serde::Serialize>(v: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("values serialise")
    );
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}
