//! Split dense's class pass (`kernels/classes.cu`): per chunk of classes, the logits of all
//! rows, `G` from the saved lse in f16 with one power-of-two scale, `d_c` and `d_bias`. The
//! scales stay on the device: the kernels and the `d_c` GEMM read them through pointers.

use super::schedule::ClassPath;
use super::*;

/// Threads and rows (one warp each) per block of `cce_split_gcols_*`.
pub(super) const GC_THREADS: u32 = 256;
pub(super) const GC_ROWS: usize = GC_THREADS as usize / 32;

/// Device addresses the class pass reads (0 = absent) besides the inputs and workspace.
#[derive(Clone, Copy)]
pub(super) struct ClassPassArgs {
    /// f32 `[N]` lse (forward output or the caller's saved one).
    pub(super) lse: u64,
    /// f32 `[N]` `1 − p_y`, saved beside the lse.
    pub(super) rest: u64,
    /// f32 `[N]` per-row upstream loss gradient, or 0 (then `dl_scalar`).
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    /// f32 `[N]` upstream lse gradient, or 0.
    pub(super) dlse: u64,
    /// `d_c` output `[V, D]` in the gradient dtype.
    pub(super) d_c: u64,
    /// f32 `[V]` `d_bias` accumulator (or the f32 output), when a bias is given.
    pub(super) d_bias_acc: u64,
    /// Add `d_c` to the output's contents (f32 outputs, the schedule's `accumulate`): the
    /// `d_c` GEMMs' beta is 1.
    pub(super) accumulate: bool,
}

impl DenseEngine {
    /// Split dense's class pass (`classes.cu`, "Split dense"): per class chunk, the logits of
    /// all rows recomputed and `G` from the saved lse (f16 with a power-of-two scale, or f32):
    /// one WGMMA kernel with `G` in its epilogue where `schedule::wgmma_gcols_classes`
    /// allows (f16 `G` at the start of the scratch, the f16 copy of `e` and the f32 `d_c`
    /// temp at its end: chunks as large as the scratch holds, [`DenseConfig::gcols_layout`]),
    /// else, per chunk of the plan's classes, a cuBLAS logits GEMM and `cce_split_gcols_*`;
    /// then `d_c` of the chunk's classes by GEMM (through the WGMMA epilogue in sub-chunks of
    /// the layout's `dc_classes` when the f32 temp of bf16 outputs holds fewer classes than a
    /// chunk), written in the gradient dtype (added to the f32 output's contents when
    /// `a.accumulate`); `d_bias` added to its f32 accumulator (or the f32 output, zeroed by
    /// the caller unless the call accumulates). Returns the note of how `G` was computed
    /// ([`DenseStats::class_pass`]).
    pub(super) fn class_pass(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        path: &ClassPath,
        a: ClassPassArgs,
    ) -> Result<String> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let code = dtype_code(dt)?;
        let kmax = cfg.chunk_classes.unwrap_or(v).clamp(1, v);
        if kmax > cce_core::plan::SPLIT_DENSE_MAX_CLASSES {
            return Err(CceError::InvalidOption {
                name: "chunk_classes",
                reason: format!(
                    "{kmax} > {} (the plan's largest class chunk, cce_core::plan::SPLIT_DENSE_MAX_CLASSES)",
                    cce_core::plan::SPLIT_DENSE_MAX_CLASSES
                ),
            });
        }
        let ldk = cfg.ld_classes();
        let gdt = cfg.class_pass_dtype();
        let l_ptr = self.ptr(&ws.logits);
        let e_ptr = self.ptr(inp.e);
        let c_ptr = self.ptr(inp.c);
        // The scratch (byte offsets): through the WGMMA epilogue its layout (f16 G [N, ldg]
        // at 0; the f16 copy of e and the f32 d_c temp of dc_classes classes at the end); else
        // the f32 logits [N, ldk] at 0 (G written over them), e's copy after them, the temp of
        // kmax classes after it.
        let (g_end, e16_off, tmp_bytes) = match path {
            ClassPath::Wgmma(l) => (
                n * l.ldg * 2,
                l.e16_off,
                if cfg.dc_tmp_bytes() > 0 {
                    l.dc_classes * d * 4
                } else {
                    0
                },
            ),
            ClassPath::Cublas(_) => (n * ldk * 4, n * ldk * 4, cfg.dc_tmp_bytes()),
        };
        let tmp_off = e16_off + cfg.e16_bytes();
        if g_end > e16_off || ws.logits.len() < tmp_off + tmp_bytes {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let x0 = ClassCtx {
            cfg,
            a,
            l_ptr,
            e_ptr,
            c_ptr,
            e_op: e_ptr,
            t_ptr: self.ptr(inp.targets),
            bias_ptr: self.opt_ptr(inp.bias),
            tau_ptr: self.ptr(&ws.tau),
            n_i: to_i32(n, "N")?,
            v_i: to_i32(v, "V")?,
            ldk,
            gdt,
            softcap: cfg.softcap.unwrap_or(0.0),
            scales: None,
            steps: (0, 0),
            tmp_off,
            wgmma: None,
        };
        let scales = self.class_scales(&x0, ws)?;
        // E' = f16(2^ke · e) for bf16 inputs (f16 G: bf16 and f16 inputs).
        let e_op = match scales {
            Some(s) if dt == DType::BF16 => {
                let dst = l_ptr + e16_off as u64;
                self.to_f16(e_ptr, dst, n * d, s.up_x())?;
                dst
            }
            _ => e_ptr,
        };
        // Classes per chunk, G's row stride (elements of gdt), classes per d_c GEMM: through
        // the WGMMA epilogue its layout's (sub-chunks when the f32 d_c temp of bf16 outputs
        // holds fewer classes than a chunk, each starting on a 16-byte column of G); else the
        // plan's chunk, one d_c GEMM per chunk.
        let (step, ldg_step, dc_step) = path.steps(kmax, ldk * 4 / gdt.size_bytes());
        let wgmma = match path {
            ClassPath::Wgmma(_) => Some((
                self.tensor_map(dt, e_ptr, n, d, WGMMA_BM)?,
                format!(
                    "cce_wgmma_gcols{}_{code}",
                    if x0.softcap > 0.0 { "_cap" } else { "" }
                ),
            )),
            ClassPath::Cublas(_) => None,
        };
        let x = ClassCtx {
            e_op,
            scales,
            steps: (ldg_step, dc_step),
            wgmma,
            ..x0
        };
        let f_g = self.func(&format!("cce_split_gcols_{code}"))?;
        let f_colsum = self.func(&format!("cce_dense_colsum_{}", dtype_code(gdt)?))?;
        let mut prof = PhaseTimer::new(&self.stream, self.switches.profile)?;
        for k0 in (0..v).step_by(step) {
            let kc = step.min(v - k0);
            self.class_chunk_g(&x, f_g, (k0, kc), &mut prof)?;
            self.class_chunk_dc(&x, f_colsum, (k0, kc))?;
            PhaseTimer::mark(&mut prof, "d_c GEMM (+ convert, d_bias)")?;
        }
        let chunks = v.div_ceil(step);
        PhaseTimer::report(prof, &format!("split dense class pass ({chunks} chunk(s))"))?;
        Ok(path.note(cfg, kmax))
    }

