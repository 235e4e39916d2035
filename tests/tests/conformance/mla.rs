//! MLA attention conformance on every enabled backend: proptest over heads (odd), page
//! sizes (1, odd, the kernel's chunk), ragged batches (q_len from 1 to the whole context,
//! kv_len not a multiple of the page or chunk), both KV formats and both tilings.
use crate::cases::{reports_pass, run_cases};
use cubecl::prelude::*;
use kiln_conformance::mla::{run_mla, AttnMode, MlaCase};
use kiln_kernels::mla::{
    absorb_query, absorbs_on_tensor_cores, mla_decode, mla_prefill, project_values, write_kv,
    write_kv_normed, AttnMetadata, KvBShape, KvFormat, KvRowPrep, PagedKvCache, PAD_SLOT,
};
use kiln_kernels::rope::Rotation;
use kiln_kernels::Precision;
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::absorb::{self, KvB};
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{bf16_decode, bf16_encode};
use kiln_reference::formats::{bf16_round, pack_u16_words};
use kiln_reference::mla::{fp8_row_decode, fp8_row_encode, fp8_tile_scale};
use kiln_reference::norm;
use kiln_reference::rope::{apply_interleaved, cos_sin_scale, inv_freq, YarnConfig};
use kiln_reference::tolerance::{compare, rope_allowed, DType, Tolerance};
use proptest::prelude::*;

fn formats() -> impl Strategy<Value = KvFormat> {
    prop_oneof![
        Just(KvFormat::F32),
        Just(KvFormat::Bf16),
        Just(KvFormat::Fp8)
    ]
}

/// Requests as (q_len, kv_len) with q_len <= max_q (and <= kv_len).
fn requests(max_q: usize, max_kv: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::vec(
        (1usize..=max_kv).prop_flat_map(move |kv| (1usize..=kv.min(max_q), Just(kv))),
        1..=3,
    )
}

pub(crate) fn cases(mode: AttnMode, max_q: usize) -> impl Strategy<Value = MlaCase> {
    (
        1usize..=3,
        prop::sample::select(vec![1usize, 7, 16, 64]),
        requests(max_q, 150),
        formats(),
        any::<u64>(),
    )
        .prop_map(move |(heads, page_size, reqs, format, seed)| MlaCase {
            heads,
            page_size,
            q_lens: reqs.iter().map(|r| r.0).collect(),
            kv_lens: reqs.iter().map(|r| r.1).collect(),
            format,
            mode,
            seed,
            huge_tile: false,
            tree: false,
        })
}

fn mla_cases<R: Runtime>(client: &ComputeClient<R>, strategy: impl Strategy<Value = MlaCase>) {
    reports_pass(16, &strategy, |case| run_mla(client, case, false));
}

fn decode<R: Runtime>(client: &ComputeClient<R>) {
    mla_cases(client, cases(AttnMode::Decode, 5));
}

fn prefill<R: Runtime>(client: &ComputeClient<R>) {
    mla_cases(client, cases(AttnMode::Prefill, 150));
}

/// Draft trees as the last queries of each request (random shapes, up to 32 nodes, after
/// plain queries where q_len passes the 32-query mask window), both tilings and formats.
fn trees<R: Runtime>(client: &ComputeClient<R>) {
    for (mode, max_q) in [(AttnMode::Decode, 40), (AttnMode::Prefill, 60)] {
        mla_cases(
            client,
            cases(mode, max_q).prop_map(|case| MlaCase { tree: true, ..case }),
        );
    }
}

/// Trees at Kimi's 64 heads (the 64-row tensor-core cube) and fewer (the 16-row one),
/// both KV formats, over a few chunks.
fn kimi_trees<R: Runtime>(client: &ComputeClient<R>) {
    for (heads, q_lens, kv_lens, format) in [
        (64, vec![16, 1], vec![300, 129], KvFormat::Bf16),
        (64, vec![8, 12], vec![97, 1000], KvFormat::Fp8),
        (8, vec![32, 3], vec![260, 40], KvFormat::Bf16),
        (4, vec![40, 5], vec![333, 5], KvFormat::Fp8),
    ] {
        let case = MlaCase {
            heads,
            page_size: 64,
            q_lens,
            kv_lens,
            format,
            mode: AttnMode::Decode,
            seed: 12,
            huge_tile: false,
            tree: true,
        };
        run_mla(client, &case, false).unwrap().assert_passed();
    }
}

