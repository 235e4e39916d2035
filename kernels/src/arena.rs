//! Device memory that [`DeviceArray::uninit`](crate::DeviceArray::uninit) carves arrays
//! from while an [`Arena`] is installed on the calling thread: how the decode steps
//! recorded as CUDA graphs (issue 29) share one region of scratch instead of each holding
//! every buffer its step ever allocated.
//!
//! An arena is a list of chunks, each one allocation of the client's. A carved array is a
//! view of a chunk (CubeCL's handle with byte offsets) leased until its last clone drops;
//! its range then returns to the chunk's free ranges, and the next array carved may reuse
//! it. That is safe for work issued in order on one stream, the order the ranges were
//! leased in (as with CubeCL's own pools): a range is handed out again only after every
//! launch that used it was issued. Chunks are never freed or moved while the arena lives,
//! so the addresses a graph recorded stay valid; work recorded over one arena may run in
//! any order against other work over it only if the two never run at the same time.
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cubecl::prelude::*;
use cubecl::server::Handle;

/// Carved arrays start at multiples of this many bytes (the CUDA allocator's alignment).
pub const ALIGN: u64 = 256;
/// The fewest bytes a new chunk holds.
const MIN_CHUNK: u64 = 16 << 20;

/// Device memory arrays are carved from while it is [installed](Arena::install).
#[derive(Clone, Default)]
pub struct Arena(Arc<Mutex<Vec<Chunk>>>);

struct Chunk {
    handle: Handle,
    ranges: Ranges,
}

/// A carved array's range of a chunk, returned when the last array holding it drops.
pub(crate) struct Lease {
    arena: Arena,
    chunk: usize,
    range: Range<u64>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut chunks = self.arena.0.lock().expect("arena");
        chunks[self.chunk].ranges.release(self.range.clone());
    }
}

thread_local! {
    static INSTALLED: RefCell<Option<Arena>> = const { RefCell::new(None) };
}

/// While alive, arrays allocated on this thread are carved from an arena
/// ([`Arena::install`]); the arena installed before is restored when it drops.
pub struct Installed {
    previous: Option<Arena>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        INSTALLED.with(|i| *i.borrow_mut() = self.previous.take());
    }
}

impl Arena {
    pub fn new() -> Self {
        Self::default()
    }

    /// Carves the arrays this thread allocates uninitialised from the arena until the
    /// guard drops. Uploads still allocate their own memory.
    pub fn install(&self) -> Installed {
        let previous = INSTALLED.with(|i| i.borrow_mut().replace(self.clone()));
        Installed { previous }
    }

    /// Bytes of device memory the arena holds.
    pub fn bytes(&self) -> u64 {
        let chunks = self.0.lock().expect("arena");
        chunks.iter().map(|c| c.ranges.size).sum()
    }

    /// Bytes leased to arrays still alive.
    pub fn leased_bytes(&self) -> u64 {
        let chunks = self.0.lock().expect("arena");
        chunks.iter().map(|c| c.ranges.leased()).sum()
    }

    /// A view of `bytes` of the arena and its lease; a new chunk when none has room.
    fn carve<R: Runtime>(&self, client: &ComputeClient<R>, bytes: u64) -> (Handle, Lease) {
        let mut chunks = self.0.lock().expect("arena");
        let found =
            (chunks.iter_mut().enumerate()).find_map(|(i, c)| c.ranges.take(bytes).map(|r| (i, r)));
        let (chunk, range) = found.unwrap_or_else(|| {
            let size = bytes.next_multiple_of(ALIGN).max(MIN_CHUNK);
            let mut ranges = Ranges::new(size);
            let range = ranges.take(bytes).expect("a chunk sized for the array");
            chunks.push(Chunk {
                handle: client.empty(size as usize),
                ranges,
            });
            (chunks.len() - 1, range)
        });
        let c = &chunks[chunk];
        let view = (c.handle.clone())
            .offset_start(range.start)
            .offset_end(c.ranges.size - range.start - bytes);
        let lease = Lease {
            arena: self.clone(),
            chunk,
            range,
        };
        (view, lease)
    }
}

