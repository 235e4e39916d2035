//! Snapshot tests of the bit-level formats: any change to an encoding shows up as a
//! reviewed diff of these tables (`reference/tests/snapshots/`).

use kiln_reference::formats::{e2m1_decode, e4m3_decode};
use kiln_reference::nvfp4::Nvfp4Matrix;
use std::fmt::Write;

#[test]
fn e2m1_table() {
    let mut s = String::new();
    for code in 0..16u8 {
        writeln!(s, "{code:#03x} {code:04b} {}", e2m1_decode(code)).unwrap();
    }
    insta::assert_snapshot!(s);
}

#[test]
fn e4m3_table() {
    let mut s = String::new();
    for code in 0..=255u8 {
        writeln!(s, "{code:#04x} {:e}", e4m3_decode(code)).unwrap();
    }
    insta::assert_snapshot!(s);
}

/// A 2 x 32 matrix: row 0 holds the E2M1 grid times 0.25 and its negatives, row 1 a
/// ramp with one outlier (the tensor's amax) in its second block.
fn small_matrix() -> Vec<f32> {
    let grid = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let mut w: Vec<f32> = grid.iter().chain(grid.iter()).map(|v| v * 0.25).collect();
    w.extend(grid.iter().chain(grid.iter()).map(|v| -v * 0.25));
    w.extend((0..32).map(|i| (i as f32 - 15.5) * 0.1));
    w[32 + 20] = 12.0;
    w
}

#[test]
fn nvfp4_small_tensor() {
    let q = Nvfp4Matrix::quantize(&small_matrix(), 2, 32).unwrap();
    let mut s = String::new();
    let hex: Vec<String> = q.packed.iter().map(|b| format!("{b:02x}")).collect();
    writeln!(
        s,
        "global_scale {:e} (bits {:#010x})",
        q.global_scale,
        q.global_scale.to_bits()
    )
    .unwrap();
    writeln!(s, "scales {:02x?}", q.scales).unwrap();
    for (r, row) in hex.chunks(16).enumerate() {
        writeln!(s, "packed row {r}: {}", row.join(" ")).unwrap();
    }
    let words: Vec<String> = q
        .packed_words()
        .iter()
        .map(|w| format!("{w:08x}"))
        .collect();
    writeln!(s, "packed_words {}", words.join(" ")).unwrap();
    writeln!(s, "scale_words {:08x?}", q.scale_words()).unwrap();
    for r in 0..2 {
        let vals: Vec<String> = (0..32).map(|c| format!("{}", q.value(r, c))).collect();
        writeln!(s, "values row {r}: {}", vals.join(" ")).unwrap();
    }
    insta::assert_snapshot!(s);
}
