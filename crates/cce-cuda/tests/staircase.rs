//! The staircase backward's device steps (`cce_cuda::dense::staircase`) against their host
//! twins: the class order against `cce_core::vocab_order`, the row order against
//! `cce_core::tile_budget::rows_by_kept`, each row's kept tiles against the rule, the
//! per-chunk counts, the gathers and scatters. Fresh random inputs per run (the seed is
//! printed); skips without a CUDA device.

mod common;

use cce_core::tile_budget::{rows_by_kept, TileMasses};
use cce_core::vocab_order::VocabOrder;
use cce_core::{DType, HostTensor};
use cce_cuda::cudarc::driver::CudaSlice;
use cce_cuda::dense::staircase::{chunk_rows, kept_by_warp_groups, mean_scratch_bytes, sort_len};
use cce_cuda::dense::DenseEngine;
use common::{backend, seeded};
use rand::Rng;

fn engine(test: &str) -> Option<DenseEngine> {
    let be = backend(test)?;
    Some(DenseEngine::new(be.stream().clone()).unwrap())
}

fn up(engine: &DenseEngine, bytes: &[u8]) -> CudaSlice<u8> {
    engine.stream().clone_htod(bytes).unwrap()
}

fn zeros(engine: &DenseEngine, bytes: usize) -> CudaSlice<u8> {
    engine.stream().alloc_zeros::<u8>(bytes.max(1)).unwrap()
}

fn down(engine: &DenseEngine, s: &CudaSlice<u8>) -> Vec<u8> {
    engine.stream().clone_dtoh(s).unwrap()
}

fn words<T: Copy>(bytes: &[u8], n: usize, f: fn([u8; 4]) -> T) -> Vec<T> {
    bytes[..n * 4]
        .chunks_exact(4)
        .map(|w| f(w.try_into().unwrap()))
        .collect()
}

fn le<T: Copy, const K: usize>(x: &[T], f: fn(T) -> [u8; K]) -> Vec<u8> {
    x.iter().flat_map(|&v| f(v)).collect()
}

/// bf16 values as a host tensor and their exact f32 widening.
fn bf16(rng: &mut impl Rng, shape: Vec<usize>, std: f32) -> (HostTensor, Vec<f32>) {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.random::<f32>() - 0.5) * 2.0 * std)
        .collect();
    let t = HostTensor::from_f32(shape, &v, DType::BF16).unwrap();
    let w = t.to_f32_vec();
    (t, w)
}

#[test]
fn class_order_is_the_batch_mean_logit_order() {
    let Some(eng) = engine("class_order_is_the_batch_mean_logit_order") else {
        return;
    };
    let mut rng = seeded();
    for (n, d, v, bias) in [(300usize, 64usize, 5000usize, false), (77, 72, 2048, true)] {
        let (e, ev) = bf16(&mut rng, vec![n, d], 1.0);
        let (c, cv) = bf16(&mut rng, vec![v, d], 0.5);
        let targets: Vec<i32> = (0..n)
            .map(|_| {
                if rng.random::<f32>() < 0.2 {
                    -1
                } else {
                    rng.random_range(0..v as i32)
                }
            })
            .collect();
        // A bias with one masked class (−∞ sorts last).
        let (_, mut bv) = bf16(&mut rng, vec![v], 1.0);
        bv[3] = f32::NEG_INFINITY;
        let b = HostTensor::from_f32(vec![v], &bv, DType::BF16).unwrap();
        let e_d = up(&eng, e.as_bytes());
        let c_d = up(&eng, c.as_bytes());
        let b_d = up(&eng, b.as_bytes());
        let t_d = up(&eng, &le(&targets, i32::to_le_bytes));
        let mut scratch = zeros(&eng, mean_scratch_bytes(n, d));
        let mut mean = zeros(&eng, d * 4);
        eng.stair_mean_rows(DType::BF16, &e_d, (n, d), &t_d, &mut scratch, &mut mean)
            .unwrap();
        let mut keys = zeros(&eng, sort_len(v) * 8);
        let (mut perm, mut inv) = (zeros(&eng, v * 4), zeros(&eng, v * 4));
        eng.stair_class_order(
            DType::BF16,
            &c_d,
            (v, d),
            &mean,
            bias.then_some(&b_d),
            &mut keys,
            (&mut perm, &mut inv),
        )
        .unwrap();
        let mean_h = words(&down(&eng, &mean), d, f32::from_le_bytes);
        let perm_h = words(&down(&eng, &perm), v, u32::from_le_bytes);
        let inv_h = words(&down(&eng, &inv), v, u32::from_le_bytes);
        // The host twin: f64 mean of the valid rows, f64 scores.
        let valid: Vec<usize> = (0..n).filter(|&i| targets[i] >= 0).collect();
        let mut want_mean = vec![0.0f64; d];
        for &i in &valid {
            for k in 0..d {
                want_mean[k] += ev[i * d + k] as f64;
            }
        }
        for (k, m) in want_mean.iter_mut().enumerate() {
            *m /= valid.len() as f64;
            assert!(
                (*m - mean_h[k] as f64).abs() <= 1e-6 * (1.0 + m.abs()),
                "mean[{k}]"
            );
        }
        let scores: Vec<f32> = (0..v)
            .map(|j| {
                let s: f64 = (0..d).map(|k| cv[j * d + k] as f64 * want_mean[k]).sum();
                (s + if bias { bv[j] as f64 } else { 0.0 }) as f32
            })
            .collect();
        let want = VocabOrder::by_score(&scores);
        let same = (0..v).filter(|&k| perm_h[k] == want.perm()[k]).count();
        assert!(
            same as f64 >= 0.99 * v as f64,
            "{same} of {v} positions agree"
        );
        for k in 1..v {
            let (a, b) = (scores[perm_h[k - 1] as usize], scores[perm_h[k] as usize]);
            assert!(
                a >= b - 1e-5 * (1.0 + b.abs()) || b.is_nan(),
                "position {k}: {a} before {b}"
            );
        }
        for (k, &j) in perm_h.iter().enumerate() {
            assert_eq!(inv_h[j as usize], k as u32, "inverse at class {j}");
        }
        if bias {
            assert_eq!(perm_h[v - 1], 3, "the masked class comes last");
        }
    }
}

