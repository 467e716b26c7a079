//! `server`: the GPU binary. Parses the command line and calls the library.

use cleave_common::logs::{self, LogFormat};
use cleave_common::telemetry::Telemetry;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cleave_common::DeviceSpec;
use cleave_server::{CheckOptions, ServerConfig};

#[derive(Parser)]
#[command(name = "server", version, about = "cleave server: runs the last stages of a split model on CUDA")]
#[command(args_conflicts_with_subcommands = true, arg_required_else_help = true)]
struct Cli {
    /// server.yaml: listen address, bundle, device, limits.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
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
    /// Write development secrets: a CA, a server certificate for localhost and 127.0.0.1, its
    /// key, a payload key and a bearer token (for testing and demos, never production).
    DevSecrets {
        /// Directory to write them into (kept out of git: `.dev-secrets/` is ignored).
        #[arg(long, default_value = ".dev-secrets")]
        out: PathBuf,
    },
}

/// Logs at info unless `RUST_LOG` says otherwise.
const DEFAULT_LOG_FILTER: &str = "info";

/// What traces call this process unless `telemetry.service_name` says otherwise.
const SERVICE: &str = "cleave-server";

fn main() -> ExitCode {
    // First, before any thread starts: process-wide settings, one of which glibc reads only
    // when a program starts.
    if let Some(e) = cleave_server::allocator::set_up() {
        eprintln!("server: could not start again with glibc's thread cache off, running with it: {e}");
    }
    let cli = Cli::parse();
    if cli.command.is_some() {
        let _ = logs::init(LogFormat::Text, DEFAULT_LOG_FILTER, &Telemetry::default(), SERVICE);
    }
    let result = match (cli.command, cli.config) {
        (Some(Command::Check { bundle, device }), _) => cleave_server::check(&CheckOptions { bundle, device })
            .map(|report| {
                println!("{report}");
                report.passed()
            })
            .map_err(anyhow::Error::from),
        (Some(Command::DevSecrets { out }), _) => cleave_server::write_dev_secrets(&out)
            .map(|s| {
                println!("wrote ca.pem, server.pem, server.key, payload.key and token to {} (development only)", s.dir.display());
                true
            })
            .map_err(anyhow::Error::from),
        (None, Some(path)) => serve(&path).map(|()| true),
        (None, None) => unreachable!("clap requires --config or a subcommand"),
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

fn serve(path: &std::path::Path) -> anyhow::Result<()> {
    let config = ServerConfig::load(path)?;
    let _tracing = logs::init(config.log_format, DEFAULT_LOG_FILTER, &config.telemetry, SERVICE)?;
    config.cpu.apply()?;
    cleave_server::allocator::Trimmer::new(config.peers.free_memory_kept_bytes).spawn()?;
    Ok(tokio::runtime::Runtime::new()?.block_on(cleave_server::run(config, |listening| println!("{listening}")))?)
}
