//! Vocabulary-parallel calls on hand-built groups of ranks (the equivalence over random cases
//! is `vocab_parallel.rs`):
//!
//! - padded vocabularies: targets equal to `ignore_index` (or any sentinel) never match a
//!   padding class, whose rows of `c` and `bias` hold NaN or huge values; the loss is finite
//!   and equal to the unpadded one; the padding's gradients are exactly 0.
//! - bad input: one test per typed error, on every rank, and no rank waits for one that stopped.

mod common;

use cce_core::options::{Options, Reduction};
use cce_core::vocab_parallel::{ShardLayout, VocabParallelError, VocabShard};
use cce_core::{Backend, CceError, DLoss, DType, HostTensor, Inputs, Saved, TensorMeta, Upstream};
use cce_reference::vocab_parallel::{RankDriver, ThreadComm};
use cce_reference::CpuBackend;
use rand::{Rng, SeedableRng};

fn vals(t: &Option<HostTensor>) -> Vec<f64> {
    t.as_ref().map(|t| t.to_f64_vec()).unwrap_or_default()
}

/// Per-rank inputs of a hand-built group.
struct RankInputs {
    shard: VocabShard,
    e: HostTensor,
    c: HostTensor,
    bias: Option<HostTensor>,
    targets: HostTensor,
}

/// `f32` tensor of `shape` from values.
fn t32(shape: Vec<usize>, vals: &[f32], dtype: DType) -> HostTensor {
    HostTensor::from_f32(shape, vals, dtype).unwrap()
}

/// Rows `range` of a row-major `[_, width]` value list, with `pad` rows of `fill` after.
fn rows_of(
    vals: &[f32],
    width: usize,
    range: std::ops::Range<usize>,
    pad: usize,
    fill: f32,
) -> Vec<f32> {
    let mut out = vals[range.start * width..range.end * width].to_vec();
    out.extend(std::iter::repeat_n(fill, pad * width));
    out
}

/// Forward then backward (from the rank's own forward) on every rank of a hand-built group.
#[allow(clippy::type_complexity)]
fn run_group(
    ranks: &[RankInputs],
    opts: &Options,
) -> Vec<(
    cce_core::Result<cce_reference::vocab_parallel::RankForward>,
    Option<cce_core::Result<cce_reference::vocab_parallel::RankBackward>>,
)> {
    ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        let driver = RankDriver::from_shard(comm, r.shard);
        let fwd = driver.forward(&inputs, opts);
        let ones = per_row_ones(&r.targets);
        let bwd = match &fwd {
            Ok(f) => Some(driver.backward(&inputs, opts, f.output.saved(), &upstream(opts, &ones))),
            Err(_) => None,
        };
        (fwd, bwd)
    })
}

/// `[N]` ones, the per-row `d_loss` of `Reduction::None`.
fn per_row_ones(targets: &HostTensor) -> HostTensor {
    t32(
        vec![targets.numel()],
        &vec![1.0; targets.numel()],
        DType::F32,
    )
}

/// `d_loss = 1` (per row of ones for `Reduction::None`).
fn upstream<'a>(opts: &Options, ones: &'a HostTensor) -> Upstream<'a, HostTensor> {
    Upstream {
        d_loss: if opts.reduction == Reduction::None {
            DLoss::PerRow(ones)
        } else {
            DLoss::Scalar(1.0)
        },
        d_lse: None,
    }
}

/// A small problem: `e` `[n, d]`, `c` `[v, d]`, `bias` `[v]` as f32 values.
fn small_problem(n: usize, d: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let case = common::random_case(&mut rng, n, d, v, true, 0.0, 0.8);
    let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    (f(&case.e), f(&case.c), f(case.bias.as_ref().unwrap()))
}

/// The whole problem, before it is split over ranks.
struct Whole<'a> {
    v: usize,
    d: usize,
    c: &'a [f32],
    bias: &'a [f32],
    e: &'a HostTensor,
    targets: &'a HostTensor,
}

/// Split `c` and `bias` over `ranges` (padding past `v` filled with `fill`).
fn split(w: &Whole, ranges: &[std::ops::Range<usize>], fill: f32) -> Vec<RankInputs> {
    let (v, d) = (w.v, w.d);
    ranges
        .iter()
        .map(|r| {
            let real = r.start.min(v)..r.end.min(v);
            let pad = r.len() - real.len();
            RankInputs {
                shard: VocabShard::new(v, r.start, r.end).unwrap(),
                e: w.e.clone(),
                c: t32(
                    vec![r.len(), d],
                    &rows_of(w.c, d, real.clone(), pad, fill),
                    DType::F32,
                ),
                bias: Some(t32(
                    vec![r.len()],
                    &rows_of(w.bias, 1, real, pad, fill),
                    DType::F32,
                )),
                targets: w.targets.clone(),
            }
        })
        .collect()
}

