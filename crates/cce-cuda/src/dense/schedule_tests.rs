//! The schedule of the benchmark shapes on an H200 (sm_90) and an A100 (sm_80), bf16, the
//! default options (512 MiB budget): which paths they take and the reason strings they report.

use super::*;
use crate::SparseMode;
use cce_core::{Options, Problem};

/// An H200 as the engine sees it: compute capability 9.0, 132 multiprocessors, 227 KiB of
/// shared memory per block.
fn h200() -> DeviceFacts {
    DeviceFacts {
        major: 9,
        minor: 0,
        sm_count: 132,
        max_smem_optin: 227 << 10,
        fused_static_smem: 0,
    }
}

/// An A100: compute capability 8.0, 108 multiprocessors, 163 KiB per block.
fn a100() -> DeviceFacts {
    DeviceFacts {
        major: 8,
        minor: 0,
        sm_count: 108,
        max_smem_optin: 163 << 10,
        fused_static_smem: 0,
    }
}

/// The notes a call reports, in the order the backend puts them before the plan's reason.
#[derive(Debug)]
struct Notes {
    plan: String,
    forward: Option<String>,
    try_sparse: bool,
    row_pass: Option<String>,
    class_pass: Option<String>,
}

/// The schedule of a `kind` call of `(n, d, v)` bf16 with `opts` on `dev`, as `CudaBackend`
/// plans it (default knobs and switches, aligned inputs, the workspace's scratch), with the
/// notes of a call whose sparse backward (if tried) gave way without reusing rows.
fn notes(
    (n, d, v): (usize, usize, usize),
    opts: &Options,
    dev: &DeviceFacts,
    kind: CallKind,
) -> Notes {
    let problem = Problem {
        n,
        d,
        v,
        dtype: DType::BF16,
        has_bias: false,
        seq_len: n,
    };
    let arch = if dev.major == 9 { "sm_90a" } else { "sm_80" };
    let limits = device_limits(
        &format!("test ({arch})"),
        140 << 30,
        dev.max_smem_optin as u64,
    );
    let knobs = PlanKnobs {
        chunk_cap: None,
        sparse: SparseMode::Auto,
        split_de_f16: true,
        chunked_f32_grads: false,
        chunked_g16: None,
        dc_in_grad_dtype: false,
        sparse_expected: true,
    };
    let plan = plan_call(&problem, opts, &limits, knobs).unwrap();
    let cfg = dense_config(&plan, opts, PathSwitches::DEFAULT, kind.backward()).unwrap();
    let call = CallFacts {
        scratch: cfg.scratch_bytes().max(4),
        aligned: true,
        capturing: false,
        accumulate: false,
    };
    let s = schedule(&cfg, kind, dev, call);
    let chunk = cfg.effective_chunk_rows();
    let kmax = cfg.chunk_classes.unwrap_or(v).clamp(1, v);
    Notes {
        plan: plan.reason.clone(),
        forward: s.forward_note.clone(),
        try_sparse: s.try_sparse,
        row_pass: s
            .row_wgmma
            .map(|verdict| row_pass_note(verdict, n.div_ceil(chunk), chunk.min(n))),
        class_pass: s.class_pass.as_ref().map(|p| p.note(&cfg, kmax)),
    }
}

const SHAPES: [(usize, usize, usize); 4] = [
    (32768, 4096, 256000),
    (8192, 2304, 256000),
    (8192, 4096, 128256),
    (12288, 576, 49152),
];

