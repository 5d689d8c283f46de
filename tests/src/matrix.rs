//! The case matrix (MATH.md "How results are judged", CASES.md `ci-*`): one function per check,
//! each returning its cases. Sizes are fixed and small except where a function takes the
//! configuration (those are cut to `max_work_flop`).

use crate::case::{Api, Case, Ignored};
use crate::config::SuiteConfig;
use crate::data::Dist;
use cce_core::options::{FilterEps, GradDType, Reduction, SideOutputs};
use cce_core::{DType, TileShape};

/// Every input dtype.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The hostile shapes `(N, D, V, bias)`: sizes 1, off every tile multiple (252 x 123 x 507),
/// `V mod 128` in {1, 126, 127} (small and past 1024), `D > 256` with bias, a single row
/// against a large `V`, `N ≫ V`, `V = 2`.
pub const HOSTILE_SHAPES: [(usize, usize, usize, bool); 15] = [
    (1, 1, 1, false),
    (1, 1, 1, true),
    (252, 123, 507, true),
    (252, 123, 507, false),
    (3, 5, 129, true),
    (37, 64, 254, false),
    (65, 33, 383, true),
    (17, 96, 1025, true),
    (17, 96, 1150, false),
    (17, 96, 1151, true),
    (64, 300, 257, true),
    (9, 513, 130, true),
    (1, 64, 4099, false),
    (600, 16, 3, true),
    (5, 7, 2, false),
];

/// Every hostile shape in every dtype, exact mode (peaked and flat data alternating), plus each
/// shape once in default filtered mode on peaked data (dtype rotating).
pub fn hostile_shapes() -> Vec<Case> {
    let mut cases = Vec::new();
    for (k, &(n, d, v, bias)) in HOSTILE_SHAPES.iter().enumerate() {
        let dist = if k % 2 == 0 { Dist::Peaked } else { Dist::Flat };
        for dt in DTYPES {
            cases.push(Case::new("hostile", n, d, v, dt).bias(bias).dist(dist));
        }
        cases.push(
            Case::new("hostile", n, d, v, DTYPES[k % 3])
                .bias(bias)
                .filtered(),
        );
    }
    cases
}

/// Shapes around the backend's own tile (`limits().tile`): one tile + 1 in rows, classes and
/// depth; exactly one tile; one tile − 1; two tiles + 1 with bias. Every dtype; exact and
/// filtered alternating.
pub fn one_tile_plus_one(tile: TileShape, cfg: &SuiteConfig) -> Vec<Case> {
    let (r, c, k) = (tile.rows.max(1), tile.classes.max(1), tile.depth.max(1));
    let shapes = [
        (r + 1, k + 1, c + 1, false),
        (r, k, c, true),
        ((r - 1).max(1), (k - 1).max(1), (c - 1).max(1), false),
        (2 * r + 1, k, 2 * c + 1, true),
    ];
    let mut cases = Vec::new();
    for (s, &(n, d, v, bias)) in shapes.iter().enumerate() {
        for (t, dt) in DTYPES.into_iter().enumerate() {
            let case = Case::new("tile+1", n, d, v, dt).bias(bias);
            let case = if (s + t) % 2 == 1 {
                case.filtered()
            } else {
                case
            };
            cases.push(case.fit_work(cfg.max_work_flop));
        }
    }
    cases
}

/// Every reduction (none with random per-row `d_loss` of both signs) in every dtype, 20% of
/// rows ignored, with bias; exact, and filtered on f32 and bf16.
pub fn reductions() -> Vec<Case> {
    let mut cases = Vec::new();
    for red in [Reduction::None, Reduction::Mean, Reduction::Sum] {
        for dt in DTYPES {
            cases.push(
                Case::new("reduction", 96, 64, 300, dt)
                    .bias(true)
                    .ignored(Ignored::Fraction(0.2))
                    .with(|o| o.reduction = red),
            );
        }
        for dt in [DType::F32, DType::BF16] {
            cases.push(
                Case::new("reduction", 96, 64, 300, dt)
                    .ignored(Ignored::Fraction(0.2))
                    .with(|o| o.reduction = red)
                    .filtered(),
            );
        }
    }
    cases
}

