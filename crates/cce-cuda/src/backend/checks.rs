//! A call's checks: buffer ownership, the problem and its plan, the targets (masked by the
//! bias?), the upstream gradients, a non-finite lse located in the inputs.

use super::*;

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
    /// checked, the strategy planned (`crate::dense::schedule::plan_call`). Reads no tensor.
    pub(super) fn plan(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
    ) -> Result<(Problem, Plan)> {
        self.check_owned("e", inputs.e)?;
        self.check_owned("c", inputs.c)?;
        self.check_owned("targets", inputs.targets)?;
        if let Some(b) = inputs.bias {
            self.check_owned("bias", b)?;
        }
        let problem = Problem::new(
            inputs.e,
            inputs.c,
            inputs.bias.map(|b| b as &dyn TensorMeta),
            inputs.targets,
            opts,
        )?;
        let knobs = crate::dense::schedule::PlanKnobs {
            chunk_cap: self.chunk_cap,
            sparse: self.sparse,
            split_de_f16: self.split_de_f16,
        };
        let plan = crate::dense::schedule::plan_call(&problem, opts, &self.limits, knobs)?;
        Ok((problem, plan))
    }

    pub(super) fn prepare(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
    ) -> Result<Prepared> {
        let (problem, plan) = self.plan(inputs, opts)?;
        // Targets are read back (4N or 8N bytes) to validate them and name a bad row; the
        // prepared classes (shift and ignore_index applied, -1 = ignored) go back as i32.
        let raw = self
            .download(inputs.targets)?
            .to_i64_vec()
            .ok_or_else(|| CceError::backend(BACKEND, "targets are not integers"))?;
        let targets = PreparedTargets::new(&raw, &problem, opts)?;
        let masked = match inputs.bias {
            Some(b) => self.check_targets_unmasked(b, &targets, opts)?,
            None => false,
        };
        let classes = self
            .stream
            .clone_htod(bytemuck::cast_slice::<i32, u8>(&targets.classes))
            .map_err(|e| alloc_err(e, problem.n * 4))?;
        Ok(Prepared {
            problem,
            plan,
            targets,
            classes,
            masked,
        })
    }

    /// A −inf `bias` entry masks its class (p = 0, a valid input); a valid row whose target it
    /// masks has an infinite loss, as has a row with any masked class under label smoothing:
    /// `TargetMasked` / `InvalidOption` naming the first such row
    /// ([`cce_core::problem::check_masked_targets`]). Reads the bias back (`V` elements).
    /// Returns whether the bias masks any class.
    pub(super) fn check_targets_unmasked(
        &self,
        bias: &CudaTensor,
        targets: &PreparedTargets,
        opts: &Options,
    ) -> Result<bool> {
        let host = self.download(bias)?.to_f32_vec();
        if !host.contains(&f32::NEG_INFINITY) {
            return Ok(false);
        }
        cce_core::problem::check_masked_targets(targets, opts, |i| {
            (host[targets.classes[i] as usize] == f32::NEG_INFINITY, true)
        })?;
        Ok(true)
    }

    /// The upstream gradients must be finite (NaN or ±inf there would spread through every
    /// gradient): `NonFinite` naming `d_loss` or `d_lse` and the first bad row
    /// ([`cce_core::problem::check_upstream_finite`], the rule every backend applies). A scalar
    /// is always checked; per-row arrays (read back, 4N bytes each) with `check_finite`.
    pub(super) fn check_upstream(
        &self,
        opts: &Options,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<()> {
        use cce_core::problem::check_upstream_finite;
        if let DLoss::Scalar(value) = upstream.d_loss {
            check_upstream_finite("d_loss", [value])?;
        }
        if !opts.check_finite {
            return Ok(());
        }
        let per_row = match upstream.d_loss {
            DLoss::PerRow(t) => Some(("d_loss", t)),
            DLoss::Scalar(_) => None,
        };
        for (what, t) in per_row
            .into_iter()
            .chain(upstream.d_lse.map(|t| ("d_lse", t)))
        {
            self.check_owned(what, t)?;
            check_upstream_finite(what, self.download(t)?.to_f32_vec())?;
        }
        Ok(())
    }

    /// With `check_finite`, read the lse back (4N bytes) and report the first non-finite input
    /// behind a non-finite lse. An ignored row whose every class is masked by the bias has lse
    /// −inf, which is not an error (without a masking bias, a −inf lse comes from −inf in `e`
    /// or `c`, which is).
    pub(super) fn check_finite_lse(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
        lse: &CudaTensor,
    ) -> Result<()> {
        if opts.check_finite {
            let host = self.download(lse)?.to_f32_vec();
            let classes = &p.targets.classes;
            // Ignored rows may have lse −inf (every class masked); anything else non-finite is
            // an error.
            let masked_ignored =
                |i: usize, x: f32| p.masked && x == f32::NEG_INFINITY && classes[i] < 0;
            let bad = host
                .iter()
                .enumerate()
                .find(|&(i, x)| !(x.is_finite() || masked_ignored(i, *x)));
            if let Some((row, &value)) = bad {
                return Err(self.locate_non_finite(inputs, p, row, value));
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
