//! Token and position embedding: `out[b, t] = wte[token[b, t]] + wpe[t]`.
//!
//! Not a [`Module`](super::Module): its input is token ids, not activations, and it has no input
//! gradient. The backward accumulates into both tables (`+=`).

use super::params::init_uniform;
use super::{Builder, Param};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::embedding::{embedding_backward, embedding_forward};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Token (`vocab × dim`) and position (`max_len × dim`) tables.
pub struct Embedding {
    alloc: CachingAllocator,
    /// `(vocab, dim)`.
    pub wte: Param,
    /// `(max_len, dim)`.
    pub wpe: Param,
}

impl Embedding {
    /// The parameters the token and position tables add to their store.
    pub fn parameter_count((vocab, max_len, dim): (usize, usize, usize)) -> usize {
        (vocab + max_len) * dim
    }

    /// Tables `{prefix}.wte` and `{prefix}.wpe` of `vb`, initialized with standard deviation 0.02
    /// (GPT-2's), uniform, from `vb`'s seed.
    ///
    /// # Errors
    /// [`Error::Shape`] when the store is full.
    pub fn new(vb: &Builder, (vocab, max_len, dim): (usize, usize, usize)) -> Result<Embedding> {
        let (bound, seed) = (0.02 * 3f32.sqrt(), vb.seed());
        let wte = vb.add("wte", &[vocab, dim], &init_uniform(vocab * dim, bound, seed))?;
        let wpe = vb.add("wpe", &[max_len, dim], &init_uniform(max_len * dim, bound, seed ^ 0x9e37))?;
        Ok(Embedding { alloc: vb.alloc().clone(), wte, wpe })
    }

    fn dim(&self) -> usize {
        self.wte.value.shape()[1]
    }

    /// `(B, T, dim)` embeddings of `(B, T)` tokens.
    pub fn forward(&self, tokens: &Tensor, stream: &Stream) -> Result<Tensor> {
        let [b, t] = *tokens.shape() else {
            return Err(Error::Shape {
                op: "Embedding::forward",
                expected: "(B, T) tokens".into(),
                found: tokens.shape().to_vec(),
            });
        };
        let out = Tensor::uninit(&self.alloc, stream, &[b, t, self.dim()], self.wte.value.dtype())?;
        embedding_forward(&out, tokens, &self.wte.value, &self.wpe.value, stream)?;
        Ok(out)
    }

    /// Accumulates the tables' gradients from `dout` (`(B, T, dim)`).
    pub fn backward(&self, tokens: &Tensor, dout: &Tensor, stream: &Stream) -> Result<()> {
        embedding_backward(&self.wte.grad, &self.wpe.grad, dout, tokens, stream)
    }

    /// The two tables.
    pub fn parameters(&self) -> Vec<&Param> {
        vec![&self.wte, &self.wpe]
    }
}
