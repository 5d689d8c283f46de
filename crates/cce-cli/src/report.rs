//! Small measuring and formatting helpers: memory, summaries, error norms, tables.

/// A `kB` field of a `/proc` file (`VmHWM`, `MemAvailable`), in bytes.
fn proc_kb(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Peak resident memory of this process (`VmHWM` of `/proc/self/status`), bytes; `None`
/// where `/proc` is unavailable.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kb("/proc/self/status", "VmHWM")
}

/// Resident memory of this process now (`VmRSS`), bytes.
pub fn rss_bytes() -> Option<u64> {
    proc_kb("/proc/self/status", "VmRSS")
}

/// What a stretch of work (one call) did to this process's resident memory: the RSS before
/// it, and its peak during it, read from `VmHWM` after the peak was reset to the current RSS
/// (`/proc/self/clear_refs`, Linux 4.0+).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RssProbe {
    /// `VmRSS` before the work.
    pub before: u64,
    /// `VmHWM` before the work (the process's peak so far).
    pub peak_before: u64,
    /// Whether the peak was reset, so that the `VmHWM` read after is the work's own peak.
    pub reset: bool,
}

/// The resident memory of a stretch of work, as [`RssProbe::finish`] measured it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RssDuring {
    /// `VmRSS` before the work.
    pub before: u64,
    /// The peak `VmRSS` during the work; when `exact` is false only a bound: the work did not
    /// pass the process's earlier peak, which is this value.
    pub peak: u64,
    /// Whether `peak` is the work's own peak (false: an upper bound).
    pub exact: bool,
    /// The process's peak over its whole life (`VmHWM` before and after).
    pub process_peak: u64,
}

impl RssDuring {
    /// `peak − before`: what the work added at its peak (or at most that when not `exact`).
    pub fn growth(&self) -> u64 {
        self.peak.saturating_sub(self.before)
    }
}

impl RssProbe {
    /// Reads the RSS and the peak so far, then resets the peak; `None` where `/proc` is
    /// unavailable.
    pub fn start() -> Option<Self> {
        let before = rss_bytes()?;
        let peak_before = peak_rss_bytes()?;
        // "5" resets the peak RSS (VmHWM) to the current RSS (proc(5), clear_refs).
        let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        Some(Self {
            before,
            peak_before,
            reset,
        })
    }

    /// The RSS before and at the peak of the work since [`RssProbe::start`].
    pub fn finish(&self) -> Option<RssDuring> {
        Some(self.during(peak_rss_bytes()?))
    }

    /// [`RssProbe::finish`] given the `VmHWM` read after the work.
    fn during(&self, peak_after: u64) -> RssDuring {
        // Without a reset, a VmHWM above the earlier peak is the work's; otherwise the work
        // stayed at or below that earlier peak, which is then only a bound.
        let exact = self.reset || peak_after > self.peak_before;
        RssDuring {
            before: self.before,
            peak: peak_after.max(self.before),
            exact,
            process_peak: peak_after.max(self.peak_before),
        }
    }
}

/// Memory this process can still get, bytes: the system's `MemAvailable` (`/proc/meminfo`),
/// or less where an address-space limit (`ulimit -v`: "Max address space" of
/// `/proc/self/limits`, soft) leaves less room above the process's `VmSize`.
pub fn available_memory_bytes() -> Option<u64> {
    let system = proc_kb("/proc/meminfo", "MemAvailable");
    let room = address_space_limit().map(|limit| {
        let used = proc_kb("/proc/self/status", "VmSize").unwrap_or(0);
        limit.saturating_sub(used)
    });
    match (system, room) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The soft address-space limit of this process (`/proc/self/limits`), bytes; `None` when
/// unlimited or unknown.
fn address_space_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `1536` -> `"1.5 KiB"`.
pub fn fmt_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// Minimum, mean and maximum of some values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Smallest value.
    pub min: f64,
    /// Mean.
    pub mean: f64,
    /// Largest value.
    pub max: f64,
}

/// Summary of the values (`None` when empty).
pub fn summary(values: impl IntoIterator<Item = f64>) -> Option<Summary> {
    let (mut min, mut max, mut sum, mut k) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0usize);
    for x in values {
        min = min.min(x);
        max = max.max(x);
        sum += x;
        k += 1;
    }
    (k > 0).then(|| Summary {
        min,
        mean: sum / k as f64,
        max,
    })
}

/// How far a computed output is from the oracle.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ErrStats {
    /// `‖got − want‖₂ / ‖want‖₂` (the absolute L2 error when `want` is all zero).
    pub rel_l2: f64,
    /// `max |got − want| / max |want|` (absolute when `want` is all zero).
    pub rel_max: f64,
    /// `max |got − want|`.
    pub max_abs: f64,
    /// Flat index of the largest `|got − want|`.
    pub worst: usize,
}

