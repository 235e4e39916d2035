//! NVFP4 weights re-laid out at load time in the order the tensor cores consume them.
//!
//! A matrix `[n, k]` (`n % 16 == 0`, `k % 64 == 0`) is cut into tiles of 16 rows x 64
//! columns, row tile after row tile, K fastest. A tile is 512 bytes of codes: lane `l` of a
//! warp (`g = l / 4`, `c = l % 4`) owns 16 contiguous bytes, one word per 16-column step `s`,
//! holding the 8 codes of its `mma.sync m16n8k16` A fragment: rows `g` and `g + 8`, columns
//! `16 s + 4 c + j` for `j` in 0..4 (the fragment's logical columns `2c, 2c + 1, 2c + 8,
//! 2c + 9` are these four; the activations are read in the same order, so the dot product is
//! unchanged). Register `i` of the fragment (`i = 2 (j / 2) + row half`) holds two codes,
//! its low bf16 (`j` even) and its high one (`j` odd); a code's magnitude bits (exponent and
//! mantissa, 3) and sign sit where [`fragment_register`] finds them with at most two shifts
//! (`MAG_BIT`, `SIGN_BIT`, plus 16 for the high half): register 2 unshifted, 1 shifted left
//! by 6, 0 by 3 (magnitudes) and 1 (signs), 3 right by 4 and left by 2. Every operation
//! lands the code's bits on bf16's (sign 15, exponent 8..7, mantissa 6), so the register
//! reads `e2m1 * 2^-126` exactly (code 1, 0.5, lands on the bf16 subnormal `2^-127`): 11
//! integer operations per word, 7 of them on the ALU pipe. A step is one NVFP4 block, so one
//! block scale per row applies to a whole MMA.
//!
//! Block scales: 64 bytes per tile, 8 per `g`: step `s`'s scale of row `g` at byte
//! `2 s`, of row `g + 8` at byte `2 s + 1`; the four lanes of a `g` read the same 8 bytes.
//! Each is re-encoded so that one shift and one mask give it as bf16: a scale
//! `2^e (1 + m / 8)` (E4M3 subnormals normalized, `e` in -9..=8) becomes
//! `((15 + e) << 3) | m`, which reads as bf16 `(b << 4) | 0x7000 = scale * 2^112` (a normal
//! E4M3 byte just gains 64). A zero scale becomes 0 and its block's codes are zeroed, so the
//! weights stay exactly zero. Matrices with a negative or NaN block scale keep the row-major
//! layout ([`fragments_hold`]).
use cubecl::prelude::*;

use super::{Nvfp4Weights, BLOCK};
use crate::formats::byte_at;
use crate::warp_mma::Frag;
use crate::{DeviceArray, KernelError};

/// Rows per tile.
pub const TILE_ROWS: usize = 16;
/// Columns per tile.
pub const TILE_K: usize = 64;

/// How a device NVFP4 matrix stores its codes and block scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Nvfp4Layout {
    /// Row-major codes (element `8w + j` in bits `4j..4j + 4` of word `w`), scales
    /// `[experts, n, k / 16]`: every kernel reads it.
    RowMajor,
    /// The tensor-core fragment order described in this module (CUDA, `n % 16 == 0`,
    /// `k % 64 == 0`).
    Fragments,
}

/// True when a `[n, k]` matrix can be tiled.
pub fn shape_fits(n: usize, k: usize) -> bool {
    n.is_multiple_of(TILE_ROWS) && k.is_multiple_of(TILE_K)
}

/// True when every scale byte decodes from its seven low bits: no sign bit (a negative zero
/// counts as zero only if it is 0x00) and no NaN (`0x7f`).
pub fn fragments_hold(scale_bytes: &[u8]) -> bool {
    scale_bytes.iter().all(|&b| b & 0x80 == 0 && b != 0x7f)
}

