//! The plan of a backend call: `cce_core::plan` within the budget less the cuBLAS workspace,
//! then the backend's adjustments (its knobs, and the exact call's plan for a filtered call
//! whose last sparse try gave way: [`super::sparse_memory`]), each with its reason appended to
//! the plan's. Pure: no CUDA call.

use super::budget::*;
use super::schedule::DeviceFacts;
use super::*;
use crate::SparseMode;
use cce_core::{Plan, Problem, Strategy, StrategyKind};

/// The backend's knobs that change a plan (tests and benches: [`crate::CudaBackend`]'s
/// `with_chunk_cap`, `with_sparse`, `with_split_de_f16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlanKnobs {
    /// Cap of the dense strategies' chunks (rows, classes).
    pub chunk_cap: Option<(usize, usize)>,
    /// How the plan's sparse backward is used.
    pub sparse: SparseMode,
    /// Split dense's `d_e` may use f16 `G` (false: bf16 `G`).
    pub split_de_f16: bool,
    /// Exact f32 gradients of bf16 inputs may take chunked dense with bf16 `G` for `d_c`
    /// ([`crate::CudaSwitches::chunked_f32_grads`]); without it, only where its row pass
    /// writes f16 `G` for `d_c` ([`chunked_g16_holds`] with `chunked_g16`).
    pub chunked_f32_grads: bool,
    /// What decides whether chunked dense's row pass writes f16 `G` for `d_c`; `None`
    /// (planning without a device): never.
    pub chunked_g16: Option<ChunkedG16>,
    /// Exact calls of bf16 inputs and gradients may take chunked dense with `d_c` accumulated
    /// in the gradient dtype where the budget holds no f32 accumulator ([`dc_in_grad_dtype`],
    /// [`crate::CudaSwitches::dc_in_grad_dtype`]).
    pub dc_in_grad_dtype: bool,
    /// The backend's memory expects the sparse backward to run to the end
    /// ([`super::sparse_memory`]): false when its last try for this call's key gave way, and a
    /// filtered call under [`SparseMode::Remember`] is then planned as an exact call would be.
    pub sparse_expected: bool,
}

/// The device and call facts that decide whether chunked dense with f32 gradients of bf16
/// inputs takes `d_c` from f16 `G` ([`chunked_g16_holds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkedG16 {
    /// The device (its WGMMA kernels).
    pub dev: DeviceFacts,
    /// The row pass's WGMMA switch ([`crate::CudaSwitches::wgmma_rows`]).
    pub wgmma_rows: bool,
    /// `e` and `c` start on 16-byte boundaries.
    pub aligned: bool,
}

/// Whether chunked dense's row pass of `plan` (forward and backward, f32 gradients of bf16
/// inputs) runs through the WGMMA epilogue with room for each chunk's f16 copy of `e`
/// ([`DenseConfig::row_e16`]), so that `d_c` comes from f16 `G` made from q's 10-bit q9 code:
/// then such calls take chunked dense without [`crate::CudaSwitches::chunked_f32_grads`].
/// Measured on the H200 (docs/perf-log.md session 19): the `d_c` rows of confident rows'
/// targets 7.5e-4 to 1.1e-3 off at margin 20 (bf16 q: 3.3e-3), 8.9e-4 to 2.3e-2 at margin 40
/// (rows of entries near e⁻⁴⁰, where f16 `G`'s one scale per chunk flushes some), the real
/// rows' `d_c` 1.5e-4; the suite passes (105/105); 1.11-1.52x the 3-GEMM floor within 0.5 GiB
/// against split dense's 1.50-1.73x.
pub(crate) fn chunked_g16_holds(plan: &Plan, opts: &cce_core::Options, g: ChunkedG16) -> bool {
    let Ok(cfg) = super::schedule::dense_config(
        plan,
        opts,
        PathSwitches {
            wgmma_forward: false,
            wgmma_gcols: false,
            wgmma_rows: g.wgmma_rows,
            dc_in_grad_dtype: false,
        },
        true,
    ) else {
        return false;
    };
    cfg.row_e16()
        && super::schedule::wgmma_rows_unfit(&cfg, &g.dev, cfg.g_mode(), g.aligned).is_none()
}

/// Whether chunked dense accumulates `d_c` across its row chunks in the gradient dtype
/// ([`crate::CudaSwitches::dc_in_grad_dtype`], `knob`): an exact call (no filter) of bf16
/// inputs with bf16 gradients and `d_c`, whose budget less the cuBLAS workspace cannot hold
/// the f32 `V x D` accumulator. Each chunk's product is summed in f32 and added to the running
/// bf16 sum by the GEMM: one bf16 rounding of `d_c` per row chunk (Liger's trade), for 3
/// GEMMs within the budget instead of split dense's 4.
pub fn dc_in_grad_dtype(problem: &Problem, opts: &cce_core::Options, knob: bool) -> bool {
    knob && problem.dtype == DType::BF16
        && opts.grad_dtype == cce_core::GradDType::Input
        && opts.compute_d_c
        && !cce_core::FilterRule::resolve(opts, problem.dtype).enabled
        && (problem.v as u64) * (problem.d as u64) * 4 >= plan_budget(opts.workspace_budget_bytes)
}

