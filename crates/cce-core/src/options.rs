//! Options of a call (MATH.md, "Inputs" and "Options").

use crate::error::{CceError, Result};

/// How per-row losses are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Per-row losses `[N]` (0 at ignored rows; all zeros when no row is valid).
    None,
    /// Sum over valid rows divided by the count of valid rows. A batch with no valid row
    /// (every target `ignore_index`, or `shift` ≥ the sequence length) is an error,
    /// [`CceError::AllTargetsIgnored`]: its mean is undefined.
    #[default]
    Mean,
    /// Sum over valid rows (0, with zero gradients apart from an lse upstream gradient, when
    /// no row is valid).
    Sum,
}

impl std::str::FromStr for Reduction {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Reduction::None),
            "mean" => Ok(Reduction::Mean),
            "sum" => Ok(Reduction::Sum),
            o => Err(format!("unknown reduction '{o}' (none, mean, sum)")),
        }
    }
}

/// Which entries of the gradient may be skipped (CCE's `filter_eps`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum FilterEps {
    /// Machine epsilon of the input dtype / 32 (2⁻¹² bf16, 2⁻¹⁵ f16, 2⁻²⁸ f32).
    #[default]
    Auto,
    /// Entries with `|p − onehot| < value` may be skipped. Must be finite and in `(0, 1]`.
    Value(f32),
    /// No filtering: the exact gradient.
    Off,
}

impl std::str::FromStr for FilterEps {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(FilterEps::Auto),
            "off" | "none" | "exact" => Ok(FilterEps::Off),
            v => v
                .parse::<f32>()
                .map(FilterEps::Value)
                .map_err(|_| format!("filter_eps '{v}': expected auto, off or a number")),
        }
    }
}

/// dtype of the returned gradients.
///
/// # Accuracy of f32 gradients from 16-bit inputs
///
/// `F32` sets the dtype of the *outputs*, not the arithmetic. With bf16/f16 inputs the CUDA
/// backend computes `d_e = G·C` and `d_c = Gᵀ·E` as tensor-core products whose operands are
/// 16-bit: `G` is rounded to bf16 or f16 (with a power-of-two scale) before the product, and
/// only the f32 accumulators are returned unrounded. Against the f32-exact gradient of the same
/// inputs, such `d_e` are off by 5e-4 to 2.7e-3 (relative, measured on an H200), where the CPU
/// backend, which forms `G` and both products in f32, is off by ~4e-7. The wgpu backend also
/// keeps `G` in f32. So on CUDA `F32` avoids the final rounding of the gradients to the input
/// dtype (and f16's overflow past 65504), but is not f32-accurate.
///
/// For f32-accurate gradients on CUDA pass f32 inputs (`e`, `c`, `bias` widened from bf16/f16:
/// exact, the same model). Then `G` stays f32 and every product runs in f32 on the CUDA cores
/// (cuBLAS `CUBLAS_COMPUTE_32F` with FMA, and f32 FMA in the custom kernels; never TF32, whose
/// 10-bit significand would be no more accurate than a 16-bit `G`). The cost: the inputs take
/// twice the memory and bandwidth, the logits workspace holds f32 `G`, and the GEMMs, most of
/// the time of a call, run at the f32 FMA rate, about 1/15 of the dense bf16 tensor-core rate
/// on an H100/H200 (67 vs 989 TFLOP/s peak): expect a call several to ~15 times slower, and
/// measure it at your shape (`cce run --dtype f32 --backend cuda` prints the times).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradDType {
    /// Same dtype as `e`/`c` (accumulated in f32, rounded once at the end).
    #[default]
    Input,
    /// f32 outputs (accumulated in f32, not rounded at the end). With bf16/f16 inputs the CUDA
    /// products still read a 16-bit `G`: see the type's docs for the accuracy and for the
    /// f32-accurate alternative.
    F32,
}

/// Optional per-row side outputs of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SideOutputs {
    /// Softmax entropy per row, `[N]` f32, nats (`lse_i − Σ_j p_ij z_ij`).
    pub entropy: bool,
    /// Index of the largest logit per row, `[N]` i32 (lowest index on ties).
    pub argmax: bool,
}

