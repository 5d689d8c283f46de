//! Glue to [`crate::CudaBackend`]: `Backend`-trait calls with [`crate::CudaTensor`] buffers.

use super::*;

/// A validated `CudaBackend` call handed to the engine (the backend has checked shapes,
/// dtypes, buffer ownership and targets, and made the plan).
pub(crate) struct BackendCall<'a> {
    /// The plan (strategy `ChunkedDense` or `SplitDense`).
    pub plan: &'a cce_core::Plan,
    /// The plan and options the call runs again with when its sparse backward gives way
    /// ([`super::schedule::give_way_plan`]).
    pub give_way: Option<(&'a cce_core::Plan, &'a cce_core::Options)>,
    /// Rows with a class, when the host knows them.
    pub n_valid: Option<usize>,
    /// Prepared classes, i32 `[N]` (−1 = ignored).
    pub classes: &'a CudaSlice<u8>,
    /// A scalar upstream `d_loss` spread over the rows, f32 `[N]` (the backend's prepare).
    pub dl: Option<&'a CudaSlice<u8>>,
    /// The backend's status buffer ([`DenseInputs::device_status`]).
    pub status: u64,
    /// The inputs.
    pub inputs: &'a cce_core::Inputs<'a, crate::CudaTensor>,
    /// The options.
    pub opts: &'a cce_core::Options,
    /// The backend's switches of the engine's paths (WGMMA forward, class pass and row pass;
    /// `d_c` in the gradient dtype).
    pub switches: PathSwitches,
}

/// A call's outputs, and whether its filter counts went to the backend's status.
pub(super) type BackendOutputs = (
    Option<cce_core::ForwardOutput<crate::CudaTensor>>,
    Option<cce_core::BackwardOutput<crate::CudaTensor>>,
    bool,
);

/// A call's statistics (forward, backward), and whether its filter counts went to the
/// backend's status.
pub(crate) type CallStatsPair = (
    Option<cce_core::CallStats>,
    Option<cce_core::CallStats>,
    bool,
);

