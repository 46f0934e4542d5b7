//! A real S3-compatible server for tests: `moto_server` (PyPI `moto[server]`, installed by
//! scripts/deps.sh; set MOTO_SERVER if it is not on PATH) on a free loopback port, stopped by
//! its pid. Shared by torpor-snapshot's and torpor's S3 tests (the latter include this file
//! with `#[path]`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Moto {
    child: Child,
    pub port: u16,
    _log_dir: tempfile::TempDir,
}

impl Moto {
    pub fn start() -> Moto {
        let exe = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
        let port = torpor_runtime::ports::loopback_port().expect("a free loopback port");
        let log_dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(log_dir.path().join("moto.log")).unwrap();
        let child = Command::new(&exe)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {exe} (pip install \"moto[server]\", or set MOTO_SERVER): {e}")
            });
        let mut moto = Moto {
            child,
            port,
            _log_dir: log_dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !http(port, "GET", "/").is_some_and(|s| s.starts_with("HTTP/1.1 200")) {
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto_server exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        moto
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn create_bucket(&self, name: &str) {
        let resp = http(self.port, "PUT", &format!("/{name}")).expect("create bucket");
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }

    /// SIGKILL by pid: the server vanishes mid-request, as a crashed one would.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A minimal unsigned HTTP/1.1 request (moto accepts unsigned bucket creation).
pub fn http(port: u16, method: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}
