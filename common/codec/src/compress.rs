//! Compression of one tensor's (shuffled) bytes. Decompression is bounded: the output buffer
//! has exactly the size the header declared (already checked against the limit), and any
//! other size is an error.

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

/// Decompresses `data` into `out`, which must come out exactly `expected` bytes long.
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
            out.resize(expected, 0);
            let n = lz4_flex::block::decompress_into(data, out).map_err(|e| format!("lz4: {e}"))?;
            if n != expected {
                return Err(format!("lz4: {n} bytes decompressed where {expected} were declared"));
            }
        }
        Compression::Zstd(_) => {
            out.resize(expected, 0);
            let n = zstd::bulk::decompress_to_buffer(data, &mut out[..]).map_err(|e| format!("zstd: {e}"))?;
            if n != expected {
                return Err(format!("zstd: {n} bytes decompressed where {expected} were declared"));
            }
        }
    }
    Ok(())
}
