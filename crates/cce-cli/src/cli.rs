//! Command-line definitions (clap derive): `cce run` and `cce repro`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use cut_cross_entropy::{
    DType, FilterEps, GradDType, Options, Reduction, SideOutputs, BACKEND_NAMES,
};

/// `cce`: cut cross-entropy (the loss of a language model's output layer and its gradients,
/// computed without the N x V logits) on real or generated data.
#[derive(Debug, Parser)]
#[command(name = "cce", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// One forward (and backward) call on a file, a generated case or, by default, the shipped
    /// real fixture (SmolLM2-135M on real text): loss, lse, times, memory, call statistics.
    Run(Box<RunArgs>),
    /// The seed's experiment: regular (randn), c/8, e/8, c*8, e*8 and lm inputs on one backend;
    /// time, ratio to regular, mean softmax entropy and filter statistics per case.
    Repro(Box<ReproArgs>),
}

/// Float dtype the inputs are converted to before the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FloatDType {
    /// IEEE binary32 (exact for every loaded file: bf16/f16 widen exactly, Q8_0 decodes
    /// exactly).
    F32,
    /// IEEE binary16 (round to nearest even).
    F16,
    /// bfloat16 (round to nearest even).
    Bf16,
}

impl FloatDType {
    /// The core dtype.
    pub fn dtype(self) -> DType {
        match self {
            FloatDType::F32 => DType::F32,
            FloatDType::F16 => DType::F16,
            FloatDType::Bf16 => DType::BF16,
        }
    }
}

/// dtype of the returned gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GradDTypeArg {
    /// Same dtype as the inputs.
    Input,
    /// f32.
    F32,
}

/// Where the problem comes from. With none of `--input`, `--npy-*`, `--case`, the shipped
/// real fixture is used.
#[derive(Debug, Args)]
pub struct InputArgs {
    /// safetensors file to read (tensor names below). Default: the shipped real fixture
    /// data/smollm2_lce_real_1k.safetensors.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["case", "npy_e"], help_heading = "Input")]
    pub input: Option<PathBuf>,
    /// Name of the hidden states tensor `[..., D]` (bf16, f16, f32).
    #[arg(long, default_value = "E", value_name = "NAME", help_heading = "Input")]
    pub e_name: String,
    /// Name of the classifier tensor `[V, D]` (bf16, f16, f32), default `C`; if not given and
    /// `C` is absent, the Q8_0 pair below. A name given here must exist.
    #[arg(long, value_name = "NAME", help_heading = "Input")]
    pub c_name: Option<String>,
    /// Name of the Q8_0 classifier codes (i8 `[V, D]`).
    #[arg(
        long,
        default_value = "C_q8",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub c_q8_name: String,
    /// Name of the Q8_0 classifier scales (f16 `[V, ceil(D/32)]`).
    #[arg(
        long,
        default_value = "C_scale",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub c_scale_name: String,
    /// Name of the optional bias `[V]` (read when present).
    #[arg(
        long,
        default_value = "bias",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub bias_name: String,
    /// Name of the targets tensor (i32 or i64, N elements).
    #[arg(
        long,
        default_value = "targets",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub targets_name: String,
    /// Name of the optional reference lse `[N]` (read when present).
    #[arg(
        long,
        default_value = "lse_ref",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub lse_ref_name: String,
    /// Name of the optional reference per-row loss `[N]` (read when present).
    #[arg(
        long,
        default_value = "nll_ref",
        value_name = "NAME",
        help_heading = "Input"
    )]
    pub nll_ref_name: String,
    /// NumPy file of the hidden states `[..., D]` (float32/float16).
    #[arg(long, value_name = "FILE", requires_all = ["npy_c", "npy_targets"], conflicts_with = "case", help_heading = "Input")]
    pub npy_e: Option<PathBuf>,
    /// NumPy file of the classifier `[V, D]`.
    #[arg(long, value_name = "FILE", requires = "npy_e", help_heading = "Input")]
    pub npy_c: Option<PathBuf>,
    /// NumPy file of the targets (int32/int64, N elements).
    #[arg(long, value_name = "FILE", requires = "npy_e", help_heading = "Input")]
    pub npy_targets: Option<PathBuf>,
    /// NumPy file of an optional bias `[V]`.
    #[arg(long, value_name = "FILE", requires = "npy_e", help_heading = "Input")]
    pub npy_bias: Option<PathBuf>,
    /// A named case instead of a file: randn, c/8, e/8, c*8, e*8, iid, iid:H, lm, lm:small,
    /// lm:large, or real (the shipped fixture).
    #[arg(long, value_name = "CASE", help_heading = "Input")]
    pub case: Option<String>,
    /// Rows: for a generated case its N (default 1024); for a file or `real`, use only the
    /// first N rows.
    #[arg(long, help_heading = "Input")]
    pub n: Option<usize>,
    /// Hidden size of a generated case (default 576).
    #[arg(long, requires = "case", help_heading = "Input")]
    pub d: Option<usize>,
    /// Vocabulary size of a generated case (default 49152).
    #[arg(long, requires = "case", help_heading = "Input")]
    pub v: Option<usize>,
    /// Seed of a generated case (default 0). Real data (a file, NumPy files, `--case real`)
    /// has nothing to seed: --seed is refused there, like --d and --v.
    #[arg(long, requires = "case", help_heading = "Input")]
    pub seed: Option<u64>,
}

