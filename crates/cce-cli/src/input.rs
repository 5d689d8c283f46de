//! Input selection: a safetensors file, NumPy files, a generated case, or the shipped real
//! fixture; and conversion of a [`Dataset`] into the host tensors of a call.

use std::path::PathBuf;
use std::time::Instant;

use cce_data::{Dataset, Distribution, NpyPaths, TensorNames};
use cut_cross_entropy::{DType, HostTensor};

use crate::cli::InputArgs;
use crate::error::{CliError, CliResult};
use crate::progress::with_spinner;

/// Default rows of a generated case (the real fixture's shape).
pub const DEFAULT_N: usize = 1024;
/// Default hidden size of a generated case.
pub const DEFAULT_D: usize = 576;
/// Default vocabulary size of a generated case.
pub const DEFAULT_V: usize = 49152;

/// A loaded or generated problem.
pub struct Loaded {
    /// The values (exact in f32).
    pub ds: Dataset,
    /// The float dtype the file stores `e` and `c` in, when they share one (`None` for a
    /// Q8_0 head, mixed dtypes, NumPy files and generated cases).
    pub file_dtype: Option<DType>,
    /// Whether this is the shipped real fixture.
    pub is_fixture: bool,
    /// Wall time of loading or generating, milliseconds.
    pub load_ms: f64,
}

/// Path of the shipped real fixture, `<repo>/data/smollm2_lce_real_1k.safetensors`, found
/// from this crate's location at compile time.
pub fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("..")
        .join("data")
        .join(cce_data::FIXTURE_FILE)
}

/// Parses a case name of `cce run --case` / `cce repro --cases` into a distribution
/// (`regular` is `randn`; `real` is not a distribution and is handled by the caller).
pub fn parse_distribution(name: &str) -> CliResult<Distribution> {
    let n = if name.trim().eq_ignore_ascii_case("regular") {
        "randn"
    } else {
        name
    };
    n.parse::<Distribution>().map_err(CliError::from)
}

/// The float dtype of `E` and `C` named in a safetensors dataset's description
/// (`"file: E BF16 [..], C BF16 [..], ..."`), when both are the same float type.
fn described_dtype(name: &str) -> Option<DType> {
    let after = |key: &str| -> Option<&str> {
        let i = name.find(key)?;
        name[i + key.len()..].split_whitespace().next()
    };
    let parse = |s: &str| match s {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    };
    let e = parse(after(": E ")?)?;
    let c = parse(after(", C ")?)?;
    (e == c).then_some(e)
}

/// Refuses `--d`, `--v` and `--seed` on real data (a file, NumPy files, the fixture), where
/// they would be silently ignored. clap's `requires = "case"` alone misses them next to
/// `--input` or `--npy-e`, which conflict with `--case`.
fn refuse_generator_flags(args: &InputArgs) -> CliResult<()> {
    let generated = args
        .case
        .as_deref()
        .is_some_and(|c| !c.eq_ignore_ascii_case("real"));
    if generated {
        return Ok(());
    }
    let fixture = args.input.is_none() && args.npy_e.is_none();
    if args.d.is_some() || args.v.is_some() {
        return Err(CliError::msg(if fixture {
            "--d and --v apply to generated cases; the real fixture is 1024 x 576 x 49152"
        } else {
            "--d and --v apply to generated cases (--case NAME); a file has its own shape"
        }));
    }
    if let Some(seed) = args.seed {
        let what = if fixture {
            "the real fixture"
        } else {
            "a file"
        };
        return Err(CliError::msg(format!(
            "--seed {seed} applies to generated cases; {what} is fixed data with nothing to seed (drop --seed, or pick a generated --case)"
        )));
    }
    Ok(())
}

/// The files the input flags read: `--input`, the `--npy-*` files, or the shipped fixture when
/// neither they nor a generated `--case` is given (none for a generated case).
pub fn input_paths(args: &InputArgs) -> Vec<PathBuf> {
    if let Some(p) = &args.input {
        return vec![p.clone()];
    }
    if args.npy_e.is_some() {
        return [&args.npy_e, &args.npy_c, &args.npy_targets, &args.npy_bias]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
    }
    let generated = args
        .case
        .as_deref()
        .is_some_and(|c| !c.eq_ignore_ascii_case("real"));
    if generated {
        Vec::new()
    } else {
        vec![fixture_path()]
    }
}

/// Whether `a` and `b` name the same existing file (through `..`, `.` or a symbolic link, or
/// as two hard links on Unix).
pub fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    if let (Ok(x), Ok(y)) = (a.canonicalize(), b.canonicalize()) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    false
}

