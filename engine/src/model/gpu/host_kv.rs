//! The prefix cache's host tier, in host RAM: one slot per cached page, holding every
//! layer's rows of the page as the device pool stores them (either KV format, bit for
//! bit), and the copies between the slots and the pool's pages ([`KvCopy`]), applied in
//! the order the cache queued them. Slots are allocated as they are first written, so an
//! unused tier costs no memory.
use cubecl::prelude::*;
use kiln_kernels::mla::{gather_pages, page_words, scatter_pages};
use kiln_kernels::{DeviceArray, KernelError};

use super::KvPool;
use crate::cache::KvCopy;

/// Host slots for the pages of one pool.
pub struct HostKv {
    /// Words of one layer's page.
    page_words: usize,
    layers: usize,
    capacity: usize,
    /// Slot-major: slot `s`, layer `l` at `(s * layers + l) * page_words`.
    words: Vec<u32>,
}

/// Bytes moved by [`HostKv::apply`], each way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub to_host: u64,
    pub to_device: u64,
}

impl HostKv {
    /// A tier of `capacity` slots for pages of `pool`.
    pub fn new(pool: &KvPool, capacity: usize) -> Self {
        HostKv {
            page_words: pool.caches.first().map_or(0, page_words),
            layers: pool.caches.len(),
            capacity,
            words: Vec::new(),
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

    /// Applies `copies` in order: each run of copies one way is one gather and read back
    /// per layer (to the host) or one upload and scatter per layer (to the device).
    pub fn apply<R: Runtime>(
        &mut self,
        client: &ComputeClient<R>,
        pool: &KvPool,
        copies: &[KvCopy],
    ) -> Result<Copied, KernelError> {
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
                for (l, cache) in pool.caches.iter().enumerate() {
                    let staged = DeviceArray::uninit(client, n);
                    gather_pages(client, cache, &pages, &staged)?;
                    let words = staged.read(client);
                    for (i, &(_, slot)) in pairs.iter().enumerate() {
                        let range = self.slot_range(slot, l);
                        self.words[range].copy_from_slice(
                            &words[i * self.page_words..(i + 1) * self.page_words],
                        );
                    }
                }
                copied.to_host += bytes * pages.len() as u64;
            } else {
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
