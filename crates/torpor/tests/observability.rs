//! Observability against the real things: the real `torpor up` daemon runs a small workload
//! (two tenants, a quota refusal, sleeping and waking agents, a GPU share on a declared
//! inventory, a networked sandbox with a denied connection, a pool on a real Redis), a real
//! Prometheus (Debian's `prometheus`) scrapes it with `deploy/prometheus`'s rules loaded, and:
//! `promtool check metrics` is clean on the scrape; every series a rule or a Grafana panel
//! names is exported (DCGM's only with NVML: those are checked against docs/GPU.md); every
//! panel's query returns data with the labels it groups by; `promtool check rules` and
//! `promtool test rules` pass. Also the usage records of a known workload, across a restart.
//! `scripts/deps.sh` installs prometheus (promtool comes with it).

#[path = "common/brokers.rs"]
mod brokers;
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_core::{IdlePolicy, NetworkPolicy, Tier};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|d| d.join("deploy/prometheus").is_dir())
        .expect("the repository root above the crate")
        .to_path_buf()
}

fn gpu_fixture_local(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/gpu")
        .join(name)
        .display()
        .to_string()
}

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(repo())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (apt-get install prometheus; scripts/deps.sh)");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    } else {
        drop(child.stdin.take());
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn promtool_checks_the_rules_and_fires_each_alert_in_its_unit_tests() {
    let (ok, out) = promtool(
        &[
            "check",
            "rules",
            "deploy/prometheus/torpor-rules.yml",
            "deploy/prometheus/torpor-alerts.yml",
        ],
        None,
    );
    assert!(ok, "{out}");
    let (ok, out) = promtool(
        &["test", "rules", "deploy/prometheus/torpor-alerts.test.yml"],
        None,
    );
    assert!(ok, "{out}");
    // Every alert of the rules file has a unit test that names it.
    let alerts =
        std::fs::read_to_string(repo().join("deploy/prometheus/torpor-alerts.yml")).unwrap();
    let tests =
        std::fs::read_to_string(repo().join("deploy/prometheus/torpor-alerts.test.yml")).unwrap();
    for name in alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "alert {name} has no promtool test"
        );
    }
}

