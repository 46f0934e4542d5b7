//! The demo's summary: a table for the terminal, a JSON object for scripts, and a
//! self-contained HTML page (inline SVG charts, no scripts, no network) for `--report`.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::json;

/// Wake latency for calls that found their agent in one tier.
pub struct TierRow {
    pub tier: String,
    pub calls: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

/// What the sampler saw at one moment.
pub struct Sample {
    pub t_s: f64,
    pub resident_bytes: u64,
    pub busy_workers: usize,
    pub resident: usize,
    pub asleep: usize,
    pub parked_calls: usize,
}

pub struct Report {
    agents: usize,
    rounds: usize,
    checks: u64,
    failures: u64,
    template_build_s: f64,
    tiers: Vec<TierRow>,
    resident_now: usize,
    samples: Vec<Sample>,
    parked_calls: u64,
    rejections: BTreeMap<String, u64>,
    evictions: BTreeMap<String, u64>,
    /// Memory of one resident agent (median over samples of resident bytes per busy worker).
    per_agent_bytes: u64,
    peak_resident_bytes: u64,
    mean_resident_bytes: u64,
}

impl Report {
    #[allow(clippy::too_many_arguments)] // one call site, every field named there
    pub fn new(
        agents: usize,
        rounds: usize,
        checks: u64,
        failures: u64,
        template_build_s: f64,
        tiers: Vec<TierRow>,
        resident_now: usize,
        samples: Vec<Sample>,
        parked_calls: u64,
        rejections: BTreeMap<String, u64>,
        evictions: BTreeMap<String, u64>,
    ) -> Report {
        let mut per: Vec<u64> = samples
            .iter()
            .filter(|s| s.busy_workers > 0 && s.resident_bytes > 0)
            .map(|s| s.resident_bytes / s.busy_workers as u64)
            .collect();
        per.sort_unstable();
        let per_agent_bytes = per.get(per.len() / 2).copied().unwrap_or(0);
        let peak_resident_bytes = samples.iter().map(|s| s.resident_bytes).max().unwrap_or(0);
        let mean_resident_bytes = if samples.is_empty() {
            0
        } else {
            samples.iter().map(|s| s.resident_bytes).sum::<u64>() / samples.len() as u64
        };
        Report {
            agents,
            rounds,
            checks,
            failures,
            template_build_s,
            tiers,
            resident_now,
            samples,
            parked_calls,
            rejections,
            evictions,
            per_agent_bytes,
            peak_resident_bytes,
            mean_resident_bytes,
        }
    }

    /// Memory if every agent had its own resident sandbox all the time.
    fn baseline_bytes(&self) -> u64 {
        self.per_agent_bytes * self.agents as u64
    }

    fn saving(&self) -> f64 {
        if self.mean_resident_bytes == 0 {
            return f64::NAN;
        }
        self.baseline_bytes() as f64 / self.mean_resident_bytes as f64
    }

    pub fn print_table(&self) {
        println!(
            "\ntorpor demo: {} agents, {} bursts, {} state checks, {} failures",
            self.agents, self.rounds, self.checks, self.failures
        );
        println!(
            "template build (boot + golden snapshot): {:.2} s",
            self.template_build_s
        );
        println!(
            "{:<16} {:>6} {:>10} {:>10} {:>10}",
            "woken from", "calls", "p50 ms", "p95 ms", "p99 ms"
        );
        for r in &self.tiers {
            println!(
                "{:<16} {:>6} {:>10.1} {:>10.1} {:>10.1}",
                r.tier, r.calls, r.p50_ms, r.p95_ms, r.p99_ms
            );
        }
        println!(
            "agents resident now: {} of {} (the rest asleep)",
            self.resident_now, self.agents
        );
        println!(
            "memory: mean {} resident, peak {}; one resident sandbox per agent: {} ({} each) -> {:.1}x less",
            mib(self.mean_resident_bytes),
            mib(self.peak_resident_bytes),
            mib(self.baseline_bytes()),
            mib(self.per_agent_bytes),
            self.saving()
        );
        println!(
            "parked calls (waited for a worker): {}; rejections: {}; evictions: {}",
            self.parked_calls,
            fmt_map(&self.rejections),
            fmt_map(&self.evictions)
        );
    }

    pub fn json(&self) -> serde_json::Value {
        let wakes: Vec<_> = self
            .tiers
            .iter()
            .map(|r| {
                json!({"tier": r.tier, "calls": r.calls, "p50_ms": finite(r.p50_ms),
                       "p95_ms": finite(r.p95_ms), "p99_ms": finite(r.p99_ms)})
            })
            .collect();
        json!({
            "agents": self.agents, "rounds": self.rounds, "checks": self.checks,
            "failures": self.failures, "template_build_s": self.template_build_s,
            "wake_by_tier": wakes, "resident": self.resident_now,
            "memory": {
                "mean_resident_bytes": self.mean_resident_bytes,
                "peak_resident_bytes": self.peak_resident_bytes,
                "per_agent_bytes": self.per_agent_bytes,
                "one_sandbox_per_agent_bytes": self.baseline_bytes(),
                "saving_x": finite(self.saving()),
            },
            "parked_calls": self.parked_calls,
            "rejections": self.rejections,
            "evictions": self.evictions,
        })
    }

