//! Greedy decoding's choice: the index of each row's largest value, ties to the lowest
//! index, NaN never chosen, and 0 for a row with no number.

/// The argmax of each `vocab`-wide row of `logits`.
///
/// Panics if `vocab` is 0 or does not divide `logits.len()`.
pub fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    assert!(vocab > 0 && logits.len() % vocab == 0, "rows of {vocab}");
    logits
        .chunks(vocab)
        .map(|row| {
            let mut best: Option<usize> = None;
            for (i, &v) in row.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|b| v > row[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_low_and_nan_never_wins() {
        let rows = [
            1.0,
            3.0,
            3.0,
            -1.0, // tie: index 1
            f32::NAN,
            -5.0,
            f32::NEG_INFINITY,
            -5.0, // NaN first: index 1
            f32::NAN,
            f32::NAN,
            f32::NAN,
            f32::NAN, // no number: 0
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::INFINITY,
            2.0,
        ];
        assert_eq!(argmax_rows(&rows, 4), vec![1, 1, 0, 2]);
    }
}
