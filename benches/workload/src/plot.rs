//! The Pareto chart of a concurrency sweep, as SVG and PNG.
//!
//! x is the median output tokens/s per user (after the first token), y the tokens/min per
//! GPU; each point is labelled with its concurrency and the Pareto frontier
//! ([`pareto_front`]) is drawn as a line, the chart inference-serving write-ups use to
//! trade interactivity against throughput. Several sweeps (configurations) share one chart
//! as series of their own colour, with a legend ([`write_pareto_series`]). Text is drawn
//! with DejaVu Sans embedded in the binary (plotters' `ab_glyph` font backend), so no
//! system font library is needed.
use crate::error::WorkloadError;
use crate::metrics::{pareto_front, PointSummary};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// Pixel size of the chart.
const SIZE: (u32, u32) = (960, 640);

/// One sweep on a chart: its legend label and its points.
pub struct Series {
    pub label: String,
    pub points: Vec<PointSummary>,
}

/// Writes the chart of one sweep as `path` with an `.svg` and a `.png` extension
/// (whichever `path` has, plus the other); returns the files written.
pub fn write_pareto(
    points: &[PointSummary],
    title: &str,
    path: &Path,
) -> Result<Vec<PathBuf>, WorkloadError> {
    let series = [Series {
        label: String::new(),
        points: points.to_vec(),
    }];
    write_pareto_series(&series, title, path)
}

/// [`write_pareto`] for several sweeps, each in its own colour with its frontier, named in
/// a legend (series with an empty label stay out of it).
pub fn write_pareto_series(
    series: &[Series],
    title: &str,
    path: &Path,
) -> Result<Vec<PathBuf>, WorkloadError> {
    register_embedded_font();
    let (svg, png) = (path.with_extension("svg"), path.with_extension("png"));
    let err = |p: &Path| {
        let path = p.display().to_string();
        move |e: String| WorkloadError::Plot { path, reason: e }
    };
    draw(
        SVGBackend::new(&svg, SIZE).into_drawing_area(),
        series,
        title,
    )
    .map_err(err(&svg))?;
    draw(
        BitMapBackend::new(&png, SIZE).into_drawing_area(),
        series,
        title,
    )
    .map_err(err(&png))?;
    Ok(vec![svg, png])
}

fn register_embedded_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans is a valid TrueType font, so registration cannot fail.
        let _ = register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// `(x, y)` of a point on the chart.
fn xy(p: &PointSummary) -> (f64, f64) {
    let x = p.output_tps_per_user.map_or(0.0, |d| d.p50);
    (x, p.tokens_per_min_per_gpu)
}

fn draw<DB: DrawingBackend>(
    area: DrawingArea<DB, Shift>,
    series: &[Series],
    title: &str,
) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Debug| format!("{x:?}");
    area.fill(&WHITE).map_err(|x| e(&x))?;
    let all = || series.iter().flat_map(|s| &s.points);
    let max = |f: fn((f64, f64)) -> f64| all().map(|p| f(xy(p))).fold(0.0, f64::max);
    let (x_max, y_max) = (nice_max(max(|v| v.0)), nice_max(max(|v| v.1)));
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("output tokens/s per user (median, after the first token)")
        .y_desc("tokens/min per GPU (prompt + output)")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .y_label_formatter(&|v| human(*v))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, s) in series.iter().enumerate() {
        let colour = if series.len() == 1 {
            BLUE.to_rgba()
        } else {
            Palette99::pick(i).to_rgba()
        };
        let front: Vec<(f64, f64)> = pareto_front(&s.points)
            .into_iter()
            .map(|i| xy(&s.points[i]))
            .collect();
        let line = chart
            .draw_series(LineSeries::new(front, colour.stroke_width(2)))
            .map_err(|x| e(&x))?;
        if !s.label.is_empty() {
            line.label(s.label.as_str()).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        }
        let dot = if series.len() == 1 {
            RED.to_rgba()
        } else {
            colour
        };
        chart
            .draw_series(s.points.iter().map(|p| {
                let label = Text::new(p.label(), (8, -18), ("sans-serif", 14));
                EmptyElement::at(xy(p)) + Circle::new((0, 0), 5, dot.filled()) + label
            }))
            .map_err(|x| e(&x))?;
    }
    if series.iter().any(|s| !s.label.is_empty()) {
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|x| e(&x))?;
    }
    area.present().map_err(|x| e(&x))
}

/// An axis end a little above `v` (1 when there is no data).
fn nice_max(v: f64) -> f64 {
    if v > 0.0 {
        v * 1.15
    } else {
        1.0
    }
}

fn human(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e3 => format!("{:.0}k", v / 1e3),
        _ => format!("{v:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{summarize, Distribution};

    #[test]
    fn a_sweep_is_drawn_as_svg_and_png_with_concurrency_labels() {
        let points: Vec<PointSummary> = [(1, 80.0, 2.0e5), (4, 60.0, 6.0e5), (16, 25.0, 1.1e6)]
            .iter()
            .map(|&(c, tps, tpm)| {
                let mut s = summarize(c, 1, 1.0, &[]);
                s.output_tps_per_user = Distribution::of([tps]);
                s.tokens_per_min_per_gpu = tpm;
                s
            })
            .collect();
        let dir = std::env::temp_dir().join(format!("kiln-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = write_pareto(&points, "test sweep", &dir.join("pareto.svg")).unwrap();
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        for label in ["c=1", "c=4", "c=16", "test sweep"] {
            assert!(svg.contains(label), "{label} missing from the SVG");
        }
        let png = std::fs::read(&files[1]).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 5_000, "PNG of {} bytes has no chart", png.len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn several_sweeps_share_a_chart_with_a_legend() {
        let sweep = |scale: f64| -> Vec<PointSummary> {
            [(1, 80.0, 2.0e5), (8, 40.0, 9.0e5)]
                .iter()
                .map(|&(c, tps, tpm)| {
                    let mut s = summarize(c, 1, 1.0, &[]);
                    s.output_tps_per_user = Distribution::of([tps * scale]);
                    s.tokens_per_min_per_gpu = tpm * scale;
                    s
                })
                .collect()
        };
        let series = [
            Series {
                label: "TP1 bf16 KV".into(),
                points: sweep(1.0),
            },
            Series {
                label: "TP4 rank fp8 KV".into(),
                points: sweep(1.7),
            },
        ];
        let dir = std::env::temp_dir().join(format!("kiln-plot-series-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = write_pareto_series(&series, "two sweeps", &dir.join("c.svg")).unwrap();
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        for label in ["TP1 bf16 KV", "TP4 rank fp8 KV", "c=8", "two sweeps"] {
            assert!(svg.contains(label), "{label} missing from the SVG");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
