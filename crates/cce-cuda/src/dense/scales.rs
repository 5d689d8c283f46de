//! Small device utilities of the engine: the power-of-two scales of split dense's f16
//! operands, the f16 copies, the f32 conversions, and the test-data generators.

use super::*;

/// The exponent `k` (clamped to ±100) with `max · 2^k ≤ 2^top`; 0 for a zero or non-finite max.
pub(super) fn pow2_to(max: f32, top: i32) -> i32 {
    if max > 0.0 && max.is_finite() {
        (top - max.log2().ceil() as i32).clamp(-100, 100)
    } else {
        0
    }
}

/// The rows `cce_split_scales_*` takes max |G coefficient| over (device addresses of `[N]`
/// arrays, 0 = absent).
#[derive(Clone, Copy)]
pub(super) struct ScaleRows {
    pub(super) targets: u64,
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) n: i32,
    pub(super) v: i32,
}

impl DenseEngine {
    /// Split dense: `dst` (f16 `[V, D]`) = `2^kc · c` for bf16 `c`, with `kc` from max |c| so
    /// that max |2^kc · c| ≤ 2^15 (one read-back). Returns `kc`.
    pub(super) fn c16_copy(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        c: &CudaSlice<u8>,
        dst: u64,
    ) -> Result<i32> {
        let count = cfg.v * cfg.d;
        let max_c = self.abs_max(ws, c, cfg.dtype, count)?;
        let kc = pow2_to(max_c, 15);
        self.to_f16(self.ptr(c), dst, count, 2f32.powi(kc))?;
        Ok(kc)
    }

    /// max |x| over `count` elements of `dtype` (a device reduction and a 4-byte read-back).
    pub(super) fn abs_max(
        &self,
        ws: &mut DenseWorkspace,
        x: &CudaSlice<u8>,
        dtype: DType,
        count: usize,
    ) -> Result<f32> {
        let x_ptr = self.ptr(x);
        Ok(self.split_scales(ws, (x_ptr, dtype, count), count, None)?.0)
    }