/// Lowest bit of register `i`'s low-half code magnitude (3 bits) in a fragment word.
const MAG_BIT: [u32; 4] = [3, 0, 6, 10];
/// Bit of register `i`'s low-half code sign in a fragment word.
const SIGN_BIT: [u32; 4] = [14, 9, 15, 13];

/// A code's place in a fragment word: register `i` (0..4), half `h` (0 low, 1 high).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub register: u32,
    pub half: u32,
}

impl Slot {
    /// The E2M1 `code` moved to this slot's bits.
    pub fn place(self, code: u32) -> u32 {
        let (mag, sign) = self.bits();
        ((code & 7) << mag) | ((code >> 3) << sign)
    }

    /// The code in this slot of `word`.
    pub fn take(self, word: u32) -> u32 {
        let (mag, sign) = self.bits();
        ((word >> mag) & 7) | (((word >> sign) & 1) << 3)
    }

    fn bits(self) -> (u32, u32) {
        let i = self.register as usize;
        (MAG_BIT[i] + 16 * self.half, SIGN_BIT[i] + 16 * self.half)
    }
}

/// Word and slot of code `(row, col)` of one `[n, k]` matrix in the fragment layout.
pub fn code_position(row: usize, col: usize, k: usize) -> (usize, Slot) {
    let tile = (row / TILE_ROWS) * (k / TILE_K) + col / TILE_K;
    let (g, row_half) = (row % 8, (row % TILE_ROWS) / 8);
    let kk = col % TILE_K;
    let (step, c, j) = (kk / 16, (kk % 16) / 4, kk % 4);
    let slot = Slot {
        register: (2 * (j / 2) + row_half) as u32,
        half: (j % 2) as u32,
    };
    (tile * 128 + (4 * g + c) * 4 + step, slot)
}

/// Register `i` of a fragment word as two bf16 codes (`e2m1 * 2^-126` each; see the module
/// docs): the bits of slots `(i, 0)` and `(i, 1)` moved onto bf16's.
#[cube]
pub fn fragment_register(q: u32, #[comptime] i: u32) -> u32 {
    let mut r = q & 0x81c0_81c0u32;
    if comptime!(i == 0) {
        r = ((q << 3) & 0x01c0_01c0u32) | ((q << 1) & 0x8000_8000u32);
    } else if comptime!(i == 1) {
        r = (q << 6) & 0x81c0_81c0u32;
    } else if comptime!(i == 3) {
        r = ((q >> 4) & 0x01c0_01c0u32) | ((q << 2) & 0x8000_8000u32);
    }
    r
}

/// Byte of block `block` (columns `16 block..16 block + 16`) of row `row`'s scale.
pub fn scale_position(row: usize, block: usize, k: usize) -> usize {
    let tile = (row / TILE_ROWS) * (k / TILE_K) + block / 4;
    tile * 64 + (row % 8) * 8 + 2 * (block % 4) + (row % TILE_ROWS) / 8
}

/// The fragment encoding of a non-negative, finite E4M3 scale byte (see the module docs).
pub fn encode_scale(x: u8) -> u8 {
    let (e, m) = (x >> 3, x & 7);
    match (e, m) {
        (0, 0) => 0,
        (0, m) => {
            // m / 8 * 2^-6 = 2^(p - 9) (1 + rest): p = floor(log2 m).
            let p = 7 - m.leading_zeros() as u8;
            ((6 + p) << 3) | ((m << (3 - p)) & 7)
        }
        _ => x + 64,
    }
}

/// The E4M3 byte a fragment scale encodes (the inverse of [`encode_scale`]).
pub fn decode_scale(b: u8) -> u8 {
    match b >> 3 {
        0 => 0,
        field if field >= 9 => b - 64,
        field => (8 + (b & 7)) >> (9 - field),
    }
}

