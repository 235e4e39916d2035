//! Arrays carved from an arena (`kiln_kernels::arena`: the scratch the decode steps
//! recorded as CUDA graphs share) on every backend: each carved array holds its own
//! values, a kernel writing into a carved array computes what it computes into memory of
//! its own, released ranges are reused (the arena does not grow case after case), and
//! nothing is carved once the arena is no longer installed.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::activation::silu_mul;
use kiln_kernels::arena::Arena;
use kiln_kernels::fill::fill_random_bits;
use kiln_kernels::DeviceArray;
use proptest::prelude::*;

fn carved_arrays_are_their_own_and_their_ranges_come_back<R: Runtime>(client: &ComputeClient<R>) {
    let arena = Arena::new();
    let installed = arena.install();
    let grown = std::cell::Cell::new(None);
    let lens = prop::collection::vec(1usize..5000, 1..8);
    run_cases(12, &(lens, any::<u32>()), |(lens, seed)| {
        let carved: Vec<DeviceArray<u32>> = lens
            .iter()
            .map(|&n| DeviceArray::uninit(client, n))
            .collect();
        for (i, array) in carved.iter().enumerate() {
            fill_random_bits(client, array, seed ^ i as u32, !0, 0).unwrap();
        }
        // Every array written before any is read back: no two share a byte. Each is
        // compared with memory of its own (an upload) filled the same way.
        for (i, (array, &n)) in carved.iter().zip(&lens).enumerate() {
            let own = DeviceArray::filled(client, n, 0xdead_beef_u32);
            fill_random_bits(client, &own, seed ^ i as u32, !0, 0).unwrap();
            prop_assert_eq!(own.read(client), array.read(client), "array {}", i);
        }
        let inter = lens[0];
        let gate = DeviceArray::upload(client, &vec![-1.5f32; inter]);
        let up: Vec<f32> = (0..inter).map(|k| k as f32 * 0.25 - 7.0).collect();
        let up = DeviceArray::upload(client, &up);
        let (carved_out, own_out) = (
            DeviceArray::<f32>::uninit(client, inter),
            DeviceArray::filled(client, inter, f32::NAN),
        );
        silu_mul(client, &gate, &up, &carved_out).unwrap();
        silu_mul(client, &gate, &up, &own_out).unwrap();
        let bits = |a: &DeviceArray<f32>| {
            a.read(client)
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(bits(&carved_out), bits(&own_out));
        drop(carved);
        drop(carved_out);
        prop_assert_eq!(arena.leased_bytes(), 0, "every range released");
        let (bytes, first) = (arena.bytes(), grown.get().unwrap_or(arena.bytes()));
        grown.set(Some(first));
        prop_assert_eq!(bytes, first, "the arena grew");
        Ok(())
    });
    drop(installed);
    let plain = DeviceArray::<u32>::uninit(client, 100);
    assert_eq!(arena.leased_bytes(), 0, "carved after the guard dropped");
    drop(plain);
}

kiln_backends::backend_tests! {
    carved_arrays_are_their_own_and_their_ranges_come_back,
}