/// Ignored rows: all rows ignored under every reduction (exact and filtered; with and without
/// an lse upstream gradient): under mean the call must fail with
/// `CceError::AllTargetsIgnored`, under sum and none the loss and gradients are exact zeros
/// (but for the lse upstream's part); every row dropped by a shift equal to `seq_len` (mean:
/// the same error, with i32 targets; none: zeros); 20% ignored with a custom `ignore_index`
/// of -1 and i32 targets, and an `ignore_index` that is itself a valid class (5).
pub fn ignored_rows() -> Vec<Case> {
    let mut cases = Vec::new();
    for (k, red) in [Reduction::None, Reduction::Mean, Reduction::Sum]
        .into_iter()
        .enumerate()
    {
        let dt = DTYPES[k];
        cases.push(
            Case::new("all-ignored", 40, 32, 130, dt)
                .bias(true)
                .ignored(Ignored::All)
                .with(|o| o.reduction = red),
        );
        cases.push(
            Case::new("all-ignored", 40, 32, 130, DTYPES[(k + 1) % 3])
                .ignored(Ignored::All)
                .with(|o| o.reduction = red)
                .filtered(),
        );
        cases.push(
            Case::new("all-ignored+d_lse", 40, 32, 130, DTYPES[(k + 2) % 3])
                .bias(true)
                .ignored(Ignored::All)
                .d_lse(true)
                .with(|o| o.reduction = red),
        );
    }
    for (k, red) in [Reduction::Mean, Reduction::None].into_iter().enumerate() {
        let mut c = Case::new("all-ignored by shift=seq_len", 40, 32, 130, DTYPES[k])
            .bias(true)
            .with(|o| {
                o.reduction = red;
                o.shift = 8;
                o.seq_len = Some(8);
            });
        c.targets_i32 = red == Reduction::Mean;
        cases.push(c);
    }
    for dt in DTYPES {
        let mut c = Case::new("ignore_index=-1", 100, 48, 257, dt)
            .ignored(Ignored::Fraction(0.2))
            .with(|o| o.ignore_index = -1);
        c.targets_i32 = true;
        cases.push(c);
        cases.push(
            Case::new("ignore_index=5", 100, 48, 12, dt)
                .dist(Dist::Flat)
                .ignored(Ignored::Fraction(0.2))
                .with(|o| o.ignore_index = 5),
        );
    }
    cases
}

/// Softcap 30 (mild) and 5 (bites: logit std is 16), with bias, every dtype, exact and
/// filtered.
pub fn softcap() -> Vec<Case> {
    let mut cases = Vec::new();
    for s in [30.0f32, 5.0] {
        for dt in DTYPES {
            let base = Case::new("softcap", 80, 96, 509, dt)
                .bias(true)
                .with(|o| o.softcap = Some(s));
            cases.push(base.clone());
            cases.push(base.filtered());
        }
    }
    cases
}

/// Label smoothing 0.1 with and without softcap (the dense term is rank-1 only without it),
/// every dtype, exact and filtered, 20% ignored.
pub fn label_smoothing() -> Vec<Case> {
    let mut cases = Vec::new();
    for cap in [None, Some(5.0f32)] {
        for dt in DTYPES {
            let base = Case::new("label-smoothing", 72, 80, 300, dt)
                .bias(cap.is_some())
                .ignored(Ignored::Fraction(0.2))
                .with(|o| {
                    o.label_smoothing = 0.1;
                    o.softcap = cap;
                });
            cases.push(base.clone());
            cases.push(base.filtered());
        }
    }
    cases
}

