//! Host-side pieces of the routed copies: contiguous lengths and pinned staging.
use std::ffi::c_void;

use cubecl::server::{CopyDescriptor, ServerError};
use cudarc::driver::result;

use super::server::server_error;

/// Bytes of a contiguous copy of `d`, or `None` where it is strided.
pub(super) fn contiguous_bytes(d: &CopyDescriptor) -> Option<usize> {
    let mut expected = 1;
    for (&dim, &stride) in d.shape.iter().zip(d.strides.iter()).rev() {
        if dim > 1 && stride != expected {
            return None;
        }
        expected *= dim;
    }
    Some(expected * d.elem_size)
}

/// Page-locked host memory, for reads copied asynchronously.
pub(super) struct Pinned {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the allocation is owned; it is read and written only by whoever holds it.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(super) fn new(len: usize) -> Result<Self, ServerError> {
        // SAFETY: a fresh host allocation of `len` bytes (flags 0: cached, not write-combined).
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| server_error("pinned host memory", e))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            len: len.max(1),
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}