    /// `cce_split_scales_*`: (max |x| over `count` elements of `dtype` at `x`, max |G
    /// coefficient| over the rows of `rows`, 0 without them). One launch sized for
    /// `grid_elems` elements and an 8-byte read-back (one host sync).
    pub(super) fn split_scales(
        &self,
        ws: &mut DenseWorkspace,
        (x, dtype, count): (u64, DType, usize),
        grid_elems: usize,
        rows: Option<ScaleRows>,
    ) -> Result<(f32, f32)> {
        self.stream.memset_zeros(&mut ws.scales).map_err(drv)?;
        let scales_ptr = self.ptr(&ws.scales);
        let count_i = count as i64;
        let r = rows.unwrap_or(ScaleRows {
            targets: 0,
            dl_rows: 0,
            dl_scalar: 0.0,
            dlse: 0,
            lse: 0,
            rest: 0,
            alpha: 0.0,
            lambda: 0.0,
            n: 0,
            v: 0,
        });
        let f = self.func(&format!("cce_split_scales_{}", dtype_code(dtype)?))?;
        let params = ScalesParams {
            x,
            count: count_i,
            rows: r,
            out: scales_ptr,
        };
        let launch = LaunchConfig {
            grid_dim: (grid_elems.div_ceil(256 * 8).clamp(1, 132 * 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ScalesParams is SCALES_PARAMS in classes.cu; x holds `count` elements (the
        // caller's buffer); the row pointers hold N values or are 0 (and N = 0 without rows,
        // so they are not read); out holds 2 u32 (zeroed).
        unsafe { self.launch_params(&self.stream, f, launch, &params) }?;
        let host = self.read_back::<8>(&ws.scales)?;
        let f32_at =
            |i: usize| f32::from_le_bytes(host[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        Ok((f32_at(0), f32_at(1)))
    }

    /// `dst` (f16) = `src` (bf16) · `scale`, `count` elements.
    pub(super) fn to_f16(&self, src: u64, dst: u64, count: usize, scale: f32) -> Result<()> {
        let count_i = count as i64;
        let mut b = self
            .stream
            .launch_builder(self.func("cce_split_e_to_f16_bf16")?);
        b.arg(&src).arg(&dst).arg(&count_i).arg(&scale);
        // SAFETY: matches cce_split_e_to_f16_bf16; src holds count bf16, dst count f16 (a
        // workspace region sized for it), disjoint.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (count.div_ceil(256 * 4).clamp(1, 132 * 32) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// `d_e` rows (`out_ty`) = f32 rows · per-row scale (or 1) · `cscale`.
    pub(super) fn de_finish(
        &self,
        out_ty: DType,
        tmp: u64,
        rs: u64,
        cscale: f32,
        de: u64,
        (rows, d): (usize, usize),
    ) -> Result<()> {
        let f = self.func(&format!("cce_split_de_finish_{}", dtype_code(out_ty)?))?;
        let rows_i = rows as i64;
        let d_i = to_i32(d, "D")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&tmp)
            .arg(&rs)
            .arg(&cscale)
            .arg(&de)
            .arg(&rows_i)
            .arg(&d_i);
        // SAFETY: matches DEF_PARAMS; tmp holds rows·d f32 written by the GEMMs above (stream
        // order), rs rows f32 (or 0), de rows·d elements of out_ty (the chunk's d_e rows).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: ((rows * d).div_ceil(256).clamp(1, 132 * 64) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// `cce_dense_convert_{code}`: `dst[i] = src[i]` for `count` values, f32 to the gradient
    /// dtype `code`. The caller guarantees `src` holds `count` f32 and `dst` `count` elements.
    pub(super) fn convert_f32(&self, code: &str, src: u64, dst: u64, count: usize) -> Result<()> {
        let f = self.func(&format!("cce_dense_convert_{code}"))?;
        let count_i = count as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&src).arg(&dst).arg(&count_i);
        // SAFETY: matches cce_dense_convert_* (f32 source, gradient-dtype destination, i64
        // count); both buffers hold `count` elements (the caller's contract, from checked
        // sizes); the grid strides over the count.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (count.div_ceil(256).min(65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// Fill `x` (`n` elements of `dtype`) with `mean + std·N(0, 1)` from a counter-based hash
    /// of `(seed, index)` (benches and tests).
    pub fn fill_randn(
        &self,
        x: &mut CudaSlice<u8>,
        dtype: DType,
        n: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> Result<()> {
        if x.len() < n * dtype.size_bytes() {
            return Err(CceError::ShapeMismatch {
                what: "fill_randn",
                expected: format!("{} bytes", n * dtype.size_bytes()),
                got: format!("{} bytes", x.len()),
            });
        }
        let f = self.func(&format!("cce_dense_randn_{}", dtype_code(dtype)?))?;
        let p = self.ptr(x);
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p).arg(&n_i).arg(&seed).arg(&mean).arg(&std);
        // SAFETY: matches cce_dense_randn_*; x holds n elements of dtype (checked).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// Fill i32 targets `[n]` with hashed classes in `[0, v)`, −1 with probability
    /// `ignore_frac`.
    pub fn random_targets(
        &self,
        t: &mut CudaSlice<u8>,
        n: usize,
        v: usize,
        seed: u64,
        ignore_frac: f32,
    ) -> Result<()> {
        if t.len() < n * 4 {
            return Err(CceError::ShapeMismatch {
                what: "random_targets",
                expected: format!("{} bytes", n * 4),
                got: format!("{} bytes", t.len()),
            });
        }
        let f = self.func("cce_dense_random_targets")?;
        let p = self.ptr(t);
        let n_i = to_i32(n, "N")?;
        let v_i = to_i32(v, "V")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p).arg(&n_i).arg(&v_i).arg(&seed).arg(&ignore_frac);
        // SAFETY: matches cce_dense_random_targets; t holds n i32 (checked).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }
}

/// `SCALES_PARAMS` of `cce_split_scales_*` (`kernels/classes.cu`): `count` elements at `x`,
/// the rows of [`ScaleRows`] (in the kernel's order), the two u32 maxima out.
pub(super) struct ScalesParams {
    pub(super) x: u64,
    pub(super) count: i64,
    pub(super) rows: ScaleRows,
    pub(super) out: u64,
}

impl KernelParams for ScalesParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        let r = &self.rows;
        b.arg(&self.x)
            .arg(&self.count)
            .arg(&r.targets)
            .arg(&r.dl_rows)
            .arg(&r.dl_scalar)
            .arg(&r.dlse)
            .arg(&r.lse)
            .arg(&r.rest)
            .arg(&r.alpha)
            .arg(&r.lambda)
            .arg(&r.n)
            .arg(&r.v)
            .arg(&self.out);
    }
}
