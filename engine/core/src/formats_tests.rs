//! Exhaustive checks of the scalar formats against a brute-force nearest-code search.

use super::*;

/// Brute force: the code among `codes` whose decoded value is nearest to `x`, ties
/// to the even code. Only non-negative magnitude codes are passed in.
fn nearest_code(x: f32, codes: impl Iterator<Item = u8>, decode: fn(u8) -> f32) -> u8 {
    let mut best: Option<(f64, u8)> = None;
    for c in codes {
        let d = (x.abs() as f64 - decode(c) as f64).abs();
        best = match best {
            None => Some((d, c)),
            Some((bd, bc)) if d < bd || (d == bd && c % 2 == 0 && bc % 2 == 1) => Some((d, c)),
            keep => keep,
        };
    }
    best.unwrap().1
}

/// Test inputs: every representable magnitude, every midpoint between neighbours and
/// the f32 values just around each, plus a log-spaced sweep, with both signs.
fn probe_values(decode: fn(u8) -> f32, max_code: u8) -> Vec<f32> {
    let mags: Vec<f32> = (0..=max_code).map(decode).collect();
    let mut out = Vec::new();
    for w in mags.windows(2) {
        let mid = (w[0] + w[1]) / 2.0; // exact: both are small dyadic numbers
        for v in [w[0], mid, w[1]] {
            out.extend([v, f32::from_bits(v.to_bits() + 1)]);
            if v > 0.0 {
                out.push(f32::from_bits(v.to_bits() - 1));
            }
        }
    }
    let mut v = 1e-6f32;
    while v < 1e4 {
        out.push(v);
        v *= 1.0137;
    }
    let negatives: Vec<f32> = out.iter().map(|v| -v).collect();
    out.extend(negatives);
    out
}

#[test]
fn e2m1_decode_encode_round_trips_every_code() {
    for c in 0..16u8 {
        assert_eq!(
            e2m1_decode(e2m1_encode(e2m1_decode(c))),
            e2m1_decode(c),
            "{c}"
        );
    }
}

#[test]
fn e4m3_decode_encode_round_trips_every_non_nan_code() {
    for c in 0..=255u8 {
        if c & 0x7f == 0x7f {
            assert!(e4m3_decode(c).is_nan());
            continue;
        }
        assert_eq!(e4m3_encode(e4m3_decode(c)), c, "code {c:#04x}");
    }
}

#[test]
fn encoders_match_brute_force_nearest_code() {
    for x in probe_values(e2m1_decode, 7) {
        let expect = nearest_code(x.clamp(-6.0, 6.0), 0..8, e2m1_decode);
        assert_eq!(e2m1_encode(x) & 0x7, expect, "e2m1 {x}");
        assert_eq!(e2m1_encode(x) & 0x8 != 0, x.is_sign_negative(), "sign {x}");
    }
    for x in probe_values(e4m3_decode, 0x7e) {
        let expect = nearest_code(x.clamp(-448.0, 448.0), 0..0x7f, e4m3_decode);
        assert_eq!(e4m3_encode(x) & 0x7f, expect, "e4m3 {x}");
        assert_eq!(e4m3_encode(x) & 0x80 != 0, x.is_sign_negative(), "sign {x}");
    }
}

#[test]
fn encoders_are_monotone() {
    let mut xs = probe_values(e4m3_decode, 0x7e);
    xs.extend(probe_values(e2m1_decode, 7));
    xs.sort_by(f32::total_cmp);
    for w in xs.windows(2) {
        assert!(e2m1_decode(e2m1_encode(w[0])) <= e2m1_decode(e2m1_encode(w[1])));
        assert!(e4m3_decode(e4m3_encode(w[0])) <= e4m3_decode(e4m3_encode(w[1])));
        assert!(bf16_round(w[0]) <= bf16_round(w[1]));
    }
}

#[test]
fn e2m1_ties_go_to_the_even_code() {
    let cases = [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (-5.0, -4.0),
    ];
    for (x, want) in cases {
        assert_eq!(e2m1_decode(e2m1_encode(x)), want, "{x}");
    }
}

#[test]
fn e4m3_ties_go_to_the_even_code() {
    // 1 + 1/16 lies halfway between 1 (mantissa 0) and 1.125 (mantissa 1).
    assert_eq!(e4m3_decode(e4m3_encode(1.0625)), 1.0);
    // 1.1875 lies between 1.125 (odd) and 1.25 (even).
    assert_eq!(e4m3_decode(e4m3_encode(1.1875)), 1.25);
    // Subnormal tie: 2^-10 is halfway between 0 and 2^-9.
    assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00);
    assert_eq!(e4m3_encode(3.0 * 2f32.powi(-10)), 0x02);
    // 432 lies between 416 (odd mantissa 5) and 448 (even mantissa 6).
    assert_eq!(e4m3_decode(e4m3_encode(432.0)), 448.0);
}

#[test]
fn fp4_and_fp8_saturate_and_map_nan() {
    for x in [6.5, 7.0, 1e9, f32::INFINITY] {
        assert_eq!(e2m1_encode(x), 0x7);
        assert_eq!(e2m1_encode(-x), 0xf);
    }
    for x in [449.0, 464.0, 1e9, f32::INFINITY] {
        assert_eq!(e4m3_encode(x), 0x7e);
        assert_eq!(e4m3_encode(-x), 0xfe);
    }
    assert_eq!(e2m1_encode(f32::NAN), 0x7);
    assert_eq!(e4m3_encode(f32::NAN), 0x7f);
    assert!(e4m3_decode(0xff).is_nan());
    assert_eq!(e4m3_decode(0x7e), 448.0);
    assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
}

#[test]
fn negative_zero_keeps_its_sign() {
    assert_eq!(e2m1_encode(-0.1), 0x8);
    assert_eq!(e4m3_encode(-1e-30), 0x80);
    assert!(e2m1_decode(0x8).is_sign_negative());
}

#[test]
fn bf16_round_trips_every_non_nan_pattern() {
    for bits in 0..=u16::MAX {
        let x = bf16_decode(bits);
        if x.is_nan() {
            assert!(bf16_decode(bf16_encode(x)).is_nan());
        } else {
            assert_eq!(bf16_encode(x), bits);
        }
    }
}

#[test]
fn bf16_rounds_ties_to_even_and_overflows_to_infinity() {
    let ulp = 2f32.powi(-7);
    assert_eq!(bf16_round(1.0 + ulp / 2.0), 1.0);
    assert_eq!(bf16_round(1.0 + 3.0 * ulp / 2.0), 1.0 + 2.0 * ulp);
    assert_eq!(bf16_round(1.0 + ulp / 2.0 + 2f32.powi(-20)), 1.0 + ulp);
    assert_eq!(bf16_round(f32::MAX), f32::INFINITY);
    assert!(bf16_round(f32::NAN).is_nan());
    assert!(bf16_round(-f32::NAN).is_nan());
}

#[test]
fn packing_puts_the_first_element_in_the_low_bits() {
    assert_eq!(pack_u16_words(&[1, 2, 3]), vec![0x0002_0001, 0x0000_0003]);
    assert_eq!(
        pack_u8_words(&[1, 2, 3, 4, 5]),
        vec![0x0403_0201, 0x0000_0005]
    );
    assert!(pack_u8_words(&[]).is_empty());
}
