//! The WGMMA kernels' launches (`kernels/wgmma.cu`, sm_90a): their tiles and shared memory,
//! the TMA tensor maps, split dense's row pass through the epilogue, the combine pass and the
//! class pass's `G` epilogue.

use super::*;

/// Threads of `cce_wgmma_lse_*` (producer warpgroup + 2 consumer warpgroups).
pub(super) const WGMMA_THREADS: u32 = 384;

/// Tile of `cce_wgmma_lse_*`: rows of E, rows of C (classes), K-step (`wgmma.cu`).
pub(super) const WGMMA_BM: usize = 128;
pub(super) const WGMMA_BN: usize = 256;
pub(super) const WGMMA_BK: usize = 64;

/// Dynamic shared memory of `cce_wgmma_lse_*`: 4 stages of (128 + 256) x 64 16-bit values,
/// 1024 bytes of alignment slack, 8 mbarriers.
pub(super) const WGMMA_SMEM_BYTES: usize = 4 * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 + 1024 + 8 * 8;

/// Dynamic shared memory of the WGMMA kernels with f16 outputs (`cce_wgmma_lseq*`,
/// `cce_wgmma_gcols*`): the stages, 1024 bytes of alignment slack, the mbarriers padded to
/// 1024 bytes, then a 64 x 256 f16 output staging buffer for their TMA stores (`wgmma.cu`
/// `store_f16_tile`).
pub(super) const WGMMA_SMEM_OUT_BYTES: usize =
    4 * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 + 1024 + 1024 + 64 * WGMMA_BN * 2;

/// Row tiles per group of the grouped tile order (16 measured best, 8 and 32 the same).
pub(super) const WGMMA_GROUP_M: i32 = 16;

/// Threads (one warp per row) of `cce_wgmma_lse_combine_*`.
pub(super) const WGMMA_COMBINE_THREADS: u32 = 256;

/// Threads (one warp per 256-column tile of a row) of `cce_wgmma_qrows_g*`.
pub(super) const WGMMA_QROWS_THREADS: u32 = 256;

/// A `CUtensorMap` as a kernel argument: the 128 opaque bytes `cuTensorMapEncodeTiled`
/// wrote, passed by value (`const __grid_constant__ TmaDesc` in `wgmma.cu`, 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(super) struct TmaDesc([u64; 16]);

// SAFETY: `TmaDesc` is plain old data (16 u64, `repr(C)`, no padding, no pointers the device
// dereferences as Rust values) with the size (128) and alignment (64) of the kernel's
// `struct __align__(64) TmaDesc { u64 w[16]; }` parameter; the driver copies its bytes into
// the parameter space.
unsafe impl cudarc::driver::DeviceRepr for TmaDesc {}