/// A real Prometheus on a free port with its own data directory, stopped by PID when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(scrape: &str) -> Prometheus {
        let dir = tempfile::Builder::new()
            .prefix("torpor-prom-")
            .tempdir()
            .unwrap();
        let rules = repo().join("deploy/prometheus");
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [{:?}, {:?}]\n\
             scrape_configs:\n\
             - job_name: torpor\n  static_configs: [{{targets: [\"{scrape}\"]}}]\n",
            rules.join("torpor-rules.yml"),
            rules.join("torpor-alerts.yml"),
        );
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(&cfg, config).unwrap();
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus (apt-get install prometheus; scripts/deps.sh)");
        Prometheus {
            child,
            port,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Option<Value> {
        let r = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/api/v1/{path}", self.port))
            .query(params)
            .send()
            .await
            .ok()?;
        let v: Value = r.json().await.ok()?;
        (v["status"] == "success").then(|| v["data"].clone())
    }

    async fn query(&self, expr: &str) -> Vec<Value> {
        self.api("query", &[("query", expr)])
            .await
            .and_then(|d| d["result"].as_array().cloned())
            .unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    // Aggregations, which may be followed by `by (..)` rather than `(`.
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names a PromQL expression reads: identifiers outside strings, label matchers
/// and ranges that are neither functions, keywords, numbers nor Grafana variables.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut plain = String::new();
    let (mut depth_brace, mut depth_bracket, mut in_str) = (0, 0, false);
    for ch in expr.chars() {
        match ch {
            '"' if depth_brace == 0 || in_str => in_str = !in_str,
            '{' if !in_str => depth_brace += 1,
            '}' if !in_str => depth_brace -= 1,
            '[' if !in_str => depth_bracket += 1,
            ']' if !in_str => depth_bracket -= 1,
            c if !in_str && depth_brace == 0 && depth_bracket == 0 => {
                plain.push(c);
                continue;
            }
            _ => {}
        }
        plain.push(' ');
    }
    // `by (a, b)` lists labels, not metrics.
    let mut out = BTreeSet::new();
    let chars: Vec<char> = plain.chars().collect();
    let mut i = 0;
    let mut skip_list = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '$' {
            while i < chars.len()
                && (chars[i] == '$' || chars[i].is_alphanumeric() || chars[i] == '_')
            {
                i += 1;
            }
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j] == ' ' {
                j += 1;
            }
            let is_call = j < chars.len() && chars[j] == '(';
            if matches!(
                word.as_str(),
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
            ) {
                skip_list = true;
            } else if !is_call
                && !skip_list
                && !PROMQL_WORDS.contains(&word.to_lowercase().as_str())
            {
                out.insert(word);
            }
            continue;
        }
        if c == '(' && skip_list {
            // The label list: skip to its ')'.
            while i < chars.len() && chars[i] != ')' {
                i += 1;
            }
            skip_list = false;
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        i += 1;
    }
    out
}

/// Labels an expression groups by (`by (a, b)`), less `le` (histogram_quantile drops it).
fn grouped_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("by (") {
        let list = &rest[at + 4..];
        let end = list.find(')').unwrap_or(list.len());
        for l in list[..end].split(',').map(str::trim) {
            if !l.is_empty() && l != "le" {
                out.insert(l.to_string());
            }
        }
        rest = &list[end..];
    }
    out
}

#[test]
fn metric_names_come_out_of_promql_without_labels_functions_or_variables() {
    let names = metric_names(
        r#"histogram_quantile(0.95, sum by (le, from_tier) (rate(torpor_wake_seconds_bucket{instance=~"$instance",x="a{b}"}[5m]))) / 1073741824 * $price + torpor:lot:saturation_ratio > bool 0.8 or up{job="torpor"} == 0"#,
    );
    let want: BTreeSet<String> = [
        "torpor_wake_seconds_bucket",
        "torpor:lot:saturation_ratio",
        "up",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(names, want);
    assert_eq!(
        grouped_labels("histogram_quantile(0.9, sum by (le, tier) (x)) + sum by (tenant) (y)"),
        ["tenant", "tier"].iter().map(|s| s.to_string()).collect()
    );
}

/// Every (dashboard, panel title, expression) of deploy/grafana/dashboards.
fn panel_queries() -> Vec<(String, String, String)> {
    let dir = repo().join("deploy/grafana/dashboards");
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "dashboards: {files:?}");
    for f in files {
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let name = d["title"].as_str().unwrap().to_string();
        for p in d["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                out.push((
                    name.clone(),
                    p["title"].as_str().unwrap().to_string(),
                    t["expr"].as_str().unwrap().to_string(),
                ));
            }
        }
    }
    out
}

/// The GPU exporter's (DCGM's) names docs/GPU.md lists.
fn dcgm_names_in_docs() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(repo().join("docs/GPU.md")).unwrap();
    doc.split('`')
        .filter(|w| {
            w.starts_with("DCGM_FI_")
                && w.chars()
                    .all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        })
        .map(str::to_string)
        .collect()
}

