//! The device status of a backend: what `kernels/prepare.cu` finds about a call (its valid
//! rows, the first bad row of each check, the filter's counts) and the first error since the
//! host last looked, decoded here into a [`DeviceReport`] or a typed error.
//!
//! The buffer is `STATUS_BYTES` of device memory per backend. The checks and the decoding are
//! split so that a call enqueues no host read: under [`Checks::Deferred`] the status is read
//! only when the caller asks ([`CudaBackend::status`]); under [`Checks::Eager`] every call
//! reads it before returning (one stream synchronization per check point).

use super::*;

/// Bytes of a backend's status buffer (`u32 [64]`, layout in `kernels/prepare.cu`).
pub(super) const STATUS_BYTES: usize = 256;

/// Bytes of the call area, zeroed at the start of every call (the sticky record after it).
pub(super) const CALL_AREA_BYTES: usize = 128;

/// Byte offset of the filter statistics (`f64 [5]`, written by `cce_dense_stats`).
pub(crate) const STATS_OFFSET: usize = 64;

/// Word slots of the call area that `cce_check_rows_finite` fills (`kernels/prepare.cu`).
pub(super) const SLOT_LSE: i32 = 5;
pub(super) const SLOT_D_LOSS: i32 = 6;
pub(super) const SLOT_D_LSE: i32 = 7;

const KIND: usize = 32;

/// When a call's device-side checks reach the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Checks {
    /// Every call synchronizes its stream at its check points (after the targets are
    /// prepared, after the lse is computed when `check_finite`) and returns the typed error
    /// at once, naming the first bad row as the CPU backend does; the statistics are complete.
    /// The default of a backend on its own stream ([`CudaBackend::new`]).
    #[default]
    Eager,
    /// No call reads the device: the checks run on the device, a failed one records its error
    /// (the first since the last read) in the backend's status, and the loss kernels never
    /// read past a buffer (a bad target is treated as ignored); while the status holds an
    /// error the host has not read, a mean or sum loss is NaN (that call's and every later
    /// one's, so that a failed check is never a silent wrong loss; per-row losses of
    /// `Reduction::None` are not marked). [`CudaBackend::status`] reads
    /// the status: the recorded error, or the last call's valid rows and filter counts. The
    /// statistics a call returns carry 0 for those device-side counts. Calls can be captured
    /// in a CUDA graph. The default of a backend on a caller's stream
    /// ([`CudaBackend::on_stream`], [`CudaBackend::on_raw_stream`]).
    Deferred,
}

/// What the device knows of the last call (read by [`CudaBackend::status`]).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct DeviceReport {
    /// Rows with a valid target.
    pub n_valid: usize,
    /// The gradient filter's counts of the last filtered backward (dense passes), when one ran.
    pub filter: Option<FilterCounts>,
}

/// The filter's raw counts (`cce_dense_stats`): per pass, summed over rows.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct FilterCounts {
    /// Entries kept over active rows.
    pub kept: f64,
    /// Sum of the per-row dropped mass over valid rows.
    pub dropped_sum: f64,
    /// Largest per-row dropped mass.
    pub dropped_max: f64,
    /// Tiles visited.
    pub tiles_visited: f64,
    /// Rows with a nonzero upstream gradient.
    pub active_rows: f64,
}

/// The status buffer's words (little-endian `u32`).
pub(super) fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i64_at(w: &[u32], i: usize) -> i64 {
    (w[i] as u64 | ((w[i + 1] as u64) << 32)) as i64
}

fn f64_at(w: &[u32], i: usize) -> f64 {
    f64::from_bits(w[i] as u64 | ((w[i + 1] as u64) << 32))
}

/// The typed error of the sticky record, `None` when it holds none. Pure: the layout of
/// `kernels/prepare.cu`.
pub(super) fn recorded_error(w: &[u32]) -> Option<CceError> {
    let row = w[KIND + 1] as usize;
    let value = i64_at(w, KIND + 2);
    let vocab_size = w[KIND + 4] as usize;
    let ignore_index = i64_at(w, KIND + 5);
    let n = w[KIND + 7] as usize;
    let shift = (w[KIND + 8] as u64 | (w[KIND + 11] as u64) << 32) as usize;
    let label_smoothing = f32::from_bits(w[KIND + 9]);
    let fvalue = f32::from_bits(w[KIND + 10]);
    let non_finite = |what| CceError::NonFinite {
        what,
        index: row,
        row,
        value: fvalue,
    };
    Some(match w[KIND] {
        0 => return None,
        1 => CceError::TargetOutOfRange {
            row,
            value,
            vocab_size,
            ignore_index,
        },
        2 => CceError::AllTargetsIgnored {
            n,
            ignore_index,
            shift,
        },
        3 => CceError::TargetMasked { row, target: value },
        4 => CceError::InvalidOption {
            name: "label_smoothing",
            reason: format!(
                "row {row} has a class masked by a -inf logit; label smoothing \
                 {label_smoothing} puts {label_smoothing}/V on every class, masked ones too, so \
                 the loss would be infinite"
            ),
        },
        5 => non_finite("lse (the logits overflow)"),
        6 => non_finite("d_loss"),
        7 => non_finite("d_lse"),
        k => CceError::backend(BACKEND, format!("unknown device status {k}")),
    })
}

