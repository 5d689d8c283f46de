//! A call's checks: buffer ownership, the problem and its plan, the targets (masked by the
//! bias?), the upstream gradients, a non-finite lse located in the inputs.

use super::*;
use crate::dense::schedule::{ChunkedG16, PlanKnobs};

/// Per-row upstream arrays the device checks (device addresses, 0 = none).
#[derive(Clone, Copy, Default)]
pub(super) struct UpstreamRows {
    d_loss: u64,
    d_lse: u64,
}

/// The arguments of `cce_prepare_finish` (device addresses, 0 = none).
struct FinishArgs {
    /// The caller's targets and whether they are i64.
    raw: (u64, bool),
    classes: u64,
    lse: u64,
    rows: UpstreamRows,
    n: usize,
    v: i64,
    /// A scalar `d_loss` to spread over the rows into `dl`.
    g: f32,
    dl: u64,
}

/// The launch of a grid-stride prepare or check kernel over `count` rows (or classes): 256
/// threads a block, at most 1024 blocks.
fn rows_grid(count: usize) -> LaunchConfig {
    cfg((count.div_ceil(256).clamp(1, 1024) as u32, 1, 1), 256, 0)
}

/// The dtype code of the prepare kernels (0 f32, 1 f16, 2 bf16).
fn dtype_code(dt: DType) -> i32 {
    match dt {
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => 0,
    }
}

impl CudaBackend {
    pub(super) fn check_owned(&self, what: &'static str, t: &CudaTensor) -> Result<()> {
        if t.cu_ctx() != self.ctx.cu_ctx() as usize {
            return Err(CceError::ForeignBuffer {
                backend: BACKEND,
                what,
            });
        }
        Ok(())
    }

    /// The problem and the plan of a call: buffer ownership, shapes, dtypes and options
    /// checked, the strategy planned (`crate::dense::schedule::plan_call`, from the sparse
    /// tries so far: `crate::dense::sparse_memory`; `call`: a call about to run, which counts
    /// towards the next try, else a query; `fused`: a forward-and-backward call, whose row pass
    /// can write f16 `G` for chunked dense's `d_c`: `PlanKnobs::chunked_g16`). Reads no tensor.
    pub(super) fn plan(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        call: bool,
        fused: bool,
    ) -> Result<(Problem, Plan, PlanKnobs)> {
        self.check_owned("e", inputs.e)?;
        self.check_owned("c", inputs.c)?;
        self.check_owned("targets", inputs.targets)?;
        if let Some(b) = inputs.bias {
            self.check_owned("bias", b)?;
        }
        let problem = inputs.problem(opts)?;
        let key = crate::dense::sparse_memory::SparseKey::new(
            (problem.n, problem.d, problem.v),
            problem.dtype,
            problem.has_bias,
            opts.softcap,
            &cce_core::FilterRule::resolve(opts, problem.dtype),
        );
        // A poisoned lock (a panic while recording) only loses the history.
        let sparse_expected = match self.sparse_memory.lock() {
            Ok(mut m) if call => m.plan_call(&key),
            Ok(m) => m.expects_sparse(&key),
            Err(_) => true,
        };
        let dev = crate::dense::schedule::DeviceFacts {
            major: self.cc.0,
            minor: self.cc.1,
            sm_count: self.sm_count,
            max_smem_optin: self.limits.max_block_memory_bytes as usize,
            fused_static_smem: 0,
        };
        let aligned =
            inputs.e.device_ptr().is_multiple_of(16) && inputs.c.device_ptr().is_multiple_of(16);
        let knobs = PlanKnobs {
            chunk_cap: self.chunk_cap,
            sparse: self.sparse,
            split_de_f16: self.split_de_f16,
            chunked_f32_grads: self.chunked_f32_grads,
            chunked_g16: fused.then_some(ChunkedG16 {
                dev,
                wgmma_rows: self.wgmma_rows,
                aligned,
            }),
            dc_in_grad_dtype: self.dc_in_grad_dtype,
            sparse_expected,
        };
        let plan = crate::dense::schedule::plan_call(&problem, opts, &self.limits, knobs)?;
        Ok((problem, plan, knobs))
    }

