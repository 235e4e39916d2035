//! The model's glue kernels (RMSNorm with and without the fused residual add, SwiGLU's
//! activation, embedding lookup, YaRN RoPE) against the reference, on every backend, with
//! proptest over odd sizes and values with outliers.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::activation::silu_mul;
use kiln_kernels::embedding::embedding;
use kiln_kernels::fill::{fill_random_bits, fill_random_records, Field};
use kiln_kernels::rmsnorm::{add_rmsnorm, rmsnorm, rmsnorm_prefix};
use kiln_kernels::rope::{rope_inplace, RopeLayout};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::activation::silu_and_mul;
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{bf16_decode, bf16_encode, pack_u16_words};
use kiln_reference::norm;
use kiln_reference::rope::{apply_interleaved, cos_sin_scale, inv_freq, YarnConfig};
use kiln_reference::tolerance::{compare, rope_allowed, swiglu_allowed, DType, Tolerance};
use proptest::prelude::*;

/// `rows x cols` RMSNorm, plain and fused with a residual add: odd and vector-sized rows,
/// and rows long enough that every unit handles several vectors (Kimi's 7168) or scalars.
fn rmsnorm_rows<R: Runtime>(client: &ComputeClient<R>) {
    let cols = prop_oneof![1usize..=300, prop::sample::select(vec![4097usize, 7168])];
    run_cases(
        24,
        &(1usize..=6, cols, any::<u64>(), any::<bool>()),
        |(rows, cols, seed, fused)| {
            let mut rng = Rng::new(seed);
            let x = normal_with_outliers(&mut rng, rows * cols, 1.0);
            let delta = normal_with_outliers(&mut rng, rows * cols, 0.5);
            let w = normal_with_outliers(&mut rng, cols, 1.0);
            let (x_dev, w_dev) = (
                DeviceArray::upload(client, &x),
                DeviceArray::upload(client, &w),
            );
            let out = DeviceArray::filled(client, rows * cols, f32::NAN);
            let input: Vec<f32> = if fused {
                let d = DeviceArray::upload(client, &delta);
                add_rmsnorm(client, &x_dev, &d, rows, &w_dev, 1e-6, &out).unwrap();
                let summed: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
                prop_assert_eq!(x_dev.read(client), summed.clone(), "residual not updated");
                summed
            } else {
                rmsnorm(client, &x_dev, rows, &w_dev, 1e-6, &out).unwrap();
                x.clone()
            };
            let expected = norm::rmsnorm(&input, &w, 1e-6);
            let tol = Tolerance::dot(cols + 4, DType::F32, DType::F32);
            let magnitude: Vec<f64> = expected.iter().map(|e| e.abs()).collect();
            let cmp = compare(
                &out.read(client),
                &expected,
                &tol.allowed_all(&expected, &magnitude),
            );
            prop_assert!(cmp.passed(), "{rows}x{cols}: {cmp}");
            Ok(())
        },
    );
}

/// MLA's compressed KV rows: the 512 latent values normalised, the 64 rope values copied.
fn rmsnorm_prefix_of_kv_rows<R: Runtime>(client: &ComputeClient<R>) {
    let (rows, stride, cols) = (3, 576, 512);
    let mut rng = Rng::new(5);
    let x = normal_with_outliers(&mut rng, rows * stride, 1.0);
    let w = normal_with_outliers(&mut rng, cols, 1.0);
    let out = DeviceArray::filled(client, rows * stride, f32::NAN);
    rmsnorm_prefix(
        client,
        &DeviceArray::upload(client, &x),
        rows,
        stride,
        &DeviceArray::upload(client, &w),
        1e-6,
        &out,
    )
    .unwrap();
    let got = out.read(client);
    let latent: Vec<f32> = x.chunks(stride).flat_map(|r| r[..cols].to_vec()).collect();
    let expected = norm::rmsnorm(&latent, &w, 1e-6);
    let magnitude: Vec<f64> = expected.iter().map(|e| e.abs()).collect();
    let got_latent: Vec<f32> = got
        .chunks(stride)
        .flat_map(|r| r[..cols].to_vec())
        .collect();
    let tol = Tolerance::dot(cols + 4, DType::F32, DType::F32);
    let cmp = compare(
        &got_latent,
        &expected,
        &tol.allowed_all(&expected, &magnitude),
    );
    assert!(cmp.passed(), "{cmp}");
    for r in 0..rows {
        assert_eq!(
            got[r * stride + cols..(r + 1) * stride],
            x[r * stride + cols..(r + 1) * stride]
        );
    }
}

