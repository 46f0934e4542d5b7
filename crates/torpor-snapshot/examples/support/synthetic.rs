//! Synthetic agent memory for the examples' benchmarks: pages of zeros, text and noise, and
//! changes to them.

pub const PAGE: usize = 4096;

pub fn noise(seed: u64, out: &mut [u8]) {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.finalize_xof().fill(out);
}

pub fn memory_like(pages: usize) -> Vec<u8> {
    let mut out = vec![0u8; pages * PAGE];
    for (p, page) in out.chunks_mut(PAGE).enumerate() {
        match p % 4 {
            0 => {}
            1 => {
                for (i, b) in page.iter_mut().enumerate() {
                    *b = b"agent heap object field value "[i % 30];
                }
            }
            _ => noise(p as u64, page),
        }
    }
    out
}

/// Rewrites `fraction` of the pages in runs of `run` pages at pseudo-random places.
/// `run = 1` is the worst case for any chunker (isolated dirty pages everywhere).
pub fn touch_pages(mem: &mut [u8], fraction: f64, run: usize, seed: u64) {
    let pages = mem.len() / PAGE;
    let n = ((pages as f64) * fraction / run as f64).round().max(1.0) as usize;
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for k in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let p = (x as usize) % (pages - run);
        noise(
            seed * 1_000_000 + k as u64,
            &mut mem[p * PAGE..(p + run) * PAGE],
        );
    }
}

/// The value after `--name` on the command line, parsed; `default` when absent or unparsable.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
