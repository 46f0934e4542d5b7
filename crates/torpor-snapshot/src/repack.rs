//! Repacking: the part of garbage collection that rewrites *sparse* packs, those of which the
//! remaining snapshots use less than a fraction of the bytes (`GcOptions::repack_below`), and
//! merges *small* ones (`GcOptions::merge_small`, see [`packs_to_repack`]) the same way.
//!
//! A pack is written once and kept whole while any snapshot locates a chunk in it, so a store
//! whose snapshots keep changing (an agent parked again and again, its older snapshots retired)
//! accumulates packs that are mostly dead bytes. Repacking copies the used chunks of sparse
//! packs into new packs (in the order the newest snapshots name them, so a restore still reads
//! long runs), rewrites every manifest that locates a chunk in them to the new locations, and
//! leaves the old packs unreferenced, for the sweep that follows in the same run.
//!
//! Safety, with the collector's exclusive lock held (no put or fork in flight):
//! - every copied blob is verified (decoded against its chunk id) before it is written again;
//!   a sparse pack with a missing or corrupt chunk is left as it is (and `verify` names it);
//! - order: new packs and their indexes, then the manifests (each replaced atomically), then
//!   the old packs (by the sweep). A crash at any step leaves every manifest pointing at packs
//!   that exist: unreferenced new packs, or old ones, are what the next run removes;
//! - a restore that read a manifest before it was rewritten and finds the old pack gone reads
//!   the manifest again and retries (see `Store::get_dir`); a process's pack catalog learns
//!   the old packs are gone at its next put (each catalog pack is checked once per put).

use std::collections::{BTreeMap, HashMap, HashSet};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::error::StoreError;
use crate::id::ChunkId;
use crate::manifest::Manifest;
use crate::pack::{PackBuilder, PackId, PackLoc};
use crate::store::{Store, DEFAULT_PACK_BYTES};

/// Bytes of used chunks fetched and held at once while repacking (the sparse packs are taken
/// in groups of about this much).
const REPACK_GROUP_BYTES: u64 = 64 << 20;

/// What a repack did (or, dry, would do).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Repacked {
    /// Sparse packs whose used chunks were copied (now unreferenced).
    pub packs: u64,
    /// New packs written, and their bytes with their indexes'.
    pub packs_written: u64,
    pub bytes_written: u64,
    pub manifests_rewritten: u64,
}

/// Used bytes one collection copies at most: it holds the store's exclusive lock, which puts
/// wait for (`StoreConfig::lock_wait`), so a large backlog is worked off over several runs.
pub(crate) const REPACK_MAX_BYTES: u64 = 128 << 20;

/// A pack is *small* under the store's pack size divided by this (1 MiB of the default 4).
pub(crate) const SMALL_PACK_DIVISOR: u64 = 4;

/// The live packs one collection rewrites (`sizes`: each pack object's size), pack → used
/// bytes, within one run's budget ([`REPACK_MAX_BYTES`], at least one pack):
/// - first the *sparse* ones, of which `used / size` is below `below`, the sparsest first (the
///   most space for the least copying);
/// - then, with `small_under`, the *small* ones (objects under that size), the smallest first:
///   two or more, or any number beside sparse packs (one small pack alone would only be
///   copied into another). Merged, a store of frequent small puts keeps few objects, so a
///   restore reads few ranges.
pub(crate) fn packs_to_repack(
    live_locs: &HashSet<PackLoc>,
    sizes: &HashMap<PackId, u64>,
    below: f64,
    small_under: Option<u64>,
) -> BTreeMap<PackId, u64> {
    let mut used: HashMap<PackId, u64> = HashMap::new();
    for l in live_locs {
        *used.entry(l.pack).or_default() += u64::from(l.len);
    }
    let mut sparse: Vec<(f64, PackId, u64)> = used
        .iter()
        .filter_map(|(&p, &u)| {
            let size = *sizes.get(&p)?;
            let fill = u as f64 / size as f64;
            (size > 0 && fill < below).then_some((fill, p, u))
        })
        .collect();
    sparse.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut budget = REPACK_MAX_BYTES;
    let mut out = BTreeMap::new();
    for (_, p, u) in sparse {
        if u > budget && !out.is_empty() {
            return out;
        }
        budget = budget.saturating_sub(u);
        out.insert(p, u);
    }
    let Some(limit) = small_under else {
        return out;
    };
    let mut small: Vec<(u64, PackId, u64)> = used
        .iter()
        .filter(|(p, _)| !out.contains_key(*p))
        .filter_map(|(&p, &u)| {
            let size = *sizes.get(&p)?;
            (size < limit).then_some((size, p, u))
        })
        .collect();
    small.sort();
    let mut merged = Vec::new();
    for (_, p, u) in small {
        if u > budget {
            break;
        }
        budget -= u;
        merged.push((p, u));
    }
    if merged.len() >= 2 || (!merged.is_empty() && !out.is_empty()) {
        out.extend(merged);
    }
    out
}

