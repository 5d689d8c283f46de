//! Borrowed host tensors: the CPU backend reading memory it does not own (a PyTorch tensor, a
//! NumPy array, a memory-mapped file) in place, without copying it into a [`HostTensor`].
//!
//! [`CpuBackend::forward_host`](crate::CpuBackend::forward_host) and
//! [`CpuBackend::backward_host`](crate::CpuBackend::backward_host) take any [`HostRead`]:
//! an owned [`HostTensor`] or a [`HostView`]. f32 inputs are read where they lie; f16 and bf16
//! are widened to f32 once per call, as for an owned tensor.

use cce_core::{CceError, DType, HostData, HostTensor, Result, TensorMeta};
use half::{bf16, f16};
use std::borrow::Cow;

/// Borrowed typed storage (the borrowed counterpart of [`HostData`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostSlice<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [f16]),
    /// bf16 values.
    BF16(&'a [bf16]),
    /// i32 values.
    I32(&'a [i32]),
    /// i64 values.
    I64(&'a [i64]),
}

impl HostSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostSlice::F32(v) => v.len(),
            HostSlice::F16(v) => v.len(),
            HostSlice::BF16(v) => v.len(),
            HostSlice::I32(v) => v.len(),
            HostSlice::I64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::F16(_) => DType::F16,
            HostSlice::BF16(_) => DType::BF16,
            HostSlice::I32(_) => DType::I32,
            HostSlice::I64(_) => DType::I64,
        }
    }
}

/// A contiguous row-major tensor in host memory that the caller owns.
#[derive(Clone, Debug, PartialEq)]
pub struct HostView<'a> {
    shape: Vec<usize>,
    data: HostSlice<'a>,
}

impl<'a> HostView<'a> {
    /// A view of `data` with `shape`. Errors: `ResourceLimit` if the shape's element count
    /// overflows `usize` ([`cce_core::checked_numel`]), `ShapeMismatch` if it differs from the
    /// data's.
    pub fn new(shape: Vec<usize>, data: HostSlice<'a>) -> Result<Self> {
        let n = cce_core::checked_numel(&shape)?;
        if n != data.len() {
            return Err(CceError::ShapeMismatch {
                what: "host view storage",
                expected: format!("{n} elements for shape {shape:?}"),
                got: format!("{} elements", data.len()),
            });
        }
        Ok(Self { shape, data })
    }

    /// The borrowed storage.
    pub fn data(&self) -> HostSlice<'a> {
        self.data
    }
}

impl TensorMeta for HostView<'_> {
    fn dtype(&self) -> DType {
        self.data.dtype()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// A host buffer the CPU backend reads: values as f32 (floats) or i64 (integers).
pub trait HostRead: TensorMeta + Sync {
    /// Float values as f32: borrowed when stored as f32, widened (exactly) from f16/bf16,
    /// converted from integers. Errors: `OutOfMemory { backend: "host" }` when the host cannot
    /// allocate the f32 copy.
    fn f32_values(&self) -> Result<Cow<'_, [f32]>>;
    /// Integer values as i64 (`None` for float storage).
    fn i64_values(&self) -> Option<Vec<i64>>;
}

impl HostRead for HostTensor {
    fn f32_values(&self) -> Result<Cow<'_, [f32]>> {
        Ok(match self.data() {
            HostData::F32(v) => Cow::Borrowed(v),
            _ => Cow::Owned(self.try_to_f32_vec()?),
        })
    }
    fn i64_values(&self) -> Option<Vec<i64>> {
        self.to_i64_vec()
    }
}

/// `values` mapped by `f` into a new vector, with an allocation failure as `OutOfMemory`.
fn try_map<A: Copy>(values: &[A], f: impl Fn(A) -> f32) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(values.len())
        .map_err(|_| CceError::OutOfMemory {
            backend: "host",
            requested_bytes: (values.len() as u64).saturating_mul(4),
        })?;
    v.extend(values.iter().map(|&x| f(x)));
    Ok(v)
}

impl HostRead for HostView<'_> {
    fn f32_values(&self) -> Result<Cow<'_, [f32]>> {
        Ok(match self.data {
            HostSlice::F32(v) => Cow::Borrowed(v),
            HostSlice::F16(v) => Cow::Owned(try_map(v, f16::to_f32)?),
            HostSlice::BF16(v) => Cow::Owned(try_map(v, bf16::to_f32)?),
            HostSlice::I32(v) => Cow::Owned(try_map(v, |x| x as f32)?),
            HostSlice::I64(v) => Cow::Owned(try_map(v, |x| x as f32)?),
        })
    }
    fn i64_values(&self) -> Option<Vec<i64>> {
        match self.data {
            HostSlice::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            HostSlice::I64(v) => Some(v.to_vec()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_read_like_owned_tensors() {
        let vals = [1.5f32, -2.0, 0.25, 8.0];
        let owned = HostTensor::from_f32(vec![2, 2], &vals, DType::F32).unwrap();
        let view = HostView::new(vec![2, 2], HostSlice::F32(&vals)).unwrap();
        assert!(matches!(view.f32_values(), Ok(Cow::Borrowed(_))));
        assert_eq!(view.f32_values().unwrap(), owned.f32_values().unwrap());
        let b: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
        let view = HostView::new(vec![4], HostSlice::BF16(&b)).unwrap();
        assert_eq!(&*view.f32_values().unwrap(), &vals);
        let t = [3i32, -100];
        let view = HostView::new(vec![2], HostSlice::I32(&t)).unwrap();
        assert_eq!(view.i64_values(), Some(vec![3, -100]));
        assert!(HostView::new(vec![3], HostSlice::I32(&t)).is_err());
    }

    #[test]
    fn an_overflowing_shape_is_an_error_not_a_wrapped_count() {
        let half = 1usize << (usize::BITS / 2);
        // [2^32, 2^32] wraps to 0 elements (or panics in debug builds) without the check, and
        // would pass for an empty view whose rows the backend then slices past its end.
        for shape in [vec![half, half], vec![usize::MAX, 2], vec![half, half, 3]] {
            let r = HostView::new(shape.clone(), HostSlice::F32(&[]));
            assert!(
                matches!(r, Err(CceError::ResourceLimit { .. })),
                "{shape:?}: {r:?}"
            );
        }
        // A zero dimension is an empty view whatever the others are.
        assert!(HostView::new(vec![usize::MAX, 0], HostSlice::F32(&[])).is_ok());
    }
}