#[test]
fn row_order_sorts_by_kept_then_id() {
    let Some(eng) = engine("row_order_sorts_by_kept_then_id") else {
        return;
    };
    let mut rng = seeded();
    for (n, n_tiles) in [(5000usize, 1000usize), (37, 3), (2049, 40)] {
        let kept: Vec<u32> = (0..n)
            .map(|_| rng.random_range(0..=n_tiles as u32))
            .collect();
        let kept_d = up(&eng, &le(&kept, u32::to_le_bytes));
        let mut keys = zeros(&eng, sort_len(n) * 8);
        let mut perm = zeros(&eng, n * 4);
        eng.stair_row_order(&kept_d, (n, n_tiles), &mut keys, &mut perm)
            .unwrap();
        let got = words(&down(&eng, &perm), n, u32::from_le_bytes);
        let kept_us: Vec<usize> = kept.iter().map(|&k| k as usize).collect();
        assert_eq!(got, rows_by_kept(&kept_us), "n {n}");
        // Per-chunk counts of the sorted rows that keep each chunk's first tile.
        let mut kept_sorted = zeros(&eng, n * 4);
        eng.stair_gather_u32(&kept_d, &perm, n, &mut kept_sorted)
            .unwrap();
        let (step, chunks) = (2, n_tiles.div_ceil(2));
        let mut counts = zeros(&eng, chunks * 4);
        eng.stair_chunk_rows(&kept_sorted, n, (step, chunks), &mut counts)
            .unwrap();
        let counts_h = words(&down(&eng, &counts), chunks, u32::from_le_bytes);
        let mut sorted = kept.clone();
        sorted.sort_by(|a, b| b.cmp(a));
        let want: Vec<u32> = chunk_rows(&sorted, step, chunks)
            .into_iter()
            .map(|x| x as u32)
            .collect();
        assert_eq!(counts_h, want, "n {n}");
    }
}

