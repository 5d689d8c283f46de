//! The error type of every fallible function of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading, saving, generating or measuring a [`Dataset`].
///
/// No function of this crate panics on bad input: malformed files, missing tensors, wrong
/// dtypes or shapes, inconsistent sizes and impossible parameters all come back as one of
/// these variants. The variant names the tensor (by its name in the file, or by its role
/// `e`, `c`, `targets`, ... for NumPy files) so that a user can fix the input.
///
/// [`Dataset`]: crate::Dataset
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The file could not be opened, read or written (missing file, permissions, disk full).
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The file exists but is not a valid file of its format: bad or truncated header,
    /// tensor data running past the end of the file, overlapping offsets, ...
    #[error("{path}: corrupt or truncated {format} file: {reason}")]
    Corrupt {
        /// The file concerned.
        path: PathBuf,
        /// `"safetensors"` or `"npy"`.
        format: &'static str,
        /// What the parser reported.
        reason: String,
    },

    /// A required tensor is not in the file.
    #[error("tensor `{name}` not found in {path}")]
    MissingTensor {
        /// The name looked for.
        name: String,
        /// The file searched.
        path: PathBuf,
    },

    /// A tensor has a dtype that cannot be used for its role.
    #[error("tensor `{name}` has dtype {found}, expected {expected}")]
    WrongDtype {
        /// The tensor (its name in the file, or its role).
        name: String,
        /// The dtype found, as the file spells it (`"F64"`, `"<f8"`, ...).
        found: String,
        /// The dtypes accepted for this role.
        expected: &'static str,
    },

    /// A tensor has a rank or shape that cannot be used for its role, on its own (for
    /// example a rank-1 `E`, or a Q8_0 scale tensor whose block count does not fit `D`).
    #[error("tensor `{name}` has shape {found:?}, expected {expected}")]
    WrongShape {
        /// The tensor (its name in the file, or its role).
        name: String,
        /// The shape found.
        found: Vec<usize>,
        /// A description of the shapes accepted.
        expected: String,
    },

    /// Tensors that must agree in size do not (for example `E` is `[N, 576]` but `C` is
    /// `[V, 512]`, or `targets` has a length other than `N`).
    #[error("size mismatch: {detail}")]
    SizeMismatch {
        /// Which sizes disagree, with their values.
        detail: String,
    },

    /// A parameter is out of its domain (zero dimension, impossible target entropy,
    /// unparsable distribution name, duplicated tensor name, ...).
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),

    /// A buffer of this many bytes could not be allocated (or its size overflows `usize`).
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// The number of bytes requested (`usize::MAX` when the size computation overflowed).
        bytes: usize,
        /// The buffer concerned.
        what: &'static str,
    },
}

/// Shorthand for `Result<T, DataError>`.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Allocates a zero-filled vector of `len` elements, or reports [`DataError::OutOfMemory`]
/// instead of aborting the process.
pub(crate) fn try_zeroed<T: Clone + Default>(len: usize, what: &'static str) -> Result<Vec<T>> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or(DataError::OutOfMemory {
            bytes: usize::MAX,
            what,
        })?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| DataError::OutOfMemory { bytes, what })?;
    v.resize(len, T::default());
    Ok(v)
}

/// `a * b` or [`DataError::OutOfMemory`] when it overflows.
pub(crate) fn checked_len(a: usize, b: usize, what: &'static str) -> Result<usize> {
    a.checked_mul(b).ok_or(DataError::OutOfMemory {
        bytes: usize::MAX,
        what,
    })
}
