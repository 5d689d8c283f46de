//! The device steps of the staircase backward (`kernels/staircase.cu`; docs/perf-log.md,
//! session 23): the order a filtered backward visits the classes (by batch-mean logit,
//! [`cce_core::vocab_order`]) and the rows (by descending count of kept 256-class tiles,
//! [`cce_core::tile_budget`]), each row's kept tiles from the forward's per-(row, tile)
//! partials, the per-chunk counts of rows that keep a class chunk, and the gathers and
//! scatters between the caller's layout and the visiting orders.
//!
//! With the rows sorted by kept count, a chunk of classes in the visiting order is needed by a
//! prefix of the sorted rows, so every product of the backward is a dense GEMM over the first
//! `n_c` rows of a gathered chunk: the kept share of the work without a block-sparse kernel.
//! Here: the pure decisions ([`sort_len`], [`bitonic_steps`], [`kept_by_warp_groups`],
//! [`chunk_rows`]), tested on the CPU as the host twins of the kernels. `launch.rs`: the
//! kernels' parameters and one `unsafe` launch per step on device addresses (what the
//! executor, `stair_pass.rs`, calls). `checked.rs`: the same steps on device buffers whose
//! lengths are checked first (`ShapeMismatch`, or `ResourceLimit` past 32-bit sizes), which
//! the device tests (`tests/staircase.rs`) check against the twins and `cce-core`.

use super::*;

mod checked;
mod launch;
pub(super) use launch::KeptRowsAt;

/// Classes per tile of the visiting order: the WGMMA forward's partials are per 256 classes.
pub const STAIR_TILE: usize = 256;

/// Keys per block of the bitonic sort's shared-memory steps (`cce_stair_bitonic_local`).
pub const SORT_BLOCK: usize = 2048;

/// Rows per block of `cce_stair_col_sums_*`.
const COL_SUM_ROWS: usize = 64;

/// The sort length for `n` keys: the next power of two, at least [`SORT_BLOCK`].
pub fn sort_len(n: usize) -> usize {
    n.next_power_of_two().max(SORT_BLOCK)
}

/// One launch of the bitonic sort over [`sort_len`] keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortStep {
    /// `cce_stair_bitonic_local`: every step of partner distance below [`SORT_BLOCK`] of the
    /// merges of sizes `k_first..=k_last`.
    Local {
        /// The first merge size (2: sort each block from scratch).
        k_first: usize,
        /// The last merge size.
        k_last: usize,
    },
    /// `cce_stair_bitonic_step`: one step of partner distance `j ≥` [`SORT_BLOCK`].
    Global {
        /// The merge size.
        k: usize,
        /// The partner distance.
        j: usize,
    },
}

/// The launches that sort `len` keys ascending (`len` a power of two ≥ [`SORT_BLOCK`]): each
/// block's keys from scratch, then per merge size `k` above the block its global steps and the
/// local finish.
pub fn bitonic_steps(len: usize) -> Vec<SortStep> {
    let mut steps = vec![SortStep::Local {
        k_first: 2,
        k_last: SORT_BLOCK.min(len),
    }];
    let mut k = SORT_BLOCK * 2;
    while k <= len {
        let mut j = k / 2;
        while j >= SORT_BLOCK {
            steps.push(SortStep::Global { k, j });
            j /= 2;
        }
        steps.push(SortStep::Local {
            k_first: k,
            k_last: k,
        });
        k *= 2;
    }
    steps
}

/// The host twin of one row of `cce_stair_kept_rows` (the same groups of 32 tiles from the end,
/// suffix sums in lane order, the same stops, then the kept count rounded up to a multiple of
/// `granule` and the mass past it summed again): `(kept, dropped)` from the row's tile masses,
/// largest `p` per tile and target tile (`None`: no target). With `granule` 1, equal to
/// [`cce_core::tile_budget::TileMasses::kept_prefix`] up to the order of the f64 sums.
pub fn kept_by_warp_groups(
    mass: &[f64],
    pmax: &[f32],
    target_tile: Option<usize>,
    (eps, delta): (f32, f64),
    granule: usize,
) -> (usize, f64) {
    let tiles = mass.len();
    let mut base = tiles;
    let mut acc = 0.0f64;
    while base > 0 {
        let group = base.min(32);
        let order: Vec<usize> = (0..group).map(|l| base - 1 - l).collect();
        let ok = |t: usize| Some(t) != target_tile && pmax[t] < eps;
        let first_bad = order.iter().position(|&t| !ok(t)).unwrap_or(group);
        let mut s = 0.0f64;
        let mut cnt = 0;
        let mut last = 0.0f64;
        for (lane, &t) in order.iter().enumerate() {
            s += mass[t];
            if lane < first_bad && acc + s <= delta {
                cnt += 1;
                last = s;
            }
        }
        if cnt > 0 {
            acc += last;
        }
        base -= cnt;
        if cnt < group {
            break;
        }
    }
    let rounded = base.div_ceil(granule.max(1)) * granule.max(1);
    let rounded = rounded.min(tiles);
    if rounded != base {
        acc = mass[rounded..].iter().sum();
    }
    (rounded, acc)
}

