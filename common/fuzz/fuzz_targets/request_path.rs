//! A hostile `Infer` stream through the server's request path, in the server's order
//! (`server/src/infer.rs`): each frame goes to a `FrameAssembler`; a payload's first frame
//! is started by the stream's `PayloadReceiver` (envelope, sizes against the limit, the cut's
//! spec in the bundle), then either answered from the window of recent results (a resent
//! request, its frames skipped) or its bytes are reserved in the memory budget; a stalled
//! request is given up; a complete payload is finished into tensors, its split checked against the
//! stage count, and its boundary checked against its cut as the server does before
//! queueing it for its device. The input format is `cleave_common_fuzz::decode`'s.
//!
//! Besides "no panic", the target checks, against a reading of its own:
//! - the envelope the receiver accepts declares exactly the tensors of the cut it names,
//!   one batch size in the bundle's range, and an unsealed one that does is accepted;
//! - what a payload holds (its data as received, its tensors as decoded) stays within the
//!   limit and the codec's bounds, and the frames never push more than it declared;
//! - the assembler's outcomes (pending, complete, failed, skipped) follow the framing rules;
//! - what finishes is what was declared, dtypes, shapes and bytes.

#![no_main]

use std::sync::OnceLock;

use cleave_codec::pb::PayloadEnvelope;
use cleave_codec::IncomingPayload;
use cleave_common::pb::InferFrame;
use cleave_common::spec::{BoundarySizes, DType, Dim, TorchDType};
use cleave_common::wire::{CodecError, CodecPolicy, Direction, FrameAssembler, Key, KeyRing, PayloadReceiver, Reassembly, Received, WireError};
use cleave_common::Bundle;
use cleave_common_fuzz::{bundle_dir, decode, Record, FUZZ_KEY, LIMIT, MEMORY_BUDGET};
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// The bundle and the key ring, loaded once.
struct Fixture {
    bundle: Bundle,
    ring: KeyRing,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        // The fuzzer runs one job on one core; libtorch's pools would only add threads.
        tch::set_num_threads(1);
        let dir = bundle_dir();
        let bundle = Bundle::open(&dir).unwrap_or_else(|e| {
            panic!("the fuzz bundle {}: {e} (set CLEAVE_FUZZ_BUNDLE, or export the test bundles with `make test-bundles`)", dir.display())
        });
        Fixture { bundle, ring: KeyRing::new([(1, Key::from_bytes(FUZZ_KEY))]).expect("one key") }
    })
}

/// Why a request was refused from its first frame.
#[derive(Debug)]
enum Refused {
    Wire(WireError),
    /// The server's memory budget cannot hold what the envelope declares.
    OverBudget,
}

impl From<WireError> for Refused {
    fn from(e: WireError) -> Self {
        Self::Wire(e)
    }
}

/// What a started payload declares, as the target reads its envelope itself.
#[derive(Debug)]
struct Declared {
    request_id: u64,
    split: usize,
    wire_len: u64,
    raw_len: u64,
    /// Each tensor's dtype and shape, in header order.
    tensors: Vec<(DType, Vec<i64>)>,
}

/// The most bytes any codec may carry `raw` tensor bytes of `count` tensors in: lz4's bound
/// (10% and 20 bytes over) or zstd's (under 1% and 64 bytes over) per tensor, and the seal's
/// 16-byte tag. Precisions only narrow what is carried.
fn wire_bound(raw: u64, count: usize) -> u64 {
    raw + raw / 10 + 64 * count as u64 + 16
}