/// The options of the contract (`cce_core::Options`), as flags.
#[derive(Debug, Args)]
pub struct OptionArgs {
    /// Softcap s: z = s·tanh(x/s) (finite, > 0).
    #[arg(long, allow_negative_numbers = true, help_heading = "Options")]
    pub softcap: Option<f32>,
    /// Loss reduction: mean, sum or none. A mean over no valid row (every target ignored, or
    /// --shift at least the sequence length) is an error; sum and none accept it (zeros).
    #[arg(long, default_value = "mean", help_heading = "Options")]
    pub reduction: Reduction,
    /// Row t of a sequence is paired with target t + shift (the last `shift` rows of each
    /// sequence are ignored).
    #[arg(long, default_value_t = 0, help_heading = "Options")]
    pub shift: usize,
    /// Rows per sequence for --shift (N must be a multiple); default: one sequence.
    #[arg(long, help_heading = "Options")]
    pub seq_len: Option<usize>,
    /// Label smoothing α in [0, 1).
    #[arg(
        long,
        default_value_t = 0.0,
        allow_negative_numbers = true,
        help_heading = "Options"
    )]
    pub label_smoothing: f32,
    /// z-loss weight λ ≥ 0 (adds λ·lse² per valid row).
    #[arg(
        long,
        default_value_t = 0.0,
        allow_negative_numbers = true,
        help_heading = "Options"
    )]
    pub z_loss: f32,
    /// Gradient filter threshold: auto (dtype eps / 32), off (exact), or a value in (0, 1].
    #[arg(
        long,
        default_value = "auto",
        allow_hyphen_values = true,
        help_heading = "Options"
    )]
    pub filter_eps: FilterEps,
    /// Per-row bound on the probability mass the filter may drop, in [0, 1].
    #[arg(long, default_value_t = cut_cross_entropy::options::DEFAULT_MAX_DROPPED_MASS, allow_negative_numbers = true, help_heading = "Options")]
    pub max_dropped_mass: f32,
    /// Do not filter d_e (it is exact).
    #[arg(long, help_heading = "Options")]
    pub no_filter_e_grad: bool,
    /// Do not filter d_c and d_bias (they are exact).
    #[arg(long, help_heading = "Options")]
    pub no_filter_c_grad: bool,
    /// Bitwise-repeatable results (fixed reduction order).
    #[arg(long, help_heading = "Options")]
    pub deterministic: bool,
    /// Extra device memory the call may use, MiB.
    #[arg(
        long,
        default_value_t = 512,
        value_name = "MIB",
        help_heading = "Options"
    )]
    pub workspace_budget_mib: u64,
    /// Also compute the softmax entropy per row.
    #[arg(long, help_heading = "Options")]
    pub entropy: bool,
    /// Also compute the argmax per row (and the top-1 accuracy).
    #[arg(long, help_heading = "Options")]
    pub argmax: bool,
    /// Targets equal to this are ignored.
    #[arg(long, default_value_t = -100, allow_negative_numbers = true, help_heading = "Options")]
    pub ignore_index: i64,
    /// dtype of the gradients: input (the inputs' dtype) or f32. With bf16/f16 inputs, f32
    /// gradients on cuda are f32 outputs of tensor-core products of a 16-bit G (d_e 5e-4 to
    /// 2.7e-3 off the f32-exact value); --dtype f32 gives f32-accurate gradients at the f32
    /// FMA rate (several to ~15x slower; see cce_core::GradDType).
    #[arg(long, value_enum, default_value = "input", help_heading = "Options")]
    pub grad_dtype: GradDTypeArg,
    /// Do not reject NaN/Inf inputs.
    #[arg(long, help_heading = "Options")]
    pub no_check_finite: bool,
    /// Skip d_e in the backward.
    #[arg(long, help_heading = "Options")]
    pub no_d_e: bool,
    /// Skip d_c (and d_bias) in the backward.
    #[arg(long, help_heading = "Options")]
    pub no_d_c: bool,
    /// Forward only.
    #[arg(long, help_heading = "Options")]
    pub no_backward: bool,
}