/// The plan of a call of `problem` with `opts` on a device of `limits`, as the backend runs
/// it: within the budget less the cuBLAS workspace ([`plan_budget`]), chunked dense only for
/// exact bf16 / f32 calls (f32 gradients of bf16 inputs: with the `chunked_f32_grads` knob,
/// where [`chunked_f32_grads_pay`]), then `knobs` applied; each
/// adjustment appends its reason to the plan's. A filtered call whose last sparse try of the
/// same key gave way (`knobs.sparse_expected` false, [`SparseMode::Remember`]) gets the plan of
/// the exact call ([`as_exact_call`]), and so does a filtered call with no sparse try where the
/// exact call runs chunked dense ([`untried_filter_takes_exact_plan`]). A budget too small for the plan is a `ResourceLimit`
/// against the whole budget, the cuBLAS workspace counted in what is asked.
pub(crate) fn plan_call(
    problem: &Problem,
    opts: &cce_core::Options,
    limits: &cce_core::DeviceLimits,
    knobs: PlanKnobs,
) -> Result<Plan> {
    let exact_opts;
    let as_exact = as_exact_call(problem, opts, knobs);
    let opts = if as_exact {
        exact_opts = cce_core::Options {
            filter_eps: cce_core::FilterEps::Off,
            ..opts.clone()
        };
        &exact_opts
    } else {
        opts
    };
    // Chunked dense rounds G to the input dtype for both products: on real data
    // that costs d_c 0.13% against the original filter's 0.05% (docs/perf-log.md), and f16
    // G under a mean is subnormal; so filtered and f16 calls skip it. Split dense keeps
    // f16 G for d_c in every dtype.
    let filtered = cce_core::FilterRule::resolve(opts, problem.dtype).enabled;
    let call_limits = limits;
    let mut limits = limits.clone();
    let mut notes = Vec::new();
    // bf16 inputs with f32 gradients: split dense's f16 G for d_c (11 significand bits, so a
    // confident row's target keeps its d_c row to 1e-3) unless the knob allows chunked
    // dense's bf16 G (`CudaSwitches::chunked_f32_grads`).
    let f32_grads_of_bf16 =
        problem.dtype == DType::BF16 && opts.grad_dtype == cce_core::GradDType::F32;
    let g16_possible = knobs.chunked_f32_grads || knobs.chunked_g16.is_some();
    if limits.strategies.contains(&StrategyKind::ChunkedDense)
        && (filtered || problem.dtype == DType::F16 || (f32_grads_of_bf16 && !g16_possible))
    {
        drop_chunked_dense(&mut limits);
        notes.push(if filtered || problem.dtype == DType::F16 {
            "chunked-dense is used for exact bf16 / f32 calls only (its products use G in the input dtype)"
        } else {
            "chunked-dense is not used for f32 gradients of bf16 inputs (its products use bf16 G; CudaSwitches::chunked_f32_grads allows it)"
        });
    }
    let budget = opts.workspace_budget_bytes;
    let share = cce_core::Options {
        workspace_budget_bytes: plan_budget(budget),
        ..opts.clone()
    };
    let mut plan = match dc_in_grad_plan(problem, (opts, &share), &limits, knobs) {
        Some(p) => {
            notes.push("d_c accumulated in the bf16 output across row chunks: CudaSwitches::dc_in_grad_dtype");
            p
        }
        None => Plan::new(problem, &share, &limits).map_err(|e| over_budget(e, budget))?,
    };
    // Where the knob allows it: chunked dense accumulates d_c in the f32 output (no
    // accumulator in the workspace); where its row chunks are short, the f32 d_c read and
    // written per chunk costs more than split dense's second logits GEMM.
    if let Strategy::ChunkedDense { chunk_rows } = plan.strategy {
        let why = if !f32_grads_of_bf16 {
            None
        } else if !chunked_f32_grads_pay(chunk_rows, problem.n) {
            Some("chunked-dense is not used for f32 gradients of bf16 inputs with row chunks under 256 rows of f32 logits (the f32 d_c read and written per chunk)")
        } else if !knobs.chunked_f32_grads
            && !knobs
                .chunked_g16
                .is_some_and(|g| chunked_g16_holds(&plan, opts, g))
        {
            Some("chunked-dense is not used for f32 gradients of bf16 inputs where its row pass cannot write f16 G for d_c (no WGMMA row pass, or no room beside the chunk's f16 e; CudaSwitches::chunked_f32_grads allows bf16 G)")
        } else {
            None
        };
        if let Some(note) = why {
            drop_chunked_dense(&mut limits);
            plan = Plan::new(problem, &share, &limits).map_err(|e| over_budget(e, budget))?;
            notes.push(note);
        }
    }
    if let Some(cf) = plan.forward {
        // Forward-only calls fit their own tiles within the forward-only cap (`dense_config`);
        // the call's note names them.
        plan.reason = plan.reason.replace(
            &format!("; {cf}"),
            &format!(
                "; forward-only calls: class tiles within {} B of workspace",
                forward_workspace_cap(budget)
            ),
        );
    }
    plan.reason.push_str(&format!(
        "; planned within {} B: the budget of {budget} B less the {CUBLAS_WORKSPACE_BYTES} B \
         cuBLAS workspace",
        share.workspace_budget_bytes
    ));
    for note in notes {
        plan.reason.push_str(&format!(" ({note})"));
    }
    if let Some((cap_rows, cap_classes)) = knobs.chunk_cap {
        cap_plan_chunks(&mut plan, cap_rows, cap_classes);
    }
    if untried_filter_takes_exact_plan(filtered && !as_exact, knobs.sparse, &plan) {
        let exact_opts = cce_core::Options {
            filter_eps: cce_core::FilterEps::Off,
            ..opts.clone()
        };
        let mut exact = plan_call(problem, &exact_opts, call_limits, knobs)?;
        if matches!(exact.strategy, Strategy::ChunkedDense { .. }) {
            exact.reason.push_str(UNTRIED_FILTER_NOTE);
            return Ok(exact);
        }
    }
    match (knobs.sparse, plan.sparse.as_mut()) {
        (SparseMode::Off, Some(_)) => {
            plan.sparse = None;
            plan.reason
                .push_str(" (sparse backward off: with_sparse(SparseMode::Off))");
        }
        (SparseMode::Always, Some(sp)) => {
            sp.max_mean_kept = problem.v;
            plan.reason
                .push_str(" (sparse backward at any density: with_sparse(SparseMode::Always))");
        }
        _ => {}
    }
    if let Strategy::SplitDense { de_f16, .. } = &mut plan.strategy {
        if *de_f16 && !knobs.split_de_f16 && problem.dtype == DType::BF16 {
            *de_f16 = false;
            plan.reason
                .push_str(" (d_e from bf16 G: with_split_de_f16(false))");
        }
    }
    if as_exact {
        plan.reason.push_str(&as_exact_note());
    }
    Ok(plan)
}

