//! Pipeline parallelism on two devices: the four layers of a model split into two stages of two
//! chunks each (stage s holds layers s and s + 2), stepped under interleaved 1F1B with one graph
//! per (layer, microbatch) and the sends and receives between stages replayed from graphs too;
//! the result equals the whole model on one device, bit for bit.
//!
//! `cargo run --example pipeline`: two simulated devices in this process, one thread each
//! (`dist::on_sim_ranks`). Started as two ranks with torchrun's variables (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), the same stage code runs one process per GPU
//! through NCCL, and the last stage checks its outputs against the whole model on its own GPU.

use graphed::device::{CommOptions, Communicator, DType, Device, SimConfig, Stream};
use graphed::dist::{on_sim_ranks, P2pLinks, ProcessGroup, RankEnv};
use graphed::graph::{make_graphed_schedule, Callable, GraphOptions, StaticTensor};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    run_schedule, Builder, EagerPasses, Inputs, KeepOnDevice, Layers, ParamStore, Schedule, Stage, TransformerLayer,
};
use graphed::tensor::Tensor;

const SHAPE: [usize; 3] = [2, 8, 32];
const MICROBATCHES: usize = 4;

/// The model's layers `global` (width 32, each seeded by its index as in the whole model).
fn layers(dev: &Device, global: &[usize]) -> graphed::Result<(CachingAllocator, Stream, Vec<TransformerLayer>)> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, global.len() * TransformerLayer::parameter_count(SHAPE[2]))?;
    let vb = Builder::new(&store, &alloc, &s)?;
    let out = TransformerLayer::stack(&vb, (SHAPE[2], 1), &Layers::of(global.iter().copied()))?;
    Ok((alloc, s, out))
}

/// Microbatch `j`'s input, and the gradient its loss sends back.
fn microbatch(alloc: &CachingAllocator, s: &Stream, j: usize) -> graphed::Result<(Tensor, Tensor)> {
    let at = |salt: usize| -> Vec<f32> {
        (0..SHAPE.iter().product::<usize>()).map(|i| ((i * 31 + j * 7 + salt) % 19) as f32 / 19.0 - 0.5).collect()
    };
    Ok((Tensor::from_host(alloc, s, &at(0), &SHAPE)?, Tensor::from_host(alloc, s, &at(500), &SHAPE)?))
}

/// Stage `comm.rank()` of two, graphed: returns each microbatch's output on the last stage.
fn stage(comm: &Communicator) -> graphed::Result<Vec<Vec<f32>>> {
    let stage = Stage::new(comm.rank(), 2)?;
    // Chunk k of stage s is the model's chunk 2k + s: stage 0 holds layers 0 and 2.
    let global = stage.model_layers(2, 1);
    let (alloc, s, own) = layers(comm.device(), &global)?;
    let schedule = Schedule::interleaved_1f1b(2, stage.index(), 2, MICROBATCHES)?;
    let data = (0..MICROBATCHES).map(|j| microbatch(&alloc, &s, j)).collect::<graphed::Result<Vec<_>>>()?;
    let samples: Vec<Inputs> = (0..own.len() * MICROBATCHES).map(|_| Inputs::one(&data[0].0)).collect();
    let callables: Vec<&dyn Callable> = own.iter().map(|l| l as &dyn Callable).collect();
    let options = GraphOptions::default().reuse_buffers(true);
    let graphed = make_graphed_schedule(&alloc, &callables, &schedule, &samples, options)?;
    let mut links = P2pLinks::graphed(comm, &alloc, &s, &SHAPE, DType::F32);
    let inputs: Vec<Tensor> = match stage.index() {
        0 => data.iter().map(|(x, _)| x.clone()).collect(),
        _ => Vec::new(),
    };
    let mut outputs = vec![Vec::new(); MICROBATCHES];
    let mut head = |j: usize, y: StaticTensor| {
        outputs[j] = y.get()?.to_f32_vec(&s)?;
        Ok(data[j].1.clone())
    };
    graphed.run_stage(&s, &inputs, None, &mut head, (stage, &mut links))?;
    s.synchronize()?;
    Ok(outputs)
}

/// Each microbatch's output of the four layers on `dev`, eagerly: what the pipeline must give.
fn whole_model(dev: &Device) -> graphed::Result<Vec<Vec<f32>>> {
    let (alloc, s, all) = layers(dev, &[0, 1, 2, 3])?;
    let data = (0..MICROBATCHES).map(|j| microbatch(&alloc, &s, j)).collect::<graphed::Result<Vec<_>>>()?;
    let inputs: Vec<Tensor> = data.iter().map(|(x, _)| x.clone()).collect();
    let mut want = vec![Vec::new(); MICROBATCHES];
    let mut head = |j: usize, y: Tensor| {
        want[j] = y.to_f32_vec(&s)?;
        Ok(data[j].1.clone())
    };
    let schedule = Schedule::interleaved_1f1b(1, 0, 1, MICROBATCHES)?;
    let mut eager = EagerPasses::new(&all, &KeepOnDevice, &s);
    run_schedule(&mut eager, &schedule, &[4], &inputs, None, &mut head)?;
    Ok(want)
}

fn main() -> graphed::Result<()> {
    let Some(env) = RankEnv::from_env()? else {
        let want = whole_model(&Device::sim())?;
        let stages = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), stage);
        let mut stages = stages.into_iter().collect::<graphed::Result<Vec<_>>>()?;
        assert_eq!(stages.pop().unwrap_or_default(), want, "the pipeline's outputs must equal one device's");
        println!(
            "two stages × two chunks, interleaved 1F1B over {MICROBATCHES} microbatches, graphed: outputs equal to \
             one device, bit for bit"
        );
        return Ok(());
    };
    // One process per rank, on GPU LOCAL_RANK.
    env.require_world(2, "this example's model is split into two stages")?;
    let dev = env.gpu()?;
    let group = ProcessGroup::join(&dev, env, "examples/pipeline", CommOptions::default())?;
    let got = stage(group.comm())?;
    if group.comm().rank() == 1 {
        let same = got == whole_model(&dev)?;
        println!(
            "rank 1: two stages × two chunks over NCCL, interleaved 1F1B over {MICROBATCHES} microbatches, graphed: \
             outputs equal to the whole model on this GPU, bit for bit: {same}"
        );
        assert!(same, "the pipeline's outputs must equal one GPU's");
    }
    group.leave();
    Ok(())
}
