//! What `report` makes of one benchmark's newest run: its tables, where they came from, and its
//! chart; and the README block that shows them.

use crate::cli::plot::Bars;

/// A Markdown table.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Column titles.
    pub header: Vec<String>,
    /// Cells, a row at a time, as many as the header has titles.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles and no rows yet.
    pub fn new(header: &[&str]) -> Table {
        Table { header: header.iter().map(|h| h.to_string()).collect(), rows: Vec::new() }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table in Markdown, without a final newline; a `|` in a cell is escaped.
    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| {
            format!("| {} |", cells.iter().map(|c| c.replace('|', "\\|")).collect::<Vec<_>>().join(" | "))
        };
        let rule = format!("|{}", "---|".repeat(self.header.len()));
        let rows = self.rows.iter().map(|r| line(r));
        [line(&self.header), rule].into_iter().chain(rows).collect::<Vec<_>>().join("\n")
    }
}

/// One benchmark's tables, their source and their chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// Shown one after another.
    pub tables: Vec<Table>,
    /// The names of the files read, graphed's first.
    pub sources: Vec<String>,
    /// The commit and device of the run.
    pub provenance: String,
    /// What the cells are: units, medians of how many.
    pub note: String,
    /// The chart.
    pub chart: Bars,
}

impl Figure {
    /// The README block: the tables, the files they came from, and the chart, linked at `plot`.
    pub fn markdown(&self, plot: &str) -> String {
        let mut parts: Vec<String> = self.tables.iter().map(Table::markdown).collect();
        let files = self.sources.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(" and ");
        parts.push(format!("From {files} ({}): {}.", self.provenance, self.note));
        parts.push(format!("![{}]({plot})", self.chart.title));
        parts.join("\n\n")
    }
}

/// A byte count in MiB, rounded to whole MiB.
pub fn mib(bytes: f64) -> String {
    format!("{:.0}", bytes / f64::from(1 << 20))
}

/// A value, or `-` for none.
pub fn or_dash(v: Option<String>) -> String {
    v.unwrap_or_else(|| "-".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_escape_bars_in_cells() {
        let mut t = Table::new(&["a", "b"]);
        t.row(vec!["1".into(), "x|y".into()]);
        assert_eq!(t.markdown(), "| a | b |\n|---|---|\n| 1 | x\\|y |");
    }
}