/// Kimi's 64 heads over a few chunks, a draft-verification step of 16 query tokens, and
/// the 64-row cube (both KV formats) with rows of two tokens, two groups per token (128
/// heads: DeepSeek-V3) and a partial last group; fp8 tiles with scales past 2^7 in both
/// tensor-core kernels. On an H200 the 64-head pairs split 4 to 16 ways, so the combine
/// runs past 64 rows with 2 and with 4 split lanes.
fn kimi_shapes<R: Runtime>(client: &ComputeClient<R>) {
    for (heads, q_lens, kv_lens, format, huge_tile) in [
        (64, vec![1, 1], vec![200, 129], KvFormat::Bf16, false),
        (64, vec![2, 1], vec![97, 300], KvFormat::Bf16, false),
        (128, vec![1, 1, 1], vec![70, 1, 300], KvFormat::Bf16, false),
        (8, vec![9, 3], vec![40, 5], KvFormat::Bf16, false),
        (128, vec![1, 2], vec![70, 300], KvFormat::Fp8, false),
        (8, vec![9, 3], vec![40, 5], KvFormat::Fp8, false),
        (64, vec![1], vec![333], KvFormat::Fp8, false),
        (4, vec![16, 3], vec![260, 3], KvFormat::Bf16, false),
        (64, vec![1, 1], vec![333, 70], KvFormat::Fp8, true),
        (16, vec![1, 2], vec![300, 41], KvFormat::Fp8, true),
        (64, vec![1, 1], vec![1000, 900], KvFormat::Bf16, false),
    ] {
        let case = MlaCase {
            heads,
            page_size: 64,
            q_lens,
            kv_lens,
            format,
            mode: AttnMode::Decode,
            seed: 11,
            huge_tile,
            tree: false,
        };
        run_mla(client, &case, false).unwrap().assert_passed();
    }
}

/// One long context: on CUDA the tensor-core kernel's split machinery (on an H200: 264
/// splits of 4 chunks, so every pass of the combine and the KV ring's wrap); on wgpu one
/// cube walking all 33,000 positions, past where llvmpipe's cap on loop trips (65,535 per
/// invocation) used to end the portable kernel's loops (~5,000 positions).
fn long_context_splits<R: Runtime>(client: &ComputeClient<R>) {
    let case = MlaCase {
        heads: 16,
        page_size: 64,
        q_lens: vec![1],
        kv_lens: vec![33_000],
        format: KvFormat::Bf16,
        mode: AttnMode::Decode,
        seed: 11,
        huge_tile: false,
        tree: false,
    };
    run_mla(client, &case, false).unwrap().assert_passed();
}