/// The largest magnitude in `xs` (0 for an empty slice).
fn max_abs(xs: &[f64]) -> f64 {
    xs.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

#[test]
fn padding_never_matches_an_ignored_target_or_a_sentinel() {
    let (n, d, v) = (12, 16, 10);
    let (e, c, bias) = small_problem(n, d, v, common::seeded().random());
    let e_t = t32(vec![n, d], &e, DType::F32);
    let full_c = t32(vec![v, d], &c, DType::F32);
    let full_bias = t32(vec![v], &bias, DType::F32);
    // V = 10 over 3 ranks padded to 12: shard 2 holds classes 8, 9 and padding 10, 11.
    let layout = ShardLayout::padded(v, 3, 4).unwrap();
    assert_eq!(layout.padded_vocab_size(), 12);
    let ranges: Vec<_> = layout.shards().iter().map(|s| s.start()..s.end()).collect();
    // ignore_index in the padding (10, 11), at its usual -100, and at -1; huge, NaN padding.
    for ignore_index in [10i64, 11, -100, -1] {
        for fill in [f32::NAN, 1e4, f32::NEG_INFINITY] {
            for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                let targets: Vec<i64> = (0..n)
                    .map(|i| {
                        if i % 3 == 0 {
                            ignore_index
                        } else {
                            ((i * 7) % v) as i64
                        }
                    })
                    .collect();
                let targets = HostTensor::from_i64(targets);
                let opts = Options {
                    ignore_index,
                    reduction,
                    label_smoothing: 0.1,
                    z_loss: 1e-3,
                    ..Options::exact()
                };
                let ranks = split(
                    &Whole {
                        v,
                        d,
                        c: &c,
                        bias: &bias,
                        e: &e_t,
                        targets: &targets,
                    },
                    &ranges,
                    fill,
                );
                let out = run_group(&ranks, &opts);
                let inputs = Inputs {
                    e: &e_t,
                    c: &full_c,
                    bias: Some(&full_bias),
                    targets: &targets,
                };
                let cpu = CpuBackend::new();
                let ones = per_row_ones(&targets);
                let (single, single_b) = cpu
                    .forward_backward(&inputs, &opts, &upstream(&opts, &ones))
                    .unwrap();
                let want = single.loss.to_f64_vec();
                for (rank, (fwd, bwd)) in out.into_iter().enumerate() {
                    let what = format!(
                        "ignore_index {ignore_index}, fill {fill}, {reduction:?}, rank {rank}"
                    );
                    let fwd = fwd.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = fwd.output.loss.to_f64_vec();
                    assert_eq!(got.len(), want.len());
                    for (a, b) in got.iter().zip(&want) {
                        assert!(a.is_finite(), "{what}: loss {a}");
                        assert!(
                            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                            "{what}: {a} vs {b}"
                        );
                    }
                    let bwd = bwd.unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
                    let shard = layout.shard(rank).unwrap();
                    let (dc, db) = (vals(&bwd.d_c), vals(&bwd.d_bias));
                    assert!(
                        dc[shard.real_len() * d..].iter().all(|&x| x == 0.0),
                        "{what}"
                    );
                    assert!(db[shard.real_len()..].iter().all(|&x| x == 0.0), "{what}");
                    assert!(dc.iter().chain(&db).all(|x| x.is_finite()), "{what}");
                    let want_dc = vals(&single_b.d_c);
                    // f32 sums with cancellation: the error floor scales with the
                    // gradient's largest entry, not with each entry.
                    let dc_scale = 0.1 * max_abs(&want_dc);
                    let lo = shard.real_classes().start * d;
                    for (k, x) in dc[..shard.real_len() * d].iter().enumerate() {
                        let y = want_dc[lo + k];
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(dc_scale),
                            "{what}: d_c {x} vs {y}"
                        );
                    }
                    let (de, want_de) = (vals(&bwd.d_e), vals(&single_b.d_e));
                    let de_scale = 0.1 * max_abs(&want_de);
                    for (x, y) in de.iter().zip(&want_de) {
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(de_scale),
                            "{what}: d_e {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_target_in_the_padding_is_out_of_range_on_every_rank() {
    let (n, d, v) = (4, 8, 10);
    let (e, c, bias) = small_problem(n, d, v, 7);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![1, 11, 3, -100]);
    let whole = Whole {
        v,
        d,
        c: &c,
        bias: &bias,
        e: &e_t,
        targets: &targets,
    };
    let ranks = split(&whole, &[0..4, 4..8, 8..12], f32::NAN);
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::TargetOutOfRange {
                    row: 1,
                    value: 11,
                    vocab_size: 10,
                    ..
                })
            ),
            "{fwd:?}"
        );
    }
}