/// The call area as a report. `filtered`: the last call wrote filter counts.
pub(super) fn report(w: &[u32], filtered: bool) -> DeviceReport {
    let s = STATS_OFFSET / 4;
    DeviceReport {
        n_valid: w[0] as usize,
        filter: filtered.then(|| FilterCounts {
            kept: f64_at(w, s),
            dropped_sum: f64_at(w, s + 2),
            dropped_max: f64_at(w, s + 4),
            tiles_visited: f64_at(w, s + 6),
            active_rows: f64_at(w, s + 8),
        }),
    }
}

/// `stats` completed with the device's counts: the valid rows, and for a backward's
/// statistics (`backward_v`: `Some(V)`) the filter's counts when the report has them
/// (`tiles_total` of `stats` is the plan's).
pub(super) fn complete_stats(stats: &mut CallStats, r: &DeviceReport, backward_v: Option<usize>) {
    stats.n_valid = r.n_valid;
    let (Some(f), Some(v)) = (r.filter, backward_v) else {
        return;
    };
    let v = v as u64;
    let kept = f.kept as u64;
    let entries = f.active_rows as u64 * v;
    stats.entries_kept = 2 * kept;
    stats.entries_skipped = 2 * entries.saturating_sub(kept);
    let visited = f.tiles_visited as u64;
    stats.tiles_visited = 2 * visited;
    stats.tiles_skipped = 2 * stats.tiles_total.saturating_sub(visited);
    stats.dropped_mass_max = f.dropped_max;
    stats.dropped_mass_mean = if r.n_valid > 0 {
        (f.dropped_sum / r.n_valid as f64).min(f.dropped_max)
    } else {
        0.0
    };
}

impl CudaBackend {
    /// The status buffer's device address.
    pub(super) fn status_ptr(&self) -> u64 {
        self.ptr(&self.status)
    }

    /// Zero the call area (the start of a call's checks).
    pub(super) fn begin_call_status(&self) -> Result<()> {
        self.zero_status(0, CALL_AREA_BYTES)
    }

