//! What the `request_path` fuzz target and its seed generator (`examples/seeds.rs`) share:
//! the input format (a stream of `Infer` frames as records), the limits the target runs
//! under, the key of its keyed side and where the bundle it checks against lives.
//!
//! An input is a sequence of records, each one frame:
//!
//! ```text
//! record := flags:u8 [request_id:u64le] [header_len:varint header] data_len:varint data
//! flags  := bit 0: the frame is marked last
//!           bit 1: a header follows (without it, the frame's header is empty)
//!           bits 2-4: the request id, 0 to 6; 7 means the id follows as 8 bytes
//!           bit 5: the request part-way in stalls before this frame (the server gives it up)
//!           bit 6: the server's window of recent results holds this request's answer (it
//!                  was resent): a payload this frame starts is answered from there, skipped
//! ```
//!
//! Lengths are LEB128 varints of at most four bytes and are cut to what the input has left,
//! so every input decodes (a record cut short ends the stream).

use bytes::Bytes;
use cleave_common::pb::InferFrame;

/// The largest request the target accepts (tensor bytes): small, so that every size the
/// checks accept is cheap to allocate, and below what the digits bundle's cuts reach at
/// batch 16 (128 KiB), so that a payload can fit its cut and still be over the limit, or
/// within it and over the memory budget.
pub const LIMIT: u64 = 64 << 10;

/// The memory budget the server's requests share: the smallest a server config accepts
/// (twice the largest request, as received and decoded).
pub const MEMORY_BUDGET: u64 = 2 * LIMIT;

/// The key (id 1) of the target's key ring; the sealed seeds are sealed with it.
pub const FUZZ_KEY: [u8; 32] = [0x42; 32];

/// The bundle the target checks requests against: `CLEAVE_FUZZ_BUNDLE`, or the digits test
/// bundle `make test-bundles` exports (`target/test-bundles/digits` of this checkout).
pub fn bundle_dir() -> std::path::PathBuf {
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/test-bundles/digits");
    std::env::var_os("CLEAVE_FUZZ_BUNDLE").map_or_else(|| default.into(), Into::into)
}

const LAST: u8 = 1;
const HAS_HEADER: u8 = 1 << 1;
const ID_SHIFT: u8 = 2;
const ID_MASK: u8 = 0b111;
/// The id field's value that says the id follows in full.
const EXPLICIT_ID: u8 = 7;
const STALL_BEFORE: u8 = 1 << 5;
const RECALLED: u8 = 1 << 6;

/// One frame of the stream, and what happens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The request part-way in stalls before this frame arrives: the server gives it up.
    pub stall_before: bool,
    /// The server's window of recent results holds this request's answer: a payload this
    /// frame starts is answered from there and its frames are skipped.
    pub recalled: bool,
    /// The frame.
    pub frame: InferFrame,
}

/// Reads an input as records; never fails.
pub fn decode(mut input: &[u8]) -> Vec<Record> {
    let mut records = Vec::new();
    while let Some((&flags, rest)) = input.split_first() {
        input = rest;
        let id = match (flags >> ID_SHIFT) & ID_MASK {
            EXPLICIT_ID => {
                let Some((id, rest)) = input.split_first_chunk::<8>() else { break };
                input = rest;
                u64::from_le_bytes(*id)
            }
            small => u64::from(small),
        };
        let header = if flags & HAS_HEADER != 0 {
            let Some(header) = take(&mut input) else { break };
            header
        } else {
            Bytes::new()
        };
        let Some(data) = take(&mut input) else { break };
        records.push(Record {
            stall_before: flags & STALL_BEFORE != 0,
            recalled: flags & RECALLED != 0,
            frame: InferFrame { request_id: id, header, data, last: flags & LAST != 0, ..Default::default() },
        });
    }
    records
}

/// Writes records in the input format ([`decode`] reads them back).
pub fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    for Record { stall_before, recalled, frame } in records {
        let small = u8::try_from(frame.request_id).ok().filter(|&id| id < EXPLICIT_ID);
        let mut flags = small.unwrap_or(EXPLICIT_ID) << ID_SHIFT;
        flags |= if frame.last { LAST } else { 0 } | if *stall_before { STALL_BEFORE } else { 0 } | if *recalled { RECALLED } else { 0 };
        flags |= if frame.header.is_empty() { 0 } else { HAS_HEADER };
        out.push(flags);
        if small.is_none() {
            out.extend_from_slice(&frame.request_id.to_le_bytes());
        }
        if !frame.header.is_empty() {
            put(&mut out, &frame.header);
        }
        put(&mut out, &frame.data);
    }
    out
}

/// A varint length and that many bytes (fewer when the input ends first).
fn take(input: &mut &[u8]) -> Option<Bytes> {
    let mut len = 0usize;
    for i in 0..4 {
        let (&byte, rest) = input.split_first()?;
        *input = rest;
        len |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            break;
        }
    }
    let (bytes, rest) = input.split_at(len.min(input.len()));
    *input = rest;
    Some(Bytes::copy_from_slice(bytes))
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    assert!(bytes.len() < 1 << 28, "a frame of at most 2^28 bytes fits four varint bytes");
    let mut len = bytes.len();
    while len >= 0x80 {
        out.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let frame = |request_id, header: &[u8], data: Vec<u8>, last| InferFrame {
            request_id,
            header: Bytes::copy_from_slice(header),
            data: data.into(),
            last,
            ..Default::default()
        };
        let records = vec![
            Record { stall_before: false, recalled: false, frame: frame(1, b"envelope", vec![7; 300], false) },
            Record { stall_before: true, recalled: false, frame: frame(1 << 40, b"", vec![], true) },
            Record { stall_before: false, recalled: true, frame: frame(6, b"h", vec![1; 20_000], true) },
        ];
        assert_eq!(decode(&encode(&records)), records);
        // Anything decodes; a record cut short ends the stream.
        assert_eq!(decode(&encode(&records)[..5]), Vec::new());
    }
}
