//! Verdicts and failure reports (in the style of burn's `compare`: the first mismatches with
//! their indices, values, errors and the tolerance, plus the case and the seed).

use std::fmt;

/// One element out of tolerance.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// Output name.
    pub output: &'static str,
    /// Flat index.
    pub index: usize,
    /// Row (`index / row length`).
    pub row: usize,
    /// Column (`index % row length`).
    pub col: usize,
    /// The backend's value.
    pub ours: f64,
    /// Ground truth (f64 oracle).
    pub gt: f64,
    /// Same-precision naive reference.
    pub reference: f64,
    /// `|ours − gt|`.
    pub abs_err: f64,
    /// `|ours − gt| / |gt|`.
    pub rel_err: f64,
    /// The allowed `|ours − gt|`.
    pub allowed: f64,
}

/// Judgement of one output of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputVerdict {
    /// Output name.
    pub name: &'static str,
    /// Elements compared.
    pub len: usize,
    /// Elements out of tolerance.
    pub bad: usize,
    /// `‖ours − gt‖ / ‖gt‖`.
    pub rel_err: f64,
    /// `‖ref − gt‖ / ‖gt‖`, when a reference was used.
    pub ref_rel_err: Option<f64>,
    /// Largest finite `|ours − gt|`.
    pub max_abs_err: f64,
    /// Largest `|ours − gt| / allowed` (≤ 1 passes; the headroom of the output).
    pub max_ratio: f64,
    /// `τ` used.
    pub tau: f64,
    /// `unit` used (its scalar part).
    pub unit: f64,
    /// Whether a per-element term scale was added to `unit` (f32 gradients).
    pub unit_per_element: bool,
    /// The first [`crate::judge::MAX_REPORTED`] mismatches, in index order.
    pub first: Vec<Mismatch>,
    /// The mismatch with the largest error/allowed ratio.
    pub worst: Option<Mismatch>,
}

/// Everything judged about one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseReport {
    /// The case, described.
    pub case: String,
    /// Seed its data was drawn from.
    pub seed: u64,
    /// Per-output verdicts.
    pub outputs: Vec<OutputVerdict>,
    /// Failed assertions other than element mismatches (missing outputs, shapes, stats,
    /// errors returned for valid input, ...).
    pub problems: Vec<String>,
    /// Informational notes (filter statistics, skipped because unsupported, ...).
    pub notes: Vec<String>,
    /// Whether the case was skipped (`Unsupported` with `allow_unsupported`).
    pub skipped: bool,
    /// Wall time in ms of: generating the data, the backend call (upload, compute, download),
    /// the oracles, the judging.
    pub times_ms: [f64; 4],
}

impl CaseReport {
    /// An empty report for `case` drawn from `seed`.
    pub fn new(case: impl Into<String>, seed: u64) -> Self {
        Self {
            case: case.into(),
            seed,
            outputs: Vec::new(),
            problems: Vec::new(),
            notes: Vec::new(),
            skipped: false,
            times_ms: [0.0; 4],
        }
    }

    /// Whether every output is within tolerance and no other problem was found.
    pub fn passed(&self) -> bool {
        self.problems.is_empty() && self.outputs.iter().all(|o| o.bad == 0)
    }

    /// Largest `|ours − gt| / allowed` over every judged element (≤ 1 passes).
    pub fn max_ratio(&self) -> f64 {
        self.outputs.iter().fold(0.0, |a, o| a.max(o.max_ratio))
    }

    /// Relative error `‖ours − gt‖/‖gt‖` of an output, if judged.
    pub fn rel_err(&self, output: &str) -> Option<f64> {
        self.outputs
            .iter()
            .find(|o| o.name == output)
            .map(|o| o.rel_err)
    }

    /// Record a problem.
    pub fn problem(&mut self, msg: impl Into<String>) {
        self.problems.push(msg.into());
    }

    /// One summary line.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} {}",
            if self.skipped {
                "skip"
            } else if self.passed() {
                "ok  "
            } else {
                "FAIL"
            },
            self.case
        );
        if !self.outputs.is_empty() {
            s += &format!(" | err/allowed {:.2}", self.max_ratio());
        }
        for o in &self.outputs {
            s += &format!(" | {} {:.1e}", o.name, o.rel_err);
            if let Some(r) = o.ref_rel_err {
                s += &format!(" (ref {r:.1e})");
            }
        }
        for n in &self.notes {
            s += &format!(" | {n}");
        }
        let [gen, call, oracle, judge] = self.times_ms;
        if call > 0.0 {
            s += &format!(
                " | ms: data {gen:.0} backend {call:.0} oracle {oracle:.0} judge {judge:.0}"
            );
        }
        s
    }
}