/// Whether `payload` declares exactly the tensors of the cut it names, with one batch size
/// and one sequence length within the bundle's ranges (read from the manifest,
/// independently of `check_declared`).
fn fits_its_cut(bundle: &Bundle, payload: &IncomingPayload) -> bool {
    let manifest = bundle.manifest();
    let Some(cut) = manifest.cuts.get(payload.split() as usize) else { return false };
    if !cut.usable && cut.index != bundle.stage_count() {
        return false;
    }
    let specs = cut.tensors();
    let declared: Vec<_> = payload.declared_tensors().collect();
    if declared.len() != specs.len() {
        return false;
    }
    let (mut batch, mut seq) = (None, None);
    for (name, spec) in &specs {
        // As many declared as specs, each spec's name declared exactly once: the same set.
        let mut named = declared.iter().filter(|(n, ..)| n == name);
        let (Some((_, dtype, shape)), None) = (named.next(), named.next()) else { return false };
        if *dtype != spec.dtype || shape.len() != spec.shape.len() {
            return false;
        }
        for (&dim, &size) in spec.shape.iter().zip(shape.iter()) {
            let fits = match dim {
                Dim::Fixed(n) => n == size,
                Dim::Batch(k) => size > 0 && size % k == 0 && *batch.get_or_insert(size / k) == size / k,
                Dim::Seq(k, c) => size > c && (size - c) % k == 0 && *seq.get_or_insert((size - c) / k) == (size - c) / k,
                Dim::Dynamic => true,
            };
            if !fits {
                return false;
            }
        }
    }
    let seq_fits = match (seq, manifest.sequence) {
        (None, _) => true,
        (Some(s), Some(range)) => (range.min..=range.max).contains(&s),
        (Some(_), None) => false,
    };
    seq_fits && batch.is_none_or(|b| (manifest.batch.min..=manifest.batch.max).contains(&b))
}

/// Starts a request from its first frame as the server does (`start_request`): the
/// receiver checks the envelope against the cut it names. Checks the receiver's verdict
/// against the target's own.
fn start(f: &Fixture, rx: &PayloadReceiver, frame: &InferFrame) -> Result<(Reassembly, Declared), Refused> {
    let started = rx.start(frame.request_id, &frame.header);
    // A fresh opener of the same ring accepts at least what the stream's opener does (it
    // has seen no nonce yet).
    let parsed = IncomingPayload::parse(&frame.header, Direction::Request, LIMIT, &CodecPolicy::default(), &f.ring.opener());
    let fits = parsed.as_ref().is_ok_and(|p| p.request_id() == frame.request_id && fits_its_cut(&f.bundle, p));
    let assembly = match started {
        Ok(assembly) => assembly,
        Err(e) => {
            let sealed = PayloadEnvelope::decode(&frame.header[..]).is_ok_and(|env| env.seal.is_some());
            // A sealed one may be refused for its nonce (a replay), which a fresh opener cannot see.
            assert!(sealed || !fits, "an unsealed payload that fits its cut was refused: {e}");
            return Err(e.into());
        }
    };
    let payload = parsed.unwrap_or_else(|e| panic!("the receiver accepted an envelope that does not parse: {e}"));
    assert!(
        fits,
        "the receiver accepted a payload that does not fit its cut: split {}, {:?}",
        payload.split(),
        payload.declared_tensors().collect::<Vec<_>>()
    );
    let declared = Declared {
        request_id: frame.request_id,
        split: payload.split() as usize,
        wire_len: payload.wire_len(),
        raw_len: payload.raw_len(),
        tensors: payload.declared_tensors().map(|(_, dtype, shape)| (dtype, shape.to_vec())).collect(),
    };
    assert_eq!(assembly.request_id, frame.request_id);
    assert_eq!(assembly.split() as usize, declared.split);
    assert!(declared.raw_len <= LIMIT, "accepted {} tensor bytes over the limit of {LIMIT}", declared.raw_len);
    let bound = wire_bound(declared.raw_len, declared.tensors.len());
    assert!(declared.wire_len <= bound, "accepted {} data bytes for {} tensor bytes (at most {bound})", declared.wire_len, declared.raw_len);
    assert_eq!(assembly.held_bytes(), declared.wire_len + declared.raw_len, "held bytes are the data as received plus as decoded");
    Ok((assembly, declared))
}

