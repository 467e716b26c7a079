//! Zero elision: a tensor whose elements are often exactly zero (activations after a ReLU:
//! a third of them, scattered) travels as a bit mask of its non-zero elements followed by
//! those elements only. Scattered zeros are what slows lz4 most (many short matches, little
//! saved); without them the mantissa planes are stored at memory speed and only the
//! exponents are compressed. An element is zero when all its bytes are (`-0.0` is not), so
//! the round trip is bit exact for every dtype.

/// Elements sampled to decide whether a tensor's zeros are worth eliding.
const SAMPLE_ELEMENTS: usize = 16 << 10;

/// Whether eliding pays: at least an eighth of the sampled elements are zero (the mask
/// costs one bit per element, an eighth of a byte element's size at most).
pub fn worth_eliding(data: &[u8], size: usize) -> bool {
    let n = (data.len() / size).min(SAMPLE_ELEMENTS);
    let zeros = data[..n * size].chunks_exact(size).filter(|e| e.iter().all(|&b| b == 0)).count();
    n > 0 && zeros * 8 >= n
}

/// Bytes of the mask for `n` elements.
pub fn mask_len(n: usize) -> usize {
    n.div_ceil(8)
}

/// Appends to `mask` one bit per element of `data` (elements of `size` bytes; bit `i % 8` of
/// byte `i / 8`, set for a non-zero element), and to `kept` the non-zero elements in order.
pub fn elide(data: &[u8], size: usize, mask: &mut Vec<u8>, kept: &mut Vec<u8>) {
    let n = data.len() / size;
    let mask_start = mask.len();
    mask.resize(mask_start + mask_len(n), 0);
    // Every element is written, and the cursor moves past the non-zero ones only: no branch
    // on the data, which is what makes the loop fast on scattered zeros.
    let start = kept.len();
    kept.resize(start + data.len() + size, 0);
    let (out, bits) = (&mut kept[start..], &mut mask[mask_start..]);
    let (done, mut at) = match size {
        2 => elide_u16(data, bits, out),
        4 => elide_u32(data, bits, out),
        8 => elide_u64(data, bits, out),
        _ => (0, 0),
    };
    for (i, element) in data[done * size..n * size].chunks_exact(size).enumerate() {
        let i = done + i;
        let nonzero = element.iter().any(|&b| b != 0);
        out[at..at + size].copy_from_slice(element);
        at += usize::from(nonzero) * size;
        bits[i / 8] |= u8::from(nonzero) << (i % 8);
    }
    kept.truncate(start + at);
}

/// Why a zero mask does not fit its tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZeroMaskError {
    /// The mask's length is not one bit per element, rounded up to bytes.
    #[error("a zero mask of {bytes} bytes for {elements} elements")]
    Length {
        /// The mask's bytes.
        bytes: usize,
        /// The tensor's elements.
        elements: usize,
    },
    /// Bits set past the last element.
    #[error("the zero mask marks elements past the last of {elements}")]
    PastTheEnd {
        /// The tensor's elements.
        elements: usize,
    },
    /// The mask marks another number of elements than the data holds.
    #[error("the zero mask marks {marked} non-zero elements, the data holds {kept_bytes} bytes of {size}-byte elements")]
    Marked {
        /// Elements the mask marks.
        marked: usize,
        /// Bytes of kept elements.
        kept_bytes: usize,
        /// Bytes per element.
        size: usize,
    },
}

/// Undoes [`elide`] into `out` (the tensor's `n` elements of `size` bytes): checks that the
/// mask has no bits past the last element and that `kept` holds exactly the elements it
/// marks.
pub fn restore(mask: &[u8], kept: &[u8], size: usize, out: &mut [u8]) -> Result<(), ZeroMaskError> {
    let n = out.len() / size;
    if mask.len() != mask_len(n) {
        return Err(ZeroMaskError::Length { bytes: mask.len(), elements: n });
    }
    if !n.is_multiple_of(8) && mask[mask.len() - 1] >> (n % 8) != 0 {
        return Err(ZeroMaskError::PastTheEnd { elements: n });
    }
    let marked: usize = mask.iter().map(|b| b.count_ones() as usize).sum();
    if marked * size != kept.len() {
        return Err(ZeroMaskError::Marked { marked, kept_bytes: kept.len(), size });
    }
    let (done, mut from) = match size {
        2 => restore_u16(mask, kept, out),
        4 => restore_u32(mask, kept, out),
        8 => restore_u64(mask, kept, out),
        _ => (0, 0),
    };
    for (i, element) in out[done * size..n * size].chunks_exact_mut(size).enumerate() {
        let i = done + i;
        if mask[i / 8] >> (i % 8) & 1 == 1 {
            element.copy_from_slice(&kept[from..from + size]);
            from += size;
        } else {
            element.fill(0);
        }
    }
    Ok(())
}

