//! The staircase forward-and-backward of a filtered call (docs/perf-log.md, session 23), behind
//! [`crate::CudaSwitches::staircase`] (off by default: never run on a GPU yet).
//!
//! 1. The order: the mean row of `e` over the rows with a target, each class's
//!    `ē · c_j + b_j`, sorted (`staircase.rs`); the bias gathered into that order once.
//! 2. The forward per class chunk of `K` classes in that order: the chunk of `c` gathered into
//!    the scratch, the WGMMA lse kernel over all rows (its per-(row, 256-class tile) partials
//!    placed among all tiles, the target logit from the chunk that holds it), then one combine:
//!    lse, `1 − p_y` and the loss, as the fused forward computes them.
//! 3. Each row's kept tiles from the partials (rounded up to the chunk), the rows sorted by
//!    them, per chunk the count `n_c` of sorted rows that keep it (one host read), the rows'
//!    `e`, lse, rest, targets (as positions in the order) and upstream rows gathered.
//! 4. Per chunk with `n_c > 0`: the chunk of `c` gathered again, `G` of the first `n_c` sorted
//!    rows by the WGMMA class-pass kernel (f16, the class pass's power-of-two scale), then
//!    `d_c`'s chunk rows `= Gᵀ · e16` scattered back through the class order, `d_bias` the
//!    same, and `d_e += G · c16` into an f32 `[N, D]` accumulator (`c16`: the chunk in f16 with
//!    a power of two of `c`'s own); at the end `d_e` scattered back through the row order.
//!
//! Every step is stream-ordered; the one host read is the chunk counts (so not under a CUDA
//! graph capture). The filter statistics: each row's kept entries and dropped mass go to the
//! workspace's `kept` / `dropped` (the statistics kernel reads them); the plan's tile flags are
//! all set (the staircase does not count plan tiles).

use super::schedule::{self, CallFacts, CallKind};
use super::staircase::{mean_scratch_bytes, sort_len, KeptRowsAt, STAIR_TILE};
use super::*;

/// Classes per chunk the staircase tries, largest first: the largest whose layout fits the
/// scratch is taken.
pub const STAIR_CHUNKS: [usize; 4] = [8192, 4096, 2048, 1024];

/// Byte offsets of the staircase's regions in the workspace's scratch (each 256-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StairLayout {
    /// Classes per chunk (a multiple of 256).
    pub(super) chunk: usize,
    /// `G`'s row stride in f16 elements (`chunk` rounded up to 8).
    pub(super) ldg: usize,
    pub(super) keys: usize,
    pub(super) class_perm: usize,
    pub(super) class_inv: usize,
    pub(super) bias_perm: usize,
    pub(super) mean: usize,
    pub(super) mean_scratch: usize,
    pub(super) partial: usize,
    pub(super) chunk_partial: usize,
    pub(super) zy: usize,
    pub(super) t_chunk: usize,
    pub(super) ytile: usize,
    pub(super) kept: usize,
    pub(super) row_perm: usize,
    pub(super) kept_sorted: usize,
    pub(super) counts: usize,
    pub(super) targets_s: usize,
    pub(super) lse_s: usize,
    pub(super) rest_s: usize,
    pub(super) dl_s: usize,
    pub(super) dlse_s: usize,
    pub(super) e_s: usize,
    pub(super) e16_s: usize,
    pub(super) c_chunk: usize,
    pub(super) c16_chunk: usize,
    pub(super) g: usize,
    pub(super) de_acc: usize,
    pub(super) dc_tmp: usize,
    pub(super) dbias_tmp: usize,
    /// The filter statistics' inputs (`cce_dense_stats`): each row's kept entries and dropped
    /// mass, the plan's tile flags (all set: the staircase does not count plan tiles).
    pub(super) kept_entries: usize,
    pub(super) dropped: usize,
    pub(super) flags: usize,
    /// Bytes of the whole layout.
    pub(super) end: usize,
}

