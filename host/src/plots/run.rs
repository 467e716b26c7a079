//! Plots of a run: where the time goes at each cut (stacked bars), the distribution of
//! end-to-end latency (empirical CDF per series), and the planner's predicted latency
//! against the measured one per cut.

use std::ops::Range;
use std::path::Path;

use cleave_common::stats::median;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{chart_on, draw_legend, draw_marked_series, refuse_empty, titled_canvas, value_range, write_svg, DrawResult, Marker, PlotError};

/// The file name of the plot of predicted against measured latency per cut.
pub const PREDICTED_VS_MEASURED: &str = "predicted_vs_measured.svg";
/// The file name of the stacked latency breakdown, a bar per cut.
pub const BREAKDOWN: &str = "latency_breakdown.svg";
/// The file name of the CDF of end-to-end latency.
pub const LATENCY_CDF: &str = "latency_cdf.svg";

/// Where one request's time went, at one cut: medians over one run with that cut, in
/// milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct CutBreakdown {
    /// The cut index (the edge ran stages `[0, cut)`).
    pub cut: usize,
    /// The bar's label on the x axis (`cut 8`, or the cut's name); `cut N` when empty.
    pub label: String,
    /// The host's prefix compute (stages `[0, cut)`).
    pub edge_ms: f64,
    /// The host's encoding of the boundary into a payload.
    pub encode_ms: f64,
    /// The network: the round trip as the host measured it, minus the server's time.
    pub network_ms: f64,
    /// The server's time: queue, decode, compute of stages `[cut, N)` and encode.
    pub server_ms: f64,
    /// The host's decoding of the result.
    pub decode_ms: f64,
}

impl CutBreakdown {
    /// The segments bottom to top, in [`SEGMENTS`]' order.
    fn segments(&self) -> [f64; 5] {
        [self.edge_ms, self.encode_ms, self.network_ms, self.server_ms, self.decode_ms]
    }

    /// The x-axis label.
    fn axis_label(&self) -> String {
        if self.label.is_empty() {
            format!("cut {}", self.cut)
        } else {
            self.label.clone()
        }
    }
}

/// The breakdown's segments, bottom to top: legend text and fill, always in this order.
const SEGMENTS: [(&str, RGBColor); 5] = [
    ("edge compute", RGBColor(31, 119, 180)),
    ("encode", RGBColor(255, 127, 14)),
    ("network", RGBColor(127, 127, 127)),
    ("server", RGBColor(44, 160, 44)),
    ("decode", RGBColor(148, 103, 189)),
];

/// Line colours of the CDF's series (and of other plots' series), reused in order past the tenth.
pub(crate) const SERIES_COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The predicted series' colour in [`plot_predicted_vs_measured`].
const PREDICTED_COLOR: RGBColor = RGBColor(255, 127, 14);
/// The measured series' colour in [`plot_predicted_vs_measured`].
const MEASURED_COLOR: RGBColor = RGBColor(31, 119, 180);

/// Plot size in pixels for the line plots.
const PLOT_SIZE: (u32, u32) = (960, 560);

/// Plots one stacked bar per cut, in the order given: edge compute, encode, network, server
/// and decode from the bottom up, in fixed colours with a legend, the total in milliseconds
/// above each bar. A non-finite or negative segment (a network estimate below zero from
/// timer noise) is drawn as zero. Refuses an empty list.
pub fn plot_breakdown(path: &Path, title: &str, cuts: &[CutBreakdown]) -> Result<(), PlotError> {
    refuse_empty(path, cuts.is_empty(), "no cuts to break down")?;
    write_svg(path, || render_breakdown(title, cuts))
}