/// Whether a filtered call's plan is replaced by the exact call's when that one is chunked
/// dense: the call filters (`filtered`, and not already planned as exact), its plan has no
/// sparse backward to try (label smoothing, deterministic calls, a filter on one gradient
/// only, or pairs that do not fit), and the sparse mode is not `Off` (the benchmarks' filtered
/// split dense). Such a call would run split dense's dense passes, whose skipped entries save
/// no GEMM work, where the exact call runs chunked dense's three GEMMs (at 16 GiB and lm
/// rows: 1.40-1.73x against 1.09-1.25x of the floor, docs/perf-log.md); the filter's
/// permission goes unused, nothing is dropped.
fn untried_filter_takes_exact_plan(filtered: bool, sparse: SparseMode, plan: &Plan) -> bool {
    filtered
        && sparse != SparseMode::Off
        && plan.sparse.is_none()
        && !matches!(plan.strategy, Strategy::ChunkedDense { .. })
}

/// The plan reason's note of a filtered call with no sparse try planned as the exact call
/// ([`untried_filter_takes_exact_plan`]).
pub(crate) const UNTRIED_FILTER_NOTE: &str = " (the exact call's plan: this filtered call has \
     no sparse backward to try, and chunked dense is faster than split dense here; nothing is \
     dropped)";

/// Chunked dense's plan where `d_c` accumulates in the gradient dtype ([`dc_in_grad_dtype`]):
/// planned as for f32 gradients (no accumulator in the workspace), where its row chunks are
/// long ([`chunked_f32_grads_pay`]: the output read and written per chunk); `None` otherwise.
/// `opts`: the call's; `share`: the same within the budget less the cuBLAS workspace.
fn dc_in_grad_plan(
    problem: &Problem,
    (opts, share): (&cce_core::Options, &cce_core::Options),
    limits: &cce_core::DeviceLimits,
    knobs: PlanKnobs,
) -> Option<Plan> {
    if !limits.strategies.contains(&StrategyKind::ChunkedDense)
        || !dc_in_grad_dtype(problem, opts, knobs.dc_in_grad_dtype)
    {
        return None;
    }
    let as_f32 = cce_core::Options {
        grad_dtype: cce_core::GradDType::F32,
        ..share.clone()
    };
    let chunked = cce_core::DeviceLimits {
        strategies: vec![StrategyKind::ChunkedDense],
        ..limits.clone()
    };
    let plan = Plan::new(problem, &as_f32, &chunked).ok()?;
    match plan.strategy {
        Strategy::ChunkedDense { chunk_rows } if chunked_f32_grads_pay(chunk_rows, problem.n) => {
            Some(plan)
        }
        _ => None,
    }
}

