//! Payload round trips for every dtype and codec combination, sealed and not; every way a
//! payload can be refused; and arbitrary bytes never panicking a decoder.

use cleave_codec::pb::{self, NamedValue, PayloadEnvelope, PayloadHeader, ValueNode};
use cleave_codec::{
    encode_payload, Codec, CodecError, CodecPolicy, Compression, DType, Direction, EncodedPayload, IncomingPayload, Key, KeyError, KeyRing,
    PayloadMeta, Precision, TensorData, REPLAY_WINDOW,
};
use proptest::prelude::*;
use prost::Message;

const LIMIT: u64 = 64 << 20;

fn every_codec() -> Vec<Codec> {
    let mut codecs = Vec::new();
    for precision in Precision::ALL {
        for shuffle in [false, true] {
            for compression in [Compression::None, Compression::Lz4, Compression::Zstd(1), Compression::Zstd(3)] {
                codecs.push(Codec { precision, shuffle, compression, auto: false });
            }
        }
    }
    codecs.push(Codec::AUTO);
    codecs
}

fn meta(request_id: u64) -> PayloadMeta {
    PayloadMeta { request_id, split: 3, direction: Direction::Request }
}

fn values_for(tensors: &[TensorData]) -> Vec<NamedValue> {
    tensors
        .iter()
        .map(|t| NamedValue { name: t.name.clone(), value: Some(ValueNode { kind: Some(pb::value_node::Kind::Tensor(t.name.clone())) }) })
        .collect()
}

/// Encodes and decodes one payload on a fresh stream.
fn round_trip(tensors: &[TensorData], codec: &Codec, ring: Option<&KeyRing>) -> Result<Vec<TensorData>, CodecError> {
    let mut sealer = ring.map(|r| r.sealer(1).unwrap());
    let enc = encode_payload(meta(7), values_for(tensors), tensors, codec, sealer.as_mut())?;
    receive(&enc, ring, Direction::Request).map(|d| d.tensors)
}

fn receive(enc: &EncodedPayload, ring: Option<&KeyRing>, direction: Direction) -> Result<cleave_codec::DecodedPayload, CodecError> {
    let mut opener = ring.cloned().unwrap_or_default().opener();
    let incoming = IncomingPayload::parse(&enc.envelope, direction, LIMIT, &CodecPolicy::default(), &opener)?;
    incoming.decode(enc.data.to_vec(), &mut opener)
}

/// Bytes of a random tensor of `dtype`: floats are finite and of varied magnitude, bools 0/1.
fn tensor_strategy() -> impl Strategy<Value = TensorData> {
    let shape = prop::collection::vec(0i64..6, 0..4);
    (prop::sample::select(DType::ALL.to_vec()), shape, any::<u64>()).prop_map(|(dtype, shape, seed)| {
        let n: i64 = shape.iter().product();
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut data = Vec::with_capacity(n as usize * dtype.size());
        // Half the tensors are a third zeros, as after a ReLU, so their zeros are elided.
        let sparse = seed & 2 != 0;
        for _ in 0..n {
            let r = next();
            let r = if sparse && r % 3 == 0 { 0 } else { r };
            let x = if r == 0 { 0.0 } else { ((r % 2001) as f64 - 1000.0) / 37.0 };
            match dtype {
                DType::Float32 => data.extend_from_slice(&(x as f32).to_le_bytes()),
                DType::Float64 => data.extend_from_slice(&x.to_le_bytes()),
                DType::Float16 => data.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
                DType::Bfloat16 => data.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
                DType::Bool => data.push((r & 1) as u8),
                other => data.extend_from_slice(&r.to_le_bytes()[..other.size()]),
            }
        }
        TensorData { dim_order: Vec::new(), name: format!("t{seed}"), dtype, shape, data: data.into() }
    })
}

fn as_f64(t: &TensorData) -> Vec<f64> {
    match t.dtype {
        DType::Float32 => t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::Float64 => t.data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => unreachable!(),
    }
}

