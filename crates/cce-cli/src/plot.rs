//! The plot of `cce repro --plot`: time and kept fraction against mean softmax entropy
//! (plotters, bitmap backend, PNG).

use std::path::Path;

use plotters::prelude::*;

use crate::error::{CliError, CliResult};

/// One case on the plot.
#[derive(Clone, Debug)]
pub struct Point {
    /// Case label.
    pub label: String,
    /// Mean softmax entropy, nats (x axis).
    pub entropy: f64,
    /// Forward + backward time, ms.
    pub time_ms: f64,
    /// Fraction of backward tiles computed (not skipped), in [0, 1].
    pub tiles_kept: f64,
    /// Fraction of entries computed, in [0, 1].
    pub entries_kept: f64,
}

fn perr(e: impl std::fmt::Display) -> CliError {
    CliError::msg(e.to_string())
}

/// Vertical label offsets (in lines) so that labels of nearby points do not overlap.
fn label_offsets(xy: &[(f64, f64)], x_span: f64, y_span: f64) -> Vec<i32> {
    let mut off = vec![0i32; xy.len()];
    for k in 0..xy.len() {
        let near = |j: usize| {
            ((xy[j].0 - xy[k].0) / x_span).abs() < 0.08
                && ((xy[j].1 - xy[k].1) / y_span).abs() < 0.06
        };
        let mut o = 0;
        while (0..k).any(|j| near(j) && off[j] == o) {
            o += 1;
        }
        off[k] = o;
    }
    off
}

/// Draws the two panels into a 1280 x 560 PNG at `path`.
///
/// Errors: the file cannot be written, or no font is available for the text.
pub fn draw(path: &Path, title: &str, pts: &[Point]) -> CliResult<()> {
    let finite = |x: f64| if x.is_finite() { x } else { 0.0 };
    let x_max = pts.iter().map(|p| finite(p.entropy)).fold(0.5f64, f64::max) * 1.2;
    let t_max = pts
        .iter()
        .map(|p| finite(p.time_ms))
        .fold(1e-3f64, f64::max)
        * 1.25;
    // The text font is embedded (DejaVu Sans, licence in assets/DejaVuSans.LICENSE), so the
    // binary needs no fontconfig or freetype on the machine it runs on.
    static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| perr("the embedded font could not be parsed"))?;
    let font = |size: u32| ("sans-serif", size).into_font();

    let root = BitMapBackend::new(path, (1280, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(perr)?;
    let root = root.titled(title, font(24)).map_err(perr)?;
    let (left, right) = root.split_horizontally(640);

    // Left: time against entropy.
    let mut ch = ChartBuilder::on(&left)
        .margin(20)
        .caption("forward + backward time (median)", font(19))
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..t_max)
        .map_err(perr)?;
    ch.configure_mesh()
        .max_light_lines(4)
        .x_desc("mean softmax entropy (nats)")
        .y_desc("time (ms)")
        .y_label_formatter(&|y| {
            if t_max >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.2}")
            }
        })
        .label_style(font(14))
        .axis_desc_style(font(16))
        .draw()
        .map_err(perr)?;
    let xy: Vec<(f64, f64)> = pts
        .iter()
        .map(|p| (finite(p.entropy), finite(p.time_ms)))
        .collect();
    let off = label_offsets(&xy, x_max, t_max);
    ch.draw_series(pts.iter().zip(&xy).zip(&off).map(|((p, &c), &o)| {
        EmptyElement::at(c)
            + Circle::new((0, 0), 5, BLUE.filled())
            + Text::new(p.label.clone(), (8, -18 + 16 * o), font(15))
    }))
    .map_err(perr)?;

    // Right: kept fractions against entropy.
    let mut ch = ChartBuilder::on(&right)
        .margin(20)
        .caption("computed in the backward", font(19))
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..110f64)
        .map_err(perr)?;
    ch.configure_mesh()
        .max_light_lines(4)
        .x_desc("mean softmax entropy (nats)")
        .y_desc("kept (%)")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(font(14))
        .axis_desc_style(font(16))
        .draw()
        .map_err(perr)?;
    let tiles: Vec<(f64, f64)> = pts
        .iter()
        .map(|p| (finite(p.entropy), 100.0 * finite(p.tiles_kept)))
        .collect();
    let off = label_offsets(&tiles, x_max, 110.0);
    ch.draw_series(pts.iter().zip(&tiles).zip(&off).map(|((p, &c), &o)| {
        EmptyElement::at(c)
            + Circle::new((0, 0), 5, RED.filled())
            + Text::new(p.label.clone(), (8, -18 + 16 * o), font(15))
    }))
    .map_err(perr)?
    .label("tiles kept")
    .legend(|(x, y)| Circle::new((x, y), 5, RED.filled()));
    ch.draw_series(pts.iter().map(|p| {
        TriangleMarker::new(
            (finite(p.entropy), 100.0 * finite(p.entries_kept)),
            6,
            GREEN.filled(),
        )
    }))
    .map_err(perr)?
    .label("entries kept")
    .legend(|(x, y)| TriangleMarker::new((x, y), 6, GREEN.filled()));
    ch.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(font(15))
        .draw()
        .map_err(perr)?;
    root.present().map_err(perr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::label_offsets;

    #[test]
    fn near_labels_are_staggered() {
        let off = label_offsets(
            &[(0.0, 1.0), (0.01, 1.0), (2.0, 1.0), (0.02, 1.01)],
            3.0,
            2.0,
        );
        assert_eq!(off, vec![0, 1, 0, 2]);
    }
}