/// Chunked dense with f32 gradients of bf16 inputs accumulates `d_c` in the f32 output, read
/// and written once per row chunk (`V·D·8` bytes): at chunks of `chunk_rows` rows of f32
/// logits (about twice as many rows of the WGMMA row pass's 16-bit q) that traffic stays under
/// the chunk's `d_c` GEMM from 256 rows (the H200: 4.8 TB/s against ~700 TFLOP/s, so a
/// product of `k` rows is compute-bound from `k ≈ 4·700/4.8 ≈ 580`), or when one chunk holds
/// every row.
pub(crate) fn chunked_f32_grads_pay(chunk_rows: usize, n: usize) -> bool {
    chunk_rows >= CHUNKED_F32_GRADS_MIN_ROWS || chunk_rows >= n
}

/// Rows of f32 logits per chunk from which chunked dense takes f32 gradients of bf16 inputs
/// ([`chunked_f32_grads_pay`]).
pub(crate) const CHUNKED_F32_GRADS_MIN_ROWS: usize = 256;

/// Take chunked dense out of `limits`' strategies (split dense stays or is added).
fn drop_chunked_dense(limits: &mut cce_core::DeviceLimits) {
    limits
        .strategies
        .retain(|k| *k != StrategyKind::ChunkedDense);
    if limits.strategies.is_empty() {
        limits.strategies.push(StrategyKind::SplitDense);
    }
}

/// A filtered call is planned as the exact call would be: the last sparse backward of its key
/// gave way ([`super::sparse_memory`]), and the backend remembers give-ways
/// ([`SparseMode::Remember`]; [`SparseMode::Auto`], the default, keeps every call of a key on
/// one path). Then no probe runs, and chunked dense is taken where the
/// budget holds it, as for an exact call (its dense GEMMs gain nothing from skipped entries,
/// so the filter's permission goes unused: nothing is dropped).
pub(crate) fn as_exact_call(problem: &Problem, opts: &cce_core::Options, knobs: PlanKnobs) -> bool {
    knobs.sparse == SparseMode::Remember
        && !knobs.sparse_expected
        && cce_core::FilterRule::resolve(opts, problem.dtype).enabled
}

/// The plan a filtered call switches to when its sparse backward gives way (the probe's first
/// chunk keeps too many entries per row, or the pairs outgrow their capacity), with the
/// options it runs under (the filter off): the exact call's plan, when that plan is chunked
/// dense and the filtered plan is not. Chunked dense is the faster dense path where the
/// budget holds it, but filtered calls do not take it (its products use `G` in the input
/// dtype), so without this a filtered call that gave way ran split dense, slower than the
/// exact call of the same inputs (real rows: 8.81 ms against 6.97 ms, docs/perf-log.md). The
/// switch reads the probe's verdict within the call: calls with the same inputs take the
/// same path (no state is kept between calls, unlike [`SparseMode::Remember`]). `None`: no
/// sparse try is planned, or the exact call would run the same strategy, so the dense passes
/// go on from the probe's chunk as before.
pub(crate) fn give_way_plan(
    problem: &Problem,
    opts: &cce_core::Options,
    limits: &cce_core::DeviceLimits,
    knobs: PlanKnobs,
    plan: &Plan,
) -> Result<Option<(Plan, cce_core::Options)>> {
    if plan.sparse.is_none() || knobs.sparse == SparseMode::Off {
        return Ok(None);
    }
    let exact_opts = cce_core::Options {
        filter_eps: cce_core::FilterEps::Off,
        ..opts.clone()
    };
    let knobs = PlanKnobs {
        sparse_expected: true,
        ..knobs
    };
    let mut exact = plan_call(problem, &exact_opts, limits, knobs)?;
    let switches = matches!(exact.strategy, Strategy::ChunkedDense { .. })
        && !matches!(plan.strategy, Strategy::ChunkedDense { .. });
    if !switches {
        return Ok(None);
    }
    exact.reason.push_str(GIVE_WAY_NOTE);
    Ok(Some((exact, exact_opts)))
}

/// The plan reason's note of a filtered call run as the exact call after its sparse backward
/// gave way.
pub(crate) const GIVE_WAY_NOTE: &str = " (the exact call's plan, run after the filtered call's \
     sparse backward gave way: chunked dense is faster than split dense here, and nothing is \
     dropped)";

/// The reason a filtered call was planned as an exact one.
pub(crate) fn as_exact_note() -> String {
    format!(
        " (planned as the exact call, nothing skipped: the last sparse backward of this shape \
         gave way, so the next {} calls of it take no probe)",
        super::sparse_memory::RETRY_AFTER
    )
}

