//! NumPy `.npy` loading (one file per tensor), through the `npyz` crate.

use std::path::{Path, PathBuf};

use npyz::{DType, NpyFile, Order, TypeChar};

use crate::dataset::Dataset;
use crate::error::{DataError, Result};

/// Paths of the `.npy` files making up one dataset (one array per file).
///
/// Accepted contents (little- or big-endian, C or Fortran order):
/// - `e`: float32 or float16, shape `[..., D]` (leading dimensions flattened into `N`);
/// - `c`: float32 or float16, shape `[V, D]`;
/// - `targets`: int32 or int64, `N` elements (any shape);
/// - `bias` (optional): float32 or float16, shape `[V]`.
///
/// float64 is refused (its values are not exact in f32): convert with `astype(np.float32)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyPaths {
    /// Hidden states.
    pub e: PathBuf,
    /// Classifier.
    pub c: PathBuf,
    /// Target classes.
    pub targets: PathBuf,
    /// Optional bias.
    pub bias: Option<PathBuf>,
}

/// An array read from one `.npy` file: C-order shape and the file's element type.
struct Array {
    path: PathBuf,
    shape: Vec<usize>,
    dtype: String,
    file: Vec<u8>,
}

fn corrupt(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Corrupt {
        path: path.to_path_buf(),
        format: "npy",
        reason: e.to_string(),
    }
}

impl Array {
    fn open(role: &str, path: &Path) -> Result<(Array, DType, Order)> {
        let file = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let npy = NpyFile::new(&file[..]).map_err(|e| corrupt(path, e))?;
        let shape = npy
            .shape()
            .iter()
            .map(|&s| usize::try_from(s))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                corrupt(
                    path,
                    format!("{role}: shape {:?} overflows usize", npy.shape()),
                )
            })?;
        let dtype = npy.dtype();
        let order = npy.order();
        let descr = dtype.descr();
        Ok((
            Array {
                path: path.to_path_buf(),
                shape,
                dtype: descr,
                file,
            },
            dtype,
            order,
        ))
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Reads all elements as `T` (file order), reporting a short file as corrupt (before
    /// allocating anything for it).
    fn values<T: npyz::Deserialize>(&self) -> Result<Vec<T>> {
        let data_bytes = NpyFile::new(&self.file[..])
            .map_err(|e| corrupt(&self.path, e))?
            .into_inner()
            .len();
        let npy = NpyFile::new(&self.file[..]).map_err(|e| corrupt(&self.path, e))?;
        let need = (self.len() as u128) * (std::mem::size_of::<T>() as u128);
        if need > data_bytes as u128 {
            return Err(corrupt(
                &self.path,
                format!(
                    "shape {:?} needs {need} bytes of data, the file holds fewer",
                    self.shape
                ),
            ));
        }
        let v: Vec<T> = npy.into_vec().map_err(|e| corrupt(&self.path, e))?;
        if v.len() != self.len() {
            return Err(corrupt(&self.path, "fewer elements than the shape says"));
        }
        Ok(v)
    }
}