fn bad_metadata_is_a_typed_error<R: Runtime>(client: &ComputeClient<R>) {
    let heads = 2;
    let meta = |max_q_len: usize| AttnMetadata {
        batch: 1,
        num_tokens: max_q_len,
        max_q_len,
        max_kv_len: max_q_len,
        cu_q_lens: DeviceArray::upload(client, &[0u32, max_q_len as u32]),
        kv_lens: DeviceArray::upload(client, &[max_q_len as u32]),
        block_table: DeviceArray::upload(client, &[0u32, 1]),
        max_blocks: 2,
        tree_masks: None,
    };
    let cache = PagedKvCache {
        data: DeviceArray::upload(client, &vec![0x3f80_3f80u32; 2 * 64 * 288]),
        format: KvFormat::Bf16,
        page_size: 64,
        num_pages: 2,
    };
    let q = DeviceArray::upload(client, &vec![0.5f32; 65 * heads * 576]);
    let out = DeviceArray::filled(client, 65 * heads * 512, f32::NAN);
    // Decode takes at most 64 query tokens per request.
    assert!(matches!(
        mla_decode(
            client,
            &q,
            heads,
            &cache,
            &meta(65),
            0.1,
            &out,
            Precision::Bf16
        ),
        Err(KernelError::Range {
            what: "query tokens per request (decode)",
            ..
        })
    ));
    // Query buffer disagrees with num_tokens * heads * 576.
    assert_eq!(
        mla_prefill(
            client,
            &q,
            heads,
            &cache,
            &meta(3),
            0.1,
            &out,
            Precision::Bf16
        ),
        Err(KernelError::Length {
            what: "queries",
            expected: 3 * heads * 576,
            got: 65 * heads * 576
        })
    );
    // Tree masks: one word per query token.
    let q3 = DeviceArray::upload(client, &vec![0.5f32; 3 * heads * 576]);
    let masked = AttnMetadata {
        tree_masks: Some(DeviceArray::upload(client, &[1u32, 3])),
        ..meta(3)
    };
    assert_eq!(
        mla_decode(
            client,
            &q3,
            heads,
            &cache,
            &masked,
            0.1,
            &out,
            Precision::Bf16
        ),
        Err(KernelError::Length {
            what: "tree masks",
            expected: 3,
            got: 2
        })
    );
    // A cache whose buffer does not hold num_pages * page_size rows.
    let short = PagedKvCache {
        num_pages: 3,
        ..cache
    };
    assert!(matches!(
        mla_prefill(
            client,
            &q,
            heads,
            &short,
            &meta(65),
            0.1,
            &out,
            Precision::Bf16
        ),
        Err(KernelError::Length {
            what: "KV cache (u32 words)",
            ..
        })
    ));
}

/// A cache of one-row pages filled with a sentinel, and the shuffled rows `tokens` new rows
/// go to; the rest must keep the sentinel.
struct SlotCache {
    cache: PagedKvCache,
    order: Vec<u32>,
    tokens: usize,
}

impl SlotCache {
    const SENTINEL: u32 = 0xdead_beef;

    fn new<R: Runtime>(
        client: &ComputeClient<R>,
        rng: &mut Rng,
        tokens: usize,
        spare: usize,
        format: KvFormat,
    ) -> Self {
        let rows = tokens + spare;
        let mut order: Vec<u32> = (0..rows as u32).collect();
        rng.shuffle(&mut order);
        let cache = PagedKvCache {
            data: DeviceArray::filled(client, rows * format.words_per_row(), Self::SENTINEL),
            format,
            page_size: 1,
            num_pages: rows,
        };
        Self {
            cache,
            order,
            tokens,
        }
    }

    /// The new rows' slots, then `pads` padding rows' ([`PAD_SLOT`]: written nowhere), on
    /// the device.
    fn slots<R: Runtime>(&self, client: &ComputeClient<R>, pads: usize) -> DeviceArray<u32> {
        let mut slots = self.order[..self.tokens].to_vec();
        slots.extend(std::iter::repeat_n(PAD_SLOT, pads));
        DeviceArray::upload(client, &slots)
    }

    /// The new rows' words in token order, once every other row is seen to be untouched.
    fn new_rows<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
    ) -> Result<Vec<Vec<u32>>, TestCaseError> {
        let data = self.cache.data.read(client);
        let words = self.cache.format.words_per_row();
        let row = |slot: u32| &data[slot as usize * words..(slot as usize + 1) * words];
        for &slot in &self.order[self.tokens..] {
            prop_assert!(
                row(slot).iter().all(|&w| w == Self::SENTINEL),
                "row {slot} was overwritten"
            );
        }
        Ok(self.order[..self.tokens]
            .iter()
            .map(|&slot| row(slot).to_vec())
            .collect())
    }
}

