//! One generation session: its range of stages, the caches of its layers and where each of
//! its rows stands. A step is checked whole before anything changes (a refused step leaves
//! the session as it was), then its rows' caches are written at the positions that follow
//! their earlier tokens: by the session alone, or in one batch with other sessions' decode
//! steps ([`run_together`]).

use cleave_common::generation::GenerationStages;
use cleave_common::pb;
use cleave_common::spec::TorchDType;
use cleave_common::{Bundle, StageRange};
use tch::{Kind, Tensor};

use super::admission::Admission;
use crate::error::{GenerationError, RequestError};
use crate::peer::Peer;

/// A session, open.
pub(crate) struct Session {
    stages: GenerationStages,
    caches: Vec<Tensor>,
    /// Tokens each row holds: its next position.
    lengths: Vec<i64>,
    max_len: i64,
    width: i64,
    kind: Kind,
    /// Its place and its caches' bytes, given back when the caches go.
    admission: Admission,
}

/// A step checked against its session, its tensors made, not yet run.
pub(crate) struct Checked {
    hidden: Tensor,
    /// Each row's positions [batch, tokens].
    positions: Tensor,
    /// Each row's first position.
    starts: Vec<i64>,
    restart_rows: Vec<usize>,
    tokens: i64,
    last_only: bool,
    /// Answer each token's `top_k` most likely tokens, not the logits (0: the logits).
    top_k: i64,
}

/// A checked step run a part of its positions at a time ([`Session::run_part`]).
pub(crate) struct Partial {
    step: Checked,
    /// Positions of each row run so far.
    done: i64,
    /// The parts' answers, as the step asked them (each token's `top_k`, on the CPU): only the
    /// last part's where the step answers its last token.
    answers: Vec<Answer>,
}

impl Checked {
    /// The step, to run in parts.
    pub(crate) fn in_parts(self) -> Partial {
        Partial { step: self, done: 0, answers: Vec::new() }
    }
}

/// A step's answer: its output [batch, tokens or 1, width], or with a `top_k` each token's
/// most likely tokens' logits [batch, tokens or 1, top_k] and their ids (u32, of that shape).
pub(crate) struct Answer {
    pub(crate) output: Tensor,
    pub(crate) token_ids: Option<Tensor>,
}

impl Answer {
    /// The answers of a step's parts, one after the other along the tokens.
    fn joined(mut parts: Vec<Self>) -> Result<Self, RequestError> {
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        let output = Tensor::f_cat(&parts.iter().map(|a| &a.output).collect::<Vec<_>>(), 1).map_err(torch_error)?;
        let ids: Option<Vec<&Tensor>> = parts.iter().map(|a| a.token_ids.as_ref()).collect();
        let token_ids = ids.map(|ids| Tensor::f_cat(&ids, 1)).transpose().map_err(torch_error)?;
        Ok(Self { output, token_ids })
    }

    /// `output` as the step asked, on the CPU: each token's `top_k` most likely, or all of it
    /// (0). They are chosen where `output` lies: only they are copied from a device.
    fn of(output: Tensor, top_k: i64) -> Result<Self, RequestError> {
        let on_cpu = |t: Tensor| t.to_device(tch::Device::Cpu).contiguous();
        if top_k == 0 {
            return Ok(Self { output: on_cpu(output), token_ids: None });
        }
        let (output, ids) = most_likely(&output, top_k).map_err(torch_error)?;
        Ok(Self { output: on_cpu(output), token_ids: Some(on_cpu(ids)) })
    }
}

/// The `k` largest of each row of `logits` [.., V] and their ids, the largest first. Which of
/// the logits equal to the k-th largest make the cut, and their order, is the lower id first:
/// a sampler over the whole vocabulary ranks them so, and `topk` promises no order among
/// equals, so a greedy or top-k choice from them is the choice from all the logits.
fn most_likely(logits: &Tensor, k: i64) -> Result<(Tensor, Tensor), tch::TchError> {
    let (values, ids) = largest(logits, k)?;
    match clear_cut(&values, &ids, k)? {
        Some(ids) => ranked_by_id(logits, &ids),
        None => cut_among_ties(logits, &values.f_narrow(-1, k - 1, 1)?, k),
    }
}