impl StairLayout {
    /// The layout for `n` rows, `v` classes, hidden size `d`, 16-bit inputs, chunks of
    /// `chunk` classes, `n_flags` plan tiles.
    pub(super) fn new(n: usize, d: usize, v: usize, chunk: usize, n_flags: usize) -> Self {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let here = at;
            at = (at + bytes.max(1)).next_multiple_of(256);
            here
        };
        let n_tiles = v.div_ceil(STAIR_TILE);
        let ldg = chunk.next_multiple_of(8);
        let mut l = Self {
            chunk,
            ldg,
            keys: take(8 * sort_len(n.max(v))),
            class_perm: take(4 * v),
            class_inv: take(4 * v),
            bias_perm: take(2 * v),
            mean: take(4 * d),
            mean_scratch: take(mean_scratch_bytes(n, d)),
            partial: take(8 * n * n_tiles),
            chunk_partial: take(8 * n * chunk.div_ceil(STAIR_TILE)),
            zy: take(4 * n),
            t_chunk: take(4 * n),
            ytile: take(4 * n),
            kept: take(4 * n),
            row_perm: take(4 * n),
            kept_sorted: take(4 * n),
            counts: take(4 * v.div_ceil(chunk)),
            targets_s: take(4 * n),
            lse_s: take(4 * n),
            rest_s: take(4 * n),
            dl_s: take(4 * n),
            dlse_s: take(4 * n),
            e_s: take(2 * n * d),
            e16_s: take(2 * n * d),
            c_chunk: take(2 * chunk * d),
            c16_chunk: take(2 * chunk * d),
            g: take(2 * n * ldg),
            de_acc: take(4 * n * d),
            dc_tmp: take(4 * chunk * d),
            dbias_tmp: take(4 * chunk),
            kept_entries: take(4 * n),
            dropped: take(4 * n),
            flags: take(4 * n_flags),
            end: 0,
        };
        l.end = at;
        l
    }

    /// The layout of `cfg`'s call with the largest of [`STAIR_CHUNKS`] (at most `V` rounded up
    /// to 256) that fits `scratch` bytes, or `None`.
    pub(super) fn fitting(cfg: &DenseConfig, scratch: usize) -> Option<Self> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let n_flags = cfg.row_tiles() * cfg.class_tiles();
        let cap = v.next_multiple_of(STAIR_TILE);
        STAIR_CHUNKS
            .iter()
            .map(|&k| Self::new(n, d, v, k.min(cap), n_flags))
            .find(|l| l.end <= scratch)
    }
}

/// The staircase's layout for a call that takes it, or why it does not, from plain data: the
/// switch, a filtered forward-and-backward call with both gradients, the WGMMA kernels'
/// conditions (`schedule::wgmma_unfit`), no label smoothing, entropy or argmax, no
/// accumulation, no CUDA graph capture (one host read), a layout that fits the scratch.
pub(super) fn stair_layout(
    cfg: &DenseConfig,
    kind: CallKind,
    dev: &schedule::DeviceFacts,
    on: bool,
    call: &CallFacts,
) -> std::result::Result<StairLayout, &'static str> {
    refusal(cfg, kind, dev, on, call).map_or_else(
        || StairLayout::fitting(cfg, call.scratch).ok_or("the scratch holds no staircase layout"),
        Err,
    )
}

/// Why a call does not take the staircase before its layout is looked at ([`stair_layout`]).
fn refusal(
    cfg: &DenseConfig,
    kind: CallKind,
    dev: &schedule::DeviceFacts,
    on: bool,
    call: &CallFacts,
) -> Option<&'static str> {
    let f = &cfg.filter;
    if !on {
        Some("switched off")
    } else if kind != CallKind::ForwardBackward {
        Some("not a forward-and-backward call")
    } else if !(f.enabled && f.filter_e_grad && f.filter_c_grad) {
        Some("the filter is off for a gradient")
    } else if !(cfg.compute_d_e && cfg.compute_d_c) {
        Some("only one gradient asked for")
    } else if cfg.label_smoothing > 0.0 {
        Some("label smoothing")
    } else if cfg.want_entropy || cfg.want_argmax {
        Some("entropy or argmax asked for")
    } else if call.accumulate {
        Some("gradients added to the outputs")
    } else if call.capturing {
        Some("a CUDA graph capture (the chunk counts are read on the host)")
    } else if let Some(why) =
        schedule::wgmma_unfit(cfg, dev, true, call.aligned, STAIR_CHUNKS[0].min(cfg.v))
    {
        Some(why)
    } else if i32::try_from(cfg.n * cfg.d).is_err() {
        Some("N x D past 32 bits")
    } else {
        None
    }
}

