//! Split dense's class pass (`kernels/classes.cu`): per chunk of classes, the logits of all
//! rows, `G` from the saved lse in f16 with one power-of-two scale, `d_c` and `d_bias`.

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
}

impl DenseEngine {
    /// Split dense's class pass (`chunked.cu`, "Split dense"): per class chunk, the logits of
    /// all rows recomputed and `G` from the saved lse (f16 with a power-of-two scale, or f32):
    /// one WGMMA kernel with `G` in its epilogue where [`DenseEngine::wgmma_gcols_classes`]
    /// allows (f16 `G` at the start of the scratch, the f16 copy of `e` and the f32 `d_c`
    /// temp at its end: chunks as large as the scratch holds, [`DenseConfig::gcols_layout`]),
    /// else, per chunk of the plan's classes, a cuBLAS logits GEMM and `cce_split_gcols_*`;
    /// then `d_c` of the chunk's classes by GEMM (through the WGMMA epilogue in sub-chunks of
    /// the layout's `dc_classes` when the f32 temp of bf16 outputs holds fewer classes than a
    /// chunk), written in the gradient dtype; `d_bias` added to its f32 accumulator (or the
    /// f32 output, zeroed by the caller). Returns the note of how `G` was computed
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
        let esz = dt.size_bytes();
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
        let out_ty = cfg.grad_dtype();
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
        let t_ptr = self.ptr(inp.targets);
        let bias_ptr = self.opt_ptr(inp.bias);
        let tau_ptr = self.ptr(&ws.tau);
        let n_i = to_i32(n, "N")?;
        let v_i = to_i32(v, "V")?;

        // Scales: max |e| (bf16 inputs only: the f16 copy) and the bound of |G|.
        // max |e| (bf16 inputs: for the scale of its f16 copy) and max |G coefficient|.
        let e_count = if dt == DType::BF16 { n * d } else { 0 };
        let (max_e, max_g) = self.split_scales(
            ws,
            (e_ptr, dt, e_count),
            n * d,
            Some(ScaleRows {
                targets: t_ptr,
                dl_rows: a.dl_rows,
                dl_scalar: a.dl_scalar,
                dlse: a.dlse,
                lse: a.lse,
                rest: a.rest,
                alpha: cfg.label_smoothing,
                lambda: cfg.z_loss,
                n: n_i,
                v: v_i,
            }),
        )?;
        // Powers of two: max |2^ke · e| ≤ 2^15 and max |2^kg · G| ≤ 2^14 (f16 max 65504).
        let (ke, kg) = if gdt == DType::F16 {
            (
                if dt == DType::BF16 {
                    pow2_to(max_e, 15)
                } else {
                    0
                },
                pow2_to(max_g, 14),
            )
        } else {
            (0, 0)
        };
        let e_scale = 2f32.powi(ke);
        let g_scale = 2f32.powi(kg);
        let alpha = 2f32.powi(-ke - kg);
        let inv_g = 2f32.powi(-kg);

        // E' = f16(2^ke · e) for bf16 inputs.
        let e_op = if dt == DType::BF16 {
            let dst = l_ptr + e16_off as u64;
            self.to_f16(e_ptr, dst, n * d, e_scale)?;
            dst
        } else {
            e_ptr
        };

