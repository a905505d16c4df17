//! The training task: 3-digit addition, written `aaa+bbb=cccc` with the sum's digits reversed
//! (least significant first, the order a carry propagates), so a small GPT can learn it without
//! any data to download.

use std::collections::HashSet;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Digits 0–9, `+` and `=`.
pub const VOCAB: usize = 12;
const PLUS: u32 = 10;
const EQUALS: u32 = 11;
const DIGITS: usize = 3;
const ANSWER: usize = DIGITS + 1;
/// Tokens of one example.
pub const SEQ: usize = 2 * DIGITS + 2 + ANSWER;
/// Tokens the model reads (it predicts each next one).
pub const INPUT: usize = SEQ - 1;
/// Where the prompt ends: the model's first answer digit is predicted at this input position.
pub const PROMPT: usize = 2 * DIGITS + 1;
const MAX: u32 = 1000;

fn digits(mut v: u32, n: usize) -> impl Iterator<Item = u32> {
    (0..n).map(move |_| {
        let d = v % 10;
        v /= 10;
        d
    })
}

/// The tokens of `a+b=` and the reversed sum.
pub fn encode(a: u32, b: u32) -> [u32; SEQ] {
    let mut t = [0; SEQ];
    let mut a_digits: Vec<u32> = digits(a, DIGITS).collect();
    let mut b_digits: Vec<u32> = digits(b, DIGITS).collect();
    a_digits.reverse();
    b_digits.reverse();
    t[..DIGITS].copy_from_slice(&a_digits);
    t[DIGITS] = PLUS;
    t[DIGITS + 1..2 * DIGITS + 1].copy_from_slice(&b_digits);
    t[2 * DIGITS + 1] = EQUALS;
    for (slot, d) in t[2 * DIGITS + 2..].iter_mut().zip(digits(a + b, ANSWER)) {
        *slot = d;
    }
    t
}

/// The sum a reversed answer stands for.
pub fn decode_answer(answer: &[u32]) -> u32 {
    answer.iter().rev().fold(0, |acc, d| acc * 10 + d)
}

/// Held-out sums, never trained on.
pub fn held_out(n: usize, seed: u64) -> Vec<(u32, u32)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let pair = (rng.random_range(0..MAX), rng.random_range(0..MAX));
        if seen.insert(pair) {
            out.push(pair);
        }
    }
    out
}

/// A training batch: inputs and next-token targets `(B·INPUT)`, and loss weights that keep the
/// answer positions only, averaged over the batch (or over a larger one it is a part of).
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Batch {
    /// Part `index` of `parts` equal parts, in order (a rank's share of the whole batch), its
    /// weights as they were.
    pub fn part(self, index: usize, parts: usize) -> Batch {
        fn cut<T>(v: Vec<T>, index: usize, parts: usize) -> Vec<T> {
            let len = v.len() / parts;
            v.into_iter().skip(index * len).take(len).collect()
        }
        Batch {
            inputs: cut(self.inputs, index, parts),
            targets: cut(self.targets, index, parts),
            weights: cut(self.weights, index, parts),
        }
    }
}

/// Draws a batch of `b` sums that are not in `held_out`, whose weights average over `over` sums
/// (`b`, or the whole batch `b` is a rank's part of).
pub fn batch(rng: &mut SmallRng, b: usize, over: usize, held_out: &HashSet<(u32, u32)>) -> Batch {
    let mut batch = Batch {
        inputs: Vec::with_capacity(b * INPUT),
        targets: Vec::with_capacity(b * INPUT),
        weights: Vec::with_capacity(b * INPUT),
    };
    let weight = 1.0 / (over * ANSWER) as f32;
    while batch.inputs.len() < b * INPUT {
        let pair = (rng.random_range(0..MAX), rng.random_range(0..MAX));
        if held_out.contains(&pair) {
            continue;
        }
        let t = encode(pair.0, pair.1);
        batch.inputs.extend_from_slice(&t[..INPUT]);
        batch.targets.extend_from_slice(&t[1..]);
        batch.weights.extend((0..INPUT).map(|i| if i >= PROMPT { weight } else { 0.0 }));
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_encode_and_decode() {
        let t = encode(907, 95);
        assert_eq!(t, [9, 0, 7, PLUS, 0, 9, 5, EQUALS, 2, 0, 0, 1]);
        assert_eq!(decode_answer(&t[2 * DIGITS + 2..]), 1002);
    }

    #[test]
    fn batches_avoid_held_out_sums_and_weigh_only_answers() {
        let held: HashSet<(u32, u32)> = held_out(500, 1).into_iter().collect();
        let mut rng = SmallRng::seed_from_u64(2);
        let b = batch(&mut rng, 64, 64, &held);
        assert_eq!(b.inputs.len(), 64 * INPUT);
        assert!((b.weights.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        for ex in b.inputs.chunks(INPUT) {
            let a = ex[..3].iter().fold(0, |acc, d| acc * 10 + d);
            let c = ex[4..7].iter().fold(0, |acc, d| acc * 10 + d);
            assert!(!held.contains(&(a, c)));
        }
    }

    #[test]
    fn a_part_of_a_batch_is_its_slice_of_whole_sums_with_the_wholes_weights() {
        let mut rng = SmallRng::seed_from_u64(3);
        let whole = batch(&mut rng, 6, 6, &HashSet::new());
        let (inputs, weights) = (whole.inputs.clone(), whole.weights.clone());
        let second = whole.part(1, 3);
        assert_eq!(second.inputs, inputs[2 * INPUT..4 * INPUT]);
        assert_eq!(second.targets.len(), 2 * INPUT);
        assert_eq!(second.weights, weights[2 * INPUT..4 * INPUT]);
    }
}