/// Host re-layout of `experts` row-major matrices (codes as words, scales as bytes):
/// the reference for [`to_fragments`]; [`from_fragments_host`] inverts it (up to the codes
/// of zero-scale blocks, which it leaves zero).
pub fn to_fragments_host(
    codes: &[u32],
    scales: &[u8],
    experts: usize,
    n: usize,
    k: usize,
) -> (Vec<u32>, Vec<u8>) {
    let mut out_codes = vec![0u32; codes.len()];
    let mut out_scales = vec![0u8; scales.len()];
    for (e, row, col) in positions(experts, n, k) {
        let (code_base, scale_base) = (e * n * k / 8, e * n * k / BLOCK);
        let flat = row * k + col;
        let scale = scales[scale_base + flat / BLOCK];
        let code = (codes[code_base + flat / 8] >> (4 * (flat % 8))) & 0xf;
        let (word, slot) = code_position(row, col, k);
        if scale != 0 {
            out_codes[code_base + word] |= slot.place(code);
        }
        if col % BLOCK == 0 {
            out_scales[scale_base + scale_position(row, col / BLOCK, k)] = encode_scale(scale);
        }
    }
    (out_codes, out_scales)
}

/// The inverse of [`to_fragments_host`].
pub fn from_fragments_host(
    codes: &[u32],
    scales: &[u8],
    experts: usize,
    n: usize,
    k: usize,
) -> (Vec<u32>, Vec<u8>) {
    let mut out_codes = vec![0u32; codes.len()];
    let mut out_scales = vec![0u8; scales.len()];
    for (e, row, col) in positions(experts, n, k) {
        let (code_base, scale_base) = (e * n * k / 8, e * n * k / BLOCK);
        let flat = row * k + col;
        let (word, slot) = code_position(row, col, k);
        let code = slot.take(codes[code_base + word]);
        out_codes[code_base + flat / 8] |= code << (4 * (flat % 8));
        if col % BLOCK == 0 {
            out_scales[scale_base + flat / BLOCK] =
                decode_scale(scales[scale_base + scale_position(row, col / BLOCK, k)]);
        }
    }
    (out_codes, out_scales)
}

fn positions(experts: usize, n: usize, k: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..experts).flat_map(move |e| (0..n).flat_map(move |r| (0..k).map(move |c| (e, r, c))))
}

/// Re-lays out row-major weights on the device into [`Nvfp4Layout::Fragments`] (one pass
/// per buffer; the row-major buffers are dropped by the caller). Trusts validated weights
/// with [`shape_fits`].
pub fn to_fragments<R: Runtime>(
    client: &ComputeClient<R>,
    w: &Nvfp4Weights,
) -> Result<Nvfp4Weights, KernelError> {
    w.validate()?;
    let codes = DeviceArray::<u32>::uninit(client, w.packed.len());
    let scales = DeviceArray::<u32>::uninit(client, w.scales.len());
    let (n, k) = (w.n as u32, w.k as u32);
    let launch = |len: usize| {
        let cubes = (len as u32).div_ceil(256);
        let x = cubes.min(65_535);
        (
            CubeCount::Static(x, cubes.div_ceil(x), 1),
            CubeDim::new_1d(256),
        )
    };
    let (code_cubes, dim) = launch(codes.len());
    let (scale_cubes, _) = launch(scales.len());
    // SAFETY: validated buffers; every output word is written by exactly one unit.
    unsafe {
        code_tiles_kernel::launch_unchecked::<R>(
            client,
            code_cubes,
            dim,
            w.packed.arg(),
            w.scales.arg(),
            codes.arg(),
            n,
            k,
            codes.len() as u32,
        );
        scale_tiles_kernel::launch_unchecked::<R>(
            client,
            scale_cubes,
            dim,
            w.scales.arg(),
            scales.arg(),
            n,
            k,
            scales.len() as u32,
        );
    }
    Ok(Nvfp4Weights {
        packed: codes,
        scales,
        global_scales: w.global_scales.clone(),
        experts: w.experts,
        n: w.n,
        k: w.k,
        layout: Nvfp4Layout::Fragments,
    })
}

