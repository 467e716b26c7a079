//! The split planner: from measured profiles, the predicted end-to-end latency and pipelined
//! throughput of every cut, and the best cut for an objective (the Neurosurgeon model:
//! edge compute, upload, server compute, download).
//!
//! Splitting at cut `s` runs stages `[0, s)` on the edge and `[s, N)` on the server. At
//! `s = N` everything runs on the edge and nothing crosses the network; at `s = 0` the edge
//! only encodes the inputs. A request's latency is the sum of its parts; pipelined requests
//! (several in flight, full-duplex link) are limited by the slowest part, so throughput is
//! one over the largest of edge compute, upload, server compute and download.
//!
//! [`BandwidthEstimate`] is the moving estimate the planner re-plans from while running: fed
//! with real transfers, it follows a changed link within a few requests; [`Replanner`] only
//! switches when the predicted gain beats a margin, so noise does not make the split flap.
//!
//! The model only: it talks to no server, reads no config and uses no other module of this
//! crate ([`codec_cost`] times a codec on a boundary it is given). `planning` measures
//! the profiles and runs `host plan` and `split: auto` with it; the config names its
//! [`Objective`], the error type its [`ProfileError`], and `records` (what `split: auto`
//! planned) its [`CutPrediction`]s.

pub mod codec_cost;

use std::collections::HashMap;

use cleave_common::wire::Codec;
use serde::{Deserialize, Serialize};

use codec_cost::{codec_text, eligible, CodecCost, CutCodecs};

/// What the planner optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// The lowest end-to-end latency of one request.
    Latency,
    /// The most requests per second with requests pipelined.
    Throughput,
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Latency => "latency",
            Self::Throughput => "throughput",
        })
    }
}

impl std::str::FromStr for Objective {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Self::Latency),
            "throughput" => Ok(Self::Throughput),
            other => Err(format!("{other:?} is not an objective (latency, throughput)")),
        }
    }
}

/// The link between the edge and the server.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    /// Sustained bandwidth, bytes per second (each way).
    pub bytes_per_s: f64,
    /// Round-trip time of an empty call, milliseconds.
    pub rtt_ms: f64,
}

impl Link {
    /// Milliseconds to move `bytes` one way at this bandwidth (latency not included).
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            0.0
        } else {
            bytes as f64 / self.bytes_per_s * 1e3
        }
    }
}

/// Measured profiles of one bundle at one batch size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profiles {
    /// Milliseconds of each stage on the edge's device.
    pub edge_stage_ms: Vec<f64>,
    /// Milliseconds of each stage on the server's device.
    pub server_stage_ms: Vec<f64>,
    /// Bytes on the wire of the boundary at each cut `0..=N`, after the codec.
    pub cut_wire_bytes: Vec<u64>,
    /// Whether each cut can be a split point.
    pub cut_usable: Vec<bool>,
    /// Bytes on the wire of the result the server sends back.
    pub result_wire_bytes: u64,
    /// Encoding plus decoding time per MiB of boundary (both ends), milliseconds.
    pub codec_ms_per_mib: f64,
    /// The link.
    pub link: Link,
    /// With `codec: auto`, each candidate codec measured at every cut `0..=N`: a cut's upload
    /// is predicted with the codec that serves the objective best there, so the cut and the
    /// codec are chosen together. Empty otherwise: `cut_wire_bytes` and `codec_ms_per_mib`.
    pub codec_choices: Vec<CutCodecs>,
}

