//! Tables printed for people: a bundle's split points and a verification run.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};

use cleave_common::verify::VerifyReport;
use cleave_common::Bundle;

/// Bytes in binary units (`1.5 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    scaled(bytes, 1024.0, &[" B", " KiB", " MiB", " GiB", " TiB"])
}

/// A count in SI units (`75.5 M`), exact below a thousand.
pub fn si(n: u64) -> String {
    scaled(n, 1000.0, &["", " K", " M", " G", " T"])
}

/// `n` divided by `base` until it is below it, with one decimal and the unit reached;
/// exact (no decimal) in the first unit.
fn scaled(n: u64, base: f64, units: &[&str]) -> String {
    let mut value = n as f64;
    let mut unit = 0;
    while value >= base && unit < units.len() - 1 {
        value /= base;
        unit += 1;
    }
    if unit == 0 {
        format!("{n}{}", units[0])
    } else {
        format!("{value:.1}{}", units[unit])
    }
}

/// A count with thousands separators.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn new_table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED).set_header(header.to_vec());
    table
}

fn align_right(table: &mut Table, columns: &[usize]) {
    for &c in columns {
        if let Some(col) = table.column_mut(c) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
}

/// The split table and, under it, each reason a cut cannot be split at, once (rows refer to
/// it by number).
pub struct SplitTable {
    /// One row per cut.
    pub table: Table,
    /// The distinct reasons cuts are unusable, numbered from 1.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for SplitTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.table)?;
        for (i, reason) in self.reasons.iter().enumerate() {
            write!(f, "\n({}) {reason}", i + 1)?;
        }
        Ok(())
    }
}

/// Every split point: what crosses it, how big it is, how the parameters and cost divide,
/// and whether a server merges requests entering there into batches. With a sequence, bytes
/// are at sequence length `seq` (see [`Bundle::resolve_seq`]), and a column gives one
/// sample's bytes per token. A size a cut does not know (its shapes depend on the data) is `?`.
pub fn split_table(bundle: &Bundle, seq: Option<i64>) -> SplitTable {
    let points = bundle.split_points_at(seq);
    let seq = points.first().and_then(|p| p.seq_len);
    let mut header = vec!["cut".to_string(), "name".into(), "live tensors".into(), "bytes/sample".into()];
    header.extend(seq.map(|s| format!("per token (S = {s})")));
    header.extend(["params edge", "params server", "edge cost", "usable", "batchable"].map(String::from));
    let mut table = new_table(&header.iter().map(String::as_str).collect::<Vec<_>>());
    let mut reasons: Vec<String> = Vec::new();
    for p in points {
        let mut live = p.tensors.join("\n");
        if p.plain_values > 0 {
            live.push_str(&format!("\n+ {} plain value(s)", p.plain_values));
        }
        let unknown_size = p.bytes_per_sample == 0 && p.usable.is_err();
        let mut row = vec![p.index.to_string(), p.name, live, if unknown_size { "?".into() } else { human_bytes(p.bytes_per_sample) }];
        if seq.is_some() {
            row.push(p.bytes_per_token.map_or_else(|| "?".into(), |b| format!("{b:.1} B")));
        }
        row.extend([
            thousands(p.params_before),
            thousands(p.params_after),
            format!("{:.1}%", 100.0 * p.edge_cost_share),
            match p.usable {
                Ok(()) => "yes".into(),
                Err(reason) => {
                    let n = reasons.iter().position(|r| *r == reason).unwrap_or_else(|| {
                        reasons.push(reason);
                        reasons.len() - 1
                    });
                    format!("no ({})", n + 1)
                }
            },
            if p.batchable { "yes" } else { "no" }.into(),
        ]);
        table.add_row(row);
    }
    let shift = usize::from(seq.is_some());
    align_right(&mut table, &[0, 3, 3 + shift, 4 + shift, 5 + shift, 6 + shift]);
    SplitTable { table, reasons }
}

/// One row per split point of a verification run.
pub fn verify_table(report: &VerifyReport) -> Table {
    let mut table = new_table(&["cut", "name", "boundary", "edge ms", "server ms", "rel. error", "same as cut 0"]);
    for s in &report.splits {
        table.add_row(vec![
            s.split.to_string(),
            s.name.clone(),
            human_bytes(s.boundary_bytes as u64),
            format!("{:.2}", s.prefix_ms),
            format!("{:.2}", s.suffix_ms),
            format!("{:.1e}{}", s.relative_error, if s.relative_error <= report.tolerance { "" } else { " FAIL" }),
            match (s.identical_to_first, report.require_identical) {
                (true, _) => "bit-identical".into(),
                (false, true) => "DIFFERS".into(),
                (false, false) => "differs (TF32)".into(),
            },
        ]);
    }
    align_right(&mut table, &[0, 2, 3, 4, 5]);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_sizes_and_counts() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(802_816), "784.0 KiB");
        assert_eq!(thousands(11_689_512), "11,689,512");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
    }
}
