//! [`OracleBackend`]: the f64 naive oracle behind the [`Backend`] trait (buffers are host
//! tensors). It is the suite's own reference backend: the suite is stamped onto it in this
//! crate's tests (it must pass every check), and deliberately broken wrappers around it must
//! fail them (a check that cannot fail is a defect).

use cce_core::options::{GradDType, Reduction};
use cce_core::plan::{DeviceLimits, Strategy};
use cce_core::problem::{check_upstream_finite, first_bad_bias, first_non_finite, Problem};
use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DLoss, DType, FilterRule, ForwardBackward,
    ForwardOutput, HostTensor, Inputs, Options, Result, Saved, TensorMeta, Upstream,
};
use cce_reference::{naive, Oracle, OracleDLoss, Precision};

/// The naive oracle as a backend: logits materialized, f64 throughout, exact (never filters,
/// reports zero dropped mass), outputs rounded once to their dtype. Meant for small problems.
#[derive(Clone, Copy, Debug, Default)]
pub struct OracleBackend {
    _private: (),
}

impl OracleBackend {
    /// A new oracle backend (never fails; `Result` for symmetry with device backends).
    pub fn new() -> Result<Self> {
        Ok(Self { _private: () })
    }

    fn validate(inputs: &Inputs<'_, HostTensor>, opts: &Options) -> Result<Problem> {
        let problem = inputs.problem(opts)?;
        if opts.check_finite {
            let named = [
                ("e", Some(inputs.e)),
                ("c", Some(inputs.c)),
                ("bias", inputs.bias),
            ];
            for (what, t) in named {
                let Some(t) = t else { continue };
                // −inf in the bias masks a class.
                let bad = if what == "bias" {
                    first_bad_bias(t.to_f32_vec())
                } else {
                    first_non_finite(t.to_f32_vec())
                };
                if let Some((index, value)) = bad {
                    let row_len = *t.shape().last().unwrap_or(&1);
                    return Err(CceError::NonFinite {
                        what,
                        index,
                        row: index / row_len.max(1),
                        value,
                    });
                }
            }
        }
        Ok(problem)
    }

    fn stats(problem: &Problem, opts: &Options, n_valid: usize, backward: bool) -> CallStats {
        let rule = FilterRule::resolve(opts, problem.dtype);
        CallStats {
            backend: "oracle".into(),
            strategy: Strategy::ChunkedDense {
                chunk_rows: problem.n,
            },
            plan_reason: "oracle: logits materialized in f64".into(),
            n_valid,
            tiles_total: 1,
            tiles_visited: u64::from(backward),
            tiles_skipped: 0,
            entries_kept: if backward {
                (problem.n * problem.v) as u64
            } else {
                0
            },
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: rule.eps,
            max_dropped_mass: rule.max_dropped_mass,
            workspace_bytes: (8 * problem.n * problem.v) as u64,
        }
    }

    fn run(
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        d_loss: &OracleDLoss,
        d_lse: Option<&[f64]>,
    ) -> Result<Oracle> {
        naive(
            inputs.e,
            inputs.c,
            inputs.bias,
            inputs.targets,
            opts,
            d_loss,
            d_lse,
            Precision::F64,
        )
    }

    fn forward_output(opts: &Options, problem: &Problem, o: &Oracle) -> ForwardOutput<HostTensor> {
        let n = problem.n;
        let loss = match opts.reduction {
            Reduction::None => f32_tensor(vec![n], &o.loss),
            _ => HostTensor::scalar_f32(o.loss[0] as f32),
        };
        ForwardOutput {
            loss,
            lse: f32_tensor(vec![n], &o.lse),
            rest_mass: f32_tensor(vec![n], &o.rest_mass),
            entropy: opts
                .side_outputs
                .entropy
                .then(|| f32_tensor(vec![n], &o.entropy)),
            argmax: opts
                .side_outputs
                .argmax
                .then(|| HostTensor::from_i32(o.argmax.clone())),
            stats: Self::stats(problem, opts, o.n_valid, false),
        }
    }

