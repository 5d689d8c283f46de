//! # cce-python: the native extension of the `cut_cross_entropy_rs` Python package
//!
//! Two functions, `forward` and `backward`, called by the package's `torch.library` custom ops
//! (`cut_cross_entropy_rs/_ops.py`); not a public API. They take `torch.Tensor` objects, check
//! device, dtype, shape and contiguity, and read and write the tensors' memory in place:
//!
//! - inputs (`e`, `c`, `bias`, `targets`, the saved `lse`, the upstream gradients) are borrowed
//!   as [`HostView`]s, so f32 tensors reach the CPU backend without a copy (f16/bf16 are widened
//!   to f32 once per call, as the backend does for its own tensors);
//! - outputs are allocated by PyTorch (so its allocator accounts for them) and passed in empty;
//!   the backend's results are written into them.
//!
//! Every [`LibError`] (`cce_core::CceError`) becomes a `cut_cross_entropy_rs.CceError` exception carrying the library's
//! message and the variant's name (`kind`); a panic, which would be a bug, is caught and raised
//! as `CceError` of kind `Internal` rather than crossing into Python.
//!
//! Devices: CPU tensors run on [`CpuBackend`]; CUDA tensors (built with the default `cuda`
//! feature) on `cce_cuda::CudaBackend` on torch's current stream (the package passes
//! `torch.cuda.current_stream(device).cuda_stream`), each tensor's `data_ptr()` borrowed in
//! place (the layout checks of `raw` hold for device memory too), outputs allocated by torch
//! (its caching allocator): see the `cuda` module for what still synchronizes.

use cce_core::CceError as LibError;
use cce_core::{CallStats, DLoss, DType, FilterEps, HostData, HostTensor, Options, Reduction};
use cce_reference::{CpuBackend, HostSlice, HostView};
use half::{bf16, f16};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::panic::{catch_unwind, AssertUnwindSafe};

mod args;
#[cfg(feature = "cuda")]
mod cuda;
mod vocab_parallel;

use args::{ForwardArgs, GradArgs, InputArgs, SavedArgs};

pyo3::create_exception!(
    cut_cross_entropy_rs,
    CceError,
    PyException,
    "An error of the cut-cross-entropy library: the library's message, and `kind`, the name of \
     the error variant (ShapeMismatch, DTypeMismatch, TargetOutOfRange, AllTargetsIgnored, \
     NonFinite, EmptyInput, InvalidOption, ResourceLimit, OutOfMemory, Unsupported, NoDevice, \
     ForeignBuffer, Backend, Internal)."
);

/// The name of a [`LibError`] variant (the exception's `kind`).
fn kind(err: &LibError) -> &'static str {
    match err {
        LibError::ShapeMismatch { .. } => "ShapeMismatch",
        LibError::DTypeMismatch { .. } => "DTypeMismatch",
        LibError::TargetOutOfRange { .. } => "TargetOutOfRange",
        LibError::TargetMasked { .. } => "TargetMasked",
        LibError::AllTargetsIgnored { .. } => "AllTargetsIgnored",
        LibError::NonFinite { .. } => "NonFinite",
        LibError::EmptyInput { .. } => "EmptyInput",
        LibError::InvalidOption { .. } => "InvalidOption",
        LibError::ResourceLimit { .. } => "ResourceLimit",
        LibError::OutOfMemory { .. } => "OutOfMemory",
        LibError::Unsupported { .. } => "Unsupported",
        LibError::NoDevice { .. } => "NoDevice",
        LibError::ForeignBuffer { .. } => "ForeignBuffer",
        LibError::Backend { .. } => "Backend",
        LibError::VocabParallel(_) => "VocabParallel",
        _ => "Other",
    }
}

/// A `CceError` exception with `message` and attribute `kind`.
fn exception(py: Python<'_>, kind: &str, message: String) -> PyErr {
    let err = CceError::new_err(message);
    // Setting an attribute on a fresh exception instance cannot fail short of memory
    // exhaustion; the message stands even then.
    let _ = err.value(py).setattr("kind", kind);
    err
}

/// A [`LibError`] as a Python exception.
fn to_py(py: Python<'_>, err: LibError) -> PyErr {
    exception(py, kind(&err), err.to_string())
}

/// `f()` with a panic turned into `CceError` of kind `Internal` (a bug in the library).
fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> cce_core::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(exception(
                py,
                "Internal",
                format!("internal error (a bug in cut-cross-entropy, please report it): {what}"),
            ))
        }
    }
}

