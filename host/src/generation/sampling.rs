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
    /// Whether the most likely token is taken.
    fn greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// How many of a token's most likely next tokens its draw is among: 1 greedy, top-k
    /// with one, 0 (all of them) without.
    pub fn candidates(&self) -> u32 {
        if self.greedy() {
            1
        } else {
            u32::try_from(self.top_k).unwrap_or(u32::MAX)
        }
    }

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
        self.next_among(logits.iter().copied().enumerate())
    }

    /// The next token from `candidates` (token id, logit), in any order: the whole
    /// vocabulary, or its [`Sampling::candidates`] most likely tokens, which give the token
    /// the whole vocabulary gives (among equal logits the lower id ranks first).
    pub fn next_among(&mut self, candidates: impl IntoIterator<Item = (usize, f32)>) -> i64 {
        if self.sampling.greedy() {
            let first = |best: (usize, f32), (i, l): (usize, f32)| if l > best.1 || (l == best.1 && i < best.0) { (i, l) } else { best };
            // No id stays usize::MAX only where every logit is NaN: token 0, as before.
            let (id, _) = candidates.into_iter().fold((usize::MAX, f32::NEG_INFINITY), first);
            return if id == usize::MAX { 0 } else { id as i64 };
        }
        let mut ranked: Vec<(usize, f64)> = candidates.into_iter().map(|(i, l)| (i, f64::from(l) / self.sampling.temperature)).collect();
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

    /// What the server answers for a step of a top_k: the k first of the logits ranked
    /// (the larger first, the lower id first among equals), here in reverse.
    fn most_likely(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
        let mut ranked: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(k);
        ranked.reverse();
        ranked
    }

    #[test]
    fn a_draw_among_the_most_likely_is_the_draw_from_the_whole_vocabulary() {
        // Logits of many ties (small integers) and of none.
        let tied: Vec<f32> = (0..64u32).map(|i| ((i * 7919) % 5) as f32).collect();
        let spread: Vec<f32> = (0..64u32).map(|i| ((i * 7919) % 97) as f32 / 13.0).collect();
        for logits in [&tied, &spread] {
            for sampling in [
                Sampling::default(),
                Sampling { temperature: 0.7, top_k: 1, ..Sampling::default() },
                Sampling { temperature: 0.7, top_k: 5, seed: 2, ..Sampling::default() },
                Sampling { temperature: 1.3, top_k: 20, top_p: 0.8, seed: 9 },
            ] {
                let k = sampling.candidates() as usize;
                assert!(k > 0, "{sampling:?} draws among its most likely");
                let (mut whole, mut among) = (Sampler::new(sampling), Sampler::new(sampling));
                let from_whole: Vec<i64> = (0..100).map(|_| whole.next(logits)).collect();
                let from_among: Vec<i64> = (0..100).map(|_| among.next_among(most_likely(logits, k))).collect();
                assert_eq!(from_whole, from_among, "{sampling:?}");
            }
        }
        assert_eq!(Sampling { temperature: 0.7, ..Sampling::default() }.candidates(), 0, "without top-k every token can be drawn");
    }

    #[test]
    fn bad_values_name_their_flag() {
        assert!(Sampling { temperature: -1.0, ..Sampling::default() }.validate().unwrap_err().contains("--temperature"));
        assert!(Sampling { top_p: 0.0, ..Sampling::default() }.validate().unwrap_err().contains("--top-p"));
        assert!(Sampling { top_p: 1.5, ..Sampling::default() }.validate().unwrap_err().contains("--top-p"));
    }
}
