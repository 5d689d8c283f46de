//! The wide tiles (128 x 128, 16 x 16 threads) and the cooperative-matrix forwards and backward
//! products against the f64 oracle, on whatever the adapter runs (part of the `conformance` test
//! binary; the cases run through its `run_all`).

use super::*;

/// The panel depths the adapter runs at 128 x 128 tiles of 16 x 16 threads (`wg` 16) with
/// the named main loop: 8 everywhere (16 KiB of panels; the threshold pass, whose 128 x 65
/// histogram does not fit beside them, at its own shape), 16 where the backward's 32 KiB of
/// panels and 24 bytes of flags fit (48 KiB devices; lavapipe has 32 KiB: a typed
/// `ResourceLimit`, checked here).
fn wide_depths(b: &WgpuBackend) -> Vec<u32> {
    let mut tks = Vec::new();
    for tk in [8, 16] {
        let cfg = cce_wgpu::KernelConfig {
            wg: 16,
            tk,
            main_loop: cce_wgpu::MainLoop::Named,
            ..b.config()
        };
        match b.with_config(cfg) {
            Ok(_) => tks.push(tk),
            Err(CceError::ResourceLimit { .. }) if tk > 8 => {
                println!(
                    "16:{tk} refused on {}: too little workgroup memory",
                    b.adapter_info().name
                )
            }
            Err(e) => panic!("16:{tk}: {e}"),
        }
    }
    assert!(tks.contains(&8), "16:8 must run: {tks:?}");
    tks
}

/// `cases` at 128 x 128 tiles (`wg` 16, named main loop) for every depth of [`wide_depths`].
fn wide(b: &WgpuBackend, cases: Vec<Case>) -> Vec<Case> {
    wide_depths(b)
        .into_iter()
        .flat_map(|tk| {
            cases.clone().into_iter().map(move |c| {
                c.with(|c| {
                    c.wg = Some(16);
                    c.tk = Some(tk);
                    c.main_loop = Some(cce_wgpu::MainLoop::Named);
                })
            })
        })
        .collect()
}

/// Hostile shapes at 128 x 128 tiles: one tile plus one, odd D, the three dtypes with bias,
/// long loops in one workgroup.
fn wide_cases() -> Vec<Case> {
    vec![
        Case::new("1x1x1", 1, 1, 1, F32),
        Case::new("252x123x507 f32 bias", 252, 123, 507, F32).with(|c| c.bias = true),
        Case::new("252x123x507 f16 bias", 252, 123, 507, F16).with(|c| c.bias = true),
        Case::new("252x123x507 bf16 bias", 252, 123, 507, BF16).with(|c| c.bias = true),
        Case::new("one tile + 1", 129, 40, 129, F32),
        Case::new("V mod 128 = 127", 33, 19, 255, BF16),
        Case::new("D > 256 with bias", 70, 300, 150, F16).with(|c| c.bias = true),
        Case::new("D = 264, 3-D e", 132, 264, 300, BF16).with(|c| c.seq = Some(12)),
        Case::new("long loops, 1 workgroup", 64, 64, 24000, F32).with(|c| {
            c.workgroups = Some(1);
            c.opts.label_smoothing = 0.1;
        }),
    ]
}

#[test]
fn wide_tiles_hostile_shapes() {
    // wg 16 (128 x 128 tiles, 256 threads): forward and backward with the device's default
    // backward sums (f32 atomics where it has them).
    let Some(b) = backend() else { return };
    run_all(&wide(b, wide_cases()));
}

#[test]
fn wide_tiles_deterministic_and_atomic_sums() {
    // wg 16: per-split slabs (deterministic calls) and f32 atomics at 64 target workgroups,
    // scattered and coalesced through subgroup shuffles (row groups of 8 lanes in 16-wide
    // rows of threads).
    let Some(b) = backend() else { return };
    // f32 and bf16 (f16's staging is bf16's but for the decode), one tile plus one.
    let base: Vec<Case> = [1, 3, 4].iter().map(|&i| wide_cases()[i].clone()).collect();
    let det = base
        .iter()
        .map(|c| c.clone().with(|c| c.opts.deterministic = true));
    let atomics = [true, false].into_iter().flat_map(|co| {
        base.iter().map(move |c| {
            c.clone().with(|c| {
                c.workgroups = Some(64);
                c.opts.deterministic = false;
                c.coalesced = Some(co);
            })
        })
    });
    run_all(&wide(b, det.chain(atomics).collect()));
}

#[test]
fn wide_tiles_filtered_mode() {
    // wg 16 with the filter: the threshold pass at its own 64 x 64 tiles, the backward's
    // skipped 128 x 128 tiles and dropped mass.
    let Some(b) = backend() else { return };
    // Chunked plans at a budget that holds one-tile chunks of 128 rows.
    let cases = filtered_cases()
        .into_iter()
        .map(|c| {
            c.with(|c| c.opts.workspace_budget_bytes = c.opts.workspace_budget_bytes.max(128 << 10))
        })
        .collect();
    run_all(&wide(b, cases));
}

