//! safetensors loading (E, C in several encodings, targets, bias, references) and saving.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

use crate::dataset::Dataset;
use crate::error::{DataError, Result};

/// Block length of the Q8_0 encoding along `D`: one scale per 32 consecutive codes of a row.
pub const Q8_BLOCK: usize = 32;

/// Names of the tensors to read from a safetensors file.
///
/// The defaults match the shipped real fixture (`E`, `C`, `C_q8`, `C_scale`, `bias`,
/// `targets`, `lse_ref`, `nll_ref`). An optional tensor (`bias`, `lse_ref`, `nll_ref`) whose
/// name is the empty string is never read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorNames {
    /// Hidden states: bf16, f16 or f32, shape `[..., D]` (leading dimensions are flattened
    /// into `N`).
    pub e: String,
    /// Classifier as floats: bf16, f16 or f32, shape `[V, D]`. Used when present; otherwise
    /// the head is read as Q8_0 from [`c_q8`](Self::c_q8) and [`c_scale`](Self::c_scale).
    pub c: String,
    /// Q8_0 codes of the classifier: i8, shape `[V, D]`. Empty: no Q8_0 fallback (a missing
    /// [`c`](Self::c) is then an error naming it).
    pub c_q8: String,
    /// Q8_0 scales: f16 (bf16 and f32 accepted), shape `[V, ceil(D / 32)]`;
    /// `C[v, d] = f32(scale[v, d / 32]) * f32(code[v, d])`, exact in f32.
    pub c_scale: String,
    /// Optional bias: bf16, f16 or f32, shape `[V]`.
    pub bias: String,
    /// Targets: i32 or i64, any shape with `N` elements.
    pub targets: String,
    /// Optional reference log-sum-exp per row: floats, `N` elements.
    pub lse_ref: String,
    /// Optional reference per-row loss: floats, `N` elements.
    pub nll_ref: String,
}

impl Default for TensorNames {
    fn default() -> Self {
        TensorNames {
            e: "E".into(),
            c: "C".into(),
            c_q8: "C_q8".into(),
            c_scale: "C_scale".into(),
            bias: "bias".into(),
            targets: "targets".into(),
            lse_ref: "lse_ref".into(),
            nll_ref: "nll_ref".into(),
        }
    }
}

/// A safetensors file read into memory and parsed.
struct StFile<'a> {
    path: &'a Path,
    st: SafeTensors<'a>,
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn corrupt(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Corrupt {
        path: path.to_path_buf(),
        format: "safetensors",
        reason: e.to_string(),
    }
}

impl<'a> StFile<'a> {
    fn parse(path: &'a Path, bytes: &'a [u8]) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(path, e))?;
        Ok(StFile { path, st })
    }

    fn get(&self, name: &str) -> Result<Option<TensorView<'a>>> {
        if name.is_empty() {
            return Ok(None);
        }
        match self.st.tensor(name) {
            Ok(t) => Ok(Some(t)),
            Err(SafeTensorError::TensorNotFound(_)) => Ok(None),
            Err(e) => Err(corrupt(self.path, e)),
        }
    }

    fn require(&self, name: &str) -> Result<TensorView<'a>> {
        self.get(name)?.ok_or_else(|| DataError::MissingTensor {
            name: name.to_string(),
            path: self.path.to_path_buf(),
        })
    }
}

const FLOATS: &str = "F32, F16 or BF16";

/// Decodes a float tensor (f32, f16, bf16) to f32, exactly.
fn floats(name: &str, t: &TensorView<'_>) -> Result<Vec<f32>> {
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => b
            .par_chunks_exact(4)
            .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect(),
        Dtype::F16 => b
            .par_chunks_exact(2)
            .map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32())
            .collect(),
        Dtype::BF16 => b
            .par_chunks_exact(2)
            .map(|x| half::bf16::from_le_bytes([x[0], x[1]]).to_f32())
            .collect(),
        other => {
            return Err(DataError::WrongDtype {
                name: name.into(),
                found: other.to_string(),
                expected: FLOATS,
            })
        }
    })
}

fn wrong_shape(name: &str, found: &[usize], expected: &str) -> DataError {
    DataError::WrongShape {
        name: name.into(),
        found: found.to_vec(),
        expected: expected.into(),
    }
}