/// Elision and restoration for one word type, eight elements (one mask byte) at a time,
/// branch-free; each returns the elements it did and where it left the kept bytes, and the
/// callers' plain loops do the rest.
macro_rules! by_words {
    ($elide:ident, $restore:ident, $word:ty) => {
        fn $elide(data: &[u8], mask: &mut [u8], out: &mut [u8]) -> (usize, usize) {
            const SIZE: usize = std::mem::size_of::<$word>();
            let mut at = 0;
            let groups = data.chunks_exact(8 * SIZE);
            let done = groups.len() * 8;
            for (group, bits) in groups.zip(mask.iter_mut()) {
                let mut b = 0u8;
                for (i, element) in group.chunks_exact(SIZE).enumerate() {
                    let word = <$word>::from_ne_bytes(element.try_into().expect("an element"));
                    out[at..at + SIZE].copy_from_slice(&word.to_ne_bytes());
                    let nonzero = word != 0;
                    at += usize::from(nonzero) * SIZE;
                    b |= u8::from(nonzero) << i;
                }
                *bits = b;
            }
            (done, at)
        }

        fn $restore(mask: &[u8], kept: &[u8], out: &mut [u8]) -> (usize, usize) {
            const SIZE: usize = std::mem::size_of::<$word>();
            let mut from = 0;
            let mut done = 0;
            // A group reads up to eight elements ahead; the last groups take the plain loop.
            for (group, &bits) in out.chunks_exact_mut(8 * SIZE).zip(mask) {
                if from + 8 * SIZE > kept.len() {
                    break;
                }
                for (i, element) in group.chunks_exact_mut(SIZE).enumerate() {
                    let bit = (bits >> i) & 1;
                    let word = <$word>::from_ne_bytes(kept[from..from + SIZE].try_into().expect("an element"));
                    element.copy_from_slice(&(word & (0 as $word).wrapping_sub(<$word>::from(bit))).to_ne_bytes());
                    from += usize::from(bit) * SIZE;
                }
                done += 8;
            }
            (done, from)
        }
    };
}

by_words!(elide_u16, restore_u16, u16);
by_words!(elide_u32, restore_u32, u32);
by_words!(elide_u64, restore_u64, u64);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn elided_zeros_come_back_bit_exact(
            elements in proptest::collection::vec(prop_oneof![Just(0u32), Just(0x8000_0000), any::<u32>(), 0u32..4], 0..200),
            size in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
        ) {
            let data: Vec<u8> = elements.iter().flat_map(|e| e.to_le_bytes()).collect();
            let data = &data[..data.len() / size * size];
            let (mut mask, mut kept) = (vec![9], vec![7]);
            elide(data, size, &mut mask, &mut kept);
            prop_assert_eq!(mask.len(), 1 + mask_len(data.len() / size));
            let zeros = data.chunks_exact(size).filter(|e| e.iter().all(|&b| b == 0)).count();
            prop_assert_eq!(kept.len(), 1 + data.len() - zeros * size, "appended after what was there");
            let mut out = vec![0xAA; data.len()];
            restore(&mask[1..], &kept[1..], size, &mut out).unwrap();
            prop_assert_eq!(&out[..], data);
        }
    }

    #[test]
    fn a_mask_that_does_not_match_its_elements_is_an_error() {
        let data: Vec<u8> = [0f32, 1.5, 0.0, -0.0, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let (mut mask, mut kept) = (Vec::new(), Vec::new());
        elide(&data, 4, &mut mask, &mut kept);
        assert_eq!((mask.as_slice(), kept.len()), (&[0b11010u8][..], 12), "-0.0 is not elided");
        let mut out = vec![0u8; data.len()];
        assert_eq!(restore(&mask, &kept[4..], 4, &mut out).unwrap_err(), ZeroMaskError::Marked { marked: 3, kept_bytes: 8, size: 4 });
        assert_eq!(restore(&[0b10_0000], &kept, 4, &mut out).unwrap_err(), ZeroMaskError::PastTheEnd { elements: 5 });
        assert!(restore(&[0, 0], &kept, 4, &mut out).unwrap_err().to_string().contains("a zero mask of 2 bytes for 5 elements"));
    }

    #[test]
    fn only_tensors_with_enough_zeros_are_elided() {
        let with = |zeros: usize| -> Vec<u8> { (0..64u32).flat_map(|i| if (i as usize) < zeros { 0 } else { i + 1 }.to_le_bytes()).collect() };
        assert!(!worth_eliding(&with(7), 4));
        assert!(worth_eliding(&with(8), 4));
        assert!(!worth_eliding(&[], 4));
    }
}
