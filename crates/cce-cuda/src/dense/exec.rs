//! The executor of a dense call: checks the buffers, then runs the passes in order.

use super::*;

pub(super) enum Mode<'a> {
    Forward,
    ForwardBackward,
    Backward {
        lse: &'a CudaSlice<u8>,
        rest: &'a CudaSlice<u8>,
    },
}

impl DenseEngine {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        up: Option<&DenseUpstream<'_>>,
        fwd: Option<&mut DenseForwardOut<'_>>,
        grads: &mut DenseGradOut<'_>,
        mode: Mode<'_>,
    ) -> Result<DenseStats> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let esz = dt.size_bytes();
        let code = dtype_code(dt)?;
        let g_ty = cfg.g_dtype();
        let out_ty = cfg.grad_dtype();
        let ld = ws.ld;
        let ldg = ld * 4 / g_ty.size_bytes();
        let chunk = ws.chunk_rows;
        if ld != cfg.ld() || chunk != cfg.effective_chunk_rows() {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        // Buffer size checks (the kernels trust them).
        let need = |s: &CudaSlice<u8>, bytes: usize, what: &'static str| -> Result<()> {
            if s.len() < bytes {
                Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("at least {bytes} bytes"),
                    got: format!("{} bytes", s.len()),
                })
            } else {
                Ok(())
            }
        };
        need(inp.e, n * d * esz, "e")?;
        need(inp.c, v * d * esz, "c")?;
        need(inp.targets, n * 4, "targets")?;
        if let Some(b) = inp.bias {
            need(b, v * esz, "bias")?;
        }
        if inp.bias.is_some() != cfg.has_bias {
            return Err(CceError::InvalidOption {
                name: "bias",
                reason: "config and inputs disagree on the bias".into(),
            });
        }
        let backward = !matches!(mode, Mode::Forward);
        let forward = !matches!(mode, Mode::Backward { .. });
        if let Some(o) = fwd.as_deref() {
            need(
                o.loss,
                if cfg.reduction == Reduction::None {
                    n * 4
                } else {
                    4
                },
                "loss",
            )?;
            need(o.lse, n * 4, "lse")?;
            need(o.rest, n * 4, "rest_mass")?;
            if let Some(x) = o.entropy.as_deref() {
                need(x, n * 4, "entropy")?;
            }
            if let Some(x) = o.argmax.as_deref() {
                need(x, n * 4, "argmax")?;
            }
        } else if forward {
            return Err(CceError::InvalidOption {
                name: "forward outputs",
                reason: "missing".into(),
            });
        }
        let mut upstream_rows = 0u64;
        let mut dl_scalar = 0.0f32;
        let mut dlse_ptr = 0u64;
        if backward {
            let up = up.ok_or_else(|| CceError::InvalidOption {
                name: "upstream",
                reason: "missing".into(),
            })?;
            match up.d_loss {
                DenseDLoss::Scalar(g) => {
                    dl_scalar = match cfg.reduction {
                        Reduction::Mean if inp.n_valid > 0 => g / inp.n_valid as f32,
                        Reduction::Mean => 0.0,
                        _ => g,
                    }
                }
                DenseDLoss::PerRow(s) => {
                    need(s, n * 4, "d_loss")?;
                    upstream_rows = self.ptr(s);
                }
            }
            if let Some(h) = up.d_lse {
                need(h, n * 4, "d_lse")?;
                dlse_ptr = self.ptr(h);
            }
            let missing = |name: &'static str| CceError::InvalidOption {
                name,
                reason: "output missing".into(),
            };
            if cfg.compute_d_e {
                let s = grads.d_e.as_deref().ok_or_else(|| missing("d_e"))?;
                need(s, n * d * out_ty.size_bytes(), "d_e")?;
            }
            if cfg.compute_d_c {
                let s = grads.d_c.as_deref().ok_or_else(|| missing("d_c"))?;
                need(s, v * d * out_ty.size_bytes(), "d_c")?;
                if cfg.has_bias {
                    let s = grads.d_bias.as_deref().ok_or_else(|| missing("d_bias"))?;
                    need(s, v * out_ty.size_bytes(), "d_bias")?;
                }
            }
        }
        if let Mode::Backward { lse, rest } = mode {
            need(lse, n * 4, "lse")?;
            need(rest, n * 4, "rest_mass")?;
        }

        let split = cfg.chunk_classes.is_some();
        // Split dense skips nothing (allowed: "an implementation may skip fewer"): its dense
        // GEMMs gain nothing from zeroed entries, and the threshold's histogram pass cost 3-7%
        // at the seed shape (docs/perf-log.md), so filtered calls run exactly like exact ones.
        let filtering = backward && cfg.filtering() && !split;
        if split && ws.tau.len() < n * 4 {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let tau_ptr = self.ptr(&ws.tau);
        let fused = if matches!(mode, Mode::ForwardBackward) && !split {
            self.fused_layout(cfg)
        } else {
            None
        };
        let softcap = cfg.softcap.unwrap_or(0.0);
        let alpha = cfg.label_smoothing;
        let lambda = cfg.z_loss;
        let filter_on = filtering as i32;
        let delta_fixed =
            (cfg.filter.max_dropped_mass as f64 * cce_core::filter::FIXED_POINT_ONE).floor() as u64;
        let (tile_rows, tile_classes) = (
            to_i32(cfg.tile.0, "tile rows")?,
            to_i32(cfg.tile.1, "tile classes")?,
        );
        let n_ctiles = to_i32(cfg.class_tiles(), "class tiles")?;
        let v_i = to_i32(v, "V")?;
        let ld_i = ld as i64;

        let e_ptr = self.ptr(inp.e);
        let c_ptr = self.ptr(inp.c);
        let bias_ptr = self.opt_ptr(inp.bias);
        let t_ptr = self.ptr(inp.targets);
        let layout = cfg.row_layout();
        let g_mode = if backward { cfg.g_mode() } else { 0 };
        let ws_base = self.ptr(&ws.logits);
        let l_ptr = if split {
            ws_base + layout.logits as u64
        } else {
            ws_base
        };
        if split && ws.logits.len() < layout.end {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let kept_ptr = self.ptr(&ws.kept);
        let dropped_ptr = self.ptr(&ws.dropped);
        let flags_ptr = self.ptr(&ws.flags);
        let edges_ptr = self.ptr(&ws.edges);
        let row_loss_ptr = self.ptr(&ws.row_loss);
        let (lse_ptr, rest_ptr, loss_rows_ptr, ent_ptr, am_ptr) = match fwd.as_deref() {
            Some(o) => (
                self.ptr(o.lse),
                self.ptr(o.rest),
                if cfg.reduction == Reduction::None {
                    self.ptr(o.loss)
                } else {
                    row_loss_ptr
                },
                if cfg.want_entropy {
                    self.opt_ptr(o.entropy.as_deref())
                } else {
                    0
                },
                if cfg.want_argmax {
                    self.opt_ptr(o.argmax.as_deref())
                } else {
                    0
                },
            ),
            None => (0, 0, 0, 0, 0),
        };
        let (saved_lse_ptr, saved_rest_ptr) = match mode {
            Mode::Backward { lse, rest } => (self.ptr(lse), self.ptr(rest)),
            _ => (lse_ptr, rest_ptr),
        };
        let de_ptr = if backward && cfg.compute_d_e {
            self.opt_ptr(grads.d_e.as_deref())
        } else {
            0
        };
        let (dc_acc_ptr, dc_acc_ty) = if backward && cfg.compute_d_c {
            match ws.dc_acc.as_ref() {
                Some(a) => (self.ptr(a), DType::F32),
                None => (self.opt_ptr(grads.d_c.as_deref()), DType::F32),
            }
        } else {
            (0, DType::F32)
        };
        let dbias_acc_ptr = if backward && cfg.compute_d_c && cfg.has_bias {
            match ws.dbias_acc.as_ref() {
                Some(a) => self.ptr(a),
                None => self.opt_ptr(grads.d_bias.as_deref()),
            }
        } else {
            0
        };

        let row_args = RowArgs {
            ld: ld_i,
            v: v_i,
            bias: bias_ptr,
            softcap,
            alpha,
            lambda,
            targets: t_ptr,
            lse: lse_ptr,
            rest: rest_ptr,
            loss_rows: loss_rows_ptr,
            entropy: ent_ptr,
            argmax: am_ptr,
        };
        let try_sparse = backward && split && cfg.sparse.is_some() && cfg.filtering();
        if backward {
            if filtering || try_sparse {
                self.stream.memset_zeros(&mut ws.flags).map_err(drv)?;
                self.stream.memset_zeros(&mut ws.kept).map_err(drv)?;
                self.stream.memset_zeros(&mut ws.dropped).map_err(drv)?;
            }
            if dbias_acc_ptr != 0 {
                match ws.dbias_acc.as_mut() {
                    Some(a) => self.stream.memset_zeros(a).map_err(drv)?,
                    None => {
                        if let Some(b) = grads.d_bias.as_deref_mut() {
                            self.stream.memset_zeros(b).map_err(drv)?
                        }
                    }
                }
            }
        }

        let mut stats = DenseStats {
            chunk_rows: chunk,
            chunks: n.div_ceil(chunk),
            row_pass: Some(match fused {
                Some((cs, _)) => RowPass::Fused { cluster: Some(cs) },
                None => RowPass::TwoPass,
            }),
            filtered: filtering,
            ..Default::default()
        };

        let f_fwd = self.func(&format!("cce_dense_fwd_{code}"))?;
        // Sparse backward first (filtered split-dense calls); `None`: the dense passes below.
        let mut sparse_kept = None;
        // Rows of a first chunk whose logits (and forward rows) a sparse backward that gave
        // way left valid at `l_ptr`: the dense passes start with them instead of recomputing.
        let mut reuse_rows = 0usize;
        if try_sparse {
            let sa = SparseArgs {
                forward,
                saved_lse: saved_lse_ptr,
                saved_rest: saved_rest_ptr,
                dl_rows: upstream_rows,
                dl_scalar,
                dlse: dlse_ptr,
                e: e_ptr,
                c: c_ptr,
                d_e: de_ptr,
                d_c: if cfg.compute_d_c {
                    self.opt_ptr(grads.d_c.as_deref())
                } else {
                    0
                },
                d_bias: if cfg.compute_d_c && cfg.has_bias {
                    self.opt_ptr(grads.d_bias.as_deref())
                } else {
                    0
                },
                delta_fixed,
                tile: (tile_rows, tile_classes, n_ctiles),
            };
            match self.sparse_backward(cfg, ws, &row_args, &sa)? {
                Ok(kept) => {
                    stats.sparse = Some(format!(
                        "sparse backward: {kept} kept entries ({:.1} per row), one logits GEMM",
                        kept as f64 / n as f64
                    ));
                    sparse_kept = Some(kept);
                }
                Err((why, rows)) => {
                    // The sparse backward's logits sit at the start of the scratch; the row
                    // pass's too unless an f16 copy of c comes first (layout.logits > 0).
                    if layout.logits == 0 && rows <= chunk {
                        reuse_rows = rows;
                    }
                    stats.sparse = Some(format!(
                        "dense passes{}: {why}",
                        if reuse_rows > 0 {
                            " (the first chunk's logits reused)"
                        } else {
                            ""
                        }
                    ))
                }
            }
        }
        let sparse_used = sparse_kept.is_some();
        stats.filtered = filtering || sparse_used;
        let f_bwd = self.func(&match g_mode {
            2 => format!("cce_dense_bwd_f16s_{code}"),
            _ => format!("cce_dense_bwd_{code}"),
        })?;
        // Split dense, f16 G for d_e: c in f16 (bf16 inputs: a copy scaled by 2^kc).
        let (c_de_ptr, c_de_scale) = if g_mode == 2 && dt == DType::BF16 && !sparse_used {
            let kc = self.c16_copy(cfg, ws, inp.c, ws_base + layout.c16 as u64)?;
            (ws_base + layout.c16 as u64, 2f32.powi(-kc))
        } else {
            (c_ptr, 1.0f32)
        };
        let tmp_ptr = ws_base + layout.tmp as u64;
        let rs_ptr = ws_base + layout.rs as u64;
        let f_colsum = self.func(&format!("cce_dense_colsum_{code}"))?;
        // Forward only through the fused WGMMA forward where it applies (no logits in memory).
        let mut class_forward_used = false;
        if matches!(mode, Mode::Forward) {
            if let Ok(group) = self.wgmma_forward_rows(cfg, ws.logits.len(), (e_ptr, c_ptr)) {
                stats.forward =
                    Some(self.forward_wgmma(cfg, group, ws_base, &row_args, (e_ptr, c_ptr))?);
                stats.chunk_rows = group;
                stats.chunks = n.div_ceil(group);
                class_forward_used = true;
            }
        }
        // Forward only with the plan's class tiles: the GEMMs and the row reductions overlap.
        if let (Mode::Forward, Some(cf), false) = (&mode, cfg.class_forward, class_forward_used) {
            if ws.logits.len() < cf.bytes(n) {
                return Err(CceError::InvalidOption {
                    name: "workspace",
                    reason: "allocated for another configuration".into(),
                });
            }
            self.forward_by_classes(cfg, cf, ws_base, &row_args, (e_ptr, c_ptr))?;
            stats.forward = Some(format!(
                "forward: {} GEMM tile(s) of {} rows x {} classes through two buffers, row reductions on a second stream",
                n.div_ceil(cf.rows) * v.div_ceil(cf.classes),
                cf.rows.min(n),
                cf.classes.min(v)
            ));
            class_forward_used = true;
        }
        let dense_chunks = if sparse_used || class_forward_used {
            0
        } else {
            n
        };
        // (first row, rows, logits and forward rows already there) per chunk.
        let chunks: Vec<(usize, usize, bool)> = if reuse_rows > 0 {
            std::iter::once((0, reuse_rows, true))
                .chain(
                    (reuse_rows..dense_chunks)
                        .step_by(chunk)
                        .map(|r0| (r0, chunk.min(n - r0), false)),
                )
                .collect()
        } else {
            (0..dense_chunks)
                .step_by(chunk)
                .map(|r0| (r0, chunk.min(n - r0), false))
                .collect()
        };
        if reuse_rows > 0 {
            stats.chunks = chunks.len();
        }
        // Split dense's row pass through the WGMMA epilogue (chunks whose logits a sparse
        // backward left in place keep the row kernels).
        let wg_rows = if split && forward && backward && chunks.iter().any(|c| !c.2) {
            match self.wgmma_rows_unfit(cfg, g_mode, (e_ptr, c_ptr)) {
                None => {
                    let wg_chunks = chunks.iter().filter(|c| !c.2).count();
                    stats.row_pass_note = Some(format!(
                        "row pass: WGMMA GEMM with the lse partials and f16 e^(z - max) in its \
                         epilogue, then G in place ({wg_chunks} chunk(s) of up to {} rows, no f32 \
                         logits in memory)",
                        chunk.min(n)
                    ));
                    // The row kernels write every row's τ (0: split dense's row pass never
                    // filters), which the cuBLAS class pass reads; these chunks write none,
                    // so zero them all (a sparse probe may have left thresholds there).
                    self.stream.memset_zeros(&mut ws.tau).map_err(drv)?;
                    Some(self.tensor_map(dt, c_ptr, v, d, WGMMA_BN)?)
                }
                Some(why) => {
                    stats.row_pass_note = Some(format!(
                        "row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA \
                         epilogue: {why})"
                    ));
                    None
                }
            }
        } else {
            None
        };
        let mut prof = if chunks.is_empty() {
            None
        } else {
            PhaseTimer::new(&self.stream, self.switches.profile)?
        };
        for (ci, &(r0, rows, reused)) in chunks.iter().enumerate() {
            let rows_u = rows as u32;
            let e_r = e_ptr + (r0 * d * esz) as u64;
            let off4 = (r0 * 4) as u64;
            let t_r = t_ptr + off4;
            let row0 = r0 as i64;
            // G's row stride in elements: ld for the WGMMA row pass (16-bit q then G, rows of
            // ld·2 bytes), ld·4 / sizeof(G) written over the f32 logits otherwise.
            let mut ldg_c = ldg;
            // The WGMMA row pass's map, for the chunks it takes (not one whose logits are there).
            let wg_tm = if reused { None } else { wg_rows.as_ref() };
            if wg_tm.is_none() && !reused {
                // (1) logits.
                self.gemm_logits((v, d, rows), dt, (c_ptr, e_r, l_ptr), ld)?;
                PhaseTimer::mark(&mut prof, "logits GEMM")?;
            }
            if let Some(tm_c) = wg_tm {
                // (1)+(2)+(3): logits, lse and G without f32 logits.
                self.row_pass_wgmma(
                    cfg,
                    tm_c,
                    (r0, rows, chunk),
                    (e_r, c_ptr, l_ptr, ld),
                    &row_args,
                    (
                        saved_lse_ptr,
                        saved_rest_ptr,
                        upstream_rows,
                        dl_scalar,
                        dlse_ptr,
                    ),
                    &mut prof,
                )?;
                ldg_c = ld;
            } else if let Some((cs, slice)) = fused {
                // (2)+(3) fused.
                let f = self.func(&format!("cce_dense_fused_{code}_c{cs}"))?;
                let slice_i = slice as i32;
                let lse_r = lse_ptr + off4;
                let rest_r = rest_ptr + off4;
                let loss_r = loss_rows_ptr + off4;
                let ent_r = if ent_ptr != 0 { ent_ptr + off4 } else { 0 };
                let am_r = if am_ptr != 0 { am_ptr + off4 } else { 0 };
                let dl_r = if upstream_rows != 0 {
                    upstream_rows + off4
                } else {
                    0
                };
                let dlse_r = if dlse_ptr != 0 { dlse_ptr + off4 } else { 0 };
                let kept_r = kept_ptr + off4;
                let dropped_r = dropped_ptr + off4;
                let cfg_l = LaunchConfig {
                    grid_dim: (rows_u * cs as u32, 1, 1),
                    block_dim: (FUSED_THREADS, 1, 1),
                    shared_mem_bytes: (slice * 4) as u32,
                };
                let mut b = self.stream.launch_builder(f);
                b.arg(&l_ptr)
                    .arg(&ld_i)
                    .arg(&v_i)
                    .arg(&slice_i)
                    .arg(&bias_ptr)
                    .arg(&softcap)
                    .arg(&t_r)
                    .arg(&alpha)
                    .arg(&lambda)
                    .arg(&dl_r)
                    .arg(&dl_scalar)
                    .arg(&dlse_r)
                    .arg(&filter_on)
                    .arg(&edges_ptr)
                    .arg(&delta_fixed)
                    .arg(&lse_r)
                    .arg(&rest_r)
                    .arg(&loss_r)
                    .arg(&ent_r)
                    .arg(&am_r)
                    .arg(&kept_r)
                    .arg(&dropped_r)
                    .arg(&flags_ptr)
                    .arg(&row0)
                    .arg(&tile_rows)
                    .arg(&tile_classes)
                    .arg(&n_ctiles);
                // SAFETY: argument types and order match FUSED_PARAMS in chunked.cu; every
                // pointer is a live device buffer of the checked size (the chunk's rows of the
                // [N] arrays start at offset r0); the grid is rows·cs blocks, a multiple of the
                // compile-time cluster size; dynamic shared memory slice·4 ≤ the attribute set
                // at construction.
                unsafe { b.launch(cfg_l) }.map_err(drv)?;
                PhaseTimer::mark(&mut prof, "fused rows")?;
            } else {
                if forward && !reused {
                    // (2) forward rows.
                    self.fwd_rows(f_fwd, &row_args, r0, rows, l_ptr)?;
                    PhaseTimer::mark(&mut prof, "forward rows")?;
                }
                if backward {
                    // (3) G in place.
                    let lse_r = saved_lse_ptr + off4;
                    let rest_r = saved_rest_ptr + off4;
                    let dl_r = if upstream_rows != 0 {
                        upstream_rows + off4
                    } else {
                        0
                    };
                    let dlse_r = if dlse_ptr != 0 { dlse_ptr + off4 } else { 0 };
                    let kept_r = kept_ptr + off4;
                    let dropped_r = dropped_ptr + off4;
                    let tau_r = if split { tau_ptr + off4 } else { 0u64 };
                    let rs_arg = if g_mode == 2 { rs_ptr } else { 0u64 };
                    let cfg_l = LaunchConfig {
                        grid_dim: (rows_u, 1, 1),
                        block_dim: (BWD_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut b = self.stream.launch_builder(f_bwd);
                    b.arg(&l_ptr)
                        .arg(&ld_i)
                        .arg(&v_i)
                        .arg(&bias_ptr)
                        .arg(&softcap)
                        .arg(&t_r)
                        .arg(&lse_r)
                        .arg(&rest_r)
                        .arg(&dl_r)
                        .arg(&dl_scalar)
                        .arg(&dlse_r)
                        .arg(&alpha)
                        .arg(&lambda)
                        .arg(&filter_on)
                        .arg(&edges_ptr)
                        .arg(&delta_fixed)
                        .arg(&kept_r)
                        .arg(&dropped_r)
                        .arg(&flags_ptr)
                        .arg(&row0)
                        .arg(&tile_rows)
                        .arg(&tile_classes)
                        .arg(&n_ctiles)
                        .arg(&tau_r)
                        .arg(&rs_arg);
                    // SAFETY: argument types and order match BWD_PARAMS; L holds the chunk's
                    // logits (stream order); lse rows were written by the forward kernel above
                    // or given by the caller ([N] checked); flags hold row_tiles x class_tiles.
                    unsafe { b.launch(cfg_l) }.map_err(drv)?;
                    PhaseTimer::mark(&mut prof, "backward rows (G)")?;
                }
            }
            if backward {
                // (4) d_e rows of the chunk.
                if cfg.compute_d_e {
                    let de_r = de_ptr + (r0 * d * out_ty.size_bytes()) as u64;
                    match g_mode {
                        0 => self.gemm_de(
                            (v, d, rows),
                            (dt, g_ty, out_ty),
                            (c_ptr, l_ptr, de_r),
                            ldg_c,
                        )?,
                        _ => {
                            // f16 G' (scaled per row) times c in f16 into f32 rows, then
                            // d_e = rows · 2^−s_i · 2^−kc in the gradient dtype.
                            self.gemm(
                                false,
                                false,
                                (d, rows, v),
                                (c_de_ptr, DType::F16, d),
                                (l_ptr, DType::F16, ld * 2),
                                (1.0, 0.0),
                                (tmp_ptr, DType::F32, d),
                            )?;
                            self.de_finish(out_ty, tmp_ptr, rs_ptr, c_de_scale, de_r, (rows, d))?;
                        }
                    }
                    PhaseTimer::mark(&mut prof, "d_e GEMM")?;
                    if dt != DType::F32 {
                        // (4') the target's entry of the 16-bit G, exact in d_e.
                        let g16 = if g_mode == 2 || dt == DType::F16 {
                            1
                        } else {
                            2
                        };
                        let (g_ld, rs) = if g_mode == 2 {
                            (ld * 2, rs_ptr)
                        } else {
                            (ldg_c, 0u64)
                        };
                        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
                        self.target_fix(
                            code,
                            (l_ptr, g_ld, g16, rs),
                            (rows, t_r, saved_lse_ptr + off4, saved_rest_ptr + off4),
                            (at(upstream_rows), dl_scalar, at(dlse_ptr)),
                            (alpha, lambda, v_i, softcap, bias_ptr),
                            (e_r, c_ptr, d),
                            (de_r, out_ty),
                        )?;
                        PhaseTimer::mark(&mut prof, "d_e target entry")?;
                    }
                }
                // (5) d_c += Gᵀ E_r, (6) d_bias (chunked dense; split dense: the class pass).
                if cfg.compute_d_c && !split {
                    let beta = if ci == 0 { 0.0 } else { 1.0 };
                    self.gemm_dc(
                        (v, d, rows),
                        (dt, g_ty, dc_acc_ty),
                        (e_r, l_ptr, dc_acc_ptr),
                        ldg,
                        (1.0, beta),
                    )?;
                    if cfg.has_bias {
                        let ldg_i = ldg as i64;
                        let rows_i = rows as i32;
                        let cfg_l = LaunchConfig {
                            grid_dim: (v.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                            block_dim: (COLSUM_THREADS, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut b = self.stream.launch_builder(f_colsum);
                        let one = 1.0f32;
                        b.arg(&l_ptr)
                            .arg(&ldg_i)
                            .arg(&rows_i)
                            .arg(&v_i)
                            .arg(&dbias_acc_ptr)
                            .arg(&one);
                        // SAFETY: matches COLSUM_PARAMS; G is rows x ldg of g_ty written by the
                        // row kernel (stream order); the accumulator holds V f32 (zeroed).
                        unsafe { b.launch(cfg_l) }.map_err(drv)?;
                    }
                    PhaseTimer::mark(&mut prof, "d_c GEMM (+ d_bias)")?;
                }
            }
        }
        PhaseTimer::report(prof, &format!("dense row pass ({} chunk(s))", chunks.len()))?;

        if split && backward && cfg.compute_d_c && !sparse_used {
            stats.class_pass = Some(self.class_pass(
                cfg,
                ws,
                inp,
                ClassPassArgs {
                    lse: saved_lse_ptr,
                    rest: saved_rest_ptr,
                    dl_rows: upstream_rows,
                    dl_scalar,
                    dlse: dlse_ptr,
                    d_c: self.opt_ptr(grads.d_c.as_deref()),
                    d_bias_acc: dbias_acc_ptr,
                },
            )?);
        }

        // Loss reduction.
        if forward && cfg.reduction != Reduction::None {
            let scale = match cfg.reduction {
                Reduction::Mean if inp.n_valid > 0 => 1.0 / inp.n_valid as f64,
                Reduction::Mean => 0.0,
                _ => 1.0,
            };
            let out = fwd.as_deref().map(|o| self.ptr(o.loss)).unwrap_or(0);
            let n_i = to_i32(n, "N")?;
            let mut b = self.stream.launch_builder(self.func("cce_dense_sum_rows")?);
            b.arg(&row_loss_ptr).arg(&n_i).arg(&scale).arg(&out);
            // SAFETY: matches cce_dense_sum_rows; row_loss holds N f32 written above; out is
            // the [1] f32 loss (checked).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
        }

        if backward {
            // Final conversions of the f32 accumulators (the sparse products write the
            // gradients directly).
            if cfg.compute_d_c && !cfg.grad_f32 && !sparse_used {
                // The accumulators hold count f32, the outputs count elements (checked sizes).
                let convert =
                    |src: u64, dst: u64, count: usize| self.convert_f32(code, src, dst, count);
                if !split {
                    let dc_out = self.opt_ptr(grads.d_c.as_deref());
                    convert(dc_acc_ptr, dc_out, v * d)?;
                }
                if cfg.has_bias {
                    let db_out = self.opt_ptr(grads.d_bias.as_deref());
                    convert(dbias_acc_ptr, db_out, v)?;
                }
            }
            if filtering || sparse_used {
                let stats_ptr = self.ptr(&ws.stats);
                let n_i = to_i32(n, "N")?;
                let n_flags = (cfg.row_tiles() * cfg.class_tiles()) as i64;
                let mut b = self.stream.launch_builder(self.func("cce_dense_stats")?);
                b.arg(&kept_ptr)
                    .arg(&dropped_ptr)
                    .arg(&t_ptr)
                    .arg(&n_i)
                    .arg(&flags_ptr)
                    .arg(&n_flags)
                    .arg(&stats_ptr);
                // SAFETY: matches cce_dense_stats; kept/dropped/targets hold N values, flags
                // n_flags u32, stats 8 f64.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (1024, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
                let host = self.read_back::<64>(&ws.stats)?;
                let s: Vec<f64> = host
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect();
                let kept = s[0] as u64;
                let active = s[4] as u64;
                let entries = active * v as u64;
                stats.active_rows = active;
                stats.entries_kept = 2 * kept;
                stats.entries_skipped = 2 * entries.saturating_sub(kept);
                let tiles = (cfg.row_tiles() * cfg.class_tiles()) as u64;
                let visited = s[3] as u64;
                stats.tiles_visited = 2 * visited;
                stats.tiles_skipped = 2 * tiles.saturating_sub(visited);
                stats.dropped_mass_max = s[2];
                stats.dropped_mass_mean = if inp.n_valid > 0 {
                    (s[1] / inp.n_valid as f64).min(s[2])
                } else {
                    0.0
                };
            }
        }
        Ok(stats)
    }
}