/// The prediction for one cut.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CutPrediction {
    /// The cut.
    pub cut: usize,
    /// The codec its upload is predicted with, where `codec: auto` chooses among several.
    #[serde(serialize_with = "optional_codec_text")]
    pub codec: Option<Codec>,
    /// Bytes on the wire up (the boundary, encoded; 0 when nothing crosses).
    pub upload_bytes: u64,
    /// Edge compute, ms.
    pub edge_ms: f64,
    /// Encoding and decoding the boundary and the result, ms.
    pub codec_ms: f64,
    /// Boundary upload, ms.
    pub upload_ms: f64,
    /// Server compute, ms.
    pub server_ms: f64,
    /// Result download, ms.
    pub download_ms: f64,
    /// Round trip, ms (0 when nothing crosses).
    pub rtt_ms: f64,
    /// End-to-end latency of one request, ms.
    pub latency_ms: f64,
    /// Requests per second when pipelined.
    pub throughput_rps: f64,
    /// Whether the cut can be used.
    pub usable: bool,
}

fn optional_codec_text<S: serde::Serializer>(codec: &Option<Codec>, s: S) -> Result<S::Ok, S::Error> {
    match codec {
        Some(c) => codec_text(c, s),
        None => s.serialize_none(),
    }
}

/// Profiles that do not describe one bundle.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// Lists of different lengths.
    #[error(
        "profiles disagree: {edge} edge stages, {server} server stages, {cut_bytes} cut sizes and {cut_flags} cut flags \
         (expected {edge}, {edge}, {} and {})",
        edge + 1,
        edge + 1
    )]
    Lengths {
        /// Edge stage times.
        edge: usize,
        /// Server stage times.
        server: usize,
        /// Bytes at each cut.
        cut_bytes: usize,
        /// Whether each cut is usable.
        cut_flags: usize,
    },
    /// Codec costs for some cuts only.
    #[error("profiles disagree: codec costs at {got} cuts (expected none or {cuts})")]
    CodecCuts {
        /// Cuts with codec costs.
        got: usize,
        /// Cuts there are.
        cuts: usize,
    },
    /// A cut with no codec to choose from.
    #[error("profiles disagree: a cut without a codec to choose")]
    NoCodec,
    /// A prediction asked for a cut the profiles do not have.
    #[error("profiles disagree: cut {cut} is past the last cut {last}")]
    PastLastCut {
        /// The cut asked for.
        cut: usize,
        /// The last cut.
        last: usize,
    },
    /// A negative, infinite or NaN figure.
    #[error("profile value {name} is {value}, expected a finite number >= 0")]
    Value {
        /// Which figure.
        name: &'static str,
        /// Its value.
        value: f64,
    },
}

impl Profiles {
    /// Number of stages.
    pub fn stage_count(&self) -> usize {
        self.edge_stage_ms.len()
    }

    fn check(&self) -> Result<(), ProfileError> {
        let n = self.stage_count();
        if self.server_stage_ms.len() != n || self.cut_wire_bytes.len() != n + 1 || self.cut_usable.len() != n + 1 {
            return Err(ProfileError::Lengths {
                edge: n,
                server: self.server_stage_ms.len(),
                cut_bytes: self.cut_wire_bytes.len(),
                cut_flags: self.cut_usable.len(),
            });
        }
        if !self.codec_choices.is_empty() && self.codec_choices.len() != n + 1 {
            return Err(ProfileError::CodecCuts { got: self.codec_choices.len(), cuts: n + 1 });
        }
        if self.codec_choices.iter().any(|c| c.costs.is_empty()) {
            return Err(ProfileError::NoCodec);
        }
        let finite = |name, value: f64| if value.is_finite() && value >= 0.0 { Ok(()) } else { Err(ProfileError::Value { name, value }) };
        for &v in &self.edge_stage_ms {
            finite("edge_stage_ms", v)?;
        }
        for &v in &self.server_stage_ms {
            finite("server_stage_ms", v)?;
        }
        finite("codec_ms_per_mib", self.codec_ms_per_mib)?;
        for cost in self.codec_choices.iter().flat_map(|c| &c.costs) {
            finite("wire_ratio", cost.wire_ratio)?;
            finite("encode_ms_per_mib", cost.encode_ms_per_mib)?;
            finite("decode_ms_per_mib", cost.decode_ms_per_mib)?;
        }
        finite("link.rtt_ms", self.link.rtt_ms)?;
        if !(self.link.bytes_per_s.is_finite() && self.link.bytes_per_s > 0.0) {
            return Err(ProfileError::Value { name: "link.bytes_per_s", value: self.link.bytes_per_s });
        }
        Ok(())
    }

