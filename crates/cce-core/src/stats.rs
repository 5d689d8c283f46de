//! Call statistics: what a call did, so a user can see why it was slow or inexact.

use crate::plan::Strategy;
use std::fmt;

/// Returned by every forward and backward call.
#[derive(Clone, Debug, PartialEq)]
pub struct CallStats {
    /// Backend name.
    pub backend: String,
    /// Strategy of the plan.
    pub strategy: Strategy,
    /// Why the plan chose it.
    pub plan_reason: String,
    /// Rows with a valid target.
    pub n_valid: usize,
    /// Logits tiles of the problem (one pass).
    pub tiles_total: u64,
    /// Tiles whose gradient contribution was computed, summed over the backward passes that
    /// filter (0 for a forward call).
    pub tiles_visited: u64,
    /// Tiles skipped by the filter, summed likewise.
    pub tiles_skipped: u64,
    /// `(row, class)` entries whose gradient was computed, summed over filtered passes.
    pub entries_kept: u64,
    /// Entries skipped, summed likewise.
    pub entries_skipped: u64,
    /// Largest per-row dropped mass (`Σ |p − onehot|` over skipped entries), over valid rows.
    pub dropped_mass_max: f64,
    /// Mean per-row dropped mass over valid rows.
    pub dropped_mass_mean: f64,
    /// Resolved filter threshold (0 when off).
    pub filter_eps: f32,
    /// Per-row dropped-mass bound (0 when off).
    pub max_dropped_mass: f32,
    /// Extra memory used beyond inputs and outputs, bytes.
    pub workspace_bytes: u64,
}

impl CallStats {
    /// Fraction of tiles skipped by the filter in the backward (0 when nothing was filtered).
    pub fn skipped_fraction(&self) -> f64 {
        let t = self.tiles_visited + self.tiles_skipped;
        if t == 0 {
            0.0
        } else {
            self.tiles_skipped as f64 / t as f64
        }
    }
}

impl fmt::Display for CallStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "backend           {}", self.backend)?;
        writeln!(
            f,
            "strategy          {} ({})",
            self.strategy, self.plan_reason
        )?;
        writeln!(f, "valid rows        {}", self.n_valid)?;
        writeln!(f, "tiles             {} per pass", self.tiles_total)?;
        if self.filter_eps > 0.0 && self.tiles_visited + self.tiles_skipped == 0 {
            writeln!(
                f,
                "filter            eps {:.3e}, max dropped mass {:.1e} per row (applies to the backward)",
                self.filter_eps, self.max_dropped_mass
            )?;
        } else if self.filter_eps > 0.0 {
            writeln!(
                f,
                "filter            eps {:.3e}, max dropped mass {:.1e} per row",
                self.filter_eps, self.max_dropped_mass
            )?;
            writeln!(
                f,
                "backward tiles    {} visited, {} skipped ({:.1}%)",
                self.tiles_visited,
                self.tiles_skipped,
                100.0 * self.skipped_fraction()
            )?;
            writeln!(
                f,
                "entries           {} kept, {} skipped",
                self.entries_kept, self.entries_skipped
            )?;
            writeln!(
                f,
                "dropped mass/row  max {:.3e}, mean {:.3e}",
                self.dropped_mass_max, self.dropped_mass_mean
            )?;
        } else {
            writeln!(f, "filter            off (exact)")?;
        }
        write!(f, "workspace         {} bytes", self.workspace_bytes)
    }
}
