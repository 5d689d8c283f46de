//! The concrete (non-autodiff) forward and backward of the loss on a burn backend's primitives.
//!
//! The path through the host, which every backend can take: a burn primitive is read into a
//! [`TensorData`], wrapped as a [`HostTensor`] (no conversion for f32/f16/bf16), run on one of
//! our engines (the CPU reference; for burn's cubecl backend our WGSL kernels or our CUDA
//! backend, with the `wgpu` or `cuda` feature) and the outputs are written back as burn
//! primitives on the input's device. burn's cubecl backend overrides it with its in-place paths
//! (`crate::cube`) where they apply.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{try_read_sync, Backend, ExecutionError, TensorMetadata};
use burn::tensor::{bf16, f16, DType as BurnDType, TensorData};
use cce_core::{
    Backend as CceBackend, CceError, DLoss, GradDType, HostData, HostTensor, Inputs, Options,
    Reduction, Result, Saved, SideOutputs, TensorMeta, Upstream,
};
use cce_reference::CpuBackend;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};

/// Name used in the errors this crate raises itself.
pub(crate) const NAME: &str = "cce-burn";

static HOST_COPIES: AtomicU64 = AtomicU64::new(0);

/// Tensors this process has moved between a burn device and the host for our engines: each
/// tensor read to the host ([`host_forward`], [`host_backward`]: inputs, saved per-row tensors,
/// the upstream gradient) and each output written back counts one. The NdArray backend,
/// `Cube` tensors on unregistered wgpu devices and `Cube` tensors the in-place paths do not
/// take (burn's `fusion`, mixed dtypes, other integer targets) go this way; on a wgpu device
/// registered with `cube::init_wgpu` / `cube::register_wgpu` and on a CUDA device the count does
/// not move (what our engines read back themselves, the targets and a few status bytes on wgpu,
/// a 256-byte status and a 4-byte upstream scalar on CUDA, is not counted).
pub fn host_copies() -> u64 {
    HOST_COPIES.load(Ordering::Relaxed)
}

/// What the forward returns: the loss and the two per-row tensors the backward reads.
#[derive(Debug, Clone)]
pub struct CceForward<B: Backend> {
    /// Loss: `[1]` for mean/sum, `[N]` for `Reduction::None`; f32.
    pub loss: FloatTensor<B>,
    /// Log-sum-exp per row, `[N]` f32 (nats).
    pub lse: FloatTensor<B>,
    /// `1 − p_y` per row without cancellation, `[N]` f32 (0 at ignored rows).
    pub rest_mass: FloatTensor<B>,
}

/// Gradients of a backward; `None` where not asked for.
#[derive(Debug)]
pub struct CceGrads<B: Backend> {
    /// `∂L/∂e`, `[N, D]`, dtype of `e`.
    pub d_e: Option<FloatTensor<B>>,
    /// `∂L/∂c`, `[V, D]`, dtype of `c`.
    pub d_c: Option<FloatTensor<B>>,
    /// `∂L/∂bias`, `[V]`, dtype of the bias.
    pub d_bias: Option<FloatTensor<B>>,
}

/// The kernels behind [`crate::LinearCrossEntropyBackend`] on a concrete (non-autodiff) burn
/// backend: the forward and the backward of arXiv 2411.09009, returning our typed errors.
///
/// The provided methods run on the CPU reference engine through host copies; a backend
/// overrides them to use a faster engine (burn's cubecl backend uses our WGSL kernels with the
/// `wgpu` feature and our CUDA kernels with the `cuda` feature). Shapes: `e` `[N, D]`, `c` `[V, D]`, `bias` `[V]` (float, one dtype among
/// f32/f16/bf16, or f64 computed in f32), `targets` `[N]` (any integer dtype).
pub trait CceKernels: Backend {
    /// Forward: loss, lse and rest mass. Errors: every input error of
    /// [`cce_core::Backend::forward`] (`ShapeMismatch`, `DTypeMismatch`, `TargetOutOfRange`,
    /// `AllTargetsIgnored`, `NonFinite`, ...), `Backend` when a tensor cannot be read.
    fn cce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        opts: &Options,
    ) -> Result<CceForward<Self>> {
        host_forward::<Self, _>(&CpuBackend::new(), e, c, bias, targets, opts)
    }

    /// Backward from the forward's `lse` and `rest_mass` and the loss's upstream gradient
    /// `d_loss` (`[1]` for mean/sum, `[N]` for none). Errors: those of
    /// [`cce_core::Backend::backward`] (`NonFinite { what: "d_loss", .. }` for a NaN upstream).
    #[allow(clippy::too_many_arguments)]
    fn cce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        saved: CceForward<Self>,
        d_loss: FloatTensor<Self>,
        opts: &Options,
    ) -> Result<CceGrads<Self>> {
        host_backward::<Self, _>(&CpuBackend::new(), e, c, bias, targets, saved, d_loss, opts)
    }
}