/// How many of the rows, sorted by descending `kept` tiles, keep class chunk `c` of `step`
/// tiles (its first tile `c·step`): the host twin of `cce_stair_chunk_rows`.
pub fn chunk_rows(kept_sorted: &[u32], step: usize, chunks: usize) -> Vec<usize> {
    (0..chunks)
        .map(|c| kept_sorted.partition_point(|&k| k as usize > c * step))
        .collect()
}

/// Bytes of the scratch of [`DenseEngine::stair_mean_rows`] for `n` rows of `d`.
pub fn mean_scratch_bytes(n: usize, d: usize) -> usize {
    let blocks = n.div_ceil(COL_SUM_ROWS).max(1);
    blocks * 2 * d * 8 + blocks * 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::tile_budget::TileMasses;

    /// The host simulation of the launches of [`bitonic_steps`], with the kernels' index maps.
    fn simulate(keys: &mut [u64]) {
        let len = keys.len();
        let swap = |keys: &mut [u64], i: usize, j: usize, k: usize| {
            let asc = i & k == 0;
            if (keys[i] > keys[i + j]) == asc {
                keys.swap(i, i + j);
            }
        };
        for step in bitonic_steps(len) {
            match step {
                SortStep::Local { k_first, k_last } => {
                    for base in (0..len).step_by(SORT_BLOCK) {
                        let mut k = k_first;
                        while k <= k_last {
                            let mut j = k.min(SORT_BLOCK) / 2;
                            while j > 0 {
                                for t in 0..SORT_BLOCK / 2 {
                                    let i = 2 * j * (t / j) + t % j;
                                    swap(keys, base + i, j, k);
                                }
                                j /= 2;
                            }
                            k *= 2;
                        }
                    }
                }
                SortStep::Global { k, j } => {
                    for p in 0..len / 2 {
                        swap(keys, 2 * j * (p / j) + p % j, j, k);
                    }
                }
            }
        }
    }

    #[test]
    fn the_bitonic_launches_sort() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [2048usize, 4096, 16384, 65536] {
            let mut keys: Vec<u64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 5000
                })
                .collect();
            let mut want = keys.clone();
            want.sort();
            simulate(&mut keys);
            assert_eq!(keys, want, "len {len}");
        }
        assert_eq!(sort_len(3), 2048);
        assert_eq!(sort_len(256000), 262144);
        assert_eq!(
            bitonic_steps(8192),
            [
                SortStep::Local {
                    k_first: 2,
                    k_last: 2048
                },
                SortStep::Global { k: 4096, j: 2048 },
                SortStep::Local {
                    k_first: 4096,
                    k_last: 4096
                },
                SortStep::Global { k: 8192, j: 4096 },
                SortStep::Global { k: 8192, j: 2048 },
                SortStep::Local {
                    k_first: 8192,
                    k_last: 8192
                },
            ]
        );
    }

    #[test]
    fn warp_groups_match_the_rule() {
        let mut x = 0x2545_f491u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 1000) as f64 / 1000.0
        };
        for tiles in [1usize, 5, 31, 32, 33, 64, 200, 1000] {
            for trial in 0..20 {
                let mass: Vec<f64> = (0..tiles).map(|_| next() * next() * 1e-4).collect();
                let pmax: Vec<f32> = (0..tiles)
                    .map(|_| if next() < 0.02 { 0.5 } else { 1e-5 })
                    .collect();
                let target = (trial % 3 == 0).then(|| (next() * tiles as f64) as usize);
                let mut tm = TileMasses::zeros(1, tiles);
                tm.mass.copy_from_slice(&mass);
                tm.max_g0.copy_from_slice(&pmax);
                if let Some(t) = target {
                    tm.max_g0[t] = f32::INFINITY;
                }
                let want = tm.kept_prefix(2.4e-4, 1e-3)[0];
                let got = kept_by_warp_groups(&mass, &pmax, target, (2.4e-4, 1e-3), 1);
                assert_eq!(got.0, want.0, "tiles {tiles} trial {trial}");
                assert!(
                    (got.1 - want.1).abs() <= 1e-15,
                    "tiles {tiles} trial {trial}"
                );
                // Rounded up to chunks of 7 tiles: what is past the rounding, never more.
                let (k7, m7) = kept_by_warp_groups(&mass, &pmax, target, (2.4e-4, 1e-3), 7);
                assert!(k7 >= got.0 && (k7 % 7 == 0 || k7 == tiles) && k7 < got.0 + 7);
                let past: f64 = mass[k7..].iter().sum();
                assert!((m7 - past).abs() <= 1e-15 && m7 <= got.1 + 1e-15);
            }
        }
    }

    #[test]
    fn chunk_rows_count_the_rows_past_each_chunk_start() {
        assert_eq!(chunk_rows(&[9, 5, 5, 2, 0], 2, 5), [4, 3, 3, 1, 1]);
        assert_eq!(chunk_rows(&[], 4, 2), [0, 0]);
        assert_eq!(mean_scratch_bytes(100, 10), 2 * 2 * 10 * 8 + 2 * 4);
    }
}
