//! kiln's speculative tree verification (greedy and stochastic) at Kimi K2's vocabulary
//! (163,840), batch 1, 8 and 64 of 8- and 64-node trees, on CUDA.
//!
//! Inputs: every request has the same tree, breadth-first with wide tops (a node that is
//! its parent's `s`-th child gets `max(1, BRANCH[depth] - s)` children). Each node's target
//! and draft rows put 98.5% of their mass on the same 8 tokens (a geometric profile of random
//! steepness; the draft's masses are the target's times `exp(N(0, 0.5))`, renormalised) and
//! the rest on a hashed background in `[2^-24, 2^-23)`; the rows are built on the device
//! (one hash kernel and a scatter of the top tokens). Stochastic: children are drawn i.i.d.
//! from their parent's draft row, as the verifier's losslessness needs. Greedy: the target's
//! argmax is its top token and the `s`-th child carries the draft's `s`-th token.
//!
//! Each point is first checked against `kiln_reference::tree` (every request, exactly), then
//! timed with `kiln_benches::device_time` (launches queued behind a spin kernel). Stochastic
//! launches rotate over identical copies of the rows (up to 256 MB of the rows launches read,
//! within 16 GB of copies) so that L2 does not hold the next launch's rows.
//!
//! The floor is the bytes the verifier must move over 4.30 TB/s. Stochastic, per request, from
//! the verdict: at every visited node where a child was rejected, its target and draft rows
//! (the residual `relu(r - q)` needs both in full); at the last node, when none of its children
//! was rejected (a leaf), its target row (the bonus is sampled from it); plus the tree, the
//! uniforms and the outputs. Greedy: the tree, the argmax ids and the outputs. The stochastic
//! kernel splits a request's rows over `cubes` cubes (`stochastic_split`: one per SM over the
//! batch); `maxreqRd` (the most bytes one request's walk streams, MB) over that many SMs'
//! bandwidth bounds its time however wide the batch (`maxreqMB`: the most it needs). Where
//! it splits, the same launches also run on one cube per request (`1-cube us`), for the
//! ratio from the same run. Targets (issue 6, at batch 64 and 64 nodes): greedy <= 10 us,
//! stochastic <= 1.3x the floor.
//!
//! Prints a table and writes JSON to the path given as the first argument; `OUT.json MODE
//! BATCH NODES` (`greedy` or `stochastic`) runs that one point alone, e.g. for a profiler.

kiln_benches::cuda_main!(tree::run, "times device kernels on CUDA");

#[cfg(feature = "cuda")]
mod tree {
    use std::time::Duration;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use kiln_benches::device_time::{Client, SpinTimer};
    use kiln_benches::report::{fixed, report};
    use kiln_benches::HBM_BYTES_PER_S;
    use kiln_kernels::tree_verify::{
        stochastic_split, verify_greedy, verify_stochastic_split, TreeBatch, Verdicts,
    };
    use kiln_kernels::DeviceArray;
    use kiln_reference::data::{categorical, Rng};
    use kiln_reference::tree::{self as reference, Tree, Verdict};

    const VOCAB: usize = 163_840;
    const BATCHES: [usize; 3] = [1, 8, 64];
    const NODES: [usize; 2] = [8, 64];
    /// Children of a first child, by depth (deeper nodes: the last entry).
    const BRANCH: [usize; 4] = [4, 3, 2, 2];
    /// Tokens per row that carry [`TOP_MASS`].
    const TOP: usize = 8;
    const TOP_MASS: f64 = 0.985;
    /// Floor bytes the stochastic launches rotate over, and the memory the copies may take.
    const ROTATE_BYTES: f64 = 256e6;
    const COPY_MEMORY: f64 = 16e9;
    const GREEDY_TARGET_US: f64 = 10.0;
    const STOCHASTIC_TARGET_RATIO: f64 = 1.3;

    #[derive(serde::Serialize)]
    struct Row {
        mode: &'static str,
        batch: usize,
        nodes: usize,
        vocab: usize,
        us: f64,
        /// Cubes per request (stochastic: the launcher's split).
        cubes: usize,
        /// Stochastic with a split: the same launches on one cube per request.
        one_cube_us: Option<f64>,
        floor_bytes: f64,
        floor_us: f64,
        ratio_to_floor: f64,
        /// Batch 64, 64 nodes only: greedy <= 10 us, stochastic <= 1.3x the floor.
        meets_target: Option<bool>,
        /// What this kernel streams (stochastic: both rows per rejection).
        streamed_bytes: f64,
        mean_accept_len: f64,
        mean_rejections: f64,
        /// The most row bytes one request needs (stochastic).
        max_request_bytes: f64,
        /// The most row bytes one request's walk streams (stochastic): with the split, its
        /// cubes' share of this is the critical path.
        max_request_streamed_bytes: f64,
        copies: usize,
        launches: usize,
    }

