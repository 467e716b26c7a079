//! Arbitrary bytes as a received payload: two bytes (little-endian) giving the envelope's
//! length, the envelope, then the data. The envelope goes to `IncomingPayload::parse` on a
//! side holding no key and on a side holding a fixed key (id 1, the key the seed payloads of
//! `examples/seeds.rs` are sealed with); when it parses, the rest goes to `decode`. Neither
//! may panic, and what decodes must be what the header declared.

#![no_main]

use std::sync::OnceLock;

use cleave_codec::{CodecPolicy, DType, Direction, IncomingPayload, Key, KeyRing};
use libfuzzer_sys::fuzz_target;

/// Small, so that declared sizes the checks accept stay cheap to allocate.
const LIMIT: u64 = 1 << 20;

/// The fixed key of the keyed side.
const FUZZ_KEY: [u8; 32] = [0x42; 32];

fn rings() -> &'static [KeyRing; 2] {
    static RINGS: OnceLock<[KeyRing; 2]> = OnceLock::new();
    RINGS.get_or_init(|| [KeyRing::default(), KeyRing::new([(1, Key::from_bytes(FUZZ_KEY))]).expect("one key")])
}

fuzz_target!(|input: &[u8]| {
    let Some((len, rest)) = input.split_first_chunk::<2>() else { return };
    let len = usize::from(u16::from_le_bytes(*len)).min(rest.len());
    let (envelope, data) = rest.split_at(len);
    for ring in rings() {
        let mut opener = ring.opener();
        let Ok(incoming) = IncomingPayload::parse(envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener) else { continue };
        let raw_len = incoming.raw_len();
        assert!(raw_len <= LIMIT, "parse accepted {raw_len} bytes over the limit");
        let Ok(decoded) = incoming.decode(data.to_vec(), &mut opener) else { continue };
        let mut total = 0u64;
        for t in &decoded.tensors {
            let numel: u64 = t.shape.iter().map(|&d| u64::try_from(d).expect("a checked dimension")).product();
            assert_eq!(t.data.len() as u64, numel * t.dtype.size() as u64, "{} decoded to the wrong size", t.name);
            if t.dtype == DType::Bool {
                assert!(t.data.iter().all(|&b| b <= 1), "{}: a bool that is not 0 or 1", t.name);
            }
            total += t.data.len() as u64;
        }
        assert_eq!(total, raw_len);
    }
});