/// The options our engines run with: the caller's, without side outputs, with gradients in the
/// input dtype (burn's optimizers expect a gradient of the parameter's dtype).
pub(crate) fn engine_options(opts: &Options) -> Options {
    Options {
        side_outputs: SideOutputs::default(),
        grad_dtype: GradDType::Input,
        ..opts.clone()
    }
}

fn read_error(what: &'static str, err: Option<ExecutionError>) -> CceError {
    match err {
        Some(e) => CceError::backend(NAME, format!("reading {what} from the device: {e:?}")),
        None => CceError::Unsupported {
            backend: NAME,
            what: format!("synchronous readback of {what} on this platform"),
        },
    }
}

fn read<F>(what: &'static str, fut: F) -> Result<TensorData>
where
    F: std::future::Future<Output = std::result::Result<TensorData, ExecutionError>>,
{
    HOST_COPIES.fetch_add(1, Ordering::Relaxed);
    match try_read_sync(fut) {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(read_error(what, Some(e))),
        None => Err(read_error(what, None)),
    }
}

/// A float tensor on the host as one of our dtypes; f64 is narrowed to f32 (returned: the
/// dtype to give the gradient back in).
fn float_to_host(what: &'static str, data: TensorData) -> Result<(HostTensor, BurnDType)> {
    let dtype = data.dtype();
    let shape = data.shape().to_vec();
    let bad = |e: burn::tensor::DataError| CceError::backend(NAME, format!("{what}: {e:?}"));
    // `try_into_vec` takes burn's allocation over when it can (no copy).
    let host = match dtype {
        BurnDType::F32 => HostData::F32(data.try_into_vec::<f32>().map_err(bad)?),
        BurnDType::F16 => HostData::F16(data.try_into_vec::<f16>().map_err(bad)?),
        BurnDType::BF16 => HostData::BF16(data.try_into_vec::<bf16>().map_err(bad)?),
        BurnDType::F64 | BurnDType::Flex32 => {
            HostData::F32(data.try_into_vec_as::<f32>().map_err(bad)?)
        }
        other => {
            return Err(CceError::Unsupported {
                backend: NAME,
                what: format!("{what} of dtype {other:?} (expected f32, f16, bf16 or f64)"),
            })
        }
    };
    Ok((HostTensor::new(shape, host)?, dtype))
}

/// A host tensor as burn data, its allocation taken over (no copy).
fn host_to_data(t: HostTensor) -> TensorData {
    let shape = t.shape().to_vec();
    match t.into_data() {
        HostData::F32(v) => TensorData::new(v, shape),
        HostData::F16(v) => TensorData::new(v, shape),
        HostData::BF16(v) => TensorData::new(v, shape),
        HostData::I32(v) => TensorData::new(v, shape),
        HostData::I64(v) => TensorData::new(v, shape),
    }
}

/// `h` as engine `K`'s buffer: `h` itself when `K`'s buffers are host tensors (the CPU
/// reference: its `upload` would copy), else uploaded into `slot`.
fn engine_buffer<'a, K: CceBackend<Buffer: 'static>>(
    k: &K,
    h: &'a HostTensor,
    slot: &'a mut Option<K::Buffer>,
) -> Result<&'a K::Buffer> {
    if let Some(same) = (h as &dyn Any).downcast_ref::<K::Buffer>() {
        return Ok(same);
    }
    Ok(slot.insert(k.upload(h)?))
}

/// Engine `K`'s buffer on the host: moved when `K`'s buffers are host tensors (the CPU
/// reference: its `download` would copy), else downloaded.
fn host_buffer<K: CceBackend<Buffer: 'static>>(k: &K, b: K::Buffer) -> Result<HostTensor> {
    let mut slot = Some(b);
    if let Some(h) = (&mut slot as &mut dyn Any).downcast_mut::<Option<HostTensor>>() {
        if let Some(h) = h.take() {
            return Ok(h);
        }
    }
    match slot {
        Some(b) => k.download(&b),
        None => unreachable!("the slot is only taken when it holds a host tensor"),
    }
}