impl OptionArgs {
    /// The options these flags describe (not yet validated).
    pub fn options(&self) -> Options {
        Options {
            ignore_index: self.ignore_index,
            softcap: self.softcap,
            reduction: self.reduction,
            shift: self.shift,
            seq_len: self.seq_len,
            label_smoothing: self.label_smoothing,
            z_loss: self.z_loss,
            filter_eps: self.filter_eps,
            max_dropped_mass: self.max_dropped_mass,
            filter_e_grad: !self.no_filter_e_grad,
            filter_c_grad: !self.no_filter_c_grad,
            deterministic: self.deterministic,
            workspace_budget_bytes: self.workspace_budget_mib.saturating_mul(1 << 20),
            side_outputs: SideOutputs {
                entropy: self.entropy,
                argmax: self.argmax,
            },
            check_finite: !self.no_check_finite,
            grad_dtype: match self.grad_dtype {
                GradDTypeArg::Input => GradDType::Input,
                GradDTypeArg::F32 => GradDType::F32,
            },
            compute_d_e: !self.no_d_e,
            compute_d_c: !self.no_d_c,
        }
    }
}

/// Arguments of `cce run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Input selection.
    #[command(flatten)]
    pub input: InputArgs,
    /// Backend: cpu, wgpu, cuda (when built with the feature and a device is present) or auto
    /// (the first of cuda, wgpu, cpu that is built and present). The report's backend line
    /// names the wgpu adapter and flags a CPU one (lavapipe: a software Vulkan driver, CPU
    /// speed), which auto also picks on a machine without a GPU.
    #[arg(long, default_value = "cpu", value_parser = clap::builder::PossibleValuesParser::new(BACKEND_NAMES))]
    pub backend: String,
    /// Split the vocabulary over K ranks simulated as threads (`--backend cpu` only): each rank
    /// computes its shard's partial forward and gradients, one all-gather merges the rows, an
    /// all-reduce sums d_e; the outputs are the whole call's (the vocabulary-parallel
    /// primitives of a tensor-parallel group, checked here on one machine).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub vocab_parallel: Option<u16>,
    /// dtype of e, c and bias for the call. Default: the file's when e and c share a float
    /// dtype, else f32 (the real fixture: f32, which keeps its Q8_0 head exact).
    #[arg(long, value_enum)]
    pub dtype: Option<FloatDType>,
    /// Options of the call.
    #[command(flatten)]
    pub opts: OptionArgs,
    /// Compare every output with the f64 naive oracle (materializes N x V f64 logits), print
    /// the errors and judge each output: its judged error must stay within the tolerance the
    /// table prints (the dtype's 1e-5 / 1e-3 / 1e-2, grown for long sums and large logits,
    /// plus what the gradient filter skipped). Any output outside it, or not finite: the run
    /// ends with `error: --check: ...` and exit status 1 (after --save-grads is written).
    #[arg(long)]
    pub check: bool,
    /// Write d_e, d_c (and d_bias) as f32 safetensors to FILE.
    #[arg(long, value_name = "FILE", conflicts_with = "no_backward")]
    pub save_grads: Option<PathBuf>,
}

/// Arguments of `cce repro`.
#[derive(Debug, Args)]
pub struct ReproArgs {
    /// Rows.
    #[arg(long, default_value_t = 256)]
    pub n: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 128)]
    pub d: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 8192)]
    pub v: usize,
    /// Backend: cpu, wgpu, cuda or auto.
    #[arg(long, default_value = "cpu", value_parser = clap::builder::PossibleValuesParser::new(BACKEND_NAMES))]
    pub backend: String,
    /// Seed of the base inputs (every scaled case uses the same e and c before scaling).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// dtype of the inputs (the seed's experiment is bf16; its filter threshold is 2^-12).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: FloatDType,
    /// Timed runs per case (after one warm-up run); the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Cases, comma-separated: regular (= randn), c/8, e/8, c*8, e*8, lm, iid, iid:H.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "regular,c/8,e/8,c*8,e*8,lm"
    )]
    pub cases: Vec<String>,
    /// Gradient filter threshold: auto, off or a value in (0, 1].
    #[arg(long, default_value = "auto", allow_hyphen_values = true)]
    pub filter_eps: FilterEps,
    /// Per-row bound on the probability mass the filter may drop.
    #[arg(long, default_value_t = cut_cross_entropy::options::DEFAULT_MAX_DROPPED_MASS, allow_negative_numbers = true)]
    pub max_dropped_mass: f32,
    /// Extra device memory the call may use, MiB.
    #[arg(long, default_value_t = 512, value_name = "MIB")]
    pub workspace_budget_mib: u64,
    /// Draw time and kept fraction against mean entropy into this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}
