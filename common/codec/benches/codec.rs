//! Throughput of each codec step on real boundary tensors: resnet18 activations at three cuts
//! from `make bench-activations`, or the file `CLEAVE_BENCH_ACTIVATIONS` names (relative to the
//! workspace root). In bytes/s of raw tensor bytes: a memcpy (the floor), the byte shuffle,
//! zero elision, lz4, zstd and AES-256-GCM alone and together, both directions, and whole
//! payloads as `encode_payload` and `IncomingPayload` produce them. Blocks of a tensor of
//! 1 MiB or more run on rayon's workers: `RAYON_NUM_THREADS=1` times one core. Compression ratios are not timings: `cargo run --release -p
//! cleave-codec --example codec_ratios` prints them.

mod support;

use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use cleave_codec::compress::{compress_blocks, decompress_blocks};
use cleave_codec::pb::Block;
use cleave_codec::shuffle::{shuffle, unshuffle};
use cleave_codec::zeros;
use cleave_codec::{
    encode_payload, Codec, CodecPolicy, Compression, Direction, EncodedPayload, IncomingPayload, Key, KeyRing, PayloadMeta, TensorData,
};
use criterion::measurement::WallTime;
use criterion::{black_box, BatchSize, BenchmarkGroup, Criterion, Throughput};

use support::Cut;

const META: PayloadMeta = PayloadMeta { request_id: 1, split: 4, direction: Direction::Request };
const LIMIT: u64 = 1 << 30;

/// Shuffles (when asked) and compresses every tensor of `cut` into `out` in blocks, as
/// `encode_payload` does per tensor; each tensor's blocks.
fn encode_tensors(cut: &Cut, shuffled: bool, compression: Compression, scratch: &mut Vec<u8>, out: &mut Vec<u8>) -> Vec<Vec<Block>> {
    out.clear();
    let mut blocks = Vec::new();
    for t in &cut.tensors {
        let (bytes, planes) = if shuffled {
            shuffle(&t.data, t.dtype.size(), scratch);
            (&scratch[..], t.dtype.size())
        } else {
            (&t.data[..], 1)
        };
        blocks.push(compress_blocks(compression, bytes, planes, out).expect("compresses"));
    }
    blocks
}

/// Each tensor's encoded bytes and blocks, for the decode direction.
fn encoded_parts(cut: &Cut, shuffled: bool, compression: Compression) -> Vec<(Vec<u8>, Vec<Block>)> {
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    cut.tensors
        .iter()
        .map(|t| {
            let one = Cut { index: cut.index, tensors: vec![t.clone()] };
            let mut blocks = encode_tensors(&one, shuffled, compression, &mut scratch, &mut out);
            (out.clone(), blocks.remove(0))
        })
        .collect()
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    // Whole-tensor steps take milliseconds: fewer, longer samples keep a run to minutes.
    g.sample_size(20);
    g
}

/// A group timing `step` on every tensor of each cut, with one output buffer it may reuse.
fn per_tensor(c: &mut Criterion, name: &str, cuts: &[Cut], mut step: impl FnMut(&TensorData, &mut Vec<u8>)) {
    let mut g = group(c, name);
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let mut out = Vec::new();
        g.bench_function(cut.id(), |b| {
            b.iter(|| {
                for t in &cut.tensors {
                    step(t, &mut out);
                }
            })
        });
    }
    g.finish();
}