        let ldg = ldk * 4 / gdt.size_bytes();
        let f_g = self.func(&format!("cce_split_gcols_{code}"))?;
        let f_colsum = self.func(&format!("cce_dense_colsum_{}", dtype_code(gdt)?))?;
        let softcap = cfg.softcap.unwrap_or(0.0);
        let ld_i = ldk as i64;
        // Classes per chunk, G's row stride (elements of gdt), classes per d_c GEMM: through
        // the WGMMA epilogue its layout's (sub-chunks when the f32 d_c temp of bf16 outputs
        // holds fewer classes than a chunk, each starting on a 16-byte column of G); else the
        // plan's chunk, one d_c GEMM per chunk.
        let (step, ldg_step, dc_step) = path.steps(kmax, ldg);
        let tms = match path {
            ClassPath::Wgmma(_) => Some((
                self.tensor_map(dt, e_ptr, n, d, WGMMA_BM)?,
                format!(
                    "cce_wgmma_gcols{}_{code}",
                    if softcap > 0.0 { "_cap" } else { "" }
                ),
            )),
            ClassPath::Cublas(_) => None,
        };
        let mut prof = PhaseTimer::new(&self.stream, self.switches.profile)?;
        for k0 in (0..v).step_by(step) {
            let kc = step.min(v - k0);
            let kc_i = kc as i32;
            let k0_i = k0 as i32;
            let c_k = c_ptr + (k0 * d * esz) as u64;
            if let Some((tm_e, name)) = &tms {
                // (a)+(b) in one kernel: the chunk's logits stay in registers.
                self.launch_wgmma_gcols(
                    name,
                    (tm_e, self.tensor_map(dt, c_k, kc, d, WGMMA_BN)?),
                    (n, kc, d, k0, v),
                    (l_ptr, ldg_step),
                    (bias_ptr, softcap, t_ptr, a.lse, a.rest),
                    (a.dl_rows, a.dl_scalar, a.dlse),
                    (cfg.label_smoothing, cfg.z_loss, g_scale),
                )?;
                PhaseTimer::mark(&mut prof, "WGMMA logits + G")?;
            } else {
                // (a) logits of the chunk's classes for every row.
                self.gemm_logits((kc, d, n), dt, (c_k, e_ptr, l_ptr), ldk)?;
                PhaseTimer::mark(&mut prof, "logits GEMM")?;
                // (b) G in place.
                let mut b = self.stream.launch_builder(f_g);
                b.arg(&l_ptr)
                    .arg(&ld_i)
                    .arg(&kc_i)
                    .arg(&k0_i)
                    .arg(&v_i)
                    .arg(&bias_ptr)
                    .arg(&softcap)
                    .arg(&t_ptr)
                    .arg(&a.lse)
                    .arg(&a.rest)
                    .arg(&tau_ptr)
                    .arg(&a.dl_rows)
                    .arg(&a.dl_scalar)
                    .arg(&a.dlse)
                    .arg(&cfg.label_smoothing)
                    .arg(&cfg.z_loss)
                    .arg(&g_scale)
                    .arg(&n_i);
                // SAFETY: matches GCOLS_PARAMS; L holds n rows of ldk f32 (ldk a multiple of 8,
                // the workspace 256-byte aligned: 16-byte row starts) written by the GEMM above
                // (stream order); lse / tau / targets / upstream rows hold N values; bias holds V.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (n.div_ceil(GC_ROWS) as u32, 1, 1),
                        block_dim: (GC_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
                PhaseTimer::mark(&mut prof, "G columns")?;
            }
            // (c) d_c of the chunk, complete (through the f32 temp for a bf16 output), in
            // sub-chunks of at most dc_step classes.
            for s0 in (0..kc).step_by(dc_step) {
                let ks = dc_step.min(kc - s0);
                let g_s = l_ptr + (s0 * gdt.size_bytes()) as u64;
                let dc_k = a.d_c + ((k0 + s0) * d * out_ty.size_bytes()) as u64;
                if cfg.dc_tmp_bytes() > 0 {
                    let tmp = l_ptr + tmp_off as u64;
                    self.gemm_dc(
                        (ks, d, n),
                        (gdt, gdt, DType::F32),
                        (e_op, g_s, tmp),
                        ldg_step,
                        (alpha, 0.0),
                    )?;
                    // tmp holds ks·d ≤ dc_step·d f32 (at tmp_off, size checked above), d_c
                    // rows k0+s0.. hold ks·d gradient elements.
                    self.convert_f32(code, tmp, dc_k, ks * d)?;
                } else {
                    self.gemm_dc(
                        (ks, d, n),
                        (gdt, gdt, out_ty),
                        (e_op, g_s, dc_k),
                        ldg_step,
                        (alpha, 0.0),
                    )?;
                }
            }
            // (d) d_bias of the chunk.
            if cfg.has_bias {
                let ldg_i = ldg_step as i64;
                let acc_k = a.d_bias_acc + (k0 * 4) as u64;
                let mut b = self.stream.launch_builder(f_colsum);
                b.arg(&l_ptr)
                    .arg(&ldg_i)
                    .arg(&n_i)
                    .arg(&kc_i)
                    .arg(&acc_k)
                    .arg(&inv_g);
                // SAFETY: matches COLSUM_PARAMS; G is n x ldg_step of gdt (written above), the
                // accumulator holds V f32 (zeroed), offset to the chunk's kc columns.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (kc.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                        block_dim: (COLSUM_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
            }
            PhaseTimer::mark(&mut prof, "d_c GEMM (+ convert, d_bias)")?;
        }
        let chunks = v.div_ceil(step);
        PhaseTimer::report(prof, &format!("split dense class pass ({chunks} chunk(s))"))?;
        Ok(path.note(cfg, kmax))
    }
}
