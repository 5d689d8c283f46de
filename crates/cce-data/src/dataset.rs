//! The [`Dataset`] struct: one LM-head problem held in plain `f32`/`i64` vectors.

use crate::error::{DataError, Result};

/// One cross-entropy problem `loss = CE(E·Cᵀ + bias, targets)` with every value held exactly
/// in `f32` (inputs stored as bf16 or f16 are widened exactly; a Q8_0 head is decoded exactly,
/// see [`crate::load_safetensors`]).
///
/// Layouts are row-major and dense:
/// - `e`: `[n, d]`, row `i` is the hidden state of token `i`;
/// - `c`: `[v, d]`, row `j` is the classifier vector of class `j`;
/// - `bias`: `[v]` when present, added to every row of logits;
/// - `targets`: `[n]`, class indices in `[0, v)`; negative values (for example the usual
///   `ignore_index` -100) are kept as they are and mean "ignored" to the statistics of
///   [`crate::measure`];
/// - `lse_ref`, `nll_ref`: `[n]` reference log-sum-exp and per-token loss in nats, when the
///   file ships them (the real fixture does: computed in f64 from exactly these values).
///
/// `Debug` prints the shapes and the provenance only, never the (large) data.
#[derive(Clone, PartialEq)]
pub struct Dataset {
    /// Where the data comes from: a file name with the dtypes read, or a generator with its
    /// distribution, shape and seed.
    pub name: String,
    /// Number of rows (tokens).
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    /// Vocabulary size (number of classes).
    pub v: usize,
    /// Hidden states, `[n, d]` row-major.
    pub e: Vec<f32>,
    /// Classifier (LM head), `[v, d]` row-major.
    pub c: Vec<f32>,
    /// Optional per-class bias, `[v]`.
    pub bias: Option<Vec<f32>>,
    /// Target class per row, `[n]`.
    pub targets: Vec<i64>,
    /// Optional reference log-sum-exp per row, `[n]`, nats.
    pub lse_ref: Option<Vec<f32>>,
    /// Optional reference per-row loss (`lse - logit[target]`), `[n]`, nats.
    pub nll_ref: Option<Vec<f32>>,
    /// Rows per sequence `T` when the file stores `e` as `[..., T, D]` (rank 3 or more);
    /// `None` for a 2-D `e` and for generated data. A caller that shifts targets within
    /// sequences (`Options::shift`) passes `e` as `[n / T, T, d]` so that the library takes
    /// `T` from the shape, as it does for any 3-D `e`.
    pub seq_len: Option<usize>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("name", &self.name)
            .field("n", &self.n)
            .field("d", &self.d)
            .field("v", &self.v)
            .field("bias", &self.bias.is_some())
            .field("lse_ref", &self.lse_ref.is_some())
            .field("nll_ref", &self.nll_ref.is_some())
            .field("seq_len", &self.seq_len)
            .finish_non_exhaustive()
    }
}

impl Dataset {
    /// Checks that `d` and `v` are at least 1 (and `v < 2³²`) and that every vector has the
    /// length its shape implies (`n` may be 0).
    ///
    /// # Errors
    /// [`DataError::InvalidParameter`] if `d` or `v` is 0 or `v >= 2³²`;
    /// [`DataError::SizeMismatch`] naming the first vector whose length is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.d == 0 || self.v == 0 || self.v > u32::MAX as usize {
            return Err(DataError::InvalidParameter(format!(
                "D and V must be >= 1 and V < 2^32 (n = {}, d = {}, v = {})",
                self.n, self.d, self.v
            )));
        }
        let check = |what: &str, len: usize, want: Option<usize>| -> Result<()> {
            match want {
                Some(w) if w == len => Ok(()),
                Some(w) => Err(DataError::SizeMismatch {
                    detail: format!(
                        "{what} has {len} elements, expected {w} (n = {}, d = {}, v = {})",
                        self.n, self.d, self.v
                    ),
                }),
                None => Err(DataError::SizeMismatch {
                    detail: format!(
                        "{what}: shape n = {}, d = {}, v = {} overflows",
                        self.n, self.d, self.v
                    ),
                }),
            }
        };
        check("e", self.e.len(), self.n.checked_mul(self.d))?;
        check("c", self.c.len(), self.v.checked_mul(self.d))?;
        check("targets", self.targets.len(), Some(self.n))?;
        if let Some(b) = &self.bias {
            check("bias", b.len(), Some(self.v))?;
        }
        if let Some(r) = &self.lse_ref {
            check("lse_ref", r.len(), Some(self.n))?;
        }
        if let Some(r) = &self.nll_ref {
            check("nll_ref", r.len(), Some(self.n))?;
        }
        Ok(())
    }

    /// Row `i` of `e` (`d` values). Panics if `i >= n` (like slice indexing).
    pub fn e_row(&self, i: usize) -> &[f32] {
        &self.e[i * self.d..(i + 1) * self.d]
    }

    /// Row `j` of `c` (`d` values). Panics if `j >= v` (like slice indexing).
    pub fn c_row(&self, j: usize) -> &[f32] {
        &self.c[j * self.d..(j + 1) * self.d]
    }

    /// The logit `e_i · c_j + bias_j` accumulated in f64 (a slow, exact-ish reference for one
    /// entry). Panics if `i >= n` or `j >= v`.
    pub fn logit_f64(&self, i: usize, j: usize) -> f64 {
        let dot: f64 = self
            .e_row(i)
            .iter()
            .zip(self.c_row(j))
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        dot + self.bias.as_ref().map_or(0.0, |b| b[j] as f64)
    }

    /// A copy holding only rows `start..start + len` (clamped to `n`) of `e`, `targets` and
    /// the references; `c` and `bias` are shared in full; `seq_len` is kept (it may no longer
    /// divide `n`: the caller decides what a cut sequence means). Useful to measure or benchmark a
    /// slice of a large dataset.
    pub fn rows(&self, start: usize, len: usize) -> Dataset {
        let start = start.min(self.n);
        let end = start.saturating_add(len).min(self.n);
        let sub = |x: &Option<Vec<f32>>| x.as_ref().map(|r| r[start..end].to_vec());
        Dataset {
            name: format!("{} [rows {start}..{end}]", self.name),
            n: end - start,
            d: self.d,
            v: self.v,
            e: self.e[start * self.d..end * self.d].to_vec(),
            c: self.c.clone(),
            bias: self.bias.clone(),
            targets: self.targets[start..end].to_vec(),
            lse_ref: sub(&self.lse_ref),
            nll_ref: sub(&self.nll_ref),
            seq_len: self.seq_len,
        }
    }

    /// Bytes held by the vectors of this dataset (`e`, `c`, `bias`, `targets`, references).
    pub fn bytes(&self) -> usize {
        let opt = |x: &Option<Vec<f32>>| x.as_ref().map_or(0, |r| r.len() * 4);
        self.e.len() * 4
            + self.c.len() * 4
            + self.targets.len() * 8
            + opt(&self.bias)
            + opt(&self.lse_ref)
            + opt(&self.nll_ref)
    }
}
