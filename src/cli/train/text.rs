//! `train --data FILE`: a byte-level language model of a local text file. The file's first 90%
//! trains (random windows each step), its last 10% is held out for the validation loss, and the
//! model writes a short sample at the end. Nothing is downloaded.

use std::path::Path;

use graphed::device::Stream;
use graphed::memory::CachingAllocator;
use graphed::nn::Gpt;
use graphed::tensor::Tensor;
use rand::rngs::SmallRng;
use rand::Rng;

use super::addition::Batch;

/// Every byte value.
pub const VOCAB: usize = 256;

/// A text file split into training and held-out bytes.
pub struct Corpus {
    train: Vec<u8>,
    held: Vec<u8>,
    /// Positions per window.
    seq: usize,
}

impl Corpus {
    /// Reads `path`, refusing a file with fewer than two windows of `seq + 1` bytes in either
    /// split.
    pub fn load(path: &Path, seq: usize) -> anyhow::Result<Corpus> {
        let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("cannot read --data {}: {e}", path.display()))?;
        let cut = bytes.len() * 9 / 10;
        let need = 10 * 2 * (seq + 1);
        if bytes.len() < need {
            anyhow::bail!(
                "--data {} has {} bytes; a byte-level model with {seq}-byte windows needs at least {need} (10% are held out)",
                path.display(),
                bytes.len()
            );
        }
        Ok(Corpus { held: bytes[cut..].to_vec(), train: bytes[..cut].to_vec(), seq })
    }

    /// Positions per window.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Training and held-out bytes, for the banner.
    pub fn describe(&self) -> String {
        format!("{} training bytes, {} held out, {}-byte windows", self.train.len(), self.held.len(), self.seq)
    }

    /// `b` random windows of the training bytes: each position predicts the next byte, every
    /// position weighed `1 / (over · seq)` (the loss is the mean cross-entropy per byte over
    /// `over` windows: `b`, or the whole batch `b` is a rank's part of).
    pub fn batch(&self, rng: &mut SmallRng, b: usize, over: usize) -> Batch {
        let mut batch = Batch { inputs: Vec::new(), targets: Vec::new(), weights: Vec::new() };
        for _ in 0..b {
            let at = rng.random_range(0..self.train.len() - self.seq);
            let window = &self.train[at..at + self.seq + 1];
            batch.inputs.extend(window[..self.seq].iter().map(|&c| u32::from(c)));
            batch.targets.extend(window[1..].iter().map(|&c| u32::from(c)));
        }
        batch.weights = vec![1.0 / (over * self.seq) as f32; b * self.seq];
        batch
    }

    /// The mean cross-entropy per byte over up to `b` consecutive held-out windows.
    pub fn validation_loss(&self, model: &Gpt, alloc: &CachingAllocator, s: &Stream, b: usize) -> anyhow::Result<f64> {
        let windows = ((self.held.len() - 1) / self.seq).min(b);
        let window = |k: usize| &self.held[k * self.seq..k * self.seq + self.seq + 1];
        let inputs: Vec<u32> = (0..windows).flat_map(|k| window(k)[..self.seq].iter().map(|&c| u32::from(c))).collect();
        let targets: Vec<u32> = (0..windows).flat_map(|k| window(k)[1..].iter().map(|&c| u32::from(c))).collect();
        let tokens = Tensor::from_host(alloc, s, &inputs, &[windows, self.seq])?;
        let targets = Tensor::from_host(alloc, s, &targets, &[windows * self.seq])?;
        let (losses, _) = model.forward(&tokens, &targets, s)?;
        let losses = losses.to_vec::<f32>(s)?;
        Ok(losses.iter().map(|l| f64::from(*l)).sum::<f64>() / losses.len() as f64)
    }

    /// `n` bytes the model writes greedily after the first window of the held-out text.
    pub fn sample(&self, model: &Gpt, alloc: &CachingAllocator, s: &Stream, n: usize) -> anyhow::Result<String> {
        let mut text: Vec<u32> = self.held[..self.seq].iter().map(|&c| u32::from(c)).collect();
        for _ in 0..n {
            let window = &text[text.len() - self.seq..];
            let tokens = Tensor::from_host(alloc, s, window, &[1, self.seq])?;
            let probs = model.probabilities(&tokens, s)?.to_f32_vec(s)?;
            let last = &probs[(self.seq - 1) * VOCAB..][..VOCAB];
            text.push((0..VOCAB).max_by(|a, b| last[*a].total_cmp(&last[*b])).unwrap_or(0) as u32);
        }
        let written: Vec<u8> = text[self.seq..].iter().map(|&c| c as u8).collect();
        Ok(String::from_utf8_lossy(&written).into_owned())
    }
}
