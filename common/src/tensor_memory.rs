//! A CPU tensor's memory as bytes, without copying: the one module of the workspace with
//! `unsafe` code, kept to the two views zero-copy boundaries need.
//!
//! - [`TensorBytes`]: a tensor given up to the wire. Its memory becomes [`Bytes`] that frames
//!   slice, so a raw boundary goes from the tensor to gRPC's encode buffer with no copy of
//!   ours in between.
//! - [`TensorBuf`]: a tensor being filled from the wire. Allocated here at its declared shape,
//!   uninitialised, so its memory is `MaybeUninit<u8>` until written: bytes are appended in
//!   order ([`TensorBuf::write`]), and only the bytes written so far can be read. Received
//!   bytes are copied once, from the frames into the memory the stages run on.
//!
//! What each view relies on:
//! - libtorch keeps a tensor's storage alive for as long as a handle to it exists, and both
//!   views hold their handle for as long as a slice of them can be used;
//! - a [`TensorBuf`]'s tensor is created here and no other handle to it exists until
//!   [`TensorBuf::into_tensor`] gives it away, so its `&mut self` methods are the only writers;
//! - a [`TensorBytes`] reads memory that other handles may share (a stage's output can alias
//!   its input or a parameter), and nothing here can see those handles: whoever makes one
//!   promises that nothing writes the memory while its bytes live. That promise is the caller's,
//!   so [`TensorBytes::new`] is an `unsafe fn` (the wire's `encode_owned` passes it on).
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use bytes::Bytes;
use tch::{Device, Kind, TchError, Tensor};

/// A dense, contiguous CPU tensor whose bytes are read as they lie.
#[derive(Debug)]
pub struct TensorBytes {
    tensor: Tensor,
    len: usize,
}

impl TensorBytes {
    /// Takes `tensor` when its memory can be read as it is (on the CPU, contiguous, dense);
    /// gives it back otherwise.
    ///
    /// # Safety
    ///
    /// The tensor's bytes are initialised (a computed tensor's are; an `empty` one's are not),
    /// and nothing writes them, through this tensor or any other handle to its storage, until
    /// the returned value and every [`Bytes`] made from it are dropped.
    pub unsafe fn new(tensor: Tensor) -> Result<Self, Tensor> {
        if tensor.device() != Device::Cpu || !tensor.is_contiguous() || tensor.is_sparse() || tensor.is_mkldnn() {
            return Err(tensor);
        }
        let Ok(kind) = tensor.f_kind() else { return Err(tensor) };
        let len = tensor.numel() * kind.elt_size_in_bytes();
        Ok(Self { tensor, len })
    }

    /// Its bytes as [`Bytes`] that own the tensor: slices of them keep it alive.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `new` checked that the tensor is a dense contiguous CPU tensor, so its
        // `numel * element size` bytes from `data_ptr` are one allocation, kept alive by
        // `self.tensor` for as long as `self` (and so the returned borrow) lives. They are
        // initialised and nothing writes them meanwhile: `new`'s caller promised both.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len) }
    }
}

/// A CPU tensor of a declared shape, allocated uninitialised and written as bytes, in order,
/// before anyone uses it.
#[derive(Debug)]
pub struct TensorBuf {
    tensor: Tensor,
    len: usize,
    /// How many bytes from the start are initialised (written or zeroed); the rest are not.
    written: usize,
    pinned: bool,
}

impl TensorBuf {
    /// Allocates an uninitialised contiguous CPU tensor (libtorch's error for a shape it
    /// cannot build, such as one whose size overflows).
    pub fn empty(shape: &[i64], kind: Kind) -> Result<Self, TchError> {
        Self::empty_in_order(shape, &[], kind)
    }

    /// Allocates an uninitialised CPU tensor of `shape` whose memory is dense in `order` (its
    /// dimensions, outermost first; empty: row-major), so that bytes written in that order
    /// make the tensor in its own shape, with no view to take afterwards (channels_last
    /// arrives as channels_last).
    pub fn empty_in_order(shape: &[i64], order: &[u32], kind: Kind) -> Result<Self, TchError> {
        let tensor = match order {
            [] => Tensor::f_empty(shape, (kind, Device::Cpu))?,
            _ => Tensor::f_empty_strided(shape, dense_strides(shape, order)?, (kind, Device::Cpu))?,
        };
        Ok(Self::of(tensor, kind, false))
    }

    /// The same in page-locked (pinned) host memory for CUDA device `device`, so that the
    /// stages' copy to the device can be asynchronous (see [`Tensor::to_device_`] with
    /// `non_blocking`). libtorch's caching host allocator keeps freed pinned blocks for reuse,
    /// and holds one back until the copies queued from it are done.
    pub fn empty_pinned(shape: &[i64], order: &[u32], kind: Kind, device: Device) -> Result<Self, TchError> {
        // tch cannot ask libtorch for an empty pinned tensor, and a pinned storage cannot be
        // resized: an empty pageable one is pinned (`_pin_memory` keeps its strides), which
        // copies its untouched pages once. `_pin_memory`, because tch always passes
        // `pin_memory` the device, which libtorch 2.11 deprecates with a warning on every call.
        let tensor = Self::empty_in_order(shape, order, kind)?.tensor.f_internal_pin_memory(device)?;
        Ok(Self::of(tensor, kind, true))
    }