/// One unit per fragment word: gathers its 8 codes (two row-major words: rows `g`, `g + 8`),
/// zeroing those of a row whose block scale is zero.
#[cube(launch_unchecked)]
fn code_tiles_kernel(
    src: &Array<u32>,
    scales: &Array<u32>,
    dst: &mut Array<u32>,
    n: u32,
    k: u32,
    len: u32,
) {
    let w = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * 256 + UNIT_POS_X as usize;
    if w < len as usize {
        let (n, k) = (n as usize, k as usize);
        let expert = w / (n * k / 8);
        let local = w % (n * k / 8);
        let tile = local / 128;
        let (lane, step) = ((local % 128) / 4, local % 4);
        let row = (tile / (k / 64)) * 16 + lane / 4;
        let col = (tile % (k / 64)) * 64 + step * 16 + (lane % 4) * 4;
        // Word indices (element indices of all experts can pass 2^32). Columns
        // col..col + 4 sit in one row-major word (col % 8 is 0 or 4).
        let base = expert * (n * k / 8);
        let shift = ((col % 8) * 4) as u32;
        let mut lo = src[base + (row * k + col) / 8] >> shift;
        let mut hi = src[base + ((row + 8) * k + col) / 8] >> shift;
        let scale_base = expert * (n * k / 16);
        if byte_at(scales, scale_base + (row * k + col) / 16) == 0 {
            lo = 0;
        }
        if byte_at(scales, scale_base + ((row + 8) * k + col) / 16) == 0 {
            hi = 0;
        }
        let mut word = 0u32;
        #[unroll]
        for j in 0..4u32 {
            // Half j % 2 of registers 2 (j / 2) (row g) and 2 (j / 2) + 1 (row g + 8).
            let (lo_code, hi_code) = ((lo >> (4 * j)) & 0xf, (hi >> (4 * j)) & 0xf);
            let (lo_mag, lo_sign) = comptime!(slot_bits(2 * (j / 2), j % 2));
            let (hi_mag, hi_sign) = comptime!(slot_bits(2 * (j / 2) + 1, j % 2));
            word |= ((lo_code & 7) << lo_mag) | ((lo_code >> 3) << lo_sign);
            word |= ((hi_code & 7) << hi_mag) | ((hi_code >> 3) << hi_sign);
        }
        dst[w] = word;
    }
}

/// (magnitude, sign) bits of slot `(register, half)`, for the device re-layout.
fn slot_bits(register: u32, half: u32) -> (u32, u32) {
    Slot { register, half }.bits()
}

/// One unit per fragment scale word (4 bytes: steps `2q`, `2q + 1` of rows `g`, `g + 8`).
#[cube(launch_unchecked)]
fn scale_tiles_kernel(src: &Array<u32>, dst: &mut Array<u32>, n: u32, k: u32, len: u32) {
    let w = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * 256 + UNIT_POS_X as usize;
    if w < len as usize {
        let (n, k) = (n as usize, k as usize);
        let per_expert = n * k / 64;
        let (expert, local) = (w / per_expert, w % per_expert);
        let tile = local / 16;
        let (g, pair) = ((local % 16) / 2, local % 2);
        let row = (tile / (k / 64)) * 16 + g;
        let block = (tile % (k / 64)) * 4 + pair * 2;
        let blocks = k / 16;
        let base = expert * n * blocks;
        let mut word = 0u32;
        #[unroll]
        for b in 0..4usize {
            let src_byte = base + (row + (b % 2) * 8) * blocks + block + b / 2;
            word |= encode_scale_byte(byte_at(src, src_byte)) << (8 * b as u32);
        }
        dst[w] = word;
    }
}

/// [`encode_scale`] on the device.
#[cube]
fn encode_scale_byte(x: u32) -> u32 {
    let m = x & 7;
    // Subnormal: p = floor(log2 m).
    let p = select(m >= 4, 2u32, select(m >= 2, 1u32, 0u32));
    let subnormal = ((6 + p) << 3) | ((m << (3 - p)) & 7);
    let normal = x + 64;
    select(x == 0, 0u32, select(x < 8, subnormal, normal))
}