/// Everything that configures a call besides the tensors. `Options::default()` is the
/// recommended setting: mean reduction, filtered backward with `filter_eps = Auto` and a per-row
/// dropped-mass bound of 1e-3, 512 MiB workspace budget.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Targets equal to this are ignored (loss 0, gradient 0). Default -100.
    pub ignore_index: i64,
    /// Softcap `s`: `z = s·tanh(x/s)`. Must be finite and > 0 when set.
    pub softcap: Option<f32>,
    /// Loss reduction. Default mean.
    pub reduction: Reduction,
    /// Row `(b, t)` of `e` is paired with target `(b, t + shift)`; the last `shift` rows of each
    /// sequence are ignored. Default 0.
    pub shift: usize,
    /// Rows per sequence for `shift` (`N` must be a multiple). `None`: all `N` rows are one
    /// sequence.
    pub seq_len: Option<usize>,
    /// Label smoothing `α` in `[0, 1)`.
    pub label_smoothing: f32,
    /// z-loss weight `λ ≥ 0` (adds `λ lse²` per valid row).
    pub z_loss: f32,
    /// Which gradient entries may be skipped.
    pub filter_eps: FilterEps,
    /// Per-row bound `δ` on the total probability of skipped entries, in `[0, 1]`. Default 1e-3
    /// (MATH.md: d_e 0.10%, d_c 0.02% relative error on real data, better than the original's
    /// default tile filter).
    pub max_dropped_mass: f32,
    /// Apply the filter to `d_e` (else `d_e` is exact).
    pub filter_e_grad: bool,
    /// Apply the filter to `d_c` and `d_bias` (else they are exact).
    pub filter_c_grad: bool,
    /// Bitwise-repeatable results (fixed reduction order) even at some speed cost.
    pub deterministic: bool,
    /// Extra device memory the call may use beyond inputs and outputs, in bytes. Default 512 MiB.
    pub workspace_budget_bytes: u64,
    /// Side outputs of the forward pass.
    pub side_outputs: SideOutputs,
    /// Reject NaN/Inf in inputs with `CceError::NonFinite` (checked through the lse of every
    /// row, so it costs no extra pass unless a value is bad), and in the backward's per-row
    /// upstream gradients `d_loss` and `d_lse` (`4N` bytes read back on a GPU). The CPU and
    /// wgpu backwards also check the `Saved` lse and rest mass they are given
    /// ([`crate::problem::check_saved_finite`]; `8N` bytes read back on wgpu). A non-finite
    /// scalar `d_loss` is an error whatever this says.
    pub check_finite: bool,
    /// dtype of the gradients.
    pub grad_dtype: GradDType,
    /// Compute `d_e` in the backward.
    pub compute_d_e: bool,
    /// Compute `d_c` (and `d_bias` when a bias is given) in the backward.
    pub compute_d_c: bool,
}

/// Default workspace budget: 512 MiB.
pub const DEFAULT_WORKSPACE_BUDGET_BYTES: u64 = 512 << 20;

/// Default per-row dropped-mass bound.
pub const DEFAULT_MAX_DROPPED_MASS: f32 = 1e-3;

impl Default for Options {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            softcap: None,
            reduction: Reduction::Mean,
            shift: 0,
            seq_len: None,
            label_smoothing: 0.0,
            z_loss: 0.0,
            filter_eps: FilterEps::Auto,
            max_dropped_mass: DEFAULT_MAX_DROPPED_MASS,
            filter_e_grad: true,
            filter_c_grad: true,
            deterministic: false,
            workspace_budget_bytes: DEFAULT_WORKSPACE_BUDGET_BYTES,
            side_outputs: SideOutputs::default(),
            check_finite: true,
            grad_dtype: GradDType::Input,
            compute_d_e: true,
            compute_d_c: true,
        }
    }
}

impl Options {
    /// Exact mode: the default with `filter_eps = Off`.
    pub fn exact() -> Self {
        Self {
            filter_eps: FilterEps::Off,
            ..Self::default()
        }
    }

    /// Check every option's domain. Errors: `InvalidOption` naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |name: &'static str, reason: String| Err(CceError::InvalidOption { name, reason });
        if let Some(s) = self.softcap {
            if !(s.is_finite() && s > 0.0) {
                return bad("softcap", format!("must be finite and > 0, got {s}"));
            }
        }
        if !(self.label_smoothing.is_finite() && (0.0..1.0).contains(&self.label_smoothing)) {
            return bad(
                "label_smoothing",
                format!("must be in [0, 1), got {}", self.label_smoothing),
            );
        }
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return bad(
                "z_loss",
                format!("must be finite and >= 0, got {}", self.z_loss),
            );
        }
        if let FilterEps::Value(v) = self.filter_eps {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return bad("filter_eps", format!("must be in (0, 1], got {v}"));
            }
        }
        if !(self.max_dropped_mass.is_finite() && (0.0..=1.0).contains(&self.max_dropped_mass)) {
            return bad(
                "max_dropped_mass",
                format!("must be in [0, 1], got {}", self.max_dropped_mass),
            );
        }
        if self.seq_len == Some(0) {
            return bad("seq_len", "must be >= 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_filtered() {
        let o = Options::default();
        o.validate().unwrap();
        assert_eq!(o.filter_eps, FilterEps::Auto);
        assert_eq!(o.reduction, Reduction::Mean);
        assert_eq!(o.ignore_index, -100);
    }

    #[test]
    fn each_bad_option_is_named() {
        let cases: Vec<(Options, &str)> = vec![
            (
                Options {
                    softcap: Some(0.0),
                    ..Default::default()
                },
                "softcap",
            ),
            (
                Options {
                    softcap: Some(f32::NAN),
                    ..Default::default()
                },
                "softcap",
            ),
            (
                Options {
                    label_smoothing: 1.0,
                    ..Default::default()
                },
                "label_smoothing",
            ),
            (
                Options {
                    z_loss: -1.0,
                    ..Default::default()
                },
                "z_loss",
            ),
            (
                Options {
                    filter_eps: FilterEps::Value(0.0),
                    ..Default::default()
                },
                "filter_eps",
            ),
            (
                Options {
                    max_dropped_mass: 2.0,
                    ..Default::default()
                },
                "max_dropped_mass",
            ),
            (
                Options {
                    seq_len: Some(0),
                    ..Default::default()
                },
                "seq_len",
            ),
        ];
        for (o, name) in cases {
            match o.validate() {
                Err(CceError::InvalidOption { name: n, .. }) => assert_eq!(n, name),
                other => panic!("expected InvalidOption({name}), got {other:?}"),
            }
        }
    }
}