/// Shrink the chunks of a dense plan to at most `rows` x `classes` (whole tiles).
fn cap_plan_chunks(plan: &mut Plan, rows: usize, classes: usize) {
    let (n, v) = (plan.problem.n, plan.problem.v);
    let chunks = |total: usize, c: usize| -> Vec<std::ops::Range<usize>> {
        (0..total.div_ceil(c))
            .map(|i| i * c..((i + 1) * c).min(total))
            .collect()
    };
    match &mut plan.strategy {
        Strategy::ChunkedDense { chunk_rows } => {
            *chunk_rows = (*chunk_rows).min(rows);
            plan.row_chunks = chunks(n, *chunk_rows);
        }
        Strategy::SplitDense {
            chunk_rows,
            chunk_classes,
            ..
        } => {
            *chunk_rows = (*chunk_rows).min(rows);
            *chunk_classes = (*chunk_classes).min(classes);
            plan.row_chunks = chunks(n, *chunk_rows);
            plan.class_chunks = chunks(v, *chunk_classes);
            if let Some(sp) = plan.sparse.as_mut() {
                sp.max_rows = sp.max_rows.min(rows).max(sp.probe_rows);
            }
        }
        Strategy::TileOwnership => return,
    }
    if let Some(cf) = plan.forward.as_mut() {
        // rows and classes are whole tiles, so the tiles keep the plan's alignment.
        cf.rows = cf.rows.min(rows);
        cf.classes = cf.classes.min(classes);
    }
    plan.reason.push_str(&format!(
        " (chunks capped at {rows} rows, {classes} classes)"
    ));
}

#[cfg(test)]
mod tests {
    use super::super::schedule::{dense_config, device_limits};
    use super::*;
    use cce_core::Options;

    /// A bf16 problem of `shape` without bias, the limits of a 140 GiB Hopper and the backend's
    /// knobs with the sparse mode and the memory of the last sparse try given.
    fn setup(
        (n, d, v): (usize, usize, usize),
        sparse: SparseMode,
        sparse_expected: bool,
    ) -> (Problem, cce_core::DeviceLimits, PlanKnobs) {
        let problem = Problem {
            n,
            d,
            v,
            dtype: DType::BF16,
            has_bias: false,
            seq_len: n,
        };
        let limits = device_limits("test", 140 << 30, 227 << 10);
        let knobs = PlanKnobs {
            chunk_cap: None,
            sparse,
            split_de_f16: true,
            chunked_f32_grads: false,
            chunked_g16: None,
            dc_in_grad_dtype: false,
            sparse_expected,
        };
        (problem, limits, knobs)
    }

    /// The plan of a bf16 call of `shape` with `opts` as `CudaBackend` makes it, with the sparse
    /// mode and the backend's memory of the last sparse try given.
    fn plan_with(
        shape: (usize, usize, usize),
        opts: &Options,
        sparse: SparseMode,
        sparse_expected: bool,
    ) -> Plan {
        let (problem, limits, knobs) = setup(shape, sparse, sparse_expected);
        plan_call(&problem, opts, &limits, knobs).unwrap()
    }

    #[test]
    fn a_filtered_call_after_a_give_way_takes_the_exact_plan() {
        let filtered = Options::default();
        let exact = Options::exact();
        let sixteen_gib = Options {
            workspace_budget_bytes: 16 << 30,
            ..Options::default()
        };
        let sixteen_gib_exact = Options {
            workspace_budget_bytes: 16 << 30,
            ..Options::exact()
        };
        // The real-row shape (chunked dense fits the default budget), the seed shape at the
        // default budget (split dense either way) and with 16 GiB (chunked dense fits).
        for (shape, f, x) in [
            ((12288, 576, 49152), &filtered, &exact),
            ((32768, 4096, 256000), &filtered, &exact),
            ((32768, 4096, 256000), &sixteen_gib, &sixteen_gib_exact),
        ] {
            let first = plan_with(shape, f, SparseMode::Remember, true);
            assert!(
                first.sparse.is_some(),
                "{shape:?}: no history, the sparse try is planned"
            );
            assert!(
                matches!(first.strategy, Strategy::SplitDense { .. }),
                "{shape:?}"
            );
            let after = plan_with(shape, f, SparseMode::Remember, false);
            let exact_plan = plan_with(shape, x, SparseMode::Auto, true);
            assert_eq!(after.strategy, exact_plan.strategy, "{shape:?}");
            assert_eq!(after.row_chunks, exact_plan.row_chunks, "{shape:?}");
            assert_eq!(after.class_chunks, exact_plan.class_chunks, "{shape:?}");
            assert!(after.sparse.is_none() && !after.filter.enabled, "{shape:?}");
            assert!(
                after.reason.ends_with(&as_exact_note()),
                "{shape:?}: {}",
                after.reason
            );
            // Nothing is skipped on the dense path either.
            let cfg = dense_config(&after, f, PathSwitches::DEFAULT, true).unwrap();
            assert!(!cfg.filtering(), "{shape:?}");
        }
        assert!(matches!(
            plan_with((12288, 576, 49152), &filtered, SparseMode::Remember, false).strategy,
            Strategy::ChunkedDense { .. }
        ));
    }