    /// Zero bytes `from..to` of the status buffer, on the backend's stream.
    fn zero_status(&self, from: usize, to: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `from..to` lies inside the backend's own status buffer (STATUS_BYTES long,
        // alive as long as `self`); the memset is enqueued on the backend's stream, after and
        // before every kernel that reads or writes the buffer, in program order.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.status_ptr() + from as u64,
                0,
                to - from,
                self.stream.cu_stream(),
            )
        }
        .map_err(drv)
    }

    /// Read the status buffer (one stream synchronization). Returns its words.
    fn read_status_words(&self) -> Result<Vec<u32>> {
        let mut host = vec![0u8; STATUS_BYTES];
        self.stream
            .memcpy_dtoh(&self.status.slice(0..STATUS_BYTES), &mut host[..])
            .map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        Ok(words(&host))
    }

    /// Clear the sticky record after it was read.
    fn clear_record(&self) -> Result<()> {
        self.zero_status(CALL_AREA_BYTES, STATUS_BYTES)
    }

    /// Wait for the backend's stream and read its device status: the first error any call
    /// recorded since the last read (then cleared), else what the device knows of the last
    /// call. Under [`Checks::Deferred`] this is where a call's bad input is reported; the
    /// filter counts are those of the last call that filtered.
    ///
    /// Errors: the recorded error (`TargetOutOfRange`, `AllTargetsIgnored`, `TargetMasked`,
    /// `InvalidOption` for label smoothing over a masked class, `NonFinite` for d_loss, d_lse
    /// or the lse), or `Backend` for a driver error.
    pub fn status(&self) -> Result<DeviceReport> {
        let w = self.read_status_words()?;
        if let Some(e) = recorded_error(&w) {
            self.clear_record()?;
            return Err(e);
        }
        Ok(report(
            &w,
            self.last_filtered
                .load(std::sync::atomic::Ordering::Relaxed),
        ))
    }

    /// Under [`Checks::Eager`], read the status now: the recorded error, else the report.
    /// `None` under [`Checks::Deferred`] (nothing is read).
    pub(super) fn eager_status(&self) -> Result<Option<DeviceReport>> {
        match self.checks {
            Checks::Eager => self.status().map(Some),
            Checks::Deferred => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32, row: u32, value: i64) -> Vec<u32> {
        let mut w = vec![0u32; STATUS_BYTES / 4];
        w[KIND] = kind;
        w[KIND + 1] = row;
        w[KIND + 2] = value as u64 as u32;
        w[KIND + 3] = ((value as u64) >> 32) as u32;
        w[KIND + 4] = 50;
        w[KIND + 5] = (-100i64) as u64 as u32;
        w[KIND + 6] = ((-100i64) as u64 >> 32) as u32;
        w[KIND + 7] = 8;
        w[KIND + 8] = 1;
        w[KIND + 11] = 0;
        w[KIND + 9] = 0.1f32.to_bits();
        w[KIND + 10] = f32::NAN.to_bits();
        w
    }

    #[test]
    fn each_recorded_kind_decodes_to_its_typed_error() {
        assert!(recorded_error(&vec![0; 64]).is_none());
        match recorded_error(&record(1, 3, -7)) {
            Some(CceError::TargetOutOfRange {
                row: 3,
                value: -7,
                vocab_size: 50,
                ignore_index: -100,
            }) => {}
            e => panic!("{e:?}"),
        }
        match recorded_error(&record(2, 0, 0)) {
            Some(CceError::AllTargetsIgnored {
                n: 8,
                ignore_index: -100,
                shift: 1,
            }) => {}
            e => panic!("{e:?}"),
        }
        let mut max_shift = record(2, 0, 0);
        max_shift[KIND + 8] = u32::MAX;
        max_shift[KIND + 11] = u32::MAX;
        match recorded_error(&max_shift) {
            Some(CceError::AllTargetsIgnored { shift, .. }) => assert_eq!(shift, usize::MAX),
            e => panic!("{e:?}"),
        }
        match recorded_error(&record(3, 5, 9)) {
            Some(CceError::TargetMasked { row: 5, target: 9 }) => {}
            e => panic!("{e:?}"),
        }
        match recorded_error(&record(4, 2, 0)) {
            Some(CceError::InvalidOption { name, reason }) => {
                assert_eq!(name, "label_smoothing");
                assert!(reason.starts_with("row 2 "), "{reason}");
            }
            e => panic!("{e:?}"),
        }
        for (kind, what) in [
            (5, "lse (the logits overflow)"),
            (6, "d_loss"),
            (7, "d_lse"),
        ] {
            match recorded_error(&record(kind, 4, 0)) {
                Some(CceError::NonFinite {
                    what: w, row: 4, ..
                }) => assert_eq!(w, what),
                e => panic!("{e:?}"),
            }
        }
    }

    #[test]
    fn filter_counts_complete_the_statistics() {
        let mut w = vec![0u32; STATUS_BYTES / 4];
        w[0] = 10;
        let s = STATS_OFFSET / 4;
        for (k, x) in [40.0f64, 0.5, 0.1, 3.0, 10.0].into_iter().enumerate() {
            w[s + 2 * k] = x.to_bits() as u32;
            w[s + 2 * k + 1] = (x.to_bits() >> 32) as u32;
        }
        let r = report(&w, true);
        let mut stats = CallStats {
            backend: "cuda".into(),
            strategy: cce_core::Strategy::TileOwnership,
            plan_reason: String::new(),
            n_valid: 0,
            tiles_total: 8,
            tiles_visited: 0,
            tiles_skipped: 0,
            entries_kept: 0,
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: 0.0,
            max_dropped_mass: 0.0,
            workspace_bytes: 0,
        };
        let mut forward = stats.clone();
        complete_stats(&mut forward, &r, None);
        assert_eq!((forward.n_valid, forward.entries_kept), (10, 0));
        complete_stats(&mut stats, &r, Some(100));
        assert_eq!(stats.n_valid, 10);
        assert_eq!(stats.entries_kept, 80);
        assert_eq!(stats.entries_skipped, 2 * (1000 - 40));
        assert_eq!((stats.tiles_visited, stats.tiles_skipped), (6, 10));
        assert_eq!(stats.dropped_mass_max, 0.1);
        assert!((stats.dropped_mass_mean - 0.05).abs() < 1e-12);
        assert_eq!(report(&w, false).filter, None);
    }
}