/// New rows land in exactly their slots, bit-exact with the reference's bf16 and fp8
/// encodings (tiles of tiny and of huge values included); padding rows land nowhere and
/// every other row keeps its contents.
fn cache_writes<R: Runtime>(client: &ComputeClient<R>) {
    let strategy = (1usize..=9, 1usize..=5, 0usize..=2, formats(), any::<u64>());
    run_cases(16, &strategy, |(tokens, spare, pads, format, seed)| {
        let mut rng = Rng::new(seed);
        let target = SlotCache::new(client, &mut rng, tokens, spare, format);
        let mut kv = normal_with_outliers(&mut rng, (tokens + pads) * 576, 1.0);
        kv[..64].iter_mut().for_each(|v| *v *= 1e-4); // codes deep in the E4M3 subnormals
        kv[128..256].iter_mut().for_each(|v| *v *= 1e6); // a scale of 2^12 or more
        write_kv(
            client,
            &DeviceArray::upload(client, &kv),
            &target.slots(client, pads),
            &target.cache,
        )
        .unwrap();
        for (t, row) in target.new_rows(client)?.iter().enumerate() {
            let x = &kv[t * 576..(t + 1) * 576];
            match format {
                KvFormat::F32 => {
                    let want: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
                    prop_assert_eq!(row.as_slice(), want.as_slice());
                }
                KvFormat::Bf16 => {
                    for (i, &w) in row.iter().enumerate() {
                        let want =
                            bf16_encode(x[2 * i]) as u32 | (bf16_encode(x[2 * i + 1]) as u32) << 16;
                        prop_assert_eq!(w, want, "token {} word {}", t, i);
                    }
                }
                KvFormat::Fp8 => {
                    let bytes: Vec<u8> = row.iter().flat_map(|w| w.to_le_bytes()).collect();
                    prop_assert_eq!(bytes, fp8_row_encode(x).to_vec(), "token {}", t);
                }
            }
        }
        Ok(())
    });
}

