//! Forward-only passes: the fused WGMMA forward in row groups and the forward over the plan's
//! class tiles on a second stream (`kernels/forward.cu` (2')).

use super::*;

/// Threads of `cce_cls_fwd_*` (one warp per row).
pub(super) const CLS_THREADS: u32 = 256;

/// Rows per block of `cce_cls_fwd_*` (one warp each).
pub(super) const CLS_ROWS_PER_BLOCK: usize = CLS_THREADS as usize / 32;

impl DenseEngine {
    /// The fused WGMMA forward of a forward-only call (`kernels/wgmma.cu`), `group` rows at a
    /// time (`schedule::wgmma_forward_rows`): per row group `cce_wgmma_lse_*` (the logits
    /// GEMM with the per-tile (max, Σexp) in its epilogue, float2 partials at `base`), then
    /// `cce_wgmma_lse_combine_*` (lse and the loss rows of `a` from the partials and the
    /// epilogue's target logits, which wait in the group's lse rows), all on the
    /// engine's stream. Its note is the schedule's (`schedule::wgmma_forward_note`).
    pub(super) fn forward_wgmma(
        &self,
        cfg: &DenseConfig,
        group: usize,
        base: u64,
        a: &RowArgs,
        (e, c): (u64, u64),
    ) -> Result<()> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let esz = cfg.dtype.size_bytes();
        let code = dtype_code(cfg.dtype)?;
        // Bias or softcap: the epilogue's extended form (`cce_wgmma_lse_x_*`).
        let ext = a.bias != 0 || a.softcap > 0.0;
        let f_lse = self.func(&format!(
            "cce_wgmma_lse{}_{code}",
            if ext { "_x" } else { "" }
        ))?;
        let f_comb = self.func(&format!("cce_wgmma_lse_combine_{code}"))?;
        let n_tiles = v.div_ceil(WGMMA_BN);
        let (v_i, d_i) = (to_i32(v, "V")?, to_i32(d, "D")?);
        let tm_c = self.tensor_map(cfg.dtype, c, v, d, WGMMA_BN)?;
        let (ordered, group_m) = (1i32, WGMMA_GROUP_M);
        for r0 in (0..n).step_by(group) {
            let rows = group.min(n - r0);
            let rows_i = to_i32(rows, "rows")?;
            let e_r = e + (r0 * d * esz) as u64;
            let tm_e = self.tensor_map(cfg.dtype, e_r, rows, d, WGMMA_BM)?;
            // The epilogue writes each row's target logit into its lse slot; the combine reads
            // it there before writing the lse.
            let (t_r, zy, _, _, _, _) = a.rows_at(r0);
            let tiles = rows.div_ceil(WGMMA_BM) * n_tiles;
            let grid = tiles.min(self.facts.sm_count.max(1)) as u32;
            let params = LseParams {
                tm_e,
                tm_c,
                rows: rows_i,
                v: v_i,
                d: d_i,
                partial: base,
                group_m,
                ordered,
                bias: a.bias,
                softcap: a.softcap,
                targets: t_r,
                zy_tile: zy,
            };
            let launch = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (WGMMA_THREADS, 1, 1),
                shared_mem_bytes: WGMMA_SMEM_BYTES as u32,
            };
            // SAFETY: LseParams is WG_LSE_PARAMS in wgmma.cu (two 128-byte tensor maps by
            // value, then i32 N, V, D, the float2 partials, i32 group_m, ordered_epi, the bias
            // (V values of the input dtype, checked by `run`, or 0), f32 softcap and the
            // group's `rows` i32 targets, its `rows` f32 lse rows for the target logits); the
            // maps describe live
            // [rows, D] / [V, D] 16-bit row-major buffers (sizes checked by `run`, addresses
            // 16-byte aligned and D a multiple of 64, checked by
            // `schedule::wgmma_forward_rows`), so TMA reads nothing outside them; the partials
            // (rows x n_tiles float2) fit the scratch at `base`
            // (`schedule::wgmma_forward_rows`); 384 threads and WGMMA_SMEM_BYTES of dynamic
            // shared memory, the attribute set at construction; grid ≤ the tile count, so
            // every CTA has a tile.
            unsafe { self.launch_params(&self.stream, f_lse, launch, &params) }?;
            // SAFETY: the partials at `base` hold the group's rows x n_tiles and zy (its lse
            // rows) its target logits, written by the launch above (stream order); e_r and c are the live
            // bf16 / f16 inputs (checked by `run`), the row arrays of `a` hold N values.
            unsafe {
                self.launch_combine(f_comb, base, (r0, rows, n_tiles), (e_r, c, d), a, zy)?;
            }
        }
        Ok(())
    }

    /// The forward of a forward-only call over the class tiles of `cf` (`forward.cu` "(2')"):
    /// tile `i`'s logits GEMM writes buffer `i mod 2` on the engine's stream, its row
    /// reductions (`cce_cls_fwd_*`) read it on the row stream; events order each buffer's
    /// reuse, and the engine's stream waits for the row stream at the end. `base` is the
    /// scratch (both buffers, then the row state).
    pub(super) fn forward_by_classes(
        &self,
        cfg: &DenseConfig,
        cf: cce_core::ClassForward,
        base: u64,
        a: &RowArgs,
        (e, c): (u64, u64),
    ) -> Result<()> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let esz = cfg.dtype.size_bytes();
        let f = self.func(&format!("cce_cls_fwd_{}", dtype_code(cfg.dtype)?))?;
        let rs = self.row_stream()?;
        let bufs = [base, base + cf.buffer_bytes() as u64];
        let state = base + cf.state_offset() as u64;
        let ldk = cf.ld();
        let ldk_i = ldk as i64;
        let v_i = to_i32(v, "V")?;
        let event = || self.ctx.new_event(None).map_err(drv);
        let gemm_done = [event()?, event()?];
        let rows_done = [event()?, event()?];
        let tiles_per_group = v.div_ceil(cf.classes);
        // Every class tile starts at a multiple of 4 (the bias's 8-byte loads): checked before
        // anything is queued on the row stream.
        if a.bias != 0 && cf.classes < v && !cf.classes.is_multiple_of(4) {
            return Err(CceError::InvalidOption {
                name: "ClassForward",
                reason: format!("{} classes per tile is not a multiple of 4", cf.classes),
            });
        }
        // From here on the row stream may hold queued work on the scratch: whatever happens,
        // the engine's stream waits for it before returning (the caller frees the scratch in
        // the engine's stream order).
        let queued = (|| -> Result<()> {
            let mut i = 0usize;
            for r0 in (0..n).step_by(cf.rows) {
                let rows = cf.rows.min(n - r0);
                let (t_r, lse_r, rest_r, loss_r, ent_r, am_r) = a.rows_at(r0);
                let state_r = state + (r0 * cce_core::plan::CLASS_FORWARD_STATE_BYTES) as u64;
                let rows_i = to_i32(rows, "rows")?;
                for (k, c0) in (0..v).step_by(cf.classes).enumerate() {
                    let kk = cf.classes.min(v - c0);
                    let b = i % 2;
                    if i >= 2 {
                        // Buffer b is free once the row reductions of tile i - 2 have read it.
                        self.stream.wait(&rows_done[b]).map_err(drv)?;
                    }
                    self.gemm_logits(
                        (kk, d, rows),
                        cfg.dtype,
                        (
                            c + (c0 * d * esz) as u64,
                            e + (r0 * d * esz) as u64,
                            bufs[b],
                        ),
                        ldk,
                    )?;
                    gemm_done[b].record(&self.stream).map_err(drv)?;
                    rs.wait(&gemm_done[b]).map_err(drv)?;
                    let (k_i, c0_i) = (to_i32(kk, "classes")?, to_i32(c0, "class")?);
                    let first = (k == 0) as i32;
                    let last = (k + 1 == tiles_per_group) as i32;
                    let params = ClsParams {
                        l: bufs[b],
                        ldk: ldk_i,
                        k: k_i,
                        c0: c0_i,
                        v: v_i,
                        rows: rows_i,
                        bias: a.bias,
                        softcap: a.softcap,
                        targets: t_r,
                        alpha: a.alpha,
                        lambda: a.lambda,
                        state: state_r,
                        first,
                        last,
                        lse: lse_r,
                        rest: rest_r,
                        loss: loss_r,
                        entropy: ent_r,
                        argmax: am_r,
                    };
                    let grid = u32::try_from(rows.div_ceil(CLS_ROWS_PER_BLOCK)).map_err(|_| {
                        CceError::ResourceLimit {
                            resource: "CUDA grid blocks".into(),
                            requested: rows.div_ceil(CLS_ROWS_PER_BLOCK) as u64,
                            max: u32::MAX as u64,
                        }
                    })?;
                    let launch = LaunchConfig {
                        grid_dim: (grid, 1, 1),
                        block_dim: (CLS_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: ClsParams is CLS_PARAMS in forward.cu; buffer b holds the tile's
                    // rows x ldk f32 logits, written by the GEMM this stream just waited for;
                    // the tile-relative [N] arrays (targets, lse, loss, entropy, argmax) start
                    // at row r0 and hold `rows` more; the state holds 6 f32 per row at r0
                    // (inside the scratch, checked by the caller); the bias is [V] with c0 a
                    // multiple of 4 (checked before the loop) for its 8-byte loads.
                    unsafe { self.launch_params(rs, f, launch, &params) }?;
                    rows_done[b].record(rs).map_err(drv)?;
                    i += 1;
                }
            }
            Ok(())
        })();
        // Everything after (the loss reduction, the caller's reads, freeing) follows the row
        // stream.
        let joined = self.stream.join(rs).map_err(drv);
        queued.and(joined)
    }

    /// The second stream ([`DenseEngine`]'s `row_stream`), made on first use.
    pub(super) fn row_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.row_stream.get() {
            return Ok(s);
        }
        self.ctx.bind_to_thread().map_err(drv)?;
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range().map_err(drv)?;
        let s = self.ctx.new_stream_with_priority(greatest).map_err(drv)?;
        Ok(self.row_stream.get_or_init(|| s))
    }
}

kernel_params! {
    /// `CLS_PARAMS` of `cce_cls_fwd_*` (`kernels/forward.cu` (2')): a class tile's logits
    /// folded into the running per-row state; the per-row arrays offset to the tile's rows.
    ClsParams {
        l: u64,
        ldk: i64,
        k: i32,
        c0: i32,
        v: i32,
        rows: i32,
        bias: u64,
        softcap: f32,
        targets: u64,
        alpha: f32,
        lambda: f32,
        state: u64,
        first: i32,
        last: i32,
        lse: u64,
        rest: u64,
        loss: u64,
        entropy: u64,
        argmax: u64,
    }
}
