//! MoE routing on the device (router, dispatch sort, gather, combine) against the reference
//! router and plain host arithmetic, on every backend.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::moe::{
    combine, dispatch, gather_rows, route, scatter_rows, Dispatch, GateParams, Routing,
};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::moe_gate::{self, selection_margins, GateConfig};
use kiln_reference::tolerance::{compare, DType, Tolerance};
use proptest::prelude::*;

/// (experts, top-k, groups, kept groups): toy, DeepSeek-V3-like and Kimi-K2 routers.
fn router_shapes() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    prop::sample::select(vec![
        (8, 2, 1, 1),
        (16, 4, 4, 2),
        (24, 3, 8, 3),
        (256, 8, 8, 4),
        (384, 8, 1, 1),
    ])
}

fn router_matches_the_reference<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(router_shapes(), 1usize..=9, any::<bool>(), any::<u64>()),
        |((e, k, g, tg), tokens, norm, seed)| {
            let cfg = GateConfig {
                n_routed_experts: e,
                num_experts_per_tok: k,
                n_group: g,
                topk_group: tg,
                norm_topk_prob: norm,
                routed_scaling_factor: 2.827,
            };
            let mut rng = Rng::new(seed);
            let logits = normal_with_outliers(&mut rng, tokens * e, 2.0);
            let bias = normal_with_outliers(&mut rng, e, 0.3);
            let out = Routing {
                experts: DeviceArray::filled(client, tokens * k, u32::MAX),
                weights: DeviceArray::filled(client, tokens * k, f32::NAN),
            };
            let params = GateParams {
                n_routed_experts: e,
                num_experts_per_tok: k,
                n_group: g,
                topk_group: tg,
                norm_topk_prob: norm,
                routed_scaling_factor: 2.827,
            };
            let (l_dev, b_dev) = (
                DeviceArray::upload(client, &logits),
                DeviceArray::upload(client, &bias),
            );
            route(client, &l_dev, &b_dev, tokens, &params, &out).unwrap();
            let expected = moe_gate::route(&logits, &bias, &cfg);
            let margins = selection_margins(&logits, &bias, &cfg);
            let (ids, weights) = (out.experts.read(client), out.weights.read(client));
            let tol = Tolerance::dot(64, DType::F32, DType::F32);
            let clear = margins.iter().filter(|&&m| m >= 1e-5).count();
            prop_assert!(clear > 0, "every token was a near-tie: nothing checked");
            for t in 0..tokens {
                // A near-tie can flip in f32; the reference says which tokens are clear.
                if margins[t] < 1e-5 {
                    continue;
                }
                let span = t * k..(t + 1) * k;
                let want: Vec<u32> = expected.experts[span.clone()]
                    .iter()
                    .map(|&x| x as u32)
                    .collect();
                prop_assert_eq!(&ids[span.clone()], want.as_slice(), "token {}", t);
                let w = &expected.weights[span.clone()];
                let mag: Vec<f64> = w.iter().map(|x| x.abs()).collect();
                let cmp = compare(&weights[span], w, &tol.allowed_all(w, &mag));
                prop_assert!(cmp.passed(), "token {t}: {cmp}");
            }
            Ok(())
        },
    );
}

