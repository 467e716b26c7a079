//! `host splits` and `host verify`: a bundle's split points, and every split run against
//! its reference outputs on this machine.

use std::path::{Path, PathBuf};

use cleave_common::tables::{split_table, thousands, verify_table};
use cleave_common::verify::verify_splits;
use cleave_common::{Bundle, DeviceSpec};

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

/// Prints the split-point table of a bundle, its bytes at sequence length `seq` (the
/// bundle's longest by default) in bundles with a sequence.
pub fn print_splits(bundle_dir: &Path, seq: Option<i64>) -> Result<()> {
    let bundle = Bundle::open(bundle_dir)?;
    let seq = bundle.resolve_seq(seq)?;
    let m = bundle.manifest();
    println!("bundle {} ({}, {} parameters), id {}", bundle_dir.display(), m.model.source, thousands(m.model.parameters), bundle.short_id());
    println!(
        "{} stages at granularity {:?}; split at cut s: the edge runs stages [0, s), the server [s, {}); batch {}..={}{}",
        bundle.stage_count(),
        m.exporter.granularity,
        bundle.stage_count(),
        m.batch.min,
        m.batch.max,
        m.sequence.zip(seq).map_or(String::new(), |(r, s)| format!("; sequence {}..={}, bytes at S = {s}", r.min, r.max))
    );
    println!("{}", split_table(&bundle, seq));
    Ok(())
}

/// Runs every split point against the references; returns whether all passed.
pub fn verify(opts: &VerifyOptions) -> Result<bool> {
    let bundle = Bundle::open(&opts.bundle)?;
    let batches = if opts.batches.is_empty() { bundle.reference_batches() } else { opts.batches.clone() };
    let mut all_passed = true;
    for batch in batches {
        let report = verify_splits(&bundle, opts.device, batch)?;
        let lengths: Vec<String> = report.seq_lens.iter().map(i64::to_string).collect();
        let lengths = if lengths.is_empty() { String::new() } else { format!(", sequence lengths {}", lengths.join(" and ")) };
        println!(
            "{}: split at every cut on {} at batch {}{lengths} (stages loaded in {:.0} ms)",
            bundle.manifest().model.source,
            report.device,
            batch,
            report.load_ms
        );
        println!("{}", verify_table(&report));
        let passed = report.passed();
        println!(
            "{}",
            if passed {
                "every split matches the reference and all splits agree bit for bit".to_string()
            } else {
                "MISMATCH: some split differs from the reference or from the others".to_string()
            }
        );
        all_passed &= passed;
    }
    Ok(all_passed)
}