impl DenseEngine {
    pub(super) fn tensor(&self, shape: Vec<usize>, dtype: DType) -> Result<crate::CudaTensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size_bytes();
        // SAFETY: every output tensor is fully written by the call before it is returned.
        let s =
            unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| alloc_err(e, bytes))?;
        crate::CudaTensor::from_slice(s, dtype, shape)
    }

    pub(super) fn base_stats(
        &self,
        call: &BackendCall<'_>,
        workspace_bytes: u64,
    ) -> cce_core::CallStats {
        let p = call.plan;
        cce_core::CallStats {
            backend: BACKEND.into(),
            strategy: p.strategy,
            plan_reason: p.reason.clone(),
            n_valid: call.n_valid.unwrap_or(0),
            tiles_total: p.tile_count(),
            tiles_visited: 0,
            tiles_skipped: 0,
            entries_kept: 0,
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: p.filter.eps,
            max_dropped_mass: p.filter.max_dropped_mass,
            workspace_bytes,
        }
    }

    /// Forward (`saved` None, `up` None), backward (`saved` Some: the forward's lse and
    /// `rest_mass`), or both (`saved` None, `up` Some), into output tensors allocated here.
    pub(crate) fn backend_run(
        &self,
        call: &BackendCall<'_>,
        saved: Option<cce_core::Saved<'_, crate::CudaTensor>>,
        up: Option<&cce_core::Upstream<'_, crate::CudaTensor>>,
    ) -> Result<BackendOutputs> {
        use cce_core::TensorMeta;
        let cfg = call_config(call, up.is_some())?;
        let mut fwd_t = if saved.is_none() {
            Some(self.forward_tensors(&cfg)?)
        } else {
            None
        };
        let mut grads_t = if up.is_some() {
            Some(self.grad_tensors(&cfg, call.inputs.e.shape().to_vec())?)
        } else {
            None
        };
        let (fs, bs, on_device) = self.run_outputs(
            call,
            &cfg,
            saved,
            up,
            fwd_t.as_mut().map(forward_out),
            grads_t
                .as_mut()
                .map_or_else(DenseGradOut::default, grad_out),
        )?;
        let fwd = fwd_t
            .zip(fs)
            .map(
                |((loss, lse, rest_mass, entropy, argmax), stats)| cce_core::ForwardOutput {
                    loss,
                    lse,
                    rest_mass,
                    entropy,
                    argmax,
                    stats,
                },
            );
        let bwd = grads_t
            .zip(bs)
            .map(|((d_e, d_c, d_bias), stats)| cce_core::BackwardOutput {
                d_e,
                d_c,
                d_bias,
                stats,
            });
        Ok((fwd, bwd, on_device))
    }

    /// As [`DenseEngine::backend_run`], into the caller's buffers (checked for dtype and shape
    /// by the backend, `crate::backend`); returns the forward's and the backward's statistics.
    pub(crate) fn backend_run_into(
        &self,
        call: &BackendCall<'_>,
        saved: Option<cce_core::Saved<'_, crate::CudaTensor>>,
        up: Option<&cce_core::Upstream<'_, crate::CudaTensor>>,
        fwd: Option<DenseForwardOut<'_>>,
        grads: DenseGradOut<'_>,
    ) -> Result<CallStatsPair> {
        let cfg = call_config(call, up.is_some())?;
        self.run_outputs(call, &cfg, saved, up, fwd, grads)
    }

    /// The engine's call of `cfg` into the output buffers `fo` (forward) and `go`
    /// (gradients): the workspace made for the call, the schedule walked, the statistics. A
    /// call whose sparse backward gave way ([`DenseStats::gave_way_stop`]) runs again on its
    /// give-way plan ([`BackendCall::give_way`]) after its workspace is freed; its statistics
    /// are the second run's, with the first's sparse note. A call with a give-way plan and a
    /// backward runs that plan from the start while its stream captures a CUDA graph.
    fn run_outputs(
        &self,
        call: &BackendCall<'_>,
        cfg: &DenseConfig,
        saved: Option<cce_core::Saved<'_, crate::CudaTensor>>,
        up: Option<&cce_core::Upstream<'_, crate::CudaTensor>>,
        mut fo: Option<DenseForwardOut<'_>>,
        mut go: DenseGradOut<'_>,
    ) -> Result<CallStatsPair> {
        let saved = saved.map(|sv| (sv.lse, sv.rest_mass));
        if let Some((lse, rest_mass)) = saved {
            f32_vec(cfg.n, lse, "lse")?;
            f32_vec(cfg.n, rest_mass, "rest_mass")?;
        }
        // A captured call cannot read the sparse backward's verdict: it runs the plan a call
        // that is not captured takes when the sparse backward gives way.
        let captured = call.give_way.is_some() && up.is_some() && self.capturing()?;
        let (first_note, first_bytes) = if captured {
            (Some(super::schedule::give_way_capture_note()), 0)
        } else {
            let (first, bytes) = self.run_engine(call, cfg, saved, up, &mut fo, &mut go)?;
            if !first.gave_way_stop {
                let forward = fo.is_some();
                return Ok(self.call_stats(call, cfg, up.is_some(), forward, &first, bytes));
            }
            (first.sparse, bytes)
        };
        let (plan, opts) = call.give_way.ok_or_else(|| {
            CceError::backend(
                BACKEND,
                "the sparse backward stopped without a give-way plan",
            )
        })?;
        let exact = BackendCall {
            plan,
            opts,
            give_way: None,
            ..*call
        };
        let exact_cfg = call_config(&exact, up.is_some())?;
        let (mut dstats, bytes) =
            self.run_engine(&exact, &exact_cfg, saved, up, &mut fo, &mut go)?;
        dstats.sparse = first_note;
        Ok(self.call_stats(
            &exact,
            &exact_cfg,
            up.is_some(),
            fo.is_some(),
            &dstats,
            bytes.max(first_bytes),
        ))
    }

    /// One run of the engine for `call` (its workspace made, used and freed): its statistics
    /// and the bytes it held beyond inputs and outputs.
    fn run_engine(
        &self,
        call: &BackendCall<'_>,
        cfg: &DenseConfig,
        saved: Option<(&crate::CudaTensor, &crate::CudaTensor)>,
        up: Option<&cce_core::Upstream<'_, crate::CudaTensor>>,
        fo: &mut Option<DenseForwardOut<'_>>,
        go: &mut DenseGradOut<'_>,
    ) -> Result<(DenseStats, u64)> {
        let dense_up = up.map(|u| dense_upstream(cfg, u, call.dl)).transpose()?;
        let mut ws = DenseWorkspace::new(self, cfg)?;
        let inputs = DenseInputs {
            e: call.inputs.e.slice(),
            c: call.inputs.c.slice(),
            bias: call.inputs.bias.map(|b| b.slice()),
            targets: call.classes,
            n_valid: call.n_valid.unwrap_or(0),
            device_status: call.status,
        };
        let ws_bytes = ws.bytes() + self.own_bytes();
        let dstats = match (fo, saved, dense_up.as_ref()) {
            (Some(fo), None, None) => self.forward(cfg, &mut ws, &inputs, fo)?,
            (Some(fo), None, Some(u)) => self.forward_backward(cfg, &mut ws, &inputs, u, fo, go)?,
            (None, Some((lse, rest_mass)), Some(u)) => self.backward(
                cfg,
                &mut ws,
                &inputs,
                (lse.slice(), rest_mass.slice()),
                u,
                go,
            )?,
            _ => {
                return Err(CceError::InvalidOption {
                    name: "call",
                    reason: "neither forward nor backward".into(),
                })
            }
        };
        drop(ws);
        Ok((dstats, ws_bytes))
    }

    /// A call's statistics from its engine run's: the forward's (`forward`: one ran), the
    /// backward's (`backward`), and whether the filter counts went to the backend's status.
    fn call_stats(
        &self,
        call: &BackendCall<'_>,
        cfg: &DenseConfig,
        backward: bool,
        forward: bool,
        dstats: &DenseStats,
        ws_bytes: u64,
    ) -> CallStatsPair {
        let fwd = forward.then(|| {
            let mut stats = self.base_stats(call, ws_bytes);
            if let Some(note) = &dstats.forward {
                stats.plan_reason = format!("{note}; plan: {}", stats.plan_reason);
            }
            stats
        });
        let bwd =
            backward.then(|| backward_stats(self.base_stats(call, ws_bytes), call, cfg.v, dstats));
        (fwd, bwd, dstats.stats_on_device)
    }

    /// The forward's output tensors of `cfg`: loss (`[N]` with reduction none, else a
    /// scalar), lse, `rest_mass`, and entropy, argmax when asked.
    fn forward_tensors(&self, cfg: &DenseConfig) -> Result<ForwardTensors> {
        let n = cfg.n;
        let loss_shape = if cfg.reduction == Reduction::None {
            vec![n]
        } else {
            vec![]
        };
        Ok((
            self.tensor(loss_shape, DType::F32)?,
            self.tensor(vec![n], DType::F32)?,
            self.tensor(vec![n], DType::F32)?,
            if cfg.want_entropy {
                Some(self.tensor(vec![n], DType::F32)?)
            } else {
                None
            },
            if cfg.want_argmax {
                Some(self.tensor(vec![n], DType::I32)?)
            } else {
                None
            },
        ))
    }

    /// The gradient tensors `cfg` asks for, in its gradient dtype (`d_e` of `e`'s shape).
    fn grad_tensors(&self, cfg: &DenseConfig, e_shape: Vec<usize>) -> Result<GradTensors> {
        let (d, v) = (cfg.d, cfg.v);
        let gdt = cfg.grad_dtype();
        Ok((
            if cfg.compute_d_e {
                Some(self.tensor(e_shape, gdt)?)
            } else {
                None
            },
            if cfg.compute_d_c {
                Some(self.tensor(vec![v, d], gdt)?)
            } else {
                None
            },
            if cfg.compute_d_c && cfg.has_bias {
                Some(self.tensor(vec![v], gdt)?)
            } else {
                None
            },
        ))
    }
}