/// Each row's `k + 1` largest logits and their ids (`k` where that is the vocabulary), in
/// one pass over the vocabulary; an error where a row holds NaN (`topk` ranks NaN above
/// every number, so such a row has it first).
fn largest(logits: &Tensor, k: i64) -> Result<(Tensor, Tensor), tch::TchError> {
    let vocabulary = logits.size().last().copied().unwrap_or(0);
    let (values, ids) = logits.f_topk((k + 1).min(vocabulary), -1, true, true)?;
    if values.f_narrow(-1, 0, 1)?.f_isnan()?.f_any()?.int64_value(&[]) != 0 {
        return Err(tch::TchError::Kind(format!("the logits hold NaN: {:?} rank nothing", logits.size())));
    }
    Ok((values, ids))
}

/// Of [`largest`]'s `values` and `ids`, each row's `k` most likely ids where no logit equal
/// to a row's k-th is left out of them (its k-th largest above its (k+1)-th in every row):
/// then they are the whole vocabulary's first k whatever order `topk` gave equals. `None`
/// where a row's k-th ties with the next, or `k` is the vocabulary.
fn clear_cut(values: &Tensor, ids: &Tensor, k: i64) -> Result<Option<Tensor>, tch::TchError> {
    if values.size().last().copied().unwrap_or(0) <= k {
        return Ok(None);
    }
    let clear = values.f_narrow(-1, k - 1, 1)?.f_gt_tensor(&values.f_narrow(-1, k, 1)?)?.f_all()?.int64_value(&[]) != 0;
    Ok(clear.then(|| ids.narrow(-1, 0, k)))
}

/// `ids`' logits, the largest first, equal ones the lower id first, with their ids (i32).
fn ranked_by_id(logits: &Tensor, ids: &Tensor) -> Result<(Tensor, Tensor), tch::TchError> {
    let (ids, _) = ids.f_sort(-1, false)?;
    let (values, order) = logits.f_gather(-1, &ids, false)?.f_sort_stable(true, -1, true)?;
    let ids = ids.f_gather(-1, &order, false)?.f_to_kind(Kind::Int)?;
    Ok((values.f_contiguous()?, ids.f_contiguous()?))
}

/// [`most_likely`] where a row's k-th logit (`kth`, [.., 1]) ties with others: which of the
/// tied make the cut.
fn cut_among_ties(logits: &Tensor, kth: &Tensor, k: i64) -> Result<(Tensor, Tensor), tch::TchError> {
    let above = logits.f_gt_tensor(kth)?;
    let tied = logits.f_eq_tensor(kth)?;
    // The first (k - above) of the tied, in id order.
    let room = above.f_sum_dim_intlist(-1, true, Kind::Int64)?.f_neg()?.f_add_scalar(k)?;
    let tied_rank = tied.f_cumsum(-1, Kind::Int64)?;
    let keep = above.f_logical_or(&tied.f_logical_and(&tied_rank.f_le_tensor(&room)?)?)?;
    let mut shape = logits.size();
    *shape.last_mut().expect("logits have a vocabulary dimension") = k;
    // nonzero lists each row's kept ids in order, k of them per row.
    let ids = keep.f_nonzero()?.f_select(1, keep.dim() as i64 - 1)?.f_view(shape.as_slice())?;
    ranked_by_id(logits, &ids)
}

/// Decode steps of sessions of equal keys (the same range of stages) may run as one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchKey {
    pub(crate) range: StageRange,
}

/// What a session asks for, checked against the model: its range and sizes.
pub(crate) struct Asked {
    pub(crate) range: StageRange,
    pub(crate) batch: i64,
    pub(crate) max_len: i64,
    pub(crate) cache_bytes: u64,
}

