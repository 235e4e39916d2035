//! Whole pages of a paged KV cache copied to and from a dense staging buffer, every row as
//! the cache stores it (any [`KvFormat`], bit for bit): what the prefix cache's host tier
//! moves. [`gather_pages`] stages pages for a read back to the host (the MoE dispatch's
//! row gather); [`scatter_pages`] writes staged pages uploaded from the host into their
//! places.
use cubecl::prelude::*;

use super::PagedKvCache;
use crate::buffer::{check_index_space, check_len};
use crate::moe::gather_rows;
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn scatter_kernel(staged: &Array<u32>, pages: &Array<u32>, cache: &mut Array<u32>, words: u32) {
    let p = CUBE_POS_X as usize;
    let w = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let n = words as usize;
    if w < n {
        let at = pages[p] as usize * n + w;
        cache[at] = staged[p * n + w];
    }
}

/// Words of one page of `kv`.
pub fn page_words(kv: &PagedKvCache) -> usize {
    kv.page_size * kv.format.words_per_row()
}

/// Checks a page list against `kv` and a staging buffer; the launch grid.
fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &PagedKvCache,
    pages: &[u32],
    staged: &DeviceArray<u32>,
) -> Result<CubeCount, KernelError> {
    let words = page_words(kv);
    check_len("KV cache", &kv.data, kv.num_pages * words)?;
    check_len("staged pages", staged, pages.len() * words)?;
    check_index_space("KV cache words", kv.data.len())?;
    if let Some(&bad) = pages.iter().find(|&&p| p as usize >= kv.num_pages) {
        return Err(KernelError::Range {
            what: "page id",
            value: bad as usize,
            min: 0,
            max: kv.num_pages - 1,
        });
    }
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if pages.len() > max {
        return Err(KernelError::Range {
            what: "pages copied at once",
            value: pages.len(),
            min: 0,
            max,
        });
    }
    Ok(CubeCount::Static(
        pages.len() as u32,
        (words as u32).div_ceil(UNITS),
        1,
    ))
}

/// `staged[i] = page pages[i] of kv` (pages of [`page_words`] words each): the MoE
/// dispatch's row gather over the cache's words.
pub fn gather_pages<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &PagedKvCache,
    pages: &[u32],
    staged: &DeviceArray<u32>,
) -> Result<(), KernelError> {
    validate(client, kv, pages, staged)?;
    if pages.is_empty() {
        return Ok(());
    }
    let ids = DeviceArray::upload(client, pages);
    gather_rows(client, &kv.data, page_words(kv), &ids, staged)
}

/// `page pages[i] of kv = staged[i]`; `pages` must be distinct.
pub fn scatter_pages<R: Runtime>(
    client: &ComputeClient<R>,
    staged: &DeviceArray<u32>,
    pages: &[u32],
    kv: &PagedKvCache,
) -> Result<(), KernelError> {
    let grid = validate(client, kv, pages, staged)?;
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(KernelError::Mismatch {
            what: "scattered pages",
            detail: format!("page {} is written twice", w[0]),
        });
    }
    if pages.is_empty() {
        return Ok(());
    }
    let ids = DeviceArray::upload(client, pages);
    // SAFETY: validated above; distinct pages, so no two units write one word.
    unsafe {
        scatter_kernel::launch_unchecked::<R>(
            client,
            grid,
            CubeDim::new_1d(UNITS),
            staged.arg(),
            ids.arg(),
            kv.data.arg(),
            page_words(kv) as u32,
        )
    }
    Ok(())
}
