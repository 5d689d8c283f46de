//! The row operation the composed vocabulary-shard primitives
//! ([`cce_core::vocab_parallel::BackendShard`]) need, on the device: a shard's real rows of
//! `c` and `bias` (with a zero row appended for the backward), and a shard's gradients cut to
//! its real classes, padded with zero rows and converted to the gradient dtype.

use super::*;
use cce_core::vocab_parallel::over_backend::resized_shape;
use cce_core::vocab_parallel::ShardRows;

impl ShardRows for CudaBackend {
    /// Device copies on the backend's stream: a zero-filled tensor, then the kept rows copied
    /// in (`memcpy` for the same dtype, the dense engine's conversion kernel from f32 to
    /// f16/bf16, through the host otherwise). Errors as [`ShardRows::resize_rows`], plus
    /// `ForeignBuffer` for a tensor of another context.
    fn resize_rows(
        &self,
        buf: &CudaTensor,
        take: usize,
        zeros: usize,
        dtype: DType,
    ) -> Result<CudaTensor> {
        self.check_owned("rows to resize", buf)?;
        let (shape, width) = resized_shape(buf, take, zeros, dtype)?;
        let count = take * width;
        let mut out = self.zeros(shape.clone(), dtype)?;
        if count == 0 {
            return Ok(out);
        }
        if buf.dtype() == dtype {
            let bytes = count * dtype.size_bytes();
            let src = buf.data.slice(..bytes);
            let mut dst = out.data.slice_mut(..bytes);
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv)?;
            return Ok(out);
        }
        if buf.dtype() == DType::F32 {
            // `buf` holds at least `count` f32 (its first `take` rows, checked by
            // `resized_shape`), `out` `(take + zeros) · width` elements of `dtype`.
            self.dense_engine()?
                .convert_f32_to(dtype, self.tptr(buf), self.tptr(&out), count)?;
            return Ok(out);
        }
        let mut vals = self.download(buf)?.try_to_f32_vec()?;
        vals.truncate(count);
        vals.resize(cce_core::checked_numel(&shape)?, 0.0);
        out = self.upload(&HostTensor::from_f32(shape, &vals, dtype)?)?;
        Ok(out)
    }
}