    /// `tensor` must be dense with no storage offset (contiguous in some order of its
    /// dimensions), on the CPU, of `kind`, and have no other handle.
    fn of(tensor: Tensor, kind: Kind, pinned: bool) -> Self {
        let len = tensor.numel() * kind.elt_size_in_bytes();
        Self { tensor, len, written: 0, pinned }
    }

    /// Whether it was allocated in pinned memory.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every byte is written.
    pub fn is_full(&self) -> bool {
        self.written == self.len
    }

    /// Appends the first bytes of `bytes` after those written so far, as many as fit; returns
    /// how many it took.
    pub fn write(&mut self, bytes: &[u8]) -> usize {
        let unwritten = self.unwritten();
        let n = unwritten.len().min(bytes.len());
        // SAFETY: `unwritten` is this buffer's own memory past the written bytes, at least `n`
        // long, and `bytes` (a shared borrow) cannot overlap it (`&mut self` is its only view).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), unwritten.as_mut_ptr().cast::<u8>(), n) };
        self.written += n;
        n
    }

    /// The bytes written so far.
    pub fn bytes(&self) -> &[u8] {
        if self.written == 0 {
            return &[];
        }
        // SAFETY: the first `written` bytes of the tensor's `len` (see `of`) are initialised,
        // and the shared borrow of `self` excludes every writer while the slice lives.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.written) }
    }

    /// The bytes written so far, to change in place (a sealed payload opened where it landed).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.written == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`; the `&mut self` borrow makes this the only view while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.tensor.data_ptr() as *mut u8, self.written) }
    }

    /// All its bytes, for a writer that takes initialised memory (a decoder that writes every
    /// byte): those not written yet are zeroed first.
    pub fn zero_rest_mut(&mut self) -> &mut [u8] {
        self.zero_rest();
        self.bytes_mut()
    }

    /// The tensor, now that its bytes are written; any never written are zeroed, so that no
    /// one reads uninitialised memory.
    pub fn into_tensor(mut self) -> Tensor {
        self.zero_rest();
        self.tensor
    }

    fn zero_rest(&mut self) {
        let unwritten = self.unwritten();
        let n = unwritten.len();
        // SAFETY: `unwritten` is this buffer's own memory, `n` bytes long, and `&mut self` is
        // its only view.
        unsafe { std::ptr::write_bytes(unwritten.as_mut_ptr().cast::<u8>(), 0, n) };
        self.written = self.len;
    }

    /// The bytes past those written, uninitialised.
    fn unwritten(&mut self) -> &mut [MaybeUninit<u8>] {
        if self.written == self.len {
            return &mut [];
        }
        // SAFETY: the tensor was created by `empty_in_order` or `empty_pinned` as a dense CPU
        // tensor (contiguous in some order of its dimensions, from its data pointer) of
        // exactly `len` bytes with no other handle until `into_tensor` consumes `self`; the
        // `&mut self` borrow makes this the only view of them while it lives. `MaybeUninit`
        // asks nothing of their contents.
        unsafe {
            let start = (self.tensor.data_ptr() as *mut MaybeUninit<u8>).add(self.written);
            std::slice::from_raw_parts_mut(start, self.len - self.written)
        }
    }
}