/// Reads `E`: returns (values, n, d, dtype, T of a `[..., T, D]` tensor of rank >= 3).
#[allow(clippy::type_complexity)]
fn read_e(
    f: &StFile<'_>,
    names: &TensorNames,
) -> Result<(Vec<f32>, usize, usize, String, Option<usize>)> {
    let t = f.require(&names.e)?;
    let shape = t.shape();
    if shape.len() < 2 || shape[shape.len() - 1] == 0 {
        return Err(wrong_shape(
            &names.e,
            shape,
            "[..., N, D] with rank >= 2 and D >= 1",
        ));
    }
    let d = shape[shape.len() - 1];
    let n = shape[..shape.len() - 1].iter().product();
    let seq_len = (shape.len() >= 3).then(|| shape[shape.len() - 2]);
    let e = floats(&names.e, &t)?;
    Ok((e, n, d, t.dtype().to_string(), seq_len))
}

/// Reads the head: returns (values, v, d, description of its encoding).
fn read_c(f: &StFile<'_>, names: &TensorNames) -> Result<(Vec<f32>, usize, usize, String)> {
    let check2 = |name: &str, shape: &[usize]| -> Result<(usize, usize)> {
        if shape.len() != 2 || shape[0] == 0 || shape[1] == 0 {
            return Err(wrong_shape(name, shape, "[V, D] with V, D >= 1"));
        }
        Ok((shape[0], shape[1]))
    };
    if let Some(t) = f.get(&names.c)? {
        let (v, d) = check2(&names.c, t.shape())?;
        let c = floats(&names.c, &t)?;
        return Ok((c, v, d, t.dtype().to_string()));
    }
    // An empty Q8_0 name: the float classifier only (a name the caller chose must exist).
    let q = if names.c_q8.is_empty() {
        None
    } else {
        f.get(&names.c_q8)?
    };
    let Some(q) = q else {
        return Err(DataError::MissingTensor {
            name: if names.c_q8.is_empty() {
                names.c.clone()
            } else {
                format!("{} (or {} with {})", names.c, names.c_q8, names.c_scale)
            },
            path: f.path.to_path_buf(),
        });
    };
    let s = f.require(&names.c_scale)?;
    if q.dtype() != Dtype::I8 {
        return Err(DataError::WrongDtype {
            name: names.c_q8.clone(),
            found: q.dtype().to_string(),
            expected: "I8",
        });
    }
    let (v, d) = check2(&names.c_q8, q.shape())?;
    let ss = s.shape();
    if ss.len() != 2 {
        return Err(wrong_shape(&names.c_scale, ss, "[V, ceil(D / 32)]"));
    }
    let nb = d.div_ceil(Q8_BLOCK);
    if ss[0] != v || ss[1] != nb {
        return Err(DataError::SizeMismatch {
            detail: format!(
                "{} is [{}, {}] but {} is {:?}: Q8_0 needs [{v}, {nb}] (one scale per {Q8_BLOCK} codes)",
                names.c_q8, v, d, names.c_scale, ss
            ),
        });
    }
    let scales = floats(&names.c_scale, &s)?;
    let codes = q.data();
    let mut c: Vec<f32> = crate::error::try_zeroed(
        crate::error::checked_len(v, d, "c (Q8_0 decoded)")?,
        "c (Q8_0 decoded)",
    )?;
    c.par_chunks_mut(d).enumerate().for_each(|(row, out)| {
        let code = &codes[row * d..(row + 1) * d];
        let sc = &scales[row * nb..(row + 1) * nb];
        for (k, (o, &q)) in out.iter_mut().zip(code).enumerate() {
            // f16 (11 significant bits) times i8 (7 bits) is exact in f32 (24 bits).
            *o = sc[k / Q8_BLOCK] * (q as i8) as f32;
        }
    });
    Ok((c, v, d, format!("Q8_0 (I8 codes, {} scales)", s.dtype())))
}