/// Reorders Fortran-order data (first index fastest) into C order (last index fastest).
fn fortran_to_c<T: Copy>(x: Vec<T>, shape: &[usize]) -> Vec<T> {
    if shape.len() < 2 || x.is_empty() {
        return x;
    }
    // Fortran strides.
    let mut fstride = vec![1usize; shape.len()];
    for k in 1..shape.len() {
        fstride[k] = fstride[k - 1] * shape[k - 1];
    }
    let mut idx = vec![0usize; shape.len()];
    let mut out = Vec::with_capacity(x.len());
    for _ in 0..x.len() {
        let f: usize = idx.iter().zip(&fstride).map(|(i, s)| i * s).sum();
        out.push(x[f]);
        // Advance the C-order multi-index.
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            if idx[k] < shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    out
}

fn plain(role: &str, a: &Array, dtype: &DType) -> Result<(TypeChar, u64)> {
    match dtype {
        DType::Plain(ts) => Ok((ts.type_char(), ts.size_field())),
        _ => Err(DataError::WrongDtype {
            name: role.into(),
            found: a.dtype.clone(),
            expected: "a plain numeric dtype",
        }),
    }
}

fn read_floats(role: &str, path: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let (a, dtype, order) = Array::open(role, path)?;
    let x: Vec<f32> = match plain(role, &a, &dtype)? {
        (TypeChar::Float, 4) => a.values::<f32>()?,
        (TypeChar::Float, 2) => a
            .values::<half::f16>()?
            .into_iter()
            .map(half::f16::to_f32)
            .collect(),
        _ => {
            return Err(DataError::WrongDtype {
                name: role.into(),
                found: a.dtype.clone(),
                expected: "float32 or float16",
            })
        }
    };
    let x = if order == Order::Fortran {
        fortran_to_c(x, &a.shape)
    } else {
        x
    };
    Ok((x, a.shape))
}

fn read_ints(role: &str, path: &Path) -> Result<(Vec<i64>, Vec<usize>)> {
    let (a, dtype, order) = Array::open(role, path)?;
    let x: Vec<i64> = match plain(role, &a, &dtype)? {
        (TypeChar::Int, 8) => a.values::<i64>()?,
        (TypeChar::Int, 4) => a.values::<i32>()?.into_iter().map(i64::from).collect(),
        _ => {
            return Err(DataError::WrongDtype {
                name: role.into(),
                found: a.dtype.clone(),
                expected: "int32 or int64",
            })
        }
    };
    let x = if order == Order::Fortran {
        fortran_to_c(x, &a.shape)
    } else {
        x
    };
    Ok((x, a.shape))
}

/// Loads a [`Dataset`] from NumPy `.npy` files (see [`NpyPaths`] for the accepted contents).
///
/// # Errors
/// - [`DataError::Io`]: a file cannot be read;
/// - [`DataError::Corrupt`]: a file is not a valid `.npy` (bad magic or header, or data
///   shorter than its shape);
/// - [`DataError::WrongDtype`]: float64, integers for `e`/`c`, floats for targets, ...;
/// - [`DataError::WrongShape`]: `e` of rank < 2, `c` not `[V, D]`, `bias` not `[V]`, or a
///   zero `V`/`D`;
/// - [`DataError::SizeMismatch`]: `D` of `e` and `c` differ, `targets` has not `N` elements,
///   `bias` has not `V`.
pub fn load_npy(paths: &NpyPaths) -> Result<Dataset> {
    let (e, es) = read_floats("e", &paths.e)?;
    if es.len() < 2 || es[es.len() - 1] == 0 {
        return Err(DataError::WrongShape {
            name: "e".into(),
            found: es,
            expected: "[..., N, D] with rank >= 2 and D >= 1".into(),
        });
    }
    let d = es[es.len() - 1];
    let n = e.len() / d;
    let (c, cs) = read_floats("c", &paths.c)?;
    if cs.len() != 2 || cs[0] == 0 || cs[1] == 0 {
        return Err(DataError::WrongShape {
            name: "c".into(),
            found: cs,
            expected: "[V, D] with V, D >= 1".into(),
        });
    }
    let v = cs[0];
    if cs[1] != d {
        return Err(DataError::SizeMismatch {
            detail: format!("e has D = {d} but c has D = {}", cs[1]),
        });
    }
    let (targets, ts) = read_ints("targets", &paths.targets)?;
    if targets.len() != n {
        return Err(DataError::SizeMismatch {
            detail: format!(
                "targets has {} elements (shape {ts:?}) but e has N = {n} rows",
                targets.len()
            ),
        });
    }
    let bias = match &paths.bias {
        None => None,
        Some(p) => {
            let (b, bs) = read_floats("bias", p)?;
            if bs.len() != 1 {
                return Err(DataError::WrongShape {
                    name: "bias".into(),
                    found: bs,
                    expected: "[V]".into(),
                });
            }
            if b.len() != v {
                return Err(DataError::SizeMismatch {
                    detail: format!("bias has {} elements but c has V = {v} rows", b.len()),
                });
            }
            Some(b)
        }
    };
    let label = |p: &Path| {
        p.file_name().map_or_else(
            || p.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        )
    };
    let ds = Dataset {
        name: format!(
            "npy: e {} [{n}x{d}], c {} [{v}x{d}], targets {}{}",
            label(&paths.e),
            label(&paths.c),
            label(&paths.targets),
            if bias.is_some() { ", bias" } else { "" }
        ),
        n,
        d,
        v,
        e,
        c,
        bias,
        targets,
        lse_ref: None,
        nll_ref: None,
        seq_len: (es.len() >= 3).then(|| es[es.len() - 2]),
    };
    ds.validate()?;
    Ok(ds)
}

#[cfg(test)]
mod tests {
    use super::fortran_to_c;

    #[test]
    fn fortran_reorder() {
        // C-order [[0, 1, 2], [3, 4, 5]] stored in Fortran order is 0 3 1 4 2 5.
        assert_eq!(
            fortran_to_c(vec![0, 3, 1, 4, 2, 5], &[2, 3]),
            vec![0, 1, 2, 3, 4, 5]
        );
        // 3-D: shape [2, 2, 2], value = 4i + 2j + k; Fortran storage index = i + 2j + 4k.
        let mut f = vec![0; 8];
        for i in 0..2 {
            for j in 0..2 {
                for k in 0..2 {
                    f[i + 2 * j + 4 * k] = 4 * i + 2 * j + k;
                }
            }
        }
        assert_eq!(fortran_to_c(f, &[2, 2, 2]), (0..8).collect::<Vec<_>>());
    }
}
