//! The next token from a row's logits: greedy, or drawn with a temperature from the top-k
//! most likely and the smallest set whose probability reaches top-p, from a seeded generator
//! (the same seed, the same tokens).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); otherwise the logits are divided by it.
    pub temperature: f64,
    /// Draw among the k most likely tokens only (0: all).
    pub top_k: usize,
    /// Draw among the most likely tokens whose probabilities add up to p (1: all).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl Sampling {
    /// Checks the values; an error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("--temperature {}: 0 (greedy) or positive", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("--top-p {}: above 0, at most 1", self.top_p));
        }
        Ok(())
    }
}

/// Draws tokens by a [`Sampling`].
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// A sampler whose generator starts from the seed.
    pub fn new(sampling: Sampling) -> Self {
        Self { sampling, rng: StdRng::seed_from_u64(sampling.seed) }
    }

    /// The next token from one row's `logits` (over the vocabulary).
    pub fn next(&mut self, logits: &[f32]) -> i64 {
        let greedy = || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best }).0;
        if self.sampling.temperature == 0.0 || self.sampling.top_k == 1 {
            return greedy() as i64;
        }
        let mut ranked: Vec<(usize, f64)> = logits.iter().enumerate().map(|(i, &l)| (i, f64::from(l) / self.sampling.temperature)).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.sampling.top_k > 0 {
            ranked.truncate(self.sampling.top_k);
        }
        let top = ranked[0].1;
        let weights: Vec<f64> = ranked.iter().map(|&(_, l)| (l - top).exp()).collect();
        let total: f64 = weights.iter().sum();
        // The smallest prefix whose probability reaches top-p (at least the first token).
        let (mut kept, mut mass) = (0, 0.0);
        while kept < weights.len() && (kept == 0 || mass < self.sampling.top_p * total) {
            mass += weights[kept];
            kept += 1;
        }
        let mut draw = self.rng.gen::<f64>() * mass;
        for (&(token, _), &w) in ranked.iter().zip(&weights).take(kept) {
            if draw < w {
                return token as i64;
            }
            draw -= w;
        }
        ranked[kept - 1].0 as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(sampling: Sampling, logits: &[f32], n: usize) -> Vec<i64> {
        let mut sampler = Sampler::new(sampling);
        (0..n).map(|_| sampler.next(logits)).collect()
    }

    #[test]
    fn greedy_takes_the_most_likely_and_the_filters_keep_what_they_say() {
        let logits = [0.0, 3.0, 2.9, -1.0, 1.0];
        assert_eq!(draws(Sampling::default(), &logits, 3), [1, 1, 1]);
        let warm = Sampling { temperature: 1.0, seed: 7, ..Sampling::default() };
        assert_eq!(draws(Sampling { top_k: 1, ..warm }, &logits, 3), [1, 1, 1], "top-k 1 is greedy");
        let two = draws(Sampling { top_k: 2, ..warm }, &logits, 200);
        assert!(two.iter().all(|t| [1, 2].contains(t)) && two.contains(&1) && two.contains(&2), "{two:?}");
        // Tokens 1 and 2 hold about 0.47 and 0.43 of the probability: 0.5 needs both, 0.4 one.
        let p = draws(Sampling { top_p: 0.4, ..warm }, &logits, 100);
        assert!(p.iter().all(|&t| t == 1), "{p:?}");
        let p = draws(Sampling { top_p: 0.5, ..warm }, &logits, 200);
        assert!(p.iter().all(|t| [1, 2].contains(t)) && p.contains(&2), "{p:?}");
        let all = draws(warm, &logits, 2000);
        assert!((0..5).all(|t| all.contains(&t)), "every token can be drawn without filters");
        assert_eq!(draws(warm, &logits, 50), draws(warm, &logits, 50), "the same seed, the same tokens");
        assert_ne!(draws(warm, &logits, 50), draws(Sampling { seed: 8, ..warm }, &logits, 50));
    }

    #[test]
    fn bad_values_name_their_flag() {
        assert!(Sampling { temperature: -1.0, ..Sampling::default() }.validate().unwrap_err().contains("--temperature"));
        assert!(Sampling { top_p: 0.0, ..Sampling::default() }.validate().unwrap_err().contains("--top-p"));
        assert!(Sampling { top_p: 1.5, ..Sampling::default() }.validate().unwrap_err().contains("--top-p"));
    }
}
