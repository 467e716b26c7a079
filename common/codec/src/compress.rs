//! Compression of one tensor's carried (shuffled) bytes, in blocks.
//!
//! The bytes are cut into planes (a shuffled tensor's planes of equal significance, or the
//! whole tensor) and each plane into blocks of [`BLOCK_BYTES`]. A plane's first block is its
//! sample: when compressing it does not save at least an eighth, the whole plane is stored as
//! it is, so the low mantissa bytes of float activations (close to random) cost a copy
//! instead of a compressor's pass. Otherwise every block is compressed, and one that does not
//! shrink is stored. Blocks also bound what one compressed unit may claim.
//!
//! Decompression is bounded: each block decodes into its exact place in a buffer of the size
//! the header declared (already checked against the limit), and any other size is an error.

use std::sync::Arc;

use rayon::prelude::*;

use crate::codec::Compression;
use crate::pb::Block;

/// Why a block cannot be compressed, or its declared sizes or bytes cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// lz4 failed (encoding fails only on a bug: the output is sized by lz4's bound).
    #[error("lz4: {0}")]
    Lz4(Lz4Error),
    /// zstd failed, with its error code.
    #[error("zstd: {}", zstd::zstd_safe::get_error_name(*code))]
    Zstd {
        /// zstd's error code.
        code: usize,
    },
    /// The data is not a zstd frame.
    #[error("zstd: not a zstd frame")]
    NotZstdFrame,
    /// A zstd frame whose own header names another size than the one declared.
    #[error("zstd: the frame holds {holds} bytes where {declared} were declared")]
    ZstdFrameSize {
        /// What the frame says it holds.
        holds: u64,
        /// What the payload declared.
        declared: usize,
    },
    /// A block of no bytes.
    #[error("an empty block")]
    Empty,
    /// A stored block whose sizes differ.
    #[error("a stored block of {raw} bytes declares {wire} on the wire")]
    StoredSizes {
        /// Bytes it stands for.
        raw: u64,
        /// Bytes it takes on the wire.
        wire: u64,
    },
    /// A compressed block in a payload whose codec compresses nothing.
    #[error("a compressed block in a payload without compression")]
    CompressedWithoutCompression,
    /// More wire bytes than the compressor ever makes of the raw size.
    #[error("{family} encodes {raw} bytes in at most {bound}, not {wire}")]
    OverBound {
        /// The compression family.
        family: &'static str,
        /// Raw bytes declared.
        raw: u64,
        /// The compressor's bound for them.
        bound: u64,
        /// Wire bytes declared.
        wire: u64,
    },
    /// More raw bytes than the wire bytes can decompress to.
    #[error("{family}: {wire} bytes cannot decompress to the {raw} declared (at most {most})")]
    OverExpansion {
        /// The compression family.
        family: &'static str,
        /// Wire bytes declared.
        wire: u64,
        /// Raw bytes declared.
        raw: u64,
        /// The most they can decompress to.
        most: u64,
    },
    /// A version 1 tensor without blocks whose sizes do not fit one block.
    #[error("no blocks, and {raw} bytes in {wire} is more than one block holds")]
    TooLargeForOne {
        /// Raw bytes.
        raw: u64,
        /// Wire bytes.
        wire: u64,
    },
    /// Blocks that reach past the tensor or past the data.
    #[error("blocks declare more than the tensor's {total} bytes")]
    PastTheTensor {
        /// The tensor's bytes.
        total: usize,
    },
    /// Blocks that do not fill the tensor, or data left over after them.
    #[error("the blocks fill {filled} of the tensor's {total} bytes and leave {left_over} bytes of data unread")]
    DoNotFill {
        /// Raw bytes the blocks fill.
        filled: usize,
        /// The tensor's bytes.
        total: usize,
        /// Data bytes after the last block.
        left_over: usize,
    },
    /// Uncompressed bytes of another length than declared.
    #[error("{got} bytes where {declared} were declared")]
    StoredLength {
        /// Bytes there are.
        got: usize,
        /// Bytes declared.
        declared: usize,
    },
    /// A block that decompressed to another length than declared.
    #[error("{family}: {got} bytes decompressed where {declared} were declared")]
    DecompressedLength {
        /// The compression family.
        family: &'static str,
        /// Bytes decompressed.
        got: usize,
        /// Bytes declared.
        declared: usize,
    },
}