/// Device of a tensor argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda,
}

/// What the extension knows of a `torch.Tensor`: where its elements are and how they lie.
struct RawTensor {
    /// Argument name, for error messages.
    what: &'static str,
    device: Device,
    /// Device index (`tensor.device.index`; 0 for the CPU).
    ordinal: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Address of the first element (`data_ptr()`).
    ptr: usize,
}

/// A `torch.dtype` as a [`DType`], or `Unsupported` naming the argument.
fn dtype_of(what: &'static str, name: &str) -> cce_core::Result<DType> {
    match name {
        "torch.float32" => Ok(DType::F32),
        "torch.float16" => Ok(DType::F16),
        "torch.bfloat16" => Ok(DType::BF16),
        "torch.int32" => Ok(DType::I32),
        "torch.int64" => Ok(DType::I64),
        other => Err(LibError::Unsupported {
            backend: "cut_cross_entropy_rs",
            what: format!(
                "{what} of dtype {other} (float32, float16 and bfloat16 for e, c and bias; int32 \
                 and int64 for targets)"
            ),
        }),
    }
}

/// Read a `torch.Tensor`'s layout. Errors (as exceptions): a non-tensor, a non-contiguous
/// tensor, a device other than CPU or CUDA, an unsupported dtype, a misaligned address.
fn raw(py: Python<'_>, what: &'static str, t: &Bound<'_, PyAny>) -> PyResult<RawTensor> {
    let err = |reason: String| to_py(py, LibError::InvalidOption { name: what, reason });
    let is_contiguous: bool = t
        .call_method0("is_contiguous")
        .and_then(|r| r.extract())
        .map_err(|_| err(format!("expected a torch.Tensor, got {}", type_name(t))))?;
    if !is_contiguous {
        return Err(err("must be contiguous (call .contiguous())".into()));
    }
    let device: String = t.getattr("device")?.getattr("type")?.extract()?;
    let device = match device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda,
        other => {
            return Err(to_py(
                py,
                LibError::Unsupported {
                    backend: "cut_cross_entropy_rs",
                    what: format!("{what} on device '{other}' (cpu and cuda are supported)"),
                },
            ))
        }
    };
    let ordinal: Option<usize> = t.getattr("device")?.getattr("index")?.extract()?;
    let dtype_name: String = t.getattr("dtype")?.str()?.extract()?;
    let dtype = dtype_of(what, &dtype_name).map_err(|e| to_py(py, e))?;
    let shape: Vec<usize> = t.getattr("shape")?.extract()?;
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let numel: usize = shape.iter().product();
    if numel > 0 && (ptr == 0 || !ptr.is_multiple_of(dtype.size_bytes())) {
        return Err(err(format!(
            "data_ptr {ptr:#x} is not aligned to its {}-byte elements",
            dtype.size_bytes()
        )));
    }
    Ok(RawTensor {
        what,
        device,
        ordinal: ordinal.unwrap_or(0),
        dtype,
        shape,
        ptr,
    })
}

