//! Real brokers for the pool tests: Redis, NATS with JetStream and RabbitMQ with its management
//! plugin, each started from the Debian package's binary on 127.0.0.1 with free ports and its
//! own data directory, and stopped by PID (scripts/deps.sh installs them).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_port(port: u16, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {port}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop_child(c: &mut Child) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

pub struct Redis {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Redis {
        let dir = tempfile::Builder::new()
            .prefix("torpor-redis-")
            .tempdir()
            .unwrap();
        let mut r = Redis {
            port,
            dir,
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let log = self.dir.path().join("redis.log");
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (apt-get install redis-server; scripts/deps.sh)");
        self.child = Some(child);
        wait_port(self.port, "redis-server", &log);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
    }

    /// A restart on the same port (no persistence: it comes back empty).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

pub struct Nats {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Nats {
    pub fn start() -> Nats {
        let dir = tempfile::Builder::new()
            .prefix("torpor-nats-")
            .tempdir()
            .unwrap();
        let port = free_port();
        let log = dir.path().join("nats.log");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path().join("js"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("nats-server (apt-get install nats-server; scripts/deps.sh)");
        let n = Nats {
            port,
            dir,
            child: Some(child),
        };
        // `/healthz` answers before the client port listens: wait for the log line.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Server is ready") {
                break;
            }
            assert!(Instant::now() < deadline, "nats-server not ready:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
    }
}

/// RabbitMQ with the management plugin; starting costs ~7 s, so a test binary starts one.
pub struct Rabbit {
    pub amqp_port: u16,
    pub mgmt_port: u16,
    dir: tempfile::TempDir,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

impl Rabbit {
    pub fn start() -> Rabbit {
        let dir = tempfile::Builder::new()
            .prefix("torpor-rmq-")
            .tempdir()
            .unwrap();
        let d = dir.path().to_path_buf();
        let (amqp_port, mgmt_port, dist_port, epmd_port) =
            (free_port(), free_port(), free_port(), free_port());
        let p = |x: &str| d.join(x).display().to_string();
        let env: Vec<(String, String)> = [
            ("HOME", p("")),
            ("RABBITMQ_NODENAME", format!("torpor{amqp_port}@localhost")),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT", amqp_port.to_string()),
            ("RABBITMQ_DIST_PORT", dist_port.to_string()),
            ("ERL_EPMD_PORT", epmd_port.to_string()),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".into()),
            ("RABBITMQ_MNESIA_BASE", p("mnesia")),
            ("RABBITMQ_LOG_BASE", p("log")),
            ("RABBITMQ_CONFIG_FILE", p("rabbitmq.conf")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", p("enabled_plugins")),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}".into(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        std::fs::write(
            d.join("rabbitmq.conf"),
            format!(
                "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {mgmt_port}\ncollect_statistics_interval = 500\n"
            ),
        )
        .unwrap();
        let st = Command::new(format!("{RABBIT_BIN}/rabbitmq-plugins"))
            .args(["enable", "--offline", "rabbitmq_management"])
            .envs(env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("rabbitmq-plugins (apt-get install rabbitmq-server; scripts/deps.sh)");
        assert!(st.success(), "rabbitmq-plugins enable failed");
        let child = Command::new(format!("{RABBIT_BIN}/rabbitmq-server"))
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(d.join("out.log")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let r = Rabbit {
            amqp_port,
            mgmt_port,
            dir,
            env,
            child: Some(child),
        };
        let st = Command::new(format!("{RABBIT_BIN}/rabbitmqctl"))
            .args(["wait", "--timeout", "120", "--pid"])
            .arg(r.child.as_ref().unwrap().id().to_string())
            .envs(r.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(
            st.success(),
            "rabbitmq did not start:\n{}",
            std::fs::read_to_string(r.dir.path().join("out.log")).unwrap_or_default()
        );
        wait_port(
            mgmt_port,
            "rabbitmq management",
            &r.dir.path().join("out.log"),
        );
        r
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    pub fn management_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.mgmt_port)
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        let _ = Command::new(format!("{RABBIT_BIN}/rabbitmqctl"))
            .arg("shutdown")
            .envs(self.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
        // epmd outlives the broker; this one listens on our own port.
        let _ = Command::new("epmd")
            .arg("-kill")
            .envs(self.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