    /// The prediction for every cut `0..=N`.
    pub fn predict(&self, objective: Objective) -> Result<Vec<CutPrediction>, ProfileError> {
        self.check()?;
        let n = self.stage_count();
        Ok((0..=n).map(|cut| self.predict_cut(cut, objective)).collect())
    }

    /// Each candidate's costs by the cut they were measured at (`codec: auto`).
    pub fn codec_costs_by_cut(&self) -> HashMap<usize, Vec<CodecCost>> {
        self.codec_choices.iter().enumerate().map(|(cut, c)| (cut, c.costs.clone())).collect()
    }

    /// The prediction for `cut`: with the configured codec, or with each candidate and the
    /// one that serves `objective` best (the first of equals: the cheapest to run).
    fn predict_cut(&self, cut: usize, objective: Objective) -> CutPrediction {
        let n = self.stage_count();
        match self.codec_choices.get(cut).filter(|_| cut < n) {
            None => self.predict_with(cut, None, self.cut_wire_bytes[cut], self.cut_codec_ms(self.cut_wire_bytes[cut])),
            Some(choices) => eligible(&choices.costs)
                .into_iter()
                .map(|c| self.predict_with(cut, Some(c.codec), c.wire_bytes(choices.tensor_bytes), c.codec_ms(choices.tensor_bytes)))
                .reduce(|a, b| if score(&b, objective) < score(&a, objective) { b } else { a })
                .expect("checked: every cut has a codec"),
        }
    }

    /// The configured codec's time for `wire_bytes` at a cut.
    fn cut_codec_ms(&self, wire_bytes: u64) -> f64 {
        wire_bytes as f64 / (1u64 << 20) as f64 * self.codec_ms_per_mib
    }

    /// The prediction for `cut` with an upload of `up` bytes that takes `up_codec_ms` to
    /// encode and decode.
    fn predict_with(&self, cut: usize, codec: Option<Codec>, up: u64, up_codec_ms: f64) -> CutPrediction {
        let n = self.stage_count();
        // fold, not sum: an empty f64 sum is -0.0.
        let edge_ms = self.edge_stage_ms[..cut].iter().fold(0.0, |a, b| a + b);
        let remote = cut < n;
        let (up, down, up_codec_ms) = if remote { (up, self.result_wire_bytes, up_codec_ms) } else { (0, 0, 0.0) };
        let codec_ms = up_codec_ms + self.cut_codec_ms(down);
        let upload_ms = self.link.transfer_ms(up);
        let download_ms = self.link.transfer_ms(down);
        let server_ms = self.server_stage_ms[cut..].iter().fold(0.0, |a, b| a + b);
        let rtt_ms = if remote { self.link.rtt_ms } else { 0.0 };
        let latency_ms = edge_ms + codec_ms + upload_ms + rtt_ms + server_ms + download_ms;
        // Pipelined, the edge's compute and codec share its processor; the link carries
        // uploads and downloads at once; the server computes one request at a time.
        let bottleneck = (edge_ms + codec_ms).max(upload_ms).max(server_ms).max(download_ms);
        let throughput_rps = if bottleneck > 0.0 { 1e3 / bottleneck } else { f64::INFINITY };
        CutPrediction {
            cut,
            codec: codec.filter(|_| remote),
            upload_bytes: up,
            edge_ms,
            codec_ms,
            upload_ms,
            server_ms,
            download_ms,
            rtt_ms,
            latency_ms,
            throughput_rps,
            usable: self.cut_usable[cut] || cut == n,
        }
    }
}

/// The best usable cut for `objective` (ties go to the earlier cut: less edge work).
pub fn best(predictions: &[CutPrediction], objective: Objective) -> Option<&CutPrediction> {
    predictions.iter().filter(|p| p.usable).min_by(|a, b| score(a, objective).total_cmp(&score(b, objective)))
}

