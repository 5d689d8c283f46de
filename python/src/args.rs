//! The torch tensors of a call, each read once by [`raw`] into a [`RawTensor`], in the groups
//! every native function shares: the inputs, the forward's outputs, the backward's saved state
//! and upstream gradients, the gradient outputs; and, for CPU tensors, their host views and
//! the writing of the results.

use super::{d_loss_of, raw, raw_opt, RawTensor};
use cce_core::{ForwardOutput, HostTensor, Inputs, Options, Saved, SideOutputs, Upstream};
use cce_reference::HostView;
use pyo3::prelude::*;

type Arg<'a, 'py> = &'a Bound<'py, PyAny>;
type OptArg<'a, 'py> = Option<&'a Bound<'py, PyAny>>;

/// `e`, `c`, `bias`, `targets`.
pub(crate) struct InputArgs {
    pub e: RawTensor,
    pub c: RawTensor,
    pub bias: Option<RawTensor>,
    pub targets: RawTensor,
}

/// Host views of [`InputArgs`].
pub(crate) struct InputViews<'a> {
    e: HostView<'a>,
    c: HostView<'a>,
    bias: Option<HostView<'a>>,
    targets: HostView<'a>,
}

impl InputArgs {
    pub fn read(py: Python<'_>, e: Arg, c: Arg, bias: OptArg, targets: Arg) -> PyResult<Self> {
        Ok(Self {
            e: raw(py, "e", e)?,
            c: raw(py, "c", c)?,
            bias: raw_opt(py, "bias", bias)?,
            targets: raw(py, "targets", targets)?,
        })
    }

    pub fn tensors(&self) -> Vec<&RawTensor> {
        let mut all = vec![&self.e, &self.c, &self.targets];
        all.extend(&self.bias);
        all
    }

    /// The tensors' metadata as the library's inputs (no data is read: for a rank that failed
    /// before its shard ran, whose driver only checks shapes).
    pub fn metas(&self) -> Inputs<'_, RawTensor> {
        Inputs {
            e: &self.e,
            c: &self.c,
            bias: self.bias.as_ref(),
            targets: &self.targets,
        }
    }

    /// # Safety
    /// Every tensor satisfies [`RawTensor::view`]'s contract.
    pub unsafe fn views(&self) -> cce_core::Result<InputViews<'_>> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Ok(InputViews {
                e: self.e.view()?,
                c: self.c.view()?,
                bias: match &self.bias {
                    Some(b) => Some(b.view()?),
                    None => None,
                },
                targets: self.targets.view()?,
            })
        }
    }
}

impl<'a> InputViews<'a> {
    pub fn inputs(&self) -> Inputs<'_, HostView<'a>> {
        Inputs {
            e: &self.e,
            c: &self.c,
            bias: self.bias.as_ref(),
            targets: &self.targets,
        }
    }
}

/// The forward's outputs: loss, lse, `rest_mass`, and the side outputs when given.
pub(crate) struct ForwardArgs {
    pub loss: RawTensor,
    pub lse: RawTensor,
    pub rest_mass: RawTensor,
    pub entropy: Option<RawTensor>,
    pub argmax: Option<RawTensor>,
}

impl ForwardArgs {
    pub fn read(
        py: Python<'_>,
        [loss, lse, rest_mass]: [Arg; 3],
        [entropy, argmax]: [OptArg; 2],
    ) -> PyResult<Self> {
        Ok(Self {
            loss: raw(py, "loss (output)", loss)?,
            lse: raw(py, "lse (output)", lse)?,
            rest_mass: raw(py, "rest_mass (output)", rest_mass)?,
            entropy: raw_opt(py, "entropy (output)", entropy)?,
            argmax: raw_opt(py, "argmax (output)", argmax)?,
        })
    }

    /// Ask for the side outputs given.
    pub fn ask(&self, o: &mut Options) {
        o.side_outputs = SideOutputs {
            entropy: self.entropy.is_some(),
            argmax: self.argmax.is_some(),
        };
    }

    pub fn tensors(&self) -> Vec<&RawTensor> {
        let mut all = vec![&self.loss, &self.lse, &self.rest_mass];
        all.extend(self.entropy.iter().chain(&self.argmax));
        all
    }

    pub fn refs(&self) -> [Option<&RawTensor>; 5] {
        [
            Some(&self.loss),
            Some(&self.lse),
            Some(&self.rest_mass),
            self.entropy.as_ref(),
            self.argmax.as_ref(),
        ]
    }

    /// # Safety
    /// Every tensor satisfies [`RawTensor::write`]'s contract.
    pub unsafe fn write(&self, out: &ForwardOutput<HostTensor>) -> cce_core::Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            self.loss.write(&out.loss)?;
            self.lse.write(&out.lse)?;
            self.rest_mass.write(&out.rest_mass)?;
            if let (Some(dst), Some(src)) = (&self.entropy, &out.entropy) {
                dst.write(src)?;
            }
            if let (Some(dst), Some(src)) = (&self.argmax, &out.argmax) {
                dst.write(src)?;
            }
        }
        Ok(())
    }
}