    /// One verification problem on the host: trees, top tokens and masses per row
    /// (`[batch * nodes, TOP]`), uniforms and argmax ids.
    struct Problem {
        batch: usize,
        nodes: usize,
        trees: Vec<Tree>,
        top_tokens: Vec<u32>,
        target_mass: Vec<f32>,
        draft_mass: Vec<f32>,
        uniforms: Vec<f32>,
        argmax: Vec<u32>,
    }

    /// Background entries in `[2^-24, 2^-23)` from a hash of their index.
    #[allow(arithmetic_overflow)]
    #[cube(launch_unchecked)]
    fn background(probs: &mut Array<f32>, seed: u32) {
        let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
        if (i as usize) < probs.len() {
            let mut h = (i ^ seed) * 0x9e37_79b1u32;
            h = (h ^ (h >> 15)) * 0x2c1b_3c6du32;
            h ^= h >> 12;
            probs[i as usize] = f32::reinterpret((h >> 9) | 0x3380_0000u32);
        }
    }

    /// `probs[at[i]] = mass[i]`.
    #[cube(launch_unchecked)]
    fn scatter(probs: &mut Array<f32>, at: &Array<u32>, mass: &Array<f32>) {
        let i = ABSOLUTE_POS;
        if i < at.len() {
            let to = at[i] as usize;
            probs[to] = mass[i];
        }
    }

    /// Breadth-first tree of `nodes` nodes (see the module docs).
    fn tree_shape(nodes: usize) -> Vec<i32> {
        let (mut parents, mut rank, mut depth) = (vec![-1i32], vec![0usize], vec![0usize]);
        let mut next = 0;
        while parents.len() < nodes {
            let d = depth[next];
            let children = BRANCH[d.min(BRANCH.len() - 1)]
                .saturating_sub(rank[next])
                .max(1);
            for s in 0..children.min(nodes - parents.len()) {
                parents.push(next as i32);
                rank.push(s);
                depth.push(d + 1);
            }
            next += 1;
        }
        parents
    }

    fn normalised(w: &[f64]) -> Vec<f64> {
        let sum: f64 = w.iter().sum();
        w.iter().map(|x| x * TOP_MASS / sum).collect()
    }

    fn problem(rng: &mut Rng, batch: usize, nodes: usize, stochastic: bool) -> Problem {
        let parents = tree_shape(nodes);
        let rows = batch * nodes;
        let mut p = Problem {
            batch,
            nodes,
            trees: Vec::with_capacity(batch),
            top_tokens: Vec::with_capacity(rows * TOP),
            target_mass: Vec::with_capacity(rows * TOP),
            draft_mass: Vec::with_capacity(rows * TOP),
            uniforms: (0..batch * (nodes + 1))
                .map(|_| rng.uniform_f32())
                .collect(),
            argmax: Vec::with_capacity(rows),
        };
        for _ in 0..batch {
            // Draft rows as (token, mass), most likely first, for drawing the children.
            let mut drafts = Vec::with_capacity(nodes);
            for _ in 0..nodes {
                let mut top: Vec<u32> = Vec::with_capacity(TOP);
                while top.len() < TOP {
                    let t = rng.below(VOCAB) as u32;
                    if !top.contains(&t) {
                        top.push(t);
                    }
                }
                let steepness = 0.3 + 1.7 * rng.uniform();
                let target: Vec<f64> = (0..TOP).map(|j| (-steepness * j as f64).exp()).collect();
                let draft: Vec<f64> = target
                    .iter()
                    .map(|w| w * (0.5 * rng.normal()).exp())
                    .collect();
                let (target, draft) = (normalised(&target), normalised(&draft));
                p.argmax.push(top[0]);
                p.top_tokens.extend(&top);
                p.target_mass.extend(target.iter().map(|&x| x as f32));
                p.draft_mass.extend(draft.iter().map(|&x| x as f32));
                let mut ranked: Vec<(u32, f64)> = top.into_iter().zip(draft).collect();
                ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
                drafts.push(ranked);
            }
            let mut tokens = vec![rng.below(VOCAB) as u32];
            let mut sibling = vec![0usize; nodes];
            for &parent in &parents[1..] {
                let row = &drafts[parent as usize];
                let s = sibling[parent as usize];
                sibling[parent as usize] += 1;
                tokens.push(if stochastic {
                    let mut w: Vec<f64> = row.iter().map(|&(_, m)| m).collect();
                    w.push(1.0 - TOP_MASS);
                    match categorical(rng, &w) {
                        j if j < TOP => row[j].0,
                        _ => rng.below(VOCAB) as u32,
                    }
                } else {
                    row[s].0
                });
            }
            p.trees.push(Tree {
                parents: parents.clone(),
                tokens,
            });
        }
        p
    }