fn read_targets(f: &StFile<'_>, names: &TensorNames, n: usize) -> Result<(Vec<i64>, String)> {
    let t = f.require(&names.targets)?;
    let b = t.data();
    let targets: Vec<i64> = match t.dtype() {
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|x| i32::from_le_bytes([x[0], x[1], x[2], x[3]]) as i64)
            .collect(),
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|x| i64::from_le_bytes(x.try_into().unwrap_or([0; 8])))
            .collect(),
        other => {
            return Err(DataError::WrongDtype {
                name: names.targets.clone(),
                found: other.to_string(),
                expected: "I32 or I64",
            })
        }
    };
    if targets.len() != n {
        return Err(DataError::SizeMismatch {
            detail: format!(
                "{} has {} elements (shape {:?}) but {} has N = {n} rows",
                names.targets,
                targets.len(),
                t.shape(),
                names.e
            ),
        });
    }
    Ok((targets, t.dtype().to_string()))
}

/// Reads an optional float tensor of `len` elements (any shape).
fn read_opt_floats(f: &StFile<'_>, name: &str, len: usize, of: &str) -> Result<Option<Vec<f32>>> {
    let Some(t) = f.get(name)? else {
        return Ok(None);
    };
    let x = floats(name, &t)?;
    if x.len() != len {
        return Err(DataError::SizeMismatch {
            detail: format!(
                "{name} has {} elements (shape {:?}), expected {len} ({of})",
                x.len(),
                t.shape()
            ),
        });
    }
    Ok(Some(x))
}

fn read_bias(f: &StFile<'_>, names: &TensorNames, v: usize) -> Result<Option<Vec<f32>>> {
    if let Some(t) = f.get(&names.bias)? {
        if t.shape().len() != 1 {
            return Err(wrong_shape(&names.bias, t.shape(), "[V]"));
        }
    }
    read_opt_floats(f, &names.bias, v, "V, the rows of the head")
}

fn file_label(path: &Path) -> String {
    path.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

fn assemble(data: &StFile<'_>, head: &StFile<'_>, names: &TensorNames) -> Result<Dataset> {
    let (e, n, d, e_dt, seq_len) = read_e(data, names)?;
    let (c, v, dc, c_desc) = read_c(head, names)?;
    if d != dc {
        return Err(DataError::SizeMismatch {
            detail: format!(
                "{} has D = {d} but the head ({}) has D = {dc}",
                names.e, names.c
            ),
        });
    }
    let (targets, t_dt) = read_targets(data, names, n)?;
    let bias = read_bias(head, names, v)?;
    let lse_ref = read_opt_floats(data, &names.lse_ref, n, "N, the rows of E")?;
    let nll_ref = read_opt_floats(data, &names.nll_ref, n, "N, the rows of E")?;
    let src = if std::ptr::eq(data, head) {
        file_label(data.path)
    } else {
        format!(
            "{} + head of {}",
            file_label(data.path),
            file_label(head.path)
        )
    };
    let ds = Dataset {
        name: format!(
            "{src}: E {e_dt} [{n}x{d}], C {c_desc} [{v}x{d}], targets {t_dt}{}",
            if bias.is_some() { ", bias" } else { "" }
        ),
        n,
        d,
        v,
        e,
        c,
        bias,
        targets,
        lse_ref,
        nll_ref,
        seq_len,
    };
    ds.validate()?;
    Ok(ds)
}

/// Loads a [`Dataset`] from one safetensors file, reading the tensors named in `names`.
///
/// - `E` (`names.e`): bf16, f16 or f32, `[..., D]`; leading dimensions are flattened to `N`.
/// - The head: `names.c` as bf16/f16/f32 `[V, D]` if present, else Q8_0 from `names.c_q8`
///   (i8 `[V, D]`) and `names.c_scale` (f16, bf16 or f32 `[V, ceil(D/32)]`), decoded exactly
///   as `C[v, d] = scale[v, d / 32] * code[v, d]`.
/// - `targets`: i32 or i64 with `N` elements, widened to i64.
/// - Optional: `bias` (floats `[V]`), `lse_ref`, `nll_ref` (floats, `N` elements).
///
/// All values are widened exactly to f32.
///
/// # Errors
/// - [`DataError::Io`]: the file cannot be read;
/// - [`DataError::Corrupt`]: not a valid safetensors file (bad or truncated header, data past
///   the end of the file, ...);
/// - [`DataError::MissingTensor`]: `E`, `targets` or the head (`C`, or `C_q8` + `C_scale`) is
///   absent;
/// - [`DataError::WrongDtype`], [`DataError::WrongShape`]: a tensor is of the wrong kind;
/// - [`DataError::SizeMismatch`]: `D` differs between `E` and the head, or `targets`,
///   `bias`, the references or the Q8 scales do not match `N`, `V` or `D`.
pub fn load_safetensors(path: impl AsRef<Path>, names: &TensorNames) -> Result<Dataset> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let f = StFile::parse(path, &bytes)?;
    assemble(&f, &f, names)
}

