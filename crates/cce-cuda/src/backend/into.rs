//! Calls whose outputs are the caller's buffers (a framework's tensors, lent with
//! [`CudaTensor::borrowed`]), and the workspace a call will take.
//!
//! The `Backend` trait's calls allocate their outputs on the backend's stream; a framework
//! that owns its tensors (PyTorch's caching allocator, candle's storage) passes them here
//! instead, and the engine writes into them: no copy, and no second buffer of the gradients'
//! size. The checks, the plan and the schedule are those of the trait's calls.

use super::*;
use crate::dense::{DenseForwardOut, DenseGradOut};
use cce_core::{CallStats, GradDType, Reduction};

/// Forward outputs the caller provides: loss f32 (`[]` for mean and sum, `[N]` for none),
/// lse and `rest_mass` f32 `[N]` (what a backward reads), entropy f32 `[N]` and argmax i32
/// `[N]` exactly when `opts.side_outputs` asks for them. Shapes are checked by element count
/// (any shape of that many elements: a framework's `[B, T]` is fine).
#[derive(Debug)]
pub struct ForwardInto<'a> {
    /// Loss.
    pub loss: &'a mut CudaTensor,
    /// Log-sum-exp per row.
    pub lse: &'a mut CudaTensor,
    /// `1 − p_y` per row without cancellation ([`cce_core::ForwardOutput::rest_mass`]).
    pub rest_mass: &'a mut CudaTensor,
    /// Entropy per row, when asked.
    pub entropy: Option<&'a mut CudaTensor>,
    /// Argmax per row, when asked.
    pub argmax: Option<&'a mut CudaTensor>,
}

/// Gradient outputs the caller provides, in the gradient dtype (`opts.grad_dtype`: the input
/// dtype, or f32): `d_e` of `e`'s element count, `d_c` `[V, D]`, `d_bias` `[V]`. A buffer may
/// be given only when the options compute it (`opts.compute_d_e`; `opts.compute_d_c`, and a
/// bias for `d_bias`); one the options compute but the caller does not give (`d_bias` of a
/// bias the caller does not train, `d_c` when only `d_bias` is wanted) goes to a buffer of
/// the call's own, freed after it. Every element given is overwritten, unless `accumulate`.
///
/// ```no_run
/// # use cce_core::{DType, GradDType, Inputs, Options, Upstream};
/// # use cce_cuda::{CudaBackend, CudaTensor, ForwardInto, GradsInto};
/// # fn step(be: &CudaBackend, inputs: &Inputs<'_, CudaTensor>, fwd: ForwardInto<'_>,
/// #         c_grad: &mut CudaTensor) -> cce_core::Result<()> {
/// // Micro-batches of one step add their d_c into one f32 buffer (zeroed once per step).
/// let opts = Options { grad_dtype: GradDType::F32, compute_d_e: false, ..Options::default() };
/// let grads = GradsInto { d_c: Some(c_grad), accumulate: true, ..GradsInto::default() };
/// be.forward_backward_into(inputs, &opts, &Upstream::default(), fwd, grads)?;
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct GradsInto<'a> {
    /// `∂loss/∂e`.
    pub d_e: Option<&'a mut CudaTensor>,
    /// `∂loss/∂c`.
    pub d_c: Option<&'a mut CudaTensor>,
    /// `∂loss/∂bias`.
    pub d_bias: Option<&'a mut CudaTensor>,
    /// Add the call's gradients to the given buffers' current contents instead of
    /// overwriting them (`buffer += gradient`, the gradient accumulation of micro-batches and
    /// mixed-precision training). Every buffer given must then be f32: the gradient dtype must
    /// be f32 (`opts.grad_dtype = GradDType::F32`, or f32 inputs), else the call fails with
    /// `InvalidOption` (`accumulate`) before any launch. Buffers the caller does not give are
    /// not affected (the call's own, zeroed, take those gradients). An accumulating call does
    /// not try the plan's sparse backward (its gather kernels write the gradients rather than
    /// add to them): a filtered split-dense call runs the dense passes, and its `plan_reason`
    /// says so; its statistics are then those of the dense passes (nothing skipped), else
    /// those of a call without `accumulate`. Default `false`.
    pub accumulate: bool,
}

