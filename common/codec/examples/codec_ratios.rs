//! Compression ratios (raw tensor bytes / payload bytes on the wire) of every codec
//! (precision x shuffle x compression) on real boundary tensors: resnet18 activations at
//! three cuts from `make bench-activations`, or the file `CLEAVE_BENCH_ACTIVATIONS` names.
//! Also the error of each lossy precision. Ratios are not timings: `benches/codec.rs` times
//! the steps.
//!
//!     cargo run --release -p cleave-codec --example codec_ratios

#[path = "../benches/support/mod.rs"]
mod support;

use cleave_codec::{encode_payload, Codec, CodecPolicy, Compression, DType, Direction, IncomingPayload, Key, KeyRing, PayloadMeta, Precision};

const COMPRESSIONS: [Compression; 5] = [Compression::None, Compression::Lz4, Compression::Zstd(-1), Compression::Zstd(1), Compression::Zstd(3)];

fn floats(t: &cleave_codec::TensorData) -> Vec<f32> {
    assert_eq!(t.dtype, DType::Float32, "the error table reads float32 tensors");
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}

fn main() {
    let cuts = support::load_or_exit();
    println!("activations: {}", support::activations_path().display());
    for cut in &cuts {
        let zeros: usize = cut.tensors.iter().filter(|t| t.dtype == DType::Float32).map(|t| floats(t).iter().filter(|v| **v == 0.0).count()).sum();
        let numel: usize = cut.tensors.iter().map(|t| t.data.len() / t.dtype.size()).sum();
        println!("  {}: {} raw bytes, {:.1}% exact zeros", cut.describe(), cut.raw_bytes(), 100.0 * zeros as f64 / numel as f64);
    }
    println!();
    let meta = PayloadMeta { request_id: 1, split: 0, direction: Direction::Request };
    let wire = |enc: &cleave_codec::EncodedPayload| enc.envelope.len() + enc.data.len();
    let ring = KeyRing::new([(1, Key::random())]).expect("one key");
    let sealed = encode_payload(meta, Vec::new(), &cuts[0].tensors, &Codec::RAW, Some(&mut ring.sealer(1).expect("key 1"))).expect("encodes");
    let unsealed = encode_payload(meta, Vec::new(), &cuts[0].tensors, &Codec::RAW, None).expect("encodes");
    println!(
        "compression ratio = raw tensor bytes / (envelope + data bytes), unsealed (sealing adds {} bytes per payload)",
        wire(&sealed) - wire(&unsealed)
    );
    print!("{:<24}", "codec");
    for cut in &cuts {
        print!("{:>10}", cut.id());
    }
    println!();
    for precision in Precision::ALL {
        for shuffle in [false, true] {
            for compression in COMPRESSIONS {
                let codec = Codec { precision, shuffle, compression, auto: false };
                print!("{:<24}", codec.to_string());
                for cut in &cuts {
                    let enc = encode_payload(meta, Vec::new(), &cut.tensors, &codec, None).expect("encodes");
                    print!("{:>10.3}", cut.raw_bytes() as f64 / wire(&enc) as f64);
                }
                println!();
            }
        }
    }

    println!();
    println!("lossy precisions: max |decoded - original| / max |original| per cut (decoded through the payload decoder)");
    print!("{:<24}", "precision");
    for cut in &cuts {
        print!("{:>12}", cut.id());
    }
    println!();
    for precision in [Precision::Fp16, Precision::Bf16, Precision::Int8] {
        print!("{:<24}", precision.name());
        let codec = Codec { precision, ..Codec::RAW };
        for cut in &cuts {
            let enc = encode_payload(meta, Vec::new(), &cut.tensors, &codec, None).expect("encodes");
            let mut opener = KeyRing::default().opener();
            let incoming = IncomingPayload::parse(&enc.envelope, Direction::Request, u64::MAX, &CodecPolicy::default(), &opener).expect("parses");
            let decoded = incoming.decode(enc.data.to_vec(), &mut opener).expect("decodes");
            let (mut err, mut max) = (0f32, 0f32);
            for (a, b) in cut.tensors.iter().zip(&decoded.tensors) {
                for (x, y) in floats(a).iter().zip(floats(b)) {
                    err = err.max((x - y).abs());
                    max = max.max(x.abs());
                }
            }
            print!("{:>12.2e}", err / max);
        }
        println!();
    }
}