impl Store {
    /// Copies the used chunks of `sparse` (pack → used bytes) into new packs and rewrites
    /// `manifests` (those that remain) to locate them there; the manifests in memory are
    /// updated too, so the sweep that follows sees the old packs unreferenced.
    pub(crate) async fn repack(
        &self,
        manifests: &mut [Manifest],
        sparse: &BTreeMap<PackId, u64>,
        dry_run: bool,
    ) -> Result<Repacked, StoreError> {
        let mut done = Repacked::default();
        if sparse.is_empty() {
            return Ok(done);
        }
        if dry_run {
            done.packs = sparse.len() as u64;
            done.bytes_written = sparse.values().sum();
            return Ok(done);
        }
        // The chunks to copy, in the order the newest snapshots name them: one copy per chunk
        // (a chunk located in two sparse packs is written once).
        let mut order: Vec<usize> = (0..manifests.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(manifests[i].created_unix_ms));
        let mut wanted: Vec<(ChunkId, PackLoc)> = Vec::new();
        let mut seen: HashSet<ChunkId> = HashSet::new();
        for &i in &order {
            let m = &manifests[i];
            for (c, _) in m.chunk_refs() {
                if let Some(loc) = m.packs.get(c) {
                    if sparse.contains_key(&loc.pack) && seen.insert(*c) {
                        wanted.push((*c, *loc));
                    }
                }
            }
        }
        // Groups of sparse packs of about REPACK_GROUP_BYTES used bytes each.
        let mut groups: Vec<HashSet<PackId>> = vec![HashSet::new()];
        let mut group_bytes = 0u64;
        for (pack, used) in sparse {
            if group_bytes > 0 && group_bytes + used > REPACK_GROUP_BYTES {
                groups.push(HashSet::new());
                group_bytes = 0;
            }
            groups.last_mut().expect("one group").insert(*pack);
            group_bytes += used;
        }
        let target = self
            .config()
            .pack_bytes
            .unwrap_or(DEFAULT_PACK_BYTES)
            .max(1);
        // Where each copied chunk now lies (by chunk: one copy serves every old location).
        let mut moved: HashMap<ChunkId, PackLoc> = HashMap::new();
        let mut skipped: HashSet<PackId> = HashSet::new();
        for group in groups {
            let chunks: Vec<(ChunkId, PackLoc)> = wanted
                .iter()
                .filter(|(_, l)| group.contains(&l.pack))
                .copied()
                .collect();
            let (blobs, bad) = self.fetch_verified(&chunks).await?;
            skipped.extend(bad);
            let mut builder = PackBuilder::default();
            let mut finished = Vec::new();
            for ((c, loc), blob) in chunks.iter().zip(blobs) {
                let Some(blob) = blob else { continue };
                if skipped.contains(&loc.pack) {
                    continue;
                }
                builder.push(*c, &blob);
                if builder.len() >= target {
                    finished.push(std::mem::take(&mut builder).finish());
                }
            }
            if !builder.is_empty() {
                finished.push(builder.finish());
            }
            let uploads = finished.into_iter().map(|(id, bytes, index, locs)| {
                let entries: Vec<(ChunkId, u64, u32)> =
                    locs.iter().map(|(c, l)| (*c, l.offset, l.len)).collect();
                let written = (bytes.len() + index.len()) as u64;
                let (pack_key, index_key) = (self.pack_key(&id), self.pack_index_key(&id));
                let backend = self.backend().clone();
                async move {
                    backend.put(&pack_key, Bytes::from(bytes)).await?;
                    backend.put(&index_key, Bytes::from(index)).await?;
                    Ok::<_, StoreError>((id, entries, locs, written))
                }
            });
            let uploaded: Vec<_> = futures::stream::iter(uploads)
                .buffer_unordered(self.config().parallelism.max(1))
                .try_collect()
                .await?;
            for (id, entries, locs, written) in uploaded {
                done.packs_written += 1;
                done.bytes_written += written;
                self.catalog().add(id, &entries);
                moved.extend(locs);
            }
        }
        // Every manifest that locates a copied chunk in a sparse pack, rewritten (atomically
        // each). A chunk of a skipped pack with a verified copy from another sparse pack moves
        // to that copy too.
        for m in manifests.iter_mut() {
            let mut changed = false;
            for (c, loc) in m.packs.iter_mut() {
                if sparse.contains_key(&loc.pack) {
                    if let Some(new) = moved.get(c) {
                        *loc = *new;
                        changed = true;
                    }
                }
            }
            if changed {
                self.write_manifest(m).await?;
                done.manifests_rewritten += 1;
            }
        }
        // Repacked: the sparse packs no manifest locates a chunk in any more (one whose chunk
        // was not copied, because it was first found in a skipped pack, stays).
        let still: HashSet<PackId> = manifests
            .iter()
            .flat_map(|m| m.packs.values().map(|l| l.pack))
            .filter(|p| sparse.contains_key(p))
            .collect();
        for p in sparse.keys().filter(|p| !still.contains(p)) {
            self.catalog().forget(p);
            done.packs += 1;
        }
        for p in skipped.intersection(&still) {
            tracing::warn!(pack = %p, "a pack chosen for repacking has a missing or corrupt chunk: not repacked (`snapshot verify` names the snapshots)");
        }
        Ok(done)
    }

