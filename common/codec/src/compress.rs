//! Compression of one tensor's (shuffled) bytes. Decompression is bounded: the output is at
//! most the size the header declared (already checked against the limit), any other size is
//! an error, and memory is touched only as data is decoded.

use crate::codec::Compression;

/// Compresses `data`, appending to `out`.
pub fn compress(compression: Compression, data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    match compression {
        Compression::None => out.extend_from_slice(data),
        Compression::Lz4 => {
            let start = out.len();
            out.resize(start + lz4_flex::block::get_maximum_output_size(data.len()), 0);
            let n = lz4_flex::block::compress_into(data, &mut out[start..]).map_err(|e| format!("lz4: {e}"))?;
            out.truncate(start + n);
        }
        Compression::Zstd(level) => {
            let start = out.len();
            out.resize(start + zstd::zstd_safe::compress_bound(data.len()), 0);
            let n = zstd::bulk::compress_to_buffer(data, &mut out[start..], level).map_err(|e| format!("zstd: {e}"))?;
            out.truncate(start + n);
        }
    }
    Ok(())
}

/// The most an lz4 block can grow: a byte of match length stands for at most 255 bytes of
/// output, so `n` compressed bytes never decompress to more than about `255 * n`.
const LZ4_MAX_EXPANSION: usize = 255;

/// Decompresses `data` into `out`, which must come out exactly `expected` bytes long.
///
/// Nothing is zero-filled ahead of the data: the output is reserved (address space only) and
/// written as it is decoded, so a few bytes that declare a gigabyte cost what they really
/// decode to. A claim no compressed block could honour (an lz4 block of `n` bytes declaring
/// more than `255 n`, a zstd frame whose header names another size) is refused before
/// anything is reserved.
pub fn decompress(compression: Compression, data: &[u8], expected: usize, out: &mut Vec<u8>) -> Result<(), String> {
    out.clear();
    match compression {
        Compression::None => {
            if data.len() != expected {
                return Err(format!("{} bytes where {expected} were declared", data.len()));
            }
            out.extend_from_slice(data);
        }
        Compression::Lz4 => {
            let most = data.len().saturating_mul(LZ4_MAX_EXPANSION).saturating_add(16);
            if expected > most {
                return Err(format!("lz4: {} bytes cannot decompress to the {expected} declared (at most {most})", data.len()));
            }
            *out = lz4_flex::block::decompress(data, expected).map_err(|e| format!("lz4: {e}"))?;
            if out.len() != expected {
                return Err(format!("lz4: {} bytes decompressed where {expected} were declared", out.len()));
            }
        }
        Compression::Zstd(_) => {
            match zstd::zstd_safe::get_frame_content_size(data) {
                Ok(Some(n)) if n != expected as u64 => return Err(format!("zstd: the frame holds {n} bytes where {expected} were declared")),
                Err(_) => return Err("zstd: not a zstd frame".into()),
                _ => {}
            }
            *out = zstd::bulk::decompress(data, expected).map_err(|e| format!("zstd: {e}"))?;
            if out.len() != expected {
                return Err(format!("zstd: {} bytes decompressed where {expected} were declared", out.len()));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(compression: Compression, data: &[u8]) -> Vec<u8> {
        let mut packed = Vec::new();
        compress(compression, data, &mut packed).unwrap();
        let mut back = Vec::new();
        decompress(compression, &packed, data.len(), &mut back).unwrap();
        back
    }

    #[test]
    fn the_most_compressible_data_still_round_trips() {
        // Zeros compress best; the expansion bound must never refuse what the encoder makes.
        for n in [0, 1, 15, 16, 17, 4096, 1 << 20, 8 << 20] {
            let zeros = vec![0u8; n];
            for compression in [Compression::Lz4, Compression::Zstd(1), Compression::Zstd(19)] {
                assert_eq!(round_trip(compression, &zeros), zeros, "{compression:?} {n}");
            }
        }
    }

    #[test]
    fn claims_no_block_could_honour_are_refused_before_reserving() {
        let mut packed = Vec::new();
        compress(Compression::Lz4, &[0u8; 4096], &mut packed).unwrap();
        let mut out = Vec::new();
        let err = decompress(Compression::Lz4, &packed[..16], 1 << 30, &mut out).unwrap_err();
        assert!(err.contains("cannot decompress to the 1073741824 declared"), "{err}");
        assert_eq!(out.capacity(), 0, "nothing reserved");
        // A zstd frame names its size: any other declared size is refused from the header.
        let mut packed = Vec::new();
        compress(Compression::Zstd(3), &[0u8; 4096], &mut packed).unwrap();
        let err = decompress(Compression::Zstd(3), &packed, 1 << 30, &mut out).unwrap_err();
        assert_eq!(err, "zstd: the frame holds 4096 bytes where 1073741824 were declared");
        assert_eq!(out.capacity(), 0, "nothing reserved");
        assert_eq!(decompress(Compression::Zstd(3), b"not zstd", 8, &mut out).unwrap_err(), "zstd: not a zstd frame");
    }
}