/// The strides of a tensor of `shape` dense in `order` (outermost first): the innermost
/// dimension's is 1, each other's the product of the sizes inside it (a size of 0 counted as
/// 1, as libtorch does). An error when `order` is not a permutation of the dimensions or a
/// stride overflows.
pub(crate) fn dense_strides(shape: &[i64], order: &[u32]) -> Result<Vec<i64>, TchError> {
    let bad = || TchError::Shape(format!("no dense layout of shape {shape:?} in the order {order:?}"));
    let mut sorted: Vec<u32> = order.to_vec();
    sorted.sort_unstable();
    if !sorted.iter().copied().eq(0..shape.len() as u32) {
        return Err(bad());
    }
    let mut strides = vec![0i64; shape.len()];
    let mut inside = 1i64;
    for (i, &d) in order.iter().enumerate().rev() {
        strides[d as usize] = inside;
        // (The outermost size is no stride: it is not multiplied in.)
        if i > 0 {
            inside = inside.checked_mul(shape[d as usize].max(1)).ok_or_else(bad)?;
        }
    }
    Ok(strides)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_bytes_are_the_tensors_memory_and_keep_it_alive() {
        let t = Tensor::from_slice(&[1.0f32, -2.5, 3.25]).reshape([3, 1]);
        let expected: Vec<u8> = [1.0f32, -2.5, 3.25].iter().flat_map(|x| x.to_le_bytes()).collect();
        let ptr = t.data_ptr() as usize;
        // SAFETY: nothing else holds `t`.
        let bytes = unsafe { TensorBytes::new(t) }.unwrap().into_bytes();
        assert_eq!(bytes.as_ptr() as usize, ptr, "no copy was made");
        let slice = bytes.slice(4..8);
        drop(bytes);
        assert_eq!(&slice[..], &expected[4..8]);
    }

    #[test]
    fn a_tensor_that_is_not_contiguous_is_given_back() {
        let t = Tensor::from_slice(&[1i64, 2, 3, 4]).reshape([2, 2]).tr();
        // SAFETY: nothing else holds `t`.
        let back = unsafe { TensorBytes::new(t) }.unwrap_err();
        assert_eq!(back.size(), [2, 2]);
    }

    #[test]
    fn an_empty_tensor_has_no_bytes() {
        let t = Tensor::f_empty([0, 4], (Kind::Float, Device::Cpu)).unwrap();
        // SAFETY: nothing else holds `t`, and it has no bytes to read.
        assert!(unsafe { TensorBytes::new(t) }.unwrap().into_bytes().is_empty());
        assert!(TensorBuf::empty(&[4, 0], Kind::Float).unwrap().bytes_mut().is_empty());
    }

    #[test]
    fn a_filled_buffer_becomes_the_tensor_written() {
        let mut buf = TensorBuf::empty(&[2, 2], Kind::Int16).unwrap();
        assert_eq!(buf.write(&[1, 0, 2]), 3);
        assert_eq!(buf.bytes(), [1, 0, 2], "only the bytes written are readable");
        assert_eq!(buf.write(&[0, 3, 0, 0xff, 0xff, 9, 9]), 5, "it takes what fits");
        assert!(buf.is_full());
        assert_eq!(buf.write(&[9]), 0);
        let t = buf.into_tensor();
        assert_eq!(Vec::<i16>::try_from(t.flatten(0, -1)).unwrap(), [1, 2, 3, -1]);
    }

    #[test]
    fn bytes_never_written_are_zeroed_before_anyone_reads_them() {
        let mut buf = TensorBuf::empty(&[4], Kind::Uint8).unwrap();
        buf.write(&[7]);
        assert_eq!(buf.bytes_mut(), [7]);
        assert_eq!(Vec::<u8>::try_from(buf.into_tensor()).unwrap(), [7, 0, 0, 0]);
        let mut whole = TensorBuf::empty(&[3], Kind::Uint8).unwrap();
        whole.write(&[5]);
        assert_eq!(whole.zero_rest_mut(), [5, 0, 0]);
        assert!(whole.is_full());
    }

    #[test]
    fn a_shape_libtorch_cannot_allocate_is_an_error() {
        assert!(TensorBuf::empty(&[-1, 2], Kind::Float).is_err());
        assert!(TensorBuf::empty_in_order(&[1, 2, 3, 4], &[0, 2, 3], Kind::Float).is_err(), "not every dimension");
        assert!(TensorBuf::empty_in_order(&[1, 2, 3, 4], &[0, 2, 2, 1], Kind::Float).is_err(), "one twice");
        assert!(TensorBuf::empty_in_order(&[1, 2], &[0, 2], Kind::Float).is_err(), "no such dimension");
        assert!(TensorBuf::empty_in_order(&[2, 1 << 32, 1 << 32], &[0, 2, 1], Kind::Float).is_err(), "strides overflow");
        // The outermost size is no stride: an empty tensor that large is allocated.
        assert!(TensorBuf::empty_in_order(&[0, i64::MAX, 2], &[1, 2, 0], Kind::Float).is_ok());
    }

    #[test]
    fn a_buffer_laid_out_in_another_order_is_written_in_that_order_and_is_the_tensor_in_its_shape() {
        // NCHW [1, 3, 2, 2] in channels_last order (N, H, W, C): bytes come pixel by pixel.
        let reference = Tensor::arange(12, (Kind::Float, Device::Cpu)).reshape([1, 3, 2, 2]);
        let travelled = reference.permute([0, 2, 3, 1]).contiguous();
        let mut buf = TensorBuf::empty_in_order(&[1, 3, 2, 2], &[0, 2, 3, 1], Kind::Float).unwrap();
        let bytes: Vec<u8> = Vec::<f32>::try_from(travelled.flatten(0, -1)).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(buf.write(&bytes), 48);
        let t = buf.into_tensor();
        assert_eq!(t.size(), [1, 3, 2, 2]);
        assert_eq!(t.stride(), [12, 1, 6, 3], "channels_last strides");
        assert!(t.equal(&reference));
        assert_eq!(dense_strides(&[2, 0, 3], &[1, 2, 0]).unwrap(), [1, 6, 2], "a size of 0 counts as 1");
    }
}
