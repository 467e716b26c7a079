//! `host splits` and `host verify`: a bundle's split points, and every split run against
//! its reference outputs on this machine. Each returns a report; the binary prints it.

use std::fmt;
use std::path::{Path, PathBuf};

use cleave_common::verify::{verify_splits, VerifyReport};
use cleave_common::DeviceSpec;
use cleave_tables::{split_table, thousands, verify_table, SplitTable};

use crate::error::Result;

/// What `host verify` checks.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The bundle directory.
    pub bundle: PathBuf,
    /// Where to run the stages.
    pub device: DeviceSpec,
    /// Batch sizes to check (every reference batch when empty).
    pub batches: Vec<i64>,
}

/// A bundle's split points (`host splits`): printed, a header and the table.
pub struct SplitsReport {
    header: String,
    table: SplitTable,
}

impl fmt::Display for SplitsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n{}", self.header, self.table)
    }
}

/// The split-point table of a bundle, its bytes at sequence length `seq` (the bundle's
/// longest by default) in bundles with a sequence.
pub fn splits(bundle_dir: &Path, seq: Option<i64>) -> Result<SplitsReport> {
    let bundle = crate::files::bundle(bundle_dir)?;
    let seq = bundle.resolve_seq(seq)?;
    let m = bundle.manifest();
    let header = format!(
        "bundle {} ({}, {} parameters), id {}\n\
         {} stages at granularity {:?}; split at cut s: the edge runs stages [0, s), the server [s, {}); batch {}..={}{}",
        bundle_dir.display(),
        m.model.source,
        thousands(m.model.parameters),
        bundle.short_id(),
        bundle.stage_count(),
        m.exporter.granularity,
        bundle.stage_count(),
        m.batch.min,
        m.batch.max,
        m.sequence.zip(seq).map_or(String::new(), |(r, s)| format!("; sequence {}..={}, bytes at S = {s}", r.min, r.max))
    );
    Ok(SplitsReport { header, table: split_table(&bundle, seq) })
}

/// Every split run against the references at each batch size (`host verify`).
pub struct VerifyRun {
    /// The model's source (`torchvision:resnet18`).
    pub source: String,
    /// Each batch size's report.
    pub batches: Vec<(i64, VerifyReport)>,
}

impl VerifyRun {
    /// Whether every split matched at every batch size.
    pub fn passed(&self) -> bool {
        self.batches.iter().all(|(_, r)| r.passed())
    }
}

impl fmt::Display for VerifyRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (batch, report) in &self.batches {
            let lengths: Vec<String> = report.seq_lens.iter().map(i64::to_string).collect();
            let lengths = if lengths.is_empty() { String::new() } else { format!(", sequence lengths {}", lengths.join(" and ")) };
            writeln!(
                f,
                "{}: split at every cut on {} at batch {batch}{lengths} (stages loaded in {:.0} ms)",
                self.source, report.device, report.load_ms
            )?;
            writeln!(f, "{}", verify_table(report))?;
            f.write_str(if report.passed() {
                "every split matches the reference and all splits agree bit for bit"
            } else {
                "MISMATCH: some split differs from the reference or from the others"
            })?;
            writeln!(f)?;
        }
        Ok(())
    }
}

/// Runs every split point against the references.
pub fn verify(opts: &VerifyOptions) -> Result<VerifyRun> {
    let bundle = crate::files::bundle(&opts.bundle)?;
    let batches = if opts.batches.is_empty() { bundle.reference_batches() } else { opts.batches.clone() };
    let reports = batches.into_iter().map(|batch| Ok((batch, verify_splits(&bundle, opts.device, batch)?))).collect::<Result<Vec<_>>>()?;
    Ok(VerifyRun { source: bundle.manifest().model.source.clone(), batches: reports })
}