fn unique_names(mut tensors: Vec<TensorData>) -> Vec<TensorData> {
    for (i, t) in tensors.iter_mut().enumerate() {
        t.name = format!("value.{i}");
    }
    tensors
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Lossless codecs give back every byte; lossy ones change only float32/float64
    /// tensors, within their precision's error; sealed or not.
    #[test]
    fn every_codec_round_trips(tensors in prop::collection::vec(tensor_strategy(), 1..4), sealed in any::<bool>()) {
        let tensors = unique_names(tensors);
        let ring = KeyRing::new([(1, Key::random())]).unwrap();
        for codec in every_codec() {
            let back = round_trip(&tensors, &codec, sealed.then_some(&ring)).unwrap();
            prop_assert_eq!(back.len(), tensors.len());
            for (a, b) in tensors.iter().zip(&back) {
                prop_assert_eq!((&a.name, a.dtype, &a.shape), (&b.name, b.dtype, &b.shape));
                if !codec.precision.casts(a.dtype) {
                    prop_assert!(a.data == b.data, "{} changed under {}", a.name, codec);
                    continue;
                }
                let (x, y) = (as_f64(a), as_f64(b));
                let max = x.iter().fold(0f64, |m, v| m.max(v.abs()));
                for (u, v) in x.iter().zip(&y) {
                    let tolerance = match codec.precision {
                        Precision::Fp16 => u.abs() / 1024.0 + 1e-7,
                        Precision::Bf16 => u.abs() / 128.0 + 1e-7,
                        // Half a step of a range at most 2 * max wide, in 254 steps.
                        Precision::Int8 => max / 254.0 * (1.0 + 1e-5) + 1e-9,
                        Precision::Full => 0.0,
                    };
                    prop_assert!((u - v).abs() <= tolerance, "{} {} -> {} under {}", a.dtype, u, v, codec);
                }
            }
        }
    }

    /// Arbitrary envelope bytes never panic the parser.
    #[test]
    fn arbitrary_envelopes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let opener = KeyRing::new([(1, Key::random())]).unwrap().opener();
        let _ = IncomingPayload::parse(&bytes, Direction::Request, LIMIT, &CodecPolicy::default(), &opener);
    }

    /// A well-formed header with arbitrary data (any codec) never panics the decoder.
    #[test]
    fn arbitrary_data_never_panics(tensors in prop::collection::vec(tensor_strategy(), 1..3), codec_index in 0usize..32, junk in prop::collection::vec(any::<u8>(), 0..2048)) {
        let tensors = unique_names(tensors);
        let codec = every_codec()[codec_index];
        let enc = encode_payload(meta(1), values_for(&tensors), &tensors, &codec, None).unwrap();
        let mut opener = KeyRing::default().opener();
        if let Ok(incoming) = IncomingPayload::parse(&enc.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener) {
            // Junk of the declared length, and of other lengths.
            let mut data = junk.clone();
            data.resize(incoming.wire_len() as usize, 0xA5);
            let _ = incoming.decode(data, &mut opener);
        }
        let incoming = IncomingPayload::parse(&enc.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener).unwrap();
        let _ = incoming.decode(junk, &mut opener);
    }

    /// Arbitrary headers (structurally valid protobuf, hostile values) never panic.
    #[test]
    fn hostile_headers_never_panic(shape in prop::collection::vec(any::<i64>(), 0..5), byte_len in any::<u64>(), wire_len in any::<u64>(), dtype in "[a-z0-9]{0,9}", codec in "[a-z0-9+-]{0,16}") {
        let header = PayloadHeader {
            request_id: 1,
            direction: Direction::Request as i32,
            codec,
            tensors: vec![pb::TensorHeader { name: "x".into(), dtype, shape, byte_len, wire_len, quant: None, ..Default::default() }],
            wire_len,
            ..Default::default()
        };
        let envelope = PayloadEnvelope { header: header.encode_to_vec().into(), ..Default::default() };
        let mut opener = KeyRing::default().opener();
        if let Ok(incoming) = IncomingPayload::parse(&envelope.encode_to_vec(), Direction::Request, LIMIT, &CodecPolicy::default(), &opener) {
            let n = incoming.wire_len() as usize;
            let _ = incoming.decode(vec![0; n], &mut opener);
        }
    }
}

fn sample() -> Vec<TensorData> {
    let floats: Vec<u8> = (0..1000).flat_map(|i| ((i % 17) as f32 * 0.25).to_le_bytes()).collect();
    vec![TensorData { dim_order: Vec::new(), name: "x".into(), dtype: DType::Float32, shape: vec![10, 100], data: floats.into() }]
}

fn sealed_payload(ring: &KeyRing) -> EncodedPayload {
    let mut sealer = ring.sealer(1).unwrap();
    encode_payload(meta(5), values_for(&sample()), &sample(), &"shuffle+lz4".parse().unwrap(), Some(&mut sealer)).unwrap()
}

