//! What the model learns: 3-digit addition scored on held-out sums (`addition.rs`), or the bytes
//! of a text file (`text.rs`); their batches and their end-of-run scores.

use std::collections::HashSet;

use graphed::device::Stream;
use graphed::dist::GradReduction;
use graphed::memory::CachingAllocator;
use graphed::nn::Gpt;
use graphed::tensor::Tensor;
use rand::rngs::SmallRng;

use super::addition::{self, Batch};
use super::text;
use crate::cli::args::TrainArgs;

/// What the model learns.
pub enum Task {
    /// 3-digit addition, scored on held-out sums.
    Addition { held: Vec<(u32, u32)>, held_set: HashSet<(u32, u32)> },
    /// The bytes of a text file.
    Text(text::Corpus),
}

impl Task {
    /// The task of `args`: `--data`'s text, else addition with `eval` held-out sums.
    pub fn new(args: &TrainArgs, eval: usize) -> anyhow::Result<Task> {
        match &args.data {
            Some(path) => Ok(Task::Text(text::Corpus::load(path, args.context as usize)?)),
            None => {
                let held = addition::held_out(eval, args.seed ^ 0x5eed);
                let held_set = held.iter().copied().collect();
                Ok(Task::Addition { held, held_set })
            }
        }
    }

    /// The vocabulary and the positions per sequence.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Task::Addition { .. } => (addition::VOCAB, addition::INPUT),
            Task::Text(c) => (text::VOCAB, c.seq()),
        }
    }

    /// Rank `rank`'s training batch of `b` sequences: its part of the whole batch of the `world`
    /// ranks, drawn whole by every rank (so that the data does not depend on how the batch is
    /// split: a group trains on what one process does with the whole batch). Its loss weights
    /// average over its own `b` sequences when the ranks' gradients are averaged, over the
    /// whole batch when they are summed: either way the gradients combine into the whole
    /// batch's mean loss.
    pub fn batch(
        &self,
        rng: &mut SmallRng,
        b: usize,
        (rank, world): (usize, usize),
        reduction: GradReduction,
    ) -> Batch {
        let whole = b * world;
        let over = match reduction {
            GradReduction::Mean => b,
            GradReduction::Sum => whole,
        };
        let batch = match self {
            Task::Addition { held_set, .. } => addition::batch(rng, whole, over, held_set),
            Task::Text(c) => c.batch(rng, whole, over),
        };
        batch.part(rank, world)
    }

    /// What the loss is of.
    pub fn loss_of(&self) -> &'static str {
        match self {
            Task::Addition { .. } => "answer digits",
            Task::Text(_) => "bytes, training windows",
        }
    }

    /// The data, for the banner; `None` for addition, which the model line says enough about.
    pub fn describe(&self) -> Option<String> {
        match self {
            Task::Addition { .. } => None,
            Task::Text(c) => Some(format!("data: {}", c.describe())),
        }
    }

    /// Prints the end-of-run score.
    pub fn report(&self, model: &Gpt, alloc: &CachingAllocator, s: &Stream) -> anyhow::Result<()> {
        match self {
            Task::Addition { held, .. } => {
                let accuracy = accuracy(model, alloc, s, held)?;
                println!("exact-match accuracy on {} held-out sums: {:.1}%", held.len(), 100.0 * accuracy);
            }
            Task::Text(c) => {
                println!("held-out loss {:.4} (bytes, cross-entropy)", c.validation_loss(model, alloc, s, 64)?);
                println!("sample: {:?}", c.sample(model, alloc, s, 80)?);
            }
        }
        Ok(())
    }
}

/// Greedy decoding of each held-out sum's answer, one digit at a time; the share that is exact.
fn accuracy(model: &Gpt, alloc: &CachingAllocator, s: &Stream, held: &[(u32, u32)]) -> anyhow::Result<f64> {
    let mut rows: Vec<Vec<u32>> =
        held.iter().map(|(a, b)| addition::encode(*a, *b)[..addition::INPUT].to_vec()).collect();
    for row in &mut rows {
        row[addition::PROMPT + 1..].fill(0);
    }
    let vocab = addition::VOCAB;
    for pos in addition::PROMPT..addition::INPUT {
        let flat: Vec<u32> = rows.iter().flatten().copied().collect();
        let tokens = Tensor::from_host(alloc, s, &flat, &[rows.len(), addition::INPUT])?;
        let probs = model.probabilities(&tokens, s)?.to_f32_vec(s)?;
        for (r, row) in rows.iter_mut().enumerate() {
            let p = &probs[(r * addition::INPUT + pos) * vocab..][..vocab];
            let best = (0..vocab).max_by(|a, b| p[*a].total_cmp(&p[*b])).unwrap_or(0) as u32;
            if pos + 1 < addition::INPUT {
                row[pos + 1] = best;
            } else {
                row.push(best);
            }
        }
    }
    let correct = rows
        .iter()
        .zip(held)
        .filter(|(row, (a, b))| addition::decode_answer(&row[addition::PROMPT + 1..]) == a + b)
        .count();
    Ok(correct as f64 / held.len() as f64)
}
