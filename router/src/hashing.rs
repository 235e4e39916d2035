//! Stable 64-bit hashing and rendezvous (highest-random-weight) hashing.
//!
//! Keys must map to the same value in every process and on every platform, so the std
//! `Hasher` (randomly keyed) is not used: bytes go through FNV-1a 64 and the result
//! through the SplitMix64 finaliser, which spreads FNV's weak low bits. Rendezvous
//! hashing (Thaler and Ravishankar, "Using name-based mappings to increase hit rates",
//! 1998) picks, for a key, the candidate with the highest `mix(key ^ mix(candidate))`:
//! removing a candidate moves only the keys it held, adding one moves only the keys it
//! now wins (about 1/N of them).

/// FNV-1a 64 of `bytes`, finished with [`mix`].
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

/// The SplitMix64 finaliser: a bijection on u64 with full avalanche.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The rendezvous weight of `candidate` (a hashed replica name) for `key`.
pub fn rendezvous_weight(key: u64, candidate: u64) -> u64 {
    mix(key ^ mix(candidate))
}

/// Position in `candidates` of the rendezvous winner for `key`; `None` when empty.
pub fn rendezvous_pick(key: u64, candidates: impl IntoIterator<Item = u64>) -> Option<usize> {
    candidates
        .into_iter()
        .enumerate()
        .max_by_key(|&(_, c)| rendezvous_weight(key, c))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_across_processes() {
        // Pinned: a change here silently breaks every session's affinity on upgrade.
        assert_eq!(hash_bytes(b""), mix(0xcbf2_9ce4_8422_2325));
        assert_eq!(hash_bytes(b"session-1"), hash_bytes(b"session-1"));
        assert_ne!(hash_bytes(b"session-1"), hash_bytes(b"session-2"));
    }

    #[test]
    fn rendezvous_of_an_empty_set_is_none() {
        assert_eq!(rendezvous_pick(7, []), None);
    }

    #[test]
    fn removing_a_loser_keeps_the_rendezvous_winner() {
        let replicas: Vec<u64> = (0..10)
            .map(|i| hash_bytes(format!("r{i}").as_bytes()))
            .collect();
        for key in 0..200u64 {
            let winner = replicas[rendezvous_pick(key, replicas.iter().copied()).unwrap()];
            let fewer: Vec<u64> = replicas
                .iter()
                .copied()
                .filter(|&r| r == winner || r % 3 != 0)
                .collect();
            assert_eq!(
                fewer[rendezvous_pick(key, fewer.iter().copied()).unwrap()],
                winner
            );
        }
    }

    #[test]
    fn rendezvous_spreads_keys_evenly() {
        let replicas: Vec<u64> = (0..8)
            .map(|i| hash_bytes(format!("r{i}").as_bytes()))
            .collect();
        let mut counts = [0u32; 8];
        for key in 0..8000u64 {
            counts[rendezvous_pick(mix(key), replicas.iter().copied()).unwrap()] += 1;
        }
        // Binomial(8000, 1/8): sd ~ 30; 6 sd either side of 1000.
        assert!(
            counts.iter().all(|&c| (820..1180).contains(&c)),
            "{counts:?}"
        );
    }
}