/// Rows straight from the `kv_a` projection: the cache holds the reference's RMSNorm of the
/// latent and rotation of the rope part (Kimi's YaRN, positions up to 200k), within the f32
/// chain's bound plus the storage format's rounding (fp8: at up to twice the reference's
/// tile scale, as a tile whose amax sits on a scale boundary may round either way); padding
/// rows land nowhere and other rows keep their contents.
fn normed_cache_writes<R: Runtime>(client: &ComputeClient<R>) {
    let strategy = (1usize..=9, 1usize..=3, 0usize..=2, formats(), any::<u64>());
    run_cases(16, &strategy, |(tokens, spare, pads, format, seed)| {
        let mut rng = Rng::new(seed);
        let target = SlotCache::new(client, &mut rng, tokens, spare, format);
        let mut kv_a = normal_with_outliers(&mut rng, (tokens + pads) * 576, 1.0);
        kv_a[128..256].iter_mut().for_each(|v| *v *= 1e3); // one tile far above the rest
        let norm = normal_with_outliers(&mut rng, 512, 1.0);
        let positions: Vec<u32> = (0..tokens + pads)
            .map(|_| rng.below(200_000) as u32)
            .collect();
        let cfg = YarnConfig::kimi_k2();
        let freqs: Vec<f32> = inv_freq(64, &cfg).iter().map(|&f| f as f32).collect();
        let rope_scale = cos_sin_scale(&cfg);
        let eps = 1e-6;
        let (norm_dev, pos_dev) = (
            DeviceArray::upload(client, &norm),
            DeviceArray::upload(client, &positions),
        );
        let freqs_dev = DeviceArray::upload(client, &freqs);
        let prep = KvRowPrep {
            norm: &norm_dev,
            eps,
            rope: Rotation {
                positions: &pos_dev,
                inv_freq: &freqs_dev,
                scale: rope_scale as f32,
            },
        };
        write_kv_normed(
            client,
            &DeviceArray::upload(client, &kv_a),
            &prep,
            &target.slots(client, pads),
            &target.cache,
        )
        .unwrap();
        let chain = Tolerance::dot(512 + 4, DType::F32, DType::F32);
        let (mut got, mut want, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
        for (t, row) in target.new_rows(client)?.iter().enumerate() {
            let x = &kv_a[t * 576..(t + 1) * 576];
            let latent = norm::rmsnorm(&x[..512], &norm, eps);
            let pos = positions[t] as usize;
            let rope = apply_interleaved(&x[512..], &[pos], 64, &cfg);
            let stored: Vec<f32> = match format {
                KvFormat::F32 => row.iter().map(|&w| f32::from_bits(w)).collect(),
                KvFormat::Bf16 => row
                    .iter()
                    .flat_map(|&w| [bf16_decode(w as u16), bf16_decode((w >> 16) as u16)])
                    .collect(),
                KvFormat::Fp8 => {
                    let bytes: Vec<u8> = row.iter().flat_map(|w| w.to_le_bytes()).collect();
                    fp8_row_decode(&bytes).to_vec()
                }
            };
            // (unit roundoff, absolute floor) of the stored latent and rope values.
            let (latent_out, rope_out) = match format {
                KvFormat::F32 => ((0.0, 0.0), (0.0, 0.0)),
                KvFormat::Bf16 => (bf16_rounding(), bf16_rounding()),
                // fp8's floor is per tile, below.
                KvFormat::Fp8 => ((DType::E4M3.unit_roundoff(), 0.0), bf16_rounding()),
            };
            for (i, &e) in latent.iter().enumerate() {
                let err = chain.allowed(e, e.abs());
                let mut floor = latent_out.1;
                if format == KvFormat::Fp8 {
                    let tile = &latent[i / 128 * 128..(i / 128 + 1) * 128];
                    let amax = tile.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    // Half a subnormal step (2^-9 of the scale) at twice the scale.
                    floor = fp8_tile_scale(amax as f32) as f64 * 2f64.powi(-9);
                }
                got.push(stored[i]);
                want.push(e);
                allowed.push(err + latent_out.0 * (e.abs() + err) + floor);
            }
            for (i, &e) in rope.iter().enumerate() {
                let pair = i / 2 * 2;
                let mag = (x[512 + pair].abs() + x[512 + pair + 1].abs()) as f64;
                let err = rope_allowed(pos, mag, rope_scale, e, DType::F32, DType::F32);
                got.push(stored[512 + i]);
                want.push(e);
                allowed.push(err + rope_out.0 * (e.abs() + err) + rope_out.1);
            }
        }
        let cmp = compare(&got, &want, &allowed);
        prop_assert!(cmp.passed(), "{format:?}: {cmp}");
        Ok(())
    });
}

/// bf16 storage: half a unit in the last place, and the smallest normal as the floor.
fn bf16_rounding() -> (f64, f64) {
    (DType::BF16.unit_roundoff(), DType::BF16.smallest_normal())
}

/// Absorbed queries and value projections against the reference at both precisions, Kimi's
/// nope/v = 128, odd small splits, and splits the tensor-core path takes with a partial K
/// step (nope 48) and two column tiles of values (v 136); more than 64 tokens cross a token
/// tile. The queries' rope parts are rotated on the way (Kimi's YaRN, positions up to 200k).
fn absorption<R: Runtime>(client: &ComputeClient<R>) {
    let strategy = (
        prop::sample::select(vec![1usize, 3, 70]),
        1usize..=4,
        prop::sample::select(vec![(128usize, 128usize), (7, 5), (16, 3), (48, 136)]),
        any::<u64>(),
    );
    run_cases(12, &strategy, |(tokens, heads, (nope, v), seed)| {
        let mut rng = Rng::new(seed);
        let w: Vec<f32> = normal_with_outliers(&mut rng, heads * (nope + v) * 512, 0.05)
            .iter()
            .map(|&x| bf16_round(x))
            .collect();
        let bits: Vec<u16> = w.iter().map(|&x| bf16_encode(x)).collect();
        let kv_b = DeviceArray::upload(client, &pack_u16_words(&bits));
        let shape = KvBShape { heads, nope, v };
        let kvb = KvB {
            weight: &w,
            heads,
            nope,
            v,
            kv_lora: 512,
        };
        let q = normal_with_outliers(&mut rng, tokens * heads * (nope + 64), 1.0);
        let latent = normal_with_outliers(&mut rng, tokens * heads * 512, 1.0);
        let (mut want_q, mag_q) = absorb::absorb_query(&q, &kvb, 64);
        let (want_v, mag_v) = absorb::project_values(&latent, &kvb);
        let cfg = YarnConfig::kimi_k2();
        let positions: Vec<u32> = (0..tokens).map(|_| rng.below(200_000) as u32).collect();
        let pos_usize: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        let q_pe: Vec<f32> = q
            .chunks(nope + 64)
            .flat_map(|r| r[nope..].to_vec())
            .collect();
        let rotated = apply_interleaved(&q_pe, &pos_usize, 64, &cfg);
        let rope_scale = cos_sin_scale(&cfg);
        // Where each row's rope part sits in the output, and its bound.
        let mut rope_bound = vec![None; want_q.len()];
        for (r, row) in q_pe.chunks(64).enumerate() {
            let pos = pos_usize[r / heads];
            for i in 0..64 {
                let e = rotated[r * 64 + i];
                let mag = (row[i / 2 * 2].abs() + row[i / 2 * 2 + 1].abs()) as f64;
                want_q[r * 576 + 512 + i] = e;
                rope_bound[r * 576 + 512 + i] = Some(rope_allowed(
                    pos,
                    mag,
                    rope_scale,
                    e,
                    DType::F32,
                    DType::F32,
                ));
            }
        }
        let freqs: Vec<f32> = inv_freq(64, &cfg).iter().map(|&f| f as f32).collect();
        let (pos_dev, freqs_dev) = (
            DeviceArray::upload(client, &positions),
            DeviceArray::upload(client, &freqs),
        );
        let rope = Rotation {
            positions: &pos_dev,
            inv_freq: &freqs_dev,
            scale: rope_scale as f32,
        };
        let (q, latent) = (
            DeviceArray::upload(client, &q),
            DeviceArray::upload(client, &latent),
        );
        for precision in [Precision::Exact, Precision::Bf16] {
            // The tensor-core path rounds the activations to bf16.
            let rounding = |tol: Tolerance| {
                if absorbs_on_tensor_cores(client, shape, precision) {
                    tol.with_operands(DType::BF16)
                } else {
                    tol
                }
            };
            let out = DeviceArray::filled(client, tokens * heads * 576, f32::NAN);
            absorb_query(client, &q, tokens, &kv_b, shape, &rope, &out, precision).unwrap();
            let tol = rounding(Tolerance::dot(nope, DType::F32, DType::F32));
            let allowed: Vec<f64> = (want_q.iter().zip(&mag_q).zip(&rope_bound))
                .map(|((&e, &m), rope)| rope.unwrap_or_else(|| tol.allowed(e, m)))
                .collect();
            let cmp = compare(&out.read(client), &want_q, &allowed);
            prop_assert!(cmp.passed(), "absorb_query ({precision:?}): {cmp}");

            let values = DeviceArray::filled(client, tokens * heads * v, f32::NAN);
            project_values(client, &latent, tokens, &kv_b, shape, &values, precision).unwrap();
            let tol = rounding(Tolerance::dot(512, DType::F32, DType::F32));
            let cmp = compare(
                &values.read(client),
                &want_v,
                &tol.allowed_all(&want_v, &mag_v),
            );
            prop_assert!(cmp.passed(), "project_values ({precision:?}): {cmp}");
        }
        Ok(())
    });
}

kiln_backends::backend_tests! {
    absorption,
    cache_writes,
    normed_cache_writes,
    decode,
    prefill,
    trees,
    kimi_trees,
    kimi_shapes,
    long_context_splits,
    bad_metadata_is_a_typed_error,
}