/// z-loss weights 1e-4 and 1e-2 (`2λ·lse` of order 1 at peaked logits), every dtype, exact and
/// filtered, sum and mean.
pub fn z_loss() -> Vec<Case> {
    let mut cases = Vec::new();
    for (lam, red) in [(1e-4f32, Reduction::Mean), (1e-2, Reduction::Sum)] {
        for dt in DTYPES {
            let base = Case::new("z-loss", 64, 64, 300, dt).with(|o| {
                o.z_loss = lam;
                o.reduction = red;
            });
            cases.push(base.clone());
            cases.push(base.filtered());
        }
    }
    cases
}

/// Shift 1 with an explicit `seq_len` (N = 4 x 21), and shift 2 with `e` given as
/// `[B, T, D]` (seq_len from T), 10% ignored, every dtype, exact and filtered.
pub fn shift() -> Vec<Case> {
    let mut cases = Vec::new();
    for dt in DTYPES {
        let a = Case::new("shift", 84, 40, 257, dt)
            .ignored(Ignored::Fraction(0.1))
            .with(|o| {
                o.shift = 1;
                o.seq_len = Some(21);
            });
        cases.push(a.clone());
        cases.push(a.filtered());
        let mut b = Case::new("shift-3d", 84, 40, 257, dt)
            .bias(true)
            .ignored(Ignored::Fraction(0.1))
            .with(|o| {
                o.shift = 2;
                o.reduction = Reduction::None;
            });
        b.batch = Some(4);
        cases.push(b);
    }
    cases
}

/// An upstream gradient of the lse (`h_i`), with mean and none reductions, every dtype, exact
/// and filtered.
pub fn d_lse_upstream() -> Vec<Case> {
    let mut cases = Vec::new();
    for red in [Reduction::Mean, Reduction::None] {
        for dt in DTYPES {
            let base = Case::new("d_lse", 64, 64, 300, dt)
                .bias(true)
                .d_lse(true)
                .ignored(Ignored::Fraction(0.2))
                .with(|o| o.reduction = red);
            cases.push(base.clone());
            cases.push(base.filtered());
        }
    }
    cases
}

/// Side outputs (entropy and argmax) on peaked, flat and iid data, one with softcap, every
/// dtype, through forward-only and fused calls.
pub fn side_outputs() -> Vec<Case> {
    let mut cases = Vec::new();
    let both = SideOutputs {
        entropy: true,
        argmax: true,
    };
    for dt in DTYPES {
        for (dist, cap, api) in [
            (Dist::Peaked, None, Api::ForwardOnly),
            (Dist::Flat, None, Api::Fused),
            (Dist::Iid, Some(5.0f32), Api::ForwardOnly),
        ] {
            cases.push(
                Case::new("side-outputs", 70, 64, 513, dt)
                    .dist(dist)
                    .bias(true)
                    .api(api)
                    .with(|o| {
                        o.side_outputs = both;
                        o.softcap = cap;
                    }),
            );
        }
        cases.push(
            Case::new("entropy-only", 33, 16, 130, dt).with(|o| o.side_outputs.entropy = true),
        );
    }
    cases
}

/// Realistic and extreme softmax shapes: peaked, flat, iid (2.5 nats) and lm, every dtype, in
/// exact mode (192 x 128 x 2000, cut to `max_work_flop`).
pub fn distributions(cfg: &SuiteConfig) -> Vec<Case> {
    let mut cases = Vec::new();
    for dist in [Dist::Peaked, Dist::Flat, Dist::Iid, Dist::Lm] {
        for dt in DTYPES {
            cases.push(
                Case::new("distribution", 192, 128, 2000, dt)
                    .dist(dist)
                    .bias(dist == Dist::Lm)
                    .fit_work(cfg.max_work_flop),
            );
        }
    }
    cases
}