/// An error of `lz4_flex`, whose types are neither `Clone` nor comparable: two are equal when
/// they say the same.
#[derive(Debug, Clone)]
pub struct Lz4Error(Arc<dyn std::error::Error + Send + Sync>);

/// `error` of lz4 as a [`BlockError`].
fn lz4(error: impl std::error::Error + Send + Sync + 'static) -> BlockError {
    BlockError::Lz4(Lz4Error(Arc::new(error)))
}

impl std::fmt::Display for Lz4Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for Lz4Error {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Lz4Error {}

/// Bytes per block. Measured on resnet18's post-ReLU activations (codec bench): smaller
/// blocks lose ratio and pay lz4's per-call set-up, larger ones gain nothing.
pub const BLOCK_BYTES: usize = 256 << 10;

/// Data of at least this many bytes is compressed and decompressed on several cores, its
/// blocks shared among rayon's workers (sized by `threads:`); below it the workers' start
/// costs more than they save.
pub const PARALLEL_BYTES: usize = 1 << 20;

/// Whether compressing `raw` bytes into `packed` is worth a decoder's pass: it saves at
/// least an eighth.
pub fn worth_compressing(raw: usize, packed: usize) -> bool {
    packed <= raw - raw / 8
}

/// Compresses `data` as a whole, appending to `out`.
pub fn compress(compression: Compression, data: &[u8], out: &mut Vec<u8>) -> Result<(), BlockError> {
    match compression {
        Compression::None => out.extend_from_slice(data),
        Compression::Lz4 => {
            let start = out.len();
            out.resize(start + lz4_flex::block::get_maximum_output_size(data.len()), 0);
            let n = lz4_flex::block::compress_into(data, &mut out[start..]).map_err(lz4)?;
            out.truncate(start + n);
        }
        Compression::Zstd(level) => {
            let start = out.len();
            out.resize(start + zstd::zstd_safe::compress_bound(data.len()), 0);
            let n = zstd::zstd_safe::compress(&mut out[start..], data, level).map_err(|code| BlockError::Zstd { code })?;
            out.truncate(start + n);
        }
    }
    Ok(())
}

/// Compresses `data`, made of `planes` planes of equal length, block by block (module
/// docs), appending to `out`; returns the blocks in order. Data of [`PARALLEL_BYTES`] or more
/// is compressed on several cores; the result is the same either way.
pub fn compress_blocks(compression: Compression, data: &[u8], planes: usize, out: &mut Vec<u8>) -> Result<Vec<Block>, BlockError> {
    let planes = if planes > 1 && data.len().is_multiple_of(planes) { planes } else { 1 };
    let plane_len = (data.len() / planes).max(1);
    let parallel = data.len() >= PARALLEL_BYTES;
    let planes: Vec<&[u8]> = data.chunks(plane_len).collect();
    let first = |plane: &&[u8]| BLOCK_BYTES.min(plane.len());
    // Each plane's sample (its first block) decides whether the rest of it is compressed.
    let samples = each(parallel, planes.iter().map(|p| &p[..first(p)]).collect(), |sample| {
        packed_if(compression, sample, |raw, packed| packed < raw && worth_compressing(raw, packed))
    })?;
    let rest: Vec<&[u8]> =
        planes.iter().zip(&samples).filter(|(_, sample)| sample.is_some()).flat_map(|(p, _)| p[first(p)..].chunks(BLOCK_BYTES)).collect();
    let mut rest = each(parallel, rest, |block| packed_if(compression, block, |raw, packed| packed < raw))?.into_iter();
    let mut blocks = Vec::with_capacity(data.len().div_ceil(BLOCK_BYTES) + planes.len());
    for (plane, mut sample) in planes.iter().zip(samples) {
        let compressing = sample.is_some();
        for (i, block) in plane.chunks(BLOCK_BYTES).enumerate() {
            let packed = if i == 0 {
                sample.take()
            } else if compressing {
                rest.next().flatten()
            } else {
                None
            };
            let raw_len = block.len() as u32;
            blocks.push(match packed {
                Some(packed) => {
                    out.extend_from_slice(&packed);
                    Block { raw_len, wire_len: packed.len() as u32, stored: false }
                }
                None => {
                    out.extend_from_slice(block);
                    Block { raw_len, wire_len: raw_len, stored: true }
                }
            });
        }
    }
    Ok(blocks)
}

/// `block` compressed, when `keep(raw length, compressed length)` says it is worth it.
fn packed_if(compression: Compression, block: &[u8], keep: impl Fn(usize, usize) -> bool) -> Result<Option<Vec<u8>>, BlockError> {
    let mut packed = Vec::new();
    compress(compression, block, &mut packed)?;
    Ok(keep(block.len(), packed.len()).then_some(packed))
}

/// `f` over `items` in order, on rayon's workers when `parallel` (the first error otherwise).
fn each<T: Send, R: Send>(parallel: bool, items: Vec<T>, f: impl Fn(T) -> Result<R, BlockError> + Sync + Send) -> Result<Vec<R>, BlockError> {
    if parallel {
        items.into_par_iter().map(f).collect()
    } else {
        items.into_iter().map(f).collect()
    }
}

/// The most an lz4 block can grow: a byte of match length stands for at most 255 bytes of
/// output, so `n` compressed bytes never decompress to more than about `255 * n`.
const LZ4_MAX_EXPANSION: u64 = 255;

/// Whether a block's declared sizes are possible for `compression`, before anything is
/// decoded: a stored block takes its own size, a compressed one at most the compressor's
/// bound, and an lz4 block of `n` bytes decodes to at most about `255 n`.
pub fn check_block(compression: Compression, block: &Block) -> Result<(), BlockError> {
    let (raw, wire) = (u64::from(block.raw_len), u64::from(block.wire_len));
    if raw == 0 {
        return Err(BlockError::Empty);
    }
    if block.stored {
        return if raw == wire { Ok(()) } else { Err(BlockError::StoredSizes { raw, wire }) };
    }
    let (bound, most) = match compression {
        Compression::None => return Err(BlockError::CompressedWithoutCompression),
        Compression::Lz4 => (lz4_flex::block::get_maximum_output_size(raw as usize) as u64, wire.saturating_mul(LZ4_MAX_EXPANSION) + 16),
        Compression::Zstd(_) => (zstd::zstd_safe::compress_bound(raw as usize) as u64, u64::MAX),
    };
    if wire > bound {
        return Err(BlockError::OverBound { family: compression.family(), raw, bound, wire });
    }
    if raw > most {
        return Err(BlockError::OverExpansion { family: compression.family(), wire, raw, most });
    }
    Ok(())
}

/// Decodes `blocks` (each checked with [`check_block`]) from `data` into `out`, which they
/// must fill exactly, as `data` must hold exactly their bytes. The sizes are checked before
/// anything is decoded; a tensor of [`PARALLEL_BYTES`] or more is decoded on several cores.
pub fn decompress_blocks(compression: Compression, blocks: &[Block], mut data: &[u8], out: &mut [u8]) -> Result<(), BlockError> {
    let (total, parallel) = (out.len(), out.len() >= PARALLEL_BYTES);
    let mut targets = out;
    let mut jobs = Vec::with_capacity(blocks.len());
    for block in blocks {
        let (raw, wire) = (block.raw_len as usize, block.wire_len as usize);
        if wire > data.len() || raw > targets.len() {
            return Err(BlockError::PastTheTensor { total });
        }
        let (packed, rest) = data.split_at(wire);
        let (target, more) = std::mem::take(&mut targets).split_at_mut(raw);
        jobs.push((block.stored, packed, target));
        (data, targets) = (rest, more);
    }
    if !targets.is_empty() || !data.is_empty() {
        let filled = total - targets.len();
        return Err(BlockError::DoNotFill { filled, total, left_over: data.len() });
    }
    each(parallel, jobs, |(stored, packed, target)| {
        if stored {
            target.copy_from_slice(packed);
            Ok(())
        } else {
            decompress_into(compression, packed, target)
        }
    })?;
    Ok(())
}

/// Decompresses `data` into `out`, which it must fill exactly.
pub fn decompress_into(compression: Compression, data: &[u8], out: &mut [u8]) -> Result<(), BlockError> {
    let expected = out.len();
    let n = match compression {
        Compression::None => {
            if data.len() != expected {
                return Err(BlockError::StoredLength { got: data.len(), declared: expected });
            }
            out.copy_from_slice(data);
            expected
        }
        Compression::Lz4 => lz4_flex::block::decompress_into(data, out).map_err(lz4)?,
        Compression::Zstd(_) => {
            match zstd::zstd_safe::get_frame_content_size(data) {
                Ok(Some(holds)) if holds != expected as u64 => return Err(BlockError::ZstdFrameSize { holds, declared: expected }),
                Err(_) => return Err(BlockError::NotZstdFrame),
                _ => {}
            }
            zstd::zstd_safe::decompress(out, data).map_err(|code| BlockError::Zstd { code })?
        }
    };
    if n != expected {
        return Err(BlockError::DecompressedLength { family: compression.family(), got: n, declared: expected });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(compression: Compression, data: &[u8], planes: usize) -> (Vec<Block>, Vec<u8>) {
        let mut packed = Vec::new();
        let blocks = compress_blocks(compression, data, planes, &mut packed).unwrap();
        for b in &blocks {
            check_block(compression, b).unwrap();
        }
        let mut back = vec![0xAA; data.len()];
        decompress_blocks(compression, &blocks, &packed, &mut back).unwrap();
        assert_eq!(back, data, "{compression:?}, {} bytes in {planes} planes", data.len());
        (blocks, packed)
    }

    /// Bytes no compressor shrinks (a fixed-seed xorshift).
    fn noise(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn the_most_compressible_data_still_round_trips() {
        // Zeros compress best; the expansion bound must never refuse what the encoder makes.
        for n in [0, 1, 15, 16, 17, 4096, BLOCK_BYTES - 1, BLOCK_BYTES + 1, 8 << 20] {
            let zeros = vec![0u8; n];
            for compression in [Compression::Lz4, Compression::Zstd(1), Compression::Zstd(19)] {
                let (blocks, _) = round_trip(compression, &zeros, 1);
                assert!(blocks.iter().all(|b| b.raw_len < 64 || !b.stored), "{compression:?} {n}: zeros are compressed");
            }
        }
    }

    #[test]
    fn a_plane_whose_sample_does_not_compress_is_stored_and_the_others_compressed() {
        // Four planes of 600 KiB (three blocks each): zeros, noise, zeros with noise after
        // the sample, noise with zeros after the sample.
        let plane = 600 << 10;
        let zeros = vec![0u8; plane];
        let mixed = |first: &[u8], rest: &[u8]| [&first[..BLOCK_BYTES], &rest[BLOCK_BYTES..]].concat();
        let data = [zeros.clone(), noise(plane), mixed(&zeros, &noise(plane)), mixed(&noise(plane), &zeros)].concat();
        let (blocks, packed) = round_trip(Compression::Lz4, &data, 4);
        let stored: Vec<bool> = blocks.iter().map(|b| b.stored).collect();
        assert_eq!(
            stored,
            [[false; 3], [true; 3], [false, true, true], [true; 3]].concat(),
            "per plane: compressed, stored (sample), compressed then stored where noise does not shrink, stored (sample)"
        );
        assert_eq!(blocks.iter().map(|b| b.raw_len as usize).sum::<usize>(), data.len());
        assert!(packed.len() < 2 * plane + (plane - BLOCK_BYTES) + 4096, "{} bytes", packed.len());
        // Planes that do not divide the data are taken as one.
        round_trip(Compression::Lz4, &data[..data.len() - 1], 4);
    }

    #[test]
    fn data_compressed_on_several_cores_is_what_one_core_makes() {
        // The same four planes as above: 2.4 MiB together (on several cores), 600 KiB each
        // (on one).
        let plane = 600 << 10;
        let zeros = vec![0u8; plane];
        let data = [zeros.clone(), noise(plane), [&zeros[..BLOCK_BYTES], &noise(plane)[BLOCK_BYTES..]].concat(), zeros].concat();
        assert!(data.len() >= PARALLEL_BYTES && plane < PARALLEL_BYTES);
        for compression in [Compression::Lz4, Compression::Zstd(3)] {
            let (blocks, packed) = round_trip(compression, &data, 4);
            let (mut one_blocks, mut one_packed) = (Vec::new(), Vec::new());
            for p in data.chunks(plane) {
                one_blocks.extend(compress_blocks(compression, p, 1, &mut one_packed).unwrap());
            }
            assert_eq!(blocks, one_blocks, "{compression:?}");
            assert_eq!(packed, one_packed, "{compression:?}");
        }
    }

    #[test]
    fn impossible_blocks_are_refused_before_decoding() {
        let lz4 = |raw_len, wire_len, stored| check_block(Compression::Lz4, &Block { raw_len, wire_len, stored });
        assert_eq!(lz4(0, 0, true).unwrap_err(), BlockError::Empty);
        assert_eq!(lz4(10, 11, true).unwrap_err(), BlockError::StoredSizes { raw: 10, wire: 11 });
        assert_eq!(lz4(1 << 30, 16, false).unwrap_err(), BlockError::OverExpansion { family: "lz4", wire: 16, raw: 1 << 30, most: 16 * 255 + 16 });
        assert!(lz4(16, 100, false).unwrap_err().to_string().contains("lz4 encodes 16 bytes in at most"));
        assert_eq!(
            check_block(Compression::None, &Block { raw_len: 4, wire_len: 2, stored: false }).unwrap_err(),
            BlockError::CompressedWithoutCompression
        );
        // Sizes that do not add up, and blocks whose data is not what they say.
        let data = vec![7u8; 4096];
        let mut packed = Vec::new();
        let blocks = compress_blocks(Compression::Lz4, &data, 1, &mut packed).unwrap();
        let mut out = vec![0u8; 4095];
        assert_eq!(decompress_blocks(Compression::Lz4, &blocks, &packed, &mut out).unwrap_err(), BlockError::PastTheTensor { total: 4095 });
        let mut out = vec![0u8; 4096];
        assert_eq!(
            decompress_blocks(Compression::Lz4, &blocks, &[&packed[..], &[0]].concat(), &mut out).unwrap_err(),
            BlockError::DoNotFill { filled: 4096, total: 4096, left_over: 1 }
        );
        let mut out = vec![0u8; 4097];
        assert_eq!(
            decompress_blocks(Compression::Lz4, &blocks, &packed, &mut out).unwrap_err(),
            BlockError::DoNotFill { filled: 4096, total: 4097, left_over: 0 }
        );
        let mut out = vec![0u8; 4096];
        let mut garbled = packed.clone();
        garbled[0] = 0xF0;
        garbled.truncate(2);
        let garbled_blocks = [Block { raw_len: 4096, wire_len: 2, stored: false }];
        assert!(matches!(decompress_blocks(Compression::Lz4, &garbled_blocks, &garbled, &mut out).unwrap_err(), BlockError::Lz4(_)));
        let mut zstd = Vec::new();
        compress(Compression::Zstd(3), &data, &mut zstd).unwrap();
        let mut out = vec![0u8; 1 << 20];
        assert_eq!(
            decompress_into(Compression::Zstd(3), &zstd, &mut out).unwrap_err().to_string(),
            "zstd: the frame holds 4096 bytes where 1048576 were declared"
        );
        assert_eq!(decompress_into(Compression::Zstd(3), b"not zstd", &mut out[..8]).unwrap_err(), BlockError::NotZstdFrame);
        zstd.truncate(zstd.len() - 1);
        let err = decompress_into(Compression::Zstd(3), &zstd, &mut out[..4096]).unwrap_err();
        assert!(matches!(err, BlockError::Zstd { .. }), "{err}");
        assert!(err.to_string().starts_with("zstd: "), "{err}");
    }
}