    pub fn html(&self) -> String {
        let mut h = String::new();
        let _ = write!(
            h,
            "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
             <title>torpor demo</title><style>\
             body{{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:960px;color:#222}}\
             table{{border-collapse:collapse;margin:1em 0}}td,th{{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:right}}\
             th:first-child,td:first-child{{text-align:left}}.ok{{color:#060}}.bad{{color:#a00}}\
             svg{{background:#fafafa;border:1px solid #eee}}text{{font:11px system-ui,sans-serif}}\
             </style></head><body>"
        );
        let verdict = if self.failures == 0 {
            "<span class=\"ok\">every agent's state intact after every wake</span>".to_string()
        } else {
            format!(
                "<span class=\"bad\">{} state checks failed</span>",
                self.failures
            )
        };
        let _ = write!(
            h,
            "<h1>torpor demo</h1><p>{} agents, {} bursts, {} state checks: {verdict}. \
             Template build (boot + golden snapshot) {:.2} s.</p>",
            self.agents, self.rounds, self.checks, self.template_build_s
        );
        h.push_str("<h2>Wake latency by the tier woken from</h2><table><tr><th>woken from</th><th>calls</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th></tr>");
        for r in &self.tiers {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
                esc(&r.tier),
                r.calls,
                r.p50_ms,
                r.p95_ms,
                r.p99_ms
            );
        }
        h.push_str("</table>");
        h.push_str(&self.latency_chart());
        let _ = write!(
            h,
            "<h2>Memory</h2><p>Mean resident {} (peak {}) for {} agents; one resident sandbox per \
             agent would hold {} ({} each): <b>{:.1}x</b> less.</p>",
            mib(self.mean_resident_bytes),
            mib(self.peak_resident_bytes),
            self.agents,
            mib(self.baseline_bytes()),
            mib(self.per_agent_bytes),
            self.saving()
        );
        h.push_str(&self.memory_chart());
        h.push_str("<h2>Agents resident and asleep</h2>");
        h.push_str(&self.agents_chart());
        let _ = write!(
            h,
            "<h2>Parking</h2><p>Calls that waited for a worker: {}. Rejections: {}. \
             Evictions: {}.</p>",
            self.parked_calls,
            esc(&fmt_map(&self.rejections)),
            esc(&fmt_map(&self.evictions))
        );
        let _ = writeln!(
            h,
            "<h2>Raw summary</h2><pre>{}</pre></body></html>",
            esc(&serde_json::to_string_pretty(&self.json()).unwrap_or_default())
        );
        h
    }

    fn latency_chart(&self) -> String {
        let (w, hgt, left, bottom) = (900.0, 260.0, 60.0, 40.0);
        let max = self
            .tiers
            .iter()
            .map(|r| finite_or_zero(r.p99_ms))
            .fold(1.0_f64, f64::max);
        let mut s = svg_open(w, hgt);
        axis(&mut s, w, hgt, left, bottom, max, "ms");
        let groups = self.tiers.len().max(1) as f64;
        let gw = (w - left - 20.0) / groups;
        let colors = ["#4a90d9", "#f5a623", "#d0021b"];
        for (i, r) in self.tiers.iter().enumerate() {
            let x0 = left + gw * i as f64 + gw * 0.15;
            let bw = gw * 0.7 / 3.0;
            for (j, v) in [r.p50_ms, r.p95_ms, r.p99_ms].into_iter().enumerate() {
                let v = finite_or_zero(v);
                let bh = (hgt - bottom - 10.0) * v / max;
                let _ = write!(
                    s,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"><title>{} p{}: {:.1} ms</title></rect>",
                    x0 + bw * j as f64,
                    hgt - bottom - bh,
                    bw - 2.0,
                    bh,
                    colors[j],
                    esc(&r.tier),
                    ["50", "95", "99"][j],
                    v
                );
            }
            let _ = write!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                x0 + gw * 0.35,
                hgt - bottom + 16.0,
                esc(&r.tier)
            );
        }
        legend(
            &mut s,
            w,
            &[("p50", colors[0]), ("p95", colors[1]), ("p99", colors[2])],
        );
        s.push_str("</svg>");
        s
    }

    fn memory_chart(&self) -> String {
        let baseline = self.baseline_bytes() as f64 / MIB;
        let max = self
            .samples
            .iter()
            .map(|p| p.resident_bytes as f64 / MIB)
            .fold(baseline, f64::max)
            .max(1.0);
        let series = [(
            "resident memory",
            "#4a90d9",
            self.samples
                .iter()
                .map(|p| (p.t_s, p.resident_bytes as f64 / MIB))
                .collect::<Vec<_>>(),
        )];
        self.time_chart(
            &series,
            max,
            "MiB",
            Some((baseline, "one sandbox per agent")),
        )
    }

    fn agents_chart(&self) -> String {
        let pts = |f: fn(&Sample) -> usize| {
            self.samples
                .iter()
                .map(|p| (p.t_s, f(p) as f64))
                .collect::<Vec<_>>()
        };
        let series = [
            ("resident", "#4a90d9", pts(|p| p.resident)),
            ("asleep", "#7ed321", pts(|p| p.asleep)),
            ("parked calls", "#d0021b", pts(|p| p.parked_calls)),
        ];
        self.time_chart(&series, (self.agents as f64).max(1.0), "agents", None)
    }

    fn time_chart(
        &self,
        series: &[Series],
        max: f64,
        unit: &str,
        reference: Option<(f64, &str)>,
    ) -> String {
        let (w, hgt, left, bottom) = (900.0, 240.0, 60.0, 30.0);
        let t_max = self.samples.last().map(|p| p.t_s).unwrap_or(1.0).max(1.0);
        let x = |t: f64| left + (w - left - 20.0) * t / t_max;
        let y = |v: f64| hgt - bottom - (hgt - bottom - 10.0) * v / max;
        let mut s = svg_open(w, hgt);
        axis(&mut s, w, hgt, left, bottom, max, unit);
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.0} s</text>",
            w - 20.0,
            hgt - 8.0,
            t_max
        );
        if let Some((v, label)) = reference {
            let _ = write!(
                s,
                "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#a00\" stroke-dasharray=\"6 4\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#a00\">{} ({v:.0} {unit})</text>",
                w - 20.0,
                y(v),
                y(v),
                left + 6.0,
                y(v) - 4.0,
                esc(label)
            );
        }
        let mut keys = Vec::new();
        for (name, color, pts) in series {
            let path: Vec<String> = pts
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
                .collect();
            let _ = write!(
                s,
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
                path.join(" ")
            );
            keys.push((*name, *color));
        }
        legend(&mut s, w, &keys);
        s.push_str("</svg>");
        s
    }
}

/// A line on a time chart: its name, its colour and its (seconds, value) points.
type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

const MIB: f64 = 1024.0 * 1024.0;

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / MIB)
}

fn finite(v: f64) -> serde_json::Value {
    if v.is_finite() {
        json!(v)
    } else {
        serde_json::Value::Null
    }
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

fn fmt_map(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn svg_open(w: f64, h: f64) -> String {
    format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">")
}

fn axis(s: &mut String, w: f64, h: f64, left: f64, bottom: f64, max: f64, unit: &str) {
    let _ = write!(
        s,
        "<line x1=\"{left}\" y1=\"10\" x2=\"{left}\" y2=\"{:.1}\" stroke=\"#999\"/>\
         <line x1=\"{left}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#999\"/>\
         <text x=\"{:.1}\" y=\"16\" text-anchor=\"end\">{max:.0} {unit}</text>\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">0</text>",
        h - bottom,
        h - bottom,
        w - 20.0,
        h - bottom,
        left - 4.0,
        left - 4.0,
        h - bottom
    );
}

fn legend(s: &mut String, w: f64, keys: &[(&str, &str)]) {
    for (i, (name, color)) in keys.iter().enumerate() {
        let x = w - 140.0;
        let y = 20.0 + 16.0 * i as f64;
        let _ = write!(
            s,
            "<rect x=\"{x}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            y - 9.0,
            x + 14.0,
            y,
            esc(name)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, bytes: u64, busy: usize) -> Sample {
        Sample {
            t_s: t,
            resident_bytes: bytes,
            busy_workers: busy,
            resident: busy,
            asleep: 4 - busy,
            parked_calls: 0,
        }
    }

    #[test]
    fn memory_comparison_uses_the_median_per_agent_figure() {
        let mb = 1 << 20;
        let r = Report::new(
            4,
            1,
            4,
            0,
            1.0,
            vec![],
            0,
            vec![
                sample(0.0, 100 * mb, 2),
                sample(1.0, 50 * mb, 1),
                sample(2.0, 0, 0),
            ],
            0,
            BTreeMap::new(),
            BTreeMap::new(),
        );
        assert_eq!(r.per_agent_bytes, 50 * mb);
        assert_eq!(r.baseline_bytes(), 200 * mb);
        assert_eq!(r.mean_resident_bytes, 50 * mb);
        assert!((r.saving() - 4.0).abs() < 1e-9);
        let v = r.json();
        assert_eq!(v["memory"]["one_sandbox_per_agent_bytes"], 200 * mb);
    }

    #[test]
    fn html_is_escaped_and_self_contained() {
        let r = Report::new(
            1,
            1,
            1,
            0,
            0.5,
            vec![TierRow {
                tier: "<parked>".into(),
                calls: 1,
                p50_ms: 1.0,
                p95_ms: f64::NAN,
                p99_ms: 3.0,
            }],
            1,
            vec![],
            0,
            BTreeMap::new(),
            BTreeMap::new(),
        );
        let h = r.html();
        assert!(h.contains("&lt;parked&gt;"));
        assert!(!h.contains("<parked>"));
        assert!(!h.contains("<script"));
        assert!(!h.contains("http://") || h.contains("http://www.w3.org/2000/svg"));
        assert!(h.trim_end().ends_with("</html>"));
    }
}
