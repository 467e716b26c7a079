//! `host`: the edge binary. Parses the command line and calls the library.

use cleave_common::logs::{self, LogFormat};
use cleave_common::telemetry::Telemetry;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use cleave_common::config::CpuUse;
use cleave_common::{DeviceSpec, SplitSpec};
use cleave_host::config::{EdgeConfig, Job, TrainMode};
use cleave_host::generation::{GenerateOptions, Sampling, TextTokenizer, TokenTime};
use cleave_host::load::{LoadMode, LoadOptions, Ratio};
use cleave_host::planner::Objective;
use cleave_host::planning::PlanOptions;
use cleave_host::progress::{Bar, Event, Progress};
use cleave_host::report::{summary_text, OutputMode};
use cleave_host::{RunOptions, VerifyOptions};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(name = "host", version, about = "cleave edge host: runs the first stages of a split model")]
#[command(args_conflicts_with_subcommands = true, arg_required_else_help = true)]
struct Cli {
    /// edge.yaml: server, bundle, split, device, batch size, inputs (or `train:`), output directory.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Start the server in this process on 127.0.0.1 and use it.
    #[arg(long)]
    loopback: bool,
    /// Split point: a cut index, after:<module path>, a share of the FLOPs like 40% (the cut
    /// nearest it), or auto (chosen per request from the measured link).
    #[arg(long)]
    split: Option<SplitSpec>,
    /// Output directory (overrides the config).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Replace the results of an earlier run in the output directory.
    #[arg(long, conflicts_with = "resume")]
    force: bool,
    /// Continue the run in the output directory: send only the requests it has no outcome for.
    #[arg(long)]
    resume: bool,
    /// Train the whole model in this process instead (a training config's reference run).
    #[arg(long)]
    monolithic: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Print every split point of a bundle: live tensors, bytes per sample, parameters on each side.
    Splits {
        /// Bundle directory (written by `python -m cleave_export`).
        #[arg(long)]
        bundle: PathBuf,
        /// Sequence length the bytes are shown at, for a bundle exported with a dynamic
        /// sequence (default: its longest).
        #[arg(long)]
        seq: Option<i64>,
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
    /// Profile the edge, the server and the link, and predict every cut's latency and
    /// throughput; or, with --fleet, place several models on GPUs and their MIG slices.
    #[command(group(clap::ArgGroup::new("what").required(true).args(["config", "fleet"])))]
    Plan {
        /// edge.yaml (bundle, device, batch size, codec, server).
        #[arg(long)]
        config: Option<PathBuf>,
        /// fleet.yaml (models, their profiles, rates, targets and edges; GPUs and their MIG
        /// layouts): fleet-plan.json, a server.yaml per slice, MIG commands (never run).
        #[arg(long, conflicts_with_all = ["loopback", "measure"])]
        fleet: Option<PathBuf>,
        /// With --fleet: simulate the planned servers (their scheduling rules, 60 s of each)
        /// and print each model's p50 and p95.
        #[arg(long, requires = "fleet")]
        simulate: bool,
        /// Start the server in this process on 127.0.0.1 and use it.
        #[arg(long)]
        loopback: bool,
        /// latency or throughput.
        #[arg(long, default_value = "latency")]
        objective: Objective,
        /// Timed passes per profile.
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Also run this many requests at every usable cut and show the measured median.
        #[arg(long, default_value_t = 0)]
        measure: u64,
        /// Where plan.json goes (default: the config's output directory; with --fleet,
        /// results/fleet).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Also profile the server's stages at these batch sizes (like 1,2,4,8) and write
        /// stage-profile.json and edge-profile.json for a fleet.yaml (batch_size: 1 only; with
        /// --measure, the server's own time per request too).
        #[arg(long, value_delimiter = ',', conflicts_with = "fleet")]
        fleet_profile: Vec<u32>,
    },
    /// Load the server(s): N edges' streams from this process, closed loop or at a Poisson
    /// rate, for a duration; a table per model, load.json, latency.csv and latency.svg. The
    /// last line printed is `load: R req/s, p50 X ms, p99 Y ms, errors E`. Errors in the
    /// requests are results: the exit status is 0 whenever the run completes.
    #[command(group(clap::ArgGroup::new("mode").required(true).args(["rate", "closed"])))]
    Load {
        /// edge.yaml of a model (server, bundle, split, batch size, codec, security); repeat
        /// the flag for a task mix of several models.
        #[arg(long = "config", required = true)]
        configs: Vec<PathBuf>,
        /// Edges in all, each with its own connection and stream.
        #[arg(long)]
        edges: usize,
        /// Open loop: requests per second of all edges together, Poisson arrivals.
        #[arg(long)]
        rate: Option<f64>,
        /// Closed loop: each edge sends its next request when the previous one is answered.
        #[arg(long)]
        closed: bool,
        /// How long requests are sent (30s, 2m); then answers are waited for up to 5 s more.
        #[arg(long, value_parser = parse_duration)]
        duration: Duration,
        /// Shares of the edges per --config, like 3:1 (default: equal shares).
        #[arg(long)]
        ratio: Option<Ratio>,
        /// Cuts each model's edges split at, round-robin, like 3,7 (default: each config's split).
        #[arg(long, value_delimiter = ',')]
        splits: Vec<usize>,
        /// Output directory (default: the first config's `output`).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Seed of the open loop's arrivals.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replace an earlier load run's files in the output directory.
        #[arg(long)]
        force: bool,
        /// Requests one open-loop edge may have unanswered; one due beyond that is dropped
        /// and counted as an error.
        #[arg(long, default_value_t = cleave_host::load::DEFAULT_IN_FLIGHT_CAP)]
        in_flight_cap: usize,
    },
    /// Generate tokens with a language model exported with --generation, split with the
    /// config's server: the embedding and the first layers run here with their caches, the
    /// server keeps the rest's (and the head, unless --tail edge).
    Generate {
        /// edge.yaml: server, bundle, security, retries (its input and split are not used).
        #[arg(long)]
        config: PathBuf,
        /// Start the server in this process on 127.0.0.1 and use it.
        #[arg(long)]
        loopback: bool,
        /// The first generation stage the server runs: 1 is the first layer (default: the
        /// middle layer).
        #[arg(long)]
        split: Option<usize>,
        /// Where the final norm and LM head run: server, or edge (neither tokens nor logits
        /// leave this machine).
        #[arg(long, default_value = "server", value_parser = ["server", "edge"])]
        tail: String,
        /// The prompt's token ids, like 1,2,3.
        #[arg(long, value_delimiter = ',', required_unless_present = "prompt", conflicts_with = "prompt")]
        prompt_ids: Vec<i64>,
        /// The prompt as text, turned into ids by --tokenizer; the new tokens are printed as
        /// text too.
        #[arg(long)]
        prompt: Option<String>,
        /// A Hugging Face tokenizer.json (default: tokenizer.json in the bundle's directory).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Tokens generated at most.
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
        /// Token ids that end the generation, like 50256.
        #[arg(long, value_delimiter = ',')]
        stop_ids: Vec<i64>,
        /// 0: greedy; otherwise the logits are divided by it before drawing.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Draw among the k most likely tokens (0: all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Draw among the most likely tokens holding this probability.
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        /// Seed of the draws.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write each new token's position, id and time (ms) here as CSV.
        #[arg(long)]
        timings: Option<PathBuf>,
    },
    /// Write a copy of a bundle with the trained weights of checkpoints (the host's and the
    /// server's `step-N` files), ready for split inference.
    ExportTrained {
        /// The bundle that was trained.
        #[arg(long)]
        bundle: PathBuf,
        /// Checkpoint files that together cover every stage (repeat the flag).
        #[arg(long = "checkpoint", required = true)]
        checkpoints: Vec<PathBuf>,
        /// The new bundle's directory.
        #[arg(long)]
        out: PathBuf,
    },
}

/// Logs at warn unless `RUST_LOG` says otherwise.
const DEFAULT_LOG_FILTER: &str = "warn";

/// What traces call this process unless `telemetry.service_name` says otherwise.
const SERVICE: &str = "cleave-host";

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A command with a config logs as it says (`log_format`), once it is read; the others as
    // text.
    if matches!(cli.command, Some(Command::Splits { .. } | Command::Verify { .. } | Command::ExportTrained { .. })) {
        let _ = logs::init(LogFormat::Text, DEFAULT_LOG_FILTER, &Telemetry::default(), SERVICE);
    }
    let result = match cli.command {
        Some(Command::Splits { bundle, seq }) => {
            cleave_host::splits(&bundle, seq).map(|report| println!("{report}")).map(|()| true).map_err(anyhow::Error::from)
        }
        Some(Command::Verify { bundle, device, batch }) => cleave_host::verify(&VerifyOptions { bundle, device, batches: batch })
            .map(|run| {
                print!("{run}");
                run.passed()
            })
            .map_err(anyhow::Error::from),
        Some(Command::Plan { fleet: Some(fleet), output, simulate, .. }) => {
            plan_fleet(&fleet, &output.unwrap_or_else(|| PathBuf::from("results/fleet")), simulate)
        }
        Some(Command::Plan { config, loopback, objective, repeats, measure, output, fleet_profile, .. }) => {
            plan(config.expect("clap asks for --config or --fleet"), PlanOptions { loopback, objective, repeats, measure, output, fleet_profile })
        }
        Some(Command::ExportTrained { bundle, checkpoints, out }) => export_trained(&bundle, &checkpoints, &out),
        Some(Command::Generate {
            config,
            loopback,
            split,
            tail,
            prompt_ids,
            prompt,
            tokenizer,
            max_new_tokens,
            stop_ids,
            temperature,
            top_k,
            top_p,
            seed,
            timings,
        }) => {
            let options = GenerateOptions {
                loopback,
                cut: split,
                tail_on_edge: tail == "edge",
                prompt: prompt_ids,
                max_new_tokens,
                stop: stop_ids,
                sampling: Sampling { temperature, top_k, top_p, seed },
            };
            let text = prompt.map(|prompt| PromptText { prompt, tokenizer });
            generate(&config, options, text, timings.as_deref())
        }
        Some(Command::Load { configs, edges, rate, closed: _, duration, ratio, splits, output, seed, force, in_flight_cap }) => {
            let mode = rate.map_or(LoadMode::Closed, |rate| LoadMode::Open { rate });
            let opts =
                LoadOptions { edges, mode, duration, ratio, splits, seed, force, in_flight_cap, progress: printed(), ..LoadOptions::default() };
            load(&configs, output, opts)
        }
        None => run(
            cli.config.unwrap_or_else(|| {
                Cli::command()
                    .error(
                        clap::error::ErrorKind::MissingRequiredArgument,
                        "a run needs --config edge.yaml (--loopback, --split, --output, --force, --resume and --monolithic go with it); \
                         or give a subcommand: splits, verify, plan, load, generate, export-trained",
                    )
                    .exit()
            }),
            RunOptions {
                loopback: cli.loopback,
                split: cli.split,
                output: cli.output,
                output_mode: match (cli.force, cli.resume) {
                    (true, _) => OutputMode::Force,
                    (_, true) => OutputMode::Resume,
                    _ => OutputMode::Fresh,
                },
                progress: printed(),
            },
            cli.monolithic,
        ),
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

fn run(path: PathBuf, opts: RunOptions, monolithic: bool) -> anyhow::Result<bool> {
    let mut config = EdgeConfig::load(&path)?;
    let _tracing = logs::init(config.log_format, DEFAULT_LOG_FILTER, &config.telemetry, SERVICE)?;
    if monolithic {
        let Job::Train(train) = &mut config.job else {
            anyhow::bail!("--monolithic needs a training config (a `train:` section)");
        };
        train.mode = TrainMode::Monolithic;
    }
    config.cpu.apply()?;
    let output = opts.output.clone().unwrap_or_else(|| config.output.clone());
    let runtime = tokio::runtime::Runtime::new()?;
    if matches!(config.job, Job::Train(_)) {
        let summary = runtime.block_on(cleave_host::training::run(config, opts))?;
        println!("{}", summary.closing_line(&output));
        return Ok(true);
    }
    let summary = runtime.block_on(cleave_host::run(config, opts))?;
    println!("{}", summary_text(&summary));
    println!("results in {}", output.display());
    Ok(summary.errors == 0 && summary.counts.never_sent == 0)
}

/// `host generate --prompt`: the text and where its tokenizer is.
struct PromptText {
    prompt: String,
    tokenizer: Option<PathBuf>,
}

fn generate(path: &Path, mut options: GenerateOptions, text: Option<PromptText>, timings: Option<&Path>) -> anyhow::Result<bool> {
    let config = EdgeConfig::load(path)?;
    let _tracing = logs::init(config.log_format, DEFAULT_LOG_FILTER, &config.telemetry, SERVICE)?;
    config.cpu.apply()?;
    let tokenizer = match &text {
        Some(text) => {
            let path = text.tokenizer.clone().unwrap_or_else(|| config.bundle.join("tokenizer.json"));
            let tokenizer = TextTokenizer::load(&path)?;
            options.prompt = tokenizer.encode(&text.prompt)?;
            Some(tokenizer)
        }
        None => None,
    };
    // Each token as it comes: its id, or the text it adds (once its bytes make whole characters).
    let (mut ids, mut printed) = (Vec::new(), String::new());
    let print_token = |t: &TokenTime| {
        ids.push(t.token);
        match &tokenizer {
            Some(tokenizer) => {
                let text = tokenizer.decode(&ids).unwrap_or_default();
                if let Some(new) = text.strip_prefix(printed.as_str()).filter(|new| !new.ends_with('\u{fffd}')) {
                    print!("{new}");
                    printed = text;
                }
            }
            None => print!("{}{}", if ids.len() > 1 { "," } else { "" }, t.token),
        }
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let generated = tokio::runtime::Runtime::new()?.block_on(cleave_host::generation::generate(&config, &options, print_token))?;
    match &tokenizer {
        // What was held back waiting for whole characters.
        Some(tokenizer) => println!("{}", tokenizer.decode(&generated.tokens)?.strip_prefix(printed.as_str()).unwrap_or_default()),
        None => println!(),
    }
    if let Some(path) = timings {
        std::fs::write(path, generated.timings_csv()).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("per-token timings in {}", path.display());
    }
    let ended = if generated.stopped { "a stop token" } else { "--max-new-tokens" };
    println!(
        "generate: {} tokens (ended by {ended}), server from stage {} on {}, first token {:.1} ms, {:.1} tokens/s after it",
        generated.tokens.len(),
        generated.cut,
        generated.device,
        generated.first_token_ms(),
        generated.tokens_per_second()
    );
    Ok(true)
}

fn plan(path: PathBuf, opts: PlanOptions) -> anyhow::Result<bool> {
    let config = EdgeConfig::load(&path)?;
    let _tracing = logs::init(config.log_format, DEFAULT_LOG_FILTER, &config.telemetry, SERVICE)?;
    config.cpu.apply()?;
    let planned = tokio::runtime::Runtime::new()?.block_on(cleave_host::planning::plan(config, opts))?;
    println!("{planned}");
    Ok(true)
}

fn plan_fleet(path: &Path, output: &Path, simulate: bool) -> anyhow::Result<bool> {
    let planned = cleave_host::planning::fleet::plan_fleet(path, output, simulate)?;
    println!("{planned}");
    println!("plan in {}", output.join("fleet-plan.json").display());
    Ok(true)
}

fn load(paths: &[PathBuf], output: Option<PathBuf>, mut opts: LoadOptions) -> anyhow::Result<bool> {
    let configs = paths.iter().map(|p| EdgeConfig::load(p)).collect::<Result<Vec<_>, _>>()?;
    let first = configs.first();
    let telemetry = first.map(|c| c.telemetry.clone()).unwrap_or_default();
    let _tracing = logs::init(first.map_or(LogFormat::Text, |c| c.log_format), DEFAULT_LOG_FILTER, &telemetry, SERVICE)?;
    // Like a run and training, a load run writes into its (first) config's `output`.
    opts.output = output.or_else(|| configs.first().map(|c| c.output.clone())).unwrap_or(opts.output);
    // The edges of one load run share this process: the first config's cores, and the most
    // threads any of them asks for.
    let cores = configs.first().and_then(|c| c.cpu.cores.clone());
    CpuUse { threads: configs.iter().filter_map(|c| c.cpu.threads).max(), cores }.apply()?;
    let output = opts.output.clone();
    let report = tokio::runtime::Runtime::new()?.block_on(cleave_host::load::run(configs, opts))?;
    println!("{}", report.table());
    println!("results in {}", output.display());
    if let Some(line) = report.first_request_line() {
        println!("{line}");
    }
    // Last: the line benches parse.
    println!("{}", report.summary_line());
    Ok(true)
}

/// A command's events, printed as they come; work counted in steps as a bar (drawn only on
/// a terminal), which the lines printed meanwhile go above.
fn printed() -> Progress {
    let current: Mutex<Option<ProgressBar>> = Mutex::new(None);
    Progress::new(move |event| {
        let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
        match (event, current.as_ref()) {
            (Event::BarStarts { bar, total }, _) => *current = Some(progress_bar(*bar, *total)),
            (Event::Advanced { loss }, Some(shown)) => {
                if let Some(loss) = loss {
                    shown.set_message(format!("{loss:.4}"));
                }
                shown.inc(1);
            }
            (Event::Advanced { .. }, None) => {}
            (Event::BarEnds, _) => current.take().iter().for_each(ProgressBar::finish_and_clear),
            (other, Some(shown)) => shown.suspend(|| println!("{other}")),
            (other, None) => println!("{other}"),
        }
    })
}

fn progress_bar(bar: Bar, total: u64) -> ProgressBar {
    let shown = ProgressBar::new(total);
    let template = match bar {
        Bar::Requests => "{bar:40} {pos}/{len} requests {per_sec} eta {eta}",
        Bar::Epoch { .. } => "epoch {prefix} {bar:30} {pos}/{len} steps {per_sec} loss {msg}",
    };
    shown.set_style(ProgressStyle::with_template(template).expect("template"));
    if let Bar::Epoch { epoch, epochs } = bar {
        shown.set_prefix(format!("{epoch}/{epochs}"));
    }
    shown
}

/// A duration like `30s`, `2m` or `1m30s`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (expected a duration like 30s or 2m)"))
}

fn export_trained(bundle: &std::path::Path, checkpoints: &[PathBuf], out: &std::path::Path) -> anyhow::Result<bool> {
    let bundle = cleave_host::files::bundle(bundle)?;
    let written = cleave_host::training::export::write_trained_bundle(&bundle, checkpoints, out)?;
    println!("wrote {} (bundle id {})", out.display(), written.short_id());
    Ok(true)
}
