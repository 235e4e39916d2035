//! kiln's own CUDA launcher ([`kiln_backends::launcher`]) against CubeCL's: SwiGLU's
//! activation launched both ways over an odd length writes the same bits; captured into a
//! CUDA graph on kiln's stream and replayed after CubeCL wrote a new input into the same
//! buffer and poisoned the output, it writes what CubeCL's launch writes for the new input.
//! And the random fill, whose eight scalars travel in the info struct, writes the same
//! words both ways. And kiln's own kernel functions, unchanged, issued through the routed
//! runtime (`cuda-routed`) are captured into a graph and replayed: a chain of two
//! launches writes what CubeCL's launches write, also after its input was overwritten in
//! place (`routed::write`) between replays; scratch the recording allocated stays the
//! graph's. CUDA only.
use kiln_backends::launcher::{Args, Kernel, Launcher};
use kiln_backends::routed::{capture, replay, write};
use kiln_backends::{Backend, Cuda, CudaRouted};
use kiln_kernels::activation::{silu_mul, silu_mul_source};
use kiln_kernels::fill::{fill_random_records, fill_source, Field};
use kiln_kernels::DeviceArray;

/// Values in [-4, 4) from a small LCG seeded `seed`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.into_iter().map(f32::to_bits).collect()
}

#[test]
fn silu_mul_through_kilns_launcher_and_its_graph_equals_cubecls_launch() {
    let client = Cuda::client();
    let launcher = Launcher::new().expect("CUDA device 0");
    let source = silu_mul_source().expect("CUDA source");
    let kernel: Kernel = launcher.load(&source).expect("NVRTC compiles it");
    let n = 100_003;
    let cubes = (n as u32).div_ceil(source.cube_dim.x);
    let gate = DeviceArray::upload(&client, &values(n, 1));
    let up = DeviceArray::upload(&client, &values(n, 2));
    let poison = DeviceArray::filled(&client, n, f32::NAN);
    let (want, got) = (
        DeviceArray::uninit(&client, n),
        DeviceArray::uninit(&client, n),
    );
    let args = || {
        let mut a = Args::default();
        a.array(&client, &gate)
            .array(&client, &up)
            .array(&client, &got);
        a
    };
    let stream = launcher.stream();

    silu_mul(&client, &poison, &up, &got).unwrap();
    silu_mul(&client, &gate, &up, &want).unwrap();
    let expected = bits(want.read(&client)); // CubeCL's work is done
                                             // SAFETY: gate, up and got hold n elements each.
    unsafe { kernel.launch(stream, (cubes, 1, 1), args()) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(bits(got.read(&client)), expected, "a launch of kiln's");

    // SAFETY: as above; the buffers outlive the graph.
    let graph = launcher
        .capture(|s| unsafe { kernel.launch(s, (cubes, 1, 1), args()) })
        .unwrap();
    // A new input in the same buffer, the output poisoned, the expectation recomputed.
    let other = DeviceArray::upload(&client, &values(n, 3));
    silu_mul(&client, &other, &up, &gate).unwrap();
    silu_mul(&client, &poison, &up, &got).unwrap();
    silu_mul(&client, &gate, &up, &want).unwrap();
    let expected = bits(want.read(&client));
    assert!(bits(got.read(&client))
        .iter()
        .all(|&b| f32::from_bits(b).is_nan()));
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(bits(got.read(&client)), expected, "the graph replayed");
}

#[test]
fn the_random_fill_through_kilns_launcher_equals_cubecls_launch() {
    let client = Cuda::client();
    let launcher = Launcher::new().expect("CUDA device 0");
    let source = fill_source().expect("CUDA source");
    let kernel = launcher.load(&source).expect("NVRTC compiles it");
    let n = 70_001;
    let field = Field {
        period: 7,
        words: 2..5,
        and_mask: 0x0f0f_0f0f,
        or_mask: 0x3000_0000,
    };
    let (seed, masks) = (12345, (0x7fff_fff0, 0x1));
    let (want, got) = (
        DeviceArray::uninit(&client, n),
        DeviceArray::filled(&client, n, 0u32),
    );
    fill_random_records(&client, &want, seed, masks, &field).unwrap();
    let expected = want.read(&client);
    assert_ne!(expected, got.read(&client));
    let mut args = Args::default();
    args.array(&client, &got);
    let w = &field.words;
    let scalars = [seed, masks.0, masks.1, field.period, w.start, w.end];
    for v in scalars.into_iter().chain([field.and_mask, field.or_mask]) {
        args.scalar(v);
    }
    let cubes = (n as u32).div_ceil(source.cube_dim.x);
    // SAFETY: `got` holds n words; the kernel bounds-checks against its length.
    unsafe { kernel.launch(launcher.stream(), (cubes, 1, 1), args) }.unwrap();
    launcher.stream().synchronize().unwrap();
    assert_eq!(got.read(&client), expected);
}

#[test]
fn kernel_functions_issued_through_the_routed_runtime_are_captured_and_replayed() {
    let n = 70_001;
    // What CubeCL's own runtime computes for the chain mid = silu(x) * up, out = silu(mid) * up.
    let expect = |x: &[f32], up: &[f32]| {
        let client = Cuda::client();
        let (x, up) = (
            DeviceArray::upload(&client, x),
            DeviceArray::upload(&client, up),
        );
        let (mid, out) = (
            DeviceArray::uninit(&client, n),
            DeviceArray::uninit(&client, n),
        );
        silu_mul(&client, &x, &up, &mid).unwrap();
        silu_mul(&client, &mid, &up, &out).unwrap();
        bits(out.read(&client))
    };
    let client = CudaRouted::client();
    let (first, second, up) = (values(n, 4), values(n, 5), values(n, 6));
    let x = DeviceArray::upload(&client, &first);
    let up_d = DeviceArray::upload(&client, &up);
    let ones = DeviceArray::filled(&client, n, 1.0f32);
    let poison = DeviceArray::filled(&client, n, f32::NAN);
    let (mid, out) = (
        DeviceArray::uninit(&client, n),
        DeviceArray::uninit(&client, n),
    );
    let chain = || {
        silu_mul(&client, &x, &up_d, &mid)?;
        silu_mul(&client, &mid, &up_d, &out)
    };
    chain().unwrap(); // compiled, and run once eagerly
    assert_eq!(
        bits(out.read(&client)),
        expect(&first, &up),
        "routed, eagerly"
    );
    silu_mul(&client, &poison, &ones, &out).unwrap();
    let (graph, ()) = capture(&client, chain).unwrap();
    assert!(
        out.read(&client).iter().all(|v| v.is_nan()),
        "a capture runs nothing"
    );
    replay(&client, &graph).unwrap();
    assert_eq!(
        bits(out.read(&client)),
        expect(&first, &up),
        "the first replay"
    );
    // New inputs written over x in place, the output poisoned, then the graph again.
    write(&client, &x, &second).unwrap();
    silu_mul(&client, &poison, &ones, &out).unwrap();
    replay(&client, &graph).unwrap();
    assert_eq!(
        bits(out.read(&client)),
        expect(&second, &up),
        "a replay on new inputs"
    );
    // Scratch allocated while recording (freed when the closure returns) stays the
    // graph's: a buffer made after the capture keeps its contents across a replay.
    let (scratch_graph, ()) = capture(&client, || {
        let mid = DeviceArray::uninit(&client, n);
        silu_mul(&client, &x, &up_d, &mid)?;
        silu_mul(&client, &mid, &up_d, &out)
    })
    .unwrap();
    assert!(scratch_graph.kept_bytes() >= 4 * n as u64);
    let later = DeviceArray::filled(&client, n, 7.0f32);
    silu_mul(&client, &poison, &ones, &out).unwrap();
    replay(&client, &scratch_graph).unwrap();
    assert!(
        later.read(&client).iter().all(|&v| v == 7.0),
        "a replay wrote into memory allocated after its capture"
    );
    assert_eq!(
        bits(out.read(&client)),
        expect(&second, &up),
        "the graph with scratch of its own"
    );
}