/// What a backward reads besides the inputs: the saved lse and `rest_mass`, `d_loss`, `d_lse`.
pub(crate) struct SavedArgs {
    pub lse: RawTensor,
    pub rest_mass: RawTensor,
    pub d_loss: RawTensor,
    pub d_lse: Option<RawTensor>,
}

/// Host views of [`SavedArgs`].
pub(crate) struct SavedViews<'a> {
    lse: HostView<'a>,
    rest_mass: HostView<'a>,
    d_loss: HostView<'a>,
    d_lse: Option<HostView<'a>>,
}

impl SavedArgs {
    pub fn read(
        py: Python<'_>,
        [lse, rest_mass, d_loss]: [Arg; 3],
        d_lse: OptArg,
    ) -> PyResult<Self> {
        Ok(Self {
            lse: raw(py, "lse", lse)?,
            rest_mass: raw(py, "rest_mass", rest_mass)?,
            d_loss: raw(py, "d_loss", d_loss)?,
            d_lse: raw_opt(py, "d_lse", d_lse)?,
        })
    }

    pub fn tensors(&self) -> Vec<&RawTensor> {
        let mut all = vec![&self.lse, &self.rest_mass, &self.d_loss];
        all.extend(&self.d_lse);
        all
    }

    /// # Safety
    /// Every tensor satisfies [`RawTensor::view`]'s contract.
    pub unsafe fn views(&self) -> cce_core::Result<SavedViews<'_>> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Ok(SavedViews {
                lse: self.lse.view()?,
                rest_mass: self.rest_mass.view()?,
                d_loss: self.d_loss.view()?,
                d_lse: match &self.d_lse {
                    Some(t) => Some(t.view()?),
                    None => None,
                },
            })
        }
    }
}

impl<'a> SavedViews<'a> {
    pub fn saved(&self) -> Saved<'_, HostView<'a>> {
        Saved {
            lse: &self.lse,
            rest_mass: &self.rest_mass,
        }
    }

    /// The upstream gradients (`unit_d_loss`: a mean's or sum's as 1; [`d_loss_of`]).
    pub fn upstream(
        &self,
        opts: &Options,
        unit_d_loss: bool,
    ) -> cce_core::Result<Upstream<'_, HostView<'a>>> {
        Ok(Upstream {
            d_loss: d_loss_of(opts, &self.d_loss, unit_d_loss)?,
            d_lse: self.d_lse.as_ref(),
        })
    }
}

/// The gradient outputs given: `d_e`, `d_c`, `d_bias` (None: not computed).
pub(crate) struct GradArgs {
    pub d_e: Option<RawTensor>,
    pub d_c: Option<RawTensor>,
    pub d_bias: Option<RawTensor>,
}

impl GradArgs {
    pub fn read(py: Python<'_>, [d_e, d_c, d_bias]: [OptArg; 3]) -> PyResult<Self> {
        Ok(Self {
            d_e: raw_opt(py, "d_e (output)", d_e)?,
            d_c: raw_opt(py, "d_c (output)", d_c)?,
            d_bias: raw_opt(py, "d_bias (output)", d_bias)?,
        })
    }

    /// Ask for the gradients given: `d_bias` needs the `d_c` pass; f32 outputs ask for f32
    /// gradients, else the input dtype.
    pub fn ask(&self, o: &mut Options) {
        o.compute_d_e = self.d_e.is_some();
        o.compute_d_c = self.d_c.is_some() || self.d_bias.is_some();
        let f32_out = self
            .d_e
            .iter()
            .chain(&self.d_c)
            .any(|t| t.dtype == cce_core::DType::F32);
        o.grad_dtype = if f32_out {
            cce_core::GradDType::F32
        } else {
            cce_core::GradDType::Input
        };
    }

    pub fn tensors(&self) -> Vec<&RawTensor> {
        self.d_e
            .iter()
            .chain(&self.d_c)
            .chain(&self.d_bias)
            .collect()
    }

    pub fn refs(&self) -> [Option<&RawTensor>; 3] {
        [self.d_e.as_ref(), self.d_c.as_ref(), self.d_bias.as_ref()]
    }

    /// Write each gradient computed into its output.
    ///
    /// # Safety
    /// Every tensor satisfies [`RawTensor::write`]'s contract.
    pub unsafe fn write(&self, grads: [&Option<HostTensor>; 3]) -> cce_core::Result<()> {
        for (dst, src) in self.refs().into_iter().zip(grads) {
            if let (Some(dst), Some(src)) = (dst, src) {
                // SAFETY: forwarded from this function's contract.
                unsafe { dst.write(src)? };
            }
        }
        Ok(())
    }
}
