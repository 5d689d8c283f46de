//! The real fixtures: SmolLM2-135M hidden states and head on real text.

use std::path::{Path, PathBuf};

use crate::dataset::Dataset;
use crate::error::Result;
use crate::st::{load_safetensors, load_safetensors_split, TensorNames};

/// File name of the shipped 1k-row real fixture.
pub const FIXTURE_FILE: &str = "smollm2_lce_real_1k.safetensors";
/// File name of the 12k-row real file (E and targets only; the head is the 1k fixture's).
pub const E12K_FILE: &str = "smollm2_lce_real_E12k.safetensors";
/// Environment variable that may point at the 12k-row file.
pub const E12K_ENV: &str = "CCE_E12K";

/// Environment variable naming a folder that holds the fixture, for binaries run away from the
/// checkout they were built in (e.g. on a GPU machine): `$CCE_DATA_DIR/smollm2_lce_real_1k.safetensors`.
pub const DATA_DIR_ENV: &str = "CCE_DATA_DIR";

/// Path of the copy of the real fixture shipped in the repository:
/// `<repo>/data/smollm2_lce_real_1k.safetensors` (31 MB; SmolLM2-135M-Instruct, N = 1024,
/// D = 576, V = 49152; provenance and licences in `data/README.md`). `$CCE_DATA_DIR` wins when
/// set, then `./data` when the compile-time checkout is gone.
pub fn fixture_path() -> PathBuf {
    if let Some(dir) = std::env::var_os(DATA_DIR_ENV) {
        return PathBuf::from(dir).join(FIXTURE_FILE);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("..")
        .join("data")
        .join(FIXTURE_FILE);
    let local = Path::new("data").join(FIXTURE_FILE);
    if !built.exists() && local.exists() {
        return local;
    }
    built
}

/// Loads the shipped real fixture: `E` bf16 `[1024, 576]`, the Q8_0 head decoded exactly to
/// f32 `[49152, 576]`, `targets` `[1024]`, and the f64-computed `lse_ref`, `nll_ref`.
///
/// # Errors
/// As [`load_safetensors`] (for example [`DataError::Io`](crate::DataError::Io) if the
/// repository's `data/` folder is missing).
pub fn load_real_fixture() -> Result<Dataset> {
    load_safetensors(fixture_path(), &TensorNames::default())
}

/// Where the 12k-row real file is, if it can be found: `$CCE_E12K` if set and existing, else
/// `shared/data/` beside the repository (`<repo>/../shared/data/`), else `<repo>/shared/data/`,
/// else `/work/shared/data/`. `None` when none exists (CI has only the repository, so tests
/// using it skip).
pub fn e12k_path() -> Option<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..");
    let candidates = [
        std::env::var_os(E12K_ENV).map(PathBuf::from),
        Some(repo.join("..").join("shared").join("data").join(E12K_FILE)),
        Some(repo.join("shared").join("data").join(E12K_FILE)),
        Some(Path::new("/work/shared/data").join(E12K_FILE)),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

/// Loads the 12k-row real file (`E` bf16 `[12288, 576]`, `targets` i32 `[12288]`: 8 windows
/// of the Rust book then 4 of CPython source, 1024 tokens each) with the head taken from the
/// 1k fixture at `head_path` (same model, same `C`). There are no `lse_ref`/`nll_ref`.
///
/// # Errors
/// As [`load_safetensors_split`].
pub fn load_real_e12k(e12k_path: impl AsRef<Path>, head_path: impl AsRef<Path>) -> Result<Dataset> {
    load_safetensors_split(e12k_path, head_path, &TensorNames::default())
}