/// `ShapeMismatch` unless `t` holds `numel` elements of `dtype` (`what` names it).
fn expect(t: &CudaTensor, what: &'static str, numel: usize, dtype: DType) -> Result<()> {
    if t.dtype() != dtype || t.numel() != numel {
        return Err(CceError::ShapeMismatch {
            what,
            expected: format!("{numel} elements of {dtype}"),
            got: format!("{:?} {}", t.shape(), t.dtype()),
        });
    }
    Ok(())
}

/// `InvalidOption` when an output is given without being asked for, or asked for without
/// being given.
fn presence(what: &'static str, given: bool, asked: bool) -> Result<()> {
    if given != asked {
        return Err(CceError::InvalidOption {
            name: what,
            reason: if asked {
                "asked for by the options but no buffer was given".into()
            } else {
                "a buffer was given but the options do not ask for it".into()
            },
        });
    }
    Ok(())
}

impl ForwardInto<'_> {
    /// Check every buffer against the problem and the options.
    fn check(&self, p: &Problem, opts: &Options) -> Result<()> {
        let n = p.n;
        let loss_n = if opts.reduction == Reduction::None {
            n
        } else {
            1
        };
        expect(self.loss, "loss (output)", loss_n, DType::F32)?;
        expect(self.lse, "lse (output)", n, DType::F32)?;
        expect(self.rest_mass, "rest_mass (output)", n, DType::F32)?;
        presence(
            "entropy (output)",
            self.entropy.is_some(),
            opts.side_outputs.entropy,
        )?;
        presence(
            "argmax (output)",
            self.argmax.is_some(),
            opts.side_outputs.argmax,
        )?;
        if let Some(t) = &self.entropy {
            expect(t, "entropy (output)", n, DType::F32)?;
        }
        if let Some(t) = &self.argmax {
            expect(t, "argmax (output)", n, DType::I32)?;
        }
        Ok(())
    }

    /// The engine's view of the buffers.
    fn dense(&mut self) -> DenseForwardOut<'_> {
        DenseForwardOut {
            loss: self.loss.slice_mut(),
            lse: self.lse.slice_mut(),
            rest: self.rest_mass.slice_mut(),
            entropy: self.entropy.as_mut().map(|t| t.slice_mut()),
            argmax: self.argmax.as_mut().map(|t| t.slice_mut()),
        }
    }
}

impl GradsInto<'_> {
    /// Check every buffer against the problem and the options (f32 gradients when
    /// accumulating).
    fn check(&self, p: &Problem, opts: &Options, has_bias: bool) -> Result<()> {
        let gdt = grad_dtype(p, opts);
        if self.accumulate && gdt != DType::F32 {
            return Err(CceError::InvalidOption {
                name: "accumulate",
                reason: format!(
                    "accumulating gradient buffers must be f32 (opts.grad_dtype = \
                     GradDType::F32); the gradient dtype is {gdt}"
                ),
            });
        }
        let given = |t: &Option<&mut CudaTensor>, what, asked: bool| {
            if t.is_some() && !asked {
                return presence(what, true, false);
            }
            Ok(())
        };
        given(&self.d_e, "d_e (output)", opts.compute_d_e)?;
        given(&self.d_c, "d_c (output)", opts.compute_d_c)?;
        given(
            &self.d_bias,
            "d_bias (output)",
            opts.compute_d_c && has_bias,
        )?;
        if let Some(t) = &self.d_e {
            expect(t, "d_e (output)", p.n * p.d, gdt)?;
        }
        if let Some(t) = &self.d_c {
            expect(t, "d_c (output)", p.v * p.d, gdt)?;
        }
        if let Some(t) = &self.d_bias {
            expect(t, "d_bias (output)", p.v, gdt)?;
        }
        Ok(())
    }
}