/// Checks `open` against `bundle`'s generation section.
pub(crate) fn check_open(bundle: &Bundle, open: &pb::OpenGeneration) -> Result<Asked, GenerationError> {
    let info = bundle.manifest().generation.as_ref().ok_or_else(|| GenerationError::NotExported { bundle: bundle.short_id().to_string() })?;
    let n = info.stages.len();
    let (start, end) = (open.start, open.end);
    let range_error = |reason: String| GenerationError::Range { start, end, reason };
    if start == 0 {
        return Err(range_error("stage 0 is the embedding, which stays on the edge with the tokens: start at 1 or later".into()));
    }
    if start >= end || end as usize > n {
        return Err(range_error(format!("the model has generation stages 0..{n}; a session runs at least one of 1..{n}")));
    }
    let batch = bundle.manifest().batch;
    if !(batch.min..=batch.max).contains(&i64::from(open.batch)) {
        return Err(GenerationError::Batch { batch: open.batch, min: batch.min, max: batch.max });
    }
    if !(1..=info.max_positions).contains(&i64::from(open.max_len)) {
        return Err(GenerationError::MaxLen { max_len: open.max_len, max_positions: info.max_positions });
    }
    let range = StageRange::new(start as usize, end as usize);
    let (batch, max_len) = (i64::from(open.batch), i64::from(open.max_len));
    Ok(Asked { range, batch, max_len, cache_bytes: info.cache_bytes(range.start..range.end, batch, max_len) })
}

impl Session {
    /// Opens a session of `asked` on `all` (the model's generation stages), its caches zeroed.
    pub(crate) fn open(all: &GenerationStages, asked: &Asked, admission: Admission) -> Result<Self, RequestError> {
        let stages = all.slice(asked.range).map_err(RequestError::Bundle)?;
        let caches = stages.new_caches(asked.batch, asked.max_len).map_err(RequestError::Bundle)?;
        let info = stages.info();
        let (width, kind) = (info.hidden_width(), info.hidden.dtype.kind());
        Ok(Self { stages, caches, lengths: vec![0; asked.batch as usize], max_len: asked.max_len, width, kind, admission })
    }

    /// Checks `step` whole and makes its tensors; nothing of the session changes.
    /// `answer_limit` bounds the output's bytes (it must fit in one message).
    pub(crate) fn check(&self, step: &pb::GenerateStep, answer_limit: u64) -> Result<Checked, RequestError> {
        let starts = self.check_step(step, answer_limit)?;
        let (batch, tokens) = (self.lengths.len() as i64, i64::from(step.tokens));
        let hidden = Tensor::f_from_data_size(&step.hidden, &[batch, tokens, self.width], self.kind).map_err(torch_error)?;
        // Refused before it runs: the stages would advance the session on them, and the head's
        // top_k would rank nothing.
        if hidden.f_isfinite().and_then(|f| f.f_all()).map_err(torch_error)?.int64_value(&[]) == 0 {
            return Err(GenerationError::Step("hidden states that are not finite (NaN or infinity): a step sends finite values".into()).into());
        }
        let positions: Vec<i64> = starts.iter().flat_map(|&at| at..at + tokens).collect();
        let positions = Tensor::from_slice(&positions).view([batch, tokens]);
        let restart_rows = step.restart_rows.iter().map(|&row| row as usize).collect();
        Ok(Checked { hidden, positions, starts, restart_rows, tokens, last_only: step.last_token_only, top_k: i64::from(step.top_k) })
    }

    /// Runs a checked step alone, whole. The session moves only once its answer is made: a
    /// step that fails (logits that rank nothing, a stage's error) leaves every row where it
    /// stood (the cache positions it wrote lie past them, and are written again before they
    /// are read), but a row it restarts stands at 0, its first positions perhaps written.
    pub(crate) fn run(&mut self, step: Checked) -> Result<Answer, RequestError> {
        let mut partial = step.in_parts();
        let answer = self.run_part(&mut partial, i64::MAX)?;
        Ok(answer.expect("a part of every position is the whole step"))
    }

    /// Runs the next `positions` (one or more) of every row of `partial`'s step: its answer
    /// once the last have run, the session then moved as [`Session::run`] moves it (and as it
    /// says where a part fails). A token attends to the positions before it in the caches, the
    /// earlier parts' among them, so a step run in parts computes what it computes whole; until
    /// the last part the session stands where it stood.
    pub(crate) fn run_part(&mut self, partial: &mut Partial, positions: i64) -> Result<Option<Answer>, RequestError> {
        let ran = self.run_positions(partial, positions);
        match &ran {
            Ok(None) => {}
            Ok(Some(_)) => {
                self.restart(&partial.step);
                self.advance(partial.step.tokens);
            }
            // Its host, told the step failed, replays a restarted row's tokens from 0.
            Err(_) => self.restart(&partial.step),
        }
        ran
    }

