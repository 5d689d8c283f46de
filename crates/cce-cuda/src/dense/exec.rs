//! The executor of a dense call: checks the buffers, takes the call's [`Schedule`]
//! (`schedule.rs`) and walks it: the sparse backward when tried, the forward-only paths, the
//! row chunks, split dense's class pass, the loss reduction, the final conversions and the
//! filter statistics, in that order on the engine's stream.

use super::schedule::{self, CallFacts, CallKind, ForwardPath, Schedule};
use super::*;

/// Which call `run` makes, with the saved forward state of a backward.
pub(super) enum Mode<'a> {
    Forward,
    ForwardBackward,
    Backward {
        lse: &'a CudaSlice<u8>,
        rest: &'a CudaSlice<u8>,
    },
}

impl Mode<'_> {
    fn kind(&self) -> CallKind {
        match self {
            Mode::Forward => CallKind::Forward,
            Mode::ForwardBackward => CallKind::ForwardBackward,
            Mode::Backward { .. } => CallKind::Backward,
        }
    }
}

/// Device addresses (0 = absent) and scalars of one call, after the buffer checks.
#[derive(Clone, Copy, Debug)]
pub(super) struct CallPtrs {
    pub(super) e: u64,
    pub(super) c: u64,
    pub(super) bias: u64,
    pub(super) targets: u64,
    /// Forward outputs: lse, `1 − p_y`, per-row loss (the output with reduction none, else
    /// the workspace's rows), entropy, argmax.
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) loss_rows: u64,
    pub(super) entropy: u64,
    pub(super) argmax: u64,
    /// The workspace's per-row loss.
    pub(super) row_loss: u64,
    /// The lse and `1 − p_y` the backward reads (the forward's or the caller's).
    pub(super) saved_lse: u64,
    pub(super) saved_rest: u64,
    /// Upstream gradients: per-row loss gradient (or 0, then `dl_scalar`), lse gradient.
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    /// `d_e` output; the f32 `d_c` accumulator (or the f32 output); the f32 `d_bias`
    /// accumulator (or the f32 output).
    pub(super) d_e: u64,
    pub(super) dc_acc: u64,
    pub(super) dbias_acc: u64,
    /// Workspace: filter statistics, bin edges, thresholds.
    pub(super) kept: u64,
    pub(super) dropped: u64,
    pub(super) flags: u64,
    pub(super) edges: u64,
    pub(super) tau: u64,
    /// Workspace scratch: its start and the row pass's logits.
    pub(super) ws_base: u64,
    pub(super) l_ptr: u64,
}

/// A buffer must hold `bytes`.
pub(super) fn need(s: &CudaSlice<u8>, bytes: usize, what: &'static str) -> Result<()> {
    if s.len() < bytes {
        Err(CceError::ShapeMismatch {
            what,
            expected: format!("at least {bytes} bytes"),
            got: format!("{} bytes", s.len()),
        })
    } else {
        Ok(())
    }
}