/// Error of `got` against the f64 oracle `want` (same length; extra elements are ignored).
pub fn err_stats(got: &[f32], want: &[f64]) -> ErrStats {
    let (mut d2, mut w2, mut max_abs, mut max_w, mut worst) = (0.0, 0.0, 0.0f64, 0.0f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let diff = (g as f64 - w).abs();
        d2 += diff * diff;
        w2 += w * w;
        max_w = max_w.max(w.abs());
        // NaN differences count as the worst.
        if diff > max_abs || diff.is_nan() && !max_abs.is_nan() {
            max_abs = diff;
            worst = i;
        }
    }
    let rel = |a: f64, b: f64| if b > 0.0 { a / b } else { a };
    ErrStats {
        rel_l2: rel(d2.sqrt(), w2.sqrt()),
        rel_max: rel(max_abs, max_w),
        max_abs,
        worst,
    }
}

/// A text table with a header row, printed with aligned columns in Markdown pipe syntax.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (missing cells are blank).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders the table: first column left-aligned, the others right-aligned.
    pub fn render(&self) -> String {
        let ncol = self.header.len();
        let cell = |r: &Vec<String>, j: usize| r.get(j).cloned().unwrap_or_default();
        let width: Vec<usize> = (0..ncol)
            .map(|j| {
                self.rows
                    .iter()
                    .map(|r| cell(r, j).chars().count())
                    .chain([self.header[j].chars().count(), 3])
                    .max()
                    .unwrap_or(3)
            })
            .collect();
        let line = |cells: Vec<String>| {
            let mut s = String::from("|");
            for (j, c) in cells.iter().enumerate() {
                let pad = width[j] - c.chars().count();
                if j == 0 {
                    s.push_str(&format!(" {c}{} |", " ".repeat(pad)));
                } else {
                    s.push_str(&format!(" {}{c} |", " ".repeat(pad)));
                }
            }
            s
        };
        let mut out = line(self.header.clone());
        out.push('\n');
        let mut sep = String::from("|");
        for (j, w) in width.iter().enumerate() {
            if j == 0 {
                sep.push_str(&format!(" {} |", "-".repeat(*w)));
            } else {
                sep.push_str(&format!(" {}: |", "-".repeat(w - 1)));
            }
        }
        out.push_str(&sep);
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line((0..ncol).map(|j| cell(r, j)).collect()));
        }
        out
    }
}

/// A duration in milliseconds for a human: one decimal from 10 ms, two from 0.1 ms, else
/// microseconds (a tiny problem's forward is not "0.0 ms").
pub fn fmt_ms(ms: f64) -> String {
    if ms >= 10.0 {
        format!("{ms:.1} ms")
    } else if ms >= 0.1 {
        format!("{ms:.2} ms")
    } else {
        format!("{:.1} µs", ms * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_keep_their_digits() {
        assert_eq!(fmt_ms(1234.56), "1234.6 ms");
        assert_eq!(fmt_ms(4.567), "4.57 ms");
        assert_eq!(fmt_ms(0.0421), "42.1 µs");
        assert_eq!(fmt_ms(0.0), "0.0 µs");
    }

    #[test]
    fn errors_and_summaries() {
        let e = err_stats(&[1.0, 2.0, 3.5], &[1.0, 2.0, 3.0]);
        assert_eq!(e.worst, 2);
        assert!((e.max_abs - 0.5).abs() < 1e-12);
        assert!((e.rel_max - 0.5 / 3.0).abs() < 1e-12);
        let s = summary([1.0, 2.0, 6.0]).unwrap();
        assert_eq!((s.min, s.mean, s.max), (1.0, 3.0, 6.0));
        assert!(summary(std::iter::empty()).is_none());
        assert_eq!(fmt_bytes(1536), "1.5 KiB");
        assert_eq!(fmt_bytes(12), "12 B");
    }

    #[test]
    fn table_is_aligned_markdown() {
        let mut t = Table::new(&["case", "ms"]);
        t.row(vec!["regular".into(), "1.5".into()]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.len() == lines[0].len()));
        assert!(lines[1].contains("-:"));
    }

    #[test]
    fn peak_rss_is_read() {
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(peak_rss_bytes().unwrap() > 0);
            assert!(rss_bytes().unwrap() > 0);
        }
    }

    #[test]
    fn a_call_rss_is_exact_after_a_reset_or_a_new_peak() {
        let mib = 1u64 << 20;
        let probe = |reset| RssProbe {
            before: 100 * mib,
            peak_before: 300 * mib,
            reset,
        };
        // Reset: the peak read after is the call's own, even under the earlier peak.
        let d = probe(true).during(250 * mib);
        assert!(d.exact);
        assert_eq!((d.growth(), d.process_peak), (150 * mib, 300 * mib));
        // No reset, a new peak: the call's.
        let d = probe(false).during(400 * mib);
        assert!(d.exact);
        assert_eq!((d.growth(), d.process_peak), (300 * mib, 400 * mib));
        // No reset, no new peak: only a bound.
        let d = probe(false).during(300 * mib);
        assert!(!d.exact);
        assert_eq!(d.growth(), 200 * mib);
    }

    #[test]
    fn the_peak_of_an_allocation_is_measured() {
        let Some(probe) = RssProbe::start() else {
            return; // no /proc
        };
        // 64 MiB touched page by page, then freed.
        let mut v = vec![0u8; 64 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        drop(v);
        let d = probe.finish().unwrap();
        if d.exact {
            assert!(d.growth() >= 60 << 20, "{d:?}");
        }
        assert!(d.process_peak >= d.peak);
    }
}
