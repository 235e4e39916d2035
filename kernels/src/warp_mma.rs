//! Warp-level steps of kiln's bf16 tensor-core kernels (the tiled GEMM, the per-head
//! products, the 64-row MLA attention): `mma.sync m16n8k16` with bf16 operands and f32
//! accumulators, A operands loaded from shared memory by `ldmatrix`. Register fragments are
//! flat arrays; the `#[comptime]` offsets say where a step's registers start in them.
use cubecl::prelude::*;
use half::bf16;

/// Two bf16 values of an operand fragment register.
pub type Frag = Vector<bf16, Const<2>>;
/// Two f32 accumulators of one row (columns `2t`, `2t + 1`).
pub type Acc = Vector<f32, Const<2>>;
/// Eight bf16 values: 16 bytes, one `ldmatrix` row.
pub type Bf16x8 = Vector<bf16, Const<8>>;

/// Loads the A fragments (4 registers) of a 16 x 16 tile of a row-major bf16 matrix in
/// shared memory (`stride` vectors of 8 per row) into `frags[at..at + 4]`: rows
/// `row0..row0 + 16`, columns vectors `vec0` and `vec0 + 1`.
#[cube]
pub fn load_a_tile(
    smem: &SharedMemory<Bf16x8>,
    row0: usize,
    vec0: usize,
    stride: usize,
    lane: usize,
    frags: &mut Array<Frag>,
    #[comptime] at: usize,
) {
    let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let addr = (row0 + ((lane / 8) % 2) * 8 + lane % 8) * stride + vec0 + lane / 16;
    let f = mma.load_matrix::<Bf16x8, Const<2>>(
        &smem.slice(addr, addr + 1),
        cmma::MatrixIdent::A,
        4usize,
        false,
    );
    #[unroll]
    for i in 0..4usize {
        frags[at + i] = f[i];
    }
}

/// One `m16n8k16` step: `acc[c..c + 2] += a[a_at..a_at + 4] x b[b_at..b_at + 2]`.
#[cube]
pub fn mma_step(
    a: &Array<Frag>,
    #[comptime] a_at: usize,
    b: &Array<Frag>,
    #[comptime] b_at: usize,
    acc: &mut Array<Acc>,
    #[comptime] c: usize,
) {
    let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let mut af = Array::<Frag>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        af[i] = a[a_at + i];
    }
    let mut bf = Array::<Frag>::new(2usize);
    bf[0] = b[b_at];
    bf[1] = b[b_at + 1];
    let mut cf = Array::<Acc>::new(2usize);
    cf[0] = acc[c];
    cf[1] = acc[c + 1];
    mma.execute_inplace(&af, &bf, &mut cf);
    acc[c] = cf[0];
    acc[c + 1] = cf[1];
}