/// Lower is better.
fn score(p: &CutPrediction, objective: Objective) -> f64 {
    match objective {
        Objective::Latency => p.latency_ms,
        Objective::Throughput => -p.throughput_rps,
    }
}

/// A moving estimate of the link's bandwidth from real transfers: an exponentially weighted
/// mean of the logarithm, so that a fall from 1 Gbit/s to 5 Mbit/s is followed as quickly as
/// the rise back (a plain mean of bytes per second takes a dozen slow transfers to notice a
/// fall of that size, each of them seconds long).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandwidthEstimate {
    bytes_per_s: f64,
    /// Weight of each new sample, in (0, 1].
    weight: f64,
}

impl BandwidthEstimate {
    /// Starts from a probed bandwidth; `weight` is how much each transfer moves it.
    pub fn new(probed_bytes_per_s: f64, weight: f64) -> Self {
        Self { bytes_per_s: probed_bytes_per_s, weight: weight.clamp(1e-3, 1.0) }
    }

    /// The current estimate, bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// Adds a transfer: `bytes` moved (both ways) in `network_ms` (the round trip less the
    /// server's time) over a link with round-trip time `rtt_ms`. Transfers too small to
    /// measure (the round trip dominates) are ignored; returns whether it counted.
    pub fn observe(&mut self, bytes: u64, network_ms: f64, rtt_ms: f64) -> bool {
        let moving_ms = network_ms - rtt_ms;
        // A transfer that is mostly round trip says nothing about bandwidth.
        if bytes == 0 || !moving_ms.is_finite() || moving_ms <= 0.25 * network_ms {
            return false;
        }
        let sample = bytes as f64 / moving_ms * 1e3;
        self.bytes_per_s = (self.bytes_per_s.ln() + self.weight * (sample.ln() - self.bytes_per_s.ln())).exp();
        true
    }
}

/// Re-plans from a moving bandwidth estimate, switching cuts only when the predicted gain
/// is worth it.
#[derive(Debug, Clone)]
pub struct Replanner {
    profiles: Profiles,
    objective: Objective,
    /// A new cut must be predicted at least this much better (a share, like 0.1 for 10%).
    margin: f64,
    current: usize,
}

impl Replanner {
    /// Starts at the best cut of `profiles`.
    pub fn new(profiles: Profiles, objective: Objective, margin: f64) -> Result<Self, ProfileError> {
        let predictions = profiles.predict(objective)?;
        let current = best(&predictions, objective).map_or(profiles.stage_count(), |p| p.cut);
        Ok(Self { profiles, objective, margin, current })
    }

    /// The cut in use.
    pub fn current(&self) -> usize {
        self.current
    }

    /// The prediction for `cut` with the link as last updated.
    pub fn prediction(&self, cut: usize) -> Result<CutPrediction, ProfileError> {
        if cut > self.profiles.stage_count() {
            return Err(ProfileError::PastLastCut { cut, last: self.profiles.stage_count() });
        }
        self.profiles.check()?;
        Ok(self.profiles.predict_cut(cut, self.objective))
    }

    /// Updates the link's bandwidth and returns the cut to use from now on.
    pub fn update(&mut self, bytes_per_s: f64) -> usize {
        self.profiles.link.bytes_per_s = bytes_per_s;
        let Ok(predictions) = self.profiles.predict(self.objective) else { return self.current };
        let Some(candidate) = best(&predictions, self.objective) else { return self.current };
        let now = &predictions[self.current];
        let better = match self.objective {
            Objective::Latency => candidate.latency_ms < now.latency_ms * (1.0 - self.margin),
            Objective::Throughput => candidate.throughput_rps > now.throughput_rps * (1.0 + self.margin),
        };
        if better {
            self.current = candidate.cut;
        }
        self.current
    }
}