impl DenseEngine {
    /// The staircase forward and backward of a call [`stair_layout`] let through, in the
    /// layout `lay` of the scratch: module docs. Returns the call's
    /// statistics (the filter's figures read as for the other filtered passes).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn staircase(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        p: &CallPtrs,
        a: &RowArgs,
        grads: &mut DenseGradOut<'_>,
        lay: &StairLayout,
    ) -> Result<DenseStats> {
        let (n, d, v, dt) = (cfg.n, cfg.d, cfg.v, cfg.dtype);
        let esz = dt.size_bytes();
        let code = dtype_code(dt)?;
        let k = lay.chunk;
        let n_tiles = v.div_ceil(STAIR_TILE);
        let chunks = v.div_ceil(k);
        if ws.logits.len() < lay.end {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let base = self.ptr(&ws.logits);
        let at = |off: usize| base + off as u64;
        let bias_perm = if p.bias != 0 { at(lay.bias_perm) } else { 0 };
        let mut prof = PhaseTimer::new(&self.stream, self.switches.profile)?;
        // The note every unsafe step call below refers to: the addresses are the call's checked
        // buffers (`check_call`: e n x d, c v x d, bias v, targets n, the forward outputs and
        // upstream rows n each) and regions of the scratch laid out by `StairLayout::new` for
        // (n, d, v, k), which `lay.end ≤ ws.logits.len()` (checked above) keeps in bounds; each
        // region is sized for what the step reads or writes there, 256-byte aligned, written
        // before it is read in this stream's order.

        // 1. The order.
        // SAFETY: the note above.
        unsafe {
            self.stair_mean_rows_at(
                dt,
                (p.e, n, d),
                p.targets,
                (at(lay.mean_scratch), at(lay.mean)),
            )?;
            self.stair_class_order_at(
                dt,
                (p.c, v, d),
                (at(lay.mean), p.bias),
                at(lay.keys),
                (at(lay.class_perm), at(lay.class_inv)),
            )?;
            if p.bias != 0 {
                self.stair_gather_u16_at((p.bias, at(lay.class_perm), v), bias_perm)?;
            }
        }
        PhaseTimer::mark(&mut prof, "order")?;

        // 2. The forward, chunk by chunk of the order, then the combine.
        let ext = p.bias != 0 || cfg.softcap.is_some();
        let f_lse = self.func(&format!(
            "cce_wgmma_lse{}_{code}",
            if ext { "_x" } else { "" }
        ))?;
        let tm_e = self.tensor_map(dt, p.e, n, d, WGMMA_BM)?;
        for k0 in (0..v).step_by(k) {
            let kc = k.min(v - k0);
            // SAFETY: the staircase layout's regions and the checked buffers (the note
            // before step 1).
            unsafe {
                self.stair_gather_rows16_at(
                    (p.c, at(lay.class_perm) + 4 * k0 as u64),
                    (kc, d),
                    at(lay.c_chunk),
                )?;
                self.stair_map_targets_at(
                    (p.targets, n),
                    (0, at(lay.class_inv)),
                    (k0, kc),
                    (at(lay.t_chunk), 0),
                )?;
            }
            let tiles = n.div_ceil(WGMMA_BM) * kc.div_ceil(WGMMA_BN);
            let params = LseParams {
                tm_e,
                tm_c: self.tensor_map(dt, at(lay.c_chunk), kc, d, WGMMA_BN)?,
                rows: to_i32(n, "N")?,
                v: to_i32(kc, "classes")?,
                d: to_i32(d, "D")?,
                partial: at(lay.chunk_partial),
                group_m: WGMMA_GROUP_M,
                ordered: 1,
                bias: if bias_perm != 0 {
                    bias_perm + (k0 * esz) as u64
                } else {
                    0
                },
                softcap: cfg.softcap.unwrap_or(0.0),
                targets: at(lay.t_chunk),
                zy_tile: at(lay.zy),
            };
            let launch = LaunchConfig {
                grid_dim: (tiles.min(self.facts.sm_count.max(1)) as u32, 1, 1),
                block_dim: (WGMMA_THREADS, 1, 1),
                shared_mem_bytes: WGMMA_SMEM_BYTES as u32,
            };
            // SAFETY: LseParams is WG_LSE_PARAMS; the maps describe e (n x d, checked by
            // `check_call`, 16-byte aligned and D % 64 == 0: `refusal`) and the gathered chunk
            // (kc x d in the scratch, 256-byte aligned); the chunk partials hold n x
            // ceil(kc/256) float2, t_chunk and zy n words (the layout); the bias chunk kc
            // values of the visiting-order bias (or 0); 384 threads and WGMMA_SMEM_BYTES of
            // dynamic shared memory (the attribute set at construction); grid ≤ tiles.
            unsafe { self.launch_params(&self.stream, f_lse, launch, &params) }?;
            // SAFETY: the staircase layout's regions and the checked buffers (the note
            // before step 1).
            unsafe {
                self.stair_place_tiles_at(
                    (at(lay.chunk_partial), n, kc.div_ceil(STAIR_TILE)),
                    (at(lay.partial), n_tiles, k0 / STAIR_TILE),
                )?;
            }
        }
        let f_comb = self.func(&format!("cce_wgmma_lse_combine_{code}"))?;
        // SAFETY: the partials hold n x n_tiles (every chunk placed above, stream order) and
        // zy each valid row's target logit (written by the chunk holding its target); e, c,
        // bias are the checked inputs (only read where zy is 0: never here); a's rows hold N.
        unsafe {
            self.launch_combine(
                f_comb,
                at(lay.partial),
                (0, n, n_tiles),
                (p.e, p.c, d),
                a,
                at(lay.zy),
            )
        }?;
        PhaseTimer::mark(&mut prof, "forward (WGMMA lse per gathered chunk)")?;

        // 3. Kept tiles, the row order, the chunk counts, the sorted rows.
        let rule = &cfg.filter;
        let kept_at = KeptRowsAt {
            partial: at(lay.partial),
            lse: p.lse,
            ytile: at(lay.ytile),
            dl_rows: p.dl_rows,
            dl_scalar: p.dl_scalar,
            dlse: p.dlse,
            kept: at(lay.kept),
            dropped: at(lay.dropped),
            kept_entries: at(lay.kept_entries),
        };
        // SAFETY: the staircase layout's regions and the checked buffers (the note
        // before step 1).
        unsafe {
            self.stair_map_targets_at(
                (p.targets, n),
                (0, at(lay.class_inv)),
                (0, v),
                (0, at(lay.ytile)),
            )?;
            self.stair_kept_rows_at(
                &kept_at,
                (n, v, n_tiles),
                (rule.eps, rule.max_dropped_mass, k / STAIR_TILE),
            )?;
            self.stair_row_order_at((at(lay.kept), n, n_tiles), at(lay.keys), at(lay.row_perm))?;
            self.stair_gather_u32_at((at(lay.kept), at(lay.row_perm), n), at(lay.kept_sorted))?;
            self.stair_chunk_rows_at(
                (at(lay.kept_sorted), n),
                (k / STAIR_TILE, chunks),
                at(lay.counts),
            )?;
        }
        let counts = self.stair_read_counts(ws, lay.counts, chunks)?;
        let ro = at(lay.row_perm);
        let opt = |src: u64, dst: usize| if src != 0 { at(dst) } else { 0 };
        let (dl_s, dlse_s) = (opt(p.dl_rows, lay.dl_s), opt(p.dlse, lay.dlse_s));
        // SAFETY: the staircase layout's regions and the checked buffers (the note
        // before step 1).
        unsafe {
            self.stair_gather_rows16_at((p.e, ro), (n, d), at(lay.e_s))?;
            self.stair_gather_u32_at((p.lse, ro, n), at(lay.lse_s))?;
            self.stair_gather_u32_at((p.rest, ro, n), at(lay.rest_s))?;
            if dl_s != 0 {
                self.stair_gather_u32_at((p.dl_rows, ro, n), dl_s)?;
            }
            if dlse_s != 0 {
                self.stair_gather_u32_at((p.dlse, ro, n), dlse_s)?;
            }
            self.stair_map_targets_at(
                (p.targets, n),
                (ro, at(lay.class_inv)),
                (0, v),
                (at(lay.targets_s), 0),
            )?;
        }
        PhaseTimer::mark(&mut prof, "kept tiles, row order, gathers")?;

        // The scales of the f16 operands: G and e's copy (the class pass's set), c's copies
        // (the row-chunk set). Both sets take the same rows, whose G bound is an exact maximum
        // (an atomicMax of bit patterns), so their kg agree: d_e's alpha 2^(−kc−kg) from the
        // row-chunk set undoes the class pass's 2^kg on G.
        let rows = ScaleRows {
            targets: at(lay.targets_s),
            dl_rows: dl_s,
            dl_scalar: p.dl_scalar,
            dlse: dlse_s,
            lse: at(lay.lse_s),
            rest: at(lay.rest_s),
            alpha: 0.0,
            lambda: cfg.z_loss,
            n: to_i32(n, "N")?,
            v: to_i32(v, "V")?,
        };
        let bf16 = dt == DType::BF16;
        let cls = self.split_scales(
            ws,
            ScaleSet::ClassPass,
            (at(lay.e_s), dt, if bf16 { n * d } else { 0 }),
            n * d,
            Some(rows),
        )?;
        let cs = self.split_scales(
            ws,
            ScaleSet::RowChunk,
            (p.c, dt, if bf16 { v * d } else { 0 }),
            v * d,
            Some(rows),
        )?;
        let e_op = if bf16 {
            self.to_f16(at(lay.e_s), at(lay.e16_s), n * d, cls.up_x())?;
            at(lay.e16_s)
        } else {
            at(lay.e_s)
        };
        self.stream
            .memset_zeros(&mut ws.logits.slice_mut(lay.de_acc..lay.de_acc + 4 * n * d))
            .map_err(drv)?;
        let d_c_out = self.opt_ptr(grads.d_c.as_deref());
        let out_ty = cfg.grad_dtype();
        // SAFETY: d_c holds v x d of the gradient dtype (`check_grads`), so the classes no
        // sorted row keeps get 0; the layout's flags region holds the plan's row x class tile
        // flags, all set (module docs); both live buffers on this stream.
        unsafe {
            let stream = self.stream.cu_stream();
            cudarc::driver::result::memset_d8_async(
                d_c_out,
                0,
                v * d * out_ty.size_bytes(),
                stream,
            )
            .map_err(drv)?;
            let n_flags = cfg.row_tiles() * cfg.class_tiles();
            cudarc::driver::result::memset_d8_async(at(lay.flags), 1, 4 * n_flags, stream)
                .map_err(drv)?;
        }

        // 4. The chunks.
        let gcols = format!(
            "cce_wgmma_gcols{}_{code}",
            if cfg.softcap.is_some() { "_cap" } else { "" }
        );
        let f_colsum = self.func("cce_dense_colsum_f16")?;
        let mut computed = 0usize;
        for (c, k0) in (0..v).step_by(k).enumerate() {
            let (kc, n_c) = (k.min(v - k0), counts[c]);
            if n_c == 0 {
                continue;
            }
            computed += n_c * kc;
            let perm_k = at(lay.class_perm) + 4 * k0 as u64;
            // SAFETY: the staircase layout's regions and the checked buffers (the note
            // before step 1).
            unsafe { self.stair_gather_rows16_at((p.c, perm_k), (kc, d), at(lay.c_chunk)) }?;
            let tm_e = self.tensor_map(dt, at(lay.e_s), n_c, d, WGMMA_BM)?;
            let tm_c = self.tensor_map(dt, at(lay.c_chunk), kc, d, WGMMA_BN)?;
            let g = at(lay.g);
            self.launch_wgmma_gcols(
                &gcols,
                (&tm_e, tm_c),
                (n_c, kc, d, k0, v),
                (g, lay.ldg),
                (
                    bias_perm,
                    cfg.softcap.unwrap_or(0.0),
                    at(lay.targets_s),
                    at(lay.lse_s),
                    at(lay.rest_s),
                ),
                (dl_s, p.dl_scalar, dlse_s),
                (0.0, cfg.z_loss, cls.up_g()),
            )?;
            // d_c of the chunk's classes, then back to their rows of d_c.
            let scalars = GemmScalars::Device {
                alpha: cls.down_xg(),
                beta: cls.zero(),
            };
            let tys = (DType::F16, DType::F16, DType::F32);
            self.gemm_dc(
                (kc, d, n_c),
                tys,
                (e_op, g, at(lay.dc_tmp)),
                lay.ldg,
                scalars,
            )?;
            // SAFETY: the staircase layout's regions and the checked buffers (the note
            // before step 1).
            unsafe {
                self.stair_scatter_rows_at(
                    (at(lay.dc_tmp), perm_k),
                    (kc, d),
                    (out_ty, d_c_out, false),
                )
            }?;
            if p.dbias_acc != 0 {
                let tmp = lay.dbias_tmp;
                self.stream
                    .memset_zeros(&mut ws.logits.slice_mut(tmp..tmp + 4 * kc))
                    .map_err(drv)?;
                let params = ColsumParams {
                    g,
                    ldg: lay.ldg as i64,
                    rows: to_i32(n_c, "rows")?,
                    cols: to_i32(kc, "classes")?,
                    acc: at(tmp),
                    scale: cls.down_g(),
                };
                let launch = LaunchConfig {
                    grid_dim: (kc.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                    block_dim: (COLSUM_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: ColsumParams is COLSUM_PARAMS; G is n_c x ldg f16 (written above,
                // stream order), the temp kc f32 (the layout, zeroed above), the scale one f32
                // of ws.scales.
                unsafe { self.launch_params(&self.stream, f_colsum, launch, &params) }?;
                // SAFETY: the staircase layout's regions and the checked buffers (the note
                // before step 1).
                unsafe {
                    self.stair_scatter_rows_at(
                        (at(tmp), perm_k),
                        (kc, 1),
                        (DType::F32, p.dbias_acc, false),
                    )
                }?;
            }
            // d_e of the chunk's rows: G · c16 into the f32 accumulator.
            let c_op = if bf16 {
                self.to_f16(at(lay.c_chunk), at(lay.c16_chunk), kc * d, cs.up_x())?;
                at(lay.c16_chunk)
            } else {
                at(lay.c_chunk)
            };
            let scalars = GemmScalars::Device {
                alpha: cs.down_xg(),
                beta: cs.one(),
            };
            let tys = (DType::F16, DType::F16, DType::F32);
            self.gemm_de(
                (kc, d, n_c),
                tys,
                (c_op, g, at(lay.de_acc)),
                lay.ldg,
                scalars,
            )?;
        }
        // SAFETY: the staircase layout's regions and the checked buffers (the note
        // before step 1).
        unsafe {
            self.stair_scatter_rows_at((at(lay.de_acc), ro), (n, d), (out_ty, p.d_e, false))
        }?;
        if cfg.has_bias && !cfg.grad_f32 {
            let db_out = self.opt_ptr(grads.d_bias.as_deref());
            self.convert_f32(code, p.dbias_acc, db_out, v)?;
        }
        PhaseTimer::mark(&mut prof, "chunks (G, d_c, d_e) and scatters")?;
        PhaseTimer::report(
            prof,
            &format!("staircase ({chunks} chunk(s) of {k} classes)"),
        )?;
        let mut stats = DenseStats {
            chunk_rows: n,
            chunks,
            row_pass: None,
            filtered: true,
            class_pass: Some(format!(
                "staircase backward: the classes by batch-mean logit, the rows by kept tiles; \
                 {:.1}% of the logits recomputed in {chunks} chunk(s) of {k} classes",
                100.0 * computed as f64 / (n * v).max(1) as f64
            )),
            ..Default::default()
        };
        // The statistics from the layout's kept entries, dropped masses and flags.
        let sp = CallPtrs {
            kept: at(lay.kept_entries),
            dropped: at(lay.dropped),
            flags: at(lay.flags),
            ..*p
        };
        self.filter_stats(cfg, ws, inp, &sp, &mut stats)?;
        Ok(stats)
    }

    /// The chunk counts at `off` of the scratch, read back (one host sync).
    fn stair_read_counts(
        &self,
        ws: &DenseWorkspace,
        off: usize,
        chunks: usize,
    ) -> Result<Vec<usize>> {
        let mut host = vec![0u8; 4 * chunks];
        self.stream
            .memcpy_dtoh(&ws.logits.slice(off..off + 4 * chunks), &mut host[..])
            .map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        Ok(host
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_fits_the_budget_at_the_issue_shapes() {
        // 8192 x 2304 x 256000 bf16 within 0.5 GiB less the cuBLAS workspace: 4096 classes
        // per chunk.
        let cfg = |n, d, v| DenseConfig {
            n,
            d,
            v,
            dtype: DType::BF16,
            has_bias: false,
            chunk_rows: 1024,
            chunk_classes: Some(32768),
            de_f16: false,
            tile: (128, 128),
            softcap: None,
            label_smoothing: 0.0,
            z_loss: 0.0,
            reduction: Reduction::Mean,
            filter: cce_core::FilterRule::resolve(&cce_core::Options::default(), DType::BF16),
            grad_f32: false,
            compute_d_e: true,
            compute_d_c: true,
            want_entropy: false,
            want_argmax: false,
            row_pass: RowPass::TwoPass,
            sparse: None,
            class_forward: None,
            wgmma_forward: true,
            wgmma_gcols: true,
            wgmma_rows: true,
            stop_on_give_way: false,
            dc_in_grad_dtype: false,
        };
        let big = cfg(8192, 2304, 256000);
        let l = StairLayout::fitting(&big, (512 << 20) - (32 << 20)).unwrap();
        assert_eq!(l.chunk, 4096);
        assert!(l.end <= (480 << 20));
        assert!(StairLayout::fitting(&big, 1 << 20).is_none());
        // A small vocabulary: one chunk of V rounded up to 256.
        let l = StairLayout::fitting(&cfg(300, 64, 1000), 1 << 30).unwrap();
        assert_eq!((l.chunk, l.ldg), (1024, 1024));
        // Regions are disjoint and in order.
        let l = StairLayout::new(1000, 128, 5000, 2048, 40 * 8);
        let offs = [
            l.keys,
            l.class_perm,
            l.class_inv,
            l.bias_perm,
            l.mean,
            l.mean_scratch,
            l.partial,
            l.chunk_partial,
            l.zy,
            l.t_chunk,
            l.ytile,
            l.kept,
            l.row_perm,
            l.kept_sorted,
            l.counts,
            l.targets_s,
            l.lse_s,
            l.rest_s,
            l.dl_s,
            l.dlse_s,
            l.e_s,
            l.e16_s,
            l.c_chunk,
            l.c16_chunk,
            l.g,
            l.de_acc,
            l.dc_tmp,
            l.dbias_tmp,
            l.end,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]));
        assert!(offs.iter().all(|o| o % 256 == 0));
        assert!(l.g + 2 * 1000 * 2048 <= l.de_acc);
    }
}