/// Dispatch is a stable sort by expert; gather lays tokens out in that order; combine
/// weights each token's rows back together (plus the shared expert).
fn dispatch_gather_combine<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(
            // Up to Kimi's 384 experts: more experts than units, so units own several.
            prop_oneof![1usize..=40, 250usize..=384],
            // Decode batches (one-cube sort) and prefill chunks past 1024 pairs.
            prop_oneof![1usize..=9, 200usize..=1100],
            1usize..=4,
            1usize..=70,
            any::<u64>(),
        ),
        |(experts, tokens, k, cols, seed)| {
            let mut rng = Rng::new(seed);
            let ids: Vec<u32> = (0..tokens * k).map(|_| rng.below(experts) as u32).collect();
            let d = Dispatch {
                offsets: DeviceArray::filled(client, experts + 1, u32::MAX),
                slot: DeviceArray::filled(client, tokens * k, u32::MAX),
                source: DeviceArray::filled(client, tokens * k, u32::MAX),
            };
            dispatch(client, &DeviceArray::upload(client, &ids), experts, k, &d).unwrap();
            let (offsets, slot, source) = (
                d.offsets.read(client),
                d.slot.read(client),
                d.source.read(client),
            );
            // The expected stable order: pairs sorted by (expert, pair index).
            let mut order: Vec<usize> = (0..tokens * k).collect();
            order.sort_by_key(|&a| (ids[a], a));
            for (row, &a) in order.iter().enumerate() {
                prop_assert_eq!(slot[a] as usize, row);
                prop_assert_eq!(source[row] as usize, a / k);
            }
            for e in 0..=experts {
                prop_assert_eq!(
                    offsets[e] as usize,
                    ids.iter().filter(|&&x| (x as usize) < e).count()
                );
            }

            let x = normal_with_outliers(&mut rng, tokens * cols, 1.0);
            let gathered = DeviceArray::filled(client, tokens * k * cols, f32::NAN);
            gather_rows(
                client,
                &DeviceArray::upload(client, &x),
                cols,
                &d.source,
                &gathered,
            )
            .unwrap();
            let g = gathered.read(client);
            for r in 0..tokens * k {
                let t = source[r] as usize;
                prop_assert_eq!(&g[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            }

            let expert_out = normal_with_outliers(&mut rng, tokens * k * cols, 1.0);
            let weights: Vec<f32> = (0..tokens * k).map(|_| rng.uniform_f32() + 0.1).collect();
            let shared = normal_with_outliers(&mut rng, tokens * cols, 1.0);
            let out = DeviceArray::filled(client, tokens * cols, f32::NAN);
            let eo = DeviceArray::upload(client, &expert_out);
            let (w_dev, s_dev) = (
                DeviceArray::upload(client, &weights),
                DeviceArray::upload(client, &shared),
            );
            combine(
                client,
                &eo,
                &d.slot,
                &w_dev,
                Some(&s_dev),
                tokens,
                cols,
                &out,
            )
            .unwrap();
            let (mut want, mut mag) = (Vec::new(), Vec::new());
            for t in 0..tokens {
                for c in 0..cols {
                    let mut acc = shared[t * cols + c] as f64;
                    let mut m = acc.abs();
                    for j in 0..k {
                        let a = t * k + j;
                        let term =
                            weights[a] as f64 * expert_out[slot[a] as usize * cols + c] as f64;
                        acc += term;
                        m += term.abs();
                    }
                    want.push(acc);
                    mag.push(m);
                }
            }
            let tol = Tolerance::dot(k + 1, DType::F32, DType::F32);
            let cmp = compare(&out.read(client), &want, &tol.allowed_all(&want, &mag));
            prop_assert!(cmp.passed(), "{cmp}");
            Ok(())
        },
    );
}

fn bad_router_configs_are_typed_errors<R: Runtime>(client: &ComputeClient<R>) {
    let logits = DeviceArray::upload(client, &[0.5f32; 16]);
    let bias = DeviceArray::upload(client, &[0.0f32; 8]);
    let out = Routing {
        experts: DeviceArray::filled(client, 4, 0u32),
        weights: DeviceArray::filled(client, 4, 0.0f32),
    };
    let ok = GateParams {
        n_routed_experts: 8,
        num_experts_per_tok: 2,
        n_group: 2,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
    };
    route(client, &logits, &bias, 2, &ok, &out).unwrap();
    let too_many = GateParams {
        num_experts_per_tok: 5,
        ..ok
    };
    assert!(matches!(
        route(client, &logits, &bias, 2, &too_many, &out),
        Err(KernelError::Range {
            what: "num_experts_per_tok",
            ..
        })
    ));
    let bad_groups = GateParams { n_group: 3, ..ok };
    assert!(matches!(
        route(client, &logits, &bias, 2, &bad_groups, &out),
        Err(KernelError::Range {
            what: "n_group (divides experts, >= 2 per group)",
            ..
        })
    ));
}

/// Rows scattered to a permutation of a larger buffer's rows (rows no one names keep their
/// poison), odd widths: `out[dest[r]] = x[r]`.
fn scattered_rows_land_where_named<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(1usize..=40, 0usize..=8, 1usize..=300, any::<u64>()),
        |(rows, spare, cols, seed)| {
            let mut rng = Rng::new(seed);
            let mut dest: Vec<u32> = (0..(rows + spare) as u32).collect();
            rng.shuffle(&mut dest);
            dest.truncate(rows);
            let x = normal_with_outliers(&mut rng, rows * cols, 1.0);
            let out = DeviceArray::filled(client, (rows + spare) * cols, f32::NAN);
            let dest_dev = DeviceArray::upload(client, &dest);
            scatter_rows(
                client,
                &DeviceArray::upload(client, &x),
                cols,
                &dest_dev,
                &out,
            )
            .unwrap();
            let got = out.read(client);
            for (r, &d) in dest.iter().enumerate() {
                let d = d as usize;
                prop_assert_eq!(&got[d * cols..(d + 1) * cols], &x[r * cols..(r + 1) * cols]);
            }
            let untouched = (0..rows + spare).filter(|d| !dest.contains(&(*d as u32)));
            for d in untouched {
                prop_assert!(got[d * cols..(d + 1) * cols].iter().all(|v| v.is_nan()));
            }
            Ok(())
        },
    );
}

kiln_backends::backend_tests! {
    scattered_rows_land_where_named,
    router_matches_the_reference,
    dispatch_gather_combine,
    bad_router_configs_are_typed_errors,
}