    /// [`Session::run_part`]'s work, the session's rows left as they stood.
    fn run_positions(&mut self, partial: &mut Partial, positions: i64) -> Result<Option<Answer>, RequestError> {
        let step = &partial.step;
        let count = positions.clamp(1, step.tokens - partial.done);
        let (hidden, at) = (step.hidden.narrow(1, partial.done, count), step.positions.narrow(1, partial.done, count));
        partial.done += count;
        if step.last_only && partial.done < step.tokens {
            // Only the caches it writes matter until the last part: no head for tokens whose
            // answer nobody asked for.
            let range = self.stages.range();
            let layers = match self.stages.ends_with_head() {
                true => self.stages.slice(StageRange::new(range.start, range.end - 1)).map_err(RequestError::Bundle)?,
                false => self.stages.clone(),
            };
            if !layers.range().is_empty() {
                let _unasked = layers.step_last(&hidden, &at, &mut self.caches, true).map_err(RequestError::Bundle)?;
            }
            return Ok(None);
        }
        let output = self.stages.step_last(&hidden, &at, &mut self.caches, step.last_only).map_err(RequestError::Bundle)?;
        // Kept as answered (each token's top_k, on the CPU), not as the device's logits.
        partial.answers.push(Answer::of(output, step.top_k)?);
        if partial.done < step.tokens {
            return Ok(None);
        }
        Answer::joined(std::mem::take(&mut partial.answers)).map(Some)
    }

    /// The peer whose session it is (none in-process).
    pub(crate) fn peer(&self) -> Option<&Peer> {
        self.admission.peer()
    }

    pub(crate) fn batch_key(&self) -> BatchKey {
        BatchKey { range: self.stages.range() }
    }

    /// The session's rows.
    pub(crate) fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// The bytes of one position of its caches, every row and layer.
    pub(crate) fn cache_bytes_per_position(&self) -> u64 {
        self.caches.iter().map(|c| (c.numel() * c.kind().elt_size_in_bytes()) as u64).sum::<u64>() / self.max_len as u64
    }

    /// A restarted row's cache is not cleared: a token attends to the positions up to its
    /// own only, and a row's positions are written in order, each before it is read. It
    /// stands at 0 from here on whatever the stages do: they may write its first positions.
    fn restart(&mut self, step: &Checked) {
        for &row in &step.restart_rows {
            self.lengths[row] = 0;
        }
    }

    fn advance(&mut self, tokens: i64) {
        for length in &mut self.lengths {
            *length += tokens;
        }
    }

    /// The bytes of `step`'s answer: hidden states, or logits where the range ends with the
    /// head (or its `top_k` and their ids), of every row's tokens or its last.
    pub(crate) fn answer_bound(&self, step: &pb::GenerateStep) -> u64 {
        let info = self.stages.info();
        let element = self.kind.elt_size_in_bytes() as u64;
        let (width, element) = match (self.stages.ends_with_head(), step.top_k) {
            (false, _) => (self.width as u64, element),
            (true, 0) => (info.vocab_size as u64, element),
            // A u32 id beside each.
            (true, k) => (u64::from(k), element + 4),
        };
        let tokens = if step.last_token_only { 1 } else { u64::from(step.tokens) };
        (self.lengths.len() as u64).saturating_mul(tokens).saturating_mul(width).saturating_mul(element)
    }