    #[test]
    fn f32_gradients_of_bf16_inputs_take_chunked_dense_with_the_knob_where_its_chunks_are_long() {
        let f32_grads = |opts: Options| Options {
            grad_dtype: cce_core::GradDType::F32,
            ..opts
        };
        let with_knob = |shape, opts: &Options| {
            let (problem, limits, knobs) = setup(shape, SparseMode::Auto, true);
            let knobs = PlanKnobs {
                chunked_f32_grads: true,
                ..knobs
            };
            plan_call(&problem, opts, &limits, knobs).unwrap()
        };
        let exact = f32_grads(Options::exact());
        // The default: split dense (f16 G for d_c), with the reason.
        let plan = plan_with((8192, 2304, 256000), &exact, SparseMode::Auto, true);
        assert!(matches!(plan.strategy, Strategy::SplitDense { .. }));
        assert!(
            plan.reason.contains("chunked_f32_grads allows it"),
            "{}",
            plan.reason
        );
        // With the knob, the default budget: no f32 accumulator in the workspace (the output
        // is one).
        for shape in [
            (8192, 2304, 256000),
            (32768, 4096, 256000),
            (12288, 576, 49152),
        ] {
            let plan = with_knob(shape, &exact);
            let Strategy::ChunkedDense { chunk_rows } = plan.strategy else {
                panic!("{shape:?}: {}", plan.reason);
            };
            assert!(chunked_f32_grads_pay(chunk_rows, shape.0), "{shape:?}");
            assert!(plan.workspace_bytes <= Options::default().workspace_budget_bytes);
        }
        // A vocabulary whose chunks would hold under 256 rows: split dense, with the reason.
        let plan = with_knob((32768, 4096, 600_000), &exact);
        assert!(
            matches!(plan.strategy, Strategy::SplitDense { .. }),
            "{}",
            plan.reason
        );
        assert!(plan.reason.contains("under 256 rows"), "{}", plan.reason);
        // bf16 gradients: the f32 accumulator does not fit 0.5 GiB, split dense as before;
        // filtered calls keep split dense (and the sparse try).
        let bf16 = with_knob((8192, 2304, 256000), &Options::exact());
        assert!(matches!(bf16.strategy, Strategy::SplitDense { .. }));
        let plan = with_knob((8192, 2304, 256000), &f32_grads(Options::default()));
        assert!(matches!(plan.strategy, Strategy::SplitDense { .. }) && plan.sparse.is_some());
        assert!(chunked_f32_grads_pay(5, 5) && !chunked_f32_grads_pay(255, 1000));
    }

    #[test]
    fn f32_gradients_of_bf16_inputs_take_chunked_dense_where_its_row_pass_writes_f16_g() {
        let exact = Options {
            grad_dtype: cce_core::GradDType::F32,
            ..Options::exact()
        };
        let h200 = DeviceFacts {
            major: 9,
            minor: 0,
            sm_count: 132,
            max_smem_optin: 227 << 10,
            fused_static_smem: 0,
        };
        let with = |shape, opts: &Options, dev: DeviceFacts, wgmma_rows, aligned| {
            let (problem, limits, knobs) = setup(shape, SparseMode::Auto, true);
            let knobs = PlanKnobs {
                chunked_g16: Some(ChunkedG16 {
                    dev,
                    wgmma_rows,
                    aligned,
                }),
                ..knobs
            };
            plan_call(&problem, opts, &limits, knobs).unwrap()
        };
        for shape in [
            (8192, 2304, 256000),
            (32768, 4096, 256000),
            (8192, 4096, 128256),
            (12288, 576, 49152),
        ] {
            let plan = with(shape, &exact, h200, true, true);
            assert!(
                matches!(plan.strategy, Strategy::ChunkedDense { .. }),
                "{shape:?}: {}",
                plan.reason
            );
            let cfg = dense_config(&plan, &exact, PathSwitches::DEFAULT, true).unwrap();
            assert!(cfg.row_e16() && cfg.wgmma_chunk_rows() >= 256, "{shape:?}");
            // Where the WGMMA row pass cannot run: split dense, with the reason.
            let a100 = DeviceFacts { major: 8, ..h200 };
            let softcap_half = Options {
                softcap: Some(0.5),
                ..exact.clone()
            };
            for (what, plan) in [
                ("A100", with(shape, &exact, a100, true, true)),
                ("switch off", with(shape, &exact, h200, false, true)),
                ("unaligned", with(shape, &exact, h200, true, false)),
                ("softcap 0.5", with(shape, &softcap_half, h200, true, true)),
            ] {
                assert!(
                    matches!(plan.strategy, Strategy::SplitDense { .. }),
                    "{shape:?} {what}: {}",
                    plan.reason
                );
                assert!(
                    plan.reason.contains("cannot write f16 G"),
                    "{what}: {}",
                    plan.reason
                );
            }
        }
    }

