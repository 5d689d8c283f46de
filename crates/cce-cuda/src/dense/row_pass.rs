//! The row kernels (`kernels/forward.cu` (2), `kernels/rows.cu`): the forward rows, `G` in
//! place, the target's entry of a 16-bit `G`, the per-row arguments they share.

use super::*;

/// Threads per block of the kernels (must match the `#define`s in `chunked.cu`).
pub(super) const FWD_THREADS: u32 = 256;

pub(super) const BWD_THREADS: u32 = 512;

pub(super) const FUSED_THREADS: u32 = 512;

pub(super) const COLSUM_THREADS: u32 = 256;

/// Threads (one warp per row) of `cce_dense_target_fix_*`.
pub(super) const TFIX_THREADS: u32 = 256;

/// Dynamic shared memory per block the automatic cluster choice aims at: two blocks of 512
/// threads per SM, so that one block loads while the other computes or writes.
pub(super) const FUSED_TARGET_SMEM_BYTES: usize = 100 << 10;

/// Per-row arrays and scalars the row kernels share (device addresses of `[N]` arrays, 0 =
/// absent; kernels get them offset to their chunk).
#[derive(Clone, Copy)]
pub(super) struct RowArgs {
    pub(super) ld: i64,
    pub(super) v: i32,
    pub(super) bias: u64,
    pub(super) softcap: f32,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) targets: u64,
    /// Forward outputs: f32 lse, f32 `1 − p_y`, f32 per-row loss, entropy, argmax.
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) loss_rows: u64,
    pub(super) entropy: u64,
    pub(super) argmax: u64,
}

impl RowArgs {
    /// The per-row arrays (targets, lse, rest, loss, entropy, argmax) offset to row `r0`
    /// (absent ones stay 0).
    pub(super) fn rows_at(&self, r0: usize) -> (u64, u64, u64, u64, u64, u64) {
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        (
            at(self.targets),
            at(self.lse),
            at(self.rest),
            at(self.loss_rows),
            at(self.entropy),
            at(self.argmax),
        )
    }
}

impl DenseEngine {
    /// Step (2), the forward row kernel, for rows `r0..r0 + rows` of logits at `l_ptr`.
    pub(super) fn fwd_rows(
        &self,
        f: &CudaFunction,
        a: &RowArgs,
        r0: usize,
        rows: usize,
        l_ptr: u64,
    ) -> Result<()> {
        let (t_r, lse_r, rest_r, loss_r, ent_r, am_r) = a.rows_at(r0);
        let cfg_l = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (FWD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&l_ptr)
            .arg(&a.ld)
            .arg(&a.v)
            .arg(&a.bias)
            .arg(&a.softcap)
            .arg(&t_r)
            .arg(&a.alpha)
            .arg(&a.lambda)
            .arg(&lse_r)
            .arg(&rest_r)
            .arg(&loss_r)
            .arg(&ent_r)
            .arg(&am_r);
        // SAFETY: argument types and order match FWD_PARAMS; L holds rows x ld f32 written by
        // the logits GEMM before this launch (stream order); the [N] outputs (checked sizes)
        // are offset to the chunk and hold its rows.
        unsafe { b.launch(cfg_l) }.map_err(drv)?;
        Ok(())
    }

    /// Step (4'), `cce_dense_target_fix_*` for rows `rows` of a chunk whose 16-bit `G` (`g16`:
    /// 1 f16, 2 bf16; row stride `g_ld` elements; stored times `1 / row_scale` when `rs` ≠ 0)
    /// the d_e product has read: adds the rounding residual of each row's target entry times
    /// `c_y` to the chunk's `d_e` rows (`d_e`, in `out_ty`). The per-row arrays are offset to
    /// the chunk; `e_r` is the chunk's first row of `e`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn target_fix(
        &self,
        code: &str,
        (g, g_ld, g16, rs): (u64, usize, i32, u64),
        (rows, t_r, lse_r, rest_r): (usize, u64, u64, u64),
        (dl_r, dl_scalar, dlse_r): (u64, f32, u64),
        (alpha, lambda, v_i, softcap, bias): (f32, f32, i32, f32, u64),
        (e_r, c, d): (u64, u64, usize),
        (d_e, out_ty): (u64, DType),
    ) -> Result<()> {
        let f = self.func(&format!("cce_dense_target_fix_{code}"))?;
        let out_kind: i32 = match out_ty {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let (g_ld_i, rows_i, d_i) = (g_ld as i64, to_i32(rows, "rows")?, to_i32(d, "D")?);
        let per_block = TFIX_THREADS as usize / 32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&g)
            .arg(&g_ld_i)
            .arg(&g16)
            .arg(&rs)
            .arg(&t_r)
            .arg(&lse_r)
            .arg(&rest_r)
            .arg(&dl_r)
            .arg(&dl_scalar)
            .arg(&dlse_r)
            .arg(&alpha)
            .arg(&lambda)
            .arg(&v_i)
            .arg(&softcap)
            .arg(&bias)
            .arg(&e_r)
            .arg(&c)
            .arg(&d_i)
            .arg(&d_e)
            .arg(&out_kind)
            .arg(&rows_i);
        // SAFETY: argument types and order match TFIX_PARAMS in chunked.cu; G holds `rows` rows
        // of `g_ld` 16-bit values (the chunk's G, written by the row kernels and read by the d_e
        // product before this launch, stream order; targets < V ≤ g_ld); row_scale 0 or `rows`
        // f32; the per-row arrays and e_r hold the chunk's rows ([N] buffers checked by `run`,
        // offset to the chunk); c V x D and bias V values of the input dtype; d_e holds the
        // chunk's rows x D in out_ty; one warp per row < rows.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows.div_ceil(per_block) as u32, 1, 1),
                block_dim: (TFIX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }
}