/// `flag`'s output file `out` must not be one of the input files ([`input_paths`]): writing
/// it would overwrite the data (the shipped fixture among them) with the outputs. Checked
/// before any work.
pub fn check_not_an_input(flag: &str, out: &std::path::Path, args: &InputArgs) -> CliResult<()> {
    match input_paths(args).iter().find(|p| same_file(out, p)) {
        Some(p) => Err(CliError::msg(format!(
            "{flag} {}: is an input of this run ({}); writing it would overwrite the input, pick another file",
            out.display(),
            p.display()
        ))),
        None => Ok(()),
    }
}

/// Loads or generates the problem the input flags describe.
///
/// Errors: every [`cce_data::DataError`] of the loaders and generators; bad `--case` names;
/// `--n` larger than the file's rows; `--d`, `--v` or `--seed` on real data.
pub fn load(args: &InputArgs) -> CliResult<Loaded> {
    refuse_generator_flags(args)?;
    let t0 = Instant::now();
    let names = TensorNames {
        e: args.e_name.clone(),
        c: args.c_name.clone().unwrap_or_else(|| "C".into()),
        // A classifier name the user gave must exist: no silent Q8_0 fallback then.
        c_q8: if args.c_name.is_some() {
            String::new()
        } else {
            args.c_q8_name.clone()
        },
        c_scale: args.c_scale_name.clone(),
        bias: args.bias_name.clone(),
        targets: args.targets_name.clone(),
        lse_ref: args.lse_ref_name.clone(),
        nll_ref: args.nll_ref_name.clone(),
    };
    let from_file =
        |path: PathBuf, is_fixture: bool| -> CliResult<(Dataset, Option<DType>, bool)> {
            let ds = with_spinner(format!("loading {}", path.display()), || {
                cce_data::load_safetensors(&path, &names)
            })?;
            let dt = described_dtype(&ds.name);
            Ok((ds, dt, is_fixture))
        };
    let (ds, file_dtype, is_fixture) = if let Some(path) = &args.input {
        from_file(path.clone(), false)?
    } else if let Some(e) = &args.npy_e {
        let paths = NpyPaths {
            e: e.clone(),
            c: args.npy_c.clone().unwrap_or_default(),
            targets: args.npy_targets.clone().unwrap_or_default(),
            bias: args.npy_bias.clone(),
        };
        let ds = with_spinner("loading .npy files", || cce_data::load_npy(&paths))?;
        (ds, None, false)
    } else if let Some(case) = args
        .case
        .as_deref()
        .filter(|c| !c.eq_ignore_ascii_case("real"))
    {
        let dist = parse_distribution(case).map_err(|e| e.context("--case"))?;
        let (n, d, v) = (
            args.n.unwrap_or(DEFAULT_N),
            args.d.unwrap_or(DEFAULT_D),
            args.v.unwrap_or(DEFAULT_V),
        );
        if n == 0 {
            return Err(CliError::msg("--n must be >= 1"));
        }
        check_generated_size(n, d, v)?;
        let seed = args.seed.unwrap_or(0);
        let ds = with_spinner(
            format!("generating {dist} N={n} D={d} V={v} seed={seed}"),
            || cce_data::generate(&dist, n, d, v, seed),
        )?;
        (ds, None, false)
    } else {
        // `--case real` or no input at all: the shipped fixture.
        let path = fixture_path();
        let path = path.canonicalize().unwrap_or(path);
        if !path.is_file() {
            return Err(CliError::msg(format!(
                "the shipped real fixture is missing at {} (pass --input FILE or --case NAME)",
                path.display()
            )));
        }
        from_file(path, true)?
    };
    let is_generated = args.case.is_some() && !is_fixture;
    let ds = match args.n {
        Some(n) if !is_generated => {
            if n == 0 || n > ds.n {
                return Err(CliError::msg(format!(
                    "--n {n}: the input has {} rows (use 1..={})",
                    ds.n, ds.n
                )));
            }
            if n < ds.n {
                ds.rows(0, n)
            } else {
                ds
            }
        }
        _ => ds,
    };
    Ok(Loaded {
        ds,
        file_dtype,
        is_fixture,
        load_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}

/// Checks a generated case's sizes before anything is generated: `N` and `V` within the
/// library's index limit (`cce_core::problem::check_index_limits`), and the host memory of
/// the dataset (f32 `e`, `c`, i64 targets) plus the call's copy of the inputs (at most as
/// large again) against what is available.
///
/// Errors: the library's `ResourceLimit`; sizes whose bytes overflow; too little memory.
pub fn check_generated_size(n: usize, d: usize, v: usize) -> CliResult<()> {
    cut_cross_entropy::problem::check_index_limits(n, v)?;
    let too_large = || {
        CliError::msg(format!(
            "--n {n} --d {d} --v {v}: the generated case's size overflows"
        ))
    };
    let floats = (n as u64)
        .checked_mul(d as u64)
        .and_then(|e| {
            (v as u64)
                .checked_mul(d as u64)
                .and_then(|c| e.checked_add(c))
        })
        .ok_or_else(too_large)?;
    // The f32 dataset plus the call's inputs (at most f32 again) and the targets (i64, twice).
    let need = floats
        .checked_mul(8)
        .and_then(|b| b.checked_add(16 * n as u64))
        .ok_or_else(too_large)?;
    if let Some(avail) = crate::report::available_memory_bytes() {
        if need > avail {
            return Err(CliError::msg(format!(
                "--n {n} --d {d} --v {v}: the generated case and its inputs need about {} of host memory, only {} is available; use a smaller --n, --d or --v",
                crate::report::fmt_bytes(need),
                crate::report::fmt_bytes(avail)
            )));
        }
    }
    Ok(())
}

/// The host tensors of one call.
pub struct Tensors {
    /// `[N, D]`, or `[N / T, T, D]` for a file whose `e` has sequences of `T` rows
    /// ([`e_shape`]).
    pub e: HostTensor,
    /// `[V, D]`.
    pub c: HostTensor,
    /// `[V]` if the problem has a bias.
    pub bias: Option<HostTensor>,
    /// `[N]` i64.
    pub targets: HostTensor,
}

impl Tensors {
    /// Bytes of the inputs in their dtype.
    pub fn bytes(&self) -> u64 {
        let b = |t: &HostTensor| t.as_bytes().len() as u64;
        b(&self.e) + b(&self.c) + self.bias.as_ref().map_or(0, b) + b(&self.targets)
    }
}

/// The shape `e` is passed to the library in: `[N / T, T, D]` when the file stores `e` as
/// `[..., T, D]` and `T` divides `N` (so the library takes the sequence length from the shape,
/// the one rule for `--shift`), else `[N, D]`.
pub fn e_shape(ds: &Dataset) -> Vec<usize> {
    match ds.seq_len {
        Some(t) if t > 0 && ds.n.is_multiple_of(t) => vec![ds.n / t, t, ds.d],
        _ => vec![ds.n, ds.d],
    }
}

/// Rounds the dataset's values to `dtype` (round to nearest even; exact for f32).
///
/// Errors: `ShapeMismatch` if the dataset is inconsistent; not enough free host memory for
/// the copy.
pub fn tensors(ds: &Dataset, dtype: DType) -> CliResult<Tensors> {
    let elems =
        ds.e.len() as u64 + ds.c.len() as u64 + ds.bias.as_ref().map_or(0, |b| b.len() as u64);
    let need = elems * dtype.size_bytes() as u64 + 8 * ds.n as u64;
    if let Some(avail) = crate::report::available_memory_bytes() {
        if need > avail {
            return Err(CliError::msg(format!(
                "the {dtype} inputs need {} of host memory, only {} is available",
                crate::report::fmt_bytes(need),
                crate::report::fmt_bytes(avail)
            )));
        }
    }
    Ok(Tensors {
        e: HostTensor::from_f32(e_shape(ds), &ds.e, dtype)?,
        c: HostTensor::from_f32(vec![ds.v, ds.d], &ds.c, dtype)?,
        bias: ds
            .bias
            .as_ref()
            .map(|b| HostTensor::from_f32(vec![ds.v], b, dtype))
            .transpose()?,
        targets: HostTensor::from_i64(ds.targets.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_from_description() {
        let q8 = "f.safetensors: E BF16 [1024x576], C Q8_0 (I8 codes, F16 scales) [49152x576], targets I32";
        assert_eq!(described_dtype(q8), None);
        let bf = "f.safetensors: E BF16 [4x8], C BF16 [16x8], targets I64";
        assert_eq!(described_dtype(bf), Some(DType::BF16));
        let mixed = "f.safetensors: E F32 [4x8], C F16 [16x8], targets I64";
        assert_eq!(described_dtype(mixed), None);
    }

    #[test]
    fn regular_is_randn() {
        assert_eq!(parse_distribution("regular").unwrap(), Distribution::Randn);
        assert!(parse_distribution("nope").is_err());
    }
}