/// The errors of every rank of a group whose rank `r` holds `ranges[r]`, `c` rows to fit.
fn tiling_errors(v: usize, ranges: &[std::ops::Range<usize>], shard_v: &[usize]) -> Vec<CceError> {
    let (n, d) = (3, 4);
    let (e, c, bias) = small_problem(n, d, v + 4, 3);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![0, 1, 2]);
    let mut ranks = split(
        &Whole {
            v: v + 4,
            d,
            c: &c,
            bias: &bias,
            e: &e_t,
            targets: &targets,
        },
        ranges,
        0.0,
    );
    for (r, s) in ranks.iter_mut().zip(shard_v) {
        r.shard = VocabShard::new(*s, r.shard.start(), r.shard.end()).unwrap();
    }
    run_group(&ranks, &Options::default())
        .into_iter()
        .map(|(f, _)| f.unwrap_err())
        .collect()
}

/// Asserts that every rank of [`tiling_errors`] (vocabulary 10) fails with a
/// `VocabParallel` error matching `$pat`.
macro_rules! assert_tiling_error {
    ($ranges:expr, $vs:expr, $pat:pat) => {
        for err in tiling_errors(10, &$ranges, &$vs) {
            assert!(
                matches!(&err, CceError::VocabParallel($pat)),
                "{:?}: {err:?}",
                $ranges
            );
        }
    };
}

#[test]
fn shards_that_do_not_tile_are_typed_errors_on_every_rank() {
    use VocabParallelError as E;
    assert_tiling_error!(
        [0..4, 5..10],
        [10, 10],
        E::Gap {
            shard: 1,
            expected_start: 4,
            start: 5
        }
    );
    assert_tiling_error!([1..4, 4..10], [10, 10], E::Gap { shard: 0, .. });
    assert_tiling_error!(
        [0..6, 4..10],
        [10, 10],
        E::Overlap {
            shard: 1,
            previous_end: 6,
            start: 4
        }
    );
    assert_tiling_error!([5..10, 0..5], [10, 10], E::OutOfOrder { shard: 1, .. });
    assert_tiling_error!(
        [0..4, 4..9],
        [10, 10],
        E::DoesNotCover {
            vocab_size: 10,
            covered_end: 9
        }
    );
    assert_tiling_error!(
        [0..4, 4..11],
        [10, 11],
        E::VocabSizeMismatch { shard: 1, .. }
    );
}

#[test]
fn a_layout_for_another_group_size_is_a_typed_error() {
    let layout = ShardLayout::even(10, 3).unwrap();
    let out = ThreadComm::run(2, |comm| RankDriver::new(comm, &layout).map(|d| d.shard()));
    for r in out {
        assert!(
            matches!(
                r,
                Err(CceError::VocabParallel(VocabParallelError::RankCount {
                    ranks: 2,
                    shards: 3
                }))
            ),
            "{r:?}"
        );
    }
}

/// A 3-rank group over `V = 10` (shards 0..4, 4..7, 7..10) with `edit` applied to its inputs.
fn edited_group(edit: impl Fn(&mut [RankInputs])) -> Vec<RankInputs> {
    let (n, d, v) = (5, 6, 10);
    let (e, c, bias) = small_problem(n, d, v, 11);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![0, 9, 5, -100, 3]);
    let mut ranks = split(
        &Whole {
            v,
            d,
            c: &c,
            bias: &bias,
            e: &e_t,
            targets: &targets,
        },
        &[0..4, 4..7, 7..10],
        0.0,
    );
    edit(&mut ranks);
    ranks
}

/// Rank `bad`'s forward error satisfies `own`; every other rank reports `PeerFailed([bad])`.
fn one_rank_fails(ranks: &[RankInputs], bad: usize, own: impl Fn(&CceError) -> bool) {
    for (rank, (fwd, _)) in run_group(ranks, &Options::default())
        .into_iter()
        .enumerate()
    {
        let err = fwd.unwrap_err();
        if rank == bad {
            assert!(own(&err), "rank {rank}: {err:?}");
        } else {
            assert!(
                matches!(&err, CceError::VocabParallel(VocabParallelError::PeerFailed { ranks }) if ranks == &[bad]),
                "rank {rank}: {err:?}"
            );
        }
    }
}

#[test]
fn a_shard_of_the_wrong_shape_fails_its_rank_and_stops_the_others() {
    let ranks = edited_group(|r| r[1].c = t32(vec![4, 6], &[0.5; 24], DType::F32));
    one_rank_fails(&ranks, 1, |e| {
        matches!(
            e,
            CceError::ShapeMismatch {
                what: "c (rows of the shard)",
                ..
            }
        )
    });
    let ranks = edited_group(|r| r[2].bias = Some(t32(vec![2], &[0.5; 2], DType::F32)));
    one_rank_fails(&ranks, 2, |e| {
        matches!(e, CceError::ShapeMismatch { what: "bias", .. })
    });
    let ranks = edited_group(|r| r[0].c = t32(vec![4, 5], &[0.5; 20], DType::F32));
    one_rank_fails(&ranks, 0, |e| matches!(e, CceError::ShapeMismatch { .. }));
}