    /// The class pass's powers of two on the device ([`ScaleSet::ClassPass`]): `2^ke` with
    /// max |2^ke · e| ≤ 2^15 (bf16 inputs, for the f16 copy of `e`; `ke = 0` for f16 inputs)
    /// and `2^kg` with max |2^kg · G| ≤ 2^14 (f16 max 65504), from max |e| and the bound of
    /// |G| over the rows (two launches, no host sync), with `2^−kg` and `2^(−ke−kg)`. `None`
    /// for an f32 `G` (f32 inputs): every factor 1, nothing launched.
    fn class_scales(
        &self,
        x: &ClassCtx<'_>,
        ws: &mut DenseWorkspace,
    ) -> Result<Option<DeviceScales>> {
        let (cfg, a) = (x.cfg, &x.a);
        let (n, d, dt) = (cfg.n, cfg.d, cfg.dtype);
        if x.gdt != DType::F16 {
            return Ok(None);
        }
        // max |e| (bf16 inputs: for the scale of its f16 copy; none else: ke = 0) and max |G
        // coefficient|.
        let e_count = if dt == DType::BF16 { n * d } else { 0 };
        let s = self.split_scales(
            ws,
            ScaleSet::ClassPass,
            (x.e_ptr, dt, e_count),
            n * d,
            Some(ScaleRows {
                targets: x.t_ptr,
                dl_rows: a.dl_rows,
                dl_scalar: a.dl_scalar,
                dlse: a.dlse,
                lse: a.lse,
                rest: a.rest,
                alpha: cfg.label_smoothing,
                lambda: cfg.z_loss,
                n: x.n_i,
                v: x.v_i,
            }),
        )?;
        Ok(Some(s))
    }