fn float_from_host<B: Backend>(
    t: HostTensor,
    dtype: BurnDType,
    device: &burn::backend::tensor::Device<B>,
) -> FloatTensor<B> {
    HOST_COPIES.fetch_add(1, Ordering::Relaxed);
    let mut data = host_to_data(t);
    if dtype != data.dtype() {
        data = data.convert_dtype(dtype);
    }
    B::float_from_data(data, device)
}

fn f32_to_host(what: &'static str, data: TensorData) -> Result<HostTensor> {
    let shape = data.shape().to_vec();
    let v: Vec<f32> = data
        .try_into_vec_as::<f32>()
        .map_err(|e| CceError::backend(NAME, format!("{what}: {e:?}")))?;
    HostTensor::new(shape, HostData::F32(v))
}

fn targets_to_host(data: TensorData) -> Result<HostTensor> {
    let shape = data.shape().to_vec();
    let t = match data.dtype() {
        BurnDType::I32 => HostTensor::from_i32(
            data.try_into_vec_as::<i32>()
                .map_err(|e| CceError::backend(NAME, format!("targets: {e:?}")))?,
        ),
        BurnDType::I64 => HostTensor::from_i64(
            data.try_into_vec_as::<i64>()
                .map_err(|e| CceError::backend(NAME, format!("targets: {e:?}")))?,
        ),
        // Other integer dtypes (u8..u64, i8, i16) are widened to i64 (exact for every class
        // index a vocabulary can hold).
        _ => HostTensor::from_i64(
            data.try_into_vec_as::<i64>()
                .map_err(|e| CceError::backend(NAME, format!("targets: {e:?}")))?,
        ),
    };
    t.reshape(shape)
}

/// The host tensors of one call, and the dtypes to return gradients in.
struct HostInputs {
    e: HostTensor,
    c: HostTensor,
    bias: Option<HostTensor>,
    targets: HostTensor,
    e_dtype: BurnDType,
    c_dtype: BurnDType,
    bias_dtype: Option<BurnDType>,
}

fn inputs_to_host<B: Backend>(
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
) -> Result<HostInputs> {
    let (e, e_dtype) = float_to_host("e", read("e", B::float_into_data(e))?)?;
    let (c, c_dtype) = float_to_host("c", read("c", B::float_into_data(c))?)?;
    let (bias, bias_dtype) = match bias {
        Some(b) => {
            let (b, d) = float_to_host("bias", read("bias", B::float_into_data(b))?)?;
            (Some(b), Some(d))
        }
        None => (None, None),
    };
    let targets = targets_to_host(read("targets", B::int_into_data(targets))?)?;
    Ok(HostInputs {
        e,
        c,
        bias,
        targets,
        e_dtype,
        c_dtype,
        bias_dtype,
    })
}

/// The forward on engine `k` through host copies. Loss `[1]` for mean/sum (burn's scalar
/// shape), `[N]` for none.
pub fn host_forward<B: Backend, K: CceBackend<Buffer: 'static>>(
    k: &K,
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
    opts: &Options,
) -> Result<CceForward<B>> {
    let device = e.device();
    let opts = engine_options(opts);
    let h = inputs_to_host::<B>(e, c, bias, targets)?;
    let mut slots: [Option<K::Buffer>; 4] = Default::default();
    let [s_e, s_c, s_t, s_b] = &mut slots;
    let inputs = Inputs {
        e: engine_buffer(k, &h.e, s_e)?,
        c: engine_buffer(k, &h.c, s_c)?,
        bias: h
            .bias
            .as_ref()
            .map(|b| engine_buffer(k, b, s_b))
            .transpose()?,
        targets: engine_buffer(k, &h.targets, s_t)?,
    };
    let fwd = k.forward(&inputs, &opts)?;
    let mut loss = host_buffer(k, fwd.loss)?;
    if loss.shape().is_empty() {
        loss = loss.reshape(vec![1])?;
    }
    let lse = host_buffer(k, fwd.lse)?;
    let rest_mass = host_buffer(k, fwd.rest_mass)?;
    Ok(CceForward {
        loss: float_from_host::<B>(loss, BurnDType::F32, &device),
        lse: float_from_host::<B>(lse, BurnDType::F32, &device),
        rest_mass: float_from_host::<B>(rest_mass, BurnDType::F32, &device),
    })
}

