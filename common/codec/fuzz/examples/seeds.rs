//! Writes seed inputs for `payload_decoder`: one valid payload per codec, unsealed and sealed
//! with the target's fixed key, in its input layout (two bytes of envelope length, the
//! envelope, the data).
//!
//!     cargo run --example seeds -- corpus/payload_decoder

use cleave_codec::{encode_payload, Codec, Compression, DType, Direction, Key, KeyRing, PayloadMeta, Precision, TensorData};

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: seeds DIR"));
    std::fs::create_dir_all(&dir).expect("creates the corpus directory");
    // The key of `payload_decoder`'s keyed side.
    let ring = KeyRing::new([(1, Key::from_bytes([0x42; 32]))]).expect("one key");
    let floats: Vec<u8> = (0..2 * 3 * 4).flat_map(|i| ((i as f32 * 0.37).sin().max(0.0)).to_le_bytes()).collect();
    let tensors = vec![
        TensorData { dim_order: Vec::new(), name: "x".into(), dtype: DType::Float32, shape: vec![2, 3, 4], data: floats.into() },
        TensorData { dim_order: Vec::new(), name: "mask".into(), dtype: DType::Bool, shape: vec![3], data: vec![1u8, 0, 1].into() },
    ];
    let meta = PayloadMeta { request_id: 1, split: 1, direction: Direction::Request };
    let mut written = 0;
    for precision in Precision::ALL {
        for shuffle in [false, true] {
            for compression in [Compression::None, Compression::Lz4, Compression::Zstd(1)] {
                let codec = Codec { precision, shuffle, compression, auto: false };
                for sealed in [false, true] {
                    let mut sealer = ring.sealer(1).expect("key 1");
                    let enc = encode_payload(meta, Vec::new(), &tensors, &codec, sealed.then_some(&mut sealer)).expect("encodes");
                    let mut input = u16::try_from(enc.envelope.len()).expect("a small envelope").to_le_bytes().to_vec();
                    input.extend_from_slice(&enc.envelope);
                    input.extend_from_slice(&enc.data.to_vec());
                    let name = format!("{codec}{}", if sealed { "+sealed" } else { "" }).replace('+', "_");
                    std::fs::write(dir.join(name), input).expect("writes a seed");
                    written += 1;
                }
            }
        }
    }
    println!("wrote {written} seeds to {}", dir.display());
}