fn transforms(c: &mut Criterion, cuts: &[Cut]) {
    // The floor every step is measured against: the same bytes copied once.
    per_tensor(c, "memcpy", cuts, |t, out| {
        out.resize(t.data.len(), 0);
        out.copy_from_slice(black_box(&t.data));
    });
    per_tensor(c, "shuffle", cuts, |t, out| shuffle(black_box(&t.data), t.dtype.size(), out));

    let mut g = group(c, "unshuffle");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let shuffled: Vec<Vec<u8>> = cut
            .tensors
            .iter()
            .map(|t| {
                let mut s = Vec::new();
                shuffle(&t.data, t.dtype.size(), &mut s);
                s
            })
            .collect();
        let mut out = Vec::new();
        g.bench_function(cut.id(), |b| {
            b.iter(|| {
                for (t, s) in cut.tensors.iter().zip(&shuffled) {
                    unshuffle(black_box(s), t.dtype.size(), &mut out);
                }
            })
        });
    }
    g.finish();

    // Zero elision, which `encode_payload` applies before the shuffle where a tensor's
    // sample is at least an eighth zeros (the post-ReLU cuts).
    let mut g = group(c, "elide-zeros");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let (mut mask, mut kept) = (Vec::new(), Vec::new());
        g.bench_function(cut.id(), |b| {
            b.iter(|| {
                for t in &cut.tensors {
                    mask.clear();
                    kept.clear();
                    zeros::elide(black_box(&t.data), t.dtype.size(), &mut mask, &mut kept);
                }
            })
        });
    }
    g.finish();

    let mut g = group(c, "restore-zeros");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let elided: Vec<(Vec<u8>, Vec<u8>)> = cut
            .tensors
            .iter()
            .map(|t| {
                let (mut mask, mut kept) = (Vec::new(), Vec::new());
                zeros::elide(&t.data, t.dtype.size(), &mut mask, &mut kept);
                (mask, kept)
            })
            .collect();
        let mut outs: Vec<Vec<u8>> = cut.tensors.iter().map(|t| vec![0; t.data.len()]).collect();
        g.bench_function(cut.id(), |b| {
            b.iter(|| {
                for ((t, (mask, kept)), out) in cut.tensors.iter().zip(&elided).zip(&mut outs) {
                    zeros::restore(black_box(mask), kept, t.dtype.size(), out).expect("restores");
                }
            })
        });
    }
    g.finish();
}

/// The shuffle and compression steps alone, without zero elision: the `payload-encode`
/// group times each codec as it is sent.
fn compression(c: &mut Criterion, cuts: &[Cut]) {
    let steps = [
        ("lz4", false, Compression::Lz4),
        ("shuffle+lz4", true, Compression::Lz4),
        ("zstd--1", false, Compression::Zstd(-1)),
        ("shuffle+zstd--1", true, Compression::Zstd(-1)),
        ("zstd-1", false, Compression::Zstd(1)),
        ("shuffle+zstd-1", true, Compression::Zstd(1)),
        ("zstd-3", false, Compression::Zstd(3)),
        ("shuffle+zstd-3", true, Compression::Zstd(3)),
    ];
    for (name, shuffled, compression) in steps {
        let mut g = group(c, name);
        for cut in cuts {
            g.throughput(Throughput::Bytes(cut.raw_bytes()));
            let (mut scratch, mut out) = (Vec::new(), Vec::new());
            g.bench_function(cut.id(), |b| b.iter(|| encode_tensors(black_box(cut), shuffled, compression, &mut scratch, &mut out)));
        }
        g.finish();
    }

    // lz4_flex alone, as a library user would call it: each tensor whole, on one core, no
    // sample, no blocks. The reference `shuffle+lz4` is held to (at least 0.8x).
    per_tensor(c, "lz4_flex", cuts, |t, out| {
        out.resize(lz4_flex::block::get_maximum_output_size(t.data.len()), 0);
        black_box(lz4_flex::block::compress_into(black_box(&t.data), out).expect("compresses"));
    });
    let mut g = group(c, "lz4_flex-decode");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let packed: Vec<Vec<u8>> = cut.tensors.iter().map(|t| lz4_flex::block::compress(&t.data)).collect();
        let mut out = Vec::new();
        g.bench_function(cut.id(), |b| {
            b.iter(|| {
                for (t, p) in cut.tensors.iter().zip(&packed) {
                    out.resize(t.data.len(), 0);
                    lz4_flex::block::decompress_into(black_box(p), &mut out).expect("decompresses");
                }
            })
        });
    }
    g.finish();

    // The decode direction: decompress into a buffer of the tensor's size, then unshuffle.
    for (name, shuffled) in [("lz4-decode", false), ("shuffle+lz4-decode", true)] {
        let mut g = group(c, name);
        for cut in cuts {
            g.throughput(Throughput::Bytes(cut.raw_bytes()));
            let parts = encoded_parts(cut, shuffled, Compression::Lz4);
            let (mut carried, mut out) = (Vec::new(), Vec::new());
            g.bench_function(cut.id(), |b| {
                b.iter(|| {
                    for (t, part) in cut.tensors.iter().zip(&parts) {
                        carried.resize(t.data.len(), 0);
                        decompress_blocks(Compression::Lz4, &part.1, black_box(&part.0), &mut carried).expect("decompresses");
                        if shuffled {
                            unshuffle(&carried, t.dtype.size(), &mut out);
                        }
                    }
                })
            });
        }
        g.finish();
    }
}