    /// One row array (`[batch * nodes, VOCAB]`) on the device: background, then the tops.
    fn device_rows(client: &Client, p: &Problem, mass: &[f32], seed: u32) -> DeviceArray<f32> {
        let rows = DeviceArray::<f32>::uninit(client, p.batch * p.nodes * VOCAB);
        let cubes = (rows.len() as u32).div_ceil(256);
        let x = cubes.min(65_535);
        let at: Vec<u32> = p
            .top_tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| ((i / TOP) * VOCAB) as u32 + t)
            .collect();
        let (at, mass) = (
            DeviceArray::upload(client, &at),
            DeviceArray::upload(client, mass),
        );
        // SAFETY: indices are bounds-checked in the kernels; `at` stays inside the rows.
        unsafe {
            background::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(x, cubes.div_ceil(x), 1),
                CubeDim::new_1d(256),
                rows.arg(),
                seed,
            );
            scatter::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static((at.len() as u32).div_ceil(256), 1, 1),
                CubeDim::new_1d(256),
                rows.arg(),
                at.arg(),
                mass.arg(),
            );
        }
        rows
    }

    /// Rows a request's walk must read in full (see the module docs), the rows this kernel
    /// streams (both rows per rejection, as each pass recomputes the residual, plus the
    /// target row for a leaf's bonus) and its rejections.
    fn rows_needed(tree: &Tree, accepted: &[usize]) -> (usize, usize, usize) {
        let (mut needed, mut streamed, mut rejections, mut cur) = (0, 0, 0, 0);
        for step in 0..=accepted.len() {
            let next = accepted.get(step).copied();
            let rejected = tree.children(cur).take_while(|&c| Some(c) != next).count();
            let leaf = (rejected == 0 && next.is_none()) as usize;
            needed += if rejected > 0 { 2 } else { leaf };
            streamed += 2 * rejected + leaf;
            rejections += rejected;
            cur = next.unwrap_or(cur);
        }
        (needed, streamed, rejections)
    }

    /// What the verdicts say about the work.
    struct Work {
        floor_bytes: f64,
        streamed_bytes: f64,
        max_request_bytes: f64,
        max_request_streamed_bytes: f64,
        mean_accept_len: f64,
        mean_rejections: f64,
    }

    fn work(p: &Problem, verdicts: &[Verdict], stochastic: bool) -> Work {
        let cells = (p.batch * p.nodes) as f64;
        // parents + tokens, accepted + accept_len + bonus, and argmax or uniforms.
        let mut small = cells * 12.0 + p.batch as f64 * 8.0;
        small += if stochastic {
            p.uniforms.len() as f64 * 4.0
        } else {
            cells * 4.0
        };
        let row = (VOCAB * 4) as f64;
        let (mut needed, mut streamed, mut accepted, mut rejections) = (0.0, 0.0, 0.0, 0.0);
        let (mut max_request, mut max_streamed) = (0.0f64, 0.0f64);
        for (tree, v) in p.trees.iter().zip(verdicts) {
            accepted += v.accepted.len() as f64;
            if stochastic {
                let (n, s, r) = rows_needed(tree, &v.accepted);
                needed += n as f64 * row;
                streamed += s as f64 * row;
                max_request = max_request.max(n as f64 * row);
                max_streamed = max_streamed.max(s as f64 * row);
                rejections += r as f64;
            }
        }
        let b = p.batch as f64;
        Work {
            floor_bytes: small + needed,
            streamed_bytes: small + streamed,
            max_request_bytes: max_request,
            max_request_streamed_bytes: max_streamed,
            mean_accept_len: accepted / b,
            mean_rejections: rejections / b,
        }
    }

    /// Checks every request's verdict against the reference; returns the reference verdicts.
    fn validate(
        client: &Client,
        p: &Problem,
        out: &Verdicts,
        rows: Option<(&DeviceArray<f32>, &DeviceArray<f32>)>,
    ) -> anyhow::Result<Vec<Verdict>> {
        let (accepted, len, bonus) = (
            out.accepted.read(client),
            out.accept_len.read(client),
            out.bonus.read(client),
        );
        let rows = rows.map(|(t, d)| (t.read(client), d.read(client)));
        let (n, span) = (p.nodes, p.nodes * VOCAB);
        let mut verdicts = Vec::with_capacity(p.batch);
        for (b, tree) in p.trees.iter().enumerate() {
            let want = match &rows {
                Some((target, draft)) => reference::verify_stochastic(
                    tree,
                    &target[b * span..(b + 1) * span],
                    &draft[b * span..(b + 1) * span],
                    &p.uniforms[b * (n + 1)..(b + 1) * (n + 1)],
                    VOCAB,
                ),
                None => reference::verify_greedy(tree, &p.argmax[b * n..(b + 1) * n]),
            };
            let mut path: Vec<i32> = want.accepted.iter().map(|&i| i as i32).collect();
            path.resize(n, -1);
            anyhow::ensure!(
                accepted[b * n..(b + 1) * n] == path[..]
                    && len[b] as usize == want.accepted.len()
                    && bonus[b] == want.bonus,
                "B={} nodes={n} request {b}: kernel path {:?} bonus {}, reference {:?} bonus {}",
                p.batch,
                &accepted[b * n..b * n + len[b].min(n as u32) as usize],
                bonus[b],
                want.accepted,
                want.bonus
            );
            verdicts.push(want);
        }
        Ok(verdicts)
    }

    fn measure(
        client: &Client,
        timer: &SpinTimer,
        rng: &mut Rng,
        batch: usize,
        nodes: usize,
        stochastic: bool,
    ) -> anyhow::Result<Row> {
        let p = problem(rng, batch, nodes, stochastic);
        let parents: Vec<i32> = p.trees.iter().flat_map(|t| t.parents.clone()).collect();
        let tokens: Vec<u32> = p.trees.iter().flat_map(|t| t.tokens.clone()).collect();
        let trees = TreeBatch {
            batch,
            nodes,
            parents: DeviceArray::upload(client, &parents),
            tokens: DeviceArray::upload(client, &tokens),
        };
        let out = Verdicts::new(client, batch, nodes);
        let uniforms = DeviceArray::upload(client, &p.uniforms);
        let argmax = DeviceArray::upload(client, &p.argmax);
        let mut copies = Vec::new();
        let cubes = if stochastic {
            stochastic_split(client, batch, VOCAB)
        } else {
            1
        };
        let launch = |copies: &[(DeviceArray<f32>, DeviceArray<f32>)], i: usize, cubes| {
            let r = if stochastic {
                let (target, draft) = &copies[i % copies.len()];
                verify_stochastic_split(
                    client, &trees, target, draft, &uniforms, VOCAB, &out, cubes,
                )
            } else {
                verify_greedy(client, &trees, &argmax, &out)
            };
            r.expect("validated shapes");
        };
        if stochastic {
            copies.push((
                device_rows(client, &p, &p.target_mass, 1),
                device_rows(client, &p, &p.draft_mass, 2),
            ));
        }
        launch(&copies, 0, cubes);
        let verdicts = validate(client, &p, &out, copies.first().map(|(t, d)| (t, d)))?;
        let w = work(&p, &verdicts, stochastic);
        if stochastic {
            // Identical copies (same seeds) at other addresses.
            let copy_bytes = (2 * batch * nodes * VOCAB * 4) as f64;
            let wanted = (ROTATE_BYTES / w.floor_bytes).ceil() as usize;
            let fit = (COPY_MEMORY / copy_bytes) as usize;
            while copies.len() < wanted.min(fit).max(1) {
                copies.push((
                    device_rows(client, &p, &p.target_mass, 1),
                    device_rows(client, &p, &p.draft_mass, 2),
                ));
            }
        }
        let floor_s = w.floor_bytes / HBM_BYTES_PER_S;
        // Enough launches for ~600 us of device work, few enough to enqueue within the spin.
        let launches = ((600e-6 / (3.0 * floor_s).max(5e-6)).ceil() as usize).clamp(10, 200);
        let time = |cubes| -> anyhow::Result<f64> {
            for i in 0..copies.len().max(1) {
                launch(&copies, i, cubes);
            }
            let timed = timer.time(launches, |i| launch(&copies, i, cubes));
            anyhow::ensure!(
                timed.enqueue < timed.spin,
                "enqueue ({:.6} s) outlasted the spin ({:.6} s)",
                timed.enqueue,
                timed.spin
            );
            Ok(timed.per_launch)
        };
        let per_launch = time(cubes)?;
        let one_cube_us = match cubes {
            1 => None,
            _ => Some(time(1)? * 1e6),
        };
        let us = per_launch * 1e6;
        let ratio = per_launch / floor_s;
        Ok(Row {
            mode: if stochastic { "stochastic" } else { "greedy" },
            batch,
            nodes,
            vocab: VOCAB,
            us,
            cubes,
            one_cube_us,
            floor_bytes: w.floor_bytes,
            floor_us: floor_s * 1e6,
            ratio_to_floor: ratio,
            meets_target: (batch == 64 && nodes == 64).then_some(if stochastic {
                ratio <= STOCHASTIC_TARGET_RATIO
            } else {
                us <= GREEDY_TARGET_US
            }),
            streamed_bytes: w.streamed_bytes,
            mean_accept_len: w.mean_accept_len,
            mean_rejections: w.mean_rejections,
            max_request_bytes: w.max_request_bytes,
            max_request_streamed_bytes: w.max_request_streamed_bytes,
            copies: copies.len().max(1),
            launches,
        })
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let timer = SpinTimer::new(&client, Duration::from_millis(3));
        let mut rng = Rng::new(20_260_606);
        let args: Vec<String> = std::env::args().collect();
        // `OUT.json MODE BATCH NODES`: one point alone (for a profiler).
        let points: Vec<(bool, usize, usize)> = match &args[..] {
            [_, _, mode, batch, nodes] => {
                let stochastic = match mode.as_str() {
                    "greedy" => false,
                    "stochastic" => true,
                    other => anyhow::bail!("mode is greedy or stochastic, not {other:?}"),
                };
                vec![(stochastic, batch.parse()?, nodes.parse()?)]
            }
            _ => [false, true]
                .into_iter()
                .flat_map(|s| {
                    BATCHES
                        .into_iter()
                        .flat_map(move |b| NODES.map(|n| (s, b, n)))
                })
                .collect(),
        };
        let mut rows = Vec::new();
        for (stochastic, batch, nodes) in points {
            let row = measure(&client, &timer, &mut rng, batch, nodes, stochastic)?;
            eprintln!(
                "done {} B={batch} nodes={nodes}: {:.2} us",
                row.mode, row.us
            );
            rows.push(row);
        }
        report(
            &[
                ("mode", 10),
                ("B", 3),
                ("nodes", 5),
                ("us", 9),
                ("cubes", 5),
                ("1-cube us", 9),
                ("floor us", 9),
                ("xfloor", 7),
                ("target", 6),
                ("accept", 6),
                ("reject", 6),
                ("floor MB", 8),
                ("read MB", 8),
                ("maxreqMB", 8),
                ("maxreqRd", 8),
            ],
            &rows,
            |r| {
                let target = match r.meets_target {
                    Some(true) => "met",
                    Some(false) => "MISSED",
                    None => "-",
                };
                vec![
                    r.mode.to_string(),
                    r.batch.to_string(),
                    r.nodes.to_string(),
                    fixed(r.us, 2),
                    r.cubes.to_string(),
                    r.one_cube_us.map_or("-".into(), |u| fixed(u, 2)),
                    fixed(r.floor_us, 3),
                    fixed(r.ratio_to_floor, 2),
                    target.to_string(),
                    fixed(r.mean_accept_len, 2),
                    fixed(r.mean_rejections, 2),
                    fixed(r.floor_bytes / 1e6, 2),
                    fixed(r.streamed_bytes / 1e6, 2),
                    fixed(r.max_request_bytes / 1e6, 2),
                    fixed(r.max_request_streamed_bytes / 1e6, 2),
                ]
            },
            args.get(1),
        )
    }
}