#[test]
fn kept_rows_follow_the_rule() {
    let Some(eng) = engine("kept_rows_follow_the_rule") else {
        return;
    };
    let mut rng = seeded();
    let (eps, delta) = (2f32.powi(-12), 1e-3f32);
    let cases = [
        (700usize, 37usize, 40usize, 1usize),
        (64, 1000, 1000, 32),
        (5, 1, 1, 4),
    ];
    for (n, n_tiles, ld, granule) in cases {
        // The last tile partly past V.
        let v = n_tiles * 256 - 100;
        let lse: Vec<f32> = (0..n).map(|_| rng.random_range(-5.0..30.0)).collect();
        let mut partial = vec![0.0f32; n * ld * 2];
        for i in 0..n {
            for t in 0..ld {
                // Mostly tiny tiles (p ~ e^-12 .. e^-25), some large, some fully masked.
                let u: f32 = rng.random();
                let m = if u < 0.03 {
                    f32::NEG_INFINITY
                } else if u < 0.08 {
                    lse[i] - rng.random_range(0.0..3.0)
                } else {
                    lse[i] - rng.random_range(12.0..25.0)
                };
                partial[(i * ld + t) * 2] = m;
                partial[(i * ld + t) * 2 + 1] = if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    rng.random_range(1.0..256.0)
                };
            }
        }
        let ytile: Vec<i32> = (0..n)
            .map(|_| {
                if rng.random::<f32>() < 0.1 {
                    -1
                } else {
                    rng.random_range(0..n_tiles as i32)
                }
            })
            .collect();
        let dl_rows: Vec<f32> = (0..n)
            .map(|_| if rng.random::<f32>() < 0.1 { 0.0 } else { 1.0 })
            .collect();
        let mut kept = zeros(&eng, n * 4);
        let mut dropped = zeros(&eng, n * 4);
        let mut entries = zeros(&eng, n * 4);
        eng.stair_kept_rows(
            &up(&eng, &le(&partial, f32::to_le_bytes)),
            (n, v, ld),
            (
                &up(&eng, &le(&lse, f32::to_le_bytes)),
                &up(&eng, &le(&ytile, i32::to_le_bytes)),
            ),
            (Some(&up(&eng, &le(&dl_rows, f32::to_le_bytes))), 0.0, None),
            (eps, delta, granule),
            (&mut kept, &mut dropped),
            Some(&mut entries),
        )
        .unwrap();
        let kept_h = words(&down(&eng, &kept), n, u32::from_le_bytes);
        let dropped_h = words(&down(&eng, &dropped), n, f32::from_le_bytes);
        let entries_h = words(&down(&eng, &entries), n, u32::from_le_bytes);
        let mut agree = 0;
        for i in 0..n {
            let active = ytile[i] >= 0 && dl_rows[i] != 0.0;
            if !active {
                assert_eq!((kept_h[i], dropped_h[i]), (0, 0.0), "inactive row {i}");
                assert_eq!(entries_h[i], u32::MAX, "inactive row {i}");
                agree += 1;
                continue;
            }
            assert_eq!(
                entries_h[i] as usize,
                (kept_h[i] as usize * 256).min(v),
                "row {i}"
            );
            let row = &partial[i * ld * 2..(i * ld + n_tiles) * 2];
            let pmax: Vec<f32> = row
                .chunks(2)
                .map(|s| ((s[0] as f64 - lse[i] as f64).exp()) as f32)
                .collect();
            let mass: Vec<f64> = row
                .chunks(2)
                .zip(&pmax)
                .map(|(s, &p)| {
                    if s[0] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        s[1] as f64 * p as f64
                    }
                })
                .collect();
            let target = usize::try_from(ytile[i]).ok();
            let (k, _) = kept_by_warp_groups(&mass, &pmax, target, (eps, delta as f64), granule);
            let (k1, m1) = kept_by_warp_groups(&mass, &pmax, target, (eps, delta as f64), 1);
            let mut tm = TileMasses::zeros(1, n_tiles);
            tm.mass.copy_from_slice(&mass);
            tm.max_g0.copy_from_slice(&pmax);
            if let Some(t) = target {
                tm.max_g0[t] = f32::INFINITY;
            }
            // The two twins sum the dropped masses in different orders: the counts agree
            // exactly, the masses to rounding.
            let (k_ref, m_ref) = tm.kept_prefix(eps, delta as f64)[0];
            assert_eq!(k1, k_ref, "twin, row {i}");
            assert!(
                (m1 - m_ref).abs() <= 1e-12 * m_ref.abs().max(1e-300),
                "twin, row {i}: dropped mass {m1} against {m_ref}"
            );
            // The contract on the device's own decision: its suffix holds no entry ≥ eps nor
            // the target, and its mass is the reported one, within delta.
            let kd = kept_h[i] as usize;
            let suffix: f64 = mass[kd..].iter().sum();
            assert!(pmax[kd..].iter().all(|&p| p < eps * 1.001), "row {i}");
            assert!(target.is_none_or(|t| t < kd), "row {i} drops its target");
            assert!(
                (suffix - dropped_h[i] as f64).abs() <= 1e-4 * suffix + 1e-12,
                "row {i}"
            );
            assert!(dropped_h[i] <= delta * 1.0001, "row {i}");
            agree += usize::from(kd == k);
        }
        assert!(
            agree as f64 >= 0.98 * n as f64,
            "{agree} of {n} rows as the twin"
        );
    }
}

