//! Data parallelism on two devices: each rank steps a graphed stack on its own microbatch, the
//! gradients averaged inside the captured backward graphs, or on graphs of their own that wait on
//! each layer's backward through typed edges (`ReductionGraphs`); either equals one device that
//! accumulates both microbatches, halved, bit for bit (halving is exact: one device whose loss is
//! the mean over both microbatches, its output gradients halved, gets the same).
//!
//! `cargo run --example data_parallel`: two simulated devices in this process, one thread each
//! (`dist::on_sim_ranks`). Started as two ranks with torchrun's variables (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), the same rank code runs one process per GPU
//! through NCCL, and each rank checks its gradients against one GPU with both microbatches (as
//! `graphed launch --gpus 2 -- train` trains).

use graphed::device::{CommOptions, Communicator, Device, SimConfig, Stream};
use graphed::dist::{on_sim_ranks, DataParallel, ProcessGroup, RankEnv, ReductionGraphs};
use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Layers, ParamStore, Stack, TransformerLayer};
use graphed::tensor::Tensor;

/// Two layers of width 32, the same on every rank (same seeds), and their parameter store.
fn model(dev: &Device) -> graphed::Result<(CachingAllocator, Stream, ParamStore, Stack<TransformerLayer>)> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, 2 * TransformerLayer::parameter_count(32))?;
    let vb = Builder::new(&store, &alloc, &s)?;
    let layers = TransformerLayer::stack(&vb, (32, 1), &Layers::first(2))?;
    Ok((alloc, s, store, Stack::new(layers)))
}

/// Microbatch `k`: an input and the gradient a loss would send back.
fn microbatch(alloc: &CachingAllocator, s: &Stream, k: u64) -> graphed::Result<(Tensor, Tensor)> {
    let at = |salt: u64| -> Vec<f32> {
        (0..4 * 8 * 32).map(|i| ((i as u64 * 31 + k * 7 + salt) % 19) as f32 / 19.0 - 0.5).collect()
    };
    Ok((Tensor::from_host(alloc, s, &at(0), &[4, 8, 32])?, Tensor::from_host(alloc, s, &at(500), &[4, 8, 32])?))
}

/// One rank: its microbatch through a graphed stack whose backward graphs reduce the gradients,
/// or (`own_graphs`) whose backward graphs signal graphs of their own that do.
fn rank(comm: &Communicator, own_graphs: bool) -> graphed::Result<Vec<f32>> {
    let (alloc, s, store, stack) = model(comm.device())?;
    let (x, dy) = microbatch(&alloc, &s, comm.rank() as u64)?;
    let dp = DataParallel::for_stack(comm, &store, &stack)?;
    let (options, reduce) = match own_graphs {
        false => (GraphOptions::default().grad_sync(dp), None),
        true => {
            let reduce = ReductionGraphs::capture(&alloc, dp)?;
            (reduce.signalled(GraphOptions::default()), Some(reduce))
        }
    };
    let graphed = make_graphed_stack(&alloc, &stack, &x, options)?;
    graphed.forward(&s, &x, Replay::caller())?;
    graphed.backward(&s, &dy)?;
    if let Some(reduce) = &reduce {
        reduce.replay(&s)?;
    }
    graphed.join(&s)?;
    store.grads()?.to_vec::<f32>(&s)
}

/// Where each run reduces, as its lines say.
const PLACEMENTS: [(bool, &str); 2] = [(false, "inside the backward graphs"), (true, "on graphs of their own")];

/// The gradients of one device on `dev` that accumulates both microbatches, halved: their mean.
fn one_device(dev: &Device) -> graphed::Result<Vec<f32>> {
    let (alloc, s, store, stack) = model(dev)?;
    let (x0, _) = microbatch(&alloc, &s, 0)?;
    let graphed = make_graphed_stack(&alloc, &stack, &x0, GraphOptions::default())?;
    for k in 0..2 {
        let (x, dy) = microbatch(&alloc, &s, k)?;
        graphed.forward(&s, &x, Replay::caller())?;
        graphed.backward(&s, &dy)?;
    }
    Ok(store.grads()?.to_vec::<f32>(&s)?.into_iter().map(|g| g * 0.5).collect())
}

fn main() -> graphed::Result<()> {
    let Some(env) = RankEnv::from_env()? else {
        let want = one_device(&Device::sim())?;
        for (own_graphs, place) in PLACEMENTS {
            let ranks = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| rank(c, own_graphs));
            for (r, grads) in ranks.into_iter().enumerate() {
                let same = grads? == want;
                println!(
                    "rank {r}, reduced {place}: gradients equal to their mean on one device with both microbatches, \
                     bit for bit: {same}"
                );
                assert!(same);
            }
        }
        return Ok(());
    };
    // One process per rank, on GPU LOCAL_RANK.
    env.require_world(2, "this example gives each of two ranks one microbatch")?;
    let dev = env.gpu()?;
    let group = ProcessGroup::join(&dev, env, "examples/data_parallel", CommOptions::default())?;
    let want = one_device(&dev)?;
    let r = group.comm().rank();
    for (own_graphs, place) in PLACEMENTS {
        let same = rank(group.comm(), own_graphs)? == want;
        println!(
            "rank {r}, reduced {place}: gradients over NCCL equal to their mean on one GPU with both microbatches, \
             bit for bit: {same}"
        );
        assert!(same, "rank {r}'s gradients must equal one GPU's");
    }
    group.leave();
    Ok(())
}
