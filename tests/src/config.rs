//! Configuration of one stamping of the suite (one backend).

/// How the suite runs against one backend. Built by [`crate::conformance_suite!`] from its
/// `key = value` arguments (each assigns the field `key`), or by hand when calling the check
/// functions directly.
#[derive(Clone, Debug, PartialEq)]
pub struct SuiteConfig {
    /// Label of the stamping (the macro's module name, e.g. `cpu`); used in messages and to
    /// derive the default `require_env` (`CCE_REQUIRE_CPU`).
    pub name: &'static str,
    /// The backend must exist: a `CceError::NoDevice` from the constructor fails the tests
    /// instead of skipping them.
    pub require: bool,
    /// Environment variable that, when set to anything but `""`, `0`, `false` or `no`, makes
    /// the backend required. `""` (default): `CCE_REQUIRE_<NAME>` with the upper-cased `name`.
    pub require_env: &'static str,
    /// Speed class of the backend: the largest work one case may ask of it, in FLOP, counting a
    /// forward+backward as `6·N·V·D` (three logits-sized GEMMs). Cases whose natural size is
    /// larger (the distribution cases, the real fixture) are cut down in rows, then classes, to
    /// fit; the hostile-shape cases are small and always run at their size. Default `2e10`.
    pub max_work_flop: f64,
    /// Upper bound on the rows of the real fixture used (it has 1024). Default 1024; the
    /// effective count is also bounded by `max_work_flop` and is at least 32.
    pub fixture_max_rows: usize,
    /// Treat `CceError::Unsupported` from a valid case as "skipped" (printed) instead of a
    /// failure, e.g. for an adapter without f16. A check whose every case is skipped still
    /// fails. Default false.
    pub allow_unsupported: bool,
    /// Fixed base seed. `None`: taken from the environment variable `CCE_SEED` if set, else
    /// fresh per check (time and a counter). The seed is printed on every failure.
    pub seed: Option<u64>,
}

impl SuiteConfig {
    /// Defaults for a stamping named `name`.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            require: false,
            require_env: "",
            max_work_flop: 2e10,
            fixture_max_rows: 1024,
            allow_unsupported: false,
            seed: None,
        }
    }

    /// The environment variable that makes this backend required.
    pub fn require_env_name(&self) -> String {
        if self.require_env.is_empty() {
            format!("CCE_REQUIRE_{}", self.name.to_ascii_uppercase())
        } else {
            self.require_env.to_string()
        }
    }

    /// Whether a missing device is a failure (the `require` flag or the environment variable).
    pub fn device_required(&self) -> bool {
        if self.require {
            return true;
        }
        match std::env::var(self.require_env_name()) {
            Ok(v) => !matches!(v.trim(), "" | "0" | "false" | "no"),
            Err(_) => false,
        }
    }

    /// Rows of the real fixture to use: `fixture_max_rows`, bounded by `max_work_flop` at
    /// `V = 49152`, `D = 576`, at least 32 and at most 1024.
    pub fn fixture_rows(&self) -> usize {
        let per_row = 6.0 * 49152.0 * 576.0;
        let by_work = (self.max_work_flop / per_row).floor() as usize;
        by_work.min(self.fixture_max_rows).clamp(32, 1024)
    }
}