/// How the target expects a frame to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// More frames are to come, or the frame was skipped.
    Pending,
    /// The request's last frame is in, after this many data bytes.
    Complete { request_id: u64, pushed: u64 },
    /// The request failed.
    Failed { request_id: u64, why: Failure },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Start,
    Interleaved,
    Overrun,
}

/// The framing rules, as `FrameAssembler`'s documentation states them: a payload starts at a
/// frame when none is part-way in; its frames must all be of its request and carry no more
/// than it declared; it ends at the frame marked last; a failed (or given up) request's
/// frames are skipped up to and including its last.
#[derive(Debug, Default)]
struct Framing {
    /// The request part-way in: its id, the bytes it has received and the bytes it declared.
    current: Option<(u64, u64, u64)>,
    skipping: Option<u64>,
}

impl Framing {
    fn starts_payload(&self, request_id: u64) -> bool {
        self.current.is_none() && self.skipping != Some(request_id)
    }

    fn give_up(&mut self) -> Option<u64> {
        let (id, ..) = self.current.take()?;
        self.skipping = Some(id);
        Some(id)
    }

    /// The payload `frame` starts was answered from its first frame: skipped to its last.
    fn skip_payload(&mut self, frame: &InferFrame) {
        self.current = None;
        self.skipping = (!frame.last).then_some(frame.request_id);
    }

    /// `started`: the declared data length, or `Err` when the start was refused.
    fn push(&mut self, frame: &InferFrame, started: Option<Result<u64, ()>>) -> Outcome {
        let (id, len) = (frame.request_id, frame.data.len() as u64);
        if self.skipping == Some(id) {
            if frame.last {
                self.skipping = None;
            }
            return Outcome::Pending;
        }
        self.skipping = None;
        let (current, pushed, declared) = match (self.current.take(), started) {
            (Some(current), _) => current,
            (None, Some(Ok(declared))) => (id, 0, declared),
            (None, Some(Err(()))) => return self.fail(frame, id, Failure::Start),
            (None, None) => unreachable!("a payload starts wherever none is part-way in"),
        };
        if id != current {
            return self.fail(frame, current, Failure::Interleaved);
        }
        if pushed + len > declared {
            return self.fail(frame, current, Failure::Overrun);
        }
        if !frame.last {
            self.current = Some((current, pushed + len, declared));
            return Outcome::Pending;
        }
        Outcome::Complete { request_id: current, pushed: pushed + len }
    }

    fn fail(&mut self, frame: &InferFrame, request_id: u64, why: Failure) -> Outcome {
        self.skipping = (!frame.last).then_some(frame.request_id);
        Outcome::Failed { request_id, why }
    }
}

