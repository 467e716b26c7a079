//! Split generation on the edge: the embedding and the first layers run here with their
//! caches, the server runs the middle layers with theirs over a `Generate` stream, and the
//! head runs on the server, or here with `tail_on_edge` (U-shaped: neither tokens nor logits
//! leave the edge). The edge keeps where each row stands and sends it with every step.

mod link;

pub use link::GenerateLink;

use cleave_common::generation::GenerationStages;
use cleave_common::spec::TorchDType;
use cleave_common::{pb, Bundle, BundleError, DeviceSpec, StageRange};
use tch::{Kind, Tensor};

use crate::error::{HostError, Result};
use crate::session::EdgeSession;

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

/// A split generation session: the edge's stages and caches, and the server's session.
pub struct SplitGenerator {
    edge: GenerationStages,
    tail: Option<GenerationStages>,
    edge_caches: Vec<Tensor>,
    tail_caches: Vec<Tensor>,
    link: GenerateLink,
    lengths: Vec<i64>,
    width: i64,
    hidden_kind: Kind,
    vocab_size: i64,
}

impl SplitGenerator {
    /// Loads the edge's stages (blocking) and opens the server's session on `session`.
    pub async fn open(bundle: &Bundle, session: &mut EdgeSession, split: GenerationSplit) -> Result<Self> {
        let info = bundle.manifest().generation.clone().ok_or(BundleError::NoGeneration)?;
        let n = info.stages.len();
        let server_end = if split.tail_on_edge { n - 1 } else { n };
        if split.cut == 0 || split.cut >= server_end {
            let reason = format!("the server runs stages cut..{server_end} of 0..{n}, at least one, never the embedding");
            return Err(BundleError::InvalidRange { start: split.cut, end: server_end, reason }.into());
        }
        let edge = GenerationStages::load(bundle, StageRange::new(0, split.cut), DeviceSpec::Cpu)?;
        let tail = split.tail_on_edge.then(|| GenerationStages::load(bundle, StageRange::new(n - 1, n), DeviceSpec::Cpu)).transpose()?;
        let edge_caches = edge.new_caches(split.batch, split.max_len)?;
        let tail_caches = match &tail {
            Some(tail) => tail.new_caches(split.batch, split.max_len)?,
            None => Vec::new(),
        };
        let open = pb::OpenGeneration { start: split.cut as u32, end: server_end as u32, batch: split.batch as u32, max_len: split.max_len as u32 };
        let link = GenerateLink::open(session, open).await?;
        Ok(Self {
            edge,
            tail,
            edge_caches,
            tail_caches,
            link,
            lengths: vec![0; split.batch as usize],
            width: info.hidden_width(),
            hidden_kind: info.hidden.dtype.kind(),
            vocab_size: info.vocab_size,
        })
    }

    /// What the server said when it opened the session.
    pub fn opened(&self) -> &pb::GenerationOpened {
        &self.link.opened
    }

    /// Where each row stands: its next position.
    pub fn lengths(&self) -> &[i64] {
        &self.lengths
    }

    /// One step: `ids` [batch, S] of every row, after restarting `restart_rows` at position 0;
    /// the logits of each row's S tokens, or of its last with `last_token_only`.
    pub async fn step(&mut self, ids: &Tensor, restart_rows: &[usize], last_token_only: bool) -> Result<Tensor> {
        let (batch, tokens) = (self.lengths.len() as i64, ids.size().get(1).copied().unwrap_or(0));
        let mut starts = self.lengths.clone();
        for &row in restart_rows {
            *starts.get_mut(row).ok_or_else(|| HostError::NoRequestCanBeSent { why: "a restarted row outside the batch" })? = 0;
        }
        let positions: Vec<i64> = starts.iter().flat_map(|&at| at..at + tokens).collect();
        let positions = Tensor::from_slice(&positions).view([batch, tokens]);
        for &row in restart_rows {
            for cache in self.edge_caches.iter_mut().chain(&mut self.tail_caches) {
                let _ = cache.narrow(1, row as i64, 1).zero_();
            }
        }
        let hidden = self.edge.step(ids, &positions, &mut self.edge_caches)?.to_kind(self.hidden_kind).contiguous();
        let mut bytes = vec![0u8; hidden.numel() * self.hidden_kind.elt_size_in_bytes()];
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
        };
        let answered_tokens = if step.last_token_only { 1 } else { tokens };
        let width = if self.tail.is_some() { self.width } else { self.vocab_size };
        let output = self.link.step(step, &[batch, answered_tokens, width]).await?;
        self.lengths = starts.iter().map(|&at| at + tokens).collect();
        let Some(tail) = &self.tail else { return Ok(output) };
        let positions = if last_token_only { positions.narrow(1, tokens - 1, 1) } else { positions };
        Ok(tail.step(&output, &positions, &mut self.tail_caches)?)
    }
}