/// Like [`load_safetensors`] but takes `E`, `targets` and the references from `data_path`
/// and the head (`C` or `C_q8` + `C_scale`) and the optional `bias` from `head_path`. This is
/// how the 12k-row real file is used: it ships no head, the 1k fixture's head is the same.
///
/// # Errors
/// As [`load_safetensors`], for either file.
pub fn load_safetensors_split(
    data_path: impl AsRef<Path>,
    head_path: impl AsRef<Path>,
    names: &TensorNames,
) -> Result<Dataset> {
    let (dp, hp) = (data_path.as_ref(), head_path.as_ref());
    let db = read_file(dp)?;
    let hb = read_file(hp)?;
    let df = StFile::parse(dp, &db)?;
    let hf = StFile::parse(hp, &hb)?;
    assemble(&df, &hf, names)
}

/// One named f32 tensor to write with [`save_safetensors`].
#[derive(Clone, Copy, Debug)]
pub struct F32Tensor<'a> {
    /// Tensor name in the file (must be unique within one call).
    pub name: &'a str,
    /// Shape; its product must equal `data.len()`.
    pub shape: &'a [usize],
    /// Values, row-major.
    pub data: &'a [f32],
}

/// A tensor ready to serialize (little-endian bytes, borrowed when possible).
struct Raw<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Cow<'a, [u8]>,
}

