//! Host tensors and the metadata every buffer (host or device) exposes.

use crate::dtype::DType;
use crate::error::{CceError, Result};
use half::{bf16, f16};

/// What every tensor-like buffer tells about itself: dtype and shape (row-major, contiguous).
pub trait TensorMeta {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Shape, outermost first. Storage is row-major and contiguous.
    fn shape(&self) -> &[usize];
    /// Number of elements. Every constructor of a buffer checks that this product does not
    /// overflow ([`checked_numel`]).
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// The element count of `shape` (the product of its dimensions; 0 when a dimension is 0), or
/// `ResourceLimit` when that product does not fit in `usize`. Every tensor constructor checks
/// its shape here, so no later size computation can overflow (or divide by a wrapped zero).
pub fn checked_numel(shape: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| CceError::ResourceLimit {
            resource: format!("elements of shape {shape:?} (the product overflows usize)"),
            requested: shape
                .iter()
                .fold(1u128, |a, &b| a.saturating_mul(b as u128))
                .min(u64::MAX as u128) as u64,
            max: usize::MAX as u64,
        })
}

/// Bytes of a `shape` x `dtype` tensor, or `ResourceLimit` when the element count or the byte
/// count does not fit in `usize` ([`checked_numel`]).
pub fn checked_bytes(shape: &[usize], dtype: DType) -> Result<usize> {
    let n = checked_numel(shape)?;
    n.checked_mul(dtype.size_bytes())
        .ok_or_else(|| CceError::ResourceLimit {
            resource: format!("bytes of a {shape:?} x {dtype} tensor (overflows usize)"),
            requested: (n as u64).saturating_mul(dtype.size_bytes() as u64),
            max: usize::MAX as u64,
        })
}

/// Typed host storage.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// i32 values.
    I32(Vec<i32>),
    /// i64 values.
    I64(Vec<i64>),
}

/// A vector of `len` copies of `fill`, or `OutOfMemory { backend: "host", .. }` when the
/// allocation fails (e.g. under an address-space limit), instead of aborting the process.
pub fn try_filled<T: Clone>(len: usize, fill: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| CceError::OutOfMemory {
            backend: "host",
            requested_bytes: (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        })?;
    v.resize(len, fill);
    Ok(v)
}

/// `values` mapped by `f` into a new vector, with the allocation failure as `OutOfMemory`
/// ([`try_filled`]).
fn try_map<A: Copy, B>(values: &[A], f: impl Fn(A) -> B) -> Result<Vec<B>> {
    let mut v = Vec::new();
    v.try_reserve_exact(values.len())
        .map_err(|_| CceError::OutOfMemory {
            backend: "host",
            requested_bytes: (values.len() as u64).saturating_mul(std::mem::size_of::<B>() as u64),
        })?;
    v.extend(values.iter().map(|&x| f(x)));
    Ok(v)
}

/// A contiguous row-major tensor in host memory. The CPU reference backend uses it as its
/// buffer type; GPU backends upload from and download to it.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Vec<usize>,
    data: HostData,
}

impl HostTensor {
    /// Build from a shape and storage. Errors: `ResourceLimit` if the shape's element count
    /// overflows `usize` ([`checked_numel`]), `ShapeMismatch` if it differs from the storage's.
    pub fn new(shape: Vec<usize>, data: HostData) -> Result<Self> {
        let n = checked_numel(&shape)?;
        let len = data.len();
        if n != len {
            return Err(CceError::ShapeMismatch {
                what: "host tensor storage",
                expected: format!("{n} elements for shape {shape:?}"),
                got: format!("{len} elements"),
            });
        }
        Ok(Self { shape, data })
    }

    /// Round f32 values to `dtype` (round-to-nearest-even). `dtype` must be a float type,
    /// else `DTypeMismatch`; `OutOfMemory` when the host cannot allocate the copy.
    pub fn from_f32(shape: Vec<usize>, values: &[f32], dtype: DType) -> Result<Self> {
        let data = match dtype {
            DType::F32 => HostData::F32(try_map(values, |x| x)?),
            DType::F16 => HostData::F16(try_map(values, f16::from_f32)?),
            DType::BF16 => HostData::BF16(try_map(values, bf16::from_f32)?),
            other => {
                return Err(CceError::DTypeMismatch {
                    what: "HostTensor::from_f32",
                    expected: "f32, f16 or bf16".into(),
                    got: other,
                })
            }
        };
        Self::new(shape, data)
    }

    /// A copy, with an allocation failure as `OutOfMemory` (what `clone` would abort on).
    pub fn try_clone(&self) -> Result<Self> {
        let data = match &self.data {
            HostData::F32(x) => HostData::F32(try_map(x, |a| a)?),
            HostData::F16(x) => HostData::F16(try_map(x, |a| a)?),
            HostData::BF16(x) => HostData::BF16(try_map(x, |a| a)?),
            HostData::I32(x) => HostData::I32(try_map(x, |a| a)?),
            HostData::I64(x) => HostData::I64(try_map(x, |a| a)?),
        };
        Ok(Self {
            shape: self.shape.clone(),
            data,
        })
    }

    /// Targets from i64 values, shape `[len]`.
    pub fn from_i64(values: Vec<i64>) -> Self {
        Self {
            shape: vec![values.len()],
            data: HostData::I64(values),
        }
    }

    /// Targets from i32 values, shape `[len]`.
    pub fn from_i32(values: Vec<i32>) -> Self {
        Self {
            shape: vec![values.len()],
            data: HostData::I32(values),
        }
    }

    /// A scalar f32 tensor (shape `[]`).
    pub fn scalar_f32(x: f32) -> Self {
        Self {
            shape: vec![],
            data: HostData::F32(vec![x]),
        }
    }