    /// Each row's first position in `step`, once everything in it is checked.
    fn check_step(&self, step: &pb::GenerateStep, answer_limit: u64) -> Result<Vec<i64>, GenerationError> {
        let batch = self.lengths.len();
        let refuse = |text: String| Err(GenerationError::Step(text));
        if step.tokens == 0 {
            return refuse("a step of no tokens".into());
        }
        // Checked before the rows are looked at one by one: a list longer than the rows has
        // a row twice or one outside them.
        if step.restart_rows.len() > batch {
            return refuse(format!("{} restart rows, the session has {batch}", step.restart_rows.len()));
        }
        if step.positions_from.len() != batch {
            return refuse(format!("positions_from gives {} rows, the session has {batch}", step.positions_from.len()));
        }
        let mut starts = self.lengths.clone();
        for (i, &row) in step.restart_rows.iter().enumerate() {
            if step.restart_rows[..i].contains(&row) {
                return refuse(format!("restart row {row} is given twice"));
            }
            match starts.get_mut(row as usize) {
                Some(at) => *at = 0,
                None => return refuse(format!("restart row {row}: the session has rows 0..{batch}")),
            }
        }
        let tokens = i64::from(step.tokens);
        for (row, (&at, &host)) in starts.iter().zip(&step.positions_from).enumerate() {
            if at != i64::from(host) {
                return refuse(format!("row {row} stands at position {at} on the server, the step starts it at {host}: replay the session's tokens"));
            }
            if at + tokens > self.max_len {
                return Err(GenerationError::CacheFull { row, at, tokens, max_len: self.max_len });
            }
        }
        let element = self.kind.elt_size_in_bytes() as u64;
        let expected = (batch as u64) * (tokens as u64) * (self.width as u64) * element;
        if step.hidden.len() as u64 != expected {
            let shape = format!("[{batch}, {tokens}, {}] {:?}", self.width, self.kind);
            return refuse(format!("the hidden states are {} bytes, {shape} is {expected}", step.hidden.len()));
        }
        if step.top_k > 0 {
            let vocab_size = self.stages.info().vocab_size;
            if !self.stages.ends_with_head() {
                return refuse(format!("top_k {}: the session's stages end before the head, they answer hidden states", step.top_k));
            }
            if i64::from(step.top_k) > vocab_size {
                return refuse(format!("top_k {}: the vocabulary has {vocab_size} tokens", step.top_k));
            }
        }
        let bytes = self.answer_bound(step);
        if bytes > answer_limit {
            return Err(GenerationError::AnswerTooLarge { bytes, limit: answer_limit });
        }
        Ok(starts)
    }
}

/// Runs the decode steps of `sessions` (one token a row, of one [`BatchKey`]) as one batch:
/// their hidden states, and every layer's caches up to the furthest position the batch
/// writes (a row reads only the positions up to its own, each written before), concatenated
/// along the batch; then each row's new key and value copied back to its own session's
/// cache. Each session's output, in order. Where the stages fail, no session has changed;
/// sessions change only once every copy is made.
pub(crate) fn run_together(sessions: &mut [(&mut Session, &Checked)]) -> Result<Vec<Answer>, RequestError> {
    debug_assert!(sessions.iter().all(|(_, step)| step.tokens == 1), "decode steps only");
    let Some((first, _)) = sessions.first() else { return Ok(Vec::new()) };
    let stages = first.stages.clone();
    let reach = sessions.iter().flat_map(|(_, step)| &step.starts).max().map_or(1, |&at| at + 1);
    let hidden = Tensor::cat(&sessions.iter().map(|(_, step)| &step.hidden).collect::<Vec<_>>(), 0);
    let positions = Tensor::cat(&sessions.iter().map(|(_, step)| &step.positions).collect::<Vec<_>>(), 0);
    // A session of a shorter cache is padded: its rows never read past their own position.
    let part = |s: &Session, layer: usize| {
        let own = s.caches[layer].narrow(3, 0, reach.min(s.max_len));
        if reach > s.max_len {
            own.constant_pad_nd([0, 0, 0, reach - s.max_len])
        } else {
            own
        }
    };
    let merge = |layer: usize| Tensor::cat(&sessions.iter().map(|(s, _)| part(s, layer)).collect::<Vec<_>>(), 1);
    let mut caches: Vec<Tensor> = (0..first.caches.len()).map(merge).collect();
    let output = stages.step_last(&hidden, &positions, &mut caches, false).map_err(RequestError::Bundle)?;
    let mut outputs = Vec::with_capacity(sessions.len());
    let mut offset = 0;
    for (session, step) in sessions.iter_mut() {
        // Its new tokens' keys and values only: the rest of the merged caches is its own.
        for (own, merged) in session.caches.iter_mut().zip(&caches) {
            for (row, &at) in (0..).zip(&step.starts) {
                own.narrow(1, row, 1).narrow(3, at, 1).copy_(&merged.narrow(1, offset + row, 1).narrow(3, at, 1));
            }
        }
        let rows = session.rows() as i64;
        outputs.push(Answer::of(output.narrow(0, offset, rows), step.top_k)?);
        offset += rows;
    }
    for (session, step) in sessions.iter_mut() {
        session.restart(step);
        session.advance(step.tokens);
    }
    Ok(outputs)
}

