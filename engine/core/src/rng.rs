//! A seeded random generator without dependencies, shared by the runtime (sampling,
//! synthetic weights, the default model), the workload generator, the router's simulator
//! and the oracle's test data.
//!
//! The generator is xoshiro256** (Blackman and Vigna, "Scrambled linear pseudorandom
//! number generators", 2021) seeded through SplitMix64, the seeding its authors
//! recommend. The same seed gives the same stream on every platform, so a failing
//! case is reproduced by its seed alone. Invariants: `uniform()` is in `[0, 1)` with
//! 53 random bits; `below(n)` is unbiased.

/// A seeded xoshiro256** generator.
#[derive(Debug, Clone)]
pub struct Rng {
    state: [u64; 4],
}

/// One SplitMix64 step: advances `x` and returns a well-mixed output.
fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        // SplitMix64 never yields four zero words in a row, so the state is valid.
        Self {
            state: [
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
            ],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, a multiple of 2^-53.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, 1)` as f32, a multiple of 2^-24.
    pub fn uniform_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform integer in `0..n`, unbiased (rejection of the incomplete last range).
    ///
    /// Panics if `n == 0`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0) has no values");
        let n = n as u64;
        let limit = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < limit {
                return (x % n) as usize;
            }
        }
    }

    /// Shuffles `items` in place (Fisher-Yates): every permutation equally likely.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }

    /// Standard normal (Box-Muller; one of the pair is discarded for simplicity).
    pub fn normal(&mut self) -> f64 {
        // 1 - uniform() is in (0, 1], so the logarithm is finite.
        let r = (-2.0 * (1.0 - self.uniform()).ln()).sqrt();
        r * (2.0 * std::f64::consts::PI * self.uniform()).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }

    #[test]
    fn uniform_and_normal_moments() {
        let mut rng = Rng::new(9);
        let n = 200_000;
        let u: Vec<f64> = (0..n).map(|_| rng.uniform()).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "{mean}");
        let z: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let zm = z.iter().sum::<f64>() / n as f64;
        let zv = z.iter().map(|x| (x - zm).powi(2)).sum::<f64>() / n as f64;
        assert!(zm.abs() < 0.01 && (zv - 1.0).abs() < 0.02, "{zm} {zv}");
    }

    #[test]
    fn below_covers_its_range() {
        let mut rng = Rng::new(3);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[rng.below(7)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 850 && c < 1150), "{seen:?}");
    }
}
