//! A CPU tensor's memory as bytes, without copying: the one module of the workspace with
//! `unsafe` code, kept to the two views zero-copy boundaries need.
//!
//! - [`TensorBytes`]: a tensor given up to the wire. Its memory becomes [`Bytes`] that frames
//!   slice, so a raw boundary goes from the tensor to gRPC's encode buffer with no copy of
//!   ours in between.
//! - [`TensorBuf`]: a tensor being filled from the wire. Allocated here at its declared shape,
//!   written through a `&mut [u8]` while nothing else can see it, then handed to the stages:
//!   received bytes are copied once, from the frames into the memory the stages run on.
//!
//! Why `unsafe` is sound here: libtorch keeps a tensor's storage alive for as long as a handle
//! to it exists, and both views hold their handle for as long as the slice can be used. A
//! [`TensorBuf`]'s tensor is created here and no other handle exists until
//! [`TensorBuf::into_tensor`] gives it away (which ends the mutable view). A [`TensorBytes`]
//! reads memory that other handles may share (a stage's output can alias its input or a
//! parameter); cleave never writes a boundary after giving it to the wire: inference runs
//! without optimizer steps, and a boundary the host keeps for itself (`fallback: edge`
//! finishes it on the edge, possibly in place) is encoded by copying instead.
#![allow(unsafe_code)]

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
    pub fn new(tensor: Tensor) -> Result<Self, Tensor> {
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
        // `self.tensor` for as long as `self` (and so the returned borrow) lives. The module
        // documentation says why nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len) }
    }
}

/// A CPU tensor of a declared shape, allocated to be written as bytes before anyone uses it.
#[derive(Debug)]
pub struct TensorBuf {
    tensor: Tensor,
    len: usize,
    pinned: bool,
}

impl TensorBuf {
    /// Allocates an uninitialised contiguous CPU tensor (libtorch's error for a shape it
    /// cannot build, such as one whose size overflows).
    pub fn empty(shape: &[i64], kind: Kind) -> Result<Self, TchError> {
        let tensor = Tensor::f_empty(shape, (kind, Device::Cpu))?;
        Ok(Self::of(tensor, kind, false))
    }

    /// The same in page-locked (pinned) host memory for CUDA device `device`, so that the
    /// stages' copy to the device can be asynchronous (see [`Tensor::to_device_`] with
    /// `non_blocking`). libtorch's caching host allocator keeps freed pinned blocks for reuse,
    /// and holds one back until the copies queued from it are done.
    pub fn empty_pinned(shape: &[i64], kind: Kind, device: Device) -> Result<Self, TchError> {
        // tch cannot ask libtorch for an empty pinned tensor, and a pinned storage cannot be
        // resized: an empty pageable one is pinned, which copies its untouched pages once.
        // `_pin_memory`, because tch always passes `pin_memory` the device, which libtorch
        // 2.11 deprecates with a warning on every call.
        let tensor = Tensor::f_empty(shape, (kind, Device::Cpu)).and_then(|t| t.f_internal_pin_memory(device))?;
        Ok(Self::of(tensor, kind, true))
    }

    fn of(tensor: Tensor, kind: Kind, pinned: bool) -> Self {
        let len = tensor.numel() * kind.elt_size_in_bytes();
        Self { tensor, len, pinned }
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

    /// Its bytes as written so far.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: as in `bytes_mut`; the shared borrow of `self` excludes any writer.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len) }
    }

    /// Its bytes, to be written. They start out as whatever the allocator left there.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the tensor was created by `empty` or `empty_pinned` as a contiguous CPU tensor of exactly
        // `len` bytes, and no other handle to it exists until `into_tensor` consumes `self`;
        // the `&mut self` borrow makes this the only view while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.tensor.data_ptr() as *mut u8, self.len) }
    }

    /// The tensor, now that its bytes are written.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_bytes_are_the_tensors_memory_and_keep_it_alive() {
        let t = Tensor::from_slice(&[1.0f32, -2.5, 3.25]).reshape([3, 1]);
        let expected: Vec<u8> = [1.0f32, -2.5, 3.25].iter().flat_map(|x| x.to_le_bytes()).collect();
        let ptr = t.data_ptr() as usize;
        let bytes = TensorBytes::new(t).unwrap().into_bytes();
        assert_eq!(bytes.as_ptr() as usize, ptr, "no copy was made");
        let slice = bytes.slice(4..8);
        drop(bytes);
        assert_eq!(&slice[..], &expected[4..8]);
    }

    #[test]
    fn a_tensor_that_is_not_contiguous_is_given_back() {
        let t = Tensor::from_slice(&[1i64, 2, 3, 4]).reshape([2, 2]).tr();
        let back = TensorBytes::new(t).unwrap_err();
        assert_eq!(back.size(), [2, 2]);
    }

    #[test]
    fn an_empty_tensor_has_no_bytes() {
        let t = Tensor::f_empty([0, 4], (Kind::Float, Device::Cpu)).unwrap();
        assert!(TensorBytes::new(t).unwrap().into_bytes().is_empty());
        assert!(TensorBuf::empty(&[4, 0], Kind::Float).unwrap().bytes_mut().is_empty());
    }

    #[test]
    fn a_filled_buffer_becomes_the_tensor_written() {
        let mut buf = TensorBuf::empty(&[2, 2], Kind::Int16).unwrap();
        buf.bytes_mut().copy_from_slice(&[1, 0, 2, 0, 3, 0, 0xff, 0xff]);
        let t = buf.into_tensor();
        assert_eq!(Vec::<i16>::try_from(t.flatten(0, -1)).unwrap(), [1, 2, 3, -1]);
    }

    #[test]
    fn a_shape_libtorch_cannot_allocate_is_an_error() {
        assert!(TensorBuf::empty(&[-1, 2], Kind::Float).is_err());
    }
}