/// The backward on engine `k` through host copies (see [`CceKernels::cce_backward`]).
#[allow(clippy::too_many_arguments)]
pub fn host_backward<B: Backend, K: CceBackend<Buffer: 'static>>(
    k: &K,
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
    saved: CceForward<B>,
    d_loss: FloatTensor<B>,
    opts: &Options,
) -> Result<CceGrads<B>> {
    let device = e.device();
    let opts = engine_options(opts);
    let h = inputs_to_host::<B>(e, c, bias, targets)?;
    let lse = f32_to_host("lse", read("lse", B::float_into_data(saved.lse))?)?;
    let rest = f32_to_host(
        "rest_mass",
        read("rest_mass", B::float_into_data(saved.rest_mass))?,
    )?;
    let d_loss = f32_to_host("d_loss", read("d_loss", B::float_into_data(d_loss))?)?;
    let mut slots: [Option<K::Buffer>; 7] = Default::default();
    let [s_e, s_c, s_t, s_b, s_lse, s_rest, s_d] = &mut slots;
    let inputs = Inputs {
        e: engine_buffer(k, &h.e, s_e)?,
        c: engine_buffer(k, &h.c, s_c)?,
        bias: h
            .bias
            .as_ref()
            .map(|b| engine_buffer(k, b, s_b))
            .transpose()?,
        targets: engine_buffer(k, &h.targets, s_t)?,
    };
    let (lse_b, rest_b) = (
        engine_buffer(k, &lse, s_lse)?,
        engine_buffer(k, &rest, s_rest)?,
    );
    let d_loss = match opts.reduction {
        Reduction::None => DLoss::PerRow(engine_buffer(k, &d_loss, s_d)?),
        Reduction::Mean | Reduction::Sum => {
            let v = d_loss.to_f32_vec();
            if v.len() != 1 {
                return Err(CceError::ShapeMismatch {
                    what: "d_loss",
                    expected: "[1]".into(),
                    got: format!("{:?}", d_loss.shape()),
                });
            }
            DLoss::Scalar(v[0])
        }
    };
    let bwd = k.backward(
        &inputs,
        &opts,
        Saved {
            lse: lse_b,
            rest_mass: rest_b,
        },
        &Upstream {
            d_loss,
            d_lse: None,
        },
    )?;
    let back = |t: Option<K::Buffer>, dtype: BurnDType| -> Result<Option<FloatTensor<B>>> {
        t.map(|t| Ok(float_from_host::<B>(host_buffer(k, t)?, dtype, &device)))
            .transpose()
    };
    Ok(CceGrads {
        d_e: back(bwd.d_e, h.e_dtype)?,
        d_c: back(bwd.d_c, h.c_dtype)?,
        d_bias: match h.bias_dtype {
            Some(d) => back(bwd.d_bias, d)?,
            None => None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU reference's buffers are host tensors: no upload or download copy.
    #[test]
    fn the_cpu_engine_takes_host_tensors_in_place() {
        let k = CpuBackend::new();
        let h = HostTensor::new(vec![2, 2], HostData::F32(vec![1.0, 2.0, 3.0, 4.0])).unwrap();
        let mut slot = None;
        let b = engine_buffer(&k, &h, &mut slot).unwrap();
        assert!(std::ptr::eq(b, &h));
        assert!(slot.is_none());
        let ptr = h.as_bytes().as_ptr();
        let back = host_buffer(&k, h).unwrap();
        assert_eq!(back.as_bytes().as_ptr(), ptr);
    }

    /// burn's data to a host tensor and back keeps the allocation (f32, f16, bf16).
    #[test]
    fn host_conversions_keep_the_allocation() {
        for data in [
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]),
            TensorData::new(vec![f16::ONE; 6], [2, 3]),
            TensorData::new(vec![bf16::ONE; 6], [2, 3]),
        ] {
            let dtype = data.dtype();
            let ptr = data.as_bytes().as_ptr();
            let (h, d) = float_to_host("x", data).unwrap();
            assert_eq!(d, dtype);
            assert_eq!(h.shape(), &[2, 3]);
            assert_eq!(h.as_bytes().as_ptr(), ptr, "{dtype:?} in");
            let back = host_to_data(h);
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.as_bytes().as_ptr(), ptr, "{dtype:?} out");
        }
    }
}
