//! Which paths a call takes, decided from plain data: no CUDA call in this module.

use super::*;

impl DenseEngine {
    /// Why the WGMMA kernels (`kernels/wgmma.cu`) cannot run `cfg` with inputs at `e`, `c`
    /// over `cols` classes per launch, for the conditions every one of them shares; `None` when
    /// they hold. `on`: the caller's switch (config and environment).
    pub(super) fn wgmma_unfit(
        &self,
        cfg: &DenseConfig,
        on: bool,
        (e, c): (u64, u64),
        cols: usize,
    ) -> Option<&'static str> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        Some(if !on {
            "switched off"
        } else if !self.wgmma {
            "not compute capability 9.0"
        } else if !matches!(cfg.dtype, DType::BF16 | DType::F16) {
            "dtype not bf16 / f16"
        } else if cfg.softcap.is_some_and(|s| s > WGMMA_SOFTCAP_MAX) {
            "softcap above 100 (the epilogue's tanh is exact to ~s·2⁻²¹)"
        } else if n == 0 || v == 0 || d == 0 {
            "an empty dimension"
        } else if !d.is_multiple_of(WGMMA_BK) {
            "D not a multiple of 64"
        } else if !e.is_multiple_of(16) || !c.is_multiple_of(16) {
            "inputs not 16-byte aligned"
        } else if i32::try_from(n.div_ceil(WGMMA_BM) * cols.div_ceil(WGMMA_BN)).is_err()
            || i32::try_from(d).is_err()
            || i32::try_from(v).is_err()
        {
            "sizes past 32 bits"
        } else {
            return None;
        })
    }

    /// Rows per row group of the fused WGMMA forward (`kernels/wgmma.cu`) for `cfg`, with
    /// `scratch_bytes` of scratch for the float2 partials (`rows x ceil(V / 256)`; all `N` rows
    /// when they fit, else the most multiples of 128 that do), and `e`, `c` the device
    /// addresses of the inputs. `Err(why)` when it does not apply: switched off
    /// ([`DenseConfig::wgmma_forward`]), not compute capability 9.0,
    /// not bf16 / f16, a softcap above [`WGMMA_SOFTCAP_MAX`], label smoothing, entropy or
    /// argmax, `D` not a multiple of 64, inputs not 16-byte aligned, sizes past 32 bits, or less
    /// scratch than 128 rows need (`wgmma_unfit` holds the shared conditions).
    pub fn wgmma_forward_rows(
        &self,
        cfg: &DenseConfig,
        scratch_bytes: usize,
        (e, c): (u64, u64),
    ) -> std::result::Result<usize, String> {
        let (n, v) = (cfg.n, cfg.v);
        let why = if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_forward, (e, c), v) {
            why
        } else if cfg.label_smoothing != 0.0 {
            "label smoothing"
        } else if cfg.want_entropy || cfg.want_argmax {
            "entropy / argmax requested"
        } else {
            let fit = scratch_bytes / (v.div_ceil(WGMMA_BN) * 8);
            let group = if fit >= n {
                n
            } else {
                fit / WGMMA_BM * WGMMA_BM
            };
            if group > 0 && i32::try_from(group).is_ok() {
                return Ok(group);
            }
            "scratch holds the partials of fewer than 128 rows"
        };
        Err(why.to_string())
    }

    /// Why split dense's row pass cannot take the WGMMA epilogue (`cce_wgmma_lseq*` and
    /// `cce_wgmma_qrows_g*`, [`DenseConfig::wgmma_rows`]) for `cfg` with inputs at `e`, `c`
    /// and the row pass's `G` mode `g_mode`; `None` when it can. Besides `wgmma_unfit`'s
    /// conditions: bf16 inputs only (f16 `G` would round twice), `G` in the input dtype
    /// (`g_mode` 0: not the f16 `G` of a budget with an f16 copy of `c`), no label smoothing
    /// (the combine has no `Σz`), no entropy or argmax, and at most 65535·8 class tiles (the
    /// `G` pass's grid). The caller checks the mode (forward and backward in one call).
    pub fn wgmma_rows_unfit(
        &self,
        cfg: &DenseConfig,
        g_mode: u8,
        (e, c): (u64, u64),
    ) -> Option<&'static str> {
        if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_rows, (e, c), cfg.v) {
            return Some(why);
        }
        Some(if cfg.dtype != DType::BF16 {
            "f16 inputs (f16 G from f16 e^(z - max) would round twice)"
        } else if cfg.softcap.is_some_and(|s| s < WGMMA_ROWS_SOFTCAP_MIN) {
            "softcap under 1 (the G pass's softcap factor comes from the f16 e^(z - max), which \
             loses its relative accuracy where |x| is many times the cap)"
        } else if g_mode != 0 {
            "f16 G for d_e (the budget's f16 copy of c)"
        } else if cfg.label_smoothing != 0.0 {
            "label smoothing"
        } else if cfg.want_entropy || cfg.want_argmax {
            "entropy / argmax requested"
        } else if cfg.v.div_ceil(WGMMA_BN).div_ceil(8) > 65535 {
            "V past the G pass's grid"
        } else {
            return None;
        })
    }

    /// Chunks of split dense's class pass through the WGMMA `G` epilogue
    /// (`cce_wgmma_gcols[_cap]_*`) in a scratch buffer of `scratch` bytes (the workspace's,
    /// [`DenseConfig::scratch_bytes`]): its layout, [`DenseConfig::gcols_layout`] (the f16
    /// `G` of up to `classes` classes at byte 0, the f16 copy of `e` and the f32 `d_c` temp of
    /// `dc_classes` classes at the end). `e`, `c`: the device addresses of the inputs. `Err`
    /// says why the epilogue does not apply: switched off ([`DenseConfig::wgmma_gcols`]), not
    /// compute capability 9.0, f32 inputs, a softcap above
    /// [`WGMMA_SOFTCAP_MAX`], an empty dimension, `D` not a multiple of 64, unaligned inputs or
    /// sizes past 32 bits (the tile count of a chunk included), a scratch too small for the
    /// layout, chunks under one 256-class tile. (No `τ`: split dense's row pass never filters,
    /// so `τ = 0`.)
    pub fn wgmma_gcols_classes(
        &self,
        cfg: &DenseConfig,
        scratch: usize,
        (e, c): (u64, u64),
    ) -> std::result::Result<GColsLayout, String> {
        let (n, v) = (cfg.n, cfg.v);
        let layout = cfg.gcols_layout(scratch);
        let kw = layout.map_or(0, |l| l.classes);
        let why = if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_gcols, (e, c), kw) {
            why
        } else if i32::try_from(n).is_err() {
            "sizes past 32 bits"
        } else if let Some(l) = layout {
            if kw < v && kw < WGMMA_BN {
                "class chunk under one 256-class tile"
            } else {
                return Ok(l);
            }
        } else {
            "scratch too small for the G chunk, the f16 copy of e and the d_c temp"
        };
        Err(why.to_string())
    }

    /// Cluster size and slice (columns per block) of the fused kernel, or `None` when it does
    /// not apply (not Hopper, or the row does not fit 16 blocks' shared memory).
    pub fn fused_layout(&self, cfg: &DenseConfig) -> Option<(usize, usize)> {
        let RowPass::Fused { cluster } = cfg.row_pass else {
            return None;
        };
        if !self.funcs.contains_key("cce_dense_fused_f32_c1") {
            return None;
        }
        let max_dyn = self.max_smem_optin.saturating_sub(self.fused_static_smem);
        let slice_of = |cs: usize| cfg.v.div_ceil(cs).div_ceil(4) * 4;
        let fits = |cs: usize| slice_of(cs) * 4 <= max_dyn;
        let cs = match cluster {
            Some(cs) if CLUSTER_SIZES.contains(&cs) && fits(cs) => cs,
            Some(_) => return None,
            None => {
                let want = CLUSTER_SIZES
                    .iter()
                    .copied()
                    .find(|&cs| slice_of(cs) * 4 <= FUSED_TARGET_SMEM_BYTES);
                match want {
                    Some(cs) => cs,
                    None => CLUSTER_SIZES.iter().copied().find(|&cs| fits(cs))?,
                }
            }
        };
        Some((cs, slice_of(cs)))
    }
}
