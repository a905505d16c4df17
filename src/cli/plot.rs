//! The binary's SVG charts, in one look: the loss curve of `train --plot` and the bar panels of
//! `report`. Each is drawn to a string, so that `report --check` can compare a chart with the
//! committed file byte for byte (plotters' SVG backend, with its font-free text layout, writes
//! the same bytes for the same chart on every machine).

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Width of every chart, in pixels.
const WIDTH: u32 = 720;
/// The font of titles, labels and values.
const FONT: &str = "sans-serif";
/// Height of one bar's row, in pixels.
const ROW: u32 = 24;

/// Plotters could not draw a chart (its errors borrow the backend, so only their text is kept).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DrawError(String);

fn fail(e: impl std::fmt::Display) -> DrawError {
    DrawError(e.to_string())
}

/// A line chart of `points` (x, y) under `title`, its axes described by `x_desc` and `y_desc`,
/// the y axis from zero.
pub fn line_chart(title: &str, (x_desc, y_desc): (&str, &str), points: &[(usize, f64)]) -> Result<String, DrawError> {
    let mut svg = String::new();
    {
        let last = points.last().map_or(1, |p| p.0.max(1));
        let top = points.iter().map(|p| p.1).fold(0.0f64, f64::max).max(1e-3);
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(fail)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(0..last, 0.0..top * 1.05)
            .map_err(fail)?;
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(fail)?;
        chart.draw_series(LineSeries::new(points.iter().copied(), &BLUE)).map_err(fail)?;
        root.present().map_err(fail)?;
    }
    Ok(svg)
}

/// Bars in panels, one panel above the other, each with its own axis from zero: a benchmark's
/// variants (the bars) per configuration (the panels).
#[derive(Debug, Clone, PartialEq)]
pub struct Bars {
    /// Above the panels.
    pub title: String,
    /// Top to bottom.
    pub panels: Vec<Panel>,
}

/// One group of bars sharing an axis.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// Above the panel, e.g. the configuration.
    pub title: String,
    /// The axis' description, with the unit, e.g. `wall ms per step`.
    pub unit: String,
    /// Top to bottom.
    pub bars: Vec<Bar>,
}

/// One bar: graphed's in blue, a reference's (PyTorch, raw cudarc, the driver) in orange.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// Beside the bar.
    pub label: String,
    /// Its length: finite, at least zero.
    pub value: f64,
    /// Whether it measures a reference rather than graphed.
    pub reference: bool,
}

impl Bar {
    /// A bar of graphed's.
    pub fn ours(label: impl Into<String>, value: f64) -> Bar {
        Bar { label: label.into(), value, reference: false }
    }

    /// A bar of a reference's.
    pub fn theirs(label: impl Into<String>, value: f64) -> Bar {
        Bar { label: label.into(), value, reference: true }
    }
}

const OURS: RGBColor = RGBColor(49, 104, 176);
const THEIRS: RGBColor = RGBColor(230, 128, 38);

/// Draws `bars` as horizontal bars, each labelled with its value.
pub fn bar_chart(bars: &Bars) -> Result<String, DrawError> {
    let widest = bars.panels.iter().flat_map(|p| &p.bars).map(|b| b.label.chars().count()).max().unwrap_or(0);
    let heights: Vec<u32> = bars.panels.iter().map(|p| 70 + ROW * p.bars.len() as u32).collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 40 + heights.iter().sum::<u32>())).into_drawing_area();
        root.fill(&WHITE).map_err(fail)?;
        let mut rest = root.titled(&bars.title, (FONT, 18)).map_err(fail)?;
        for (panel, height) in bars.panels.iter().zip(&heights) {
            let (area, below) = rest.split_vertically(*height);
            draw_panel(&area, panel, 16 + 7 * widest as u32)?;
            rest = below;
        }
        root.present().map_err(fail)?;
    }
    Ok(svg)
}

/// One panel: bar i at the top when i = 0, its value written after its end.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
    label_width: u32,
) -> Result<(), DrawError> {
    let n = panel.bars.len() as i32;
    let top = panel.bars.iter().map(|b| b.value).fold(0.0f64, f64::max);
    // Room after the longest bar for its value.
    let top = if top > 0.0 { top * 1.2 } else { 1.0 };
    // Bar i is centred at y = n - 1 - i, so that the first is at the top and the axis' whole
    // numbers label the bars.
    let label_of = |y: &f64| match y.fract() == 0.0 && (0.0..f64::from(n)).contains(y) {
        true => panel.bars.get((n - 1) as usize - *y as usize).map_or(String::new(), |b| b.label.clone()),
        false => String::new(),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FONT, 15))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(label_width)
        .build_cartesian_2d(0.0..top, -0.5..f64::from(n) - 0.5)
        .map_err(fail)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(panel.bars.len())
        .y_label_formatter(&label_of)
        .x_label_formatter(&|x| tick(*x))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 12))
        .x_desc(panel.unit.as_str())
        .draw()
        .map_err(fail)?;
    let value_style = TextStyle::from((FONT, 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, bar) in panel.bars.iter().enumerate() {
        let y = f64::from(n - 1 - i as i32);
        let colour = if bar.reference { THEIRS } else { OURS };
        chart.draw_series([Rectangle::new([(0.0, y - 0.36), (bar.value, y + 0.36)], colour.filled())]).map_err(fail)?;
        let text = EmptyElement::at((bar.value, y)) + Text::new(figure(bar.value), (4, 0), value_style.clone());
        chart.draw_series([text]).map_err(fail)?;
    }
    Ok(())
}

/// An axis tick: `v` with no trailing zeros.
fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// `v` with three or four significant digits, as the tables write it.
pub fn figure(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> Bars {
        let panel = |title: &str, bars: &[(&str, f64)]| Panel {
            title: title.into(),
            unit: "ms".into(),
            bars: bars.iter().map(|(l, v)| Bar::ours(*l, *v)).collect(),
        };
        Bars {
            title: "bench".into(),
            panels: vec![panel("S", &[("eager", 2.0), ("graphed", 1.0)]), panel("M", &[("eager", 40.0)])],
        }
    }

    #[test]
    fn bars_are_labelled_with_their_values_and_drawn_the_same_twice() {
        let svg = bar_chart(&chart()).unwrap();
        for text in ["bench", "S", "M", "eager", "graphed", "2.00", "1.00", "40.0", "ms"] {
            assert!(svg.contains(&format!("\n{text}\n")), "{text} is missing from {svg}");
        }
        assert_eq!(svg, bar_chart(&chart()).unwrap());
    }

    #[test]
    fn figures_keep_three_or_four_digits() {
        assert_eq!(
            [figure(1234.4), figure(12.345), figure(1.2345), figure(0.12345)],
            ["1234", "12.3", "1.23", "0.123"]
        );
    }
}
