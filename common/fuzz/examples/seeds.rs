//! Writes seed inputs for `request_path`: `Infer` streams of valid requests at several cuts
//! of the bundle (`CLEAVE_FUZZ_BUNDLE`, by default the digits test bundle), with every kind
//! of codec, unsealed and sealed with the target's key, framed whole or in chunks; streams of
//! several requests; and streams where a request fails (a garbled envelope, another cut's
//! tensors, a batch out of range, a stray frame, an overrun, a stall) or is answered from the
//! server's window of recent results, and the next one assembles. The fuzzer starts from these to reach the decoding behind the checks.
//!
//!     cargo run --example seeds -- corpus/request_path

use bytes::Bytes;
use cleave_common::pb::InferFrame;
use cleave_common::spec::Dim;
use cleave_common::wire::{frame_parts, Codec, Direction, EncodedPayload, Key, KeyRing, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, Bundle, Value};
use cleave_common_fuzz::{bundle_dir, decode, encode, Record, FUZZ_KEY};
use tch::Tensor;

/// Cuts and batch sizes of the single-request seeds: the input, early, middle and late
/// features, the classifier and the output (small batches keep the inputs small).
const CUTS: [(usize, i64); 6] = [(0, 3), (1, 1), (4, 1), (7, 2), (8, 2), (12, 4)];

const CODECS: [&str; 8] = ["raw", "lz4", "shuffle+lz4", "zstd-3", "shuffle+zstd-1", "fp16+shuffle+lz4", "bf16+zstd", "int8+shuffle+lz4"];

/// The boundary at `cut` for `batch` samples: post-ReLU-like floats (exact zeros, so the
/// compressors have something to do).
fn boundary(bundle: &Bundle, cut: usize, batch: i64) -> Boundary {
    let values = bundle
        .cut(cut)
        .values
        .iter()
        .map(|v| {
            let cleave_common::spec::ValueSpec::Tensor(spec) = &v.spec else { panic!("{}: the seeds know tensor values only", v.name) };
            let shape: Vec<i64> = spec
                .shape
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => *n,
                    Dim::Batch(k) => k * batch,
                    Dim::Dynamic => 1,
                })
                .collect();
            let n: i64 = shape.iter().product();
            let floats: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.37).sin() * 3.0 + (i as f32 * 0.011).cos()).max(0.0)).collect();
            (v.name.clone(), Value::Tensor(Tensor::from_slice(&floats).view(shape.as_slice())))
        })
        .collect();
    Boundary { values }
}

/// A payload's frames: the whole payload in one frame when `chunk` is `None`.
fn frames(request_id: u64, enc: &EncodedPayload, chunk: Option<usize>) -> Vec<Record> {
    frame_parts(enc.envelope.clone(), &enc.data, chunk.unwrap_or(usize::MAX))
        .into_iter()
        .map(|p| Record { stall_before: false, recalled: false, frame: InferFrame { request_id, header: p.header, data: p.data, last: p.last, ..Default::default() } })
        .collect()
}

struct Seeds {
    dir: std::path::PathBuf,
    written: usize,
}

impl Seeds {
    fn write(&mut self, name: &str, records: &[Record]) {
        let input = encode(records);
        assert_eq!(decode(&input), records, "{name}: the target reads back other records");
        std::fs::write(self.dir.join(name.replace(['+', ' '], "_")), input).expect("writes a seed");
        self.written += 1;
    }
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: seeds DIR"));
    std::fs::create_dir_all(&dir).expect("creates the corpus directory");
    let bundle = Bundle::open(bundle_dir()).unwrap_or_else(|e| panic!("the fuzz bundle {}: {e}", bundle_dir().display()));
    let ring = KeyRing::new([(1, Key::from_bytes(FUZZ_KEY))]).expect("one key");
    let meta = |request_id, split| PayloadMeta { request_id, split, direction: Direction::Request };
    let mut seeds = Seeds { dir, written: 0 };

