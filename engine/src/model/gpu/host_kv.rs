//! The prefix cache's host tier, in host RAM: one slot per cached page, holding every
//! layer's rows of the page as the device pool stores them (either KV format, bit for
//! bit), and the copies between the slots and the pool's pages ([`KvCopy`]), applied in
//! the order the cache queued them. Slots are allocated as they are first written, so an
//! unused tier costs no memory.
//!
//! Copies to the host do not stall the engine: their reads are enqueued behind the work
//! issued so far (through the backend's staging memory, pinned on CUDA) and land in their
//! slots at the next [`HostKv::apply`], by when the step they were enqueued before has been
//! read back, or before a copy back to the device reads a slot.
use cubecl::prelude::*;
use kiln_kernels::mla::{gather_pages, page_words, scatter_pages};
use kiln_kernels::{DeviceArray, PendingRead};

use super::{KvPool, ModelError};
use crate::cache::KvCopy;

/// Host slots for the pages of one pool, and the copies to them in flight (reads on the
/// client `'c`).
pub struct HostKv<'c> {
    /// Words of one layer's page.
    page_words: usize,
    layers: usize,
    capacity: usize,
    /// Slot-major: slot `s`, layer `l` at `(s * layers + l) * page_words`.
    words: Vec<u32>,
    /// Copies to the host in flight: their slots, and each layer's read of those slots'
    /// pages, gathered in the same order.
    pending: Vec<(Vec<u32>, Vec<PendingRead<'c, u32>>)>,
}

/// Bytes moved by [`HostKv::apply`], each way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub to_host: u64,
    pub to_device: u64,
}

impl<'c> HostKv<'c> {
    /// A tier of `capacity` slots for pages of `pool`.
    pub fn new(pool: &KvPool, capacity: usize) -> Self {
        HostKv {
            page_words: pool.caches.first().map_or(0, page_words),
            layers: pool.caches.len(),
            capacity,
            words: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Bytes one slot holds (a page of every layer).
    pub fn slot_bytes(pool: &KvPool) -> usize {
        pool.caches.iter().map(|c| page_words(c) * 4).sum()
    }

    fn slot_range(&mut self, slot: u32, layer: usize) -> std::ops::Range<usize> {
        assert!(
            (slot as usize) < self.capacity,
            "slot {slot} beyond the tier"
        );
        let start = (slot as usize * self.layers + layer) * self.page_words;
        let end = start + self.page_words;
        if self.words.len() < end {
            let slot_end = (slot as usize + 1) * self.layers * self.page_words;
            self.words.resize(slot_end, 0);
        }
        start..end
    }

    /// Pages whose copy to the host is in flight.
    pub fn in_flight_pages(&self) -> usize {
        self.pending.iter().map(|(slots, _)| slots.len()).sum()
    }

    /// Writes the copies to the host in flight into their slots (waiting for their reads).
    fn settle(&mut self) -> Result<(), ModelError> {
        for (slots, reads) in std::mem::take(&mut self.pending) {
            for (l, read) in reads.into_iter().enumerate() {
                let words = read.wait().map_err(|e| ModelError::Device(e.to_string()))?;
                for (i, &slot) in slots.iter().enumerate() {
                    let range = self.slot_range(slot, l);
                    self.words[range]
                        .copy_from_slice(&words[i * self.page_words..(i + 1) * self.page_words]);
                }
            }
        }
        Ok(())
    }

    /// Applies `copies` in order: each run of copies one way is one gather and enqueued
    /// read per layer (to the host; landing in the slots later, see the module's notes) or
    /// one upload and scatter per layer (to the device). First lands the copies to the host
    /// of the call before.
    pub fn apply<R: Runtime>(
        &mut self,
        client: &'c ComputeClient<R>,
        pool: &KvPool,
        copies: &[KvCopy],
    ) -> Result<Copied, ModelError> {
        self.settle()?;
        let mut copied = Copied::default();
        let bytes = (self.layers * self.page_words * 4) as u64;
        for run in copies.chunk_by(|a, b| {
            matches!(a, KvCopy::ToHost { .. }) == matches!(b, KvCopy::ToHost { .. })
        }) {
            let pairs: Vec<(u32, u32)> = (run.iter())
                .map(|c| match *c {
                    KvCopy::ToHost { page, slot } | KvCopy::ToDevice { slot, page } => (page, slot),
                })
                .collect();
            let pages: Vec<u32> = pairs.iter().map(|&(p, _)| p).collect();
            let n = pages.len() * self.page_words;
            if matches!(run[0], KvCopy::ToHost { .. }) {
                let mut reads = Vec::with_capacity(pool.caches.len());
                for cache in &pool.caches {
                    let staged = DeviceArray::uninit(client, n);
                    gather_pages(client, cache, &pages, &staged)?;
                    reads.push(staged.read_later(client));
                }
                self.pending
                    .push((pairs.iter().map(|&(_, s)| s).collect(), reads));
                copied.to_host += bytes * pages.len() as u64;
            } else {
                // The slots read here may be the ones just copied to.
                self.settle()?;
                for (l, cache) in pool.caches.iter().enumerate() {
                    let mut staged = Vec::with_capacity(n);
                    for &(_, slot) in &pairs {
                        let range = self.slot_range(slot, l);
                        staged.extend_from_slice(&self.words[range]);
                    }
                    let staged = DeviceArray::upload(client, &staged);
                    scatter_pages(client, &staged, &pages, cache)?;
                }
                copied.to_device += bytes * pages.len() as u64;
            }
        }
        Ok(copied)
    }
}
