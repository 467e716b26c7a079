//! `host generate`: a prompt's tokens in, new tokens out, split between this edge and the
//! config's server: the prompt in one step, then one token a step, each drawn here from the
//! logits (which the head makes on the server, or here with the tail on the edge), until a
//! stop token or the limit; time to first token, tokens per second and each token's time.

use std::time::Instant;

use cleave_client::{connect_first, Link, LinkError, RetryPolicy};
use cleave_common::Bundle;
use tch::Tensor;

use super::sampling::{Sampler, Sampling};
use super::split::{GenerationSplit, Scores, SplitGenerator};
use crate::config::EdgeConfig;
use crate::error::{HostError, Result};
use crate::files::open_config_bundle;

/// What `host generate` does.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Start a server in this process.
    pub loopback: bool,
    /// The first generation stage the server runs (default: the middle layer).
    pub cut: Option<usize>,
    /// Run the head here.
    pub tail_on_edge: bool,
    /// The prompt's token ids.
    pub prompt: Vec<i64>,
    /// Tokens generated at most.
    pub max_new_tokens: usize,
    /// Tokens that end the generation (kept in its output).
    pub stop: Vec<i64>,
    /// How each token is chosen.
    pub sampling: Sampling,
}

/// One token's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenTime {
    /// Its position in the sequence.
    pub position: i64,
    /// Its id.
    pub token: i64,
    /// From its step's start (the prompt's, for the first) to the token drawn.
    pub ms: f64,
    /// When it was drawn, in ms since the Unix epoch (to line up several sessions' tokens).
    pub unix_ms: f64,
    /// What the server says its step waited (for its turn, for its batch).
    pub server_queue_ms: f64,
    /// What the server says its step (or its batch) took to run.
    pub server_compute_ms: f64,
}

/// What a generation gave.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The new tokens, in order.
    pub tokens: Vec<i64>,
    /// Each new token's time.
    pub times: Vec<TokenTime>,
    /// Whether a stop token ended it.
    pub stopped: bool,
    /// The first generation stage the server ran.
    pub cut: usize,
    /// Where the server ran it.
    pub device: String,
}

impl Generated {
    /// From the prompt's step to the first new token.
    pub fn first_token_ms(&self) -> f64 {
        self.times.first().map_or(0.0, |t| t.ms)
    }

    /// New tokens a second after the first (the decode rate).
    pub fn tokens_per_second(&self) -> f64 {
        let decode_ms: f64 = self.times.iter().skip(1).map(|t| t.ms).sum();
        if decode_ms > 0.0 {
            (self.times.len() - 1) as f64 * 1e3 / decode_ms
        } else {
            0.0
        }
    }

    /// `position,token,ms,unix_ms,server_queue_ms,server_compute_ms` lines with a header.
    pub fn timings_csv(&self) -> String {
        let lines = self
            .times
            .iter()
            .map(|t| format!("{},{},{:.3},{:.3},{:.3},{:.3}\n", t.position, t.token, t.ms, t.unix_ms, t.server_queue_ms, t.server_compute_ms));
        std::iter::once("position,token,ms,unix_ms,server_queue_ms,server_compute_ms\n".to_string()).chain(lines).collect()
    }
}

/// Generates from `options.prompt` on the config's servers (or a loopback one), handing each
/// new token to `on_token` as it comes.
pub async fn generate(config: &EdgeConfig, options: &GenerateOptions, on_token: impl FnMut(&TokenTime)) -> Result<Generated> {
    let bundle = open_config_bundle(config).await?;
    let loopback = if options.loopback { Some(crate::loopback::for_inference(config).await?) } else { None };
    let servers = loopback.as_ref().map_or_else(|| config.servers.clone(), |l| vec![l.url.clone()]);
    let servers = Servers { urls: servers, link: config.link(), retry: config.resilience.retry };
    let generated = generate_on(&bundle, &servers, options, on_token).await;
    if let Some(loopback) = loopback {
        loopback.shutdown().await?;
    }
    generated
}

/// Where a generation runs, and how it reaches a server again.
pub struct Servers {
    /// Tried in order.
    pub urls: Vec<String>,
    /// TLS, token and timeouts.
    pub link: Link,
    /// Connection attempts, and sessions given to a new server in a row, before giving up.
    pub retry: RetryPolicy,
}

/// Whether `e` says the server's session is gone (the server stopped, restarted, drains, or
/// closed it idle): a new server, given the tokens again, can go on.
fn session_lost(e: &HostError) -> bool {
    use tonic::Code::{Aborted, Cancelled, DeadlineExceeded, Unavailable, Unknown};
    matches!(e, HostError::Link(LinkError::Rpc { call: "Generate", code: Unavailable | Unknown | Cancelled | Aborted | DeadlineExceeded, .. }))
}