fn silu_and_mul_rows<R: Runtime>(client: &ComputeClient<R>) {
    // Pinned: a gate far in the negative tail, whose sigmoid llvmpipe flushes to zero.
    silu_and_mul_case(client, 1, 103, 3694268016568392736).unwrap();
    run_cases(
        24,
        &(1usize..=5, 1usize..=200, any::<u64>()),
        |(rows, inter, seed)| silu_and_mul_case(client, rows, inter, seed),
    );
}

fn silu_and_mul_case<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    inter: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let gate = normal_with_outliers(&mut rng, rows * inter, 2.0);
    let up = normal_with_outliers(&mut rng, rows * inter, 1.0);
    let out = DeviceArray::filled(client, rows * inter, f32::NAN);
    silu_mul(
        client,
        &DeviceArray::upload(client, &gate),
        &DeviceArray::upload(client, &up),
        &out,
    )
    .unwrap();
    let side_by_side: Vec<f32> = gate
        .chunks(inter)
        .zip(up.chunks(inter))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect();
    let expected = silu_and_mul(&side_by_side, inter);
    let allowed: Vec<f64> = (gate.iter().zip(&expected))
        .map(|(&g, &e)| swiglu_allowed(g as f64, e))
        .collect();
    let cmp = compare(&out.read(client), &expected, &allowed);
    prop_assert!(cmp.passed(), "{cmp}");
    Ok(())
}

fn embedding_rows<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(1usize..=40, 1usize..=150, 1usize..=9, any::<u64>()),
        |(vocab, half_hidden, tokens, seed)| {
            let hidden = 2 * half_hidden;
            let mut rng = Rng::new(seed);
            let table: Vec<u16> = normal_with_outliers(&mut rng, vocab * hidden, 1.0)
                .iter()
                .map(|&v| bf16_encode(v))
                .collect();
            let ids: Vec<u32> = (0..tokens).map(|_| rng.below(vocab) as u32).collect();
            let out = DeviceArray::filled(client, tokens * hidden, f32::NAN);
            let table_dev = DeviceArray::upload(client, &pack_u16_words(&table));
            embedding(
                client,
                &table_dev,
                vocab,
                hidden,
                &DeviceArray::upload(client, &ids),
                &out,
            )
            .unwrap();
            let expected: Vec<f32> = ids
                .iter()
                .flat_map(|&t| {
                    table[t as usize * hidden..(t as usize + 1) * hidden]
                        .iter()
                        .map(|&b| bf16_decode(b))
                })
                .collect();
            prop_assert_eq!(out.read(client), expected);
            Ok(())
        },
    );
}

