//! Byte shuffle: element i's byte b moves to `b * n + i`, so the bytes of equal significance
//! (a float's sign and exponent, its mantissa) sit together and compress. The same filter as
//! HDF5's and Blosc's shuffle.

/// Shuffles `data` (elements of `size` bytes) into `out`; a trailing partial element (never
/// produced by a valid tensor) is copied as it is.
pub fn shuffle(data: &[u8], size: usize, out: &mut Vec<u8>) {
    out.clear();
    if size <= 1 {
        out.extend_from_slice(data);
        return;
    }
    let n = data.len() / size;
    out.resize(data.len(), 0);
    for (b, plane) in out[..n * size].chunks_exact_mut(n.max(1)).enumerate().take(size) {
        for (o, element) in plane.iter_mut().zip(data.chunks_exact(size)) {
            *o = element[b];
        }
    }
    out[n * size..].copy_from_slice(&data[n * size..]);
}

/// Undoes [`shuffle`].
pub fn unshuffle(data: &[u8], size: usize, out: &mut Vec<u8>) {
    out.clear();
    if size <= 1 {
        out.extend_from_slice(data);
        return;
    }
    let n = data.len() / size;
    out.resize(data.len(), 0);
    for (b, plane) in data[..n * size].chunks_exact(n.max(1)).enumerate().take(size) {
        for (element, &byte) in out.chunks_exact_mut(size).zip(plane) {
            element[b] = byte;
        }
    }
    out[n * size..].copy_from_slice(&data[n * size..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_groups_bytes_by_significance() {
        let data = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut out = Vec::new();
        shuffle(&data, 4, &mut out);
        assert_eq!(out, [1, 5, 2, 6, 3, 7, 4, 8, 9]);
        let mut back = Vec::new();
        unshuffle(&out, 4, &mut back);
        assert_eq!(back, data);
        shuffle(&[], 8, &mut out);
        assert!(out.is_empty());
    }
}
