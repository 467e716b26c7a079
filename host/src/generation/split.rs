//! A split generation session on the edge: the edge's stages and caches, the tokens each
//! row was fed, and the server's session.

use cleave_client::{GenerateLink, ServerSession};
use cleave_common::generation::GenerationStages;
use cleave_common::spec::{DType, TorchDType};
use cleave_common::{pb, Bundle, BundleError, DeviceSpec, StageRange};
use tch::Tensor;

use crate::client::ServerTimes;
use crate::error::{HostError, Result};

/// Where a generation splits and how large its session is.
#[derive(Debug, Clone, Copy)]
pub struct GenerationSplit {
    /// The first generation stage the server runs (1 or later: the embedding stays here).
    pub cut: usize,
    /// The head (final norm and LM head) runs on the edge, after the server's layers.
    pub tail_on_edge: bool,
    /// Rows (sequences) generated together.
    pub batch: i64,
    /// Positions each row may reach.
    pub max_len: i64,
}

/// A step's scores of each row's answered tokens [batch, tokens, ..]: logits over the
/// vocabulary, or of each token's `top_k` most likely tokens, with their ids.
pub struct Scores {
    /// Logits [batch, tokens, vocabulary or top_k].
    pub logits: Tensor,
    /// The token id of each of `logits` where they are the most likely tokens' only (Int64).
    pub token_ids: Option<Tensor>,
}

/// A split generation session: the edge's stages and caches, and the server's session.
pub struct SplitGenerator {
    edge: GenerationStages,
    tail: Option<GenerationStages>,
    edge_caches: Vec<Tensor>,
    tail_caches: Vec<Tensor>,
    link: GenerateLink,
    open: pb::OpenGeneration,
    /// The tokens each row has been fed since its start: what a new server is given again.
    histories: Vec<Vec<i64>>,
    width: i64,
    /// The hidden states' dtype (the manifest's): every answer's.
    hidden_dtype: DType,
    vocab_size: i64,
    /// Bytes a step's hidden states, or its answer, may take in one message.
    message_room: i64,
    /// What the server spent on the last step (on all its messages).
    server_times: ServerTimes,
}

impl SplitGenerator {
    /// Loads the edge's stages and warms them up (blocking), and opens the server's session
    /// on `session`.
    pub async fn open(bundle: &Bundle, session: &mut ServerSession, split: GenerationSplit) -> Result<Self> {
        let info = bundle.manifest().generation.clone().ok_or(BundleError::NoGeneration)?;
        let n = info.stages.len();
        let server_end = if split.tail_on_edge { n - 1 } else { n };
        if split.cut == 0 || split.cut >= server_end {
            let reason = format!("the server runs stages cut..{server_end} of 0..{n}, at least one, never the embedding");
            return Err(BundleError::InvalidRange { start: split.cut, end: server_end, reason }.into());
        }
        // Warmed before the first step, which would otherwise pay for their cold start.
        let load = |range| GenerationStages::load(bundle, range, DeviceSpec::Cpu).and_then(|stages| stages.warm_up().map(|()| stages));
        let edge = load(StageRange::new(0, split.cut))?;
        let tail = split.tail_on_edge.then(|| load(StageRange::new(n - 1, n))).transpose()?;
        let edge_caches = edge.new_caches(split.batch, split.max_len)?;
        let tail_caches = match &tail {
            Some(tail) => tail.new_caches(split.batch, split.max_len)?,
            None => Vec::new(),
        };
        let open = pb::OpenGeneration { start: split.cut as u32, end: server_end as u32, batch: split.batch as u32, max_len: split.max_len as u32 };
        let link = GenerateLink::open(session, open).await?;
        let (width, hidden_dtype) = (info.hidden_width(), info.hidden.dtype);
        // Room is left for the message's own fields.
        let message_room = session.server.limits.max_message_bytes.saturating_sub(64 << 10) as i64;
        Ok(Self {
            edge,
            tail,
            edge_caches,
            tail_caches,
            link,
            open,
            histories: vec![Vec::new(); split.batch as usize],
            width,
            hidden_dtype,
            vocab_size: info.vocab_size,
            message_room,
            server_times: ServerTimes::default(),
        })
    }