fn envelope_of(enc: &EncodedPayload) -> PayloadEnvelope {
    PayloadEnvelope::decode(&enc.envelope[..]).unwrap()
}

#[test]
fn wrong_key_is_reported_as_a_wrong_key() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let other = KeyRing::new([(1, Key::random())]).unwrap();
    let err = receive(&sealed_payload(&ring), Some(&other), Direction::Request).unwrap_err();
    assert_eq!(err, CodecError::WrongKey { id: 1 });
    assert_eq!(err.to_string(), "wrong key: key id 1 here is not the key the sender used");
}

#[test]
fn unknown_key_id_and_missing_keys_are_refused() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let other = KeyRing::new([(2, Key::random()), (3, Key::random())]).unwrap();
    let err = receive(&sealed_payload(&ring), Some(&other), Direction::Request).unwrap_err();
    assert_eq!(err.to_string(), "unknown key id 1 (this side holds ids [2, 3])");
    let err = receive(&sealed_payload(&ring), None, Direction::Request).unwrap_err();
    assert_eq!(err, CodecError::NoKeys { id: 1 });
}

#[test]
fn tampered_data_is_refused() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let enc = sealed_payload(&ring);
    for position in [0, enc.data.len() / 2, enc.data.len() - 1] {
        let mut data = enc.data.to_vec();
        data[position] ^= 0x01;
        let tampered = EncodedPayload { data: data.into(), ..enc.clone() };
        assert_eq!(receive(&tampered, Some(&ring), Direction::Request).unwrap_err(), CodecError::DataTampered, "byte {position}");
    }
}

#[test]
fn tampered_header_is_refused_whatever_field_changed() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let enc = sealed_payload(&ring);
    let change: [fn(&mut PayloadHeader); 5] = [
        |h| h.request_id += 1,
        |h| h.split = 0,
        |h| h.codec = "shuffle+zstd-3".into(),
        |h| h.tensors[0].shape = vec![100, 10],
        |h| h.tensors[0].dtype = "int32".into(),
    ];
    for f in change {
        let mut envelope = envelope_of(&enc);
        let mut header = PayloadHeader::decode(&envelope.header[..]).unwrap();
        f(&mut header);
        envelope.header = header.encode_to_vec().into();
        let tampered = EncodedPayload { envelope: envelope.encode_to_vec().into(), ..enc.clone() };
        assert_eq!(receive(&tampered, Some(&ring), Direction::Request).unwrap_err(), CodecError::HeaderTampered);
    }
    // Dropping the seal does not help: a side with keys requires sealed payloads.
    let mut envelope = envelope_of(&enc);
    envelope.seal = None;
    let stripped = EncodedPayload { envelope: envelope.encode_to_vec().into(), ..enc.clone() };
    let mut opener = ring.opener();
    let policy = CodecPolicy { require_encryption: true, ..CodecPolicy::default() };
    let err = IncomingPayload::parse(&stripped.envelope, Direction::Request, LIMIT, &policy, &opener).unwrap_err();
    assert_eq!(err, CodecError::NotSealed);
    let _ = &mut opener;
}

