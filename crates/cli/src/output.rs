//! Output: aligned tables, JSON, and the progress of long transfers.
//!
//! Tables go to stdout, padded so columns line up (numbers right-aligned, text left);
//! progress goes to stderr, as a bar only when stderr is a terminal, so scripts and
//! logs get one summary line instead of a screen of redraws.

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::io::IsTerminal;
use std::time::Instant;

use crate::size::format_size;

/// How a column is aligned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers and sizes.
    Right,
}

/// A table printed with aligned columns.
pub struct Table {
    headers: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[(&str, Align)]) -> Table {
        Table {
            headers: headers.iter().map(|(h, a)| (h.to_string(), *a)).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row (as many cells as headers).
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    /// The table as text, one line per row, no trailing spaces.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self
            .headers
            .iter()
            .map(|(h, _)| h.chars().count())
            .collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let header_cells: Vec<String> = self.headers.iter().map(|(h, _)| h.clone()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header_cells).chain(&self.rows) {
            let mut line = String::new();
            for (index, ((cell, width), (_, align))) in
                row.iter().zip(&widths).zip(&self.headers).enumerate()
            {
                if index > 0 {
                    line.push_str("  ");
                }
                match align {
                    Align::Left => line.push_str(&format!("{cell:<width$}")),
                    Align::Right => line.push_str(&format!("{cell:>width$}")),
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    /// Print to stdout.
    pub fn print(&self) {
        print!("{}", self.render());
    }

    /// Print to stdout without the header line (columns aligned as with it).
    pub fn print_rows(&self) {
        for line in self.render().lines().skip(1) {
            println!("{line}");
        }
    }
}

/// Print a value as pretty JSON on stdout.
pub fn print_json<T: Serialize>(value: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Progress of a transfer of a known number of bytes.
pub struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
}

impl Progress {
    /// A bar on stderr if stderr is a terminal, else nothing until [`Progress::finish`].
    pub fn new(total_bytes: u64, message: &str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message(message.to_string());
            bar
        });
        Progress {
            bar,
            started: Instant::now(),
        }
    }

    /// `bytes` more are done.
    pub fn advance(&self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }

    /// Clear the bar and print one summary line on stdout.
    pub fn finish(&self, what: &str, bytes: u64) {
        println!("{}", self.summary(what, bytes));
    }

    /// Like [`Progress::finish`], on stderr: for a transfer whose output is stdout.
    pub fn finish_on_stderr(&self, what: &str, bytes: u64) {
        eprintln!("{}", self.summary(what, bytes));
    }

    /// Clear the bar and return the summary line, for a caller that prints it
    /// elsewhere (a server's answer to the command that asked).
    pub fn summary_line(&self, what: &str, bytes: u64) -> String {
        self.summary(what, bytes)
    }

    /// Clear the bar, printing nothing: a step of a longer command.
    pub fn finish_quietly(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    fn summary(&self, what: &str, bytes: u64) -> String {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let seconds = self.started.elapsed().as_secs_f64();
        let rate = if seconds > 0.0 {
            format!("{}/s", format_size((bytes as f64 / seconds) as u64))
        } else {
            "-".to_string()
        };
        format!("{what}: {} in {seconds:.1} s ({rate})", format_size(bytes))
    }
}

/// `part` as a percentage of `whole`, rounded up as vdostats does (any use shows).
pub fn percent_rounded_up(part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    (u128::from(part) * 100).div_ceil(u128::from(whole)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up() {
        let mut table = Table::new(&[("Name", Align::Left), ("Size", Align::Right)]);
        table.row(vec!["a".into(), "10.00 GiB".into()]);
        table.row(vec!["longer".into(), "4.00 KiB".into()]);
        assert_eq!(
            table.render(),
            "Name         Size\na       10.00 GiB\nlonger   4.00 KiB\n"
        );
    }

    #[test]
    fn percent_rounds_up() {
        assert_eq!(percent_rounded_up(1, 1000), 1);
        assert_eq!(percent_rounded_up(0, 1000), 0);
        assert_eq!(percent_rounded_up(5, 10), 50);
        assert_eq!(percent_rounded_up(1, 0), 0);
    }
}