impl fmt::Display for CaseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "case: {}", self.case)?;
        writeln!(f, "case seed: {:#x}", self.seed)?;
        for p in &self.problems {
            writeln!(f, "  problem: {p}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        writeln!(
            f,
            "  rule: |ours-gt| <= |ref-gt| + tau*(|gt| + unit) [+ filter bound]; per row (d_e rows, d_c rows): \
             ||ours_i-gt_i|| <= tau*(||gt_i|| + sum|G_i.|*max||operand row||) + G range [+ ||ref_i-gt_i|| under a softcap] [+ filter bound], ours/gt = row norms"
        )?;
        for o in &self.outputs {
            write!(
                f,
                "  {:<8} rel err {:.3e}{}  max abs {:.3e}  err/allowed {:.2}  tau {:.1e} unit {:.3e}",
                o.name,
                o.rel_err,
                o.ref_rel_err
                    .map_or(String::new(), |r| format!(" (ref {r:.3e})")),
                o.max_abs_err,
                o.max_ratio,
                o.tau,
                o.unit
            )?;
            if o.unit_per_element {
                write!(f, " + term scale")?;
            }
            if o.bad == 0 {
                writeln!(f, "  ok")?;
                continue;
            }
            let what = if o.name.ends_with(" rows") {
                "rows (worst first)"
            } else {
                "elements"
            };
            writeln!(f, "  {} of {} {what} out of tolerance", o.bad, o.len)?;
            writeln!(
                f,
                "    {:>10} {:>14} {:>15} {:>15} {:>15} {:>10} {:>10} {:>10}",
                "index", "(row, col)", "ours", "gt", "ref", "abs err", "rel err", "allowed"
            )?;
            let worst = o.worst.iter().filter(|w| !o.first.contains(w));
            for (m, tag) in o
                .first
                .iter()
                .map(|m| (m, ""))
                .chain(worst.map(|m| (m, " (worst)")))
            {
                writeln!(
                    f,
                    "    {:>10} {:>14} {:>15.8e} {:>15.8e} {:>15.8e} {:>10.3e} {:>10.3e} {:>10.3e}{tag}",
                    m.index,
                    format!("({}, {})", m.row, m.col),
                    m.ours,
                    m.gt,
                    m.reference,
                    m.abs_err,
                    m.rel_err,
                    m.allowed
                )?;
            }
        }
        Ok(())
    }
}

/// What a passing check did: one report per case.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    /// Check name.
    pub check: String,
    /// Backend name.
    pub backend: String,
    /// Base seed of the check.
    pub seed: u64,
    /// Per-case reports.
    pub cases: Vec<CaseReport>,
    /// Wall time of the check in seconds.
    pub seconds: f64,
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "check {} on {}: {} cases, seed {:#x}, {:.2} s",
            self.check,
            self.backend,
            self.cases.len(),
            self.seed,
            self.seconds
        )?;
        for c in &self.cases {
            writeln!(f, "  {}", c.summary())?;
        }
        Ok(())
    }
}

/// A failed check: the failing cases in full (up to 3), the others as summary lines.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckFailure {
    /// Check name.
    pub check: String,
    /// Backend name.
    pub backend: String,
    /// Base seed of the check (`CCE_SEED` to reproduce).
    pub seed: u64,
    /// Every case report (passing and failing).
    pub cases: Vec<CaseReport>,
}

impl CheckFailure {
    /// The failing cases.
    pub fn failing(&self) -> impl Iterator<Item = &CaseReport> {
        self.cases.iter().filter(|c| !c.passed())
    }
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_fail = self.failing().count();
        writeln!(
            f,
            "conformance check '{}' FAILED on backend '{}': {} of {} cases (seed {:#x}, CCE_SEED={})",
            self.check,
            self.backend,
            n_fail,
            self.cases.len(),
            self.seed,
            self.seed
        )?;
        for c in self.failing().take(3) {
            writeln!(f, "{c}")?;
        }
        writeln!(f, "all cases:")?;
        for c in &self.cases {
            writeln!(f, "  {}", c.summary())?;
        }
        Ok(())
    }
}

impl std::error::Error for CheckFailure {}
