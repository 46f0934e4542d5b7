//! Real brokers for the pool tests: Redis, NATS with JetStream and RabbitMQ with its management
//! plugin, each started from the Debian package's binary on 127.0.0.1 with free ports and its
//! own data directory, and stopped by PID (scripts/deps.sh installs them); and the helpers every
//! pool test shares (waiting for a pool state, reading back what the agents handled).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
pub fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

fn wait_port(port: u16, what: &str, log: &Path) {
    wait_port_on("127.0.0.1", port, what, log)
}

fn wait_port_on(host: &str, port: u16, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect((host, port)).is_err() {
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
    /// The address it listens on (127.0.0.1 unless started with [`Redis::start_bound`]).
    pub bind: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Redis {
        Self::start_bound("127.0.0.1", port)
    }

    /// On `bind` (e.g. a global address of this host, which sandboxes reach through their
    /// egress network).
    pub fn start_bound(bind: &str, port: u16) -> Redis {
        let dir = tempfile::Builder::new()
            .prefix("torpor-redis-")
            .tempdir()
            .unwrap();
        let mut r = Redis {
            port,
            bind: bind.to_string(),
            dir,
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let log = self.dir.path().join("redis.log");
        let child = Command::new("redis-server")
            .args(["--bind", &self.bind, "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
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
        wait_port_on(&self.bind, self.port, "redis-server", &log);
    }

    pub fn url(&self) -> String {
        format!("redis://{}:{}", self.bind, self.port)
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
        let mut n = Nats {
            port: free_port(),
            dir,
            child: None,
        };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        let log = self.dir.path().join("nats.log");
        let _ = std::fs::remove_file(&log);
        let child = Command::new("nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("js"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("nats-server (apt-get install nats-server; scripts/deps.sh)");
        self.child = Some(child);
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
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
    }

    /// A restart on the same port and JetStream directory: streams, consumers and their
    /// messages survive (file storage). After [`Nats::stop`], starts it again.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
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
        let mut r = Rabbit {
            amqp_port,
            mgmt_port,
            dir,
            env,
            child: None,
        };
        r.spawn();
        r
    }

    /// Starts the node; a start that does not come up (seen once after a restart: the node
    /// before it not yet gone) is tried once more after a pause.
    fn spawn(&mut self) {
        if self.try_spawn() {
            return;
        }
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            self.try_spawn(),
            "rabbitmq did not start (twice):\n{}",
            std::fs::read_to_string(self.dir.path().join("out.log")).unwrap_or_default()
        );
    }

    /// Starts the node and waits for it; false when it did not come up.
    fn try_spawn(&mut self) -> bool {
        let d = self.dir.path().to_path_buf();
        let child = Command::new(format!("{RABBIT_BIN}/rabbitmq-server"))
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(d.join("out.log")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let r = &*self;
        let mgmt_port = self.mgmt_port;
        let st = Command::new(format!("{RABBIT_BIN}/rabbitmqctl"))
            .args(["wait", "--timeout", "120", "--pid"])
            .arg(r.child.as_ref().unwrap().id().to_string())
            .envs(r.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        if !st.success() {
            return false;
        }
        wait_port(
            mgmt_port,
            "rabbitmq management",
            &r.dir.path().join("out.log"),
        );
        wait_port(
            self.amqp_port,
            "rabbitmq amqp",
            &self.dir.path().join("out.log"),
        );
        true
    }

    /// Stops the node (every connection is closed) and starts it again on the same ports and
    /// data directory: durable queues and persistent messages survive. After [`Rabbit::stop`],
    /// starts it again.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn stop(&mut self) {
        let _ = Command::new(format!("{RABBIT_BIN}/rabbitmqctl"))
            .arg("shutdown")
            .envs(self.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
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
        self.stop();
        // epmd outlives the broker; this one listens on our own port.
        let _ = Command::new("epmd")
            .arg("-kill")
            .envs(self.env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

// ------------------------------------------------------------------------ pool test helpers

/// A dispatch handler: appends the message to /tmp/done.log; a message starting with `poison`
/// fails.
pub const HANDLER: &str = "import sys\nm = sys.stdin.read()\nif m.startswith('poison'): sys.exit(3)\nopen('/tmp/done.log', 'a').write(m + '\\n')\n";

/// Polls `GET /v1/pools/{name}` until `ok`, failing with the last status after `within`.
pub async fn wait_pool(
    c: &torpor_api::Client,
    name: &str,
    what: &str,
    within: Duration,
    ok: impl Fn(&torpor_control::pools::PoolStatus) -> bool,
) -> torpor_control::pools::PoolStatus {
    let deadline = Instant::now() + within;
    loop {
        let p = c.pool(name).await.unwrap();
        if ok(&p) {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "pool {name}: {what} not reached within {within:?}: {}",
            serde_json::to_string_pretty(&p).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every line every agent of the pool logged in /tmp/done.log, counted.
pub async fn handled(
    c: &torpor_api::Client,
    p: &torpor_control::pools::PoolStatus,
) -> std::collections::BTreeMap<String, usize> {
    let mut seen = std::collections::BTreeMap::new();
    for id in &p.sandboxes {
        let text = match c.read_file(id.as_str(), "/tmp/done.log").await {
            Ok(b) => String::from_utf8(b).unwrap(),
            Err(torpor_api::ClientError::Api { code, .. }) if code == "file_not_found" => {
                String::new()
            }
            Err(e) => panic!("reading {id}'s log: {e}"),
        };
        for line in text.lines().filter(|l| !l.is_empty()) {
            *seen.entry(line.to_string()).or_insert(0) += 1;
        }
    }
    seen
}

/// Each message sent was handled exactly once, and nothing else was.
pub fn exactly_once(seen: &std::collections::BTreeMap<String, usize>, sent: &[String]) {
    let dup: Vec<_> = seen.iter().filter(|(_, &n)| n != 1).collect();
    assert!(dup.is_empty(), "messages handled more than once: {dup:?}");
    let mut got: Vec<_> = seen.keys().cloned().collect();
    let mut want = sent.to_vec();
    got.sort();
    want.sort();
    assert_eq!(got, want, "handled messages differ from those sent");
}

// ------------------------------------------------------------------------------------ tansu

/// tansu, a Kafka-compatible broker, in memory (scripts/test-kafka.sh installs it into
/// /opt/tansu; `TANSU` names another binary).
pub struct Tansu {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Tansu {
    pub fn start() -> Tansu {
        let dir = tempfile::Builder::new()
            .prefix("torpor-tansu-")
            .tempdir()
            .unwrap();
        let port = free_port();
        let bin = std::env::var("TANSU").unwrap_or_else(|_| "/opt/tansu/bin/tansu".into());
        let log = dir.path().join("tansu.log");
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("tansu.err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin}: {e} (scripts/test-kafka.sh installs tansu)"));
        let t = Tansu {
            port,
            dir,
            child: Some(child),
        };
        wait_port(port, "tansu", &t.dir.path().join("tansu.err"));
        t
    }

    pub fn brokers(&self) -> Vec<String> {
        vec![format!("127.0.0.1:{}", self.port)]
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
    }
}