/// What a finished payload must be: what its envelope declared, in the cut's range; when
/// the server's check of its boundary passes, the cut's values at one batch size.
fn check_received(f: &Fixture, declared: &Declared, received: &Received) {
    assert_eq!((received.request_id, received.split as usize), (declared.request_id, declared.split));
    let leaves = received.boundary.tensors();
    let mut got: Vec<(String, Vec<i64>)> = leaves
        .iter()
        .map(|(name, t)| (DType::from_kind(t.kind()).unwrap_or_else(|| panic!("{name}: kind {:?} decoded", t.kind())).to_string(), t.size()))
        .collect();
    let mut want: Vec<(String, Vec<i64>)> = declared.tensors.iter().map(|(dtype, shape)| (dtype.to_string(), shape.clone())).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "the tensors decoded are not the tensors declared");
    assert_eq!(received.boundary.tensor_bytes() as u64, declared.raw_len);
    // The server answers a split past the last cut before it checks the boundary; the cut check
    // at the first frame has refused those already.
    assert!(declared.split <= f.bundle.stage_count());
    let Ok(BoundarySizes { batch, seq }) = f.bundle.check_boundary(declared.split, &received.boundary) else { return };
    let manifest = f.bundle.manifest();
    assert!((manifest.batch.min..=manifest.batch.max).contains(&batch), "batch {batch} out of range");
    let specs = f.bundle.cut(declared.split).tensors();
    assert_eq!(leaves.len(), specs.len());
    for ((name, tensor), (spec_name, spec)) in leaves.iter().zip(&specs) {
        assert_eq!(name, spec_name);
        assert_eq!(DType::from_kind(tensor.kind()), Some(spec.dtype), "{name}");
        let sizes: Vec<i64> = spec
            .shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => *n,
                Dim::Batch(k) => k * batch,
                Dim::Seq(k, c) => k * seq.expect("a sequence dimension gives the boundary a length") + c,
                Dim::Dynamic => -1,
            })
            .collect();
        for (axis, (&want, got)) in sizes.iter().zip(tensor.size()).enumerate() {
            assert!(want == -1 || want == got, "{name}: dimension {axis} is {got}, the cut has {want} at batch {batch}");
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let f = fixture();
    // One stream's receiver, as the server builds it (`service.rs`).
    let mut rx = PayloadReceiver::new(Direction::Request, LIMIT, CodecPolicy::default(), &f.ring).checked_against(&f.bundle);
    let mut frames = FrameAssembler::<Declared>::default();
    let mut framing = Framing::default();
    for Record { stall_before, recalled, frame } in decode(input) {
        if stall_before {
            // The request part-way in missed its deadline: the server gives it up.
            assert_eq!(frames.give_up(), framing.give_up());
        }
        let starts = frames.starts_payload(&frame);
        assert_eq!(starts, framing.starts_payload(frame.request_id));
        let started = match starts.then(|| start(f, &rx, &frame)) {
            Some(Ok(_)) if recalled => {
                // A resent request: answered from the window of recent results, nothing
                // reserved, the rest of its frames skipped.
                frames.skip_payload(&frame);
                framing.skip_payload(&frame);
                assert!(!frames.in_progress());
                continue;
            }
            // The server's reservation: what does not fit the whole budget is refused at once.
            Some(Ok((assembly, _))) if assembly.held_bytes() > MEMORY_BUDGET => Some(Err(Refused::OverBudget)),
            started => started,
        };
        let expected = framing.push(&frame, started.as_ref().map(|s| s.as_ref().map(|(_, d)| d.wire_len).map_err(|_| ())));
        match (frames.push_started(&frame, started), expected) {
            (Ok(None), Outcome::Pending) => {}
            (Ok(Some((assembly, declared))), Outcome::Complete { request_id, pushed }) => {
                assert_eq!((assembly.request_id, declared.request_id), (request_id, request_id));
                // The server finishes it on its blocking pool, then checks it and queues it.
                match rx.finish(assembly) {
                    Ok(received) => {
                        assert_eq!(pushed, declared.wire_len, "a payload decoded from other than its declared bytes");
                        check_received(f, &declared, &received);
                    }
                    Err(e) if pushed < declared.wire_len => {
                        assert!(matches!(e, WireError::Codec(CodecError::Truncated { .. })), "a short payload failed otherwise: {e}")
                    }
                    Err(_) => {}
                }
            }
            (Err((id, e)), Outcome::Failed { request_id, why }) => {
                assert_eq!(id, request_id, "the failure names another request ({e:?})");
                let fits = match why {
                    Failure::Start => !matches!(e, Refused::Wire(WireError::Interleaved { .. } | WireError::Overrun { .. })),
                    Failure::Interleaved => matches!(e, Refused::Wire(WireError::Interleaved { .. })),
                    Failure::Overrun => matches!(e, Refused::Wire(WireError::Overrun { .. })),
                };
                assert!(fits, "expected a failure at {why:?}, got {e:?}");
            }
            (got, expected) => panic!(
                "frame {:?}: expected {expected:?}, got {:?}",
                (frame.request_id, frame.data.len(), frame.last),
                got.map(|d| d.map(|(a, _)| a.request_id))
            ),
        }
        assert_eq!(frames.in_progress(), framing.current.is_some());
    }
});
