//! The simulator's attention: the math of `attention.cu` row by row in f32, each stored value
//! rounded once. It keeps no tiles and no running maximum (the row's log-sum-exp is computed
//! first), so it agrees with the GPU within rounding, not bitwise.

use super::super::rng;
use crate::device::{CpuArgs, Float};
use crate::Result;

/// The sizes and dropout arguments every pass but the row terms receives.
struct Call {
    seq: usize,
    pairs: usize,
    hd: usize,
    scale: f32,
    dropout: Option<Dropout>,
}

/// Dropout's coordinates in the counter-based numbers (Note [Graph-safe RNG] in `rng.rs`).
struct Dropout {
    threshold: u32,
    keep_scale: f32,
    seed: u32,
    site: u32,
    step: u64,
}

impl Call {
    fn of(a: &CpuArgs, elems: usize) -> Result<Call> {
        let (seq, pairs) = (a.u32("seq")? as usize, a.u32("pairs")? as usize);
        let threshold = a.u32("threshold")?;
        let dropout = if threshold == 0 {
            None
        } else {
            Some(Dropout {
                threshold,
                keep_scale: a.f32("keep_scale")?,
                seed: a.u32("seed")?,
                site: a.u32("site")?,
                step: rng::step_of(a, "step")?,
            })
        };
        Ok(Call { seq, pairs, hd: elems / (seq * pairs), scale: a.f32("scale")?, dropout })
    }

    /// The factor dropout applies to probability `(pair, i, j)`: 0 if dropped, else the keep
    /// scale (1 without dropout). The element index is that of a `(pairs, T, T)` tensor.
    fn keep(&self, pair: usize, i: usize, j: usize) -> f32 {
        self.dropout.as_ref().map_or(1.0, |d| {
            let n = ((pair * self.seq + i) * self.seq + j) as u64;
            if rng::random_u32(d.seed, d.site, d.step, n) >= d.threshold {
                d.keep_scale
            } else {
                0.0
            }
        })
    }

    /// Row `i` of a pair's `(T, hd)` heads.
    fn row<'h>(&self, heads: &'h [f32], pair: usize, i: usize) -> &'h [f32] {
        let at = (pair * self.seq + i) * self.hd;
        &heads[at..at + self.hd]
    }

    /// The scaled scores of query row `i` against keys `0..=i`.
    fn scores(&self, q: &[f32], k: &[f32], pair: usize, i: usize) -> Vec<f32> {
        let qi = self.row(q, pair, i);
        (0..=i).map(|j| self.scale * dot(qi, self.row(k, pair, j))).collect()
    }
}

/// An input widened to f32 once, so that rows are slices.
fn widen<T: Float>(a: &CpuArgs, param: &str) -> Result<Vec<f32>> {
    Ok(a.input::<T>(param)?.iter().map(|x| x.to_f32()).collect())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// `acc += w · x`.
fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, x)| *a += w * x);
}

fn store<T: Float>(out: &mut [T], at: usize, values: &[f32]) {
    out[at..at + values.len()].iter_mut().zip(values).for_each(|(o, &v)| *o = T::from_f32(v));
}

pub(super) fn forward<T: Float>(a: &CpuArgs) -> Result<()> {
    let (q, k, v) = (widen::<T>(a, "q")?, widen::<T>(a, "k")?, widen::<T>(a, "v")?);
    let c = Call::of(a, q.len())?;
    let (mut out, mut lse) = (a.output::<T>("out")?, a.output::<f32>("lse")?);
    for pair in 0..c.pairs {
        for i in 0..c.seq {
            let s = c.scores(&q, &k, pair, i);
            let m = s.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let l = m + s.iter().map(|s| (s - m).exp()).sum::<f32>().ln();
            let mut o = vec![0.0; c.hd];
            for (j, s) in s.iter().enumerate() {
                axpy(&mut o, (s - l).exp() * c.keep(pair, i, j), c.row(&v, pair, j));
            }
            store(&mut out, (pair * c.seq + i) * c.hd, &o);
            lse[pair * c.seq + i] = l;
        }
    }
    Ok(())
}

