//! Whole KV pages copied out of a paged cache and back (the prefix cache's host tier) on
//! every backend: every word where the page list says, bit for bit, in every KV format.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::mla::{gather_pages, page_words, scatter_pages, KvFormat, PagedKvCache};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::data::Rng;
use proptest::prelude::*;

fn formats() -> impl Strategy<Value = KvFormat> {
    prop_oneof![
        Just(KvFormat::F32),
        Just(KvFormat::Bf16),
        Just(KvFormat::Fp8)
    ]
}

/// Whole pages staged out of a cache and scattered into another, in any format: every word
/// lands where the page list says, bit for bit (random bits, NaN patterns included), and
/// pages not listed keep their contents. Odd page sizes, repeated pages when gathering.
fn page_copies<R: Runtime>(client: &ComputeClient<R>) {
    let strategy = (1usize..=7, 1usize..=9, formats(), any::<u64>());
    run_cases(16, &strategy, |(page_size, num_pages, format, seed)| {
        let mut rng = Rng::new(seed);
        let words = page_size * format.words_per_row();
        let cache = |rng: &mut Rng| {
            let data: Vec<u32> = (0..num_pages * words)
                .map(|_| rng.next_u64() as u32)
                .collect();
            let kv = PagedKvCache {
                data: DeviceArray::upload(client, &data),
                format,
                page_size,
                num_pages,
            };
            (data, kv)
        };
        let (src, from) = cache(&mut rng);
        let (mut want, to) = cache(&mut rng);
        let n = 1 + rng.below(num_pages);
        let gathered: Vec<u32> = (0..n).map(|_| rng.below(num_pages) as u32).collect();
        let staged = DeviceArray::filled(client, n * words, 0xdead_beef);
        gather_pages(client, &from, &gathered, &staged).unwrap();
        let got = staged.read(client);
        for (i, &p) in gathered.iter().enumerate() {
            let page = &src[p as usize * words..(p as usize + 1) * words];
            prop_assert_eq!(
                &got[i * words..(i + 1) * words],
                page,
                "gathered page {}",
                p
            );
        }
        // Distinct destinations, in a shuffled order.
        let mut targets: Vec<u32> = (0..num_pages as u32).collect();
        rng.shuffle(&mut targets);
        targets.truncate(n);
        scatter_pages(client, &staged, &targets, &to).unwrap();
        for (i, &p) in targets.iter().enumerate() {
            want[p as usize * words..(p as usize + 1) * words]
                .copy_from_slice(&got[i * words..(i + 1) * words]);
        }
        prop_assert_eq!(to.data.read(client), want);
        Ok(())
    });
}

/// A page beyond the pool, a staging buffer of the wrong size and a page scattered twice
/// are typed errors, not launches.
fn bad_page_copies_are_refused<R: Runtime>(client: &ComputeClient<R>) {
    let kv = PagedKvCache {
        data: DeviceArray::filled(client, 4 * 2 * KvFormat::Bf16.words_per_row(), 0u32),
        format: KvFormat::Bf16,
        page_size: 2,
        num_pages: 4,
    };
    let staged = DeviceArray::filled(client, 2 * page_words(&kv), 0u32);
    assert!(matches!(
        gather_pages(client, &kv, &[0, 4], &staged),
        Err(KernelError::Range { .. })
    ));
    assert!(matches!(
        gather_pages(client, &kv, &[0], &staged),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        scatter_pages(client, &staged, &[1, 1], &kv),
        Err(KernelError::Mismatch { .. })
    ));
}

kiln_backends::backend_tests! {
    page_copies,
    bad_page_copies_are_refused,
}