    fn run_backward(
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        problem: &Problem,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<Oracle> {
        let n = problem.n;
        let d_loss = match (&upstream.d_loss, opts.reduction) {
            (DLoss::Scalar(s), Reduction::Mean | Reduction::Sum) => OracleDLoss::Scalar(*s as f64),
            (DLoss::PerRow(t), Reduction::None) => {
                OracleDLoss::PerRow(Self::vector_f32("d_loss", t, n)?)
            }
            (DLoss::Scalar(_), Reduction::None) => {
                return Err(CceError::ShapeMismatch {
                    what: "d_loss",
                    expected: format!("per-row [{n}] for reduction none"),
                    got: "scalar".into(),
                })
            }
            (DLoss::PerRow(t), _) => {
                return Err(CceError::ShapeMismatch {
                    what: "d_loss",
                    expected: "a scalar for reduction mean/sum".into(),
                    got: format!("{:?}", t.shape()),
                })
            }
        };
        let h = upstream
            .d_lse
            .map(|t| Self::vector_f32("d_lse", t, n))
            .transpose()?;
        let as_f32 = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        match &d_loss {
            OracleDLoss::Scalar(s) => check_upstream_finite("d_loss", [*s as f32])?,
            OracleDLoss::PerRow(g) if opts.check_finite => {
                check_upstream_finite("d_loss", as_f32(g))?
            }
            OracleDLoss::PerRow(_) => {}
        }
        if let (Some(h), true) = (&h, opts.check_finite) {
            check_upstream_finite("d_lse", as_f32(h))?;
        }
        Self::run(inputs, opts, &d_loss, h.as_deref())
    }

    fn backward_output(
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        problem: &Problem,
        o: &Oracle,
    ) -> BackwardOutput<HostTensor> {
        let gdt = match opts.grad_dtype {
            GradDType::Input => problem.dtype,
            GradDType::F32 => DType::F32,
        };
        BackwardOutput {
            d_e: opts
                .compute_d_e
                .then(|| rounded(inputs.e.shape().to_vec(), &o.d_e, gdt)),
            d_c: opts
                .compute_d_c
                .then(|| rounded(vec![problem.v, problem.d], &o.d_c, gdt)),
            d_bias: if opts.compute_d_c {
                o.d_bias.as_ref().map(|b| rounded(vec![problem.v], b, gdt))
            } else {
                None
            },
            stats: Self::stats(problem, opts, o.n_valid, true),
        }
    }

    fn vector_f32(what: &'static str, t: &HostTensor, n: usize) -> Result<Vec<f64>> {
        if t.dtype() != DType::F32 {
            return Err(CceError::DTypeMismatch {
                what,
                expected: "f32".into(),
                got: t.dtype(),
            });
        }
        if t.numel() != n {
            return Err(CceError::ShapeMismatch {
                what,
                expected: format!("[{n}]"),
                got: format!("{:?}", t.shape()),
            });
        }
        Ok(t.to_f64_vec())
    }
}

fn f32_tensor(shape: Vec<usize>, v: &[f64]) -> HostTensor {
    let x: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    HostTensor::from_f32(shape, &x, DType::F32).expect("f32 tensor")
}

fn rounded(shape: Vec<usize>, v: &[f64], dtype: DType) -> HostTensor {
    let data = match dtype {
        DType::F16 => cce_core::HostData::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
        DType::BF16 => {
            cce_core::HostData::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect())
        }
        _ => cce_core::HostData::F32(v.iter().map(|&x| x as f32).collect()),
    };
    HostTensor::new(shape, data).expect("gradient tensor")
}

impl Backend for OracleBackend {
    type Buffer = HostTensor;

    fn name(&self) -> &'static str {
        "oracle"
    }

    fn limits(&self) -> DeviceLimits {
        DeviceLimits {
            name: "oracle".into(),
            ..DeviceLimits::cpu()
        }
    }

    fn upload(&self, host: &HostTensor) -> Result<HostTensor> {
        Ok(host.clone())
    }

    fn download(&self, buf: &HostTensor) -> Result<HostTensor> {
        Ok(buf.clone())
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<HostTensor>> {
        let problem = Self::validate(inputs, opts)?;
        let n = problem.n;
        let d_loss = match opts.reduction {
            Reduction::None => OracleDLoss::PerRow(vec![1.0; n]),
            _ => OracleDLoss::Scalar(1.0),
        };
        let o = Self::run(inputs, opts, &d_loss, None)?;
        Ok(Self::forward_output(opts, &problem, &o))
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        saved: Saved<'_, HostTensor>,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<BackwardOutput<HostTensor>> {
        let problem = Self::validate(inputs, opts)?;
        Self::vector_f32("lse", saved.lse, problem.n)?;
        Self::vector_f32("rest_mass", saved.rest_mass, problem.n)?;
        let o = Self::run_backward(inputs, opts, &problem, upstream)?;
        Ok(Self::backward_output(inputs, opts, &problem, &o))
    }

    /// One oracle run for both passes (the oracle computes everything at once).
    fn forward_backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<ForwardBackward<HostTensor>> {
        let problem = Self::validate(inputs, opts)?;
        let o = Self::run_backward(inputs, opts, &problem, upstream)?;
        Ok((
            Self::forward_output(opts, &problem, &o),
            Self::backward_output(inputs, opts, &problem, &o),
        ))
    }
}