#[test]
fn a_non_finite_shard_is_named_with_its_global_index() {
    let ranks = edited_group(|r| {
        let mut c = r[2].c.to_f32_vec();
        c[6 + 4] = f32::INFINITY; // row 1 of shard [7, 10): class 8, column 4
        r[2].c = t32(vec![3, 6], &c, DType::F32);
    });
    one_rank_fails(&ranks, 2, |e| {
        matches!(
            e,
            CceError::NonFinite {
                what: "c",
                index: 52,
                row: 8,
                ..
            }
        )
    });
    let ranks = edited_group(|r| {
        r[1].bias = Some(t32(vec![3], &[0.0, f32::NAN, 0.0], DType::F32));
    });
    one_rank_fails(&ranks, 1, |e| {
        matches!(
            e,
            CceError::NonFinite {
                what: "bias",
                index: 5,
                ..
            }
        )
    });
}

#[test]
fn ranks_with_different_replicated_inputs_are_typed_errors() {
    let ranks = edited_group(|r| r[1].targets = HostTensor::from_i64(vec![0, 9, 5, -100, 4]));
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::VocabParallel(
                    VocabParallelError::ReplicaMismatch {
                        what: "targets",
                        ..
                    }
                ))
            ),
            "{fwd:?}"
        );
    }
    // Another N on one rank: the collective's lengths differ; an error, never a hang.
    let ranks = edited_group(|r| {
        r[2].e = t32(vec![4, 6], &[0.25; 24], DType::F32);
        r[2].targets = HostTensor::from_i64(vec![0, 9, 5, -100]);
    });
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::VocabParallel(
                    VocabParallelError::CollectiveMismatch { .. }
                ))
            ),
            "{fwd:?}"
        );
    }
}

#[test]
fn a_masked_target_is_reported_by_every_rank() {
    // Row 1's target is 9, in shard [7, 10), masked by its bias.
    let ranks = edited_group(|r| {
        r[2].bias = Some(t32(vec![3], &[0.0, 0.0, f32::NEG_INFINITY], DType::F32));
    });
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(fwd, Err(CceError::TargetMasked { row: 1, target: 9 })),
            "{fwd:?}"
        );
    }
}

#[test]
fn bad_saved_or_upstream_buffers_are_errors_on_every_rank() {
    let ranks = edited_group(|_| {});
    let opts = Options::default();
    let out = ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        let driver = RankDriver::from_shard(comm, r.shard);
        let short = t32(vec![4], &[0.0; 4], DType::F32);
        let saved = Saved {
            lse: &short,
            rest_mass: &short,
        };
        let bad_lse = driver.backward(&inputs, &opts, saved, &Upstream::<HostTensor>::default());
        let fwd = driver.forward(&inputs, &opts).unwrap();
        let per_row = t32(vec![5], &[1.0; 5], DType::F32);
        let upstream = Upstream {
            d_loss: DLoss::PerRow(&per_row),
            d_lse: None,
        };
        let bad_dloss = driver.backward(&inputs, &opts, fwd.output.saved(), &upstream);
        let nan = Upstream::<HostTensor> {
            d_loss: DLoss::Scalar(f32::NAN),
            d_lse: None,
        };
        let nan_dloss = driver.backward(&inputs, &opts, fwd.output.saved(), &nan);
        (bad_lse, bad_dloss, nan_dloss)
    });
    for (bad_lse, bad_dloss, nan_dloss) in out {
        assert!(
            matches!(bad_lse, Err(CceError::ShapeMismatch { what: "lse", .. })),
            "{bad_lse:?}"
        );
        assert!(
            matches!(
                bad_dloss,
                Err(CceError::ShapeMismatch { what: "d_loss", .. })
            ),
            "{bad_dloss:?}"
        );
        assert!(
            matches!(nan_dloss, Err(CceError::NonFinite { what: "d_loss", .. })),
            "{nan_dloss:?}"
        );
    }
}

#[test]
fn a_rank_that_stops_early_never_hangs_the_group() {
    let ranks = edited_group(|_| {});
    let out = ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        if comm.rank() == 1 {
            return None;
        }
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        Some(RankDriver::from_shard(comm, r.shard).forward(&inputs, &Options::default()))
    });
    for r in out.into_iter().flatten() {
        assert!(
            matches!(
                r,
                Err(CceError::VocabParallel(VocabParallelError::PeerLost {
                    rank: 1
                }))
            ),
            "{r:?}"
        );
    }
}