    /// A call's problem and plan, and its targets prepared on the device
    /// (`kernels/prepare.cu`): classes with shift and ignore_index applied, the valid rows,
    /// the bias's masked targets, with a backward (`upstream`) the per-row spread of a scalar
    /// `d_loss` and, with `check_finite`, per-row upstream gradients checked. Nothing is read
    /// back under [`Checks::Deferred`]; under [`Checks::Eager`] the status is read once here.
    ///
    /// Errors: those of [`CudaBackend::plan`]; a non-finite scalar `d_loss` (host value);
    /// under `Eager`, the first of `TargetOutOfRange`, `AllTargetsIgnored`, `TargetMasked`,
    /// `InvalidOption` (label smoothing over a masked class), `NonFinite` (`d_loss`, `d_lse`).
    /// `fused`: a forward-and-backward call ([`CudaBackend::plan`]).
    pub(super) fn prepare(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        upstream: Option<&Upstream<'_, CudaTensor>>,
        fused: bool,
    ) -> Result<Prepared> {
        let (problem, plan, knobs) = self.plan(inputs, opts, true, fused)?;
        let give_way =
            crate::dense::schedule::give_way_plan(&problem, opts, &self.limits, knobs, &plan)?;
        let rows = self.upstream_rows(opts, upstream)?;
        let n = problem.n;
        let classes = self.alloc_raw(n * 4)?;
        self.begin_call_status()?;
        let status = self.status_ptr();
        let v = problem.v as i64;
        let (bias, bias_dt) = match inputs.bias {
            Some(b) => (self.tptr(b), dtype_code(b.dtype())),
            None => (0u64, 0i32),
        };
        let grid = rows_grid;
        if bias != 0 {
            // SAFETY: matches cce_prepare_bias_masked; bias holds V elements of its dtype
            // (checked by Problem::new), status is the backend's 256-byte buffer.
            unsafe {
                launch!(
                    self,
                    "cce_prepare_bias_masked",
                    grid(problem.v),
                    bias,
                    bias_dt,
                    v,
                    status
                )
            }?;
        }
        let raw = self.tptr(inputs.targets);
        let raw_i64 = inputs.targets.dtype() == DType::I64;
        let name = if raw_i64 {
            "cce_prepare_targets_i64"
        } else {
            "cce_prepare_targets_i32"
        };
        let seq_len = problem.seq_len as i64;
        let shift = opts.shift.min(problem.seq_len) as i64;
        let classes_ptr = self.ptr(&classes);
        // SAFETY: matches cce_prepare_targets_*; raw holds N targets of its integer dtype
        // (checked), seq_len divides N (checked) and shift ≤ seq_len, so `i + shift` stays
        // below N where it is read; classes holds N i32 (allocated above); bias V elements
        // or null.
        unsafe {
            launch!(
                self,
                name,
                grid(n),
                raw,
                n as i64,
                seq_len,
                shift,
                opts.ignore_index,
                v,
                bias,
                bias_dt,
                classes_ptr,
                status
            )
        }?;
        for (slot, x) in [
            (status::SLOT_D_LOSS, rows.d_loss),
            (status::SLOT_D_LSE, rows.d_lse),
        ] {
            if x != 0 {
                self.check_rows_finite(x, n, classes_ptr, (false, slot))?;
            }
        }
        let dl = match upstream.map(|u| u.d_loss) {
            Some(DLoss::Scalar(g)) => Some((g, self.alloc_raw(n * 4)?)),
            _ => None,
        };
        let finish = FinishArgs {
            raw: (raw, raw_i64),
            classes: classes_ptr,
            lse: 0,
            rows,
            n,
            v,
            g: dl.as_ref().map_or(0.0, |x| x.0),
            dl: dl.as_ref().map_or(0, |x| self.ptr(&x.1)),
        };
        self.finish_checks(opts, &finish)?;
        let n_valid = self.eager_status()?.map(|r| r.n_valid);
        Ok(Prepared {
            problem,
            plan,
            give_way,
            classes,
            dl: dl.map(|x| x.1),
            n_valid,
        })
    }

    /// The upstream gradients' checks that need no device read: ownership, a finite scalar
    /// `d_loss` (`NonFinite` otherwise, [`cce_core::problem::check_upstream_finite`]). Returns
    /// the per-row arrays the device checks when `check_finite` (0 for none).
    fn upstream_rows(
        &self,
        opts: &Options,
        upstream: Option<&Upstream<'_, CudaTensor>>,
    ) -> Result<UpstreamRows> {
        let mut rows = UpstreamRows::default();
        let Some(up) = upstream else {
            return Ok(rows);
        };
        match up.d_loss {
            DLoss::Scalar(value) => {
                cce_core::problem::check_upstream_finite("d_loss", [value])?;
            }
            DLoss::PerRow(t) => {
                self.check_owned("d_loss", t)?;
                if opts.check_finite {
                    rows.d_loss = self.tptr(t);
                }
            }
        }
        if let Some(t) = up.d_lse {
            self.check_owned("d_lse", t)?;
            if opts.check_finite {
                rows.d_lse = self.tptr(t);
            }
        }
        Ok(rows)
    }

    /// `cce_check_rows_finite` over an f32 `[N]` array at `x`: its first non-finite row into
    /// status word `slot` (`lse_rule`: a −inf lse of an ignored row is allowed when the bias
    /// masks a class).
    fn check_rows_finite(
        &self,
        x: u64,
        n: usize,
        classes: u64,
        (lse_rule, slot): (bool, i32),
    ) -> Result<()> {
        let grid = rows_grid(n);
        let status = self.status_ptr();
        let rule = lse_rule as i32;
        // SAFETY: matches cce_check_rows_finite; x holds N f32 (a checked upstream array or
        // the call's lse), classes N i32, status the backend's 256-byte buffer.
        unsafe {
            launch!(
                self,
                "cce_check_rows_finite",
                grid,
                x,
                n as i64,
                classes,
                rule,
                slot,
                status
            )
        }
    }