    // One request per seed: every cut with every codec, unsealed and sealed, whole or in chunks.
    for (cut, batch) in CUTS {
        let input = boundary(&bundle, cut, batch);
        for (i, codec) in CODECS.iter().enumerate() {
            let parsed: Codec = codec.parse().expect("a codec name");
            for sealed in [false, true] {
                let mut sender = if sealed { PayloadSender::sealed(&ring, 1).expect("key 1") } else { PayloadSender::plain() };
                let enc = sender.encode(meta(1, cut as u32), &parsed, &input).expect("encodes");
                // Alternate whole and chunked, so each cut has both.
                let chunk = (i % 2 == 1).then_some(700);
                let name =
                    format!("cut{cut}_b{batch}_{codec}{}{}", if sealed { "_sealed" } else { "" }, if chunk.is_some() { "_chunked" } else { "" });
                seeds.write(&name, &frames(1, &enc, chunk));
            }
        }
    }

    let small = boundary(&bundle, 12, 2);
    let features = boundary(&bundle, 8, 1);
    // Several requests on one stream: ids in order, one sender (so one nonce sequence) each.
    for sealed in [false, true] {
        let mut sender = if sealed { PayloadSender::sealed(&ring, 1).expect("key 1") } else { PayloadSender::plain() };
        let mut records = Vec::new();
        for (id, (cut, input, codec)) in [(12, &small, "raw"), (8, &features, "shuffle+lz4"), (12, &small, "bf16+zstd")].into_iter().enumerate() {
            let id = id as u64 + 1;
            records.extend(frames(id, &sender.encode(meta(id, cut), &codec.parse().expect("a codec"), input).expect("encodes"), Some(300)));
        }
        seeds.write(&format!("three_requests{}", if sealed { "_sealed" } else { "" }), &records);
    }

    let raw = |id, cut, input: &Boundary| PayloadSender::plain().encode(meta(id, cut), &Codec::RAW, input).expect("encodes");
    let good = frames(2, &raw(2, 12, &small), Some(64));
    let then_good = |mut records: Vec<Record>| {
        records.extend(good.iter().cloned());
        records
    };
    // A garbled envelope: refused, its frames skipped, the next request assembles.
    let mut garbled = frames(1, &raw(1, 8, &features), Some(1000));
    garbled[0].frame.header = Bytes::from_static(&[0xff; 9]);
    seeds.write("garbled_then_good", &then_good(garbled));
    // Tensors of cut 8 under split 9 (a name the cut does not have), and a batch out of range.
    seeds.write("wrong_cut_then_good", &then_good(frames(1, &raw(1, 9, &features), Some(1000))));
    seeds.write("batch_out_of_range_then_good", &then_good(frames(1, &raw(1, 12, &boundary(&bundle, 12, 17)), None)));
    // A frame of another request inside request 1, skipped to its end.
    let mut interleaved = frames(1, &raw(1, 8, &features), Some(500));
    let stray = InferFrame { request_id: 5, header: Bytes::new(), data: Bytes::from_static(&[0; 8]), last: true, ..Default::default() };
    interleaved.insert(1, Record { stall_before: false, recalled: false, frame: stray });
    seeds.write("interleaved_then_good", &then_good(interleaved));
    // More data than declared.
    let mut overrun = frames(1, &raw(1, 12, &small), Some(40));
    overrun.last_mut().expect("a frame").frame.data = Bytes::from(vec![0; 60]);
    seeds.write("overrun_then_good", &then_good(overrun));
    // A request that stalls part-way: given up, its late frames skipped.
    let mut stalled = frames(1, &raw(1, 8, &features), Some(500));
    stalled[2].stall_before = true;
    seeds.write("stall_then_good", &then_good(stalled));
    // A resent request answered from the server's window of recent results: its frames skipped.
    let mut resent = frames(1, &raw(1, 8, &features), Some(500));
    resent[0].recalled = true;
    seeds.write("recalled_then_good", &then_good(resent));
    // A request id that needs all eight bytes.
    let id = 0x0123_4567_89ab_cdef;
    seeds.write("large_request_id", &frames(id, &raw(id, 12, &small), Some(100)));

    println!("wrote {} seeds to {}", seeds.written, seeds.dir.display());
}