fn other_config() -> CceError {
    CceError::InvalidOption {
        name: "workspace",
        reason: "allocated for another configuration".into(),
    }
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
        let kind = mode.kind();
        self.check_call(cfg, ws, inp, up, fwd.as_deref(), grads, &mode)?;
        let p = self.call_ptrs(cfg, ws, inp, up, fwd.as_deref(), grads, &mode)?;
        let facts = CallFacts {
            scratch: ws.logits.len(),
            aligned: p.e.is_multiple_of(16) && p.c.is_multiple_of(16),
            capturing: self.capturing()?,
            accumulate: grads.accumulate,
        };
        let sched = schedule::schedule(cfg, kind, &self.facts, facts);
        let row_args = RowArgs::of_call(cfg, ws.ld, &p)?;
        if kind.backward() {
            self.zero_backward_state(ws, grads, &sched, &p)?;
        }
        // The staircase (stair_pass.rs), where its switch is on and the call fits it: at once
        // when the plan has no sparse try, else once the try gave way (peaked rows finish in
        // the sparse backward at a fraction of the staircase's cost).
        let stair =
            stair_pass::stair_layout(cfg, kind, &self.facts, self.switches.staircase, &facts);
        if let (Ok(lay), false) = (&stair, sched.try_sparse) {
            let out = fwd.as_deref().map(|o| self.ptr(o.loss)).unwrap_or(0);
            return self.stair_call(cfg, ws, inp, &p, &row_args, grads, lay, out);
        }
        // Chunked dense's row chunks hold about twice the rows where the row pass takes the
        // WGMMA epilogue (16-bit q instead of f32 logits: `DenseConfig::wgmma_chunk_rows`).
        let chunk = match sched.row_wgmma {
            Some(Ok(())) => cfg.wgmma_chunk_rows(),
            _ => ws.chunk_rows,
        };
        let mut stats = DenseStats {
            chunk_rows: chunk,
            chunks: cfg.n.div_ceil(chunk),
            row_pass: Some(match sched.fused {
                Some((cs, _)) => RowPass::Fused { cluster: Some(cs) },
                None => RowPass::TwoPass,
            }),
            filtered: sched.filtering,
            ..Default::default()
        };
        // Sparse backward first (filtered split-dense calls); rows of a first chunk whose
        // logits (and forward rows) a sparse backward that gave way left valid at `l_ptr`.
        let (sparse_used, reuse_rows) = if sched.try_sparse {
            self.try_sparse(cfg, ws, &row_args, &p, grads, kind, &mut stats)?
        } else {
            (false, 0)
        };
        if let (true, false, Ok(lay)) = (sched.try_sparse, sparse_used, &stair) {
            // The try gave way: the staircase from a clean state, the try's note kept.
            self.zero_backward_state(ws, grads, &sched, &p)?;
            let out = fwd.as_deref().map(|o| self.ptr(o.loss)).unwrap_or(0);
            let mut st = self.stair_call(cfg, ws, inp, &p, &row_args, grads, lay, out)?;
            st.sparse = stats.sparse.take();
            return Ok(st);
        }
        if sched.try_sparse && !sparse_used && cfg.stop_on_give_way {
            stats.gave_way_stop = true;
            return Ok(stats);
        }
        stats.filtered = sched.filtering || sparse_used;
        if let Some(note) = &sched.sparse_note {
            stats.sparse = Some(note.clone());
        }
        let forward_done = match sched.forward {
            Some(path) => self.forward_only(cfg, ws, &row_args, &p, path, &sched, &mut stats)?,
            None => false,
        };
        let dense_rows = if sparse_used || forward_done {
            0
        } else {
            cfg.n
        };
        let chunks = row_chunks(cfg.n, chunk, dense_rows, reuse_rows);
        if reuse_rows > 0 {
            stats.chunks = chunks.len();
        }
        self.row_pass(
            cfg,
            ws,
            inp,
            &sched,
            &p,
            &row_args,
            &chunks,
            sparse_used,
            &mut stats,
        )?;
        if let (Some(path), false) = (&sched.class_pass, sparse_used) {
            stats.class_pass = Some(self.class_pass(
                cfg,
                ws,
                inp,
                path,
                ClassPassArgs {
                    lse: p.saved_lse,
                    rest: p.saved_rest,
                    dl_rows: p.dl_rows,
                    dl_scalar: p.dl_scalar,
                    dlse: p.dlse,
                    d_c: self.opt_ptr(grads.d_c.as_deref()),
                    d_bias_acc: p.dbias_acc,
                    accumulate: sched.accumulate,
                },
            )?);
        }
        if kind.forward() && cfg.reduction != Reduction::None {
            let out = fwd.as_deref().map(|o| self.ptr(o.loss)).unwrap_or(0);
            self.reduce_loss(cfg, inp, p.row_loss, out)?;
        }
        if kind.backward() {
            self.finish_backward(cfg, ws, inp, grads, &p, &sched, sparse_used, &mut stats)?;
        }
        if let (true, Err(why)) = (self.switches.staircase, stair) {
            let note = format!("staircase not taken: {why}");
            stats.row_pass_note = Some(match stats.row_pass_note.take() {
                Some(n) => format!("{n}; {note}"),
                None => note,
            });
        }
        Ok(stats)
    }

    /// The staircase call ([`Self::staircase`]) and the loss's reduction into `loss_out`
    /// (0: no loss output).
    #[allow(clippy::too_many_arguments)]
    fn stair_call(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        p: &CallPtrs,
        row_args: &RowArgs,
        grads: &mut DenseGradOut<'_>,
        lay: &stair_pass::StairLayout,
        loss_out: u64,
    ) -> Result<DenseStats> {
        let stats = self.staircase(cfg, ws, inp, p, row_args, grads, lay)?;
        if cfg.reduction != Reduction::None {
            self.reduce_loss(cfg, inp, p.row_loss, loss_out)?;
        }
        Ok(stats)
    }

    /// Whether the engine's stream is capturing a CUDA graph (then no step may read the
    /// device back).
    pub(super) fn capturing(&self) -> Result<bool> {
        use cudarc::driver::sys::CUstreamCaptureStatus as Capture;
        let status = self.stream.capture_status().map_err(drv)?;
        Ok(status == Capture::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    }

    /// The size checks of every buffer of the call (the kernels trust them) and of the
    /// workspace against `cfg`.
    #[allow(clippy::too_many_arguments)]
    fn check_call(
        &self,
        cfg: &DenseConfig,
        ws: &DenseWorkspace,
        inp: &DenseInputs<'_>,
        up: Option<&DenseUpstream<'_>>,
        fwd: Option<&DenseForwardOut<'_>>,
        grads: &DenseGradOut<'_>,
        mode: &Mode<'_>,
    ) -> Result<()> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let esz = cfg.dtype.size_bytes();
        if ws.ld != cfg.ld() || ws.chunk_rows != cfg.effective_chunk_rows() {
            return Err(other_config());
        }
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
        let kind = mode.kind();
        if let Some(o) = fwd {
            let loss_bytes = if cfg.reduction == Reduction::None {
                n * 4
            } else {
                4
            };
            need(o.loss, loss_bytes, "loss")?;
            need(o.lse, n * 4, "lse")?;
            need(o.rest, n * 4, "rest_mass")?;
            if let Some(x) = o.entropy.as_deref() {
                need(x, n * 4, "entropy")?;
            }
            if let Some(x) = o.argmax.as_deref() {
                need(x, n * 4, "argmax")?;
            }
        } else if kind.forward() {
            return Err(CceError::InvalidOption {
                name: "forward outputs",
                reason: "missing".into(),
            });
        }
        if kind.backward() {
            let up = up.ok_or_else(|| CceError::InvalidOption {
                name: "upstream",
                reason: "missing".into(),
            })?;
            if let DenseDLoss::PerRow(s) = up.d_loss {
                need(s, n * 4, "d_loss")?;
            }
            if let Some(h) = up.d_lse {
                need(h, n * 4, "d_lse")?;
            }
            self.check_grads(cfg, grads)?;
        }
        if let Mode::Backward { lse, rest } = mode {
            need(lse, n * 4, "lse")?;
            need(rest, n * 4, "rest_mass")?;
        }
        let split = cfg.chunk_classes.is_some();
        if split && (ws.tau.len() < n * 4 || ws.logits.len() < cfg.row_layout().end) {
            return Err(other_config());
        }
        Ok(())
    }

    /// The gradient outputs `cfg` asks for are given and large enough, and f32 when they
    /// accumulate.
    fn check_grads(&self, cfg: &DenseConfig, grads: &DenseGradOut<'_>) -> Result<()> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        if grads.accumulate && !cfg.grad_f32 {
            return Err(CceError::InvalidOption {
                name: "accumulate",
                reason: format!(
                    "accumulating gradients must be f32 (the gradient dtype is {})",
                    cfg.grad_dtype()
                ),
            });
        }
        let osz = cfg.grad_dtype().size_bytes();
        let missing = |name: &'static str| CceError::InvalidOption {
            name,
            reason: "output missing".into(),
        };
        if cfg.compute_d_e {
            let s = grads.d_e.as_deref().ok_or_else(|| missing("d_e"))?;
            need(s, n * d * osz, "d_e")?;
        }
        if cfg.compute_d_c {
            let s = grads.d_c.as_deref().ok_or_else(|| missing("d_c"))?;
            need(s, v * d * osz, "d_c")?;
            if cfg.has_bias {
                let s = grads.d_bias.as_deref().ok_or_else(|| missing("d_bias"))?;
                need(s, v * osz, "d_bias")?;
            }
        }
        Ok(())
    }

    /// The device addresses of the call's buffers (checked by `check_call`).
    #[allow(clippy::too_many_arguments)]
    fn call_ptrs(
        &self,
        cfg: &DenseConfig,
        ws: &DenseWorkspace,
        inp: &DenseInputs<'_>,
        up: Option<&DenseUpstream<'_>>,
        fwd: Option<&DenseForwardOut<'_>>,
        grads: &DenseGradOut<'_>,
        mode: &Mode<'_>,
    ) -> Result<CallPtrs> {
        let backward = mode.kind().backward();
        let (mut dl_rows, mut dl_scalar, mut dlse) = (0u64, 0.0f32, 0u64);
        if let (true, Some(up)) = (backward, up) {
            match up.d_loss {
                DenseDLoss::Scalar(g) => {
                    dl_scalar = match cfg.reduction {
                        Reduction::Mean if inp.n_valid > 0 => g / inp.n_valid as f32,
                        Reduction::Mean => 0.0,
                        _ => g,
                    }
                }
                DenseDLoss::PerRow(s) => dl_rows = self.ptr(s),
            }
            dlse = self.opt_ptr(up.d_lse);
        }
        let row_loss = self.ptr(&ws.row_loss);
        let (lse, rest, loss_rows, entropy, argmax) = match fwd {
            Some(o) => (
                self.ptr(o.lse),
                self.ptr(o.rest),
                if cfg.reduction == Reduction::None {
                    self.ptr(o.loss)
                } else {
                    row_loss
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
        let (saved_lse, saved_rest) = match mode {
            Mode::Backward { lse, rest } => (self.ptr(lse), self.ptr(rest)),
            _ => (lse, rest),
        };
        let d_c_on = backward && cfg.compute_d_c;
        let dc_acc = match (d_c_on, ws.dc_acc.as_ref()) {
            (false, _) => 0,
            (true, Some(a)) => self.ptr(a),
            (true, None) => self.opt_ptr(grads.d_c.as_deref()),
        };
        let dbias_acc = match (d_c_on && cfg.has_bias, ws.dbias_acc.as_ref()) {
            (false, _) => 0,
            (true, Some(a)) => self.ptr(a),
            (true, None) => self.opt_ptr(grads.d_bias.as_deref()),
        };
        let ws_base = self.ptr(&ws.logits);
        Ok(CallPtrs {
            e: self.ptr(inp.e),
            c: self.ptr(inp.c),
            bias: self.opt_ptr(inp.bias),
            targets: self.ptr(inp.targets),
            lse,
            rest,
            loss_rows,
            entropy,
            argmax,
            row_loss,
            saved_lse,
            saved_rest,
            dl_rows,
            dl_scalar,
            dlse,
            d_e: if backward && cfg.compute_d_e {
                self.opt_ptr(grads.d_e.as_deref())
            } else {
                0
            },
            dc_acc,
            dbias_acc,
            kept: self.ptr(&ws.kept),
            dropped: self.ptr(&ws.dropped),
            flags: self.ptr(&ws.flags),
            edges: self.ptr(&ws.edges),
            tau: self.ptr(&ws.tau),
            ws_base,
            l_ptr: if cfg.chunk_classes.is_some() {
                ws_base + cfg.row_layout().logits as u64
            } else {
                ws_base
            },
        })
    }

    /// Zero what a backward accumulates into: the filter statistics (filtered calls and
    /// sparse tries) and the `d_bias` accumulator (or output; not when the call adds to the
    /// output's contents, [`Schedule::accumulate`]).
    fn zero_backward_state(
        &self,
        ws: &mut DenseWorkspace,
        grads: &mut DenseGradOut<'_>,
        sched: &Schedule,
        p: &CallPtrs,
    ) -> Result<()> {
        if sched.filtering || sched.try_sparse {
            self.stream.memset_zeros(&mut ws.flags).map_err(drv)?;
            self.stream.memset_zeros(&mut ws.kept).map_err(drv)?;
            self.stream.memset_zeros(&mut ws.dropped).map_err(drv)?;
        }
        if p.dbias_acc != 0 && !sched.accumulate {
            match ws.dbias_acc.as_mut() {
                Some(a) => self.stream.memset_zeros(a).map_err(drv)?,
                None => {
                    if let Some(b) = grads.d_bias.as_deref_mut() {
                        self.stream.memset_zeros(b).map_err(drv)?
                    }
                }
            }
        }
        Ok(())
    }

    /// The plan's sparse backward; its note in `stats`. Returns (whether it ran to the end,
    /// rows of its first chunk the dense passes reuse when it gave way).
    #[allow(clippy::too_many_arguments)]
    fn try_sparse(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        row_args: &RowArgs,
        p: &CallPtrs,
        grads: &DenseGradOut<'_>,
        kind: CallKind,
        stats: &mut DenseStats,
    ) -> Result<(bool, usize)> {
        let delta_fixed =
            (cfg.filter.max_dropped_mass as f64 * cce_core::filter::FIXED_POINT_ONE).floor() as u64;
        let sa = SparseArgs {
            forward: kind.forward(),
            saved_lse: p.saved_lse,
            saved_rest: p.saved_rest,
            dl_rows: p.dl_rows,
            dl_scalar: p.dl_scalar,
            dlse: p.dlse,
            e: p.e,
            c: p.c,
            d_e: p.d_e,
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
            tile: tile_args(cfg)?,
        };
        let outcome = self.sparse_backward(cfg, ws, row_args, &sa)?;
        self.record_sparse(cfg, outcome.is_err());
        Ok(match outcome {
            Ok(kept) => {
                stats.sparse = Some(schedule::sparse_used_note(kept, cfg.n));
                (true, 0)
            }
            Err((why, _)) if cfg.stop_on_give_way => {
                stats.sparse = Some(schedule::sparse_gave_way_stop_note(&why));
                (false, 0)
            }
            Err((why, rows)) => {
                let reuse =
                    schedule::reuse_probe_rows(cfg.row_layout().logits, rows, ws.chunk_rows);
                stats.sparse = Some(schedule::sparse_gave_way_note(&why, reuse > 0));
                (false, reuse)
            }
        })
    }

    /// A forward-only call through the fused WGMMA forward or the plan's class tiles; its note
    /// in `stats`. Returns whether it ran (else the row chunks do the forward).
    #[allow(clippy::too_many_arguments)]
    fn forward_only(
        &self,
        cfg: &DenseConfig,
        ws: &DenseWorkspace,
        row_args: &RowArgs,
        p: &CallPtrs,
        path: ForwardPath,
        sched: &Schedule,
        stats: &mut DenseStats,
    ) -> Result<bool> {
        match path {
            ForwardPath::Wgmma { group } => {
                self.forward_wgmma(cfg, group, p.ws_base, row_args, (p.e, p.c))?;
                stats.chunk_rows = group;
                stats.chunks = cfg.n.div_ceil(group);
            }
            ForwardPath::ClassTiles(cf) => {
                if ws.logits.len() < cf.bytes(cfg.n) {
                    return Err(other_config());
                }
                self.forward_by_classes(cfg, cf, p.ws_base, row_args, (p.e, p.c))?;
            }
            ForwardPath::RowChunks => return Ok(false),
        }
        stats.forward.clone_from(&sched.forward_note);
        Ok(true)
    }

    /// The loss reduction: `out` (f32 `[1]`) = the sum of the `N` per-row losses, times
    /// `1 / n_valid` for a mean (the count read on the device when `inp.device_status` is set).
    fn reduce_loss(
        &self,
        cfg: &DenseConfig,
        inp: &DenseInputs<'_>,
        row_loss: u64,
        out: u64,
    ) -> Result<()> {
        let LossScale {
            scale,
            status,
            by_count,
        } = loss_scale(cfg.reduction, inp.n_valid, inp.device_status);
        let by_count = i32::from(by_count);
        let n_i = to_i32(cfg.n, "N")?;
        let mut b = self.stream.launch_builder(self.func("cce_dense_sum_rows")?);
        b.arg(&row_loss)
            .arg(&n_i)
            .arg(&scale)
            .arg(&status)
            .arg(&by_count)
            .arg(&out);
        // SAFETY: matches cce_dense_sum_rows; row_loss holds N f32 written by the forward;
        // status is 0 or the backend's status buffer (u32 [64], its words written by the
        // prepare kernels earlier on this stream); out is the [1] f32 loss (checked).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// After the passes of a backward: the f32 accumulators converted to the gradient dtype
    /// (the sparse products write the gradients directly), and the filter statistics of
    /// filtered calls read back into `stats`.
    #[allow(clippy::too_many_arguments)]
    fn finish_backward(
        &self,
        cfg: &DenseConfig,
        ws: &DenseWorkspace,
        inp: &DenseInputs<'_>,
        grads: &DenseGradOut<'_>,
        p: &CallPtrs,
        sched: &Schedule,
        sparse_used: bool,
        stats: &mut DenseStats,
    ) -> Result<()> {
        let (d, v) = (cfg.d, cfg.v);
        let code = dtype_code(cfg.dtype)?;
        if cfg.compute_d_c && !cfg.grad_f32 && !sparse_used {
            // The accumulators hold count f32, the outputs count elements (checked sizes).
            if !sched.split && !cfg.dc_in_grad_dtype {
                let dc_out = self.opt_ptr(grads.d_c.as_deref());
                self.convert_f32(code, p.dc_acc, dc_out, v * d)?;
            }
            if cfg.has_bias {
                let db_out = self.opt_ptr(grads.d_bias.as_deref());
                self.convert_f32(code, p.dbias_acc, db_out, v)?;
            }
        }
        if sched.filtering || sparse_used {
            self.filter_stats(cfg, ws, inp, p, stats)?;
        }
        Ok(())
    }

    /// `cce_dense_stats` over the rows' kept / dropped counts and the tile flags: into the
    /// status buffer when `inp.device_status` is set (read there by the backend), else read
    /// back (one host sync) into `stats`.
    pub(super) fn filter_stats(
        &self,
        cfg: &DenseConfig,
        ws: &DenseWorkspace,
        inp: &DenseInputs<'_>,
        p: &CallPtrs,
        stats: &mut DenseStats,
    ) -> Result<()> {
        let n_valid = inp.n_valid;
        let on_device = inp.device_status != 0;
        let stats_ptr = if on_device {
            inp.device_status + crate::backend::STATS_OFFSET as u64
        } else {
            self.ptr(&ws.stats)
        };
        let n_i = to_i32(cfg.n, "N")?;
        let n_flags = (cfg.row_tiles() * cfg.class_tiles()) as i64;
        let mut b = self.stream.launch_builder(self.func("cce_dense_stats")?);
        b.arg(&p.kept)
            .arg(&p.dropped)
            .arg(&p.targets)
            .arg(&n_i)
            .arg(&p.flags)
            .arg(&n_flags)
            .arg(&stats_ptr);
        // SAFETY: matches cce_dense_stats; kept/dropped/targets hold N values, flags
        // n_flags u32, stats 8 f64 (the workspace's, or bytes STATS_OFFSET..+40 of the
        // backend's 256-byte status buffer).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        if on_device {
            stats.stats_on_device = true;
            return Ok(());
        }
        let host = self.read_back::<64>(&ws.stats)?;
        let s: Vec<f64> = host
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let kept = s[0] as u64;
        let active = s[4] as u64;
        let entries = active * cfg.v as u64;
        stats.active_rows = active;
        stats.entries_kept = 2 * kept;
        stats.entries_skipped = 2 * entries.saturating_sub(kept);
        let tiles = (cfg.row_tiles() * cfg.class_tiles()) as u64;
        let visited = s[3] as u64;
        stats.tiles_visited = 2 * visited;
        stats.tiles_skipped = 2 * tiles.saturating_sub(visited);
        stats.dropped_mass_max = s[2];
        stats.dropped_mass_mean = if n_valid > 0 {
            (s[1] / n_valid as f64).min(s[2])
        } else {
            0.0
        };
        Ok(())
    }
}

/// The arguments of `cce_dense_sum_rows`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct LossScale {
    /// Factor of the sum of the per-row losses.
    pub scale: f64,
    /// The backend's device status buffer, 0 for none: the kernel then also makes the loss NaN
    /// while the status holds an unread error (`Checks::Deferred`).
    pub status: u64,
    /// Divide by the status's valid rows on the device (a mean with a device status).
    pub by_count: bool,
}

/// The loss reduction's arguments: with a device status, a mean's scale 1 divided on the
/// device by the valid rows there; else `1 / n_valid` (0 for none) for a mean, 1 for a sum.
pub(super) fn loss_scale(reduction: Reduction, n_valid: usize, status: u64) -> LossScale {
    let (scale, by_count) = match reduction {
        Reduction::Mean if status != 0 => (1.0, true),
        Reduction::Mean if n_valid > 0 => (1.0 / n_valid as f64, false),
        Reduction::Mean => (0.0, false),
        _ => (1.0, false),
    };
    LossScale {
        scale,
        status,
        by_count,
    }
}

/// The plan's tile statistics arguments: tile rows, tile classes, class tiles.
pub(super) fn tile_args(cfg: &DenseConfig) -> Result<(i32, i32, i32)> {
    Ok((
        to_i32(cfg.tile.0, "tile rows")?,
        to_i32(cfg.tile.1, "tile classes")?,
        to_i32(cfg.class_tiles(), "class tiles")?,
    ))
}

/// The row chunks of the dense passes, `(first row, rows, logits and forward rows already
/// there)`: chunks of `chunk` rows over the first `rows` rows, the first `reuse` rows (a
/// sparse probe's, left in place) as one chunk of their own.
pub(super) fn row_chunks(
    n: usize,
    chunk: usize,
    rows: usize,
    reuse: usize,
) -> Vec<(usize, usize, bool)> {
    let fresh = |from: usize| {
        (from..rows)
            .step_by(chunk)
            .map(move |r0| (r0, chunk.min(n - r0), false))
    };
    if reuse > 0 {
        std::iter::once((0, reuse, true))
            .chain(fresh(reuse))
            .collect()
    } else {
        fresh(0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mean_with_a_device_status_divides_on_the_device() {
        let s = loss_scale(Reduction::Mean, 0, 0x1000);
        assert_eq!(
            s,
            LossScale {
                scale: 1.0,
                status: 0x1000,
                by_count: true
            }
        );
        // A sum still passes the status: a recorded error makes its loss NaN.
        let s = loss_scale(Reduction::Sum, 0, 0x1000);
        assert_eq!((s.scale, s.status, s.by_count), (1.0, 0x1000, false));
    }

    #[test]
    fn without_a_device_status_the_host_count_scales() {
        assert_eq!(loss_scale(Reduction::Mean, 4, 0).scale, 0.25);
        assert_eq!(loss_scale(Reduction::Mean, 0, 0).scale, 0.0);
        assert_eq!(loss_scale(Reduction::Sum, 4, 0).scale, 1.0);
        assert!(!loss_scale(Reduction::Mean, 4, 0).by_count);
    }

    #[test]
    fn row_chunks_keep_a_reused_probe_chunk_first() {
        assert_eq!(
            row_chunks(10, 4, 10, 3),
            vec![(0, 3, true), (3, 4, false), (7, 3, false)]
        );
        assert_eq!(row_chunks(5, 4, 5, 0), vec![(0, 4, false), (4, 1, false)]);
    }
}
