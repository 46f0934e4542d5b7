//! Snapshot store benchmark. Prints a table and one JSON line; every figure is measured beside
//! its baseline in the same run.
//!
//! ```text
//! cargo run --release --example bench -- [--image PATH] [--next PATH] [--fleet N] [--mib N]
//! ```
//!
//! Without `--image` the input is a synthetic gVisor image (memory-like pages: zeros, text,
//! noise) of `--mib` MiB inflated. Measured:
//! - chunk + hash + compress throughput on one core vs `zstd -1` of the same image (ratio);
//! - FastCDC average size: incremental bytes and chunk counts for 8/16/64 KiB;
//! - incremental: re-put after changing 5% of memory pages, bytes written / full put;
//! - fleet dedup: N sandboxes from one template, each changing 1% of pages: stored bytes /
//!   sum of image sizes;
//! - restore from the store (cold and warm chunk cache) vs copying the raw image on local disk;
//! - the requests of an incremental put (5% of pages changed) that names its parent (the
//!   sandbox's previous snapshot, as a cluster worker's upload does) vs one that does not,
//!   loose and packed: existence lookups (one S3 HEAD each), reads and writes, from a counting
//!   backend;
//! - with `--next` (a later checkpoint of the same sandbox, e.g. from tests/runsc_real.rs with
//!   TORPOR_SNAPSHOT_KEEP_IMAGES): bytes a real incremental put writes / that image's size.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use torpor_snapshot::gvisor::{self, encode_compressed_image, InflatingReader};
use torpor_snapshot::manifest::ChunkParams;
use torpor_snapshot::store::PutOptions;
use torpor_snapshot::{ChunkCache, ChunkCodec, LocalBackend, Store, StoreConfig};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::{flag, memory_like, touch_pages};
#[path = "support/counting.rs"]
mod counting;
use counting::Counting;

fn inflate(img: &[u8]) -> (Vec<u8>, Vec<u8>, u32) {
    let layout = gvisor::probe(std::io::Cursor::new(img))
        .expect("read image")
        .expect("a gVisor image");
    let mut out = Vec::new();
    InflatingReader::new(&img[layout.header.len()..], layout.frame_size)
        .read_to_end(&mut out)
        .expect("inflate image");
    (layout.header, out, layout.frame_size)
}

fn write_ckpt(dir: &Path, img: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("checkpoint.img"), img).unwrap();
}

fn store_at(root: &Path, chunking: ChunkParams) -> Store {
    let backend = Arc::new(LocalBackend::open(root).unwrap());
    Store::new(
        backend,
        StoreConfig {
            chunking,
            image_chunking: chunking,
            ..StoreConfig::default()
        },
    )
    .unwrap()
}

fn params(avg: u32) -> ChunkParams {
    ChunkParams {
        min: avg / 4,
        avg,
        max: avg * 4,
    }
}

fn mbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