/// `bytes` carved from the arena installed on this thread, if one is.
pub(crate) fn carve_installed<R: Runtime>(
    client: &ComputeClient<R>,
    bytes: u64,
) -> Option<(Handle, Arc<Lease>)> {
    let arena = INSTALLED.with(|i| i.borrow().clone())?;
    let (view, lease) = arena.carve(client, bytes.max(1));
    Some((view, Arc::new(lease)))
}

/// The free ranges of one chunk of `size` bytes: first fit, in [`ALIGN`]-byte units,
/// neighbours merged when released.
#[derive(Debug)]
struct Ranges {
    size: u64,
    /// Sorted, disjoint, never adjacent.
    free: Vec<Range<u64>>,
}

impl Ranges {
    fn new(size: u64) -> Self {
        Ranges {
            size,
            free: std::iter::once(0..size).collect(),
        }
    }

    /// The lowest free range of `bytes` (rounded up to [`ALIGN`]), now leased.
    fn take(&mut self, bytes: u64) -> Option<Range<u64>> {
        let need = bytes.max(1).next_multiple_of(ALIGN);
        let i = self.free.iter().position(|r| r.end - r.start >= need)?;
        let start = self.free[i].start;
        self.free[i].start += need;
        if self.free[i].is_empty() {
            self.free.remove(i);
        }
        Some(start..start + need)
    }

    /// Returns a range [`Ranges::take`] leased.
    fn release(&mut self, range: Range<u64>) {
        let i = self.free.partition_point(|r| r.start < range.start);
        debug_assert!(
            i == 0 || self.free[i - 1].end <= range.start,
            "released twice"
        );
        self.free.insert(i, range);
        if i + 1 < self.free.len() && self.free[i].end == self.free[i + 1].start {
            self.free[i].end = self.free.remove(i + 1).end;
        }
        if i > 0 && self.free[i - 1].end == self.free[i].start {
            self.free[i - 1].end = self.free.remove(i).end;
        }
    }

    fn leased(&self) -> u64 {
        self.size - self.free.iter().map(|r| r.end - r.start).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any sequence of leases and releases: live ranges are aligned, inside the
        /// chunk and disjoint; a lease fails only when no free range is large enough; and
        /// once all are released the chunk is one free range again.
        #[test]
        fn leased_ranges_never_overlap_and_all_come_back(
            ops in prop::collection::vec((any::<bool>(), 1u64..5000, any::<prop::sample::Index>()), 1..200)
        ) {
            let size = 64 * ALIGN;
            let mut ranges = Ranges::new(size);
            let mut live: Vec<Range<u64>> = Vec::new();
            for (lease, bytes, pick) in ops {
                if lease || live.is_empty() {
                    let largest = ranges.free.iter().map(|r| r.end - r.start).max().unwrap_or(0);
                    match ranges.take(bytes) {
                        Some(r) => {
                            prop_assert_eq!(r.start % ALIGN, 0);
                            prop_assert!(r.end <= size && r.end - r.start >= bytes);
                            prop_assert!(live.iter().all(|l| l.end <= r.start || r.end <= l.start));
                            live.push(r);
                        }
                        None => prop_assert!(largest < bytes.next_multiple_of(ALIGN)),
                    }
                } else {
                    ranges.release(live.swap_remove(pick.index(live.len())));
                }
                let leased: u64 = live.iter().map(|r| r.end - r.start).sum();
                prop_assert_eq!(ranges.leased(), leased);
                prop_assert!(ranges.free.windows(2).all(|w| w[0].end < w[1].start));
            }
            for r in live {
                ranges.release(r);
            }
            prop_assert_eq!(ranges.free.len(), 1);
            prop_assert_eq!(ranges.free[0].clone(), 0..size);
        }
    }

    #[test]
    fn a_released_range_is_the_next_one_leased() {
        let mut ranges = Ranges::new(8 * ALIGN);
        let a = ranges.take(ALIGN).unwrap();
        let b = ranges.take(3 * ALIGN - 5).unwrap();
        assert_eq!((a.clone(), b.clone()), (0..ALIGN, ALIGN..4 * ALIGN));
        ranges.release(a);
        assert_eq!(ranges.take(10), Some(0..ALIGN), "first fit reuses the hole");
        assert_eq!(ranges.take(5 * ALIGN), None, "4 units left");
        ranges.release(b);
        assert_eq!(
            ranges.take(7 * ALIGN),
            Some(ALIGN..8 * ALIGN),
            "merged with the tail"
        );
    }
}
