//! A device buffer that knows its element type and length, so launches can validate shapes.
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use cubecl::bytes::Bytes;
use cubecl::prelude::*;
use cubecl::server::{Handle, ServerError};

use crate::arena::{carve_installed, Lease};

/// `len` elements of `T` in device memory.
pub struct DeviceArray<T> {
    handle: Handle,
    len: usize,
    /// For an array carved from an [`Arena`](crate::arena::Arena): its range, held until
    /// the last clone drops.
    lease: Option<Arc<Lease>>,
    _elem: PhantomData<T>,
}

impl<T> Clone for DeviceArray<T> {
    fn clone(&self) -> Self {
        Self {
            handle: self.handle.clone(),
            len: self.len,
            lease: self.lease.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T> DeviceArray<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: CubeElement> DeviceArray<T> {
    /// Copies `data` to the device.
    pub fn upload<R: Runtime>(client: &ComputeClient<R>, data: &[T]) -> Self {
        Self {
            handle: client.create_from_slice(T::as_bytes(data)),
            len: data.len(),
            lease: None,
            _elem: PhantomData,
        }
    }

    /// `len` copies of `value`: used to poison outputs before a kernel runs, so an element
    /// the kernel fails to write shows up as the poison instead of a plausible zero.
    pub fn filled<R: Runtime>(client: &ComputeClient<R>, len: usize, value: T) -> Self {
        Self::upload(client, &vec![value; len])
    }

    /// `len` elements, uninitialised: only for outputs a kernel overwrites entirely
    /// (allocating without a host copy matters for gigabyte-sized buffers). Carved from
    /// the arena installed on this thread, if one is ([`crate::arena`]).
    pub fn uninit<R: Runtime>(client: &ComputeClient<R>, len: usize) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        let (handle, lease) = match carve_installed(client, bytes as u64) {
            Some((view, lease)) => (view, Some(lease)),
            None => (client.empty(bytes), None),
        };
        Self {
            handle,
            len,
            lease,
            _elem: PhantomData,
        }
    }

    /// Reads the buffer back (waits for the kernels that write it).
    pub fn read<R: Runtime>(&self, client: &ComputeClient<R>) -> Vec<T> {
        let bytes = client.read_one_unchecked(self.handle.clone());
        T::from_bytes(&bytes)[..self.len].to_vec()
    }

    /// Enqueues a read of the buffer now, after the kernels issued so far, and returns what
    /// waits for it: the host may issue more work before [`PendingRead::wait`], and the wait
    /// is for this read only, not for that later work.
    pub fn read_later<'a, R: Runtime>(&self, client: &'a ComputeClient<R>) -> PendingRead<'a, T> {
        PendingRead {
            read: Box::pin(client.read_async(vec![self.handle.clone()])),
            len: self.len,
            _elem: PhantomData,
        }
    }

    /// CubeCL's handle of the buffer (for a launcher outside CubeCL, which reads the
    /// buffer's device address through it).
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The kernel argument viewing this buffer (also for kernels outside this crate, such as
    /// a benchmark's input generator).
    pub fn arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY: `len` elements of `T` were allocated for this handle.
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len) }
    }
}

/// A read of a [`DeviceArray`] in flight ([`DeviceArray::read_later`]), borrowing the
/// client it was enqueued on.
pub struct PendingRead<'a, T> {
    read: Pin<Box<dyn Future<Output = Result<Vec<Bytes>, ServerError>> + Send + 'a>>,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: CubeElement> PendingRead<'_, T> {
    /// The buffer's contents, once the device has written them (blocks until then).
    pub fn wait(self) -> Result<Vec<T>, ServerError> {
        let bytes = cubecl::reader::read_sync(self.read)?;
        Ok(T::from_bytes(&bytes[0])[..self.len].to_vec())
    }
}

/// Checks that element (or byte) indices up to `count` fit the kernels' 32-bit indexing.
pub(crate) fn check_index_space(
    what: &'static str,
    count: usize,
) -> Result<(), crate::KernelError> {
    if count <= u32::MAX as usize {
        Ok(())
    } else {
        Err(crate::KernelError::Range {
            what,
            value: count,
            min: 0,
            max: u32::MAX as usize,
        })
    }
}

/// Checks that `array` holds exactly `expected` elements.
pub(crate) fn check_len<T>(
    what: &'static str,
    array: &DeviceArray<T>,
    expected: usize,
) -> Result<(), crate::KernelError> {
    if array.len() == expected {
        Ok(())
    } else {
        Err(crate::KernelError::Length {
            what,
            expected,
            got: array.len(),
        })
    }
}
