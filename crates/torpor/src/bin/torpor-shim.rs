//! `torpor-shim`: the supervisor of one container's runsc process (live restore, see
//! `torpor_runtime::shim`), as a binary of its own. One runs beside every resident sandbox, so
//! its memory counts against density: this one links only the relay, where `torpor shim` (the
//! same code inside the whole CLI) carries the big binary's relocated data, several MiB a copy.
//! The daemon uses it when it sits next to the `torpor` binary.
//!
//! Usage (the daemon's, never a person's): `torpor-shim shim --dir DIR --socket NAME -- RUNSC ARGS…`

use std::ffi::OsString;
use std::path::PathBuf;

fn usage() -> ! {
    eprintln!("usage: torpor-shim shim --dir DIR --socket NAME -- COMMAND [ARGS...]");
    std::process::exit(2);
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some("shim".as_ref()) {
        usage();
    }
    let (mut dir, mut socket) = (None, None);
    let mut command: Vec<OsString> = Vec::new();
    while let Some(a) = args.next() {
        match a.to_str() {
            Some("--dir") => dir = args.next().map(PathBuf::from),
            Some("--socket") => socket = args.next().and_then(|s| s.into_string().ok()),
            Some("--") => {
                command = args.by_ref().collect();
                break;
            }
            _ => usage(),
        }
    }
    let (Some(dir), Some(socket)) = (dir, socket) else {
        usage();
    };
    if command.is_empty() {
        usage();
    }
    match torpor_runtime::shim::run(dir, socket, command) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("torpor-shim: {e}");
            std::process::exit(1);
        }
    }
}