fn type_name(t: &Bound<'_, PyAny>) -> String {
    t.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Shape and dtype, as the library's checks read them (a rank that failed before its shard ran
/// still takes part in the call's collectives with its tensors' shapes: `vocab_parallel`).
impl cce_core::TensorMeta for RawTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl RawTensor {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's elements as a borrowed host view.
    ///
    /// # Safety
    /// `self` was read by [`raw`] from a live, contiguous CPU tensor that stays alive and is
    /// not written (for inputs) or read (for outputs) by anyone else while the view is used.
    unsafe fn view(&self) -> cce_core::Result<HostView<'_>> {
        let n = self.numel();
        macro_rules! slice {
            ($t:ty) => {
                if n == 0 {
                    &[]
                } else {
                    // SAFETY: by this function's contract the tensor is a live, contiguous CPU
                    // tensor of `n` elements of this dtype starting at `ptr`, which `raw`
                    // checked to be non-null and aligned; it outlives the returned view.
                    unsafe { std::slice::from_raw_parts(self.ptr as *const $t, n) }
                }
            };
        }
        let data = match self.dtype {
            DType::F32 => HostSlice::F32(slice!(f32)),
            DType::F16 => HostSlice::F16(slice!(f16)),
            DType::BF16 => HostSlice::BF16(slice!(bf16)),
            DType::I32 => HostSlice::I32(slice!(i32)),
            DType::I64 => HostSlice::I64(slice!(i64)),
        };
        HostView::new(self.shape.clone(), data)
    }

    /// Copy `src` into this (output) tensor; dtype and shape must match.
    ///
    /// # Safety
    /// As [`RawTensor::view`], and nothing else reads or writes the tensor during the call.
    unsafe fn write(&self, src: &HostTensor) -> cce_core::Result<()> {
        use cce_core::TensorMeta;
        if src.dtype() != self.dtype || src.numel() != self.numel() {
            return Err(LibError::ShapeMismatch {
                what: self.what,
                expected: format!("{:?} {}", src.shape(), src.dtype()),
                got: format!("{:?} {}", self.shape, self.dtype),
            });
        }
        let n = self.numel();
        if n == 0 {
            return Ok(());
        }
        macro_rules! copy {
            ($t:ty, $v:expr) => {{
                // SAFETY: by this function's contract the tensor is a live, contiguous CPU
                // tensor of `n` elements of this dtype at `ptr` (non-null, aligned: `raw`),
                // written by no one else during the call; `$v` has `n` elements (checked above).
                let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut $t, n) };
                dst.copy_from_slice($v);
            }};
        }
        match src.data() {
            HostData::F32(v) => copy!(f32, v),
            HostData::F16(v) => copy!(f16, v),
            HostData::BF16(v) => copy!(bf16, v),
            HostData::I32(v) => copy!(i32, v),
            HostData::I64(v) => copy!(i64, v),
        }
        Ok(())
    }
}

/// The `Options` named by the keys of `opts` (the rest stay at their defaults). Unknown keys
/// and bad values are `InvalidOption`.
fn options(opts: &Bound<'_, PyDict>) -> PyResult<Options> {
    let py = opts.py();
    let bad =
        |name: &'static str, reason: String| to_py(py, LibError::InvalidOption { name, reason });
    let mut o = Options::default();
    for (k, v) in opts.iter() {
        let key: String = k.extract()?;
        let want = |name: &'static str, ty: &str| bad(name, format!("expected {ty}, got {v}"));
        match key.as_str() {
            "ignore_index" => {
                o.ignore_index = v.extract().map_err(|_| want("ignore_index", "an int"))?
            }
            "softcap" => {
                o.softcap = v
                    .extract()
                    .map_err(|_| want("softcap", "a float or None"))?
            }
            "reduction" => {
                let s: String = v.extract().map_err(|_| want("reduction", "a str"))?;
                o.reduction = s.parse::<Reduction>().map_err(|r| bad("reduction", r))?;
            }
            "shift" => {
                let s: i64 = v.extract().map_err(|_| want("shift", "an int or a bool"))?;
                o.shift = usize::try_from(s)
                    .map_err(|_| bad("shift", format!("must be >= 0, got {s}")))?;
            }
            "seq_len" => {
                o.seq_len = v
                    .extract()
                    .map_err(|_| want("seq_len", "an int >= 1 or None"))?
            }
            "label_smoothing" => {
                o.label_smoothing = v
                    .extract()
                    .map_err(|_| want("label_smoothing", "a float"))?
            }
            "z_loss" => o.z_loss = v.extract().map_err(|_| want("z_loss", "a float"))?,
            "filter_eps" => {
                o.filter_eps = if v.is_none() {
                    FilterEps::Off
                } else if let Ok(s) = v.extract::<String>() {
                    s.parse::<FilterEps>().map_err(|r| bad("filter_eps", r))?
                } else {
                    FilterEps::Value(
                        v.extract()
                            .map_err(|_| want("filter_eps", "'auto', None or a float"))?,
                    )
                }
            }
            "max_dropped_mass" => {
                o.max_dropped_mass = v
                    .extract()
                    .map_err(|_| want("max_dropped_mass", "a float"))?
            }
            "filter_e_grad" => {
                o.filter_e_grad = v.extract().map_err(|_| want("filter_e_grad", "a bool"))?
            }
            "filter_c_grad" => {
                o.filter_c_grad = v.extract().map_err(|_| want("filter_c_grad", "a bool"))?
            }
            "deterministic" => {
                o.deterministic = v.extract().map_err(|_| want("deterministic", "a bool"))?
            }
            "check_finite" => {
                o.check_finite = v.extract().map_err(|_| want("check_finite", "a bool"))?
            }
            // Not a library option: a switch of the CUDA backend, read by `dc_in_grad_dtype`.
            "dc_in_grad_dtype" => {
                let _: bool = v
                    .extract()
                    .map_err(|_| want("dc_in_grad_dtype", "a bool"))?;
            }
            "workspace_budget_bytes" => {
                o.workspace_budget_bytes = v
                    .extract()
                    .map_err(|_| want("workspace_budget_bytes", "an int >= 0"))?
            }
            _ => {
                return Err(to_py(
                    py,
                    LibError::InvalidOption {
                        name: "options",
                        reason: format!("unknown option '{key}'"),
                    },
                ))
            }
        }
    }
    Ok(o)
}