    /// `cce_prepare_finish`: the call area folded into the status's record, and the per-row
    /// `d_loss` written when `a.dl` is set.
    fn finish_checks(&self, opts: &Options, a: &FinishArgs) -> Result<()> {
        let status = self.status_ptr();
        let raw_i64 = a.raw.1 as i32;
        let mean = (opts.reduction == cce_core::Reduction::Mean) as i32;
        let shift = opts.shift as u64;
        // SAFETY: matches cce_prepare_finish; status is the backend's 256-byte buffer, raw N
        // targets of the flagged integer dtype, classes N i32, lse / d_loss / d_lse N f32 or
        // 0 (read only at a row their check flagged), dl N f32 or 0; one block.
        unsafe {
            launch!(
                self,
                "cce_prepare_finish",
                cfg((1, 1, 1), 1024, 0),
                status,
                a.raw.0,
                raw_i64,
                a.classes,
                a.lse,
                a.rows.d_loss,
                a.rows.d_lse,
                a.n as i64,
                a.v,
                opts.ignore_index,
                shift,
                mean,
                opts.label_smoothing,
                a.g,
                a.dl
            )
        }
    }

    /// After a call's passes: with `check_finite` and a forward (`lse`), the lse checked on the
    /// device; then, under [`Checks::Eager`], the status read when there is something to read
    /// (the lse's check, the filter's counts): a non-finite lse reported with the first
    /// non-finite input behind it, and `stats` completed with the valid rows and the filter's
    /// counts. Under `Deferred` nothing is read (the counts wait in [`CudaBackend::status`]).
    pub(super) fn finish_call(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
        lse: Option<&CudaTensor>,
        filtered_on_device: bool,
        (fwd, bwd): (Option<&mut CallStats>, Option<&mut CallStats>),
    ) -> Result<()> {
        self.last_filtered
            .store(filtered_on_device, std::sync::atomic::Ordering::Relaxed);
        let check_lse = opts.check_finite && lse.is_some();
        if let (true, Some(lse)) = (check_lse, lse) {
            let (n, classes) = (p.problem.n, self.ptr(&p.classes));
            let lse_ptr = self.tptr(lse);
            self.check_rows_finite(lse_ptr, n, classes, (true, status::SLOT_LSE))?;
            let raw = (
                self.tptr(inputs.targets),
                inputs.targets.dtype() == DType::I64,
            );
            let finish = FinishArgs {
                raw,
                classes,
                lse: lse_ptr,
                rows: UpstreamRows::default(),
                n,
                v: p.problem.v as i64,
                g: 0.0,
                dl: 0,
            };
            self.finish_checks(opts, &finish)?;
        }
        let report = if check_lse || filtered_on_device {
            match self.eager_status() {
                Err(CceError::NonFinite {
                    what, row, value, ..
                }) if what.starts_with("lse") => {
                    return Err(self.locate_non_finite(inputs, p, row, value))
                }
                r => r?,
            }
        } else {
            p.n_valid.map(|n_valid| DeviceReport {
                n_valid,
                filter: None,
            })
        };
        if let Some(r) = report {
            if let Some(s) = fwd {
                status::complete_stats(s, &r, None);
            }
            if let Some(s) = bwd {
                status::complete_stats(s, &r, Some(p.problem.v));
            }
        }
        Ok(())
    }

    /// Locate the first non-finite input behind a non-finite lse of `row` (error path only).
    pub(super) fn locate_non_finite(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        p: &Prepared,
        row: usize,
        lse: f32,
    ) -> CceError {
        let d = p.problem.d;
        let first_bad = |t: &CudaTensor| -> Option<(usize, f32)> {
            self.download(t)
                .ok()
                .and_then(|h| cce_core::problem::first_non_finite(h.to_f32_vec()))
        };
        if let Ok(h) = self.download(inputs.e) {
            let vals = h.to_f32_vec();
            if let Some((k, v)) = vals[row * d..(row + 1) * d]
                .iter()
                .enumerate()
                .find(|(_, x)| !x.is_finite())
            {
                return CceError::NonFinite {
                    what: "e",
                    index: row * d + k,
                    row,
                    value: *v,
                };
            }
        }
        if let Some(b) = inputs.bias {
            // −inf masks a class (valid input); NaN and +inf are errors.
            let bad = self.download(b).ok().and_then(|h| {
                h.to_f32_vec()
                    .into_iter()
                    .enumerate()
                    .find(|(_, x)| x.is_nan() || *x == f32::INFINITY)
            });
            if let Some((index, value)) = bad {
                return CceError::NonFinite {
                    what: "bias",
                    index,
                    row: index,
                    value,
                };
            }
        }
        if let Some((index, value)) = first_bad(inputs.c) {
            return CceError::NonFinite {
                what: "c",
                index,
                row: index / d,
                value,
            };
        }
        CceError::NonFinite {
            what: "lse (the logits overflow)",
            index: row,
            row,
            value: lse,
        }
    }
}