    /// The blobs at `chunks`' locations, each verified against its chunk id (`None` where
    /// missing or corrupt), and the packs that had such a chunk. One ranged read per pack.
    async fn fetch_verified(
        &self,
        chunks: &[(ChunkId, PackLoc)],
    ) -> Result<(Vec<Option<Bytes>>, HashSet<PackId>), StoreError> {
        let mut by_pack: BTreeMap<PackId, Vec<usize>> = BTreeMap::new();
        for (i, (_, loc)) in chunks.iter().enumerate() {
            by_pack.entry(loc.pack).or_default().push(i);
        }
        let reads = by_pack.into_iter().map(|(pack, slots)| {
            let ranges: Vec<std::ops::Range<u64>> =
                slots.iter().map(|&i| chunks[i].1.range()).collect();
            let key = self.pack_key(&pack);
            let backend = self.backend().clone();
            async move {
                let got = backend.get_ranges(&key, &ranges).await?;
                Ok::<_, StoreError>((pack, slots, got))
            }
        });
        let read: Vec<_> = futures::stream::iter(reads)
            .buffer_unordered(self.config().parallelism.max(1))
            .try_collect()
            .await?;
        let mut out: Vec<Option<Bytes>> = vec![None; chunks.len()];
        let mut bad = HashSet::new();
        for (pack, slots, got) in read {
            match got {
                Some(blobs) if blobs.len() == slots.len() => {
                    for (i, b) in slots.into_iter().zip(blobs) {
                        out[i] = Some(b);
                    }
                }
                _ => {
                    bad.insert(pack);
                }
            }
        }
        let codec = self.codec().clone();
        let ids: Vec<ChunkId> = chunks.iter().map(|(c, _)| *c).collect();
        let (out, corrupt) = tokio::task::spawn_blocking(move || {
            let corrupt: Vec<usize> = out
                .iter()
                .enumerate()
                .filter(|(i, b)| {
                    b.as_ref()
                        .is_some_and(|b| codec.decode(&ids[*i], b).is_err())
                })
                .map(|(i, _)| i)
                .collect();
            (out, corrupt)
        })
        .await?;
        bad.extend(corrupt.into_iter().map(|i| chunks[i].1.pack));
        Ok((out, bad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(pack: u8, len: u32) -> PackLoc {
        PackLoc {
            pack: PackId([pack; 32]),
            offset: 0,
            len,
        }
    }

    #[test]
    fn sparse_packs_are_those_under_the_fraction_sparsest_first_within_a_runs_budget() {
        let mb = 1u32 << 20;
        let sizes: HashMap<PackId, u64> = (1..=4u8)
            .map(|p| (PackId([p; 32]), 100 * u64::from(mb)))
            .collect();
        // Pack 1: 10% used, 2: 40%, 3: 60% (not sparse at 0.5), 4: 99%; 5 is not listed.
        let live: HashSet<PackLoc> = [
            loc(1, 10 * mb),
            loc(2, 40 * mb),
            loc(3, 60 * mb),
            loc(4, 99 * mb),
            loc(5, mb),
        ]
        .into_iter()
        .collect();
        let sparse = packs_to_repack(&live, &sizes, 0.5, None);
        assert_eq!(
            sparse.keys().map(|p| p.0[0]).collect::<Vec<_>>(),
            vec![1, 2]
        );
        // The budget: 128 MiB of used bytes. 10 + 40 + 99 would pass it: the sparsest first.
        let sparse = packs_to_repack(&live, &sizes, 1.0, None);
        assert_eq!(
            sparse.keys().map(|p| p.0[0]).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        // One pack over the budget on its own is still taken (alone).
        let big: HashSet<PackLoc> = [loc(1, 200 * mb)].into_iter().collect();
        let sizes1 = HashMap::from([(PackId([1; 32]), 1000 * u64::from(mb))]);
        assert_eq!(packs_to_repack(&big, &sizes1, 0.5, None).len(), 1);
    }

    #[test]
    fn small_packs_are_merged_two_or_more_or_beside_sparse_ones() {
        let kb = 1u32 << 10;
        let size = |n: u64| n * u64::from(kb);
        // Pack 1: 4 MiB, full; 2 and 3: 100 and 300 KiB, full; 4: 2 MiB, full.
        let sizes: HashMap<PackId, u64> = [(1, 4096), (2, 100), (3, 300), (4, 2048)]
            .into_iter()
            .map(|(p, n)| (PackId([p; 32]), size(n)))
            .collect();
        let live: HashSet<PackLoc> = [
            loc(1, 4096 * kb),
            loc(2, 100 * kb),
            loc(3, 300 * kb),
            loc(4, 2048 * kb),
        ]
        .into_iter()
        .collect();
        let picked = |r: BTreeMap<PackId, u64>| r.keys().map(|p| p.0[0]).collect::<Vec<_>>();
        // Nothing sparse; under 1 MiB: 2 and 3, merged together.
        assert_eq!(
            picked(packs_to_repack(&live, &sizes, 0.5, Some(size(1024)))),
            vec![2, 3]
        );
        // Without merging, nothing.
        assert!(packs_to_repack(&live, &sizes, 0.5, None).is_empty());
        // One small pack alone is left as it is.
        let one: HashSet<PackLoc> = [loc(1, 4096 * kb), loc(2, 100 * kb)].into_iter().collect();
        assert!(packs_to_repack(&one, &sizes, 0.5, Some(size(1024))).is_empty());
        // Beside a sparse pack (1 at 10%), one small pack joins it.
        let sparse_one: HashSet<PackLoc> =
            [loc(1, 400 * kb), loc(2, 100 * kb)].into_iter().collect();
        assert_eq!(
            picked(packs_to_repack(&sparse_one, &sizes, 0.5, Some(size(1024)))),
            vec![1, 2]
        );
    }
}