/// The `dc_in_grad_dtype` key of `opts` (false when absent): exact CUDA calls of bf16 inputs
/// with bf16 gradients accumulate `d_c` in the output dtype where the budget holds no f32
/// accumulator (`cce_cuda::CudaSwitches::dc_in_grad_dtype`). The CPU backend accumulates in f32
/// whatever it says. Errors: `InvalidOption` for a value that is not a bool.
fn dc_in_grad_dtype(opts: &Bound<'_, PyDict>) -> PyResult<bool> {
    let py = opts.py();
    match opts.get_item("dc_in_grad_dtype")? {
        None => Ok(false),
        Some(v) => v.extract().map_err(|_| {
            to_py(
                py,
                LibError::InvalidOption {
                    name: "dc_in_grad_dtype",
                    reason: format!("expected a bool, got {v}"),
                },
            )
        }),
    }
}

/// A [`CallStats`] as a dict.
fn stats_dict<'py>(py: Python<'py>, s: &CallStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("backend", &s.backend)?;
    d.set_item("strategy", s.strategy.to_string())?;
    d.set_item("plan_reason", &s.plan_reason)?;
    d.set_item("n_valid", s.n_valid)?;
    d.set_item("tiles_total", s.tiles_total)?;
    d.set_item("tiles_visited", s.tiles_visited)?;
    d.set_item("tiles_skipped", s.tiles_skipped)?;
    d.set_item("entries_kept", s.entries_kept)?;
    d.set_item("entries_skipped", s.entries_skipped)?;
    d.set_item("dropped_mass_max", s.dropped_mass_max)?;
    d.set_item("dropped_mass_mean", s.dropped_mass_mean)?;
    d.set_item("filter_eps", s.filter_eps)?;
    d.set_item("max_dropped_mass", s.max_dropped_mass)?;
    d.set_item("workspace_bytes", s.workspace_bytes)?;
    d.set_item("summary", s.to_string())?;
    Ok(d)
}

