//! Open-descriptor headroom (`RLIMIT_NOFILE`). The default soft limit (often 1024) is less than
//! a busy daemon needs: every API connection, every resident sandbox (runsc's pipes, the
//! agent's connection, cgroup files, relayed connections) and the database take descriptors. At
//! start the soft limit is raised to the hard limit (as root the hard limit first, when the kernel
//! allows), and the daemon checks that its connection cap, workers and their relayed connections
//! fit under it, so that
//! running out shows at start with the flags to change, not as `EMFILE` under load.

/// The connection cap when `--max-connections` is not given.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Descriptors a resident sandbox takes in the daemon besides its relayed connections (runsc's
/// pipes and logs, the agent's connection, cgroup and OOM files).
pub const FDS_PER_WORKER: u64 = 64;
/// Relayed connections per sandbox when the limit allows it.
pub const DEFAULT_RELAYED_PER_SANDBOX: usize = 256;
/// The least a lowered default gives a sandbox.
pub const MIN_RELAYED_PER_SANDBOX: usize = 16;
/// Descriptors the daemon takes whatever its load: the database, listeners, logs, the store.
pub const FDS_BASE: u64 = 256;
/// Below this many connections a lowered default cap would not serve; refuse instead.
pub const MIN_CONNECTIONS: usize = 64;
/// What root asks the hard limit to be raised to (the kernel's `fs.nr_open` caps it).
pub const ROOT_HARD_LIMIT: u64 = 1 << 20;

/// What the daemon is set to hold at once, in descriptors' terms.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// `--workers`: resident sandboxes.
    pub workers: usize,
    /// `--max-sandbox-connections`: relayed TCP connections per sandbox, two descriptors each.
    pub relayed_per_sandbox: usize,
}