/// (compute capability major, shape, options, call, forward note, sparse tried, row pass note,
/// class pass note) of every benchmark shape, as the backend reports them (the row pass note
/// of a call whose sparse backward, when tried, gave way without reusing rows).
#[allow(clippy::type_complexity)]
const EXPECTED: &[(
    i32,
    (usize, usize, usize),
    &str,
    CallKind,
    Option<&str>,
    bool,
    Option<&str>,
    Option<&str>,
)] = &[
    (
        9,
        (32768, 4096, 256000),
        "default",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (4 row group(s) of up to 8192 rows x 1000 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (32768, 4096, 256000),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (86 chunk(s) of up to 384 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (91 chunk(s) of up to 2816 classes, d_c in sub-chunks of up to 1408 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (32768, 4096, 256000),
        "exact",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (4 row group(s) of up to 8192 rows x 1000 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (32768, 4096, 256000),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (86 chunk(s) of up to 384 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (84 chunk(s) of up to 3072 classes, d_c in sub-chunks of up to 1536 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (8192, 2304, 256000),
        "default",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 8192 rows x 1000 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (8192, 2304, 256000),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (22 chunk(s) of up to 384 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (19 chunk(s) of up to 13824 classes, d_c in sub-chunks of up to 13824 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (8192, 2304, 256000),
        "exact",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 8192 rows x 1000 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (8192, 2304, 256000),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (22 chunk(s) of up to 384 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (19 chunk(s) of up to 13824 classes, d_c in sub-chunks of up to 13824 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (8192, 4096, 128256),
        "default",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 8192 rows x 501 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (8192, 4096, 128256),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (10 chunk(s) of up to 896 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (11 chunk(s) of up to 11776 classes, d_c in sub-chunks of up to 11776 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (8192, 4096, 128256),
        "exact",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 8192 rows x 501 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (8192, 4096, 128256),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (10 chunk(s) of up to 896 rows, no f32 logits in memory)"),
        Some("class pass: WGMMA GEMM with G in its epilogue (11 chunk(s) of up to 11776 classes, d_c in sub-chunks of up to 11776 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (12288, 576, 49152),
        "default",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 12288 rows x 192 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (12288, 576, 49152),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: f16 G for d_e (the budget's f16 copy of c))"),
        Some("class pass: WGMMA GEMM with G in its epilogue (3 chunk(s) of up to 17664 classes, d_c in sub-chunks of up to 8832 classes, f16 G, no logits in memory)"),
    ),
    (
        9,
        (12288, 576, 49152),
        "exact",
        CallKind::Forward,
        Some("forward: WGMMA GEMM with the lse in its epilogue (1 row group(s) of up to 12288 rows x 192 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"),
        false,
        None,
        None,
    ),
    (
        9,
        (12288, 576, 49152),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its epilogue, then G in place (7 chunk(s) of up to 1920 rows, no f32 logits in memory)"),
        None,
    ),
    (
        8,
        (32768, 4096, 256000),
        "default",
        CallKind::Forward,
        Some("forward: 1115 GEMM tile(s) of 6656 rows x 1152 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (32768, 4096, 256000),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (182 chunk(s) of up to 1408 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (32768, 4096, 256000),
        "exact",
        CallKind::Forward,
        Some("forward: 1115 GEMM tile(s) of 6656 rows x 1152 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (32768, 4096, 256000),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (167 chunk(s) of up to 1536 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (8192, 2304, 256000),
        "default",
        CallKind::Forward,
        Some("forward: 268 GEMM tile(s) of 4096 rows x 1920 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (8192, 2304, 256000),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (63 chunk(s) of up to 4096 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (8192, 2304, 256000),
        "exact",
        CallKind::Forward,
        Some("forward: 268 GEMM tile(s) of 4096 rows x 1920 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (8192, 2304, 256000),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (63 chunk(s) of up to 4096 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (8192, 4096, 128256),
        "default",
        CallKind::Forward,
        Some("forward: 134 GEMM tile(s) of 4096 rows x 1920 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (8192, 4096, 128256),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (32 chunk(s) of up to 4096 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (8192, 4096, 128256),
        "exact",
        CallKind::Forward,
        Some("forward: 134 GEMM tile(s) of 4096 rows x 1920 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (8192, 4096, 128256),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (32 chunk(s) of up to 4096 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (12288, 576, 49152),
        "default",
        CallKind::Forward,
        Some("forward: 78 GEMM tile(s) of 6144 rows x 1280 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (12288, 576, 49152),
        "default",
        CallKind::ForwardBackward,
        None,
        true,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        Some("class pass: cuBLAS logits then G (12 chunk(s) of up to 4096 classes; no WGMMA epilogue: not compute capability 9.0)"),
    ),
    (
        8,
        (12288, 576, 49152),
        "exact",
        CallKind::Forward,
        Some("forward: 78 GEMM tile(s) of 6144 rows x 1280 classes through two buffers, row reductions on a second stream"),
        false,
        None,
        None,
    ),
    (
        8,
        (12288, 576, 49152),
        "exact",
        CallKind::ForwardBackward,
        None,
        false,
        Some("row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA epilogue: not compute capability 9.0)"),
        None,
    ),
];

#[test]
fn bench_shapes_reason_strings() {
    assert_eq!(EXPECTED.len(), 2 * SHAPES.len() * 2 * 2);
    for &(major, shape, what, kind, forward, try_sparse, row_pass, class_pass) in EXPECTED {
        let dev = if major == 9 { h200() } else { a100() };
        let opts = if what == "exact" {
            Options::exact()
        } else {
            Options::default()
        };
        let x = notes(shape, &opts, &dev, kind);
        let at = format!("sm_{major}0 {shape:?} {what} {kind:?}");
        assert_eq!(x.forward.as_deref(), forward, "{at}");
        assert_eq!(x.try_sparse, try_sparse, "{at}");
        assert_eq!(x.row_pass.as_deref(), row_pass, "{at}");
        assert_eq!(x.class_pass.as_deref(), class_pass, "{at}");
        eprintln!("{at}: plan: {}", x.plan);
    }
}

/// The bench's split-dense configuration of `shape` (bf16, default options, a backward).
fn split_cfg(shape: (usize, usize, usize), opts: &Options) -> DenseConfig {
    let problem = Problem {
        n: shape.0,
        d: shape.1,
        v: shape.2,
        dtype: DType::BF16,
        has_bias: false,
        seq_len: shape.0,
    };
    let limits = device_limits("test", 140 << 30, 227 << 10);
    let knobs = PlanKnobs {
        chunk_cap: None,
        sparse: SparseMode::Auto,
        split_de_f16: true,
        chunked_f32_grads: false,
        chunked_g16: None,
        dc_in_grad_dtype: false,
        sparse_expected: true,
    };
    let plan = plan_call(&problem, opts, &limits, knobs).unwrap();
    dense_config(&plan, opts, PathSwitches::DEFAULT, true).unwrap()
}

#[test]
fn fallback_reasons() {
    let cfg = split_cfg((8192, 4096, 128256), &Options::default());
    let dev = h200();
    let scratch = cfg.scratch_bytes();
    assert_eq!(wgmma_unfit(&cfg, &dev, true, true, cfg.v), None);
    assert_eq!(
        wgmma_unfit(&cfg, &dev, false, true, cfg.v),
        Some("switched off")
    );
    assert_eq!(
        wgmma_unfit(&cfg, &dev, true, false, cfg.v),
        Some("inputs not 16-byte aligned")
    );
    assert_eq!(
        wgmma_unfit(&cfg, &a100(), true, true, cfg.v),
        Some("not compute capability 9.0")
    );
    let mut c = cfg.clone();
    c.softcap = Some(300.0);
    assert_eq!(
        wgmma_unfit(&c, &dev, true, true, c.v),
        Some("softcap above 100 (the epilogue's tanh is exact to ~s·2⁻²¹)")
    );
    let mut c = cfg.clone();
    c.d = 4000;
    assert_eq!(
        wgmma_unfit(&c, &dev, true, true, c.v),
        Some("D not a multiple of 64")
    );
    let mut c = cfg.clone();
    c.dtype = DType::F32;
    assert_eq!(
        wgmma_gcols_classes(&c, &dev, scratch, true).unwrap_err(),
        "dtype not bf16 / f16"
    );
    let mut c = cfg.clone();
    c.label_smoothing = 0.1;
    assert_eq!(
        wgmma_forward_rows(&c, &dev, scratch, true).unwrap_err(),
        "label smoothing"
    );
    assert_eq!(wgmma_rows_unfit(&c, &dev, 0, true), Some("label smoothing"));
    let mut c = cfg.clone();
    c.want_entropy = true;
    assert_eq!(
        wgmma_forward_rows(&c, &dev, scratch, true).unwrap_err(),
        "entropy / argmax requested"
    );
    let mut c = cfg.clone();
    c.softcap = Some(0.5);
    assert!(wgmma_rows_unfit(&c, &dev, 0, true)
        .unwrap()
        .starts_with("softcap under 1"));
    let mut c = cfg.clone();
    c.dtype = DType::F16;
    assert_eq!(
        wgmma_rows_unfit(&c, &dev, 0, true),
        Some("f16 inputs (the G pass writes bf16 G)")
    );
    assert_eq!(
        wgmma_rows_unfit(&cfg, &dev, 2, true),
        Some("f16 G for d_e (the budget's f16 copy of c)")
    );
    assert_eq!(
        wgmma_forward_rows(&cfg, &dev, 1000, true).unwrap_err(),
        "scratch holds the partials of fewer than 128 rows"
    );
    assert_eq!(
        wgmma_gcols_classes(&cfg, &dev, 1024, true).unwrap_err(),
        "scratch too small for the G chunk, the f16 copy of e and the d_c temp"
    );
    // A budget with room for an f16 copy of c: f16 G for d_e, so the cuBLAS row pass.
    let small = split_cfg((12288, 576, 49152), &Options::default());
    let facts = CallFacts {
        scratch: small.scratch_bytes(),
        aligned: true,
        capturing: false,
        accumulate: false,
    };
    let s = schedule(&small, CallKind::ForwardBackward, &dev, facts);
    assert!(s.c16_copy && s.g_mode == 2 && s.try_sparse && s.split && !s.filtering);
    assert!(s.sparse_note.is_none());
    // A capturing stream: no sparse try (its choice reads the device), and the note says why.
    let capturing = CallFacts {
        capturing: true,
        ..facts
    };
    let s = schedule(&small, CallKind::ForwardBackward, &dev, capturing);
    assert!(!s.try_sparse && s.split);
    assert_eq!(s.sparse_note, Some(sparse_capture_note()));
    // An accumulating call: no sparse try either (its gather kernels overwrite the
    // gradients), and the note says why; a forward-only call never accumulates.
    let acc = CallFacts {
        accumulate: true,
        ..facts
    };
    for kind in [CallKind::ForwardBackward, CallKind::Backward] {
        let s = schedule(&small, kind, &dev, acc);
        assert!(s.accumulate && !s.try_sparse && s.split, "{kind:?}");
        assert_eq!(s.sparse_note, Some(sparse_accumulate_note()), "{kind:?}");
    }
    assert!(!schedule(&small, CallKind::Forward, &dev, acc).accumulate);
    assert_eq!(
        s.row_wgmma,
        Some(Err("f16 G for d_e (the budget's f16 copy of c)"))
    );
    let s = schedule(&small, CallKind::Backward, &dev, facts);
    assert!(s.c16_copy && s.row_wgmma.is_none() && s.forward.is_none());
    let cublas = ClassPath::Cublas("switched off".into());
    assert_eq!(
        cublas.note(&cfg, 4096),
        "class pass: cuBLAS logits then G (32 chunk(s) of up to 4096 classes; no WGMMA \
         epilogue: switched off)"
    );
    // The WGMMA forward in row groups: 128-row multiples of what the scratch holds.
    let partials = cfg.v.div_ceil(WGMMA_BN) * 8;
    assert_eq!(
        wgmma_forward_rows(&cfg, &dev, 300 * partials, true),
        Ok(256)
    );
    assert_eq!(
        wgmma_forward_note(&cfg, 256, 132),
        "forward: WGMMA GEMM with the lse in its epilogue (32 row group(s) of up to 256 rows x \
         501 class tile(s) of 256, 132 persistent blocks), a combine pass per row group"
    );
}

#[test]
fn fused_row_pass_layout() {
    let mut cfg = split_cfg((8192, 4096, 128256), &Options::exact());
    assert_eq!(fused_layout(&cfg, &h200()), None, "two-pass by default");
    cfg.row_pass = RowPass::Fused { cluster: None };
    // 128256 classes: 4 blocks of 32064 columns hold ~125 KiB each, 8 of 16032 under 100 KiB.
    assert_eq!(fused_layout(&cfg, &h200()), Some((8, 16032)));
    assert_eq!(fused_layout(&cfg, &a100()), None, "not Hopper");
    cfg.row_pass = RowPass::Fused { cluster: Some(2) };
    assert_eq!(
        fused_layout(&cfg, &h200()),
        None,
        "half a row per block does not fit"
    );
}

#[test]
fn sparse_decisions() {
    let cfg = split_cfg((8192, 4096, 128256), &Options::default());
    let sp = cfg
        .sparse
        .expect("a filtered split-dense plan has a sparse backward");
    let rows = sp.probe_rows;
    let cap = sp.capacity(rows, cfg.v) as u64;
    assert_eq!(
        probe_verdict(&cfg, &sp, rows, (10, true, cap)).unwrap_err(),
        format!("the first {rows} rows' pairs overflowed the sparse capacity of {cap}")
    );
    let dense = (sp.max_mean_kept as u64 + 1) * rows as u64;
    let why = probe_verdict(&cfg, &sp, rows, (dense, false, cap)).unwrap_err();
    assert!(
        why.starts_with(&format!("the first {rows} rows keep ")) && why.ends_with("stop paying"),
        "{why}"
    );
    let next = probe_verdict(&cfg, &sp, rows, (3 * rows as u64, false, cap)).unwrap();
    assert_eq!(
        next.chunk,
        sp.rows_after_probe(3 * rows as u64, cfg.n, cfg.v)
    );
    assert_eq!(next.cap, sp.capacity(next.chunk, cfg.v) as u64);
    assert_eq!(
        sparse_used_note(12345, 8192),
        "sparse backward: 12345 kept entries (1.5 per row), one logits GEMM"
    );
    assert_eq!(
        sparse_gave_way_note("why", true),
        "dense passes (the first chunk's logits reused): why"
    );
    assert_eq!(sparse_gave_way_note("why", false), "dense passes: why");
    assert_eq!(
        pairs_outgrew_note(100, 120),
        "the pairs outgrew the sparse capacity of 100 after the first chunk (120 asked)"
    );
    assert_eq!(reuse_probe_rows(0, 128, 384), 128);
    assert_eq!(reuse_probe_rows(256, 128, 384), 0);
    assert_eq!(reuse_probe_rows(0, 512, 384), 0);
    assert!(fold_forward(true, SEL_THREADS, (false, false, 0.0), true));
    assert!(!fold_forward(true, 256, (false, false, 0.0), true));
    assert!(!fold_forward(true, SEL_THREADS, (true, false, 0.0), true));
    assert!(!fold_forward(false, SEL_THREADS, (false, false, 0.0), true));
    assert!(fold_after_probe(true, 32, 128, 128 * 256));
    assert!(!fold_after_probe(true, 33, 128, 10));
    assert!(!fold_after_probe(true, 0, 128, 128 * 257));
    assert!(dc_zero_by_memset(100, 128256) && !dc_zero_by_memset(128256, 128256));
    assert_eq!(select_threads(256), 256);
    assert_eq!(select_threads(512), SEL_THREADS);
}

/// The engine's configuration of a bf16 call of `shape` with `opts` as `CudaBackend` makes it
/// (default knobs and switches), or the error of its plan or budget.
fn call_cfg(
    (n, d, v): (usize, usize, usize),
    opts: &Options,
    backward: bool,
) -> Result<DenseConfig> {
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
        sparse: SparseMode::Auto,
        split_de_f16: true,
        chunked_f32_grads: false,
        chunked_g16: None,
        dc_in_grad_dtype: false,
        sparse_expected: true,
    };
    let plan = plan_call(&problem, opts, &limits, knobs)?;
    dense_config(&plan, opts, PathSwitches::DEFAULT, backward)
}

#[test]
fn bench_shapes_fit_the_forward_cap_and_the_budget() {
    use super::super::workspace::WorkspaceSizes;
    let cublas = CUBLAS_WORKSPACE_BYTES as u64;
    for budget in [512u64 << 20, 64 << 20] {
        for &(n, d, v) in &SHAPES {
            for exact in [false, true] {
                let base = if exact {
                    Options::exact()
                } else {
                    Options::default()
                };
                let opts = Options {
                    workspace_budget_bytes: budget,
                    ..base
                };
                let at = format!("{n}x{d}x{v} exact {exact}, budget {budget} B");
                let (fwd, bwd) = (
                    call_cfg((n, d, v), &opts, false),
                    call_cfg((n, d, v), &opts, true),
                );
                if budget == 64 << 20 && n * d != 12288 * 576 {
                    // 32 MiB beside the cuBLAS workspace hold no class chunk of these N rows:
                    // a resource error against the whole budget, for every call.
                    for r in [fwd, bwd] {
                        match r {
                            Err(CceError::ResourceLimit { max, .. }) => assert_eq!(max, budget),
                            other => panic!("{at}: {other:?}"),
                        }
                    }
                    continue;
                }
                let (fwd, bwd) = (fwd.unwrap(), bwd.unwrap());
                let totals = [&fwd, &bwd].map(|c| WorkspaceSizes::of(c).total());
                assert!(
                    totals[0] <= forward_workspace_cap(budget),
                    "{at}: {totals:?}"
                );
                assert!(totals[0] <= FORWARD_WORKSPACE_CAP, "{at}: {totals:?}");
                for t in totals {
                    assert!(t + cublas <= budget, "{at}: {totals:?}");
                }
                // Every forward path fits the forward-only scratch: the WGMMA row groups (4
                // groups of 8192 rows at V = 256000, N = 32768; else one), the class tiles,
                // the row chunks.
                let scratch = fwd.scratch_bytes();
                let facts = CallFacts {
                    scratch,
                    aligned: true,
                    capturing: false,
                    accumulate: false,
                };
                match schedule(&fwd, CallKind::Forward, &h200(), facts).forward {
                    Some(ForwardPath::Wgmma { group }) => {
                        assert!(group * v.div_ceil(WGMMA_BN) * 8 <= scratch, "{at}");
                        assert_eq!(group, if n == 32768 { 8192 } else { n }, "{at}");
                    }
                    other => panic!("{at}: {other:?}"),
                }
                match schedule(&fwd, CallKind::Forward, &a100(), facts).forward {
                    Some(ForwardPath::ClassTiles(cf)) => assert!(cf.bytes(n) <= scratch, "{at}"),
                    other => panic!("{at}: {other:?}"),
                }
                assert!(fwd.effective_chunk_rows() * fwd.ld() * 4 <= scratch, "{at}");
                eprintln!(
                    "{at}: forward-only {} B (scratch {scratch} B), with a backward {} B; \
                     + cuBLAS {} / {} B",
                    totals[0],
                    totals[1],
                    totals[0] + cublas,
                    totals[1] + cublas
                );
            }
        }
    }
}

#[test]
fn the_cublas_workspace_counts_in_the_budget() {
    assert_eq!(plan_budget(512 << 20), 480 << 20);
    assert_eq!(plan_budget(16), 0);
    assert_eq!(forward_workspace_cap(512 << 20), FORWARD_WORKSPACE_CAP);
    assert_eq!(forward_workspace_cap(80 << 20), 48 << 20);
    // A budget under the cuBLAS workspace (tests/errors.rs: 16 B): the plan's error, against
    // the whole budget, the cuBLAS workspace in what it asks.
    let opts = Options {
        workspace_budget_bytes: 16,
        ..Options::default()
    };
    match call_cfg((1000, 256, 3000), &opts, true) {
        Err(CceError::ResourceLimit {
            resource,
            requested,
            max,
        }) => {
            assert_eq!(max, 16);
            assert!(requested > CUBLAS_WORKSPACE_BYTES as u64, "{requested}");
            assert!(
                resource.ends_with("cuBLAS workspace beside it"),
                "{resource}"
            );
        }
        other => panic!("{other:?}"),
    }
}