/// Plots the empirical CDF of end-to-end latency (milliseconds across, share of requests
/// up), one step line per series with its name, count and median in the legend. Non-finite
/// latencies are skipped; a series left without any is left out. Refuses an empty list and
/// series without a single finite latency.
pub fn plot_latency_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> Result<(), PlotError> {
    refuse_empty(path, series.is_empty(), "no latency series")?;
    let sorted: Vec<(&str, Vec<f64>)> = series
        .iter()
        .map(|(name, values)| {
            let mut finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
            finite.sort_by(f64::total_cmp);
            (name.as_str(), finite)
        })
        .filter(|(_, values)| !values.is_empty())
        .collect();
    refuse_empty(path, sorted.is_empty(), "no finite latency in any series")?;
    write_svg(path, || render_cdf(title, &sorted))
}

/// Plots predicted and measured latency per cut: `points` are `(cut, predicted ms, measured
/// ms)`, drawn in cut order as two lines with markers (triangles predicted, circles
/// measured) on an axis from zero. A non-finite value breaks its line and gets no marker.
/// Refuses an empty list.
pub fn plot_predicted_vs_measured(path: &Path, title: &str, points: &[(usize, f64, f64)]) -> Result<(), PlotError> {
    refuse_empty(path, points.is_empty(), "no cuts with a prediction and a measurement")?;
    write_svg(path, || render_predicted_vs_measured(title, points))
}

/// A segment's height: the value when finite and positive, else zero.
fn drawn(value: f64) -> f64 {
    if value.is_finite() && value > 0.0 {
        value
    } else {
        0.0
    }
}

/// Draws the stacked bars into an SVG document held in memory.
fn render_breakdown(title: &str, cuts: &[CutBreakdown]) -> DrawResult<String> {
    let labels: Vec<String> = cuts.iter().map(CutBreakdown::axis_label).collect();
    let totals: Vec<f64> = cuts.iter().map(|c| c.segments().into_iter().map(drawn).sum()).collect();
    let highest = totals.iter().copied().fold(0.0, f64::max);
    // Headroom above the highest bar for its total and for the legend.
    let y_max = if highest > 0.0 { highest * 1.35 } else { 1.0 };
    // Wide enough for each bar and its label, up to a limit past which labels are thinned.
    let width = (160 + 56 * cuts.len() as u32).clamp(PLOT_SIZE.0, 2400);
    let x_range = BarSlots(cuts.len());
    let label_of = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };

    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, (width, PLOT_SIZE.1), title)?;
        let mut chart = chart_on(&root, 48).build_cartesian_2d(x_range, 0.0..y_max)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("cut")
            .y_desc("median time per request (ms)")
            .x_labels(MAX_BAR_LABELS)
            .x_label_formatter(&label_of)
            .draw()?;

        for (segment, &(name, color)) in SEGMENTS.iter().enumerate() {
            let bars = cuts.iter().enumerate().filter_map(|(i, cut)| {
                let values = cut.segments();
                let height = drawn(values[segment]);
                if height == 0.0 {
                    return None;
                }
                let bottom: f64 = values[..segment].iter().copied().map(drawn).sum();
                // A bar spans 70% of its slot.
                let x = i as f64;
                Some(Rectangle::new([(x - 0.35, bottom), (x + 0.35, bottom + height)], color.filled()))
            });
            chart.draw_series(bars)?.label(name).legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
        }
        let total_style = ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(
            totals
                .iter()
                .enumerate()
                .filter(|&(_, &t)| t > 0.0)
                .map(|(i, &total)| Text::new(format_ms(total), (i as f64, total), total_style.clone())),
        )?;
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
    }
    Ok(svg)
}

/// At most this many bars are labelled; past it, every k-th bar is.
const MAX_BAR_LABELS: usize = 40;

/// The breakdown's x axis: bar `i` is centred on `x = i` within `-0.5..n - 0.5`, and the
/// ticks (and labels) sit on bar centres only, every k-th one when the axis asks for fewer.
#[derive(Debug, Clone, Copy)]
struct BarSlots(usize);

impl Ranged for BarSlots {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let share = (value + 0.5) / self.0 as f64;
        limit.0 + (share * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let every = self.0.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0).step_by(every).map(|i| i as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..self.0 as f64 - 0.5
    }
}