/// Synthetic profiles with known best cuts, for the planner's tests and `auto_split`'s.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// Bytes per second in one Mbit/s.
    pub(crate) const MBIT: f64 = 1e6 / 8.0;

    /// A 4-stage model: a big input, a boundary that shrinks along the model, a small result;
    /// the edge 10x slower than the server.
    pub(crate) fn profiles(mbit_per_s: f64) -> Profiles {
        Profiles {
            edge_stage_ms: vec![20.0, 20.0, 20.0, 20.0],
            server_stage_ms: vec![2.0, 2.0, 2.0, 2.0],
            cut_wire_bytes: vec![600_000, 800_000, 100_000, 10_000, 4_000],
            cut_usable: vec![true; 5],
            result_wire_bytes: 4_000,
            codec_ms_per_mib: 0.0,
            link: Link { bytes_per_s: mbit_per_s * MBIT, rtt_ms: 1.0 },
            codec_choices: Vec::new(),
        }
    }

    /// [`profiles`] with `codec: auto`'s candidates at every cut: raw (the boundary as
    /// it is, no time), or a tenth of it at 10 ms per MiB.
    pub(crate) fn profiles_choosing_codecs(mbit_per_s: f64) -> Profiles {
        let mut p = profiles(mbit_per_s);
        let raw = CodecCost { codec: Codec::RAW, wire_ratio: 1.0, encode_ms_per_mib: 0.0, decode_ms_per_mib: 0.0 };
        let lz4 = CodecCost { codec: Codec::SHUFFLE_LZ4, wire_ratio: 0.1, encode_ms_per_mib: 6.0, decode_ms_per_mib: 4.0 };
        p.codec_choices = p.cut_wire_bytes.iter().map(|&b| CutCodecs { tensor_bytes: b, costs: vec![raw, lz4] }).collect();
        p
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{profiles, profiles_choosing_codecs, MBIT};
    use super::*;

    fn best_cut(p: &Profiles, objective: Objective) -> usize {
        best(&p.predict(objective).unwrap(), objective).unwrap().cut
    }

    #[test]
    fn latency_is_the_sum_of_its_parts() {
        let p = profiles(100.0);
        let at2 = p.predict(Objective::Latency).unwrap()[2];
        // Edge 40 ms, upload 100 kB at 12.5 MB/s = 8 ms, rtt 1, server 4, download 0.32.
        assert_eq!(at2.edge_ms, 40.0);
        assert!((at2.upload_ms - 8.0).abs() < 1e-9 && (at2.download_ms - 0.32).abs() < 1e-9);
        assert!((at2.latency_ms - (40.0 + 8.0 + 1.0 + 4.0 + 0.32)).abs() < 1e-9);
        assert!((at2.throughput_rps - 1e3 / 40.0).abs() < 1e-9);
        let edge_only = p.predict(Objective::Latency).unwrap()[4];
        assert_eq!((edge_only.latency_ms, edge_only.upload_ms, edge_only.rtt_ms), (80.0, 0.0, 0.0));
    }

    #[test]
    fn a_fast_link_sends_everything_to_the_fast_server() {
        // 10 Gbit/s: the 600 kB input takes 0.48 ms; all on the server costs about 10 ms.
        assert_eq!(best_cut(&profiles(10_000.0), Objective::Latency), 0);
    }

    #[test]
    fn a_slow_link_keeps_work_on_the_edge_until_the_boundary_is_small() {
        // 5 Mbit/s: the input takes 960 ms and cut 2's 100 kB 160 ms, cut 3's 10 kB 16 ms:
        // 60 + 16 + 1 + 2 + 6.4 = 85.4 ms, while the edge alone takes 80 ms.
        assert_eq!(best_cut(&profiles(5.0), Objective::Latency), 4);
        // At 25 Mbit/s cut 3 costs 60 + 3.2 + 1 + 2 + 1.28 = 67.5 ms and wins.
        assert_eq!(best_cut(&profiles(25.0), Objective::Latency), 3);
    }

    #[test]
    fn throughput_balances_the_pipeline_where_latency_would_not() {
        // At 100 Mbit/s with a 400 kB input and 250 kB at cut 1: all on the server is the
        // quickest request (32 + 1 + 8 + 0.32 = 41.3 ms, cut 1: 20 + 20 + 1 + 6 + 0.32 =
        // 47.3 ms), but its 32 ms upload limits the pipeline to 31 requests/s, where cut 1's
        // slowest part takes 20 ms (50 requests/s).
        let mut p = profiles(100.0);
        p.cut_wire_bytes[0] = 400_000;
        p.cut_wire_bytes[1] = 250_000;
        assert_eq!(best_cut(&p, Objective::Latency), 0);
        assert_eq!(best_cut(&p, Objective::Throughput), 1);
        assert!((p.predict(Objective::Latency).unwrap()[1].throughput_rps - 50.0).abs() < 1e-9);
    }

    #[test]
    fn with_codec_auto_the_cut_and_the_codec_are_chosen_together() {
        // At 5 Mbit/s with raw only, the edge alone is best (80 ms). Compressed to a tenth,
        // cut 2's 100 kB take 16 ms plus about 1 ms of codec: 40 + 0.95 + 16 + 1 + 4 + 6.4 =
        // 68.4 ms, less than cut 3 (71.1 ms) or the edge alone.
        assert_eq!(best_cut(&profiles(5.0), Objective::Latency), 4);
        let p = profiles_choosing_codecs(5.0);
        let chosen = *best(&p.predict(Objective::Latency).unwrap(), Objective::Latency).unwrap();
        assert_eq!((chosen.cut, chosen.codec), (2, Some(Codec::SHUFFLE_LZ4)));
        assert!((chosen.latency_ms - (40.0 + 100_000.0 / 1048576.0 * 10.0 + 16.0 + 1.0 + 4.0 + 6.4)).abs() < 1e-9, "{chosen:?}");
        // At 10 Gbit/s compressing costs more than it saves: everything on the server, raw.
        let p = profiles_choosing_codecs(10_000.0);
        let chosen = *best(&p.predict(Objective::Latency).unwrap(), Objective::Latency).unwrap();
        assert_eq!((chosen.cut, chosen.codec), (0, Some(Codec::RAW)));
        // The edge alone sends nothing, so it has no codec.
        assert_eq!(p.predict(Objective::Latency).unwrap()[4].codec, None);
        // The re-planner follows the link with both.
        let mut replanner = Replanner::new(profiles_choosing_codecs(10_000.0), Objective::Latency, 0.1).unwrap();
        assert_eq!(replanner.current(), 0);
        assert_eq!(replanner.update(5.0 * MBIT), 2);
        assert_eq!(replanner.prediction(2).unwrap().codec, Some(Codec::SHUFFLE_LZ4));
    }

    #[test]
    fn a_codec_that_saves_under_one_percent_is_predicted_as_codec_auto_would_choose_raw() {
        // Free and 0.5% smaller: faster on paper, but within the noise of its measured cost,
        // so `codec: auto` sends raw, and the prediction must say what will run.
        let mut p = profiles_choosing_codecs(5.0);
        for choices in &mut p.codec_choices {
            choices.costs[1] = CodecCost { codec: Codec::SHUFFLE_LZ4, wire_ratio: 0.995, encode_ms_per_mib: 0.0, decode_ms_per_mib: 0.0 };
        }
        let predictions = p.predict(Objective::Latency).unwrap();
        assert!(predictions[..4].iter().all(|c| c.codec == Some(Codec::RAW)), "{predictions:?}");
        // Where raw is not a candidate (the server refuses it), the codec that is left runs.
        for choices in &mut p.codec_choices {
            choices.costs.remove(0);
        }
        assert_eq!(p.predict(Objective::Latency).unwrap()[2].codec, Some(Codec::SHUFFLE_LZ4));
    }

    #[test]
    fn unusable_cuts_are_never_chosen() {
        let mut p = profiles(25.0);
        p.cut_usable[3] = false;
        let cut = best_cut(&p, Objective::Latency);
        assert_ne!(cut, 3);
        // The all-edge cut is always usable: nothing crosses.
        p.cut_usable = vec![false; 5];
        assert_eq!(best_cut(&p, Objective::Latency), 4);
    }

    #[test]
    fn profiles_that_do_not_fit_are_refused() {
        let mut p = profiles(25.0);
        p.cut_wire_bytes.pop();
        assert!(matches!(p.predict(Objective::Latency), Err(ProfileError::Lengths { .. })));
        let mut p = profiles(25.0);
        p.server_stage_ms[1] = f64::NAN;
        assert!(p.predict(Objective::Latency).unwrap_err().to_string().contains("server_stage_ms"));
        let mut p = profiles_choosing_codecs(25.0);
        p.codec_choices.pop();
        assert!(p.predict(Objective::Latency).unwrap_err().to_string().contains("codec costs at 4 cuts"));
        let mut p = profiles_choosing_codecs(25.0);
        p.codec_choices[1].costs[1].wire_ratio = f64::INFINITY;
        assert!(p.predict(Objective::Latency).unwrap_err().to_string().contains("wire_ratio"));
        let mut p = profiles(25.0);
        p.link.bytes_per_s = 0.0;
        assert!(p.predict(Objective::Latency).unwrap_err().to_string().contains("link.bytes_per_s"));
    }

    #[test]
    fn the_estimate_follows_a_changed_link_and_ignores_tiny_transfers() {
        let mut bw = BandwidthEstimate::new(100.0 * MBIT, 0.3);
        // The link drops to 10 Mbit/s: 125 kB take 100 ms plus the 1 ms round trip.
        for _ in 0..20 {
            assert!(bw.observe(125_000, 101.0, 1.0));
        }
        assert!((bw.bytes_per_s() / (10.0 * MBIT) - 1.0).abs() < 0.01, "{}", bw.bytes_per_s() / MBIT);
        // A transfer that is mostly round trip says nothing about bandwidth.
        assert!(!bw.observe(100, 1.1, 1.0));
        // A fall by 200x is followed as quickly as a rise by 200x: within 2x after 5 transfers each way.
        let mut bw = BandwidthEstimate::new(1000.0 * MBIT, 0.5);
        for _ in 0..5 {
            bw.observe(625_000, 1001.0, 1.0); // 5 Mbit/s
        }
        assert!((bw.bytes_per_s() / (5.0 * MBIT)) < 2.0, "{}", bw.bytes_per_s() / MBIT);
        for _ in 0..5 {
            bw.observe(625_000, 6.0, 1.0); // 1000 Mbit/s
        }
        assert!((1000.0 * MBIT / bw.bytes_per_s()) < 2.0, "{}", bw.bytes_per_s() / MBIT);
    }

    #[test]
    fn the_replanner_moves_when_the_link_changes_and_not_on_noise() {
        let mut plan = Replanner::new(profiles(10_000.0), Objective::Latency, 0.1).unwrap();
        assert_eq!(plan.current(), 0);
        // Small wobbles do not move it.
        assert_eq!(plan.update(9_500.0 * MBIT), 0);
        // The link falls to 25 Mbit/s: cut 3 is best.
        assert_eq!(plan.update(25.0 * MBIT), 3);
        // Then to 2 Mbit/s: everything on the edge (80 ms; cut 3 would take 119 ms).
        assert_eq!(plan.update(2.0 * MBIT), 4);
        // At 7 Mbit/s cut 3 is predicted best (60 + 11.4 + 1 + 2 + 4.6 = 79 ms against 80
        // on the edge), but by less than the margin: the split stays.
        assert_eq!(best_cut(&profiles(7.0), Objective::Latency), 3);
        assert_eq!(plan.update(7.0 * MBIT), 4);
    }
}