impl View for Raw<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn f32_bytes(x: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(x))
    } else {
        Cow::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

fn i64_bytes(x: &[i64]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(x))
    } else {
        Cow::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

fn write(
    path: &Path,
    tensors: Vec<(String, Raw<'_>)>,
    meta: Option<HashMap<String, String>>,
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (name, _) in &tensors {
        if name.is_empty() || !seen.insert(name.as_str()) {
            return Err(DataError::InvalidParameter(format!(
                "tensor names must be unique and non-empty, got `{name}` twice or empty"
            )));
        }
    }
    // A symbolic link is followed (its target is replaced, the link kept); anything else that
    // is not a regular file (a device, a directory, a pipe) is refused, not replaced.
    let resolved;
    let path: &Path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            resolved = std::fs::canonicalize(path).map_err(|source| DataError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            &resolved
        }
        _ => path,
    };
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() {
            return Err(DataError::InvalidParameter(format!(
                "{} exists and is not a regular file: refusing to replace it",
                path.display()
            )));
        }
    }
    // Write next to the target and rename, so that a crash never leaves a truncated file.
    let mut tmp: PathBuf = path.to_path_buf();
    tmp.as_mut_os_string().push(".partial");
    let io = |source| DataError::Io {
        path: tmp.clone(),
        source,
    };
    // Wider dtypes first (a stable sort: the given order within a dtype size), so that every
    // tensor starts at a multiple of its element size, as safetensors' own writer does.
    let mut tensors = tensors;
    tensors.sort_by_key(|(_, t)| std::cmp::Reverse(t.dtype.bitsize()));
    let header = stable_header(&tensors, meta.as_ref());
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let mut w = std::io::BufWriter::new(file);
    use std::io::Write as _;
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(header.as_bytes()).map_err(io)?;
    for (_, t) in &tensors {
        w.write_all(&t.bytes).map_err(io)?;
    }
    w.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The JSON header of a safetensors file holding `tensors` in the given order, with every
/// key in a fixed order (`__metadata__` first, its keys sorted, then the tensors in order), so
/// that the same tensors and metadata always give the same bytes; padded with spaces so the
/// data starts at a multiple of 8 bytes, as the format recommends.
fn stable_header(tensors: &[(String, Raw<'_>)], meta: Option<&HashMap<String, String>>) -> String {
    use serde_json::Value;
    let q = |x: &str| Value::String(x.to_string()).to_string();
    let mut parts = Vec::new();
    if let Some(meta) = meta {
        let sorted: std::collections::BTreeMap<_, _> = meta.iter().collect();
        let kv: Vec<String> = sorted
            .into_iter()
            .map(|(k, v)| format!("{}:{}", q(k), q(v)))
            .collect();
        parts.push(format!("\"__metadata__\":{{{}}}", kv.join(",")));
    }
    let mut offset = 0usize;
    for (name, t) in tensors {
        let end = offset + t.bytes.len();
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        parts.push(format!(
            "{}:{{\"dtype\":{},\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            q(name),
            q(&t.dtype.to_string()),
            shape.join(",")
        ));
        offset = end;
    }
    let mut header = format!("{{{}}}", parts.join(","));
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    header
}

/// Writes named f32 tensors (for example the gradients `d_e`, `d_c`, `d_bias` of the CLI's
/// `--save-grads`) to a safetensors file, with optional string metadata.
///
/// The bytes are a function of the arguments only: the tensors are laid out in the order
/// given (wider dtypes first) and the metadata keys sorted, so that two runs with equal results write identical
/// files (`cmp` proves a deterministic run).
///
/// The file is written to `<path>.partial` and renamed, so `path` is either the old file or
/// the complete new one. On little-endian machines the data is not copied.
///
/// # Errors
/// - [`DataError::SizeMismatch`]: a shape's product differs from its data length;
/// - [`DataError::InvalidParameter`]: a name is empty or used twice;
/// - [`DataError::Io`]: the file cannot be written.
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[F32Tensor<'_>],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let mut raw = Vec::with_capacity(tensors.len());
    for t in tensors {
        let want = t.shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        if want != Some(t.data.len()) {
            return Err(DataError::SizeMismatch {
                detail: format!(
                    "tensor `{}` has shape {:?} but {} values",
                    t.name,
                    t.shape,
                    t.data.len()
                ),
            });
        }
        raw.push((
            t.name.to_string(),
            Raw {
                dtype: Dtype::F32,
                shape: t.shape.to_vec(),
                bytes: f32_bytes(t.data),
            },
        ));
    }
    write(path.as_ref(), raw, metadata)
}

/// Writes a whole [`Dataset`] as a safetensors file that [`load_safetensors`] reads back
/// bit-exactly with the default [`TensorNames`]: `E` f32 `[N, D]` (`[N / T, T, D]` when
/// [`Dataset::seq_len`] is `T` and divides `N`), `C` f32 `[V, D]`,
/// `targets` i64 `[N]`, and `bias`, `lse_ref`, `nll_ref` (f32) when present; metadata
/// `name` holds [`Dataset::name`].
///
/// # Errors
/// [`DataError::SizeMismatch`] if the dataset is inconsistent ([`Dataset::validate`]);
/// [`DataError::Io`] if the file cannot be written.
pub fn save_dataset(path: impl AsRef<Path>, ds: &Dataset) -> Result<()> {
    ds.validate()?;
    fn f<'a>(name: &str, shape: Vec<usize>, x: &'a [f32]) -> (String, Raw<'a>) {
        (
            name.to_string(),
            Raw {
                dtype: Dtype::F32,
                shape,
                bytes: f32_bytes(x),
            },
        )
    }
    let e_shape = match ds.seq_len {
        Some(t) if t > 0 && ds.n.is_multiple_of(t) => vec![ds.n / t, t, ds.d],
        _ => vec![ds.n, ds.d],
    };
    let mut raw = vec![
        f("E", e_shape, &ds.e),
        f("C", vec![ds.v, ds.d], &ds.c),
        (
            "targets".to_string(),
            Raw {
                dtype: Dtype::I64,
                shape: vec![ds.n],
                bytes: i64_bytes(&ds.targets),
            },
        ),
    ];
    if let Some(b) = &ds.bias {
        raw.push(f("bias", vec![ds.v], b));
    }
    if let Some(r) = &ds.lse_ref {
        raw.push(f("lse_ref", vec![ds.n], r));
    }
    if let Some(r) = &ds.nll_ref {
        raw.push(f("nll_ref", vec![ds.n], r));
    }
    let meta = HashMap::from([("name".to_string(), ds.name.clone())]);
    write(path.as_ref(), raw, Some(meta))
}
