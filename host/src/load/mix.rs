//! The task mix of a load run: how many edges stream each model (`--ratio`, shared out by
//! largest remainder) and at which cut each edge splits (its model's cuts, round-robin).
//! Pure: the same options always give the same edges.

use std::str::FromStr;

/// `--ratio 3:1`: the relative share of the edges each config (model) gets, in the order the
/// configs are given. Every weight is a positive integer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ratio(pub Vec<u32>);

impl FromStr for Ratio {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let weights = s
            .split(':')
            .map(|part| match part.trim().parse::<u32>() {
                Ok(w) if w > 0 => Ok(w),
                _ => Err(format!("{s:?}: expected positive whole weights separated by `:`, like 3:1 ({part:?} is not one)")),
            })
            .collect::<Result<Vec<u32>, String>>()?;
        Ok(Self(weights))
    }
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(u32::to_string).collect();
        f.write_str(&parts.join(":"))
    }
}

/// Shares `total` items in proportion to `weights` by largest remainder (Hamilton): each
/// share gets the whole part of its quota, and the items left over go one each to the
/// largest fractional parts, the earlier share first on a tie. The shares sum to `total`.
/// No weight at all, or only zero weights, gives every share nothing.
pub fn apportion(weights: &[u32], total: usize) -> Vec<usize> {
    let sum: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if sum == 0 {
        return vec![0; weights.len()];
    }
    // Exact integer arithmetic: quota_i = total * w_i / sum, remainder kept as a numerator.
    let quotas: Vec<(usize, u64)> = weights
        .iter()
        .map(|&w| {
            let scaled = total as u64 * u64::from(w);
            ((scaled / sum) as usize, scaled % sum)
        })
        .collect();
    let mut shares: Vec<usize> = quotas.iter().map(|&(whole, _)| whole).collect();
    let left = total - shares.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    // A stable sort keeps the earlier share first among equal remainders.
    order.sort_by(|&a, &b| quotas[b].1.cmp(&quotas[a].1));
    for &i in order.iter().take(left) {
        shares[i] += 1;
    }
    shares
}

/// One edge of a load run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeSlot {
    /// Its index, from 0.
    pub edge: usize,
    /// The config (model) it streams, an index into the configs given.
    pub model: usize,
    /// The cut it splits at.
    pub split: usize,
}

/// The edges, model by model: model `m` gets `counts[m]` consecutive edges, and its `j`-th
/// edge splits at `cuts[m][j % cuts[m].len()]`. Every model must have a cut.
pub fn assign_edges(counts: &[usize], cuts: &[Vec<usize>]) -> Vec<EdgeSlot> {
    let mut slots = Vec::with_capacity(counts.iter().sum());
    for (model, (&count, cuts)) in counts.iter().zip(cuts).enumerate() {
        for j in 0..count {
            slots.push(EdgeSlot { edge: slots.len(), model, split: cuts[j % cuts.len()] });
        }
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_parse_and_refuse_what_is_not_a_weight() {
        assert_eq!("3:1".parse::<Ratio>(), Ok(Ratio(vec![3, 1])));
        assert_eq!("2".parse::<Ratio>(), Ok(Ratio(vec![2])));
        assert_eq!(" 1 : 2 : 3 ".parse::<Ratio>(), Ok(Ratio(vec![1, 2, 3])));
        for bad in ["", "3:", "0:1", "a:1", "1.5:1", "-1:2"] {
            assert!(bad.parse::<Ratio>().is_err(), "{bad:?} should be refused");
        }
        assert_eq!(Ratio(vec![3, 1]).to_string(), "3:1");
    }

    #[test]
    fn apportionment_by_largest_remainder() {
        assert_eq!(apportion(&[3, 1], 16), [12, 4]);
        assert_eq!(apportion(&[1, 1], 3), [2, 1], "a tie goes to the earlier share");
        assert_eq!(apportion(&[1, 1, 1], 10), [4, 3, 3]);
        // Quotas 4.2, 2.8, 2.1, 0.9 (of 10 over weights 42:28:21:9): wholes 4, 2, 2, 0 and the two
        // left go to the largest remainders, 0.9 then 0.8.
        assert_eq!(apportion(&[42, 28, 21, 9], 10), [4, 3, 2, 1]);
        assert_eq!(apportion(&[5], 7), [7]);
        assert_eq!(apportion(&[3, 1], 0), [0, 0]);
        assert_eq!(apportion(&[], 4), Vec::<usize>::new());
        for total in 0..50 {
            assert_eq!(apportion(&[7, 2, 5], total).iter().sum::<usize>(), total);
        }
    }

    #[test]
    fn edges_go_model_by_model_and_round_robin_over_cuts() {
        let slots = assign_edges(&[3, 2], &[vec![2, 5], vec![4]]);
        let got: Vec<(usize, usize, usize)> = slots.iter().map(|s| (s.edge, s.model, s.split)).collect();
        assert_eq!(got, [(0, 0, 2), (1, 0, 5), (2, 0, 2), (3, 1, 4), (4, 1, 4)]);
        // The "16 edges over 4 cuts" bench: four edges at each cut.
        let slots = assign_edges(&[16], &[vec![1, 3, 5, 7]]);
        for cut in [1, 3, 5, 7] {
            assert_eq!(slots.iter().filter(|s| s.split == cut).count(), 4);
        }
    }
}