    /// What the server said when it opened the session.
    pub fn opened(&self) -> &pb::GenerationOpened {
        &self.link.opened
    }

    /// Where each row stands: its next position.
    pub fn lengths(&self) -> Vec<i64> {
        self.histories.iter().map(|h| h.len() as i64).collect()
    }

    /// What the server spent on the last step: waiting for its batch, checking it, running it.
    pub fn server_times(&self) -> ServerTimes {
        self.server_times
    }

    /// One step: `ids` [batch, S] of every row, after restarting `restart_rows` at position 0;
    /// the logits of each row's S tokens, or of its last with `last_token_only`. A step too
    /// large for one message goes in several (a chunked prefill).
    pub async fn step(&mut self, ids: &Tensor, restart_rows: &[usize], last_token_only: bool) -> Result<Tensor> {
        Ok(self.step_scores(ids, restart_rows, last_token_only, 0).await?.logits)
    }

    /// [`Self::step`], answered with the logits of each token's `top_k` most likely tokens
    /// and their ids where the head runs on the server (they alone cross the link); the whole
    /// vocabulary's logits with `top_k` 0 or the head on the edge.
    pub async fn step_scores(&mut self, ids: &Tensor, restart_rows: &[usize], last_token_only: bool, top_k: u32) -> Result<Scores> {
        let top_k = if self.tail.is_some() { 0 } else { top_k };
        if i64::from(top_k) > self.vocab_size {
            return Err(HostError::Generation(format!("top-k {top_k}: the vocabulary has {} tokens", self.vocab_size)));
        }
        let (batch, tokens) = (self.histories.len() as i64, ids.size().get(1).copied().unwrap_or(0));
        if ids.size() != [batch, tokens] || tokens < 1 {
            return Err(HostError::Generation(format!("a step takes ids [{batch}, tokens >= 1], not {:?}", ids.size())));
        }
        if let Some(&row) = restart_rows.iter().find(|&&row| row >= self.histories.len()) {
            return Err(HostError::Generation(format!("restart row {row}: the session has {} rows", self.histories.len())));
        }
        let step_tokens = self.tokens_per_message(last_token_only, top_k);
        self.server_times = ServerTimes::default();
        let (mut outputs, mut token_ids) = (Vec::new(), Vec::new());
        let mut restart = restart_rows;
        let mut from = 0;
        while from < tokens {
            let take = step_tokens.min(tokens - from);
            let last = from + take == tokens;
            let scores = self.step_once(&ids.narrow(1, from, take), restart, last_token_only, top_k).await?;
            if last || !last_token_only {
                outputs.push(scores.logits);
                token_ids.extend(scores.token_ids);
            }
            (restart, from) = (&[], from + take);
        }
        let token_ids = (top_k > 0).then(|| Tensor::cat(&token_ids, 1));
        Ok(Scores { logits: Tensor::cat(&outputs, 1), token_ids })
    }

    /// Tokens a step may carry so that its hidden states, and its answer, fit in a message.
    fn tokens_per_message(&self, last_token_only: bool, top_k: u32) -> i64 {
        let (batch, element) = (self.histories.len() as i64, self.hidden_dtype.kind().elt_size_in_bytes() as i64);
        let hidden = batch * self.width * element;
        // A u32 id beside each of the top_k logits.
        let answer = batch * self.answer_width(top_k) * if top_k > 0 { element + 4 } else { element };
        let fit = if last_token_only { (self.message_room - answer) / hidden } else { self.message_room / (hidden + answer) };
        fit.max(1)
    }

    /// The last dimension of the server's answers: hidden states where the head runs here,
    /// else the vocabulary's logits, or the `top_k` candidates' (`step_scores` sets it to 0
    /// where the head runs here).
    fn answer_width(&self, top_k: u32) -> i64 {
        match (&self.tail, top_k) {
            (Some(_), _) => self.width,
            (None, 0) => self.vocab_size,
            (None, k) => i64::from(k),
        }
    }

