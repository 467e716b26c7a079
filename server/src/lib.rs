//! The GPU side of cleave.
//!
//! The server loads a whole bundle once, on its device, so that it can run the suffix
//! `[s, N)` of any split point a host asks for. For now it offers `server check`, which does
//! exactly that load on the configured device and runs every split against the bundle's
//! references: the check an operator runs before serving. The gRPC service builds on it.

use std::path::PathBuf;

use cleave_common::tables::verify_table;
use cleave_common::verify::verify_splits;
use cleave_common::{Bundle, DeviceSpec};

/// What `server check` checks.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The bundle directory.
    pub bundle: PathBuf,
    /// The device to serve from.
    pub device: DeviceSpec,
}

/// Loads the bundle on the device and runs every split at every reference batch size;
/// returns whether everything matched.
pub fn check(opts: &CheckOptions) -> anyhow::Result<bool> {
    let bundle = Bundle::open(&opts.bundle)?;
    let device = opts.device.resolve()?;
    println!(
        "bundle {} ({}), id {}; device {} resolves to {}",
        opts.bundle.display(),
        bundle.manifest().model.source,
        bundle.id(),
        opts.device,
        cleave_common::device::device_name(device)
    );
    let mut passed = true;
    for batch in bundle.reference_batches() {
        let report = verify_splits(&bundle, opts.device, batch)?;
        println!("batch {batch}: {} stages loaded on {} in {:.0} ms", bundle.stage_count(), report.device, report.load_ms);
        println!("{}", verify_table(&report));
        passed &= report.passed();
    }
    println!("{}", if passed { "check passed" } else { "CHECK FAILED: outputs differ from the reference" });
    Ok(passed)
}
