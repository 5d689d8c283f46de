//! The plan's tests: strategies, chunks, sub-plans and their budgets.

use super::Strategy;

#[test]
fn class_layout_and_d_e_deferral() {
    let sp = SparseBackward::fit(1 << 29, 1 << 29, 32768, 256000, 128, 384).unwrap();
    // randn at the seed keeps ~3 pairs per row, c/8 ~324.
    assert!(sp.defer_d_e(3.0 * 32768.0, 256000));
    assert!(!sp.defer_d_e(324.0 * 32768.0, 256000));
    for v in [1usize, 7, 4095, 4096, 4097, 256000] {
        for pairs in [0usize, 1, 1000] {
            let (counts, starts, lists, end) = SparseBackward::class_layout(pairs, v);
            assert!(counts >= 8 * pairs && starts >= counts + 4 * (v + 2 + v.div_ceil(4096)));
            assert!(lists >= starts + 4 * (v + 1) && end == lists + 4 * v);
            assert!(end <= 16 * pairs + SparseBackward::class_bytes(v) - 8 * pairs);
        }
    }
}
use super::*;
use crate::tensor::HostTensor;
use proptest::prelude::{any, prop, prop_assert, proptest, ProptestConfig};

fn problem(n: usize, d: usize, v: usize, dt: DType) -> Problem {
    Problem {
        n,
        d,
        v,
        dtype: dt,
        has_bias: false,
        seq_len: n,
    }
}

fn gpu_limits(max_buffer: u64, tile: (usize, usize)) -> DeviceLimits {
    DeviceLimits {
        name: "test-gpu".into(),
        max_buffer_bytes: max_buffer,
        max_block_memory_bytes: 48 << 10,
        max_threads_per_block: 256,
        max_grid: [65535, 65535, 65535],
        index_bits: 32,
        tile: TileShape {
            rows: tile.0,
            classes: tile.1,
            depth: 16,
        },
        strategies: vec![StrategyKind::ChunkedDense, StrategyKind::TileOwnership],
        class_forward: false,
    }
}