/// The default filtered mode on every distribution and dtype, plus filter variants: only one
/// of `d_e` / `d_c` filtered, an aggressive explicit `filter_eps` with a loose bound, a tight
/// bound, and `max_dropped_mass = 0` (filter off). The error must be explained by the reported
/// dropped mass.
pub fn filtered_mode(cfg: &SuiteConfig) -> Vec<Case> {
    let mut cases = Vec::new();
    for dist in [Dist::Peaked, Dist::Flat, Dist::Iid, Dist::Lm] {
        for dt in DTYPES {
            cases.push(
                Case::new("filtered", 128, 128, 2000, dt)
                    .dist(dist)
                    .bias(dist != Dist::Flat)
                    .ignored(Ignored::Fraction(0.1))
                    .filtered()
                    .fit_work(cfg.max_work_flop),
            );
        }
    }
    type Edit = fn(&mut cce_core::Options);
    let variants: [(&str, Edit); 5] = [
        ("filter d_e only", |o| o.filter_c_grad = false),
        ("filter d_c only", |o| o.filter_e_grad = false),
        ("aggressive eps", |o| {
            o.filter_eps = FilterEps::Value(1e-2);
            o.max_dropped_mass = 2e-2;
        }),
        ("tight bound", |o| {
            o.filter_eps = FilterEps::Value(1e-3);
            o.max_dropped_mass = 1e-5;
        }),
        ("max_dropped_mass=0", |o| o.max_dropped_mass = 0.0),
    ];
    // Few rows against a large vocabulary: even a tile-granular filter skips here (most class
    // tiles hold neither a target nor a significant probability), so the dropped-mass bound
    // and the error explanation are exercised on every backend.
    for (k, (n, dist)) in [
        (1usize, Dist::Peaked),
        (3, Dist::Lm),
        (8, Dist::Peaked),
        (5, Dist::Iid),
    ]
    .into_iter()
    .enumerate()
    {
        for dt in DTYPES {
            let base = Case::new("sparse rows", n, 64, 8191, dt)
                .dist(dist)
                .bias(k % 2 == 0)
                .filtered();
            cases.push(base.clone());
            cases.push(Case {
                label: "sparse rows, aggressive eps".into(),
                ..base.with(|o| {
                    o.filter_eps = FilterEps::Value(1e-2);
                    o.max_dropped_mass = 5e-2;
                })
            });
        }
    }
    for (k, (label, f)) in variants.into_iter().enumerate() {
        for dist in [Dist::Iid, Dist::Lm] {
            cases.push(
                Case::new(label, 128, 96, 1500, DTYPES[k % 3])
                    .dist(dist)
                    .bias(true)
                    .filtered()
                    .with(f)
                    .fit_work(cfg.max_work_flop),
            );
        }
    }
    cases
}

/// The entry points and output options: forward then backward with the forward's lse,
/// forward only, `compute_d_e = false`, `compute_d_c = false`, f32 gradients, i32 targets;
/// every dtype.
pub fn api_paths() -> Vec<Case> {
    let mut cases = Vec::new();
    for dt in DTYPES {
        let base = Case::new("api", 50, 40, 300, dt)
            .bias(true)
            .ignored(Ignored::Fraction(0.2));
        cases.push(base.clone().api(Api::Separate));
        cases.push(base.clone().api(Api::Separate).filtered());
        cases.push(base.clone().api(Api::ForwardOnly));
        cases.push(base.clone().with(|o| o.compute_d_e = false));
        cases.push(base.clone().with(|o| o.compute_d_c = false));
        cases.push(base.clone().with(|o| o.grad_dtype = GradDType::F32));
        let mut i32t = base.clone().filtered();
        i32t.targets_i32 = true;
        cases.push(i32t);
    }
    cases
}

/// Cases run twice with `deterministic = true` (results must be bitwise equal), every dtype,
/// exact and filtered.
pub fn deterministic() -> Vec<Case> {
    let mut cases = Vec::new();
    for dt in DTYPES {
        let base = Case::new("deterministic", 130, 72, 700, dt)
            .bias(true)
            .dist(Dist::Iid)
            .with(|o| o.deterministic = true);
        cases.push(base.clone());
        cases.push(base.filtered());
    }
    cases
}