#[test]
fn gathers_and_scatters_move_whole_rows() {
    let Some(eng) = engine("gathers_and_scatters_move_whole_rows") else {
        return;
    };
    let mut rng = seeded();
    for (rows, d) in [(513usize, 64usize), (40, 13)] {
        let src: Vec<u16> = (0..rows * d).map(|_| rng.random()).collect();
        let mut perm: Vec<u32> = (0..rows as u32).collect();
        for i in (1..rows).rev() {
            perm.swap(i, rng.random_range(0..=i));
        }
        let perm_d = up(&eng, &le(&perm, u32::to_le_bytes));
        let mut out = zeros(&eng, rows * d * 2);
        eng.stair_gather_rows16(
            &up(&eng, &le(&src, u16::to_le_bytes)),
            &perm_d,
            (rows, d),
            &mut out,
        )
        .unwrap();
        let got: Vec<u16> = down(&eng, &out)
            .chunks_exact(2)
            .map(|w| u16::from_le_bytes([w[0], w[1]]))
            .collect();
        for k in 0..rows {
            let j = perm[k] as usize;
            assert_eq!(got[k * d..(k + 1) * d], src[j * d..(j + 1) * d], "row {k}");
        }
        // Scatter f32 rows back through the permutation: to f32 (added) and to bf16.
        let x: Vec<f32> = (0..rows * d).map(|_| rng.random_range(-2.0..2.0)).collect();
        let base: Vec<f32> = (0..rows * d).map(|_| rng.random_range(-2.0..2.0)).collect();
        let x_d = up(&eng, &le(&x, f32::to_le_bytes));
        let mut acc = up(&eng, &le(&base, f32::to_le_bytes));
        eng.stair_scatter_rows(&x_d, &perm_d, (rows, d), DType::F32, &mut acc, true)
            .unwrap();
        let mut b16 = zeros(&eng, rows * d * 2);
        eng.stair_scatter_rows(&x_d, &perm_d, (rows, d), DType::BF16, &mut b16, false)
            .unwrap();
        let acc_h = words(&down(&eng, &acc), rows * d, f32::from_le_bytes);
        let b16_h = HostTensor::from_bytes(vec![rows, d], DType::BF16, &down(&eng, &b16))
            .unwrap()
            .to_f32_vec();
        for k in 0..rows {
            let j = perm[k] as usize;
            for q in 0..d {
                assert_eq!(acc_h[j * d + q], base[j * d + q] + x[k * d + q]);
                let want = HostTensor::from_f32(vec![1], &[x[k * d + q]], DType::BF16)
                    .unwrap()
                    .to_f32_vec()[0];
                assert_eq!(b16_h[j * d + q], want);
            }
        }
        // Per-row words and targets in the visiting orders.
        let targets: Vec<i32> = (0..rows)
            .map(|i| {
                if i % 7 == 0 {
                    -1
                } else {
                    (i * 31 % rows) as i32
                }
            })
            .collect();
        let class_inv: Vec<u32> = perm.clone();
        let mut mapped = zeros(&eng, rows * 4);
        let mut ytile = zeros(&eng, rows * 4);
        let (offset, limit) = (rows / 3, rows / 2);
        eng.stair_map_targets(
            &up(&eng, &le(&targets, i32::to_le_bytes)),
            rows,
            (Some(&perm_d), &up(&eng, &le(&class_inv, u32::to_le_bytes))),
            (offset, limit),
            (Some(&mut mapped), Some(&mut ytile)),
        )
        .unwrap();
        let mapped_h = words(&down(&eng, &mapped), rows, i32::from_le_bytes);
        let ytile_h = words(&down(&eng, &ytile), rows, i32::from_le_bytes);
        for k in 0..rows {
            let y = targets[perm[k] as usize];
            let pos = if y < 0 {
                -1
            } else {
                class_inv[y as usize] as i32
            };
            let rel = pos - offset as i32;
            let want = if pos >= 0 && rel >= 0 && rel < limit as i32 {
                rel
            } else {
                -1
            };
            assert_eq!(mapped_h[k], want, "row {k}");
            assert_eq!(ytile_h[k], if pos < 0 { -1 } else { pos / 256 });
        }
    }
}