async fn post_json(d: &Daemon, path: &str, token: &str, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}{path}", d.url()))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn get_json(d: &Daemon, path: &str, token: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{}{path}", d.url()))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Runs until `check` holds or `limit` passes (then panics with `what`).
async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        let missing = check().await;
        let Some(missing) = missing else {
            return;
        };
        assert!(Instant::now() < deadline, "{what}: {missing}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_scrapes_every_series_the_rules_and_dashboards_name() {
    let redis = brokers::Redis::start();
    let host = host_addr();
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let d = Daemon::start_with_env(
        &[
            "--workers",
            "6",
            "--metrics-listen",
            &metrics_addr,
            "--sandbox-reach-host",
            &host,
            "--gpu-inventory",
            &gpu_fixture_local("node-h200-l4.toml"),
            "--gpu-quotas",
            &gpu_fixture_local("quotas-admin.toml"),
        ],
        &[("TORPOR_USAGE_SAMPLE_MS", "300")],
    )
    .await;
    let c = d.client();
    let admin = d.token();
    let prom = Prometheus::start(&metrics_addr);

    // Sleeping and waking: freeze after 1 s, park after 2 s.
    let sleepy = IdlePolicy {
        freeze_after_s: Some(1.0),
        park_after_s: Some(2.0),
        suspend_after_s: None,
    };
    c.create_template(&agent_template("sleepy", sleepy))
        .await
        .unwrap();
    let agent = create(&c, "sleepy").await;
    call_agent(&c, &agent, "first").await;
    let a2 = agent.clone();
    let c2 = c.clone();
    wait_for("the agent parks", Duration::from_secs(60), || {
        let (c, a) = (c2.clone(), a2.clone());
        async move {
            let s = c.sandbox(&a).await.unwrap();
            (s.tier != "parked").then(|| format!("tier {}", s.tier))
        }
    })
    .await;
    call_agent(&c, &agent, "woken").await;
    c.suspend(&agent, Some(Tier::Suspended)).await.unwrap();
    call_agent(&c, &agent, "from the store").await;

    // A quota refusal of another tenant.
    let r = post_json(
        &d,
        "/v1/tenants",
        &admin,
        json!({"name": "team-b", "quotas": {"max_sandboxes": 1}}),
    )
    .await;
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let team_b: Value = r.json().await.unwrap();
    let tb = team_b["token"].as_str().unwrap().to_string();
    let b = torpor_api::Client::new(&d.url(), &tb);
    create(&b, "host").await;
    let err = b
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("quota_exceeded"), "{err}");

    // A GPU share on the declared inventory.
    let gpu = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            gpu: Some(json!({"mode": "mig", "profile": "3g.71gb"})),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;

    // A networked sandbox: one allowed fetch, one denied, one proxied request.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut s in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhi");
        }
    });
    let mut tpl = agent_template("net", no_idle());
    tpl.command = Vec::new();
    tpl.warmup_ms = 0;
    tpl.network = Some(NetworkPolicy::full());
    c.create_template(&tpl).await.unwrap();
    let net = c
        .create_sandbox(&CreateSandboxBody {
            template: "net".into(),
            network: Some(
                serde_json::from_value(
                    json!({"allow": [{"cidr": format!("{host}/32"), "ports": [port]}]}),
                )
                .unwrap(),
            ),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let fetch = |url: String| {
        ExecBody {
        cmd: vec![
            "python3".into(),
            "-c".into(),
            "import sys,urllib.request;print(urllib.request.urlopen(sys.argv[1],timeout=3).read().decode())".into(),
            url,
        ],
        timeout_ms: Some(30_000),
        ..Default::default()
    }
    };
    let ok = c
        .exec(&net, &fetch(format!("http://{host}:{port}/")))
        .await
        .unwrap();
    assert_eq!(ok.stdout.trim(), "hi", "{ok:?}");
    let denied = c
        .exec(&net, &fetch(format!("http://{host}:{}/", port + 1)))
        .await
        .unwrap();
    assert_ne!(denied.exit_code, Some(0), "{denied:?}");
    let _ = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{net}/ports/8080/", d.url()))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();

    // A pool on a real Redis (no work: its gauges and counters exist from its first reading).
    let r = post_json(
        &d,
        "/v1/pools",
        &admin,
        json!({"name": "jobs", "template": "host", "min": 0, "max": 2, "target": 1,
               "poll_interval_ms": 300,
               "triggers": [{"type": "redis-list", "url": redis.url(), "key": "jobs"}],
               "dispatch": {"command": ["cat"]}}),
    )
    .await;
    assert!(r.status().is_success(), "{:?}", r.text().await);

    // promtool on a real scrape of /metrics.
    let scrape = reqwest::get(format!("http://{metrics_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let (ok, out) = promtool(&["check", "metrics"], Some(&scrape));
    assert!(ok, "promtool check metrics:\n{out}\n{scrape}");

    // What the rules and the dashboards name.
    let dcgm = dcgm_names_in_docs();
    assert!(dcgm.contains("DCGM_FI_DEV_XID_ERRORS"), "{dcgm:?}");
    let panels = panel_queries();
    wait_for(
        "Prometheus loads the rules",
        Duration::from_secs(60),
        || async {
            let groups = prom.api("rules", &[]).await?;
            let n = groups["groups"].as_array()?.len();
            (n != 2).then(|| format!("{n} groups\n{}", prom.log()))
        },
    )
    .await;
    let groups = prom.api("rules", &[]).await.unwrap();
    let mut recorded = BTreeSet::new();
    let mut rule_exprs = Vec::new();
    for g in groups["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            if r["type"] == "recording" {
                recorded.insert(r["name"].as_str().unwrap().to_string());
            }
            rule_exprs.push((
                r["name"].as_str().unwrap().to_string(),
                r["query"].as_str().unwrap().to_string(),
            ));
        }
    }
    let mut named: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (who, expr) in rule_exprs
        .iter()
        .map(|(n, e)| (format!("rule {n}"), e))
        .chain(panels.iter().map(|(d, p, e)| (format!("{d} / {p}"), e)))
    {
        for name in metric_names(expr) {
            named.entry(name).or_default().push(who.clone());
        }
    }
    // Each name: exported by torpor (seen by Prometheus), recorded by a rule, Prometheus' own
    // `up`, or a DCGM name docs/GPU.md lists (there is no GPU here).
    wait_for(
        "every named series is scraped",
        Duration::from_secs(90),
        || async {
            let scraped: BTreeSet<String> = prom
                .api("label/__name__/values", &[])
                .await?
                .as_array()?
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            let missing: Vec<String> = named
                .iter()
                .filter(|(n, _)| {
                    !(scraped.contains(*n)
                        || n.as_str() == "up"
                        || (n.starts_with("DCGM_FI_") && dcgm.contains(*n))
                        || (n.contains(':') && recorded.contains(*n)))
                })
                .map(|(n, who)| format!("{n} (named by {})", who.join("; ")))
                .collect();
            (!missing.is_empty()).then(|| missing.join("\n"))
        },
    )
    .await;
    // Each panel's query (but DCGM's) returns data, with the labels it groups by; each
    // recording rule has a value.
    let substitute = |e: &str| {
        e.replace("$instance", ".*")
            .replace("$price_gib_hour", "1")
            .replace("$price_vcpu_hour", "1")
    };
    wait_for(
        "every panel and recording rule returns data",
        Duration::from_secs(120),
        || async {
            let mut empty = Vec::new();
            for (dash, panel, expr) in &panels {
                if metric_names(expr).iter().any(|n| n.starts_with("DCGM_FI_")) {
                    continue;
                }
                let result = prom.query(&substitute(expr)).await;
                if result.is_empty() {
                    empty.push(format!("{dash} / {panel}: {expr}"));
                    continue;
                }
                for series in &result {
                    for l in grouped_labels(expr) {
                        if series["metric"].get(&l).is_none() {
                            empty.push(format!("{dash} / {panel}: no label {l} in {series}"));
                        }
                    }
                }
            }
            // Sandboxes in a transition: empty unless one is in flight (the alert's input).
            for r in recorded
                .iter()
                .filter(|r| r.as_str() != "torpor:sandboxes_in_transition:by_state")
            {
                if prom.query(r).await.is_empty() {
                    empty.push(format!("recording rule {r}"));
                }
            }
            (!empty.is_empty()).then(|| empty.join("\n"))
        },
    )
    .await;
    // The GPU share in the usage records: a 3g MIG slice is 3/7 of an H200 for every hour the
    // sandbox was resident (a sample taken mid-transition counts the time, not the share).
    let (_, usage) = get_json(&d, "/v1/usage?group_by=sandbox", &admin).await;
    let row = usage["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["sandbox"] == gpu.as_str())
        .unwrap_or_else(|| panic!("no usage for {gpu}: {usage}"))
        .clone();
    let held = row["gpu_hours"]["mig:3g.71gb@NVIDIA H200"]
        .as_f64()
        .unwrap_or(0.0);
    let resident = row["tier_hours"]["running"].as_f64().unwrap_or(0.0)
        + row["tier_hours"]["frozen"].as_f64().unwrap_or(0.0);
    let by_hand = resident * 3.0 / 7.0;
    assert!(
        held > 0.5 * by_hand && held <= by_hand * (1.0 + 1e-9),
        "GPU-hours {held} vs 3/7 x {resident} resident hours: {row}"
    );
}

/// Usage of `tenant`'s rows (summed) from `GET /v1/usage`, as `token` sees it.
async fn usage_of(d: &Daemon, token: &str, query: &str) -> (u16, Value) {
    get_json(d, &format!("/v1/usage{query}"), token).await
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_f64().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn usage_of_a_known_workload_is_recorded_per_tenant_and_survives_a_restart() {
    let mut d =
        Daemon::start_with_env(&["--workers", "4"], &[("TORPOR_USAGE_SAMPLE_MS", "200")]).await;
    let c = d.client();
    let admin = d.token();
    let mut tokens = BTreeMap::new();
    for t in ["team-a", "team-b"] {
        let r = post_json(&d, "/v1/tenants", &admin, json!({"name": t})).await;
        assert_eq!(r.status(), 201);
        let v: Value = r.json().await.unwrap();
        tokens.insert(t, v["token"].as_str().unwrap().to_string());
    }
    let a = torpor_api::Client::new(&d.url(), &tokens["team-a"]);
    let b = torpor_api::Client::new(&d.url(), &tokens["team-b"]);
    // Both: 256 MiB, 1 CPU (the `host` template's limits are the test agent's: see below).
    c.create_template(&agent_template("agent", no_idle()))
        .await
        .unwrap();
    let started = Instant::now();
    let sa = create(&a, "agent").await;
    let sb = create(&b, "agent").await;
    // team-a burns 2 CPU-seconds (process time inside the sandbox); team-b stays idle.
    let burn = c
        .exec(
            &sa,
            &sh("python3 -c 'import time\nt=time.process_time()\nwhile time.process_time()-t<2: pass'"),
        )
        .await
        .unwrap();
    assert_eq!(burn.exit_code, Some(0), "{burn:?}");
    // team-a's sandbox is parked, then woken: one wake from parked.
    a.suspend(&sa, Some(Tier::Parked)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    call_agent(&a, &sa, "after the park").await;
    let resident_s_bound = started.elapsed().as_secs_f64() + 1.0;

    let (code, mine) = usage_of(&d, &tokens["team-a"], "?group_by=sandbox").await;
    assert_eq!(code, 200, "{mine}");
    // Wait for a sample after the wake.
    let mut mine = mine;
    let deadline = Instant::now() + Duration::from_secs(30);
    while num(&mine["rows"][0], &["wakes", "parked"]) < 1.0 {
        assert!(Instant::now() < deadline, "no wake recorded: {mine}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        mine = usage_of(&d, &tokens["team-a"], "?group_by=sandbox").await.1;
    }
    let rows = mine["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "a tenant sees only its own: {mine}");
    let row = &rows[0];
    assert_eq!(row["tenant"], "team-a");
    assert_eq!(row["sandbox"], sa.as_str());
    // By hand: CPU at least half the 2 s burned inside, at most what 1 CPU can do over the time
    // it was resident. (Not nearer the 2 s: the guest's own process time, which the burn counts,
    // runs on under gVisor's ptrace platform while its host thread waits for a core, so on a
    // machine busy with other tests the cgroup's host CPU time came to 1.56 s for it once.)
    let cpu = num(row, &["cpu_seconds"]);
    assert!(cpu >= 1.0 && cpu <= resident_s_bound, "cpu {cpu}: {row}");
    // Memory: at least the agent's 4 MiB buffer, at most its 256 MiB limit, over the time it
    // was resident.
    let gib_h = num(row, &["memory_gib_hours", "running"]);
    let hours = resident_s_bound / 3600.0;
    assert!(
        gib_h > 0.0 && gib_h <= 0.25 * hours,
        "memory {gib_h}: {row}"
    );
    assert_eq!(num(row, &["wakes", "parked"]), 1.0, "{row}");
    assert!(
        num(row, &["snapshot_gib_hours"]) > 0.0,
        "parked for a second: {row}"
    );

    // team-b may not read team-a's usage; the admin reads both.
    let (code, refused) = usage_of(&d, &tokens["team-b"], "?tenant=team-a").await;
    assert_eq!(code, 403, "{refused}");
    assert_eq!(refused["error"]["code"], "forbidden");
    let (_, all) = usage_of(&d, &admin, "?group_by=sandbox").await;
    let tenants: BTreeSet<&str> = all["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["tenant"].as_str())
        .collect();
    assert!(
        tenants.contains("team-a") && tenants.contains("team-b"),
        "{all}"
    );
    let b_cpu = all["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["sandbox"] == sb.as_str())
        .map(|r| num(r, &["cpu_seconds"]))
        .unwrap();
    assert!(
        b_cpu < cpu,
        "the idle tenant used less CPU ({b_cpu} vs {cpu})"
    );
    let (code, bad) = usage_of(&d, &admin, "?group_by=colour").await;
    assert_eq!(
        (code, bad["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    drop(b);

    // A restart loses nothing recorded.
    let before = usage_of(&d, &admin, "?tenant=team-a").await.1;
    d.stop();
    d.spawn().await;
    let after = usage_of(&d, &admin, "?tenant=team-a").await.1;
    for path in [
        &["cpu_seconds"][..],
        &["memory_gib_hours", "running"],
        &["snapshot_gib_hours"],
        &["wakes", "parked"],
    ] {
        assert!(
            num(&after["rows"][0], path) >= num(&before["rows"][0], path),
            "{path:?} went down over a restart: {before} -> {after}"
        );
    }

    // The CLI: CSV for billing systems, with the fixed header.
    let out = Command::new(BIN)
        .args([
            "usage",
            "--csv",
            "--group-by",
            "sandbox",
            "--url",
            &d.url(),
            "--token",
            &admin,
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    assert!(lines
        .next()
        .unwrap()
        .starts_with("tenant,sandbox,interval_start_s,memory_gib_hours_running"));
    assert!(
        lines.any(|l| l.starts_with(&format!("team-a,{sa},"))),
        "{text}"
    );
    // The report: with both agents deleted nothing accrues any more, so its figures can be
    // checked exactly against the usage records priced by hand.
    a.delete_sandbox(&sa).await.unwrap();
    torpor_api::Client::new(&d.url(), &tokens["team-b"])
        .delete_sandbox(&sb)
        .await
        .unwrap();
    let mut settled = usage_of(&d, &admin, "").await.1;
    loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let again = usage_of(&d, &admin, "").await.1;
        if again["rows"] == settled["rows"] {
            break;
        }
        settled = again;
    }
    let prices = d.dir.join("prices.toml");
    std::fs::write(
        &prices,
        "currency = \"USD\"\nmemory_gib_hour = 0.5\nvcpu_hour = 2.0\nstorage_gib_month = 73.0\n",
    )
    .unwrap();
    let page = d.dir.join("report.html");
    let out = Command::new(BIN)
        .args(["report", "--json", "--url", &d.url(), "--token", &admin])
        .arg("--prices")
        .arg(&prices)
        .arg("--html")
        .arg(&page)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    for row in settled["rows"].as_array().unwrap() {
        let tenant = row["tenant"].as_str().unwrap();
        let memory: f64 = row["memory_gib_hours"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .sum();
        let by_hand = memory * 0.5
            + num(row, &["cpu_seconds"]) / 3600.0 * 2.0
            + num(row, &["snapshot_gib_hours"]) / 730.0 * 73.0;
        let priced = report["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant"] == tenant)
            .unwrap_or_else(|| panic!("{tenant} missing from {report}"));
        let total = num(priced, &["cost", "total"]);
        assert!(
            (total - by_hand).abs() <= 1e-9 * by_hand.max(1e-9),
            "{tenant}: report {total} vs by hand {by_hand}"
        );
        // Sleeping made it cheaper than one resident sandbox each (team-a was parked a while);
        // a tenant resident all along costs the same either way, up to rounding
        // ((memory / hours) * hours).
        let always = num(priced, &["cost", "always_resident"]);
        let charged = total - num(priced, &["cost", "storage"]);
        assert!(
            always >= charged * (1.0 - 1e-9),
            "{tenant}: always resident {always} < charged {charged}"
        );
    }
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("<svg") && html.contains("team-a") && html.contains("team-b"));
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "self-contained"
    );
    // A real browser renders it at a phone's width (Debian's chromium; scripts/deps.sh).
    let shot = d.dir.join("report-phone.png");
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=390,1600",
        ])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium (apt-get install chromium; scripts/deps.sh)");
    assert!(out.status.success(), "{out:?}");
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    assert_eq!(width, 390, "rendered at phone width");
}

/// Snapshot GiB-hours of each sandbox in `rows` (grouped by sandbox).
fn snapshot_by_sandbox(usage: &Value) -> BTreeMap<String, f64> {
    usage["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["sandbox"].as_str().unwrap().to_string(),
                num(r, &["snapshot_gib_hours"]),
            )
        })
        .collect()
}

/// How fast each of `ids`' snapshot GiB-hours grow, in GiB (GiB-hours per hour), over `window`.
async fn snapshot_gib(d: &Daemon, token: &str, ids: &[String], window: Duration) -> Vec<f64> {
    let (_, u) = usage_of(d, token, "?group_by=sandbox").await;
    let first = snapshot_by_sandbox(&u);
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let (_, u) = usage_of(d, token, "?group_by=sandbox").await;
    let hours = t.elapsed().as_secs_f64() / 3600.0;
    let second = snapshot_by_sandbox(&u);
    ids.iter()
        .map(|id| (second[id] - first.get(id).copied().unwrap_or(0.0)) / hours)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn suspended_forks_pay_an_equal_share_of_the_chunks_they_share() {
    let d = Daemon::start_with_env(&["--workers", "2"], &[("TORPOR_USAGE_SAMPLE_MS", "200")]).await;
    let c = d.client();
    let admin = d.token();
    c.create_template(&agent_template("agent", no_idle()))
        .await
        .unwrap();
    let source = create(&c, "agent").await;
    call_agent(&c, &source, "state").await;
    c.suspend(&source, Some(Tier::Suspended)).await.unwrap();
    let wait_charged = |ids: Vec<String>| {
        let (d, admin) = (&d, &admin);
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let (_, u) = usage_of(d, admin, "?group_by=sandbox").await;
                let by = snapshot_by_sandbox(&u);
                if ids.iter().all(|id| by.get(id).is_some_and(|v| *v > 0.0)) {
                    return;
                }
                assert!(Instant::now() < deadline, "no store share recorded: {u}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    // Alone, the source pays for its whole image: measured once the sampler has read the
    // store (two windows in a row agree; before, it was charged for its local image).
    wait_charged(vec![source.clone()]).await;
    let one = std::slice::from_ref(&source);
    let mut alone = snapshot_gib(&d, &admin, one, Duration::from_secs(3)).await[0];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let next = snapshot_gib(&d, &admin, one, Duration::from_secs(3)).await[0];
        if next > 0.0 && (next - alone).abs() <= 0.1 * next {
            alone = next;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the source's charge does not settle"
        );
        alone = next;
    }
    // Two forks share its chunks: once the sampler has read the store again, each of the
    // three pays a third (stated tolerance: 25%, for the sample period against the window).
    let forks: Vec<String> = c
        .fork(&source, 2)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    let all: Vec<String> = std::iter::once(source.clone()).chain(forks).collect();
    wait_charged(all.clone()).await;
    let mut shared = snapshot_gib(&d, &admin, &all, Duration::from_secs(3)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let next = snapshot_gib(&d, &admin, &all, Duration::from_secs(3)).await;
        if (next[0] - shared[0]).abs() <= 0.1 * next[0] {
            shared = next;
            break;
        }
        assert!(Instant::now() < deadline, "the shares do not settle");
        shared = next;
    }
    for (id, g) in all.iter().zip(&shared) {
        let ratio = g * 3.0 / alone;
        assert!(
            (0.75..=1.33).contains(&ratio),
            "{id} pays {g} GiB against {alone} alone (x3 = {ratio}): {shared:?}"
        );
    }
}

/// `torpor report` shows each GPU share's GPU-hours next to its utilisation. On a declared
/// inventory there is no telemetry: the share is priced from its GPU-hours and its utilisation
/// is not measured (`null`, "not measured"), never reported as idle. The measured case (DCGM
/// readings of a held device) is checked in torpor-control's usage tests and finops' tests.
#[tokio::test(flavor = "multi_thread")]
async fn the_report_shows_each_gpu_share_next_to_its_utilisation_on_a_declared_inventory() {
    let d = Daemon::start_with_env(
        &[
            "--gpu-inventory",
            &gpu_fixture_local("node-h200-l4.toml"),
            "--gpu-quotas",
            &gpu_fixture_local("quotas-admin.toml"),
        ],
        &[("TORPOR_USAGE_SAMPLE_MS", "200")],
    )
    .await;
    let c = d.client();
    let admin = d.token();
    let gpu = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            gpu: Some(json!({"mode": "mig", "profile": "3g.71gb"})),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let dim = "mig:3g.71gb@NVIDIA H200";
    wait_for("GPU-hours in the usage", Duration::from_secs(60), || {
        let (d, admin) = (&d, admin.clone());
        async move {
            let (_, u) = get_json(d, "/v1/usage", &admin).await;
            let held = u["rows"][0]["gpu_hours"][dim].as_f64().unwrap_or(0.0);
            (held <= 0.0).then(|| format!("{u}"))
        }
    })
    .await;
    // Deleted, it accrues nothing more: the report can be checked against the records.
    c.delete_sandbox(&gpu).await.unwrap();
    let mut settled = usage_of(&d, &admin, "").await.1;
    loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let again = usage_of(&d, &admin, "").await.1;
        if again["rows"] == settled["rows"] {
            break;
        }
        settled = again;
    }
    let row = &settled["rows"][0];
    let held = num(row, &["gpu_hours", dim]);
    assert!(held > 0.0, "{settled}");
    for never_read in [
        "gpu_util_sampled_hours",
        "gpu_busy_hours",
        "gpu_fb_sampled_hours",
    ] {
        assert!(row.get(never_read).is_none(), "no telemetry here: {row}");
    }
    let prices = d.dir.join("prices.toml");
    std::fs::write(
        &prices,
        "memory_gib_hour = 0.5\nvcpu_hour = 2.0\nstorage_gib_month = 73.0\n\
         [gpu_hour]\n\"NVIDIA H200\" = 7.0\n",
    )
    .unwrap();
    let page = d.dir.join("report.html");
    let out = Command::new(BIN)
        .args(["report", "--json", "--url", &d.url(), "--token", &admin])
        .arg("--prices")
        .arg(&prices)
        .arg("--html")
        .arg(&page)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let shares = report["gpu_shares"].as_array().unwrap();
    assert_eq!(shares.len(), 1, "{report}");
    let share = &shares[0];
    assert_eq!(share["share"], "mig:3g.71gb");
    assert_eq!(share["model"], "NVIDIA H200");
    let close = |x: f64, y: f64| assert!((x - y).abs() <= 1e-9 * y.max(1e-9), "{x} vs {y}");
    close(num(share, &["gpu_hours"]), held);
    close(num(share, &["cost"]), held * 7.0);
    assert!(share["utilisation"].is_null(), "{share}");
    assert_eq!(num(share, &["measured_gpu_hours"]), 0.0);
    assert!(share["idle_cost"].is_null() && share["mean_fb_used_gib"].is_null());
    assert_eq!(report["gpu_holders"][0]["sandbox"], gpu.as_str());
    let html = std::fs::read_to_string(&page).unwrap();
    let cells = format!(
        "<td>mig:3g.71gb</td><td>NVIDIA H200</td><td>{held:.4}</td><td>{}</td><td>not measured</td>",
        if held * 7.0 >= 0.01 {
            format!("{:.4}", held * 7.0)
        } else {
            format!("{:.3e}", held * 7.0)
        }
    );
    assert!(html.contains(&cells), "{cells} in {html}");
}