#[test]
fn replayed_payloads_and_those_past_the_window_are_refused_reordered_ones_within_it_accepted() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let mut sealer = ring.sealer(1).unwrap();
    let codec: Codec = "lz4".parse().unwrap();
    let n = REPLAY_WINDOW as u64 + 40;
    let sent: Vec<EncodedPayload> =
        (0..n).map(|i| encode_payload(meta(i), values_for(&sample()), &sample(), &codec, Some(&mut sealer)).unwrap()).collect();
    let mut opener = ring.opener();
    let mut accept = |enc: &EncodedPayload| {
        let incoming = IncomingPayload::parse(&enc.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener)?;
        incoming.decode(enc.data.to_vec(), &mut opener)
    };
    accept(&sent[0]).unwrap();
    let replay = accept(&sent[0]).unwrap_err();
    assert_eq!(replay.to_string(), "replayed or reordered payload refused: counter 0 was accepted before");
    // A payload that arrives after a later one (a request moved from another server) is
    // accepted once, within the window.
    accept(&sent[2]).unwrap();
    accept(&sent[1]).unwrap();
    assert!(matches!(accept(&sent[1]).unwrap_err(), CodecError::Replayed { .. }));
    assert!(matches!(accept(&sent[2]).unwrap_err(), CodecError::Replayed { .. }));
    // Far ahead: what was seen stays seen across the shift, and what falls past the window
    // is refused whether seen or not.
    accept(&sent[70]).unwrap();
    accept(&sent[66]).unwrap();
    let last = n as usize - 1;
    accept(&sent[last]).unwrap();
    let behind = (last - 66) as u32;
    assert!(behind < REPLAY_WINDOW);
    assert_eq!(accept(&sent[66]).unwrap_err().to_string(), "replayed or reordered payload refused: counter 66 was accepted before");
    assert!(matches!(accept(&sent[70]).unwrap_err(), CodecError::Replayed { .. }));
    accept(&sent[67]).unwrap();
    let err = accept(&sent[3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("replayed or reordered payload refused: counter 3 is {} behind counter {last}, past the window of {REPLAY_WINDOW}", last - 3)
    );
    // Another stream's payload (another nonce prefix) is refused on this one.
    let mut other = ring.sealer(1).unwrap();
    let foreign = encode_payload(meta(9), values_for(&sample()), &sample(), &codec, Some(&mut other)).unwrap();
    let err = accept(&foreign).unwrap_err();
    assert!(err.to_string().contains("nonce prefix changed"), "{err}");
}

#[test]
fn a_failed_payload_does_not_advance_the_stream() {
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let mut sealer = ring.sealer(1).unwrap();
    let codec = Codec::RAW;
    let first = encode_payload(meta(0), values_for(&sample()), &sample(), &codec, Some(&mut sealer)).unwrap();
    let second = encode_payload(meta(1), values_for(&sample()), &sample(), &codec, Some(&mut sealer)).unwrap();
    let mut opener = ring.opener();
    let mut data = first.data.to_vec();
    data[3] ^= 0xFF;
    let incoming = IncomingPayload::parse(&first.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener).unwrap();
    assert_eq!(incoming.decode(data, &mut opener).unwrap_err(), CodecError::DataTampered);
    let incoming = IncomingPayload::parse(&second.envelope, Direction::Request, LIMIT, &CodecPolicy::default(), &opener).unwrap();
    assert_eq!(incoming.decode(second.data.to_vec(), &mut opener).unwrap().header.meta.request_id, 1);
}

fn with_header(enc: &EncodedPayload, f: impl FnOnce(&mut PayloadHeader)) -> Vec<u8> {
    let mut envelope = envelope_of(enc);
    let mut header = PayloadHeader::decode(&envelope.header[..]).unwrap();
    f(&mut header);
    envelope.header = header.encode_to_vec().into();
    envelope.encode_to_vec()
}

fn parse(envelope: &[u8], limit: u64) -> Result<IncomingPayload, CodecError> {
    IncomingPayload::parse(envelope, Direction::Request, limit, &CodecPolicy::default(), &KeyRing::default().opener())
}

