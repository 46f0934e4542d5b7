//! A worker's idle CPU between two heartbeats, read from `/proc/stat`: what placement ranks
//! workers by ([`crate::placement`]'s "Load").
//!
//! The figure is the whole machine's: the worker's sandboxes, its own restores and checkpoints,
//! and whatever else the machine runs (on Kubernetes, the node's other pods). A worker pod
//! held to a CPU limit below its node's cores sees the node's idle time, not its own share;
//! run workers as a DaemonSet that owns its node (`deploy/k8s/`), or give them the node whole.

/// Idle and total CPU time since boot, in the kernel's ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticks {
    idle: u64,
    total: u64,
}

/// The machine's CPU counters and its online CPUs, from the text of `/proc/stat`; `None` when
/// it has no aggregate `cpu` line.
fn parse(stat: &str) -> Option<(Ticks, u32)> {
    let mut ticks = None;
    let mut cpus = 0u32;
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        if rest.starts_with(|c: char| c.is_ascii_digit()) {
            cpus += 1;
        } else if rest.starts_with(' ') {
            // user nice system idle iowait irq softirq steal (guest time is counted in user).
            let f: Vec<u64> = rest
                .split_ascii_whitespace()
                .take(8)
                .map(|v| v.parse().unwrap_or(0))
                .collect();
            if f.len() < 4 {
                return None;
            }
            let idle = f[3] + f.get(4).copied().unwrap_or(0);
            ticks = Some(Ticks {
                idle,
                total: f.iter().sum(),
            });
        }
    }
    Some((ticks?, cpus.max(1)))
}

/// Samples the machine's idle CPU; each [`IdleCpu::sample`] covers the time since the last.
#[derive(Debug, Default)]
pub struct IdleCpu {
    prev: Option<Ticks>,
}

impl IdleCpu {
    pub fn new() -> Self {
        Self::default()
    }

    /// Thousandths of a core idle since the previous sample (a machine of 4 idle cores: 4000);
    /// `None` on the first sample, when no time passed, or when `/proc/stat` cannot be read.
    pub fn sample(&mut self) -> Option<u32> {
        match std::fs::read_to_string("/proc/stat") {
            Ok(stat) => self.next(&stat),
            Err(_) => None,
        }
    }

    fn next(&mut self, stat: &str) -> Option<u32> {
        let (now, cpus) = parse(stat)?;
        let prev = self.prev.replace(now)?;
        let total = now.total.checked_sub(prev.total).filter(|t| *t > 0)?;
        let idle = now.idle.saturating_sub(prev.idle).min(total);
        let milli = (idle as u128 * u128::from(cpus) * 1000 / total as u128) as u32;
        Some(milli)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(user: u64, idle: u64, iowait: u64) -> String {
        format!(
            "cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\n\
             cpu0 1 0 0 1 0 0 0 0 0 0\n\
             cpu1 1 0 0 1 0 0 0 0 0 0\n\
             intr 1 2 3\nctxt 5\n"
        )
    }

    #[test]
    fn idle_is_the_share_of_ticks_spent_idle_or_waiting_times_the_cpus() {
        let mut cpu = IdleCpu::new();
        assert_eq!(
            cpu.next(&stat(100, 100, 0)),
            None,
            "the first sample has no interval"
        );
        // 200 ticks passed: 50 busy, 150 idle (100 idle + 50 iowait) on 2 CPUs: 1.5 cores.
        assert_eq!(cpu.next(&stat(150, 200, 50)), Some(1500));
        // All busy.
        assert_eq!(cpu.next(&stat(350, 200, 50)), Some(0));
        // No time passed: nothing to say.
        assert_eq!(cpu.next(&stat(350, 200, 50)), None);
        // All idle.
        assert_eq!(cpu.next(&stat(350, 300, 50)), Some(2000));
    }

    #[test]
    fn a_stat_without_the_aggregate_line_says_nothing() {
        let mut cpu = IdleCpu::new();
        assert_eq!(cpu.next("cpu0 1 2 3 4\n"), None);
        assert_eq!(cpu.next("cpu0 1 2 3 4\n"), None);
        assert_eq!(cpu.next("cpu  1 2\n"), None);
    }

    #[test]
    fn this_machine_is_read() {
        let (_, cpus) = parse(&std::fs::read_to_string("/proc/stat").unwrap()).unwrap();
        let mut cpu = IdleCpu::new();
        assert_eq!(cpu.sample(), None);
        // The kernel counts in ticks of 10 ms: let a few pass.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let milli = cpu.sample().expect("a figure after 200 ms");
        assert!(milli <= cpus * 1000, "{milli} of {cpus} cores");
    }
}