    /// `G` of classes `k0..k0 + kc` for every row, at the start of the scratch: one WGMMA
    /// kernel (the chunk's logits stay in registers), or (a) the cuBLAS logits and (b)
    /// `cce_split_gcols_*` (`f_g`) in place.
    fn class_chunk_g(
        &self,
        x: &ClassCtx<'_>,
        f_g: &CudaFunction,
        (k0, kc): (usize, usize),
        prof: &mut Option<PhaseTimer>,
    ) -> Result<()> {
        let (cfg, a) = (x.cfg, &x.a);
        let (n, d, v, dt) = (cfg.n, cfg.d, cfg.v, cfg.dtype);
        let c_k = x.c_ptr + (k0 * d * dt.size_bytes()) as u64;
        if let Some((tm_e, name)) = &x.wgmma {
            // (a)+(b) in one kernel: the chunk's logits stay in registers.
            self.launch_wgmma_gcols(
                name,
                (tm_e, self.tensor_map(dt, c_k, kc, d, WGMMA_BN)?),
                (n, kc, d, k0, v),
                (x.l_ptr, x.steps.0),
                (x.bias_ptr, x.softcap, x.t_ptr, a.lse, a.rest),
                (a.dl_rows, a.dl_scalar, a.dlse),
                (cfg.label_smoothing, cfg.z_loss, x.g_scale()),
            )?;
            return PhaseTimer::mark(prof, "WGMMA logits + G");
        }
        // (a) logits of the chunk's classes for every row.
        self.gemm_logits((kc, d, n), dt, (c_k, x.e_ptr, x.l_ptr), x.ldk)?;
        PhaseTimer::mark(prof, "logits GEMM")?;
        // (b) G in place.
        let params = GColsParams {
            l: x.l_ptr,
            ld: x.ldk as i64,
            kc: kc as i32,
            k0: k0 as i32,
            v: x.v_i,
            bias: x.bias_ptr,
            softcap: x.softcap,
            targets: x.t_ptr,
            lse: a.lse,
            rest: a.rest,
            tau: x.tau_ptr,
            dl_rows: a.dl_rows,
            dl_scalar: a.dl_scalar,
            dlse: a.dlse,
            alpha: cfg.label_smoothing,
            lambda: cfg.z_loss,
            g_scale: x.g_scale(),
            n: x.n_i,
        };
        let launch = LaunchConfig {
            grid_dim: (n.div_ceil(GC_ROWS) as u32, 1, 1),
            block_dim: (GC_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: GColsParams is GCOLS_PARAMS; L holds n rows of ldk f32 (ldk a multiple of 8,
        // the workspace 256-byte aligned: 16-byte row starts) written by the GEMM above
        // (stream order); lse / tau / targets / upstream rows hold N values; bias holds V;
        // g_scale is one f32 of ws.scales written by `class_scales` (stream order) or 0.
        unsafe { self.launch_params(&self.stream, f_g, launch, &params) }?;
        PhaseTimer::mark(prof, "G columns")
    }

    /// (c) `d_c` of classes `k0..k0 + kc`, complete (through the f32 temp for a bf16
    /// output), in sub-chunks of at most the schedule's `dc_classes`; (d) their `d_bias` by
    /// `cce_dense_colsum_*` (`f_colsum`).
    fn class_chunk_dc(
        &self,
        x: &ClassCtx<'_>,
        f_colsum: &CudaFunction,
        (k0, kc): (usize, usize),
    ) -> Result<()> {
        let cfg = x.cfg;
        let (n, d) = (cfg.n, cfg.d);
        let (gdt, out_ty) = (x.gdt, cfg.grad_dtype());
        let code = dtype_code(cfg.dtype)?;
        let (ldg_step, dc_step) = x.steps;
        // alpha = 2^(−ke−kg) and beta = 0 (1 when accumulating into the f32 output) read from
        // the device (f16 G), else 1 and 0 (or 1) on the host.
        let acc = x.a.accumulate;
        let scalars = match x.scales {
            Some(s) => GemmScalars::Device {
                alpha: s.down_xg(),
                beta: if acc { s.one() } else { s.zero() },
            },
            None => GemmScalars::Host(1.0, if acc { 1.0 } else { 0.0 }),
        };
        for s0 in (0..kc).step_by(dc_step) {
            let ks = dc_step.min(kc - s0);
            let g_s = x.l_ptr + (s0 * gdt.size_bytes()) as u64;
            let dc_k = x.a.d_c + ((k0 + s0) * d * out_ty.size_bytes()) as u64;
            if cfg.dc_tmp_bytes() > 0 {
                // bf16 outputs (never accumulating: `check_grads`): the temp then a convert.
                let tmp = x.l_ptr + x.tmp_off as u64;
                let tys = (gdt, gdt, DType::F32);
                self.gemm_dc((ks, d, n), tys, (x.e_op, g_s, tmp), ldg_step, scalars)?;
                // tmp holds ks·d ≤ dc_step·d f32 (at tmp_off, size checked by `class_pass`),
                // d_c rows k0+s0.. hold ks·d gradient elements.
                self.convert_f32(code, tmp, dc_k, ks * d)?;
            } else {
                let tys = (gdt, gdt, out_ty);
                self.gemm_dc((ks, d, n), tys, (x.e_op, g_s, dc_k), ldg_step, scalars)?;
            }
        }
        if cfg.has_bias {
            let params = ColsumParams {
                g: x.l_ptr,
                ldg: ldg_step as i64,
                rows: x.n_i,
                cols: kc as i32,
                acc: x.a.d_bias_acc + (k0 * 4) as u64,
                scale: x.scales.map_or(0, |s| s.down_g()),
            };
            let launch = LaunchConfig {
                grid_dim: (kc.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                block_dim: (COLSUM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: ColsumParams is COLSUM_PARAMS; G is n x ldg_step of gdt (written by
            // `class_chunk_g`, stream order), the accumulator holds V f32 (zeroed, or the
            // caller's f32 d_bias when accumulating), offset to the chunk's kc columns; scale
            // is one f32 of ws.scales (stream order) or 0.
            unsafe { self.launch_params(&self.stream, f_colsum, launch, &params) }?;
        }
        Ok(())
    }
}

/// What every class chunk of a call shares.
#[derive(Clone)]
struct ClassCtx<'a> {
    cfg: &'a DenseConfig,
    a: ClassPassArgs,
    /// The scratch (`G` at its start), `e`, `c`, `e`'s operand of the `d_c` product (its f16
    /// copy for bf16 inputs), targets, bias, thresholds.
    l_ptr: u64,
    e_ptr: u64,
    c_ptr: u64,
    e_op: u64,
    t_ptr: u64,
    bias_ptr: u64,
    tau_ptr: u64,
    n_i: i32,
    v_i: i32,
    /// Row stride of the cuBLAS pass's f32 logits; dtype of `G` and `e`'s operand.
    ldk: usize,
    gdt: DType,
    softcap: f32,
    /// The device factors of f16 `G` (`G`'s scale, the `d_c` product's, `d_bias`'s); `None`
    /// for f32 `G` (factors 1).
    scales: Option<DeviceScales>,
    /// `G`'s row stride in elements of `gdt`, classes per `d_c` GEMM.
    steps: (usize, usize),
    /// Byte offset of the f32 `d_c` temp in the scratch.
    tmp_off: usize,
    /// The WGMMA pass's map of `e` and kernel name.
    wgmma: Option<(TmaDesc, String)>,
}

impl ClassCtx<'_> {
    /// Device address of `G`'s f32 scale `2^kg`, or 0 (the kernels read 1).
    fn g_scale(&self) -> u64 {
        self.scales.map_or(0, |s| s.up_g())
    }
}

/// `GCOLS_PARAMS` of `cce_split_gcols_*` (`kernels/classes.cu`).
struct GColsParams {
    l: u64,
    ld: i64,
    kc: i32,
    k0: i32,
    v: i32,
    bias: u64,
    softcap: f32,
    targets: u64,
    lse: u64,
    rest: u64,
    tau: u64,
    dl_rows: u64,
    dl_scalar: f32,
    dlse: u64,
    alpha: f32,
    lambda: f32,
    /// `const float*`: G's scale in device memory, or 0 (1).
    g_scale: u64,
    n: i32,
}

impl KernelParams for GColsParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.l)
            .arg(&self.ld)
            .arg(&self.kc)
            .arg(&self.k0)
            .arg(&self.v)
            .arg(&self.bias)
            .arg(&self.softcap)
            .arg(&self.targets)
            .arg(&self.lse)
            .arg(&self.rest)
            .arg(&self.tau)
            .arg(&self.dl_rows)
            .arg(&self.dl_scalar)
            .arg(&self.dlse)
            .arg(&self.alpha)
            .arg(&self.lambda)
            .arg(&self.g_scale)
            .arg(&self.n);
    }
}