#[test]
fn declared_sizes_are_checked_before_anything_is_allocated() {
    let enc = encode_payload(meta(1), values_for(&sample()), &sample(), &"shuffle+lz4".parse().unwrap(), None).unwrap();
    let err = parse(&enc.envelope, 1000).unwrap_err();
    assert_eq!(err, CodecError::PayloadTooLarge { declared: 4000, limit: 1000 });
    let huge = with_header(&enc, |h| {
        h.tensors[0].shape = vec![1 << 40, 1 << 10];
        h.tensors[0].byte_len = 4 << 50;
    });
    assert!(matches!(parse(&huge, LIMIT).unwrap_err(), CodecError::PayloadTooLarge { .. }));
    let overflow = with_header(&enc, |h| h.tensors[0].shape = vec![i64::MAX, i64::MAX]);
    assert!(matches!(parse(&overflow, LIMIT).unwrap_err(), CodecError::InvalidShape { .. }));
    let negative = with_header(&enc, |h| h.tensors[0].shape = vec![-1, 4]);
    assert!(matches!(parse(&negative, LIMIT).unwrap_err(), CodecError::InvalidShape { .. }));
    let lying = with_header(&enc, |h| h.tensors[0].byte_len = 8);
    assert!(parse(&lying, LIMIT).unwrap_err().to_string().contains("declared 8 bytes, but float32[10, 100] needs 4000"));
    // Compressed tensors travel in blocks, each within the compressor's bounds, adding up to
    // the tensor.
    let bloated = with_header(&enc, |h| h.tensors[0].wire_len = 1 << 30);
    let err = parse(&bloated, LIMIT).unwrap_err().to_string();
    assert!(err.contains("tensor x: its blocks hold 4000 bytes in") && err.contains("where it carries 4000 bytes in 1073741824"), "{err}");
    let bloated = with_header(&enc, |h| h.tensors[0].blocks[0].wire_len = 1 << 30);
    let err = parse(&bloated, LIMIT).unwrap_err().to_string();
    assert!(err.contains("block 0: lz4 encodes") && err.contains("in at most"), "{err}");
    let claiming = with_header(&enc, |h| h.tensors[0].blocks[0].raw_len = 1 << 30);
    assert!(parse(&claiming, LIMIT).unwrap_err().to_string().contains("cannot decompress to the 1073741824 declared"));
    // Without blocks, a tensor is one block compressed whole (protocol version 1), still
    // within the compressor's bounds.
    let unblocked = with_header(&enc, |h| {
        h.tensors[0].blocks.clear();
        h.tensors[0].wire_len = 1 << 30;
        h.wire_len = 1 << 30;
    });
    assert!(parse(&unblocked, LIMIT).unwrap_err().to_string().contains("block 0: lz4 encodes 4000 bytes in at most"));
    let own = with_header(&enc, |h| h.tensors[0].codec = "raw".into());
    assert!(parse(&own, LIMIT).unwrap_err().to_string().contains("tensor x: codec \"raw\" of its own in a shuffle+lz4 payload"));
    let inconsistent = with_header(&enc, |h| h.wire_len += 1);
    assert!(matches!(parse(&inconsistent, LIMIT).unwrap_err(), CodecError::WireLength { tagged: false, .. }));
    // A layout must order every dimension once, and int8 takes row-major tensors.
    let layout = with_header(&enc, |h| h.tensors[0].dim_order = vec![1, 1]);
    assert!(parse(&layout, LIMIT).unwrap_err().to_string().contains("dim_order [1, 1] is not an order of its 2 dimensions"));
    assert!(parse(&with_header(&enc, |h| h.tensors[0].dim_order = vec![1, 0]), LIMIT).is_ok());
    let quantised = encode_payload(meta(1), values_for(&sample()), &sample(), &"int8+lz4".parse().unwrap(), None).unwrap();
    let err = parse(&with_header(&quantised, |h| h.tensors[0].dim_order = vec![1, 0]), LIMIT).unwrap_err().to_string();
    assert!(err.contains("int8 quantisation of a tensor that is not row-major"), "{err}");
    let dtype = with_header(&enc, |h| h.tensors[0].dtype = "complex64".into());
    assert!(matches!(parse(&dtype, LIMIT).unwrap_err(), CodecError::UnknownDtype { .. }));
}

#[test]
fn a_version_1_payload_compressed_whole_is_still_read() {
    // Protocol version 1 compressed each tensor's carried (shuffled) bytes whole and sent no
    // blocks.
    let floats = &sample()[0].data;
    for (codec, shuffled) in [("shuffle+lz4", true), ("lz4", false), ("shuffle+zstd-3", true)] {
        let codec: Codec = codec.parse().unwrap();
        let enc = encode_payload(meta(1), values_for(&sample()), &sample(), &codec, None).unwrap();
        let mut carried = floats.to_vec();
        if shuffled {
            cleave_codec::shuffle::shuffle(floats, 4, &mut carried);
        }
        let mut whole = Vec::new();
        cleave_codec::compress::compress(codec.compression, &carried, &mut whole).unwrap();
        let version_1 = with_header(&enc, |h| {
            h.tensors[0].blocks.clear();
            (h.tensors[0].wire_len, h.wire_len) = (whole.len() as u64, whole.len() as u64);
        });
        let mut opener = KeyRing::default().opener();
        let decoded = parse(&version_1, LIMIT).unwrap().decode(whole, &mut opener).unwrap();
        assert_eq!(decoded.tensors[0].data, *floats, "{codec}");
    }
}

