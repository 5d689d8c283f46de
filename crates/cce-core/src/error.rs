//! Typed errors. Every bad input is one of these, never a panic.

use crate::dtype::DType;

/// Result with [`CceError`].
pub type Result<T> = std::result::Result<T, CceError>;

/// Everything that can go wrong in a call, as data a caller can match on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CceError {
    /// A tensor's shape does not fit the others (e.g. `c` has a different `D` than `e`).
    #[error("shape mismatch for {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which tensor or dimension.
        what: &'static str,
        /// What the other inputs imply.
        expected: String,
        /// What was passed.
        got: String,
    },
    /// A tensor's dtype does not fit the others or is not allowed there.
    #[error("dtype mismatch for {what}: expected {expected}, got {got}")]
    DTypeMismatch {
        /// Which tensor.
        what: &'static str,
        /// Allowed dtype(s).
        expected: String,
        /// Passed dtype.
        got: DType,
    },
    /// A target is neither in `[0, V)` nor `ignore_index`.
    #[error("target out of range at row {row}: {value} is not in [0, {vocab_size}) and is not ignore_index ({ignore_index})")]
    TargetOutOfRange {
        /// Row of `targets` (before shift) holding the bad value.
        row: usize,
        /// The bad value.
        value: i64,
        /// `V`.
        vocab_size: usize,
        /// The configured ignore_index.
        ignore_index: i64,
    },
    /// A valid row whose target's logit is −inf, e.g. masked by a −inf `bias` entry (a row
    /// whose every class is masked is one): `p_y = 0`, so the loss would be infinite. Other
    /// −inf logits are valid input meaning `p = 0`.
    #[error("target masked at row {row}: the logit of target {target} is -inf (e.g. masked by the bias), so the loss would be infinite")]
    TargetMasked {
        /// Row of `e` (the logits row; under `shift` its target is read `shift` positions
        /// later in its sequence).
        row: usize,
        /// The target class.
        target: i64,
    },
    /// `Reduction::Mean` over a batch where no row has a target: every target equals
    /// `ignore_index`, or `shift` is at least the sequence length. The mean over zero valid rows
    /// is undefined, so it is an error rather than a silent 0 or NaN. `Reduction::Sum` (loss 0)
    /// and `Reduction::None` (per-row zeros) accept such a batch.
    #[error("all targets ignored: none of the {n} rows has a target (ignore_index {ignore_index}, shift {shift}), so the mean over valid rows is undefined; reduction = sum (value 0 over no rows) or none (per-row zeros) accepts such a batch")]
    AllTargetsIgnored {
        /// Rows `N`.
        n: usize,
        /// The configured ignore_index.
        ignore_index: i64,
        /// The configured shift.
        shift: usize,
    },
    /// A NaN or infinity in an input (when `Options::check_finite` is on), or in an upstream
    /// gradient of the backward: `what` is then `"d_loss"` (the scalar of a mean/sum
    /// reduction, checked always, or the per-row `[N]` values of `Reduction::None`) or
    /// `"d_lse"` (`[N]`), with `index` = `row` = the row (0 for the scalar)
    /// ([`crate::problem::check_upstream_finite`]).
    #[error("non-finite value in {what} at flat index {index} (row {row}): {value}")]
    NonFinite {
        /// Which tensor (`e`, `c`, `bias`, `lse`, `d_loss`, `d_lse`, ...).
        what: &'static str,
        /// Flat element index.
        index: usize,
        /// Row of that element (index / row length).
        row: usize,
        /// The value (NaN or ±inf).
        value: f32,
    },
    /// An input with a zero-sized dimension.
    #[error("empty input: {what} has a zero-sized dimension (shape {shape:?})")]
    EmptyInput {
        /// Which tensor.
        what: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// An option value outside its domain.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// Option name (field of `Options`).
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A size past what a backend or device supports (buffer size, grid, 32-bit indexing,
    /// workspace budget).
    #[error("resource limit exceeded: {resource} needs {requested}, the maximum is {max}")]
    ResourceLimit {
        /// What resource.
        resource: String,
        /// Requested amount (units in `resource`).
        requested: u64,
        /// Maximum.
        max: u64,
    },
    /// The device could not allocate memory.
    #[error("out of memory on {backend}: could not allocate {requested_bytes} bytes")]
    OutOfMemory {
        /// Backend name.
        backend: &'static str,
        /// Size of the failed allocation in bytes.
        requested_bytes: u64,
    },
    /// A feature this backend does not support (e.g. f16 on an adapter without SHADER_F16).
    #[error("{backend} does not support {what}")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// What is missing.
        what: String,
    },
    /// No usable device or driver library for this backend.
    #[error("no {backend} device available: {reason}")]
    NoDevice {
        /// Backend name.
        backend: &'static str,
        /// Why (library missing, no adapter, zero devices).
        reason: String,
    },
    /// A buffer passed to a backend belongs to another backend or device.
    #[error("buffer {what} does not belong to this {backend} backend")]
    ForeignBuffer {
        /// Backend name.
        backend: &'static str,
        /// Which input.
        what: &'static str,
    },
    /// Shards of a vocabulary-parallel call that do not tile the vocabulary, ranks that
    /// disagree, or a peer rank that failed or left ([`crate::vocab_parallel`]).
    #[error("vocabulary-parallel: {0}")]
    VocabParallel(#[from] crate::vocab_parallel::VocabParallelError),
    /// An error reported by the backend's runtime (driver, compiler, validation).
    #[error("{backend} error: {source}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// The runtime's own error (its message is kept verbatim).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl CceError {
    /// Wrap a backend runtime error.
    pub fn backend(
        backend: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        CceError::Backend {
            backend,
            source: source.into(),
        }
    }

    /// [`CceError::AllTargetsIgnored`] for a problem of `n` rows under `opts` (its
    /// `ignore_index` and `shift`).
    pub fn all_targets_ignored(n: usize, opts: &crate::options::Options) -> Self {
        CceError::AllTargetsIgnored {
            n,
            ignore_index: opts.ignore_index,
            shift: opts.shift,
        }
    }
}