impl DenseEngine {
    /// Split dense's row pass for rows `r0..r0 + rows` of a forward-and-backward call through
    /// the WGMMA epilogue (`kernels/wgmma.cu` (3)); `chunk` the plan's chunk rows, whose
    /// `chunk·ld·4`-byte logits region at `l_ptr` holds, in order, q then `G` (`rows x ld`
    /// 16-bit, row stride `ld`), the float2 partials (`rows x ceil(V/256)`) and the target
    /// logits (`rows` f32). Launches `cce_wgmma_lseq[_x]_bf16` (logits, per-tile (max, Σexp),
    /// f16 `e^{z − max}`), `cce_wgmma_lse_combine_bf16` (lse, loss rows and `z_y` of `a`), then
    /// `cce_wgmma_qrows_g[_cap]_bf16` (`G` in place, from the lse at `up.0` with the upstream
    /// gradients `up.1..`; skipped without `d_e`), on the engine's stream. `d_e` then reads `G`
    /// with row stride `ld`.
    /// The caller checked `schedule::wgmma_rows_unfit`.
    #[allow(clippy::too_many_arguments)]
    ///
    /// With `g16` (`Schedule::row_g16`) `G` is written as f16 times `2^kg` beside an f16
    /// copy of the chunk's rows of `e` times `2^ke` (the chunk's [`ScaleSet::RowChunk`]:
    /// max |e| of the chunk, the `G` bound of its rows); returns those factors and the copy's
    /// address for the chunk's `d_c` product.
    pub(super) fn row_pass_wgmma(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        tm_c: &TmaDesc,
        (r0, rows, chunk, g16): (usize, usize, usize, bool),
        (e_r, c, l_ptr, ld): (u64, u64, u64, usize),
        a: &RowArgs,
        (lse, rest, dl_rows, dl_scalar, dlse): (u64, u64, u64, f32, u64),
        prof: &mut Option<PhaseTimer>,
    ) -> Result<Option<(DeviceScales, u64)>> {
        let (d, v) = (cfg.d, cfg.v);
        let n_tiles = v.div_ceil(WGMMA_BN);
        // The regions of `chunk` rows (`DenseConfig::wgmma_chunk_rows`) fit the logits region
        // of the plan's rows of f32.
        let o = cfg.wgmma_row_offsets(chunk);
        let region = cfg.effective_chunk_rows() * ld * 4;
        if rows > chunk || o.end > region || (g16 && !cfg.row_e16()) || ld != cfg.ld() {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "the WGMMA row pass's regions do not fit the logits chunk".into(),
            });
        }
        let (q, partial) = (l_ptr, l_ptr + o.partial as u64);
        let zy = l_ptr + o.zy as u64;
        let ext = a.bias != 0 || a.softcap > 0.0;
        // With f16 G for d_c, q as its q9 code (2⁻¹⁰ relative instead of bf16's 2⁻⁹: the
        // d_c rows of confident rows' targets are sums of entries as small as the target's).
        let f_lse = self.func(match (ext, g16) {
            (false, false) => "cce_wgmma_lseq_bf16",
            (true, false) => "cce_wgmma_lseq_x_bf16",
            (false, true) => "cce_wgmma_lseq_q9_bf16",
            (true, true) => "cce_wgmma_lseq_x_q9_bf16",
        })?;
        let f_comb = self.func("cce_wgmma_lse_combine_bf16")?;
        let f_g = self.func(match (a.softcap > 0.0, g16) {
            (false, false) => "cce_wgmma_qrows_g_bf16",
            (true, false) => "cce_wgmma_qrows_g_cap_bf16",
            (false, true) => "cce_wgmma_qrows_g_q9_bf16",
            (true, true) => "cce_wgmma_qrows_g_cap_q9_bf16",
        })?;
        let (rows_i, v_i, d_i) = (to_i32(rows, "rows")?, to_i32(v, "V")?, to_i32(d, "D")?);
        let n_tiles_i = to_i32(n_tiles, "class tiles")?;
        let ldq = ld as i64;
        let tm_e = self.tensor_map(cfg.dtype, e_r, rows, d, WGMMA_BM)?;
        let tm_q = self.tensor_map_out(q, rows, v, ld)?;
        let grid = (rows.div_ceil(WGMMA_BM) * n_tiles).min(self.facts.sm_count.max(1)) as u32;
        let (ordered, group_m) = (1i32, WGMMA_GROUP_M);
        let t_r = a.rows_at(r0).0;
        let params = LseqParams {
            lse: LseParams {
                tm_e,
                tm_c: *tm_c,
                rows: rows_i,
                v: v_i,
                d: d_i,
                partial,
                group_m,
                ordered,
                bias: a.bias,
                softcap: a.softcap,
                targets: t_r,
                zy_tile: zy,
            },
            tm_q,
        };
        let launch = LaunchConfig {
            grid_dim: (grid.max(1), 1, 1),
            block_dim: (WGMMA_THREADS, 1, 1),
            shared_mem_bytes: WGMMA_SMEM_OUT_BYTES as u32,
        };
        // SAFETY: LseqParams is WG_LSEQ_PARAMS in wgmma.cu (WG_LSE_PARAMS, then q's 128-byte
        // tensor map by value); the maps describe live [rows, D] / [V, D] bf16 row-major
        // buffers (sizes checked by `run`, 16-byte aligned, D a multiple of 64:
        // `schedule::wgmma_rows_unfit`), so TMA reads nothing outside them; q's map ([rows, V]
        // f16, row stride ld·2 bytes, ld ≥ V), the partials (rows x n_tiles float2) and zy
        // (rows f32, the target logits) lie in the chunk's logits region (checked above), and
        // TMA stores write nothing outside the map; 384 threads and WGMMA_SMEM_OUT_BYTES of dynamic shared memory, the attribute
        // set at construction; grid ≤ the tile count, so every CTA has a tile.
        unsafe { self.launch_params(&self.stream, f_lse, launch, &params) }?;
        PhaseTimer::mark(prof, "WGMMA logits + lse partials + q")?;
        // SAFETY: the partials and the target logits zy (`rows` f32 in the chunk's region,
        // checked above) were written by the launch above (stream order); e_r and c are the
        // live bf16 inputs (checked by `run`), the row arrays of `a` hold N values.
        unsafe {
            self.launch_combine(f_comb, partial, (r0, rows, n_tiles), (e_r, c, d), a, zy)?;
        }
        PhaseTimer::mark(prof, "combine (lse, loss)")?;
        if !cfg.compute_d_e && cfg.chunk_classes.is_some() {
            // Split dense's row-pass G only feeds d_e (the class pass recomputes its own);
            // chunked dense's also feeds d_c and d_bias.
            return Ok(None);
        }
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        let (lse_g, rest_g, dl_r, dlse_r) = (lse + off4, rest + off4, at(dl_rows), at(dlse));
        let g16 = if g16 {
            // The chunk's factors (max |e| of its rows, the G bound of its rows from the
            // combine's lse and rest), then its rows of e in f16.
            let count = rows * d;
            let s = self.split_scales(
                ws,
                ScaleSet::RowChunk,
                (e_r, DType::BF16, count),
                count,
                Some(ScaleRows {
                    targets: t_r,
                    dl_rows: dl_r,
                    dl_scalar,
                    dlse: dlse_r,
                    lse: lse_g,
                    rest: rest_g,
                    alpha: 0.0,
                    lambda: a.lambda,
                    n: rows_i,
                    v: v_i,
                }),
            )?;
            let e16 = l_ptr + o.e16 as u64;
            self.to_f16(e_r, e16, count, s.up_x())?;
            PhaseTimer::mark(prof, "f16 scales + e rows")?;
            Some((s, e16))
        } else {
            None
        };
        let warps = WGMMA_QROWS_THREADS as usize / 32;
        let params = QRowsParams {
            q,
            ldq,
            v: v_i,
            n_tiles: n_tiles_i,
            partial,
            lse: lse_g,
            zy,
            rest: rest_g,
            targets: t_r,
            dl_rows: dl_r,
            dl_scalar,
            dlse: dlse_r,
            lambda: a.lambda,
            softcap: a.softcap,
            g_scale: g16.map_or(0, |(s, _)| s.up_g()),
        };
        let launch = LaunchConfig {
            grid_dim: (rows as u32, n_tiles.div_ceil(warps) as u32, 1),
            block_dim: (WGMMA_QROWS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: QRowsParams is WG_QROWS_PARAMS; q holds rows x ld f16 written by the WGMMA
        // launch (columns < V; a thread's 8-column group ends at or before ld, ld a multiple
        // of 8), rewritten in place as bf16; partials, zy and the lse (written by the combine,
        // or the caller's) hold the chunk's rows; the upstream arrays are [N] offset to r0 or
        // 0; grid (rows, ceil(n_tiles / 8)) with n_tiles / 8 ≤ 65535
        // (`schedule::wgmma_rows_unfit`); g_scale is 0 or one f32 of ws.scales written by
        // `split_scales` above (stream order).
        unsafe { self.launch_params(&self.stream, f_g, launch, &params) }?;
        PhaseTimer::mark(prof, "G from q")?;
        Ok(g16)
    }

    /// One launch of `cce_wgmma_lse_combine_*` (`f`) over rows `r0..r0 + rows` (one warp per
    /// row): lse from the float2 partials at `partial` (`rows x n_tiles`), the target logit
    /// from `zy` (`rows` f32: the lse epilogue's, so that `lse − z_y` cancels the rounding the
    /// row's tensor-core logits share) or, where `zy` is 0, as the dot product of the rows of
    /// `e_r` (the group's first row) and `c` (`d` columns), then the lse and loss rows of `a`
    /// at row `r0`.
    ///
    /// # Safety
    /// `partial` must hold the rows' partials and `zy` (unless 0) their target logits, written
    /// before on the engine's stream; `e_r` (`rows x d`) and `c` (`V x d`) live 16-bit inputs
    /// of `f`'s dtype with `d` even; the per-row arrays of `a` hold at least `r0 + rows`
    /// values, its bias `V` or 0.
    pub(super) unsafe fn launch_combine(
        &self,
        f: &CudaFunction,
        partial: u64,
        (r0, rows, n_tiles): (usize, usize, usize),
        (e_r, c, d): (u64, u64, usize),
        a: &RowArgs,
        zy: u64,
    ) -> Result<()> {
        let (t_r, lse_r, rest_r, loss_r, _, _) = a.rows_at(r0);
        let (rows_i, n_tiles_i, d_i) = (
            to_i32(rows, "rows")?,
            to_i32(n_tiles, "class tiles")?,
            to_i32(d, "D")?,
        );
        let rows_per_block = WGMMA_COMBINE_THREADS as usize / 32;
        let blocks =
            u32::try_from(rows.div_ceil(rows_per_block)).map_err(|_| CceError::ResourceLimit {
                resource: "CUDA grid blocks".into(),
                requested: rows.div_ceil(rows_per_block) as u64,
                max: u32::MAX as u64,
            })?;
        let params = CombineParams {
            partial,
            rows: rows_i,
            n_tiles: n_tiles_i,
            e: e_r,
            c,
            d: d_i,
            targets: t_r,
            lambda: a.lambda,
            v: a.v,
            lse: lse_r,
            rest: rest_r,
            loss: loss_r,
            bias: a.bias,
            softcap: a.softcap,
            zy,
        };
        let launch = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (WGMMA_COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: CombineParams is WG_COMBINE_PARAMS in wgmma.cu; the buffers are as the
        // caller guarantees (this function's contract): partials of `rows` rows, e_r rows x d
        // and c V x d 16-bit values (4-byte aligned: d even), targets (class < V or −1), lse
        // and loss rows offset to r0 with `rows` more, bias V values or 0, zy 0 or `rows` f32
        // written before.
        unsafe { self.launch_params(&self.stream, f, launch, &params) }
    }

    /// A 2-D TMA tensor map of the row-major `[rows, d]` 16-bit matrix at `ptr`: boxes of
    /// `box_rows` rows x 64 columns (128 bytes), 128-byte swizzle, zero fill out of bounds
    /// (`wgmma.cu` "Parameters").
    pub(super) fn tensor_map(
        &self,
        dtype: DType,
        ptr: u64,
        rows: usize,
        d: usize,
        box_rows: usize,
    ) -> Result<TmaDesc> {
        self.encode_map(dtype, ptr, (rows, d, d), box_rows)
    }

    /// The TMA tensor map of an f16 output of the WGMMA epilogues (`wgmma.cu`
    /// `store_f16_tile`): the row-major `[rows, cols]` u16 matrix at `ptr` (16-byte aligned)
    /// with row stride `ld` elements (a multiple of 8, ≥ cols), 64 x 64 boxes, 128-byte swizzle.
    pub(super) fn tensor_map_out(
        &self,
        ptr: u64,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<TmaDesc> {
        self.encode_map(DType::F16, ptr, (rows, cols, ld), 64)
    }

    /// `cuTensorMapEncodeTiled` of the 2-D 16-bit `[rows, cols]` matrix at `ptr` with row stride
    /// `ld` elements: boxes of `box_rows` rows x 64 columns (128 bytes), 128-byte swizzle, zero
    /// fill out of bounds.
    pub(super) fn encode_map(
        &self,
        dtype: DType,
        ptr: u64,
        (rows, d, ld): (usize, usize, usize),
        box_rows: usize,
    ) -> Result<TmaDesc> {
        use cudarc::driver::sys;
        if !ptr.is_multiple_of(16) || !(ld * 2).is_multiple_of(16) || ld < d {
            return Err(CceError::InvalidOption {
                name: "tensor map",
                reason: format!(
                    "address {ptr:#x} or row stride {ld} not 16-byte aligned, or under {d}"
                ),
            });
        }
        let data_type = match dtype {
            DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            other => {
                return Err(CceError::Unsupported {
                    backend: BACKEND,
                    what: format!("dtype {other} in the WGMMA forward"),
                })
            }
        };
        let dims: [u64; 2] = [d as u64, rows as u64];
        let strides: [u64; 1] = [(ld * 2) as u64];
        let boxes: [u32; 2] = [WGMMA_BK as u32, box_rows as u32];
        let elem_strides: [u32; 2] = [1, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `map` is a writable, 64-byte (here 128-byte) aligned CUtensorMap; the four
        // arrays hold rank (2) entries (strides rank − 1) and live through the call; `ptr` is
        // the 16-byte aligned device address (checked above) of a live [rows, d] buffer of
        // 2-byte elements with the row stride ld·2 bytes (a multiple of 16, checked); box 64 x
        // box_rows (≤ 256) with 64·2 = 128 bytes inner extent, as SWIZZLE_128B requires. The
        // call only encodes the descriptor (it dereferences no device memory).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type,
                2,
                ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(drv)?;
        // SAFETY: cuTensorMapEncodeTiled returned success, so it wrote the whole map.
        let map = unsafe { map.assume_init() };
        Ok(TmaDesc(map.opaque))
    }

    /// One launch of `cce_wgmma_gcols[_cap]_*` (`kernels/wgmma.cu`): `G[n, kc]` (f16, row stride
    /// `ldg` elements, at `g`) of classes `k0..k0 + kc` from the logits `E · C_kᵀ` computed in
    /// registers, the saved lse, the targets and upstream gradients, scaled by `*g_scale` (the
    /// device address of an f32, or 0 for 1); persistent grid of at most one block per
    /// multiprocessor.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(super) fn launch_wgmma_gcols(
        &self,
        name: &str,
        (tm_e, tm_c): (&TmaDesc, TmaDesc),
        (n, kc, d, k0, v): (usize, usize, usize, usize, usize),
        (g, ldg): (u64, usize),
        (bias, softcap, targets, lse, rest): (u64, f32, u64, u64, u64),
        (dl_rows, dl_scalar, dlse): (u64, f32, u64),
        (alpha, lambda, g_scale): (f32, f32, u64),
    ) -> Result<()> {
        let f = self.func(name)?;
        let tiles = n.div_ceil(WGMMA_BM) * kc.div_ceil(WGMMA_BN);
        let grid = tiles.min(self.facts.sm_count.max(1)) as u32;
        let (n_i, kc_i, d_i) = (to_i32(n, "N")?, to_i32(kc, "classes")?, to_i32(d, "D")?);
        let (k0_i, v_i) = (to_i32(k0, "k0")?, to_i32(v, "V")?);
        let tm_g = self.tensor_map_out(g, n, kc, ldg)?;
        let (group_m, ordered) = (WGMMA_GROUP_M, 1i32);
        let params = WgGColsParams {
            tm_e: *tm_e,
            tm_c,
            n: n_i,
            k: kc_i,
            d: d_i,
            k0: k0_i,
            v: v_i,
            tm_g,
            bias,
            softcap,
            targets,
            lse,
            rest,
            dl_rows,
            dl_scalar,
            dlse,
            alpha,
            lambda,
            g_scale,
            group_m,
            ordered,
        };
        let launch = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (WGMMA_THREADS, 1, 1),
            shared_mem_bytes: WGMMA_SMEM_OUT_BYTES as u32,
        };
        // SAFETY: WgGColsParams is WG_GCOLS_PARAMS in wgmma.cu (two 128-byte tensor maps by
        // value; i32 N, K, D, k0, V; G's tensor map by value; bias, f32 softcap, targets, lse,
        // rest; dl_rows, f32 dl_scalar, dlse; f32 α, λ; g_scale (const float*: one f32 of
        // ws.scales written before on this stream, or 0); i32 group_m, ordered_epi). The
        // maps describe the live [n, D] and [kc, D] 16-bit row-major inputs (16-byte aligned,
        // D % 64 == 0: `schedule::wgmma_gcols_classes`), so TMA reads nothing outside them; G's
        // map is [n, kc] f16 with row stride ldg·2 bytes (ldg ≥ kc a multiple of 8: bytes
        // [0, n·ldg·2) of the scratch, below the f16 copy of e and the d_c temp, checked by
        // `class_pass` against the layout of `DenseConfig::gcols_layout`), and TMA stores write
        // nothing outside it; the per-row arrays hold n values and bias V (checked by `run`);
        // 384 threads and WGMMA_SMEM_OUT_BYTES of dynamic shared memory (the attribute set at
        // construction); grid ≤ the tile count.
        unsafe { self.launch_params(&self.stream, f, launch, &params) }
    }
}

kernel_params! {
    /// `WG_COMBINE_PARAMS` of `cce_wgmma_lse_combine_*` (`kernels/wgmma.cu`); the per-row
    /// arrays offset to the group's first row.
    CombineParams {
        partial: u64,
        rows: i32,
        n_tiles: i32,
        e: u64,
        c: u64,
        d: i32,
        targets: u64,
        lambda: f32,
        v: i32,
        lse: u64,
        rest: u64,
        loss: u64,
        bias: u64,
        softcap: f32,
        zy: u64,
    }
}

kernel_params! {
    /// `WG_GCOLS_PARAMS` of `cce_wgmma_gcols[_cap]_*` (`kernels/wgmma.cu`): `G` of a class
    /// chunk in the epilogue of the logits GEMM.
    WgGColsParams {
        tm_e: TmaDesc,
        tm_c: TmaDesc,
        n: i32,
        k: i32,
        d: i32,
        k0: i32,
        v: i32,
        tm_g: TmaDesc,
        bias: u64,
        softcap: f32,
        targets: u64,
        lse: u64,
        rest: u64,
        dl_rows: u64,
        dl_scalar: f32,
        dlse: u64,
        alpha: f32,
        lambda: f32,
        /// `const float*`: `G`'s scale in device memory, or 0 (1).
        g_scale: u64,
        group_m: i32,
        ordered: i32,
    }
}

kernel_params! {
    /// `WG_LSE_PARAMS` of `cce_wgmma_lse[_x]_*` (`kernels/wgmma.cu`): the logits GEMM of a row
    /// group with per-tile (max, Σexp) partials in its epilogue.
    LseParams {
        tm_e: TmaDesc,
        tm_c: TmaDesc,
        rows: i32,
        v: i32,
        d: i32,
        partial: u64,
        group_m: i32,
        ordered: i32,
        bias: u64,
        softcap: f32,
        targets: u64,
        /// `float*`: the target logits of the group's rows (`rows` f32).
        zy_tile: u64,
    }
}

/// `WG_LSEQ_PARAMS` of `cce_wgmma_lseq[_x]_bf16`: [`LseParams`], then the map of the f16
/// `e^{z − max}` output.
pub(super) struct LseqParams {
    pub(super) lse: LseParams,
    pub(super) tm_q: TmaDesc,
}

impl KernelParams for LseqParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        self.lse.push(b);
        b.arg(&self.tm_q);
    }
}

kernel_params! {
    /// `WG_QROWS_PARAMS` of `cce_wgmma_qrows_g[_cap]_bf16`: `G` in place over the bf16
    /// `e^{z − max}` of a chunk (bf16, or f16 times `*g_scale` where `g_scale` is set); the
    /// per-row arrays offset to the chunk.
    QRowsParams {
        q: u64,
        ldq: i64,
        v: i32,
        n_tiles: i32,
        partial: u64,
        lse: u64,
        zy: u64,
        rest: u64,
        targets: u64,
        dl_rows: u64,
        dl_scalar: f32,
        dlse: u64,
        lambda: f32,
        softcap: f32,
        g_scale: u64,
    }
}