/// AES-256-GCM on its own, through the same `aes-gcm` cipher the codec's sealer holds. One
/// nonce for every iteration: nothing secret is protected here, only time is measured.
fn aes(c: &mut Criterion, cuts: &[Cut]) {
    let cipher = Aes256Gcm::new_from_slice(&[7u8; 32]).expect("32-byte key");
    let nonce = Nonce::from([9u8; 12]);
    let mut g = group(c, "aes-256-gcm-seal");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let mut buffer: Vec<u8> = cut.tensors.iter().flat_map(|t| t.data.iter().copied()).collect();
        g.bench_function(cut.id(), |b| b.iter(|| cipher.encrypt_inout_detached(&nonce, &[], black_box(&mut buffer[..]).into()).expect("seals")));
    }
    g.finish();

    let mut g = group(c, "aes-256-gcm-open");
    for cut in cuts {
        g.throughput(Throughput::Bytes(cut.raw_bytes()));
        let mut sealed: Vec<u8> = cut.tensors.iter().flat_map(|t| t.data.iter().copied()).collect();
        let tag = cipher.encrypt_inout_detached(&nonce, &[], sealed.as_mut_slice().into()).expect("seals");
        g.bench_function(cut.id(), |b| {
            b.iter_batched_ref(
                || sealed.clone(),
                |buffer| cipher.decrypt_inout_detached(&nonce, &[], buffer.as_mut_slice().into(), &tag).expect("opens"),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

/// Whole payloads: `encode_payload` (one copy of the tensors at least, the header, the seal)
/// and `IncomingPayload::parse` + `decode` (a fresh opener per payload: an opener refuses a
/// counter it has seen).
fn payloads(c: &mut Criterion, cuts: &[Cut]) {
    let ring = KeyRing::new([(1, Key::from_bytes([7u8; 32]))]).expect("one key");
    let unsealed = KeyRing::default();
    let cases = [("raw", false), ("raw", true), ("shuffle+lz4", false), ("auto", false), ("shuffle+lz4", true), ("fp16+shuffle+lz4", false)];
    for (codec, sealed) in cases {
        let codec: Codec = codec.parse().expect("codec");
        let suffix = if sealed { "+aes-256-gcm" } else { "" };
        let mut g = group(c, &format!("payload-encode/{codec}{suffix}"));
        for cut in cuts {
            g.throughput(Throughput::Bytes(cut.raw_bytes()));
            let mut sealer = ring.sealer(1).expect("sealer");
            g.bench_function(cut.id(), |b| {
                b.iter(|| {
                    let sealer = sealed.then_some(&mut sealer);
                    encode_payload(META, Vec::new(), black_box(&cut.tensors), &codec, sealer).expect("encodes")
                })
            });
        }
        g.finish();

        let mut g = group(c, &format!("payload-decode/{codec}{suffix}"));
        for cut in cuts {
            g.throughput(Throughput::Bytes(cut.raw_bytes()));
            let mut sealer = ring.sealer(1).expect("sealer");
            let enc: EncodedPayload = encode_payload(META, Vec::new(), &cut.tensors, &codec, sealed.then_some(&mut sealer)).expect("encodes");
            let keys = if sealed { &ring } else { &unsealed };
            g.bench_function(cut.id(), |b| {
                b.iter_batched(
                    || (keys.opener(), enc.data.to_vec()),
                    |(mut opener, data)| {
                        let incoming =
                            IncomingPayload::parse(&enc.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener).expect("parses");
                        incoming.decode(data, &mut opener).expect("decodes")
                    },
                    BatchSize::LargeInput,
                )
            });
        }
        g.finish();
    }
}

fn main() {
    let cuts = support::load_or_exit();
    for cut in &cuts {
        println!("{}: {} raw bytes", cut.describe(), cut.raw_bytes());
    }
    let mut c = Criterion::default().configure_from_args();
    transforms(&mut c, &cuts);
    compression(&mut c, &cuts);
    aes(&mut c, &cuts);
    payloads(&mut c, &cuts);
    c.final_summary();
}