/// The bf16 pair `(s, s)` (`s = scale * 2^112`) of the fragment scale in byte `byte` of
/// `word`: `(b << 4) | 0x7000` in both halves as one multiply-add (`b << 4` stays below
/// `0x1000`, so adding `0x7000` is the or, and nothing carries into the high half).
#[cube]
pub fn scale_pair(word: u32, #[comptime] byte: u32) -> u32 {
    ((word >> comptime!(8 * byte)) & 0xff) * 0x0010_0010 + 0x7000_7000
}

/// The 4 A-fragment registers of step `s` from its code word `q` and the scale word of
/// steps `s / 2 * 2..+2`: each [`fragment_register`] times its row's [`scale_pair`] (rows
/// `g`: registers 0, 2; `g + 8`: 1, 3), `e2m1 * scale * 2^-14` exactly.
#[cube]
pub fn decode_step(q: u32, scale_word: u32, #[comptime] s: usize) -> Array<Frag> {
    let s_g = Frag::reinterpret(scale_pair(scale_word, comptime!(2 * (s as u32 % 2))));
    let s_g8 = Frag::reinterpret(scale_pair(scale_word, comptime!(2 * (s as u32 % 2) + 1)));
    let mut frags = Array::<Frag>::new(4usize);
    #[unroll]
    for i in 0..4u32 {
        let w = Frag::reinterpret(fragment_register(q, i));
        if comptime!(i % 2 == 0) {
            frags[i as usize] = w * s_g;
        } else {
            frags[i as usize] = w * s_g8;
        }
    }
    frags
}

/// `2^14`: restores the sums of products with weights decoded as `e2m1 * scale * 2^-14`
/// (codes read as `e2m1 * 2^-126`, times the stored `scale * 2^112`).
pub const TWO_POW_14: f32 = 16384.0;

#[cfg(test)]
mod tests {
    use super::*;

    /// `2^-112`: a fragment scale's bf16 value times this is the E4M3 scale.
    const TWO_POW_MINUS_112: f32 = f32::from_bits((127 - 112) << 23);

    /// Every code and every scale of a tiling matrix has its own slot.
    #[test]
    fn positions_are_a_bijection() {
        for (n, k) in [(16, 64), (32, 192), (48, 128)] {
            let mut codes = vec![0u32; n * k / 8];
            let mut scales = vec![false; n * k / BLOCK];
            for row in 0..n {
                for col in 0..k {
                    let (word, slot) = code_position(row, col, k);
                    assert_eq!(codes[word] & slot.place(0xf), 0, "({row}, {col})");
                    codes[word] |= slot.place(0xf);
                    if col % BLOCK == 0 {
                        let byte = scale_position(row, col / BLOCK, k);
                        assert!(!scales[byte], "scale ({row}, {})", col / BLOCK);
                        scales[byte] = true;
                    }
                }
            }
            assert!(codes.iter().all(|&w| w == u32::MAX));
            assert!(scales.iter().all(|&s| s));
        }
    }

    /// Fragment word `s` of lane `(g, c)` holds rows `g`, `g + 8`, columns `16 s + 4 c + j`,
    /// register `i = 2 (j / 2) + row half`, low half for even `j`, high for odd.
    #[test]
    fn a_lane_word_holds_its_fragment() {
        let k = 128;
        // Lane 9 = (g 2, c 1), second column tile, step 3.
        let (word, slot) = code_position(2, 64 + 48 + 4, k);
        let expected = Slot {
            register: 0,
            half: 0,
        };
        assert_eq!((word, slot), (128 + 9 * 4 + 3, expected));
        let (word, slot) = code_position(10, 64 + 48 + 4 + 3, k);
        let expected = Slot {
            register: 3,
            half: 1,
        };
        assert_eq!((word, slot), (128 + 9 * 4 + 3, expected));
        assert_eq!(scale_position(10, 7, k), 64 + 2 * 8 + 2 * 3 + 1);
    }