/// One core: FastCDC + BLAKE3 + zstd-1 per chunk (what a put does before I/O).
fn chunk_hash_compress(data: &[u8], p: ChunkParams) -> (usize, usize) {
    let codec = ChunkCodec::new(1, None);
    let mut stored = 0;
    let mut chunks = 0;
    for c in fastcdc::v2020::FastCDC::new(data, p.min, p.avg, p.max) {
        let bytes = &data[c.offset..c.offset + c.length];
        chunks += 1;
        if bytes.iter().all(|&b| b == 0) {
            continue;
        }
        let id = codec.id_of(bytes);
        stored += codec.encode(&id, bytes).unwrap().0.len();
    }
    (chunks, stored)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let fleet: usize = flag("--fleet", 100);
    let mib: usize = flag("--mib", 32);
    let (source, img) = match arg("--image") {
        Some(p) => (p.clone(), std::fs::read(&p).expect("read --image")),
        None => (
            format!("synthetic {mib} MiB"),
            encode_compressed_image(b"{}", &memory_like(mib * 256), 1 << 20),
        ),
    };
    let (header, mem, frame_size) = inflate(&img);
    let rebuild = |m: &[u8]| encode_compressed_image(&header[16..header.len() - 36], m, frame_size);
    let tmp = tempfile::tempdir().unwrap();
    let mut rows: Vec<(String, String, String, String)> = Vec::new();
    let mut json = vec![
        format!("\"input\": {:?}", source),
        format!("\"image_bytes\": {}", img.len()),
        format!("\"inflated_bytes\": {}", mem.len()),
    ];

    // 1. Throughput per core vs zstd -1 on the same (inflated) image.
    let t = Instant::now();
    let (chunks, stored) = chunk_hash_compress(&mem, params(16 * 1024));
    let ours = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let z = zstd::bulk::compress(&mem, 1).unwrap();
    let base = t.elapsed().as_secs_f64();
    rows.push((
        "chunk+hash+zstd, 1 core".into(),
        format!(
            "{:.0} MB/s, {} chunks, {:.3} of input",
            mbps(mem.len(), ours),
            chunks,
            stored as f64 / mem.len() as f64
        ),
        format!(
            "zstd -1: {:.0} MB/s, {:.3} of input",
            mbps(mem.len(), base),
            z.len() as f64 / mem.len() as f64
        ),
        format!("{:.2}x speed", base / ours),
    ));
    json.push(format!(
        "\"chunk_mbps\": {:.1}, \"zstd1_mbps\": {:.1}, \"chunk_vs_zstd1_time\": {:.3}",
        mbps(mem.len(), ours),
        mbps(mem.len(), base),
        ours / base
    ));

    // 2-4. Per average chunk size: full put, incremental after 5% of pages changed (isolated
    // pages, and 64-page runs), and a fleet of N sandboxes from one template, each changing
    // 1% of its pages in 16-page runs.
    let mut scattered = mem.clone();
    touch_pages(&mut scattered, 0.05, 1, 42);
    let scattered_img = rebuild(&scattered);
    let mut clustered = mem.clone();
    touch_pages(&mut clustered, 0.05, 64, 43);
    let clustered_img = rebuild(&clustered);
    let mut best = (0u32, f64::MAX);
    let mut golden_store = None;
    for avg in [4 * 1024, 8 * 1024, 16 * 1024, 64 * 1024] {
        let k = avg / 1024;
        let root = tmp.path().join(format!("s-{avg}"));
        let s = store_at(&root, params(avg));
        let d1 = tmp.path().join(format!("s-{avg}-1"));
        write_ckpt(&d1, &img);
        let t = Instant::now();
        let full = s.put_dir(&d1, None).await.unwrap();
        let put_s = t.elapsed().as_secs_f64();
        let mut inc = Vec::new();
        for (name, changed) in [("scattered", &scattered_img), ("clustered", &clustered_img)] {
            let d = tmp.path().join(format!("s-{avg}-{name}"));
            write_ckpt(&d, changed);
            let r = s.put_dir(&d, Some(&full.id)).await.unwrap();
            inc.push(r.stats.bytes_written as f64 / img.len() as f64);
        }
        rows.push((
            format!("incremental 5%, avg {k} KiB"),
            format!(
                "isolated pages {:.3}, 64-page runs {:.3} of image",
                inc[0], inc[1]
            ),
            format!(
                "full put {} B, {} chunks, {:.2} s",
                full.stats.bytes_written, full.stats.chunks_total, put_s
            ),
            format!("{:.3} / {:.3}", inc[0], inc[1]),
        ));
        json.push(format!(
            "\"incr_isolated_{k}k\": {:.4}, \"incr_runs_{k}k\": {:.4}, \"chunks_{k}k\": {}",
            inc[0], inc[1], full.stats.chunks_total
        ));

        let fs = store_at(&tmp.path().join(format!("fleet-{avg}")), params(avg));
        let d = tmp.path().join("fleet-template");
        let _ = std::fs::remove_dir_all(&d);
        write_ckpt(&d, &img);
        let golden = fs.put_dir(&d, None).await.unwrap();
        let mut image_sum = 0u64;
        let t = Instant::now();
        for i in 0..fleet {
            let mut m = mem.clone();
            touch_pages(&mut m, 0.01, 16, 1000 + i as u64);
            let mi = rebuild(&m);
            image_sum += mi.len() as u64;
            let d = tmp.path().join("fleet-sb");
            let _ = std::fs::remove_dir_all(&d);
            write_ckpt(&d, &mi);
            fs.put_dir(&d, Some(&golden.id)).await.unwrap();
        }
        let fleet_s = t.elapsed().as_secs_f64();
        let st = fs.stats().await.unwrap();
        let dedup = st.stored_bytes as f64 / image_sum as f64;
        rows.push((
            format!("fleet of {fleet}, avg {k} KiB"),
            format!("{} B stored (template included)", st.stored_bytes),
            format!("sum of {fleet} images {image_sum} B"),
            format!("{dedup:.4} stored/images"),
        ));
        json.push(format!(
            "\"fleet_{k}k_stored_over_images\": {dedup:.5}, \"fleet_{k}k_put_s\": {fleet_s:.2}"
        ));
        let score = inc[1] + dedup;
        if score < best.1 {
            best = (avg, score);
        }
        if avg == StoreConfig::default().image_chunking.avg {
            golden_store = Some((fs, golden));
        }
    }
    json.push(format!("\"fleet\": {fleet}"));
    let (s, golden) = golden_store.expect("default chunk size measured");

    // 5. Restore from the store vs copying the raw image on local disk (same page cache).
    let raw = tmp.path().join("raw.img");
    std::fs::write(&raw, &img).unwrap();
    let t = Instant::now();
    std::fs::copy(&raw, tmp.path().join("raw-copy.img")).unwrap();
    let copy_s = t.elapsed().as_secs_f64();
    let cache = Arc::new(ChunkCache::open(tmp.path().join("cache"), 4 << 30).unwrap());
    let s = s.with_cache(cache.clone());
    let t = Instant::now();
    let cold = s
        .get_dir(&golden.id, &tmp.path().join("r-cold"))
        .await
        .unwrap();
    let cold_s = t.elapsed().as_secs_f64();
    cache.wait_idle().await;
    let t = Instant::now();
    let warm = s
        .get_dir(&golden.id, &tmp.path().join("r-warm"))
        .await
        .unwrap();
    let warm_s = t.elapsed().as_secs_f64();
    rows.push((
        "restore, cold chunk cache".into(),
        format!(
            "{:.1} ms ({} chunks fetched)",
            cold_s * 1e3,
            cold.chunks_fetched
        ),
        format!("cp raw image: {:.1} ms", copy_s * 1e3),
        format!("{:.2}x of cp", cold_s / copy_s),
    ));
    rows.push((
        "restore, warm chunk cache".into(),
        format!("{:.1} ms ({} cache hits)", warm_s * 1e3, warm.cache_hits),
        format!("cp raw image: {:.1} ms", copy_s * 1e3),
        format!("{:.2}x of cp", warm_s / copy_s),
    ));
    json.push(format!("\"restore_cold_ms\": {:.1}, \"restore_warm_ms\": {:.1}, \"copy_raw_ms\": {:.1}, \"restore_cold_over_copy\": {:.2}, \"restore_warm_over_copy\": {:.2}", cold_s * 1e3, warm_s * 1e3, copy_s * 1e3, cold_s / copy_s, warm_s / copy_s));
    json.push(format!("\"best_avg_chunk_kib\": {}", best.0 / 1024));

    if let Some(next) = arg("--next") {
        let next_img = std::fs::read(&next).expect("read --next");
        let s = store_at(
            &tmp.path().join("real-next"),
            StoreConfig::default().image_chunking,
        );
        let d1 = tmp.path().join("real-1");
        write_ckpt(&d1, &img);
        let first = s.put_dir(&d1, None).await.unwrap();
        let d2 = tmp.path().join("real-2");
        write_ckpt(&d2, &next_img);
        let second = s.put_dir(&d2, Some(&first.id)).await.unwrap();
        let ratio = second.stats.bytes_written as f64 / next_img.len() as f64;
        rows.push((
            "real incremental (--next)".into(),
            format!(
                "{} B written, {}/{} chunks reused",
                second.stats.bytes_written, second.stats.chunks_reused, second.stats.chunks_total
            ),
            format!(
                "next image {} B (full put {} B)",
                next_img.len(),
                first.stats.bytes_written
            ),
            format!("{ratio:.4} of image"),
        ));
        json.push(format!("\"real_incremental_over_image\": {ratio:.5}"));
    }

    // 5. The requests of an incremental put that names its parent vs one that does not (a
    // store that holds the full put already), loose and packed (4 MiB packs).
    for (kind, pack_bytes) in [("loose", None), ("packed", Some(4usize << 20))] {
        let mut got = Vec::new();
        for with_parent in [true, false] {
            let backend = Arc::new(Counting::open(
                &tmp.path().join(format!("req-{kind}-{with_parent}")),
            ));
            let open = || {
                let cfg = StoreConfig {
                    pack_bytes,
                    ..StoreConfig::default()
                };
                Store::new(backend.clone(), cfg).unwrap()
            };
            let s = open();
            let d = tmp.path().join(format!("req-{kind}-{with_parent}-1"));
            write_ckpt(&d, &img);
            let full = s.put_dir(&d, None).await.unwrap();
            let d = tmp.path().join(format!("req-{kind}-{with_parent}-2"));
            write_ckpt(&d, &scattered_img);
            // A fresh process's store (a worker's first upload after its start): nothing of
            // the first put is remembered in memory.
            let s = open();
            backend.take();
            let t = Instant::now();
            let put = s
                .put_dir_with(
                    &d,
                    PutOptions {
                        parent: with_parent.then(|| full.id.clone()),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            got.push((backend.take(), ms, put.stats.bytes_written));
        }
        let ([l1, r1, w1], ms1, b1) = got[0];
        let ([l0, r0, w0], ms0, b0) = got[1];
        rows.push((
            format!("put 5% changed, {kind}: requests"),
            format!("parent named: {l1} lookups, {r1} reads, {w1} writes, {ms1:.0} ms"),
            format!("no parent: {l0} lookups, {r0} reads, {w0} writes, {ms0:.0} ms"),
            format!(
                "{:.2}x requests",
                (l1 + r1 + w1) as f64 / (l0 + r0 + w0).max(1) as f64
            ),
        ));
        json.push(format!(
            "\"put_requests_{kind}\": {{\"parent\": {{\"lookups\": {l1}, \"reads\": {r1}, \"writes\": {w1}, \"ms\": {ms1:.1}, \"bytes_written\": {b1}}}, \"no_parent\": {{\"lookups\": {l0}, \"reads\": {r0}, \"writes\": {w0}, \"ms\": {ms0:.1}, \"bytes_written\": {b0}}}}}"
        ));
    }

    println!(
        "input: {source}, image {} B, inflated {} B",
        img.len(),
        mem.len()
    );
    println!(
        "{:<30} | {:<52} | {:<40} | ratio",
        "measure", "torpor-snapshot", "baseline"
    );
    println!("{}", "-".repeat(140));
    for (a, b, c, d) in rows {
        println!("{a:<30} | {b:<52} | {c:<40} | {d}");
    }
    println!("{{{}}}", json.join(", "));
}