fn check_invariants(plan: &Plan, limits: &DeviceLimits, budget: u64) {
    let p = &plan.problem;
    // Coverage: every (row, class) pair exactly once; tiles within bounds and shapes.
    let mut count = vec![0u8; p.n * p.v];
    for t in plan.tiles() {
        assert!(t.rows.end <= p.n && t.classes.end <= p.v);
        assert!(!t.rows.is_empty() && !t.classes.is_empty());
        assert!(t.rows.len() <= plan.tile.rows && t.classes.len() <= plan.tile.classes);
        for r in t.rows.clone() {
            for c in t.classes.clone() {
                count[r * p.v + c] += 1;
            }
        }
    }
    assert!(count.iter().all(|&x| x == 1), "coverage");
    assert_eq!(plan.tiles().count() as u64, plan.tile_count());
    // Chunks: ordered, disjoint, covering, tile-aligned starts.
    for (chunks, total, unit) in [
        (&plan.row_chunks, p.n, plan.tile.rows),
        (&plan.class_chunks, p.v, plan.tile.classes),
    ] {
        assert_eq!(chunks.first().unwrap().start, 0);
        assert_eq!(chunks.last().unwrap().end, total);
        for w in chunks.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        for c in chunks.iter() {
            assert_eq!(c.start % unit, 0);
        }
    }
    // Limits: buffers of a chunk fit, indices fit.
    let idx_cap = if limits.index_bits >= 64 {
        u64::MAX
    } else {
        (1u64 << (limits.index_bits - 1)) - 1
    };
    for c in &plan.class_chunks {
        assert!(c.len() as u64 * p.d as u64 * 4 <= limits.max_buffer_bytes);
        assert!((c.len() as u64 * p.d as u64) <= idx_cap);
        assert!(c.len().div_ceil(plan.tile.classes) as u64 <= limits.max_grid[0] as u64);
    }
    for r in &plan.row_chunks {
        assert!(r.len() as u64 * p.d as u64 * 4 <= limits.max_buffer_bytes);
        assert!(r.len().div_ceil(plan.tile.rows) as u64 <= limits.max_grid[1] as u64);
    }
    if let Strategy::ChunkedDense { chunk_rows } = plan.strategy {
        assert!(chunk_rows as u64 * p.v as u64 * 4 <= limits.max_buffer_bytes);
        assert!(chunk_rows as u64 * p.v as u64 <= idx_cap);
        // The chunks are the plan's chunks: the label names the rows a chunk holds.
        assert_eq!(plan.row_chunks[0].len(), chunk_rows);
        assert!(chunk_rows <= p.n);
    }
    if let Strategy::SplitDense {
        chunk_rows,
        chunk_classes,
        ..
    } = plan.strategy
    {
        // The chunks are the plan's chunks, and each buffer of a pass fits one binding.
        assert_eq!(plan.row_chunks[0].len(), chunk_rows);
        assert_eq!(plan.class_chunks[0].len(), chunk_classes);
        assert!(chunk_classes <= SPLIT_DENSE_MAX_CLASSES);
        assert!(chunk_rows as u64 * p.v.div_ceil(8) as u64 * 32 <= limits.max_buffer_bytes);
        assert!(p.n as u64 * chunk_classes.div_ceil(8) as u64 * 32 <= limits.max_buffer_bytes);
    }
    if let Some(sp) = plan.sparse {
        // Split dense's scratch holds the sparse layout; the pairs cover one per row.
        let Strategy::SplitDense { chunk_rows, .. } = plan.strategy else {
            panic!("sparse backward without split dense")
        };
        assert!(sp.probe_rows >= 1 && sp.probe_rows <= p.n);
        assert_eq!(sp.scratch_bytes % 256, 0);
        assert!(sp.max_rows >= sp.probe_rows && sp.max_rows <= chunk_rows.max(sp.probe_rows));
        assert!(sp.capacity(sp.probe_rows, p.v) >= p.n && sp.max_mean_kept >= 1);
        // Every chunk size it may pick keeps the records clear of the logits and the
        // regrouping by class below the records.
        for pairs in [0u64, p.n as u64, 7 * p.n as u64, 1000 * p.n as u64] {
            let rows = sp.rows_after_probe(pairs, p.n, p.v);
            assert!(rows >= sp.probe_rows.min(p.n) && rows <= sp.max_rows.min(p.n));
            let cap = sp.capacity(rows, p.v);
            assert!(
                SparseBackward::logits_bytes(rows, p.v) + 8 * cap <= sp.scratch_bytes || cap == 0
            );
            let (_, _, _, end) = SparseBackward::class_layout(cap, p.v);
            assert!(
                end + 8 * cap <= sp.scratch_bytes || cap == 0,
                "{sp:?} rows {rows} cap {cap}"
            );
        }
        assert!(plan.filter.filter_e_grad && plan.filter.filter_c_grad);
    }
    assert!(
        plan.workspace_bytes <= budget,
        "workspace {} > budget {budget}",
        plan.workspace_bytes
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn plan_invariants_hold(
        n in 1usize..300, d in 1usize..80, v in 1usize..700,
        tr in prop::sample::select(vec![1usize, 16, 64, 128]),
        tc in prop::sample::select(vec![1usize, 32, 64, 128, 256]),
        buf_kib in 4u64..4096, budget_kib in 1u64..(64 << 10),
        dt in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        filter_off in any::<bool>(),
        split in any::<bool>(),
    ) {
        let p = problem(n, d, v, dt);
        let mut limits = gpu_limits(buf_kib << 10, (tr, tc));
        if split {
            limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
        }
        let opts = Options {
            workspace_budget_bytes: budget_kib << 10,
            filter_eps: if filter_off { crate::options::FilterEps::Off } else { crate::options::FilterEps::Auto },
            ..Default::default()
        };
        match Plan::new(&p, &opts, &limits) {
            Ok(plan) => check_invariants(&plan, &limits, opts.workspace_budget_bytes),
            Err(CceError::ResourceLimit { .. }) => {
                // Only a budget or a buffer too small for one tile may refuse.
                let one_tile = (tr.max(tc) * d * 4) as u64 <= limits.max_buffer_bytes;
                let roomy = Options { workspace_budget_bytes: 1 << 40, ..opts.clone() };
                prop_assert!(!one_tile || Plan::new(&p, &roomy, &limits).is_ok());
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

#[test]
fn seed_shape_default_budget_is_tile_ownership_within_budget() {
    let p = problem(32768, 4096, 256000, DType::BF16);
    let limits = gpu_limits(2 << 30, (128, 128));
    let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
    assert_eq!(plan.strategy, Strategy::TileOwnership);
    assert!(plan.workspace_bytes <= 512 << 20);
    // With a budget for the f32 d_c accumulator, chunked dense is chosen.
    let big = Options {
        workspace_budget_bytes: 8 << 30,
        ..Default::default()
    };
    let plan = Plan::new(&p, &big, &limits).unwrap();
    assert!(matches!(plan.strategy, Strategy::ChunkedDense { chunk_rows } if chunk_rows >= 1024));
}

#[test]
fn seed_shape_default_budget_is_split_dense_within_budget() {
    let p = problem(32768, 4096, 256000, DType::BF16);
    let mut limits = gpu_limits(140 << 30, (128, 128));
    limits.strategies = vec![
        StrategyKind::ChunkedDense,
        StrategyKind::SplitDense,
        StrategyKind::TileOwnership,
    ];
    // The CUDA backend's budget: the default 0.5 GiB less its 32 MiB cuBLAS workspace.
    let opts = Options {
        workspace_budget_bytes: (512 << 20) - (32 << 20),
        ..Options::default()
    };
    let plan = Plan::new(&p, &opts, &limits).unwrap();
    let Strategy::SplitDense {
        chunk_rows,
        chunk_classes,
        de_f16,
    } = plan.strategy
    else {
        panic!("{}", plan.reason)
    };
    // 480 MiB: 384 rows of V = 256000 f32 logits (no room for an f16 copy of c); the f16
    // copy of e (256 MiB) and an f32 d_c chunk beside ~1.4k classes of N = 32768.
    assert_eq!(chunk_rows, 384);
    assert!(!de_f16);
    assert!((1280..=1792).contains(&chunk_classes), "{chunk_classes}");
    assert!(plan.workspace_bytes <= opts.workspace_budget_bytes);
    // The sparse backward holds the pairs of c/8 data at the seed shape (324 per row).
    let sp = plan.sparse.expect("sparse backward");
    assert!(sp.capacity(sp.probe_rows, 256000) >= 32768 * 324, "{sp}");
    // randn data (3 pairs per row) gets 384-row chunks, c/8 (324) about as many.
    assert_eq!(sp.rows_after_probe(3 * 128, 32768, 256000), 384);
    assert!(sp.rows_after_probe(324 * 128, 32768, 256000) >= 300);
    assert_eq!(sp.max_mean_kept, 1000);
    assert!(
        plan.reason.starts_with("sparse backward first"),
        "{}",
        plan.reason
    );
    // Exact calls, label smoothing and deterministic mode take no sparse backward.
    for o in [
        Options::exact(),
        Options {
            label_smoothing: 0.1,
            ..Default::default()
        },
        Options {
            deterministic: true,
            ..Default::default()
        },
    ] {
        assert!(Plan::new(&p, &o, &limits).unwrap().sparse.is_none());
    }
    assert!(
        plan.reason.contains("chunked-dense needs"),
        "{}",
        plan.reason
    );
    check_invariants_light(&plan, &limits);
}

#[test]
fn sparse_chunks_leave_room_for_denser_rows_than_the_probe() {
    // A probe of ignored rows (0 pairs) must not size the chunks so large that later rows
    // keeping ~10 entries each overflow (8192 x 4096 x 128256, default budget).
    let p = problem(8192, 4096, 128256, DType::BF16);
    let mut limits = gpu_limits(140 << 30, (128, 128));
    limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
    let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
    let sp = plan.sparse.expect("sparse backward");
    for pairs in [0, 3 * 128] {
        let rows = sp.rows_after_probe(pairs, p.n, p.v);
        assert!(
            sp.capacity(rows, p.v) >= SPARSE_MIN_PAIRS_PER_ROW * p.n,
            "{sp:?}: {rows} rows leave {} pairs",
            sp.capacity(rows, p.v)
        );
    }
}

#[test]
fn small_binding_splits_the_vocabulary() {
    // lavapipe: 128 MiB per binding; c of the seed shape is 2 GiB in bf16.
    let p = problem(4096, 4096, 256000, DType::BF16);
    let limits = gpu_limits(128 << 20, (64, 64));
    let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
    assert!(plan.class_chunks.len() > 1);
    check_invariants_light(&plan, &limits);
}

fn check_invariants_light(plan: &Plan, limits: &DeviceLimits) {
    for c in &plan.class_chunks {
        assert!(c.len() as u64 * plan.problem.d as u64 * 4 <= limits.max_buffer_bytes);
    }
}

#[test]
fn too_small_a_buffer_is_a_resource_error() {
    let p = problem(10, 1 << 20, 10, DType::F32);
    let limits = gpu_limits(1 << 20, (16, 16));
    assert!(matches!(
        Plan::new(&p, &Options::default(), &limits),
        Err(CceError::ResourceLimit { .. })
    ));
    let _ = HostTensor::scalar_f32(0.0);
}

#[test]
fn labels_name_the_rows_and_classes_a_chunk_holds() {
    // A problem shorter than a tile is one chunk of its own rows: `cce run --n 5` printed
    // "chunked-dense(64 rows)" for 5 rows.
    let cpu = DeviceLimits::cpu();
    for (n, v) in [(5, 64), (100, 700), (1024, 49152)] {
        let plan = Plan::new(&problem(n, 16, v, DType::F32), &Options::default(), &cpu).unwrap();
        assert_eq!(plan.strategy, Strategy::ChunkedDense { chunk_rows: n });
        assert_eq!(
            plan.strategy.to_string(),
            format!("chunked-dense({n} rows)")
        );
        assert!(
            plan.reason
                .starts_with(&format!("chunked-dense: {n}-row logits chunk")),
            "{}",
            plan.reason
        );
    }
    // Several chunks: whole tiles, and the label is the first chunk's length.
    let small = Options {
        workspace_budget_bytes: 2 << 20,
        ..Default::default()
    };
    let plan = Plan::new(&problem(1000, 16, 4096, DType::F32), &small, &cpu).unwrap();
    let Strategy::ChunkedDense { chunk_rows } = plan.strategy else {
        panic!("{}", plan.reason)
    };
    assert!(plan.row_chunks.len() > 1 && chunk_rows.is_multiple_of(64));
    assert_eq!(plan.row_chunks[0].len(), chunk_rows);
    assert_eq!(
        plan.strategy.to_string(),
        format!("chunked-dense({chunk_rows} rows)")
    );

    // Split dense clamps its chunks to N and V; its label says so.
    let mut limits = gpu_limits(1 << 30, (64, 64));
    limits.strategies = vec![StrategyKind::SplitDense];
    let plan = Plan::new(
        &problem(5, 16, 100, DType::F32),
        &Options::default(),
        &limits,
    )
    .unwrap();
    assert_eq!(
        plan.strategy.to_string(),
        "split-dense(5-row chunks for d_e, 100-class chunks for d_c)"
    );
    // Tile ownership has no parameters in its label; its reason names the chunks.
    limits.strategies = vec![StrategyKind::TileOwnership];
    let plan = Plan::new(
        &problem(5, 16, 100, DType::F32),
        &Options::default(),
        &limits,
    )
    .unwrap();
    assert_eq!(plan.strategy.to_string(), "tile-ownership");
    assert!(
        plan.reason
            .starts_with("tile-ownership: 1 row chunk(s) of 5, 1 class chunk(s) of 100,"),
        "{}",
        plan.reason
    );
}

#[test]
fn class_forward_takes_all_rows_at_the_seed_shape_and_fits_its_scratch() {
    // Default budget at the seed shape: split dense's scratch holds two 32768-row buffers
    // of at least 1024 classes.
    let p = problem(32768, 4096, 256000, DType::BF16);
    let mut limits = gpu_limits(140 << 30, (128, 128));
    limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
    // A backend without class tiles (here the default test limits) gets none in its plan,
    // and no workspace for them.
    let without = Plan::new(&p, &Options::default(), &limits).unwrap();
    assert!(without.forward.is_none() && !without.reason.contains("forward-only"));
    limits.class_forward = true;
    let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
    assert!(plan.workspace_bytes >= without.workspace_bytes);
    let cf = plan.forward.expect("class forward");
    assert_eq!(cf.rows, 32768);
    assert!(
        cf.classes >= CLASS_FORWARD_MIN_CLASSES && cf.classes.is_multiple_of(128),
        "{cf:?}"
    );
    assert!(
        plan.reason.contains("forward-only calls"),
        "{}",
        plan.reason
    );
    assert!((cf.bytes(p.n) as u64) < plan.workspace_bytes);
}

#[test]
fn class_forward_tiles_are_whole_units_or_all_classes() {
    // V = 1615 misses only by the buffers' 256-byte rounding; the next candidate must be a
    // multiple of the unit (1600), not V − unit (1599, whose tiles would start off the
    // bias's 4-element alignment).
    let cf = ClassForward::fit(13256, 1, 1615, 16, 16).expect("fits");
    assert!(
        cf.classes == 1615 || cf.classes.is_multiple_of(16),
        "{cf:?}"
    );
    assert!(cf.bytes(1) <= 13256);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn class_forward_fits_and_covers(
        scratch in 0usize..(64 << 20),
        n in 1usize..20000,
        v in 1usize..300000,
        unit in prop::sample::select(vec![16usize, 64, 128]),
    ) {
        match ClassForward::fit(scratch, n, v, unit, unit) {
            Some(cf) => {
                prop_assert!(cf.bytes(n) <= scratch, "{cf:?} over {scratch}");
                prop_assert!(cf.rows >= 1 && cf.rows <= n && cf.classes >= 1 && cf.classes <= v);
                prop_assert!(cf.rows == n || cf.rows.is_multiple_of(unit));
                prop_assert!(cf.classes == v || cf.classes.is_multiple_of(unit));
                prop_assert!(cf.ld().is_multiple_of(8) && cf.ld() >= cf.classes);
                prop_assert!(cf.buffer_bytes().is_multiple_of(256));
                // Fewer classes than the minimum only with every row or every class.
                prop_assert!(cf.classes >= CLASS_FORWARD_MIN_CLASSES.min(v) || cf.rows == n);
            }
            None => {
                // Not even one unit of rows of the smallest tile fits.
                let classes = (CLASS_FORWARD_MIN_CLASSES.div_ceil(unit) * unit).min(v);
                let least = ClassForward { rows: unit.min(n), classes };
                prop_assert!(least.bytes(n) > scratch);
            }
        }
    }
}

/// A budget tile ownership cannot meet is reported with the least it needs over the chunk
/// sizes it tried (the per-row state of one class chunk here, f32 gradients having no
/// accumulator), not with the state of its last, smallest, chunks, which is larger: a caller
/// who raises the budget to the reported figure must not be giving more than needed.
#[test]
fn tile_ownership_reports_its_least_workspace() {
    let mut limits = DeviceLimits::cpu();
    limits.strategies = vec![StrategyKind::TileOwnership];
    let p = problem(300, 40, 2000, DType::F32);
    let opts = |budget: u64| Options {
        workspace_budget_bytes: budget,
        ..Options::exact()
    };
    // One class chunk: 300 rows x (8 + 24) bytes of row state.
    let least = 300 * 32;
    match Plan::new(&p, &opts(least - 1), &limits) {
        Err(CceError::ResourceLimit {
            resource,
            requested,
            ..
        }) => {
            assert_eq!(requested, least, "{resource}");
            assert!(
                resource.contains(&format!("needs at least {least} B")),
                "{resource}"
            );
        }
        other => panic!("{other:?}"),
    }
    let plan = Plan::new(&p, &opts(least), &limits).unwrap();
    assert_eq!(plan.strategy, Strategy::TileOwnership);
    assert_eq!(plan.workspace_bytes, least);
}