/// The gradient dtype of a call.
fn grad_dtype(p: &Problem, opts: &Options) -> DType {
    match opts.grad_dtype {
        GradDType::F32 => DType::F32,
        GradDType::Input => p.dtype,
    }
}

/// The engine's gradient buffers: the caller's, and the call's own for what the options
/// compute but the caller did not give (`own` holds them for the call; zeroed when the call
/// accumulates, so that the engine reads no uninitialized memory).
fn grads_dense<'a>(
    be: &CudaBackend,
    out: &'a mut GradsInto<'_>,
    own: &'a mut [Option<CudaTensor>; 3],
    p: &Problem,
    opts: &Options,
    has_bias: bool,
) -> Result<DenseGradOut<'a>> {
    let gdt = grad_dtype(p, opts);
    let wanted = [
        (opts.compute_d_e && out.d_e.is_none(), p.n * p.d),
        (opts.compute_d_c && out.d_c.is_none(), p.v * p.d),
        (opts.compute_d_c && has_bias && out.d_bias.is_none(), p.v),
    ];
    for (slot, (missing, numel)) in own.iter_mut().zip(wanted) {
        if missing {
            *slot = Some(if out.accumulate {
                be.zeros(vec![numel], gdt)?
            } else {
                be.alloc_tensor(vec![numel], gdt)?
            });
        }
    }
    let [e_own, c_own, b_own] = own;
    let pick = |given: &'a mut Option<&mut CudaTensor>, own: &'a mut Option<CudaTensor>| {
        given.as_deref_mut().or(own.as_mut()).map(|t| t.slice_mut())
    };
    Ok(DenseGradOut {
        d_e: pick(&mut out.d_e, e_own),
        d_c: pick(&mut out.d_c, c_own),
        d_bias: pick(&mut out.d_bias, b_own),
        accumulate: out.accumulate,
    })
}

impl CudaBackend {
    /// [`Backend::forward`] into the caller's buffers: the loss, lse and rest mass (and the
    /// side outputs asked for) are written into `out`, nothing is allocated for them. Returns
    /// the call's statistics.
    ///
    /// Errors: those of [`Backend::forward`], plus `ShapeMismatch` for an output of the wrong
    /// dtype or element count and `InvalidOption` for a side output given but not asked for
    /// (or asked for but not given).
    pub fn forward_into(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        mut out: ForwardInto<'_>,
    ) -> Result<CallStats> {
        let p = self.prepare(inputs, opts, None, false)?;
        out.check(&p.problem, opts)?;
        let call = self.dense_call(&p, inputs, opts);
        let (fs, _, on_device) = self.dense_engine()?.backend_run_into(
            &call,
            None,
            None,
            Some(out.dense()),
            DenseGradOut::default(),
        )?;
        let mut fs = fs.ok_or_else(|| CceError::backend(BACKEND, "no forward statistics"))?;
        self.finish_call(
            inputs,
            opts,
            &p,
            Some(out.lse),
            on_device,
            (Some(&mut fs), None),
        )?;
        Ok(fs)
    }

    /// [`Backend::backward`] into the caller's buffers (`out`, see [`GradsInto`]). Returns the
    /// call's statistics.
    ///
    /// Errors: those of [`Backend::backward`], plus those of [`GradsInto`]'s checks
    /// (`ShapeMismatch`, `InvalidOption`).
    pub fn backward_into(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Saved<'_, CudaTensor>,
        upstream: &Upstream<'_, CudaTensor>,
        mut out: GradsInto<'_>,
    ) -> Result<CallStats> {
        self.check_owned("lse", saved.lse)?;
        self.check_owned("rest_mass", saved.rest_mass)?;
        let p = self.prepare(inputs, opts, Some(upstream), false)?;
        out.check(&p.problem, opts, inputs.bias.is_some())?;
        saved.check(p.problem.n)?;
        let call = self.dense_call(&p, inputs, opts);
        let mut own = [None, None, None];
        let grads = grads_dense(
            self,
            &mut out,
            &mut own,
            &p.problem,
            opts,
            inputs.bias.is_some(),
        )?;
        let (_, bs, on_device) = self.dense_engine()?.backend_run_into(
            &call,
            Some(saved),
            Some(upstream),
            None,
            grads,
        )?;
        let mut bs = bs.ok_or_else(|| CceError::backend(BACKEND, "no backward statistics"))?;
        self.finish_call(inputs, opts, &p, None, on_device, (None, Some(&mut bs)))?;
        Ok(bs)
    }