/// f16 cases for the cooperative-matrix forwards: more than one 128 x 128 tile each way, D a
/// multiple of 8 (whole-vector panel reads) with a partial last panel, and D not (element
/// reads), bias and softcap; many class tiles per split (the running row states extended
/// tile after tile), a bias of −20 outside the first classes with ignored rows.
fn coop_cases() -> Vec<Case> {
    vec![
        Case::new("coop 300x200x700 f16", 300, 200, 700, F16),
        Case::new("coop 129x32x257 f16 bias", 129, 32, 257, F16).with(|c| c.bias = true),
        Case::new("coop 257x77x385 f16 softcap", 257, 77, 385, F16)
            .with(|c| c.opts.softcap = Some(4.0)),
        Case::new("coop 200x64x1100 f16, 2 workgroups", 200, 64, 1100, F16)
            .with(|c| c.workgroups = Some(2)),
        Case::new(
            "coop 150x48x600 f16 hot classes, ignored",
            150,
            48,
            600,
            F16,
        )
        .with(|c| {
            c.bias = true;
            c.hot_classes = Some(40);
            c.ignore_frac = 0.1;
        }),
    ]
}

#[test]
fn coop_forwards_64_and_128() {
    // Where the adapter runs cooperative matrices (the `coop-matrix` build on a capable GPU),
    // each f16 case through the three forwards (64 x 64, 128 x 128, 128 x 128 with 64 x 64
    // per subgroup); elsewhere (lavapipe) the FMA forward runs them, so the cases run once.
    let Some(b) = backend() else { return };
    let coop = b.adapter_report().contains("coop64 true");
    let tiles: &[cce_wgpu::CoopTile] = if coop {
        &[
            cce_wgpu::CoopTile::T64,
            cce_wgpu::CoopTile::T128,
            cce_wgpu::CoopTile::T128W,
            cce_wgpu::CoopTile::T128W16,
        ]
    } else {
        &[cce_wgpu::CoopTile::T128]
    };
    let cases: Vec<Case> = tiles
        .iter()
        .flat_map(|&t| {
            coop_cases()
                .into_iter()
                .chain(hostile_cases().into_iter().filter(|c| c.dtype == F16))
                .map(move |c| c.with(|c| c.coop_tile = Some(t)))
        })
        .collect();
    run_all(&cases);
}

/// f16 cases for the cooperative-matrix backward (`KernelConfig::coop_backward`): the
/// forwards' coop cases and the hostile f16 shapes, every reduction (per-row `d_loss` for
/// none), an upstream `d_lse`, ignored rows, label smoothing and z-loss, a bias of −20 outside
/// hot classes (tiles of tiny G: the power-of-two scale), D = 300 (three slices of 128, the
/// last partial) and more than one 128 x 128 tile each way.
fn coop_backward_cases() -> Vec<Case> {
    let more = vec![
        Case::new("coopb 260x300x390 f16 sum", 260, 300, 390, F16)
            .with(|c| c.opts.reduction = Reduction::Sum),
        Case::new("coopb 140x40x300 f16 none, d_lse", 140, 40, 300, F16).with(|c| {
            c.opts.reduction = Reduction::None;
            c.d_lse = true;
        }),
        Case::new("coopb 200x72x520 f16 ls, z, ignored", 200, 72, 520, F16).with(|c| {
            c.opts.label_smoothing = 0.1;
            c.opts.z_loss = 1e-3;
            c.ignore_frac = 0.2;
            c.bias = true;
        }),
        Case::new("coopb 130x24x900 f16 hot, softcap", 130, 24, 900, F16).with(|c| {
            c.bias = true;
            c.hot_classes = Some(20);
            c.opts.softcap = Some(5.0);
        }),
    ];
    coop_cases()
        .into_iter()
        .chain(hostile_cases().into_iter().filter(|c| c.dtype == F16))
        .chain(more)
        .collect()
}

#[test]
fn coop_backward_products() {
    // Where the adapter runs cooperative matrices, the f16 backward's d_e and d_c passes by
    // them (128 x 128 tiles, f16 G), through both sums of the splits: f32 atomics into one
    // slab (calls that are not deterministic, where the device has them) and per-split slabs
    // (deterministic calls), each judged against the f64 oracle; elsewhere (lavapipe) the FMA
    // backward runs the same cases. A filtered call keeps the FMA backward (run once).
    let cases: Vec<Case> = coop_backward_cases()
        .into_iter()
        .flat_map(|c| [false, true].map(|det| c.clone().with(|c| c.opts.deterministic = det)))
        .map(|c| c.with(|c| c.coop_backward = Some(true)))
        .chain([
            Case::new("coopb 150x48x600 f16 filtered", 150, 48, 600, F16).with(|c| {
                c.opts = Options {
                    side_outputs: c.opts.side_outputs,
                    ..Options::default()
                };
                c.bias = true;
                c.hot_classes = Some(40);
                c.coop_backward = Some(true);
            }),
        ])
        .collect();
    run_all(&cases);
}