pub(super) fn delta<T: Float>(a: &CpuArgs) -> Result<()> {
    let (out, dout) = (a.input::<T>("out")?, a.input::<T>("dout")?);
    let rows = a.u32("seq")? as usize * a.u32("pairs")? as usize;
    let hd = out.len() / rows.max(1);
    let rows = out.chunks_exact(hd).zip(dout.chunks_exact(hd));
    for (d, (o, g)) in a.output::<f32>("delta")?.iter_mut().zip(rows) {
        *d = o.iter().zip(g).map(|(o, g)| o.to_f32() * g.to_f32()).sum();
    }
    Ok(())
}

/// The score gradients `dS_ij` of query row `i` against keys `0..=i`, and the kept
/// probabilities `p̃_ij` (the forward's weights of the values).
fn row_grads(c: &Call, t: &Saved, pair: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let (l, d) = (t.lse[pair * c.seq + i], t.delta[pair * c.seq + i]);
    let g = c.row(&t.dout, pair, i);
    let s = c.scores(&t.q, &t.k, pair, i);
    let mut ds = Vec::with_capacity(s.len());
    let mut kept = Vec::with_capacity(s.len());
    for (j, s) in s.iter().enumerate() {
        let (p, keep) = ((s - l).exp(), c.keep(pair, i, j));
        ds.push(p * (keep * dot(g, c.row(&t.v, pair, j)) - d));
        kept.push(p * keep);
    }
    (ds, kept)
}

/// The backward's inputs, widened.
struct Saved {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    lse: Vec<f32>,
    delta: Vec<f32>,
}

impl Saved {
    fn of<T: Float>(a: &CpuArgs) -> Result<Saved> {
        Ok(Saved {
            q: widen::<T>(a, "q")?,
            k: widen::<T>(a, "k")?,
            v: widen::<T>(a, "v")?,
            dout: widen::<T>(a, "dout")?,
            lse: a.input::<f32>("lse")?.to_vec(),
            delta: a.input::<f32>("delta")?.to_vec(),
        })
    }
}

pub(super) fn backward_dkdv<T: Float>(a: &CpuArgs) -> Result<()> {
    let t = Saved::of::<T>(a)?;
    let c = Call::of(a, t.q.len())?;
    let (mut dk, mut dv) = (a.output::<T>("dk")?, a.output::<T>("dv")?);
    for pair in 0..c.pairs {
        let (mut gk, mut gv) = (vec![0.0; c.seq * c.hd], vec![0.0; c.seq * c.hd]);
        for i in 0..c.seq {
            let (ds, kept) = row_grads(&c, &t, pair, i);
            let (qi, gi) = (c.row(&t.q, pair, i), c.row(&t.dout, pair, i));
            for j in 0..=i {
                axpy(&mut gk[j * c.hd..(j + 1) * c.hd], c.scale * ds[j], qi);
                axpy(&mut gv[j * c.hd..(j + 1) * c.hd], kept[j], gi);
            }
        }
        store(&mut dk, pair * c.seq * c.hd, &gk);
        store(&mut dv, pair * c.seq * c.hd, &gv);
    }
    Ok(())
}

pub(super) fn backward_dq<T: Float>(a: &CpuArgs) -> Result<()> {
    let t = Saved::of::<T>(a)?;
    let c = Call::of(a, t.q.len())?;
    let mut dq = a.output::<T>("dq")?;
    for pair in 0..c.pairs {
        for i in 0..c.seq {
            let (ds, _) = row_grads(&c, &t, pair, i);
            let mut g = vec![0.0; c.hd];
            for (j, ds) in ds.iter().enumerate() {
                axpy(&mut g, c.scale * ds, c.row(&t.k, pair, j));
            }
            store(&mut dq, (pair * c.seq + i) * c.hd, &g);
        }
    }
    Ok(())
}
