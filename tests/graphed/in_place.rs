//! Replays that read the caller's tensors in place (`forward_in_place`, `backward_in_place`):
//! what cannot be read in place is copied in, and a copy-in replay after an in-place one reads
//! the static input again.

use anyhow::ensure;
use graphed::device::Device;
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedCallable, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, Linear, ParamStore};
use graphed::ops::elementwise;
use graphed::tensor::Tensor;

use super::fixtures::{lcg, Model, Result};

/// A Linear's input is an operand of its GEMM, whose arguments cuBLASLt lays out: it is copied
/// in, and `forward_in_place` gives what `forward` gives.
pub fn gemm_operands_are_copied_in(dev: &Device) -> Result {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::new(&alloc, &s, 2 * Linear::parameter_count((8, 4)))?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3);
    let (a, b) = (Linear::new(&vb.pp("a"), (8, 4))?, Linear::new(&vb.pp("a"), (8, 4))?);
    let x0 = Tensor::from_host(&alloc, &s, &lcg(24, 1), &[3, 8])?;
    let graph = |l: &Linear| {
        make_graphed_callables(&alloc, &[l as &dyn Callable], &[Inputs::one(&x0)], GraphOptions::default())
    };
    let (ga, gb) = (graph(&a)?, graph(&b)?);
    ensure!(gb[0].in_place_inputs()? == [false], "a GEMM operand");
    for k in 0..2 {
        let x = Tensor::from_host(&alloc, &s, &lcg(24, 10 + k), &[3, 8])?;
        let (ya, _t) = ga[0].forward(&s, &Inputs::one(&x), Replay::caller())?;
        let (yb, _t) = gb[0].forward_in_place(&s, &Inputs::one(&x), Replay::caller())?;
        ensure!(ya[0].get()?.to_vec::<f32>(&s)? == yb[0].get()?.to_vec::<f32>(&s)?);
        ensure!(gb[0].static_inputs()?[0].to_vec::<f32>(&s)? == lcg(24, 10 + k), "copied in");
        let dy = Tensor::from_host(&alloc, &s, &lcg(12, 20 + k), &[3, 4])?;
        let (dxa, _t) = ga[0].backward(&s, &[&dy])?;
        let (dxb, _t) = gb[0].backward_in_place(&s, &[&dy])?;
        let read = |d: &[Option<graphed::graph::StaticTensor>]| -> Result<Vec<f32>> {
            Ok(d[0].as_ref().expect("an input gradient").get()?.to_vec::<f32>(&s)?)
        };
        ensure!(read(&dxa)? == read(&dxb)?);
    }
    Ok(())
}

/// Two microbatches through one transformer layer: the first read in place, the second copied
/// in. The second's backward reads the static input again, not the first's tensor (which is
/// overwritten before it runs), and every result equals a twin that copies both in.
pub fn a_copy_in_replay_after_an_in_place_one_reads_the_static_input(dev: &Device) -> Result {
    let (twin, model) = (Model::new(dev)?, Model::new(dev)?);
    let (x0, _) = model.data(0)?;
    let graph =
        |m: &Model| make_graphed_callables(&m.alloc, &m.callables()[..1], &[Inputs::one(&x0)], GraphOptions::default());
    let (copying, mine) = (graph(&twin)?, graph(&model)?);
    ensure!(mine[0].in_place_inputs()? == [true]);
    // Microbatch `k` (input `x`) through `g`, read in place or copied in; `between` runs after
    // the forward.
    let run = |m: &Model,
               g: &GraphedCallable,
               k: u64,
               x: &Tensor,
               in_place: bool,
               between: &dyn Fn() -> Result|
     -> Result<(Vec<f32>, Vec<f32>)> {
        let (y, _t) = match in_place {
            true => g.forward_in_place(&m.s, &Inputs::one(x), Replay::caller())?,
            false => g.forward(&m.s, &Inputs::one(x), Replay::caller())?,
        };
        let y = y[0].get()?.to_f32_vec(&m.s)?;
        between()?;
        let (dx, _t) = g.backward(&m.s, &[&m.data(k)?.1])?;
        Ok((y, dx[0].as_ref().expect("an input gradient").get()?.to_f32_vec(&m.s)?))
    };
    let nothing = || Ok(());
    let x1 = model.data(1)?.0;
    let first = run(&model, &mine[0], 1, &x1, true, &nothing)?;
    // Reading x1 now would change the second backward: the copy-in replay must not.
    let overwrite_x1 = || Ok(elementwise::fill(x1.view::<f32>()?, 1e3, &model.s)?);
    let second = run(&model, &mine[0], 2, &model.data(2)?.0, false, &overwrite_x1)?;
    ensure!(first == run(&twin, &copying[0], 1, &twin.data(1)?.0, false, &nothing)?, "the in-place microbatch");
    ensure!(second == run(&twin, &copying[0], 2, &twin.data(2)?.0, false, &nothing)?, "the copied-in microbatch");
    ensure!(model.grads()? == twin.grads()?, "accumulated parameter gradients");
    Ok(())
}

/// A replay that feeds the tensors the one before fed rebinds nothing; a new tensor moves the
/// same nodes, and a copy-in replay moves them back.
pub fn rebinding_happens_only_when_the_tensors_change(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let (x0, _) = model.data(0)?;
    let g =
        make_graphed_callables(&model.alloc, &model.callables()[..1], &[Inputs::one(&x0)], GraphOptions::default())?;
    let ((x1, dy), (x2, _)) = (model.data(1)?, model.data(2)?);
    let mut moved = Vec::new();
    for (x, in_place) in [(&x1, true), (&x1, true), (&x2, true), (&x2, false)] {
        let (_y, _t) = match in_place {
            true => g[0].forward_in_place(&model.s, &Inputs::one(x), Replay::caller())?,
            false => g[0].forward(&model.s, &Inputs::one(x), Replay::caller())?,
        };
        moved.push(g[0].rebound_nodes());
        let (_dx, _tail) = g[0].backward(&model.s, &[&dy])?;
    }
    ensure!(moved[0] > 0 && moved == [moved[0], 0, moved[0], moved[0]], "nodes moved per replay: {moved:?}");
    Ok(())
}