impl Load {
    /// Descriptors one resident sandbox may take in the daemon.
    pub fn per_worker(&self) -> u64 {
        FDS_PER_WORKER.saturating_add((self.relayed_per_sandbox as u64).saturating_mul(2))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NofileError {
    #[error(
        "RLIMIT_NOFILE allows {limit} open descriptors, but --max-connections {max_connections} \
         with --workers {workers} and --max-sandbox-connections {relayed} need {needed} \
         ({max_connections} + {workers} x {per_worker} + {FDS_BASE}); lower --max-connections, \
         --workers or --max-sandbox-connections, or raise the limit (ulimit -n, LimitNOFILE= in \
         a systemd unit)"
    )]
    TooFew {
        limit: u64,
        max_connections: usize,
        workers: usize,
        relayed: usize,
        per_worker: u64,
        needed: u64,
    },
    #[error("cannot read RLIMIT_NOFILE")]
    Read(#[source] std::io::Error),
}

/// Descriptors the daemon may need with this connection cap under this load.
/// `--max-sandbox-connections` when the operator does not set it: 256, or less when the limit
/// is low: half of the descriptors go to relayed connections (two each) beside the workers'
/// own, never below [`MIN_RELAYED_PER_SANDBOX`].
pub fn default_relayed(limit: u64, workers: usize) -> usize {
    let workers = workers.max(1) as u64;
    let budget = (limit / 2).saturating_sub(workers * FDS_PER_WORKER);
    (budget / (2 * workers)).clamp(
        MIN_RELAYED_PER_SANDBOX as u64,
        DEFAULT_RELAYED_PER_SANDBOX as u64,
    ) as usize
}

pub fn needed(max_connections: usize, load: Load) -> u64 {
    (max_connections as u64)
        .saturating_add((load.workers as u64).saturating_mul(load.per_worker()))
        .saturating_add(FDS_BASE)
}

/// The connection cap to run with under `limit` descriptors: the operator's, if it fits (else an
/// error naming the flags); without one, the default, lowered to what fits (the caller warns).
pub fn connection_cap(
    limit: u64,
    max_connections: Option<usize>,
    load: Load,
) -> Result<usize, NofileError> {
    let too_few = |max_connections| NofileError::TooFew {
        limit,
        max_connections,
        workers: load.workers,
        relayed: load.relayed_per_sandbox,
        per_worker: load.per_worker(),
        needed: needed(max_connections, load),
    };
    match max_connections {
        Some(m) if needed(m, load) <= limit => Ok(m),
        Some(m) => Err(too_few(m)),
        None => {
            let rest = limit.saturating_sub(needed(0, load));
            let cap = rest.min(DEFAULT_MAX_CONNECTIONS as u64) as usize;
            if cap >= MIN_CONNECTIONS {
                Ok(cap)
            } else {
                Err(too_few(DEFAULT_MAX_CONNECTIONS))
            }
        }
    }
}

/// The (soft, hard) limits to ask for: the soft limit up to the hard one; as root the hard limit
/// up to [`ROOT_HARD_LIMIT`] first, never past the kernel's `nr_open`, never lowered.
pub fn raise_target(soft: u64, hard: u64, root: bool, nr_open: u64) -> (u64, u64) {
    let hard = if root {
        hard.max(ROOT_HARD_LIMIT.min(nr_open))
    } else {
        hard
    };
    // RLIM_INFINITY is not a valid soft limit for descriptors; nr_open is the real ceiling.
    (soft.max(hard.min(nr_open)), hard)
}

/// Raises `RLIMIT_NOFILE` as [`raise_target`] says, falling back to the soft limit at the
/// current hard limit when the kernel refuses the larger hard limit. Returns the soft limit now
/// in force.
pub fn raise() -> Result<u64, NofileError> {
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut cur) } != 0 {
        return Err(NofileError::Read(std::io::Error::last_os_error()));
    }
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(ROOT_HARD_LIMIT);
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let (soft, hard) = raise_target(cur.rlim_cur, cur.rlim_max, root, nr_open);
    let set = |soft: u64, hard: u64| {
        let want = libc::rlimit {
            rlim_cur: soft,
            rlim_max: hard,
        };
        // SAFETY: setrlimit reads the struct we pass.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 }
    };
    if (soft, hard) == (cur.rlim_cur, cur.rlim_max) || set(soft, hard) {
        return Ok(soft);
    }
    let (soft, _) = raise_target(cur.rlim_cur, cur.rlim_max, false, nr_open);
    if soft != cur.rlim_cur && set(soft, cur.rlim_max) {
        return Ok(soft);
    }
    Ok(cur.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(workers: usize, relayed_per_sandbox: usize) -> Load {
        Load {
            workers,
            relayed_per_sandbox,
        }
    }

    #[test]
    fn needed_counts_connections_workers_their_relays_and_the_base() {
        assert_eq!(needed(4096, load(8, 0)), 4096 + 8 * 64 + 256);
        assert_eq!(needed(4096, load(8, 256)), 4096 + 8 * (64 + 2 * 256) + 256);
        assert_eq!(needed(0, load(0, 256)), FDS_BASE);
        assert_eq!(needed(usize::MAX, load(usize::MAX, usize::MAX)), u64::MAX);
    }

    #[test]
    fn an_operators_cap_that_fits_is_kept_and_one_that_does_not_is_refused() {
        assert_eq!(
            connection_cap(1 << 20, Some(4096), load(256, 256)).unwrap(),
            4096
        );
        let limit = needed(1000, load(4, 10));
        assert_eq!(
            connection_cap(limit, Some(1000), load(4, 10)).unwrap(),
            1000
        );
        let err = connection_cap(limit - 1, Some(1000), load(4, 10)).unwrap_err();
        assert!(
            matches!(
                err,
                NofileError::TooFew {
                    limit: l,
                    max_connections: 1000,
                    workers: 4,
                    relayed: 10,
                    per_worker: 84,
                    needed: n
                } if l == limit - 1 && n == limit
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("--max-connections 1000")
                && msg.contains("--workers 4")
                && msg.contains("--max-sandbox-connections 10"),
            "{msg}"
        );
    }

    #[test]
    fn the_default_cap_is_lowered_to_fit_and_refused_when_too_little_is_left() {
        assert_eq!(
            connection_cap(1 << 20, None, load(16, 256)).unwrap(),
            DEFAULT_MAX_CONNECTIONS
        );
        // A usual non-root hard limit of 4096: the default cap shrinks by the workers and the
        // base.
        assert_eq!(
            connection_cap(4096, None, load(4, 0)).unwrap(),
            4096 - 4 * 64 - 256
        );
        assert_eq!(
            connection_cap(needed(MIN_CONNECTIONS, load(4, 8)), None, load(4, 8)).unwrap(),
            MIN_CONNECTIONS
        );
        assert!(matches!(
            connection_cap(1024, None, load(16, 0)),
            Err(NofileError::TooFew { workers: 16, .. })
        ));
        // Relays count: 4 sandboxes relaying 256 connections each leave less room.
        assert_eq!(
            connection_cap(4096, None, load(4, 256)).unwrap(),
            4096 - 4 * (64 + 2 * 256) - 256
        );
        assert!(connection_cap(4096, None, load(8, 256)).is_err());
    }

    #[test]
    fn the_default_relay_cap_fits_a_low_limit_and_stays_256_under_a_high_one() {
        assert_eq!(default_relayed(1 << 20, 47), DEFAULT_RELAYED_PER_SANDBOX);
        // 20000 descriptors, 47 workers (this CI's machine): lowered, and the rest still fits
        // the default connection cap.
        let r = default_relayed(20_000, 47);
        assert!((MIN_RELAYED_PER_SANDBOX..DEFAULT_RELAYED_PER_SANDBOX).contains(&r));
        let load = Load {
            workers: 47,
            relayed_per_sandbox: r,
        };
        assert_eq!(
            connection_cap(20_000, None, load).unwrap(),
            DEFAULT_MAX_CONNECTIONS
        );
        assert_eq!(default_relayed(1024, 256), MIN_RELAYED_PER_SANDBOX);
    }

    #[test]
    fn the_soft_limit_goes_up_to_the_hard_one_and_root_raises_the_hard_one() {
        assert_eq!(raise_target(1024, 4096, false, 1 << 20), (4096, 4096));
        assert_eq!(raise_target(1024, 4096, true, 1 << 20), (1 << 20, 1 << 20));
        // Never past nr_open, never lowered.
        assert_eq!(raise_target(1024, 4096, true, 65536), (65536, 65536));
        assert_eq!(
            raise_target(1024, 1 << 22, true, 1 << 23),
            (1 << 22, 1 << 22)
        );
        assert_eq!(raise_target(8192, 8192, false, 1 << 20), (8192, 8192));
        // An unlimited hard limit: the soft limit stops at nr_open.
        assert_eq!(
            raise_target(1024, u64::MAX, false, 1 << 20),
            (1 << 20, u64::MAX)
        );
    }
}