    /// The give-way plan of a bf16 call of `shape` with `opts`, under `sparse`.
    fn give_way_with(
        shape: (usize, usize, usize),
        opts: &Options,
        sparse: SparseMode,
    ) -> Option<(Plan, Options)> {
        let (problem, limits, knobs) = setup(shape, sparse, true);
        let plan = plan_call(&problem, opts, &limits, knobs).unwrap();
        give_way_plan(&problem, opts, &limits, knobs, &plan).unwrap()
    }

    #[test]
    fn a_filtered_call_that_gives_way_switches_to_chunked_dense_where_the_exact_call_takes_it() {
        let sixteen_gib = Options {
            workspace_budget_bytes: 16 << 30,
            ..Options::default()
        };
        let sixteen_gib_exact = Options {
            workspace_budget_bytes: 16 << 30,
            ..Options::exact()
        };
        for (shape, f, x) in [
            ((12288, 576, 49152), &Options::default(), &Options::exact()),
            ((32768, 4096, 256000), &sixteen_gib, &sixteen_gib_exact),
        ] {
            for mode in [SparseMode::Auto, SparseMode::Always, SparseMode::Remember] {
                let (plan, opts) = give_way_with(shape, f, mode)
                    .unwrap_or_else(|| panic!("{shape:?} {mode:?}: no give-way plan"));
                let exact = plan_with(shape, x, SparseMode::Auto, true);
                assert!(matches!(plan.strategy, Strategy::ChunkedDense { .. }));
                assert_eq!(plan.strategy, exact.strategy, "{shape:?} {mode:?}");
                assert_eq!(plan.row_chunks, exact.row_chunks, "{shape:?} {mode:?}");
                assert!(plan.sparse.is_none() && !plan.filter.enabled);
                assert!(plan.reason.ends_with(GIVE_WAY_NOTE), "{}", plan.reason);
                assert_eq!(opts.filter_eps, cce_core::FilterEps::Off);
                let cfg = dense_config(&plan, &opts, PathSwitches::DEFAULT, true).unwrap();
                assert!(!cfg.filtering());
            }
        }
        // Split dense either way (the seed at 0.5 GiB): the dense passes go on from the
        // probe's chunk. No sparse try (Off, exact calls): nothing to give way.
        assert!(
            give_way_with((32768, 4096, 256000), &Options::default(), SparseMode::Auto).is_none()
        );
        assert!(give_way_with((12288, 576, 49152), &Options::default(), SparseMode::Off).is_none());
        assert!(give_way_with((12288, 576, 49152), &Options::exact(), SparseMode::Auto).is_none());
    }

    #[test]
    fn a_filtered_call_without_a_sparse_try_takes_the_exact_plan_where_it_is_chunked_dense() {
        type Edit = fn(Options) -> Options;
        let no_try: [(&str, Edit); 3] = [
            ("deterministic", |o| Options {
                deterministic: true,
                ..o
            }),
            ("label smoothing", |o| Options {
                label_smoothing: 0.1,
                ..o
            }),
            ("d_e filtered only", |o| Options {
                filter_c_grad: false,
                ..o
            }),
        ];
        let default_budget: Edit = |o| o;
        let sixteen_gib: Edit = |o| Options {
            workspace_budget_bytes: 16 << 30,
            ..o
        };
        // The real-row shape (chunked dense fits the default budget) and the seed with 16 GiB.
        for (shape, budget) in [
            ((12288, 576, 49152), default_budget),
            ((32768, 4096, 256000), sixteen_gib),
        ] {
            for (what, edit) in no_try {
                let filtered = edit(budget(Options::default()));
                let exact = edit(budget(Options::exact()));
                let plan = plan_with(shape, &filtered, SparseMode::Auto, true);
                let exact_plan = plan_with(shape, &exact, SparseMode::Auto, true);
                assert!(
                    matches!(plan.strategy, Strategy::ChunkedDense { .. }),
                    "{shape:?} {what}: {}",
                    plan.reason
                );
                assert_eq!(plan.strategy, exact_plan.strategy, "{shape:?} {what}");
                assert_eq!(plan.row_chunks, exact_plan.row_chunks, "{shape:?} {what}");
                assert_eq!(
                    plan.class_chunks, exact_plan.class_chunks,
                    "{shape:?} {what}"
                );
                assert!(
                    plan.sparse.is_none() && !plan.filter.enabled,
                    "{shape:?} {what}"
                );
                assert!(
                    plan.reason.ends_with(UNTRIED_FILTER_NOTE),
                    "{shape:?} {what}: {}",
                    plan.reason
                );
                let cfg = dense_config(&plan, &filtered, PathSwitches::DEFAULT, true).unwrap();
                assert!(!cfg.filtering(), "{shape:?} {what}");
                // SparseMode::Off (the benchmarks' filtered split dense) keeps its plan.
                let off = plan_with(shape, &filtered, SparseMode::Off, true);
                assert!(
                    matches!(off.strategy, Strategy::SplitDense { .. }) && off.filter.enabled,
                    "{shape:?} {what}: {}",
                    off.reason
                );
            }
        }
        // Where the exact call runs split dense too (the seed at 0.5 GiB), the filtered call
        // keeps its filtered split dense.
        let det = Options {
            deterministic: true,
            ..Options::default()
        };
        let plan = plan_with((32768, 4096, 256000), &det, SparseMode::Auto, true);
        assert!(matches!(plan.strategy, Strategy::SplitDense { .. }));
        assert!(plan.filter.enabled && plan.sparse.is_none());
        assert!(
            !plan.reason.contains(UNTRIED_FILTER_NOTE),
            "{}",
            plan.reason
        );
        // A call with a sparse try keeps it (it gives way within the call where it must).
        let tried = plan_with(
            (12288, 576, 49152),
            &Options::default(),
            SparseMode::Auto,
            true,
        );
        assert!(tried.sparse.is_some() && tried.filter.enabled);
    }