#[test]
fn truncated_and_corrupt_data_are_errors() {
    let codec: Codec = "shuffle+zstd-3".parse().unwrap();
    let enc = encode_payload(meta(1), values_for(&sample()), &sample(), &codec, None).unwrap();
    let mut opener = KeyRing::default().opener();
    let incoming = parse(&enc.envelope, LIMIT).unwrap();
    let short = enc.data.to_vec()[..enc.data.len() - 1].to_vec();
    assert!(matches!(incoming.decode(short, &mut opener).unwrap_err(), CodecError::Truncated { .. }));
    let mut garbled = enc.data.to_vec();
    garbled.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    let err = parse(&enc.envelope, LIMIT).unwrap().decode(garbled, &mut opener).unwrap_err();
    assert!(matches!(err, CodecError::Corrupt { .. }), "{err}");
    // A bool tensor whose bytes are not 0 or 1 is refused, not handed to libtorch.
    let bools = vec![TensorData { dim_order: Vec::new(), name: "m".into(), dtype: DType::Bool, shape: vec![3], data: vec![0, 1, 1].into() }];
    let enc = encode_payload(meta(1), values_for(&bools), &bools, &Codec::RAW, None).unwrap();
    let err = parse(&enc.envelope, LIMIT).unwrap().decode(vec![0, 7, 1], &mut opener).unwrap_err();
    assert!(err.to_string().contains("bool element 1 is 7"), "{err}");
}

#[test]
fn policies_and_directions_are_enforced() {
    let enc = encode_payload(meta(1), values_for(&sample()), &sample(), &"fp16+zstd".parse().unwrap(), None).unwrap();
    let opener = KeyRing::default().opener();
    let policy = CodecPolicy { precisions: vec![Precision::Full], ..CodecPolicy::default() };
    let err = IncomingPayload::parse(&enc.envelope, Direction::Request, LIMIT, &policy, &opener).unwrap_err();
    assert_eq!(err.to_string(), "codec \"fp16+zstd-3\": precision fp16 is not accepted (accepted: full)");
    let err = IncomingPayload::parse(&enc.envelope, Direction::Result, LIMIT, &CodecPolicy::default(), &opener).unwrap_err();
    assert_eq!(err.to_string(), "a request payload arrived where a result was expected");
}

#[test]
fn keys_parse_from_hex_or_raw_bytes_and_never_print() {
    let key = Key::random();
    let hex = key.to_hex();
    assert!(Key::parse(format!("{}\n", &*hex).as_bytes()).is_ok());
    assert!(Key::parse(&[7u8; 32]).is_ok());
    let err = Key::parse(b"too short").unwrap_err();
    assert_eq!(err, KeyError::Length { bytes: 9 });
    assert!(err.to_string().contains("this one has 9 bytes"), "{err}");
    assert!(!err.to_string().contains("too short"));
    assert_eq!(Key::parse(&[b'g'; 64]).unwrap_err(), KeyError::NotHex);
    assert_eq!(format!("{key:?}"), "Key(<redacted>)");
    let ring = KeyRing::new([(1, key.clone()), (2, Key::random())]).unwrap();
    assert!(!format!("{ring:?}").contains(&*hex));
    assert_eq!(KeyRing::new([(1, key.clone()), (1, key)]).unwrap_err(), KeyError::DuplicateId { id: 1 });
}

#[test]
fn rotation_a_server_holding_two_keys_opens_either() {
    let (old, new) = (Key::random(), Key::random());
    let server = KeyRing::new([(2, new.clone()), (1, old.clone())]).unwrap();
    for (id, key) in [(1, old), (2, new)] {
        let host = KeyRing::new([(id, key)]).unwrap();
        let mut sealer = host.sealer(id).unwrap();
        let enc = encode_payload(meta(1), values_for(&sample()), &sample(), &Codec::RAW, Some(&mut sealer)).unwrap();
        assert_eq!(receive(&enc, Some(&server), Direction::Request).unwrap().tensors, sample());
    }
}

#[test]
fn shuffle_makes_floats_compress() {
    // Smooth activations: shuffling groups sign/exponent bytes, which then compress well.
    let data: Vec<u8> = (0..65536).flat_map(|i| ((i as f32 * 0.001).sin().max(0.0)).to_le_bytes()).collect();
    let t = vec![TensorData { dim_order: Vec::new(), name: "x".into(), dtype: DType::Float32, shape: vec![65536], data: data.into() }];
    let size = |codec: &str| encode_payload(meta(1), values_for(&t), &t, &codec.parse().unwrap(), None).unwrap().data.len();
    assert!(size("shuffle+lz4") < size("lz4"), "{} vs {}", size("shuffle+lz4"), size("lz4"));
    assert!(size("shuffle+zstd") < size("zstd"));
}