    /// The storage.
    pub fn data(&self) -> &HostData {
        &self.data
    }

    /// Consume into storage.
    pub fn into_data(self) -> HostData {
        self.data
    }

    /// Values widened to f64 (exact for every dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            HostData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            HostData::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::I64(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Values as f32 (exact for f32/f16/bf16; integers are converted).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            HostData::F16(v) => v.iter().map(|&x| x.to_f32()).collect(),
            HostData::BF16(v) => v.iter().map(|&x| x.to_f32()).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as f32).collect(),
            HostData::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// Values as f32 like [`HostTensor::to_f32_vec`], with an allocation failure as
    /// `OutOfMemory { backend: "host", .. }` instead of aborting the process.
    pub fn try_to_f32_vec(&self) -> Result<Vec<f32>> {
        match &self.data {
            HostData::F32(v) => try_map(v, |x| x),
            HostData::F16(v) => try_map(v, |x| x.to_f32()),
            HostData::BF16(v) => try_map(v, |x| x.to_f32()),
            HostData::I32(v) => try_map(v, |x| x as f32),
            HostData::I64(v) => try_map(v, |x| x as f32),
        }
    }

    /// Integer values as i64 (`None` for float tensors).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        match &self.data {
            HostData::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            HostData::I64(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// Reinterpret with a new shape of the same element count (`ShapeMismatch` otherwise).
    pub fn reshape(self, shape: Vec<usize>) -> Result<Self> {
        Self::new(shape, self.data)
    }

    /// Raw little-endian bytes of the storage.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
            HostData::BF16(v) => bytemuck::cast_slice(v),
            HostData::I32(v) => bytemuck::cast_slice(v),
            HostData::I64(v) => bytemuck::cast_slice(v),
        }
    }

    /// Build from raw little-endian bytes of `dtype` (`ShapeMismatch` if the length is off,
    /// `ResourceLimit` if the shape's size overflows `usize`).
    pub fn from_bytes(shape: Vec<usize>, dtype: DType, bytes: &[u8]) -> Result<Self> {
        let need = checked_bytes(&shape, dtype)?;
        if bytes.len() != need {
            let n = need / dtype.size_bytes();
            return Err(CceError::ShapeMismatch {
                what: "host tensor bytes",
                expected: format!("{need} bytes for {n} x {dtype}"),
                got: format!("{} bytes", bytes.len()),
            });
        }
        fn collect<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
            b.chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect()
        }
        let data = match dtype {
            DType::F32 => HostData::F32(collect(bytes)),
            DType::F16 => HostData::F16(collect(bytes)),
            DType::BF16 => HostData::BF16(collect(bytes)),
            DType::I32 => HostData::I32(collect(bytes)),
            DType::I64 => HostData::I64(collect(bytes)),
        };
        Self::new(shape, data)
    }
}

impl HostData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::I64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
        }
    }
}

impl TensorMeta for HostTensor {
    fn dtype(&self) -> DType {
        self.data.dtype()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_each_dtype() {
        let vals = [1.5f32, -2.25, 3.0e-3, 7.0];
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let t = HostTensor::from_f32(vec![2, 2], &vals, dt).unwrap();
            let back = HostTensor::from_bytes(vec![2, 2], dt, t.as_bytes()).unwrap();
            assert_eq!(t, back);
        }
        assert!(matches!(
            HostTensor::from_bytes(vec![3], DType::F32, &[0u8; 8]),
            Err(CceError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn new_checks_element_count() {
        assert!(HostTensor::new(vec![2, 3], HostData::F32(vec![1.0; 5])).is_err());
    }

    #[test]
    fn an_overflowing_shape_is_an_error_at_construction() {
        let half = 1usize << (usize::BITS / 2);
        // The product wraps to 0 (or panics in debug builds) without the check.
        for shape in [vec![half, half], vec![half, half, 1], vec![usize::MAX, 2]] {
            let r = HostTensor::new(shape.clone(), HostData::F32(vec![]));
            assert!(
                matches!(r, Err(CceError::ResourceLimit { .. })),
                "{shape:?}: {r:?}"
            );
            let r = HostTensor::from_f32(shape.clone(), &[], DType::BF16);
            assert!(matches!(r, Err(CceError::ResourceLimit { .. })), "{r:?}");
            let r = HostTensor::from_bytes(shape.clone(), DType::F32, &[]);
            assert!(matches!(r, Err(CceError::ResourceLimit { .. })), "{r:?}");
        }
        // A zero dimension makes the count 0 whatever the others are.
        assert_eq!(checked_numel(&[usize::MAX, 0, 7]).unwrap(), 0);
        // The element count fits but the bytes do not.
        let r = checked_bytes(&[usize::MAX / 2], DType::F32);
        assert!(matches!(r, Err(CceError::ResourceLimit { .. })), "{r:?}");
        let r = HostTensor::new(vec![usize::MAX / 2, 1], HostData::F32(vec![]));
        assert!(matches!(r, Err(CceError::ShapeMismatch { .. })), "{r:?}");
    }

    #[test]
    fn allocation_failures_are_errors() {
        let too_big = try_filled(usize::MAX / 4, 0u64);
        assert!(
            matches!(
                too_big,
                Err(CceError::OutOfMemory {
                    backend: "host",
                    ..
                })
            ),
            "{too_big:?}"
        );
        let t = HostTensor::from_f32(vec![2, 2], &[1.0, -2.0, 3.5, 0.25], DType::BF16).unwrap();
        assert_eq!(t.try_clone().unwrap(), t);
        assert_eq!(try_filled(3, 7u8).unwrap(), vec![7, 7, 7]);
    }
}
