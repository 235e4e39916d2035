//! Greedy decoding's argmax on the device against `kiln_reference::argmax`, on every
//! backend: rows of any width (odd, under and over a cube's units, Kimi's 163,840) with
//! planted ties, infinities and NaNs; the output poisoned before the launch.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::argmax::argmax_rows;
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::argmax;
use kiln_reference::data::{normal_with_outliers, Rng};
use proptest::prelude::*;

/// Random rows with a maximum planted twice (a tie), and some rows with -inf and NaN.
fn rows(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut x = normal_with_outliers(rng, rows * vocab, 1.0);
    for row in x.chunks_mut(vocab) {
        let (a, b) = (rng.below(vocab), rng.below(vocab));
        let top = row.iter().copied().fold(f32::MIN, f32::max) + 1.0;
        row[a] = top;
        row[b] = top;
        if rng.below(3) == 0 {
            row[rng.below(vocab)] = f32::NAN;
            row[rng.below(vocab)] = f32::NEG_INFINITY;
        }
    }
    x
}

fn rows_argmax<R: Runtime>(client: &ComputeClient<R>) {
    let width = prop_oneof![1usize..=600, Just(163_840usize)];
    run_cases(
        24,
        &(1usize..=5, width, any::<u64>()),
        |(n, vocab, seed)| {
            let mut rng = Rng::new(seed);
            let x = rows(&mut rng, n, vocab);
            let out = DeviceArray::filled(client, n, u32::MAX - 1);
            argmax_rows(client, &DeviceArray::upload(client, &x), n, vocab, &out).unwrap();
            prop_assert_eq!(out.read(client), argmax::argmax_rows(&x, vocab));
            Ok(())
        },
    );
}

fn rows_without_numbers_and_bad_shapes<R: Runtime>(client: &ComputeClient<R>) {
    let x = [
        f32::NAN,
        f32::NAN,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        1.0,
        f32::INFINITY,
    ];
    let out = DeviceArray::filled(client, 3, u32::MAX - 1);
    argmax_rows(client, &DeviceArray::upload(client, &x), 3, 2, &out).unwrap();
    assert_eq!(out.read(client), vec![0, 0, 1]);
    let err = argmax_rows(client, &DeviceArray::upload(client, &x), 2, 2, &out);
    assert!(
        matches!(err, Err(KernelError::Length { what: "logits", .. })),
        "{err:?}"
    );
    let err = argmax_rows(client, &DeviceArray::upload(client, &x), 0, 6, &out);
    assert!(
        matches!(err, Err(KernelError::Range { what: "rows", .. })),
        "{err:?}"
    );
}

kiln_backends::backend_tests! {
    rows_argmax,
    rows_without_numbers_and_bad_shapes,
}