fn torch_error(e: tch::TchError) -> RequestError {
    RequestError::Internal(crate::error::Internal::Torch(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row's k most likely as a stable sort of the whole row ranks them.
    fn ranked(row: &[f32], k: usize) -> (Vec<f32>, Vec<i32>) {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        order.truncate(k);
        (order.iter().map(|&i| row[i]).collect(), order.iter().map(|&i| i as i32).collect())
    }

    #[test]
    fn the_most_likely_are_the_whole_vocabulary_s_first_k_ties_to_the_lower_id() {
        let rows: Vec<Vec<f32>> = vec![vec![1.0, 3.0, 3.0, 0.0, 3.0, 2.0], vec![0.0; 6], vec![-1.0, 5.0, 2.0, 2.0, 2.0, 5.0]];
        // And rows of many ties at random: small integers.
        let random = Tensor::randint_low(-2, 3, [4, 3, 40], (Kind::Float, tch::Device::Cpu));
        for k in [1, 2, 3, 5, 6] {
            let logits = Tensor::from_slice(&rows.concat()).view([3, 1, 6]);
            let (values, ids) = most_likely(&logits, k).unwrap();
            assert_eq!(values.size(), [3, 1, k]);
            for (r, row) in rows.iter().enumerate() {
                let got_values: Vec<f32> = Vec::try_from(values.get(r as i64).flatten(0, -1)).unwrap();
                let got_ids: Vec<i32> = Vec::try_from(ids.get(r as i64).flatten(0, -1)).unwrap();
                assert_eq!((got_values, got_ids), ranked(row, k as usize), "row {row:?}, k {k}");
            }
        }
        for k in [1, 4, 17, 40] {
            let (values, ids) = most_likely(&random, k).unwrap();
            for (b, t) in (0..4).flat_map(|b| (0..3).map(move |t| (b, t))) {
                let row: Vec<f32> = Vec::try_from(random.get(b).get(t)).unwrap();
                let got = (Vec::try_from(values.get(b).get(t)).unwrap(), Vec::try_from(ids.get(b).get(t)).unwrap());
                assert_eq!(got, ranked(&row, k as usize), "k {k}");
            }
        }
        // Rows whose k-th is above their (k+1)-th (one pass), ties inside the k among them.
        let clear = Tensor::from_slice(&[5.0f32, 2.0, 5.0, 0.0, 2.0, -1.0]).view([1, 1, 6]);
        for k in [1, 2, 3, 4, 5] {
            let (values, ids) = most_likely(&clear, k).unwrap();
            let got = (Vec::try_from(values.flatten(0, -1)).unwrap(), Vec::try_from(ids.flatten(0, -1)).unwrap());
            assert_eq!(got, ranked(&[5.0, 2.0, 5.0, 0.0, 2.0, -1.0], k as usize), "k {k}");
        }
        tch::manual_seed(7);
        let distinct = Tensor::randn([3, 2, 50], (Kind::Float, tch::Device::Cpu));
        for k in [1, 7, 49] {
            let (values, ids) = largest(&distinct, k).unwrap();
            assert!(clear_cut(&values, &ids, k).unwrap().is_some(), "random logits have no ties");
            let (values, ids) = most_likely(&distinct, k).unwrap();
            for (b, t) in (0..3).flat_map(|b| (0..2).map(move |t| (b, t))) {
                let row: Vec<f32> = Vec::try_from(distinct.get(b).get(t)).unwrap();
                let got = (Vec::try_from(values.get(b).get(t)).unwrap(), Vec::try_from(ids.get(b).get(t)).unwrap());
                assert_eq!(got, ranked(&row, k as usize), "k {k}");
            }
        }
        let nan = Tensor::from_slice(&[1.0f32, f32::NAN, 0.0]).view([1, 1, 3]);
        assert!(most_likely(&nan, 2).unwrap_err().to_string().contains("NaN"));
        let nan_first = Tensor::from_slice(&[f32::NAN, 3.0, 1.0, 0.0]).view([1, 1, 4]);
        assert!(most_likely(&nan_first, 1).unwrap_err().to_string().contains("NaN"));
    }
}
