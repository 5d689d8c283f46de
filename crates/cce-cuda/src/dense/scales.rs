//! Small device utilities of the engine: the power-of-two scales of split dense's f16
//! operands (computed and kept on the device: no host sync), the f16 copies, the f32
//! conversions, and the test-data generators.

use super::*;

/// 4-byte words of one [`ScaleSet`] in the workspace's `scales` region.
pub(super) const SET_WORDS: usize = 9;
/// Bytes of the workspace's `scales` region: one set per [`ScaleSet`].
pub(super) const SCALES_BYTES: usize = 3 * SET_WORDS * 4;

/// A set of scale words in the workspace's `scales` region (byte offset `index · 4 ·
/// SET_WORDS`), one per use so that the factors of the row pass's copy of `c` stay valid while
/// the class pass computes its own. Words (`cce_split_scales_finish`, `classes.cu`): 0, 1 the
/// bits of max |x| and max |G coefficient| (`cce_split_scales_*`); 2 `2^kx`, 3 `2^−kx`,
/// 4 `2^kg`, 5 `2^−kg`, 6 `2^(−kx−kg)`, 7 `0.0`, 8 `1.0` (f32), with `kx = pow2_to(max |x|, 15)` and
/// `kg = pow2_to(max |G|, 14)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScaleSet {
    /// The row pass's f16 copy of bf16 `c` (`x = c`, no rows).
    CCopy = 0,
    /// The class pass (`x = e` for bf16 inputs, else none; the rows' `G` bound).
    ClassPass = 1,
    /// A row chunk of chunked dense with f32 gradients of bf16 inputs
    /// ([`super::DenseConfig::row_e16`]): `x` = the chunk's rows of `e`, the `G` bound over
    /// its rows; rewritten per chunk (stream order: after the previous chunk's readers).
    RowChunk = 2,
}

impl ScaleSet {
    /// Byte offset of the set in the `scales` region.
    pub(super) fn offset(self) -> usize {
        self as usize * SET_WORDS * 4
    }
}

/// Device addresses of a [`ScaleSet`]'s f32 factors, valid once `split_scales` returned (its
/// kernels run before any later launch on the stream).
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceScales {
    base: u64,
}

impl DeviceScales {
    fn word(self, i: usize) -> u64 {
        self.base + 4 * i as u64
    }
    /// `2^kx`: the f16 copy of `x` is `x` times it.
    pub(super) fn up_x(self) -> u64 {
        self.word(2)
    }
    /// `2^−kx`: undoes the scale of `x`'s copy.
    pub(super) fn down_x(self) -> u64 {
        self.word(3)
    }
    /// `2^kg`: `G` is stored times it.
    pub(super) fn up_g(self) -> u64 {
        self.word(4)
    }
    /// `2^−kg`: undoes the scale of `G` (`d_bias`).
    pub(super) fn down_g(self) -> u64 {
        self.word(5)
    }
    /// `2^(−kx−kg)`: undoes both (the `d_c` GEMM's alpha).
    pub(super) fn down_xg(self) -> u64 {
        self.word(6)
    }
    /// `0.0` (the `d_c` GEMM's beta in device pointer mode: overwrite).
    pub(super) fn zero(self) -> u64 {
        self.word(7)
    }
    /// `1.0` (the `d_c` GEMM's beta in device pointer mode: add to the output's contents).
    pub(super) fn one(self) -> u64 {
        self.word(8)
    }
}

/// The reference of `cce_split_scales_finish`'s exponent (`classes.cu` `pow2_to_bits`, the same
/// integer steps): `k = top − ⌈log2 max⌉` clamped to ±100, so that `max · 2^k ≤ 2^top`, from
/// the exponent and significand bits (exact, subnormals included); 0 for a zero, negative or
/// non-finite max.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn pow2_to(max: f32, top: i32) -> i32 {
    let u = max.to_bits();
    let ex = ((u >> 23) & 0xff) as i32;
    let m = u & 0x7f_ffff;
    if u >> 31 != 0 || ex == 0xff || u == 0 {
        return 0;
    }
    let ceil_log2 = if ex != 0 {
        ex - 127 + i32::from(m != 0)
    } else {
        (31 - m.leading_zeros() as i32) - 149 + i32::from(!m.is_power_of_two())
    };
    (top - ceil_log2).clamp(-100, 100)
}