/// q-like rows (several heads per token, rope dims at an offset) and k-like rows, with
/// Kimi's YaRN settings and positions up to 100k.
fn rope_rows<R: Runtime>(client: &ComputeClient<R>) {
    let strategy = (
        1usize..=5,
        1usize..=4,
        prop::sample::select(vec![(192usize, 128usize), (576, 512), (6, 2)]),
        any::<u64>(),
    );
    run_cases(24, &strategy, |(tokens, heads, (stride, offset), seed)| {
        let rope_dim = (stride - offset).min(64);
        let cfg = YarnConfig::kimi_k2();
        let mut rng = Rng::new(seed);
        let x = normal_with_outliers(&mut rng, tokens * heads * stride, 1.0);
        let positions: Vec<u32> = (0..tokens).map(|_| rng.below(100_000) as u32).collect();
        let freqs: Vec<f32> = inv_freq(rope_dim, &cfg).iter().map(|&f| f as f32).collect();
        let scale = cos_sin_scale(&cfg);
        let x_dev = DeviceArray::upload(client, &x);
        let layout = RopeLayout {
            tokens,
            rows_per_token: heads,
            row_stride: stride,
            offset,
            rope_dim,
        };
        let pos_dev = DeviceArray::upload(client, &positions);
        rope_inplace(
            client,
            &x_dev,
            layout,
            &pos_dev,
            &DeviceArray::upload(client, &freqs),
            scale as f32,
        )
        .unwrap();
        let rope_part: Vec<f32> = x
            .chunks(stride)
            .flat_map(|r| r[offset..offset + rope_dim].to_vec())
            .collect();
        let pos_usize: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        let expected_rope = apply_interleaved(&rope_part, &pos_usize, rope_dim, &cfg);
        let actual = x_dev.read(client);
        let (mut got, mut want, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
        for (r, row) in actual.chunks(stride).enumerate() {
            let pos = positions[r / heads] as usize;
            for d in 0..stride {
                got.push(row[d]);
                if d >= offset && d < offset + rope_dim {
                    let e = expected_rope[r * rope_dim + d - offset];
                    let pair = (d - offset) / 2 * 2 + offset;
                    let mag = (x[r * stride + pair].abs() + x[r * stride + pair + 1].abs()) as f64;
                    want.push(e);
                    allowed.push(rope_allowed(pos, mag, scale, e, DType::F32, DType::F32));
                } else {
                    want.push(x[r * stride + d] as f64);
                    allowed.push(0.0);
                }
            }
        }
        let cmp = compare(&got, &want, &allowed);
        prop_assert!(cmp.passed(), "{cmp}");
        Ok(())
    });
}

/// Synthetic-model fill: every word obeys the masks, and the bits vary.
fn random_fill_respects_masks<R: Runtime>(client: &ComputeClient<R>) {
    let buf = DeviceArray::<u32>::uninit(client, 10_007);
    fill_random_bits(client, &buf, 42, 0x0f0f_0f0f, 0x3030_3030).unwrap();
    let words = buf.read(client);
    assert!(words.iter().all(|w| w & !0x0f0f_0f0f == 0x3030_3030));
    let distinct: std::collections::HashSet<u32> = words.iter().copied().collect();
    assert!(
        distinct.len() > 9_000,
        "only {} distinct words",
        distinct.len()
    );
    let again = DeviceArray::<u32>::uninit(client, 10_007);
    fill_random_bits(client, &again, 43, u32::MAX, 0).unwrap();
    assert_ne!(again.read(client), words, "another seed gives other bits");
}

/// A record field (the scale words of fp8 KV rows: 164 words, 128..132 powers of two)
/// takes its own masks; every other word is what `fill_random_bits` gives it; a zero
/// period is a typed error.
fn record_fill_masks_its_field<R: Runtime>(client: &ComputeClient<R>) {
    let (masks, field) = (
        (0x3fbf_3fbf, 0x3c00_3c00),
        Field {
            period: 164,
            words: 128..132,
            and_mask: 0x0380_0000,
            or_mask: 0x3c00_0000,
        },
    );
    let records = DeviceArray::<u32>::uninit(client, 164 * 61 + 7);
    fill_random_records(client, &records, 9, masks, &field).unwrap();
    let plain = DeviceArray::<u32>::uninit(client, records.len());
    fill_random_bits(client, &plain, 9, masks.0, masks.1).unwrap();
    let (records, plain) = (records.read(client), plain.read(client));
    let mut exponents = std::collections::HashSet::new();
    for (i, (&w, &p)) in records.iter().zip(&plain).enumerate() {
        if (128..132).contains(&(i % 164)) {
            assert_eq!(w & !0x0380_0000, 0x3c00_0000, "word {i}: a power of two");
            exponents.insert(w >> 23);
        } else {
            assert_eq!(w, p, "word {i}");
        }
    }
    assert_eq!(exponents.len(), 8, "every exponent 120..127 shows up");
    assert_eq!(
        field.masks_of(164 * 3 + 131, masks),
        (0x0380_0000, 0x3c00_0000)
    );
    assert_eq!(field.masks_of(164 * 3 + 132, masks), masks);
    let none = Field { period: 0, ..field };
    assert!(matches!(
        fill_random_records(client, &DeviceArray::uninit(client, 4), 9, masks, &none),
        Err(KernelError::Range { .. })
    ));
}

fn bad_shapes_are_typed_errors<R: Runtime>(client: &ComputeClient<R>) {
    let x = DeviceArray::upload(client, &[1.0f32; 12]);
    let w = DeviceArray::upload(client, &[1.0f32; 5]);
    let out = DeviceArray::filled(client, 12, f32::NAN);
    assert!(matches!(
        rmsnorm(client, &x, 2, &w, 1e-6, &out),
        Err(KernelError::Length { .. })
    ));
    let table = DeviceArray::upload(client, &[0u32; 6]);
    let ids = DeviceArray::upload(client, &[0u32]);
    assert_eq!(
        embedding(client, &table, 4, 3, &ids, &out).unwrap_err(),
        KernelError::Alignment {
            what: "hidden (bf16 table)",
            value: 3,
            multiple: 2
        }
    );
    let layout = RopeLayout {
        tokens: 2,
        rows_per_token: 1,
        row_stride: 6,
        offset: 4,
        rope_dim: 4,
    };
    let freqs = DeviceArray::upload(client, &[1.0f32; 2]);
    assert!(matches!(
        rope_inplace(client, &x, layout, &ids, &freqs, 1.0),
        Err(KernelError::Range { .. })
    ));
}

kiln_backends::backend_tests! {
    rmsnorm_rows,
    rmsnorm_prefix_of_kv_rows,
    silu_and_mul_rows,
    embedding_rows,
    rope_rows,
    random_fill_respects_masks,
    record_fill_masks_its_field,
    bad_shapes_are_typed_errors,
}