/// Generates on `servers`: when the server's session is lost, the next server that answers
/// (the same one restarted, or another of the list) is given the tokens so far again and the
/// step sent again, so the tokens are those of an uninterrupted run.
pub async fn generate_on(bundle: &Bundle, servers: &Servers, options: &GenerateOptions, mut on_token: impl FnMut(&TokenTime)) -> Result<Generated> {
    let invalid = |why: String| HostError::Generation(why);
    options.sampling.validate().map_err(invalid)?;
    let info = bundle.manifest().generation.as_ref().ok_or(cleave_common::BundleError::NoGeneration)?;
    let layers = info.stages.len() - 2;
    let cut = options.cut.unwrap_or(1 + layers / 2);
    // The last new token is never fed back: it needs no position.
    let max_len = (options.prompt.len() + options.max_new_tokens).saturating_sub(1).max(1) as i64;
    if options.prompt.is_empty() || options.max_new_tokens == 0 {
        return Err(invalid("a generation needs a prompt of one token or more and --max-new-tokens of 1 or more".into()));
    }
    if max_len > info.max_positions {
        let why = format!(
            "a prompt of {} tokens and {} new ones pass the model's {} positions",
            options.prompt.len(),
            options.max_new_tokens,
            info.max_positions
        );
        return Err(invalid(why));
    }
    if let Some(bad) = options.prompt.iter().chain(&options.stop).find(|&&id| !(0..info.vocab_size).contains(&id)) {
        return Err(invalid(format!("token id {bad} is outside the vocabulary (0..{})", info.vocab_size)));
    }
    let split = GenerationSplit { cut, tail_on_edge: options.tail_on_edge, batch: 1, max_len };
    let mut session = connect_first(&servers.urls, bundle, &servers.link, &servers.retry).await?;
    let mut generator = SplitGenerator::open(bundle, &mut session, split).await?;
    let device = generator.opened().device.clone();
    let mut sampler = Sampler::new(options.sampling);
    let (mut tokens, mut times) = (Vec::new(), Vec::new());
    let mut input = Tensor::from_slice(&options.prompt).unsqueeze(0);
    loop {
        let started = Instant::now();
        let fed_before = generator.lengths()[0];
        let step = async |generator: &mut SplitGenerator| {
            // After a resume, a prompt in several steps: the steps the lost server took were
            // given again by the replay, the rest are sent again.
            let taken = generator.lengths()[0] - fed_before;
            let input = input.narrow(1, taken, input.size()[1] - taken);
            generator.step_scores(&input, &[], true, options.sampling.candidates()).await
        };
        let scores = servers.retry.resuming(&mut generator, session_lost, step, async |g| resume(g, bundle, servers).await).await?;
        let token = sample(&mut sampler, scores).map_err(|e| invalid(e.to_string()))?;
        let unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let server = generator.server_times();
        let time = TokenTime {
            position: generator.lengths()[0],
            token,
            ms: started.elapsed().as_secs_f64() * 1e3,
            unix_ms,
            server_queue_ms: server.queue_ms,
            server_compute_ms: server.compute_ms,
        };
        on_token(&time);
        times.push(time);
        tokens.push(token);
        let stopped = options.stop.contains(&token);
        if stopped || tokens.len() == options.max_new_tokens {
            return Ok(Generated { tokens, times, stopped, cut, device });
        }
        input = Tensor::from_slice(&[token]).unsqueeze(0);
    }
}

/// The next token from one row's scores: the whole vocabulary's logits, or its most likely
/// tokens' and their ids.
fn sample(sampler: &mut Sampler, scores: Scores) -> std::result::Result<i64, tch::TchError> {
    let logits: Vec<f32> = Vec::try_from(scores.logits.flatten(0, -1).to_kind(tch::Kind::Float))?;
    Ok(match scores.token_ids {
        None => sampler.next(&logits),
        Some(ids) => {
            let ids: Vec<i64> = Vec::try_from(ids.flatten(0, -1))?;
            sampler.next_among(ids.into_iter().map(|id| id as usize).zip(logits))
        }
    })
}

/// Gives `generator`'s tokens to the first server of `servers` that answers.
async fn resume(generator: &mut SplitGenerator, bundle: &Bundle, servers: &Servers) -> Result<()> {
    tracing::info!(tokens = generator.lengths()[0], "giving the generation's tokens to a server again");
    let mut session = connect_first(&servers.urls, bundle, &servers.link, &servers.retry).await?;
    generator.resume(&mut session).await
}
