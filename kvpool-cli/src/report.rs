//! Report helpers: latency percentiles and plain-text tables.

use serde::Serialize;

/// Latency summary of one operation, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Maximum.
    pub max_us: f64,
}

impl Latency {
    /// Summarises samples given in seconds.
    pub fn from_seconds(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_by(f64::total_cmp);
        let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] * 1e6;
        Latency {
            count: samples.len(),
            p50_us: pick(0.50),
            p99_us: pick(0.99),
            max_us: pick(1.0),
        }
    }
}

/// A table printed with aligned columns.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders with the first column left-aligned and the rest right-aligned.
    pub fn render(&self) -> String {
        let cols = self.header.len();
        let width: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                    .chain([self.header[c].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| -> String {
            cells
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    if c == 0 {
                        format!("{s:<w$}", w = width[c])
                    } else {
                        format!("{s:>w$}", w = width[c])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * (cols - 1)));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out
    }
}

/// Bytes per second as GB/s (10^9).
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_right_samples() {
        let mut s: Vec<f64> = (1..=100).map(|i| i as f64 * 1e-6).collect();
        let l = Latency::from_seconds(&mut s);
        assert_eq!(l.count, 100);
        assert!(
            (l.p50_us - 51.0).abs() < 1e-6
                && (l.p99_us - 99.0).abs() < 1e-6
                && (l.max_us - 100.0).abs() < 1e-6,
            "{l:?}"
        );
        assert_eq!(Latency::from_seconds(&mut []).count, 0);
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["tier", "GB/s"]);
        t.row(vec!["cpu".into(), "12.5".into()]);
        assert_eq!(t.render(), "tier  GB/s\n----------\ncpu   12.5");
    }
}