#[test]
fn zeros_are_elided_where_a_tensor_is_an_eighth_zeros_and_a_mask_that_lies_is_refused() {
    // A post-ReLU-like tensor: a third of it zeros, scattered; and one without zeros.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let n = 1usize << 14;
    let mut value = |sparse: bool| match next() % 3000 {
        r if sparse && r < 1000 => 0f32,
        r => (r % 1000) as f32 / 7.0 + 0.5,
    };
    let relu: Vec<u8> = (0..n).flat_map(|_| value(true).to_le_bytes()).collect();
    let dense: Vec<u8> = (0..n).flat_map(|_| value(false).to_le_bytes()).collect();
    let tensors = vec![
        TensorData { dim_order: Vec::new(), name: "relu".into(), dtype: DType::Float32, shape: vec![n as i64], data: relu.into() },
        TensorData { dim_order: Vec::new(), name: "dense".into(), dtype: DType::Float32, shape: vec![n as i64], data: dense.into() },
    ];
    let elided = |enc: &EncodedPayload| -> Vec<bool> {
        PayloadHeader::decode(&envelope_of(enc).header[..]).unwrap().tensors.iter().map(|t| t.zeros_elided).collect()
    };
    for (codec, expected) in [
        ("shuffle+lz4", [true, false]),
        ("shuffle+zstd", [true, false]),
        ("fp16+shuffle+lz4", [true, false]),
        ("auto", [true, false]),
        ("lz4", [false, false]),
        ("shuffle", [false, false]),
    ] {
        let enc = encode_payload(meta(1), values_for(&tensors), &tensors, &codec.parse().unwrap(), None).unwrap();
        assert_eq!(elided(&enc), expected, "{codec}");
        let back = receive(&enc, None, Direction::Request).unwrap().tensors;
        if codec.starts_with("fp16") {
            let zeros = |t: &TensorData| as_f64(t).iter().filter(|v| **v == 0.0).count();
            assert_eq!(zeros(&back[0]), zeros(&tensors[0]), "zeros come back as zeros");
            assert!(zeros(&tensors[0]) > n / 4);
        } else {
            assert_eq!(back, tensors, "{codec}");
        }
    }
    let enc = encode_payload(meta(1), values_for(&tensors), &tensors, &"shuffle+lz4".parse().unwrap(), None).unwrap();
    // Elided zeros need shuffle and compression, and blocks that hold a mask and whole elements.
    let raw = encode_payload(meta(1), values_for(&tensors), &tensors, &Codec::RAW, None).unwrap();
    let err = parse(&with_header(&raw, |h| h.tensors[0].zeros_elided = true), LIMIT).unwrap_err().to_string();
    assert!(err.contains("tensor relu: zeros elided with codec raw"), "{err}");
    let err = parse(&with_header(&enc, |h| h.tensors[0].zeros_elided = false), LIMIT).unwrap_err().to_string();
    assert!(err.contains("tensor relu: its blocks hold"), "{err}");
    let err = parse(&with_header(&enc, |h| h.tensors[1].blocks.truncate(1)), LIMIT).unwrap_err().to_string();
    assert!(err.contains("tensor dense: its blocks hold 16384 bytes"), "{err}");
    let err = parse(&with_header(&enc, |h| h.tensors[0].blocks.truncate(0)), LIMIT).unwrap_err().to_string();
    assert!(err.contains("a 2048-byte mask and at most 65536 bytes"), "{err}");
    // A mask that marks other elements than the data holds decodes to an error, not a tensor.
    let header = PayloadHeader::decode(&envelope_of(&enc).header[..]).unwrap();
    assert!(header.tensors[0].blocks[0].stored, "the mask of scattered zeros does not compress");
    let mut data = enc.data.to_vec();
    data[0] ^= 0x01;
    let err = parse(&enc.envelope, LIMIT).unwrap().decode(data, &mut KeyRing::default().opener()).unwrap_err().to_string();
    assert!(err.contains("the zero mask marks"), "{err}");
    let dense_as_elided = with_header(&enc, |h| h.tensors[1].zeros_elided = true);
    let err = parse(&dense_as_elided, LIMIT).unwrap().decode(enc.data.to_vec(), &mut KeyRing::default().opener()).unwrap_err().to_string();
    assert!(err.contains("tensor dense") && err.contains("the zero mask"), "{err}");
}