    /// [`Backend::forward_backward`] into the caller's buffers. Returns the forward's and
    /// the backward's statistics.
    ///
    /// Errors: those of [`CudaBackend::forward_into`] and [`CudaBackend::backward_into`].
    pub fn forward_backward_into(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        upstream: &Upstream<'_, CudaTensor>,
        mut fwd: ForwardInto<'_>,
        mut grads: GradsInto<'_>,
    ) -> Result<(CallStats, CallStats)> {
        let p = self.prepare(inputs, opts, Some(upstream), true)?;
        fwd.check(&p.problem, opts)?;
        grads.check(&p.problem, opts, inputs.bias.is_some())?;
        let call = self.dense_call(&p, inputs, opts);
        let mut own = [None, None, None];
        let dense_grads = grads_dense(
            self,
            &mut grads,
            &mut own,
            &p.problem,
            opts,
            inputs.bias.is_some(),
        )?;
        let (fs, bs, on_device) = self.dense_engine()?.backend_run_into(
            &call,
            None,
            Some(upstream),
            Some(fwd.dense()),
            dense_grads,
        )?;
        let (mut fs, mut bs) = match (fs, bs) {
            (Some(f), Some(b)) => (f, b),
            _ => return Err(CceError::backend(BACKEND, "no statistics")),
        };
        self.finish_call(
            inputs,
            opts,
            &p,
            Some(fwd.lse),
            on_device,
            (Some(&mut fs), Some(&mut bs)),
        )?;
        Ok((fs, bs))
    }

    /// Device bytes a call with these inputs' shapes and `opts` allocates beyond its inputs
    /// and outputs: the plan's workspace and the cuBLAS workspace (what
    /// [`CallStats::workspace_bytes`] reports for the call), at most
    /// `opts.workspace_budget_bytes`; for a forward-only call the workspace is at most
    /// [`crate::dense::FORWARD_WORKSPACE_CAP`] of it. `backward`: the call runs a backward
    /// (`backward`, `forward_backward`); a forward-only call otherwise. Reads no tensor's
    /// contents (no synchronization).
    ///
    /// Errors: those of the inputs' shapes, dtypes and options, and `ResourceLimit` when no
    /// strategy fits the budget less the cuBLAS workspace.
    pub fn workspace_bytes(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        backward: bool,
    ) -> Result<u64> {
        let (problem, plan, knobs) = self.plan(inputs, opts, false, backward)?;
        let first = crate::dense::workspace_bytes(&plan, opts, self.path_switches(), backward)?;
        // A call whose sparse backward gives way frees its workspace before the exact plan's
        // is made: the larger of the two is what the call takes.
        let give_way =
            crate::dense::schedule::give_way_plan(&problem, opts, &self.limits, knobs, &plan)?;
        Ok(match (give_way, backward) {
            (Some((p, o)), true) => first.max(crate::dense::workspace_bytes(
                &p,
                &o,
                self.path_switches(),
                true,
            )?),
            _ => first,
        })
    }

    /// The switches of a call's engine paths.
    pub(super) fn path_switches(&self) -> crate::dense::PathSwitches {
        crate::dense::PathSwitches {
            wgmma_forward: self.wgmma_forward,
            wgmma_gcols: self.wgmma_gcols,
            wgmma_rows: self.wgmma_rows,
            dc_in_grad_dtype: self.dc_in_grad_dtype,
        }
    }
}
