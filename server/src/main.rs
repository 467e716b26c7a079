//! `server`: the GPU binary. Parses the command line and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cleave_common::DeviceSpec;
use cleave_server::CheckOptions;

#[derive(Parser)]
#[command(name = "server", version, about = "cleave server: runs the last stages of a split model on CUDA")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load a bundle on the serving device and check every split point against its references.
    Check {
        /// Bundle directory.
        #[arg(long)]
        bundle: PathBuf,
        /// auto, cpu, cuda or cuda:N (cuda where there is none is an error, not a CPU run).
        #[arg(long, default_value = "auto")]
        device: DeviceSpec,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let result = match Cli::parse().command {
        Command::Check { bundle, device } => cleave_server::check(&CheckOptions { bundle, device }),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("server: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