    /// `fragment_register`'s shifts and masks, on the host: every code in every slot lands on
    /// bf16's sign, exponent and mantissa bits of its register's half, and nothing else does.
    #[test]
    fn registers_read_every_slot_as_bf16() {
        let register = |q: u32, i: u32| match i {
            0 => ((q << 3) & 0x01c0_01c0) | ((q << 1) & 0x8000_8000),
            1 => (q << 6) & 0x81c0_81c0,
            2 => q & 0x81c0_81c0,
            _ => ((q >> 4) & 0x01c0_01c0) | ((q << 2) & 0x8000_8000),
        };
        for i in 0..4 {
            for half in 0..2 {
                for code in 0..16u32 {
                    let slot = Slot { register: i, half };
                    let bf16_bits = ((code & 8) << 12) | ((code & 7) << 6);
                    // Alone, and with every other slot of the word set.
                    assert_eq!(register(slot.place(code), i), bf16_bits << (16 * half));
                    let others = !slot.place(0xf);
                    let got = register(others | slot.place(code), i) >> (16 * half) & 0xffff;
                    assert_eq!(got, bf16_bits, "slot ({i}, {half}), code {code}");
                }
            }
        }
    }

    #[test]
    fn the_host_relayout_round_trips() {
        let (experts, n, k) = (3, 32, 128);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let codes: Vec<u32> = (0..experts * n * k / 8).map(|_| next() as u32).collect();
        let scales: Vec<u8> = (0..experts * n * k / BLOCK)
            .map(|_| (next() % 126) as u8 + 1)
            .collect();
        let (fc, fs) = to_fragments_host(&codes, &scales, experts, n, k);
        assert_ne!(fc, codes);
        assert_eq!(
            from_fragments_host(&fc, &fs, experts, n, k),
            (codes, scales)
        );
    }

    /// Every finite non-negative E4M3 scale survives the encoding, and the encoding read as
    /// bf16 `(b << 4) | 0x7000` is the scale times 2^112.
    #[test]
    fn scale_encoding_reads_as_bf16() {
        for x in 0u8..0x7f {
            let b = encode_scale(x);
            assert_eq!(decode_scale(b), x, "{x:#x}");
            let e4m3 = if x >> 3 == 0 {
                (x & 7) as f64 / 8.0 * 2f64.powi(-6)
            } else {
                2f64.powi((x >> 3) as i32 - 7) * (1.0 + (x & 7) as f64 / 8.0)
            };
            let bits = ((b as u32) << 4 | 0x7000) << 16;
            let as_bf16 = f32::from_bits(bits) as f64;
            if x == 0 {
                assert_eq!(b, 0);
            } else {
                assert_eq!(as_bf16, e4m3 * 2f64.powi(112), "{x:#x}");
                assert_eq!(as_bf16 as f32 * TWO_POW_MINUS_112, e4m3 as f32);
            }
        }
    }

    /// A zero block scale zeroes the block's codes (its weights are zero either way).
    #[test]
    fn zero_scales_zero_their_codes() {
        let (n, k) = (16, 64);
        let codes = vec![0x7777_7777u32; n * k / 8];
        let mut scales = vec![0x38u8; n * k / BLOCK];
        scales[5] = 0; // row 1, block 1
        let (fc, fs) = to_fragments_host(&codes, &scales, 1, n, k);
        let (back, back_scales) = from_fragments_host(&fc, &fs, 1, n, k);
        assert_eq!(back_scales, scales);
        for col in 0..k {
            let flat = k + col;
            let code = (back[flat / 8] >> (4 * (flat % 8))) & 0xf;
            assert_eq!(code, if col / 16 == 1 { 0 } else { 7 }, "col {col}");
        }
    }

    #[test]
    fn scales_with_a_sign_or_nan_keep_row_major() {
        assert!(fragments_hold(&[0x00, 0x38, 0x7e]));
        assert!(!fragments_hold(&[0x38, 0x7f]));
        assert!(!fragments_hold(&[0x80]));
        assert!(!fragments_hold(&[0xb8]));
    }
}
