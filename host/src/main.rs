//! `host`: the edge binary. Parses the command line and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cleave_common::DeviceSpec;
use cleave_host::VerifyOptions;

#[derive(Parser)]
#[command(name = "host", version, about = "cleave edge host: runs the first stages of a split model")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every split point of a bundle: live tensors, bytes per sample, parameters on each side.
    Splits {
        /// Bundle directory (written by `python -m cleave_export`).
        #[arg(long)]
        bundle: PathBuf,
    },
    /// Run the bundle split at every cut on its reference inputs and compare with the reference outputs.
    Verify {
        /// Bundle directory.
        #[arg(long)]
        bundle: PathBuf,
        /// auto, cpu, cuda or cuda:N.
        #[arg(long, default_value = "auto")]
        device: DeviceSpec,
        /// Batch sizes to check (default: every reference batch in the bundle).
        #[arg(long, value_delimiter = ',')]
        batch: Vec<i64>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let result = match Cli::parse().command {
        Command::Splits { bundle } => cleave_host::print_splits(&bundle).map(|()| true),
        Command::Verify { bundle, device, batch } => cleave_host::verify(&VerifyOptions { bundle, device, batches: batch }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("host: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