/// The forward's output tensors: loss, lse, `rest_mass`, entropy, argmax.
type ForwardTensors = (
    crate::CudaTensor,
    crate::CudaTensor,
    crate::CudaTensor,
    Option<crate::CudaTensor>,
    Option<crate::CudaTensor>,
);

/// The gradient tensors: `d_e`, `d_c`, `d_bias`.
type GradTensors = (
    Option<crate::CudaTensor>,
    Option<crate::CudaTensor>,
    Option<crate::CudaTensor>,
);

/// The forward's output tensors as the engine's output buffers.
fn forward_out(t: &mut ForwardTensors) -> DenseForwardOut<'_> {
    let (loss, lse, rest, ent, am) = t;
    DenseForwardOut {
        loss: loss.slice_mut(),
        lse: lse.slice_mut(),
        rest: rest.slice_mut(),
        entropy: ent.as_mut().map(|t| t.slice_mut()),
        argmax: am.as_mut().map(|t| t.slice_mut()),
    }
}

/// The gradient tensors as the engine's output buffers.
fn grad_out(t: &mut GradTensors) -> DenseGradOut<'_> {
    let (de, dc, db) = t;
    DenseGradOut {
        d_e: de.as_mut().map(|t| t.slice_mut()),
        d_c: dc.as_mut().map(|t| t.slice_mut()),
        d_bias: db.as_mut().map(|t| t.slice_mut()),
        accumulate: false,
    }
}