/// Read an optional tensor argument.
fn raw_opt(
    py: Python<'_>,
    what: &'static str,
    t: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<RawTensor>> {
    match t {
        Some(t) if !t.is_none() => raw(py, what, t).map(Some),
        _ => Ok(None),
    }
}

/// The one device of a call's tensors, or `Unsupported` when they are spread over several.
fn device_of(all: &[&RawTensor]) -> cce_core::Result<Device> {
    let first = all[0].device;
    let ordinal = all[0].ordinal;
    match all
        .iter()
        .find(|t| t.device != first || t.ordinal != ordinal)
    {
        Some(t) => Err(LibError::Unsupported {
            backend: "cut_cross_entropy_rs",
            what: format!(
                "tensors on different devices ({} on {:?}:{}, {} on {:?}:{})",
                all[0].what, first, ordinal, t.what, t.device, t.ordinal
            ),
        }),
        None => Ok(first),
    }
}

/// What a build without the `cuda` feature answers for CUDA tensors.
#[cfg(not(feature = "cuda"))]
fn cuda_missing() -> LibError {
    LibError::Unsupported {
        backend: "cut_cross_entropy_rs",
        what: "CUDA tensors in this build (built without the `cuda` feature)".into(),
    }
}

/// torch's current stream for a call on `device` (ordinal from the tensors).
#[cfg(feature = "cuda")]
fn torch_stream(
    ordinal: usize,
    stream: usize,
    eager: bool,
    dc_in_grad_dtype: bool,
) -> cuda::TorchStream {
    cuda::TorchStream {
        ordinal,
        handle: stream,
        eager,
        dc_in_grad_dtype,
    }
}

/// Forward: writes the loss (`[]` or `[N]` f32), the lse and the rest mass `1 − p_y` (`[N]`
/// f32 each, what the backward reads) and, when given, the entropy (`[N]` f32) and argmax
/// (`[N]` i32) into the output tensors; returns the call's statistics as a dict. `opts`: the
/// options by name (see the package's `_ops.py`).
#[pyfunction]
#[pyo3(signature = (e, c, bias, targets, opts, loss_out, lse_out, rest_mass_out, entropy_out=None, argmax_out=None, stream=0, eager=false))]
#[allow(clippy::too_many_arguments)]
fn forward<'py>(
    py: Python<'py>,
    e: &Bound<'py, PyAny>,
    c: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    opts: &Bound<'py, PyDict>,
    loss_out: &Bound<'py, PyAny>,
    lse_out: &Bound<'py, PyAny>,
    rest_mass_out: &Bound<'py, PyAny>,
    entropy_out: Option<&Bound<'py, PyAny>>,
    argmax_out: Option<&Bound<'py, PyAny>>,
    stream: usize,
    eager: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let mut o = options(opts)?;
    let dc_knob = dc_in_grad_dtype(opts)?;
    let inp = InputArgs::read(py, e, c, bias, targets)?;
    let outs = ForwardArgs::read(
        py,
        [loss_out, lse_out, rest_mass_out],
        [entropy_out, argmax_out],
    )?;
    outs.ask(&mut o);
    let all = [inp.tensors(), outs.tensors()].concat();
    let stats = guarded(py, || match device_of(&all)? {
        #[cfg(feature = "cuda")]
        Device::Cuda => py.detach(|| {
            // SAFETY: every RawTensor was read by `raw` from a CUDA tensor of one device that
            // the caller holds for the whole call, and `stream` is torch's current stream of
            // that device (the package passes it); inputs are only read and the outputs, fresh
            // tensors of this call, only written, all on that stream.
            unsafe {
                cuda::forward(
                    torch_stream(inp.e.ordinal, stream, eager, dc_knob),
                    &inp.e,
                    &inp.c,
                    inp.bias.as_ref(),
                    &inp.targets,
                    &o,
                    outs.refs(),
                )
            }
        }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => {
            let _ = (stream, eager, dc_knob);
            Err(cuda_missing())
        }
        Device::Cpu => py.detach(|| {
            // SAFETY: every RawTensor was read by `raw` from a CPU tensor the caller holds for
            // the whole call; inputs are only read and the outputs, fresh tensors the package
            // allocated for this call, are only written here.
            unsafe { run_forward(&inp, &outs, &o) }
        }),
    })?;
    stats_dict(py, &stats)
}

/// The CPU forward on borrowed tensors.
///
/// # Safety
/// Every tensor satisfies [`RawTensor::view`]'s and [`RawTensor::write`]'s contracts.
unsafe fn run_forward(
    inp: &InputArgs,
    outs: &ForwardArgs,
    opts: &Options,
) -> cce_core::Result<CallStats> {
    // SAFETY: forwarded from this function's contract (so is the write below).
    let views = unsafe { inp.views()? };
    let out = CpuBackend::new().forward_host(&views.inputs(), opts)?;
    // SAFETY: as above.
    unsafe { outs.write(&out)? };
    Ok(out.stats)
}

/// Backward from the saved lse and rest mass of the forward: writes `d_e`, `d_c`, `d_bias` into the output tensors given
/// (`None`: that gradient is not computed); returns the call's statistics as a dict.
/// `d_loss`: a scalar f32 tensor (mean, sum) or `[N]` f32 (reduction none); `d_lse`: `[N]` f32
/// or None. Gradients are f32 when their output tensor is f32, else the input dtype.
#[pyfunction]
#[pyo3(signature = (e, c, bias, targets, opts, lse, rest_mass, d_loss, d_lse=None, d_e_out=None, d_c_out=None, d_bias_out=None, stream=0, unit_d_loss=false, eager=false))]
#[allow(clippy::too_many_arguments)]
fn backward<'py>(
    py: Python<'py>,
    e: &Bound<'py, PyAny>,
    c: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    opts: &Bound<'py, PyDict>,
    lse: &Bound<'py, PyAny>,
    rest_mass: &Bound<'py, PyAny>,
    d_loss: &Bound<'py, PyAny>,
    d_lse: Option<&Bound<'py, PyAny>>,
    d_e_out: Option<&Bound<'py, PyAny>>,
    d_c_out: Option<&Bound<'py, PyAny>>,
    d_bias_out: Option<&Bound<'py, PyAny>>,
    stream: usize,
    unit_d_loss: bool,
    eager: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let mut o = options(opts)?;
    let dc_knob = dc_in_grad_dtype(opts)?;
    let inp = InputArgs::read(py, e, c, bias, targets)?;
    let sv = SavedArgs::read(py, [lse, rest_mass, d_loss], d_lse)?;
    let grads = GradArgs::read(py, [d_e_out, d_c_out, d_bias_out])?;
    grads.ask(&mut o);
    let all = [inp.tensors(), sv.tensors(), grads.tensors()].concat();
    let stats = guarded(py, || match device_of(&all)? {
        #[cfg(feature = "cuda")]
        Device::Cuda => py.detach(|| {
            // SAFETY: as in `forward`'s CUDA arm: tensors of one device held by the caller for
            // the whole call, torch's current stream, inputs only read, outputs only written.
            unsafe {
                cuda::backward(
                    torch_stream(inp.e.ordinal, stream, eager, dc_knob),
                    &inp.e,
                    &inp.c,
                    inp.bias.as_ref(),
                    &inp.targets,
                    &o,
                    [&sv.lse, &sv.rest_mass],
                    &sv.d_loss,
                    sv.d_lse.as_ref(),
                    unit_d_loss,
                    grads.refs(),
                )
            }
        }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => {
            let _ = (stream, eager, dc_knob);
            Err(cuda_missing())
        }
        Device::Cpu => py.detach(|| {
            // SAFETY: as in `forward`'s CPU arm.
            unsafe { run_backward(&inp, &sv, &grads, &o, unit_d_loss) }
        }),
    })?;
    stats_dict(py, &stats)
}

/// The CPU backward on borrowed tensors.
///
/// # Safety
/// Every tensor satisfies [`RawTensor::view`]'s and [`RawTensor::write`]'s contracts.
unsafe fn run_backward(
    inp: &InputArgs,
    sv: &SavedArgs,
    grads: &GradArgs,
    opts: &Options,
    unit_d_loss: bool,
) -> cce_core::Result<CallStats> {
    // SAFETY: forwarded from this function's contract (so is the write below).
    let (views, saved) = unsafe { (inp.views()?, sv.views()?) };
    let out = CpuBackend::new().backward_host(
        &views.inputs(),
        opts,
        saved.saved(),
        &saved.upstream(opts, unit_d_loss)?,
    )?;
    // SAFETY: as above.
    unsafe { grads.write([&out.d_e, &out.d_c, &out.d_bias])? };
    Ok(out.stats)
}

/// The loss gradient of a backward from the `d_loss` tensor: per row for reduction none, else
/// the scalar (1 when `unit_d_loss`: the caller scales the gradients itself).
///
/// Errors: `DTypeMismatch` unless f32; `ShapeMismatch` for a non-scalar under mean or sum.
fn d_loss_of<'a, 'b>(
    opts: &Options,
    d_loss: &'a HostView<'b>,
    unit_d_loss: bool,
) -> cce_core::Result<DLoss<'a, HostView<'b>>> {
    if d_loss.data().dtype() != DType::F32 {
        return Err(LibError::DTypeMismatch {
            what: "d_loss",
            expected: "f32".into(),
            got: d_loss.data().dtype(),
        });
    }
    Ok(match (opts.reduction, d_loss.data()) {
        (Reduction::None, _) => DLoss::PerRow(d_loss),
        _ if unit_d_loss => DLoss::Scalar(1.0),
        (_, HostSlice::F32([s])) => DLoss::Scalar(*s),
        _ => {
            return Err(LibError::ShapeMismatch {
                what: "d_loss",
                expected: "a scalar for reduction mean or sum".into(),
                got: format!("{} elements", d_loss.data().len()),
            })
        }
    })
}

/// Forward and backward in one call (CUDA tensors; the logits are computed once): the
/// forward's outputs as in `forward`, and `d_e`, `d_c`, `d_bias` (those given) of the loss with
/// an upstream gradient of 1, which the package's autograd formula scales by the real upstream
/// gradient (reductions mean and sum). Returns the forward's and the backward's statistics.
#[pyfunction]
#[pyo3(signature = (e, c, bias, targets, opts, loss_out, lse_out, rest_mass_out, entropy_out=None, argmax_out=None, d_e_out=None, d_c_out=None, d_bias_out=None, stream=0, eager=false))]
#[allow(clippy::too_many_arguments)]
fn forward_backward<'py>(
    py: Python<'py>,
    e: &Bound<'py, PyAny>,
    c: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    opts: &Bound<'py, PyDict>,
    loss_out: &Bound<'py, PyAny>,
    lse_out: &Bound<'py, PyAny>,
    rest_mass_out: &Bound<'py, PyAny>,
    entropy_out: Option<&Bound<'py, PyAny>>,
    argmax_out: Option<&Bound<'py, PyAny>>,
    d_e_out: Option<&Bound<'py, PyAny>>,
    d_c_out: Option<&Bound<'py, PyAny>>,
    d_bias_out: Option<&Bound<'py, PyAny>>,
    stream: usize,
    eager: bool,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let mut o = options(opts)?;
    let dc_knob = dc_in_grad_dtype(opts)?;
    let inp = InputArgs::read(py, e, c, bias, targets)?;
    let outs = ForwardArgs::read(
        py,
        [loss_out, lse_out, rest_mass_out],
        [entropy_out, argmax_out],
    )?;
    let grads = GradArgs::read(py, [d_e_out, d_c_out, d_bias_out])?;
    outs.ask(&mut o);
    grads.ask(&mut o);
    let all = [inp.tensors(), outs.tensors(), grads.tensors()].concat();
    let (fs, bs) = guarded(py, || match device_of(&all)? {
        #[cfg(feature = "cuda")]
        Device::Cuda => py.detach(|| {
            // SAFETY: as in `forward`'s CUDA arm: tensors of one device held by the caller for
            // the whole call, torch's current stream, inputs only read, outputs only written.
            unsafe {
                cuda::forward_backward(
                    torch_stream(inp.e.ordinal, stream, eager, dc_knob),
                    &inp.e,
                    &inp.c,
                    inp.bias.as_ref(),
                    &inp.targets,
                    &o,
                    outs.refs(),
                    grads.refs(),
                )
            }
        }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => {
            let _ = (stream, eager, dc_knob);
            Err(cuda_missing())
        }
        Device::Cpu => Err(LibError::Unsupported {
            backend: "cut_cross_entropy_rs",
            what: "forward_backward on CPU tensors (the package runs the CPU forward and backward \
                   as separate calls)"
                .into(),
        }),
    })?;
    Ok((stats_dict(py, &fs)?, stats_dict(py, &bs)?))
}

/// The device status of CUDA device `device` (`cce_cuda::CudaBackend::status` of every stream
/// the package ran a call on): raises the first error a deferred call recorded since the last
/// read (then cleared), else returns what the device knows of the last call on `stream`
/// (`{"n_valid": int, "filter": None or {"kept", "dropped_sum", "dropped_max",
/// "tiles_visited", "active_rows"}}`), or None when no call ran there. Synchronizes those
/// streams. A build without the `cuda` feature raises `Unsupported`.
#[pyfunction]
#[pyo3(signature = (device, stream=0))]
fn status<'py>(
    py: Python<'py>,
    device: usize,
    stream: usize,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    #[cfg(feature = "cuda")]
    {
        let report = guarded(py, || py.detach(|| cuda::status(device, stream)))?;
        let Some(r) = report else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("n_valid", r.n_valid)?;
        match r.filter {
            Some(f) => {
                let fd = PyDict::new(py);
                fd.set_item("kept", f.kept)?;
                fd.set_item("dropped_sum", f.dropped_sum)?;
                fd.set_item("dropped_max", f.dropped_max)?;
                fd.set_item("tiles_visited", f.tiles_visited)?;
                fd.set_item("active_rows", f.active_rows)?;
                d.set_item("filter", fd)?;
            }
            None => d.set_item("filter", py.None())?,
        }
        Ok(Some(d))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, stream);
        Err(to_py(py, cuda_missing()))
    }
}

/// The native module `cut_cross_entropy_rs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CceError", m.py().get_type::<CceError>())?;
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(forward_backward, m)?)?;
    m.add_function(wrap_pyfunction!(status, m)?)?;
    m.add_function(wrap_pyfunction!(vocab_parallel::vp_forward, m)?)?;
    m.add_function(wrap_pyfunction!(vocab_parallel::vp_backward, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