    #[test]
    fn the_memory_leaves_exact_calls_and_the_bench_modes_alone() {
        let shape = (12288, 576, 49152);
        // SparseMode::Off benches filtered split dense; Always forces the try; Auto (the
        // default) keeps every call of a key on one path: no memory there.
        for mode in [SparseMode::Off, SparseMode::Always, SparseMode::Auto] {
            let p = plan_with(shape, &Options::default(), mode, false);
            assert!(p.filter.enabled, "{mode:?}");
            assert!(
                matches!(p.strategy, Strategy::SplitDense { .. }),
                "{mode:?}"
            );
            assert!(!p.reason.contains("planned as the exact call"), "{mode:?}");
        }
        let exact = plan_with(shape, &Options::exact(), SparseMode::Remember, false);
        assert_eq!(
            exact,
            plan_with(shape, &Options::exact(), SparseMode::Remember, true)
        );
    }

    /// `d_c` in the gradient dtype: with the knob, an exact bf16 call whose budget holds no
    /// f32 accumulator takes chunked dense without one (its engine configuration accumulates
    /// in the output); without the knob, or filtered, or with f32 gradients, or with a budget
    /// that holds the accumulator, the plan and configuration are what they were.
    #[test]
    fn dc_in_grad_dtype_takes_chunked_dense_without_the_accumulator() {
        let (problem, limits, knobs) = setup((8192, 2304, 256000), SparseMode::Auto, true);
        let on = PlanKnobs {
            dc_in_grad_dtype: true,
            ..knobs
        };
        let exact = Options::exact();
        let switches = PathSwitches {
            dc_in_grad_dtype: true,
            ..PathSwitches::DEFAULT
        };
        let plan = plan_call(&problem, &exact, &limits, on).unwrap();
        assert!(
            matches!(plan.strategy, Strategy::ChunkedDense { .. }),
            "{}",
            plan.reason
        );
        assert!(plan.reason.contains("dc_in_grad_dtype"), "{}", plan.reason);
        let cfg = dense_config(&plan, &exact, switches, true).unwrap();
        assert!(cfg.dc_in_grad_dtype);
        assert_eq!(cfg.dc_acc_dtype(), DType::BF16);
        let ws = super::super::workspace::WorkspaceSizes::of(&cfg);
        assert!(ws.total() <= exact.workspace_budget_bytes);
        // Forward-only calls of the same plan accumulate nothing.
        assert!(
            !dense_config(&plan, &exact, switches, false)
                .unwrap()
                .dc_in_grad_dtype
        );
        // Without the knob: split dense.
        let off = plan_call(&problem, &exact, &limits, knobs).unwrap();
        assert!(matches!(off.strategy, Strategy::SplitDense { .. }));
        // Filtered, or f32 gradients: not taken.
        let filtered = plan_call(&problem, &Options::default(), &limits, on).unwrap();
        assert!(!matches!(filtered.strategy, Strategy::ChunkedDense { .. }));
        let f32_grads = Options {
            grad_dtype: cce_core::GradDType::F32,
            ..Options::exact()
        };
        assert!(!dc_in_grad_dtype(&problem, &f32_grads, true));
        // A budget that holds the f32 accumulator keeps it.
        let roomy = Options {
            workspace_budget_bytes: 16 << 30,
            ..Options::exact()
        };
        let plan = plan_call(&problem, &roomy, &limits, on).unwrap();
        assert!(matches!(plan.strategy, Strategy::ChunkedDense { .. }));
        assert!(
            !dense_config(&plan, &roomy, switches, true)
                .unwrap()
                .dc_in_grad_dtype
        );
    }
}