/// The reference of `classes.cu` `pow2f`: `2^k` as f32, exact where representable (subnormals
/// included), +inf above `2^127`, 0 below `2^−149`.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn pow2f(k: i32) -> f32 {
    match k {
        128.. => f32::INFINITY,
        -126..=127 => f32::from_bits(((k + 127) as u32) << 23),
        -149..=-127 => f32::from_bits(1u32 << (k + 149)),
        _ => 0.0,
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
    /// that max |2^kc · c| ≤ 2^15, all on the device. Returns the device address of the f32
    /// `2^−kc` (`cce_split_de_finish_*`'s `cscale`).
    pub(super) fn c16_copy(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        c: &CudaSlice<u8>,
        dst: u64,
    ) -> Result<u64> {
        let count = cfg.v * cfg.d;
        let x = (self.ptr(c), cfg.dtype, count);
        let s = self.split_scales(ws, ScaleSet::CCopy, x, count, None)?;
        self.to_f16(self.ptr(c), dst, count, s.up_x())?;
        Ok(s.down_x())
    }

    /// `cce_split_scales_*` then `cce_split_scales_finish` into `set` of `ws.scales`: max |x|
    /// over `count` elements of `dtype` at `x`, max |G coefficient| over the rows of `rows` (0
    /// without them), and the factors of [`ScaleSet`] from them. One launch sized for
    /// `grid_elems` elements and a one-thread launch; no host sync.
    pub(super) fn split_scales(
        &self,
        ws: &mut DenseWorkspace,
        set: ScaleSet,
        (x, dtype, count): (u64, DType, usize),
        grid_elems: usize,
        rows: Option<ScaleRows>,
    ) -> Result<DeviceScales> {
        if ws.scales.len() < SCALES_BYTES {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let off = set.offset();
        self.stream
            .memset_zeros(&mut ws.scales.slice_mut(off..off + 8))
            .map_err(drv)?;
        let base = self.ptr(&ws.scales) + off as u64;
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
            count: count as i64,
            rows: r,
            out: base,
        };
        let launch = LaunchConfig {
            grid_dim: (grid_elems.div_ceil(256 * 8).clamp(1, 132 * 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ScalesParams is SCALES_PARAMS in classes.cu; x holds `count` elements (the
        // caller's buffer); the row pointers hold N values or are 0 (and N = 0 without rows,
        // so they are not read); out holds 2 u32 (the set's first 8 bytes of the SCALES_BYTES
        // region, checked above, zeroed just before).
        unsafe { self.launch_params(&self.stream, f, launch, &params) }?;
        let params = ScalesFinishParams {
            set: base,
            top_x: 15,
            top_g: 14,
        };
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ScalesFinishParams is cce_split_scales_finish's parameter list (u32*, int,
        // int); set points at SET_WORDS 4-byte words within ws.scales (offset + 4·SET_WORDS ≤
        // SCALES_BYTES ≤ its length, checked above), its maxima written by the launch above
        // (stream order); one thread.
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_split_scales_finish")?,
                one,
                &params,
            )
        }?;
        Ok(DeviceScales { base })
    }

    /// `dst` (f16) = `src` (bf16) · `*scale` (a device f32, or 0 for 1), `count` elements.
    pub(super) fn to_f16(&self, src: u64, dst: u64, count: usize, scale: u64) -> Result<()> {
        let count_i = count as i64;
        let mut b = self
            .stream
            .launch_builder(self.func("cce_split_e_to_f16_bf16")?);
        b.arg(&src).arg(&dst).arg(&count_i).arg(&scale);
        // SAFETY: matches cce_split_e_to_f16_bf16 (u16*, u16*, i64, const float*); src holds
        // count bf16, dst count f16 (a workspace region sized for it), disjoint; scale is 0 or
        // one f32 of ws.scales written before on this stream.
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

    /// `cce_g16_to_bf16`: a chunk's `G` (`rows x ldg` 16-bit at `g`, its first `cols8`
    /// columns: `V` rounded up to 8), f16 times `2^kg` in, bf16 out (times `*down`, a device
    /// f32 `2^−kg`), in place.
    pub(super) fn g16_to_bf16(
        &self,
        g: u64,
        (rows, ldg, cols8): (usize, usize, usize),
        down: u64,
    ) -> Result<()> {
        if ldg % 8 != 0 || cols8 % 8 != 0 || cols8 > ldg {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "G's row stride is not a multiple of 8 elements".into(),
            });
        }
        let (ldg_i, rows_i, cols_i) = (ldg as i64, to_i32(rows, "rows")?, to_i32(cols8, "V")?);
        let groups = rows * cols8 / 8;
        let mut b = self.stream.launch_builder(self.func("cce_g16_to_bf16")?);
        b.arg(&g).arg(&ldg_i).arg(&rows_i).arg(&cols_i).arg(&down);
        // SAFETY: matches cce_g16_to_bf16 (u16*, i64, int, int, const float*); g holds rows x
        // ldg 16-bit values (the chunk's G in its logits region, 16-byte aligned rows: ldg a
        // multiple of 8, checked above), of which the first cols8 ≤ ldg per row are read and
        // written; down is one f32 of ws.scales written before on this stream.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (groups.div_ceil(256).clamp(1, 132 * 32) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// `d_e` rows (`out_ty`) = f32 rows · per-row scale (or 1) · `*cscale` (a device f32, or
    /// 0 for 1); with `accumulate`, added to the rows' contents instead.
    pub(super) fn de_finish(
        &self,
        out_ty: DType,
        tmp: u64,
        rs: u64,
        cscale: u64,
        (de, accumulate): (u64, bool),
        (rows, d): (usize, usize),
    ) -> Result<()> {
        let f = self.func(&format!("cce_split_de_finish_{}", dtype_code(out_ty)?))?;
        let rows_i = rows as i64;
        let d_i = to_i32(d, "D")?;
        let acc_i = i32::from(accumulate);
        let mut b = self.stream.launch_builder(f);
        b.arg(&tmp)
            .arg(&rs)
            .arg(&cscale)
            .arg(&de)
            .arg(&rows_i)
            .arg(&d_i)
            .arg(&acc_i);
        // SAFETY: matches DEF_PARAMS (f32*, f32*, const float*, void*, i64, i32, i32); tmp holds
        // rows·d f32 written by the GEMMs above (stream order), rs rows f32 (or 0), cscale one
        // f32 of ws.scales written before on this stream (or 0), de rows·d elements of out_ty
        // (the chunk's d_e rows; read first when accumulating, the caller's contents).
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

    /// [`DenseEngine::convert_f32`] to `dtype` (f32, f16 or bf16) for callers outside the
    /// engine. The caller guarantees `src` holds `count` f32 and `dst` `count` elements of
    /// `dtype`. Errors: `Unsupported` for another dtype; `Backend` for a failed launch.
    pub(crate) fn convert_f32_to(
        &self,
        dtype: DType,
        src: u64,
        dst: u64,
        count: usize,
    ) -> Result<()> {
        self.convert_f32(super::launch::dtype_code(dtype)?, src, dst, count)
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

kernel_params! {
    /// The parameters of `cce_split_scales_finish` (`kernels/classes.cu`): a [`ScaleSet`]'s
    /// address and the tops of `kx` and `kg`.
    ScalesFinishParams {
        set: u64,
        top_x: i32,
        top_g: i32,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `top − ⌈log2 x⌉` clamped, from f64 (exact for every f32: an independent oracle).
    fn oracle(x: f32, top: i32) -> i32 {
        if x > 0.0 && x.is_finite() {
            (top - (x as f64).log2().ceil() as i32).clamp(-100, 100)
        } else {
            0
        }
    }

    #[test]
    fn pow2_to_edges() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(2),
            f32::from_bits(3),
            f32::from_bits(0x7f_ffff),
            1.0,
            1.5,
            65504.0,
            1e-30,
            3e38,
        ];
        for e in -149..=127 {
            let p = 2f64.powi(e) as f32;
            xs.extend([p, p.next_up(), p.next_down(), 3.0 * p]);
        }
        for &x in &xs {
            for top in [14, 15, -5, 120] {
                let k = pow2_to(x, top);
                assert_eq!(
                    k,
                    oracle(x, top),
                    "pow2_to({x:e} = {:#x}, {top})",
                    x.to_bits()
                );
                if x > 0.0 && x.is_finite() && k.abs() < 100 {
                    // The defining bound, and the largest such k.
                    let scaled = x as f64 * 2f64.powi(k);
                    assert!(scaled <= 2f64.powi(top), "{x:e} {top} {k}");
                    assert!(scaled * 2.0 > 2f64.powi(top), "{x:e} {top} {k}");
                }
            }
        }
        // Exact powers of two, their neighbours, subnormals, the non-finite and zero cases.
        assert_eq!(pow2_to(1.0, 15), 15);
        assert_eq!(pow2_to(1.0f32.next_up(), 15), 14);
        assert_eq!(pow2_to(1.0f32.next_down(), 15), 15);
        assert_eq!(pow2_to(32768.0, 15), 0);
        assert_eq!(pow2_to(f32::from_bits(1), 15), 100);
        assert_eq!(pow2_to(f32::MAX, 15), -100);
        assert_eq!(pow2_to(2f32.powi(64).next_up(), 14), 14 - 65);
        for x in [0.0, -0.0, -2.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            assert_eq!(pow2_to(x, 14), 0, "{x}");
        }
    }

    #[test]
    fn pow2f_is_exact_two_to_the_k() {
        for k in -300..300 {
            let want = 2f64.powi(k) as f32;
            assert_eq!(pow2f(k).to_bits(), want.to_bits(), "2^{k}");
        }
        assert_eq!(pow2f(0), 1.0);
        assert_eq!(pow2f(-149), f32::from_bits(1));
        assert_eq!(pow2f(-150), 0.0);
        assert_eq!(pow2f(128), f32::INFINITY);
    }

    #[test]
    fn scale_sets_fit_the_region() {
        for set in [ScaleSet::CCopy, ScaleSet::ClassPass, ScaleSet::RowChunk] {
            assert_eq!(set.offset() % 4, 0);
            assert!(set.offset() + SET_WORDS * 4 <= SCALES_BYTES);
            let s = DeviceScales {
                base: 4096 + set.offset() as u64,
            };
            let words = [
                s.up_x(),
                s.down_x(),
                s.up_g(),
                s.down_g(),
                s.down_xg(),
                s.zero(),
                s.one(),
            ];
            for (i, w) in words.into_iter().enumerate() {
                assert_eq!(w, s.base + 4 * (i as u64 + 2));
            }
        }
        assert_ne!(ScaleSet::CCopy.offset(), ScaleSet::ClassPass.offset());
    }
}