/// An f32 vector of `n` values, else `ShapeMismatch` naming `what`.
fn f32_vec(n: usize, t: &crate::CudaTensor, what: &'static str) -> Result<()> {
    use cce_core::TensorMeta;
    if t.dtype() != DType::F32 || t.numel() != n {
        return Err(CceError::ShapeMismatch {
            what,
            expected: format!("[{n}] f32"),
            got: format!("{:?} {}", t.shape(), t.dtype()),
        });
    }
    Ok(())
}

/// The engine's upstream gradients of `u`: a scalar `d_loss` with a reduction (as `dl`, its
/// per-row spread, when given), per-row `d_loss` (f32 `[N]`) with none; `d_lse` f32 `[N]`.
fn dense_upstream<'a>(
    cfg: &DenseConfig,
    u: &cce_core::Upstream<'a, crate::CudaTensor>,
    dl: Option<&'a CudaSlice<u8>>,
) -> Result<DenseUpstream<'a>> {
    use cce_core::TensorMeta;
    let n = cfg.n;
    let d_loss = match u.d_loss {
        cce_core::DLoss::Scalar(_) if cfg.reduction == Reduction::None => {
            return Err(CceError::ShapeMismatch {
                what: "d_loss",
                expected: format!("per-row [{n}] f32 for reduction none"),
                got: "a scalar".into(),
            });
        }
        cce_core::DLoss::Scalar(x) => match dl {
            Some(rows) => DenseDLoss::PerRow(rows),
            None => DenseDLoss::Scalar(x),
        },
        cce_core::DLoss::PerRow(t) => {
            if cfg.reduction != Reduction::None {
                return Err(CceError::ShapeMismatch {
                    what: "d_loss",
                    expected: format!("a scalar for reduction {:?}", cfg.reduction),
                    got: format!("{:?}", t.shape()),
                });
            }
            f32_vec(n, t, "d_loss")?;
            DenseDLoss::PerRow(t.slice())
        }
    };
    if let Some(t) = u.d_lse {
        f32_vec(n, t, "d_lse")?;
    }
    Ok(DenseUpstream {
        d_loss,
        d_lse: u.d_lse.map(|t| t.slice()),
    })
}

/// A backward's statistics: `base` with what ran before the plan in its reason (the sparse
/// backward or why it gave way, the row pass, the class pass), and the filter's counts (or,
/// when nothing was skipped, every tile and entry of both filtered products).
fn backward_stats(
    mut stats: cce_core::CallStats,
    call: &BackendCall<'_>,
    v: usize,
    dstats: &DenseStats,
) -> cce_core::CallStats {
    let notes: Vec<&str> = [
        dstats.sparse.as_deref(),
        dstats.row_pass_note.as_deref(),
        dstats.class_pass.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !notes.is_empty() {
        stats.plan_reason = format!("{}; plan: {}", notes.join("; "), stats.plan_reason);
    }
    if dstats.filtered {
        stats.tiles_visited = dstats.tiles_visited;
        stats.tiles_skipped = dstats.tiles_skipped;
        stats.entries_kept = dstats.entries_kept;
        stats.entries_skipped = dstats.entries_skipped;
        stats.dropped_mass_max = dstats.dropped_mass_max;
        stats.dropped_mass_mean = dstats.dropped_mass_mean;
    } else {
        // Nothing skipped: every tile and entry of both filtered products was computed.
        let passes = call.plan.filter.filter_e_grad as u64 + call.plan.filter.filter_c_grad as u64;
        stats.tiles_visited = passes * stats.tiles_total;
        stats.entries_kept = passes * call.n_valid.unwrap_or(0) as u64 * v as u64;
    }
    stats
}

/// The engine's configuration of a call (`backward`: an upstream gradient is given).
fn call_config(call: &BackendCall<'_>, backward: bool) -> Result<DenseConfig> {
    let mut cfg = super::schedule::dense_config(call.plan, call.opts, call.switches, backward)?;
    cfg.stop_on_give_way = call.give_way.is_some();
    Ok(cfg)
}

/// Device bytes a call of `plan` with `opts` takes beyond its inputs and outputs: the
/// workspace ([`WorkspaceSizes`]) and the cuBLAS workspace the engine holds. `backward`: a
/// backward runs in the call; `switches`: (WGMMA forward, class pass, row pass).
pub(crate) fn workspace_bytes(
    plan: &cce_core::Plan,
    opts: &cce_core::Options,
    switches: PathSwitches,
    backward: bool,
) -> Result<u64> {
    let cfg = super::schedule::dense_config(plan, opts, switches, backward)?;
    Ok(super::workspace::WorkspaceSizes::of(&cfg).total() + CUBLAS_WORKSPACE_BYTES as u64)
}