#[test]
fn auto_sends_what_does_not_compress_raw_from_its_own_memory_and_compresses_the_rest() {
    // Noise (no plane of it compresses) and a post-ReLU-like tensor (half zeros).
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let noise: Vec<u8> = (0..1 << 18).map(|_| next() as u8).collect();
    let relu: Vec<u8> = (0..1 << 16).flat_map(|i| if i % 2 == 0 { 0f32 } else { (next() % 1000) as f32 / 7.0 }.to_le_bytes()).collect();
    let tensors = vec![
        TensorData { dim_order: Vec::new(), name: "noise".into(), dtype: DType::Float32, shape: vec![1 << 16], data: noise.into() },
        TensorData { dim_order: Vec::new(), name: "relu".into(), dtype: DType::Float32, shape: vec![1 << 16], data: relu.into() },
    ];
    let enc = encode_payload(meta(1), values_for(&tensors), &tensors, &Codec::AUTO, None).unwrap();
    let header = PayloadHeader::decode(&envelope_of(&enc).header[..]).unwrap();
    let picked: Vec<&str> = header.tensors.iter().map(|t| t.codec.as_str()).collect();
    assert_eq!((header.codec.as_str(), picked), ("auto", vec!["raw", "shuffle+lz4"]));
    assert!(header.tensors[1].wire_len < 3 * (1 << 18) / 4, "{}", header.tensors[1].wire_len);
    // The raw tensor is its own segment: the tensor's memory, not a copy.
    assert_eq!(enc.data.segments()[0].as_ptr(), tensors[0].data.as_ptr());
    assert_eq!(receive(&enc, None, Direction::Request).unwrap().tensors, tensors);
    // Only auto's two codecs, and only in an auto payload.
    let other = with_header(&enc, |h| h.tensors[0].codec = "lz4".into());
    assert!(parse(&other, LIMIT).unwrap_err().to_string().contains("tensor noise: codec \"lz4\" is not one `auto` picks"));
    // A payload auto sends wholly raw is verbatim, as a raw one.
    let raw_only = &tensors[..1];
    let enc = encode_payload(meta(1), values_for(raw_only), raw_only, &Codec::AUTO, None).unwrap();
    assert!(parse(&enc.envelope, LIMIT).unwrap().is_verbatim());
    let enc = encode_payload(meta(1), values_for(&tensors), &tensors, &Codec::AUTO, None).unwrap();
    assert!(!parse(&enc.envelope, LIMIT).unwrap().is_verbatim());
}

#[test]
fn a_sealed_message_opens_once_as_itself_and_not_as_another_kind_or_altered() {
    let ring = KeyRing::new([(7, Key::random())]).unwrap();
    let mut sealer = ring.sealer(7).unwrap();
    let (first, second) = (b"a step".to_vec(), b"another step".to_vec());
    let sealed = sealer.seal_message("cleave.v1.GenerateStep", first.clone()).unwrap();
    let later = sealer.seal_message("cleave.v1.GenerateStep", second.clone()).unwrap();
    assert!(!sealed.data.windows(first.len()).any(|w| w == first.as_slice()), "the message travels encrypted");

    let mut opener = ring.opener();
    assert!(matches!(opener.open_message("cleave.v1.GenerateReply", sealed.clone()), Err(CodecError::HeaderTampered)));
    let mut altered = sealed.clone();
    altered.data[0] ^= 1;
    assert!(matches!(opener.open_message("cleave.v1.GenerateStep", altered), Err(CodecError::DataTampered)));
    assert_eq!(opener.open_message("cleave.v1.GenerateStep", sealed.clone()).unwrap(), first);
    assert!(matches!(opener.open_message("cleave.v1.GenerateStep", sealed.clone()), Err(CodecError::Replayed { .. })));
    assert_eq!(opener.open_message("cleave.v1.GenerateStep", later).unwrap(), second);

    let other_key = KeyRing::new([(7, Key::random())]).unwrap();
    assert!(matches!(other_key.opener().open_message("cleave.v1.GenerateStep", sealed.clone()), Err(CodecError::WrongKey { id: 7 })));
    assert!(matches!(KeyRing::new([]).unwrap().opener().open_message("cleave.v1.GenerateStep", sealed.clone()), Err(CodecError::NoKeys { id: 7 })));
    let unsealed = pb::SealedMessage { seal: None, ..sealed };
    assert!(matches!(ring.opener().open_message("cleave.v1.GenerateStep", unsealed), Err(CodecError::NotSealed)));
}