    /// A step that fits in one message.
    async fn step_once(&mut self, ids: &Tensor, restart_rows: &[usize], last_token_only: bool, top_k: u32) -> Result<Scores> {
        let (batch, tokens) = (self.histories.len() as i64, ids.size().get(1).copied().unwrap_or(0));
        let mut starts = self.lengths();
        for &row in restart_rows {
            starts[row] = 0;
        }
        let positions: Vec<i64> = starts.iter().flat_map(|&at| at..at + tokens).collect();
        let positions = Tensor::from_slice(&positions).view([batch, tokens]);
        // As on the server, a restarted row's caches are not cleared (a token attends to the
        // positions up to its own only) and the row stands at 0 once its stages ran: they
        // wrote its first positions.
        let hidden = self.edge.step(ids, &positions, &mut self.edge_caches);
        for &row in restart_rows {
            self.histories[row].clear();
        }
        let hidden = hidden?.to_kind(self.hidden_dtype.kind()).contiguous();
        let mut bytes = vec![0u8; hidden.numel() * self.hidden_dtype.kind().elt_size_in_bytes()];
        hidden.f_copy_data_u8(&mut bytes, hidden.numel()).map_err(|e| BundleError::StageFailed {
            index: self.edge.range().end - 1,
            name: "hidden states".into(),
            message: e.to_string(),
        })?;
        let step = pb::GenerateStep {
            request_id: 0,
            tokens: tokens as u32,
            hidden: bytes.into(),
            positions_from: starts.iter().map(|&at| at as u32).collect(),
            restart_rows: restart_rows.iter().map(|&row| row as u32).collect(),
            last_token_only,
            top_k,
        };
        let answered_tokens = if last_token_only { 1 } else { tokens };
        let shape = [batch, answered_tokens, self.answer_width(top_k)];
        let answered = self.link.step(step, &shape, self.hidden_dtype, self.vocab_size).await?;
        self.server_times = self.server_times + answered.server_times;
        let output = answered.output;
        // The server holds the step: so does the edge.
        let fed: Vec<Vec<i64>> = Vec::try_from(ids).map_err(|e: tch::TchError| HostError::Generation(e.to_string()))?;
        for (history, row) in self.histories.iter_mut().zip(fed) {
            history.extend(row);
        }
        let Some(tail) = &self.tail else {
            let token_ids = answered.token_ids.map(|ids| Tensor::from_slice(&ids.iter().map(|&id| i64::from(id)).collect::<Vec<_>>()).view(shape));
            return Ok(Scores { logits: output, token_ids });
        };
        let positions = if last_token_only { positions.narrow(1, tokens - 1, 1) } else { positions };
        Ok(Scores { logits: tail.step(&output, &positions, &mut self.tail_caches)?, token_ids: None })
    }

    /// Continues on a new server (`session`): opens the session there and gives it every
    /// row's tokens again, so that its caches are what the lost server's were. Rows must
    /// stand at one position (a step carries as many tokens for every row).
    pub async fn resume(&mut self, session: &mut ServerSession) -> Result<()> {
        let lengths = self.lengths();
        if lengths.iter().any(|&l| l != lengths[0]) {
            return Err(HostError::Generation(format!("rows at positions {lengths:?} cannot be given to a new server in one replay")));
        }
        self.link = GenerateLink::open(session, self.open).await?;
        if lengths[0] == 0 {
            return Ok(());
        }
        let histories = std::mem::replace(&mut self.histories, vec![Vec::new(); lengths.len()]);
        let ids = Tensor::from_slice(&histories.concat()).view([lengths.len() as i64, lengths[0]]);
        let replayed = self.step(&ids, &[], true).await.map(drop);
        if replayed.is_err() {
            // Part of the tokens reached a server that is gone: the next one is given them all.
            self.histories = histories;
        }
        replayed
    }
}