/// Milliseconds with the precision a bar's total needs.
fn format_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 10.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.2}")
    }
}

/// Draws the CDF of each series (sorted, finite, non-empty) into an SVG document.
fn render_cdf(title: &str, series: &[(&str, Vec<f64>)]) -> DrawResult<String> {
    let x_range = value_range(series.iter().flat_map(|(_, values)| values.iter().copied()), None);
    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, PLOT_SIZE, title)?;
        let mut chart = chart_on(&root, 40).build_cartesian_2d(x_range, 0.0..1.02)?;
        chart
            .configure_mesh()
            .x_desc("end-to-end latency (ms)")
            .y_desc("share of requests")
            .y_label_formatter(&|y: &f64| if *y <= 1.0 { format!("{y:.1}") } else { String::new() })
            .draw()?;
        for (i, (name, values)) in series.iter().enumerate() {
            let color = SERIES_COLORS[i % SERIES_COLORS.len()];
            let style = ShapeStyle::from(color).stroke_width(2);
            let label = format!("{name} (n={}, median {} ms)", values.len(), format_ms(median(values).unwrap_or(f64::NAN)));
            chart
                .draw_series(LineSeries::new(cdf_steps(values), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        root.present()?;
    }
    Ok(svg)
}

/// The empirical CDF of sorted values as a step line: it rises by `1/n` at each value.
fn cdf_steps(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len() as f64;
    let mut points = Vec::with_capacity(2 * sorted.len());
    for (i, &x) in sorted.iter().enumerate() {
        points.push((x, i as f64 / n));
        points.push((x, (i + 1) as f64 / n));
    }
    points
}

/// Draws predicted and measured latency per cut into an SVG document.
fn render_predicted_vs_measured(title: &str, points: &[(usize, f64, f64)]) -> DrawResult<String> {
    let mut points = points.to_vec();
    points.sort_by_key(|&(cut, _, _)| cut);
    let first = points[0].0 as i64;
    let last = points[points.len() - 1].0 as i64;
    // One cut of padding on each side keeps the end markers whole; padding gets no labels.
    let x_range = (first - 1)..(last + 1);
    let cut_label = |x: &i64| {
        if (first..=last).contains(x) {
            x.to_string()
        } else {
            String::new()
        }
    };
    let predicted: Vec<(i64, f64)> = points.iter().map(|&(cut, p, _)| (cut as i64, p)).collect();
    let measured: Vec<(i64, f64)> = points.iter().map(|&(cut, _, m)| (cut as i64, m)).collect();
    // From zero, so that a gap reads at its true size, with headroom above for the legend.
    let span = value_range(predicted.iter().chain(&measured).map(|&(_, y)| y), None);
    let bottom = span.start.min(0.0);
    let y_range = bottom..span.end + 0.2 * (span.end - bottom);

    let mut svg = String::new();
    {
        let root = titled_canvas(&mut svg, PLOT_SIZE, title)?;
        let mut chart = chart_on(&root, 40).build_cartesian_2d(x_range, y_range)?;
        chart
            .configure_mesh()
            .x_desc("cut")
            .y_desc("latency per request (ms)")
            .x_labels(((last - first) as usize + 3).min(16))
            .x_label_formatter(&cut_label)
            .draw()?;
        draw_marked_series(&mut chart, &predicted, PREDICTED_COLOR, "predicted", Marker::Triangle(5))?;
        draw_marked_series(&mut chart, &measured, MEASURED_COLOR, "measured", Marker::Circle(4))?;
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn breakdown(cut: usize, label: &str, ms: [f64; 5]) -> CutBreakdown {
        CutBreakdown { cut, label: label.into(), edge_ms: ms[0], encode_ms: ms[1], network_ms: ms[2], server_ms: ms[3], decode_ms: ms[4] }
    }

    fn hex(color: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2)
    }

    /// `<rect` elements filled with `color` (bars and the legend's swatch).
    fn rects_filled(svg: &str, color: RGBColor) -> usize {
        let fill = format!("fill=\"{}\"", hex(color));
        svg.split("<rect").skip(1).filter(|el| el.split('>').next().unwrap().contains(&fill)).count()
    }

    /// `<polyline` elements stroked with `color` (series lines and the legend's sample).
    fn polylines_stroked(svg: &str, color: RGBColor) -> usize {
        let stroke = format!("stroke=\"{}\"", hex(color));
        svg.split("<polyline").skip(1).filter(|el| el.split('>').next().unwrap().contains(&stroke)).count()
    }

    fn has_text(svg: &str, text: &str) -> bool {
        svg.contains(&format!(">{text}<")) || svg.contains(&format!(">\n{text}\n<"))
    }

    fn assert_svg(svg: &str) {
        let start = svg.trim_start();
        assert!(start.starts_with("<svg") || start.starts_with("<?xml"), "not an SVG: {}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        // Degenerate ranges and skipped values must not leak into coordinates.
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "non-finite coordinate in the plot");
    }

    #[test]
    fn breakdown_has_one_stacked_bar_per_cut_and_a_legend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("breakdown.svg");
        let cuts = [
            breakdown(0, "", [0.0, 0.5, 3.0, 12.0, 0.2]),
            breakdown(8, "cut 8 (layer1.0.conv2)", [4.0, 0.8, 2.5, 8.0, 0.2]),
            breakdown(33, "cut 33", [9.0, 0.3, 1.0, 4.0, 0.2]),
        ];
        plot_breakdown(&path, "breakdown of <resnet18> & co", &cuts).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        assert!(svg.contains("&lt;resnet18&gt; &amp; co"), "title missing or unescaped");
        for text in ["edge compute", "encode", "network", "server", "decode", "cut", "cut 0", "cut 8 (layer1.0.conv2)", "cut 33"] {
            assert!(has_text(&svg, text), "no text {text:?} in the plot");
        }
        assert!(has_text(&svg, "median time per request (ms)"));
        // Each segment colour: one rect per bar with a non-zero segment, plus its legend swatch.
        let [edge, encode, network, server, decode] = SEGMENTS.map(|(_, c)| c);
        assert_eq!(rects_filled(&svg, edge), 2 + 1, "cut 0 has no edge compute");
        for color in [encode, network, server, decode] {
            assert_eq!(rects_filled(&svg, color), 3 + 1);
        }
        // Totals above the bars.
        for total in ["15.7", "15.5", "14.5"] {
            assert!(has_text(&svg, total), "no total {total}");
        }
    }

    #[test]
    fn breakdown_with_one_cut_and_non_finite_or_negative_segments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("one.svg");
        plot_breakdown(&path, "one cut", &[breakdown(4, "", [2.0, f64::NAN, -0.3, f64::INFINITY, 0.1])]).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        assert!(has_text(&svg, "cut 4"));
        let counts: Vec<usize> = SEGMENTS.iter().map(|&(_, c)| rects_filled(&svg, c)).collect();
        // Only edge compute and decode are drawn; every segment keeps its legend swatch.
        assert_eq!(counts, [2, 1, 1, 1, 2]);

        // All zero: an empty bar, still a valid plot.
        plot_breakdown(&path, "idle", &[breakdown(0, "", [0.0; 5])]).unwrap();
        assert_svg(&fs::read_to_string(&path).unwrap());
    }

    #[test]
    fn breakdown_of_many_cuts_thins_nothing_it_needs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.svg");
        let cuts: Vec<_> = (0..67).map(|i| breakdown(i, "", [i as f64 * 0.1, 0.2, 1.0, 5.0, 0.1])).collect();
        plot_breakdown(&path, "every cut", &cuts).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        assert_eq!(rects_filled(&svg, SEGMENTS[3].1), 67 + 1);
    }

    #[test]
    fn cdf_has_one_line_per_series_with_legend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cdf.svg");
        let series = vec![
            ("cut 8, lz4".to_string(), vec![12.0, 10.0, 11.0, f64::NAN, 14.0]),
            ("cut 33, zstd".to_string(), (0..100).map(|i| 8.0 + i as f64 * 0.05).collect()),
            ("nothing finite".to_string(), vec![f64::NAN, f64::INFINITY]),
        ];
        plot_latency_cdf(&path, "latency", &series).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        for text in ["end-to-end latency (ms)", "share of requests", "cut 8, lz4 (n=4, median 11.5 ms)", "cut 33, zstd (n=100, median 10.5 ms)"] {
            assert!(has_text(&svg, text), "no text {text:?} in the plot");
        }
        assert!(!svg.contains("nothing finite"), "a series without finite values has no line");
        // Each series: its line and its legend sample.
        assert_eq!(polylines_stroked(&svg, SERIES_COLORS[0]), 2);
        assert_eq!(polylines_stroked(&svg, SERIES_COLORS[1]), 2);
        assert_eq!(polylines_stroked(&svg, SERIES_COLORS[2]), 0);
    }

    #[test]
    fn cdf_steps_rise_by_one_over_n() {
        assert_eq!(cdf_steps(&[1.0, 2.0]), [(1.0, 0.0), (1.0, 0.5), (2.0, 0.5), (2.0, 1.0)]);
        assert_eq!(median(&[1.0, 2.0, 4.0]).unwrap(), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 5.0]).unwrap(), 3.0);
    }

    #[test]
    fn cdf_of_a_single_latency() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("single.svg");
        plot_latency_cdf(&path, "one request", &[("only".to_string(), vec![7.5])]).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        assert!(has_text(&svg, "only (n=1, median 7.50 ms)"));
        assert_eq!(polylines_stroked(&svg, SERIES_COLORS[0]), 2);
    }

    #[test]
    fn predicted_and_measured_are_two_lines_with_markers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pvm.svg");
        let points = [(33, 14.0, 15.5), (0, 20.0, 18.0), (8, 16.0, f64::NAN), (18, 15.0, 16.0)];
        plot_predicted_vs_measured(&path, "predicted vs measured", &points).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        for text in ["predicted", "measured", "cut", "latency per request (ms)", "0", "30"] {
            assert!(has_text(&svg, text), "no text {text:?} in the plot");
        }
        // Predicted: one line and its legend sample. Measured: the NaN at cut 8 splits the
        // line into two runs, plus the legend sample.
        assert_eq!(polylines_stroked(&svg, PREDICTED_COLOR), 2);
        assert_eq!(polylines_stroked(&svg, MEASURED_COLOR), 3);
        // One circle per finite measurement.
        assert_eq!(svg.matches("<circle").count(), 3);
    }

    #[test]
    fn predicted_and_measured_at_a_single_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("single.svg");
        plot_predicted_vs_measured(&path, "one cut", &[(5, 12.0, 12.0)]).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert_svg(&svg);
        assert!(has_text(&svg, "5"));
        assert_eq!(svg.matches("<circle").count(), 1);
    }

    #[test]
    fn empty_inputs_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.svg");
        let errors = [
            plot_breakdown(&path, "t", &[]).unwrap_err(),
            plot_latency_cdf(&path, "t", &[]).unwrap_err(),
            plot_latency_cdf(&path, "t", &[("a".to_string(), vec![]), ("b".to_string(), vec![f64::NAN])]).unwrap_err(),
            plot_predicted_vs_measured(&path, "t", &[]).unwrap_err(),
        ];
        for err in errors {
            let err = format!("{err:#}");
            assert!(err.contains("empty.svg") && err.contains("cannot plot"), "{err}");
        }
        assert!(!path.exists());
    }

    #[test]
    fn an_unwritable_path_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("plot.svg");
        let err = format!("{:#}", plot_predicted_vs_measured(&path, "t", &[(1, 1.0, 1.0)]).unwrap_err());
        assert!(err.contains("missing-dir/plot.svg"), "{err}");
    }
}
