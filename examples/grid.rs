//! Megatron-LM's grid on four ranks: two data-parallel replicas of a two-stage pipeline. Rank
//! `stage · 2 + replica` splits the world into its replica's pipeline and its stage's replicas
//! (`ProcessGroup::grid`, as `graphed train --pipeline` does);
//! each replica pipelines its own four microbatches under 1F1B, graphed, and each stage's
//! replicas sum its gradients inside the schedule's backward graphs (`GradReduction::Sum`; the
//! default, the mean, would halve them, exactly). Every layer's gradients
//! equal the sum of both replicas' on one device, bit for bit (one sum of two values, which no
//! order changes).
//!
//! `cargo run --example grid`: four simulated devices in this process, one thread each
//! (`ProcessGroup::simulated`). Started as four ranks with torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), the same rank code runs one process
//! per GPU through NCCL (`ProcessGroup::join`), and each rank checks its layers against its own
//! GPU.

use graphed::device::{CommOptions, DType, Device, SimConfig, Stream};
use graphed::dist::{on_sim_ranks, DataParallel, GradReduction, P2pLinks, ProcessGroup, RankEnv};
use graphed::graph::{make_graphed_schedule, Callable, GraphOptions, StaticTensor};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    run_schedule, Builder, EagerPasses, Inputs, KeepOnDevice, Layers, Module, ParamStore, Schedule, TransformerLayer,
};
use graphed::tensor::Tensor;

const SHAPE: [usize; 3] = [2, 8, 32];
const STAGES: usize = 2;
const REPLICAS: usize = 2;
const MICROBATCHES: usize = 4;
/// Layers per stage (one chunk each: plain 1F1B).
const PER_STAGE: usize = 2;

/// The model's layers `global` (width 32, each seeded by its index as in the whole model).
struct Part {
    alloc: CachingAllocator,
    s: Stream,
    store: ParamStore,
    global: Vec<usize>,
    layers: Vec<TransformerLayer>,
}

fn part(dev: &Device, global: Vec<usize>) -> graphed::Result<Part> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, global.len() * TransformerLayer::parameter_count(SHAPE[2]))?;
    let vb = Builder::new(&store, &alloc, &s)?;
    let layers = TransformerLayer::stack(&vb, (SHAPE[2], 1), &Layers::of(global.iter().copied()))?;
    Ok(Part { alloc, s, store, global, layers })
}

/// Microbatch `j` of the whole batch (replica r has `r · MICROBATCHES ..`): its input, and the
/// gradient its loss sends back.
fn microbatch(p: &Part, j: usize) -> graphed::Result<(Tensor, Tensor)> {
    let at = |salt: usize| -> Vec<f32> {
        (0..SHAPE.iter().product::<usize>()).map(|i| ((i * 31 + j * 7 + salt) % 19) as f32 / 19.0 - 0.5).collect()
    };
    Ok((Tensor::from_host(&p.alloc, &p.s, &at(0), &SHAPE)?, Tensor::from_host(&p.alloc, &p.s, &at(500), &SHAPE)?))
}

/// Each of `p`'s layers with its gradients, by model layer.
fn grads(p: &Part) -> graphed::Result<Vec<(usize, Vec<f32>)>> {
    (p.global.iter().zip(&p.layers))
        .map(|(&g, l)| Ok((g, p.store.grads_of(&l.parameters())?.to_f32_vec(&p.s)?)))
        .collect()
}

/// Every layer's gradients of both replicas' microbatches, each replica's on the whole model on
/// `dev` (eagerly), summed.
fn replicas_summed(dev: &Device) -> graphed::Result<Vec<(usize, Vec<f32>)>> {
    let mut sum: Vec<(usize, Vec<f32>)> = Vec::new();
    for replica in 0..REPLICAS {
        let p = part(dev, (0..STAGES * PER_STAGE).collect())?;
        let data = (0..MICROBATCHES)
            .map(|j| microbatch(&p, replica * MICROBATCHES + j))
            .collect::<graphed::Result<Vec<_>>>()?;
        let inputs: Vec<Tensor> = data.iter().map(|(x, _)| x.clone()).collect();
        let mut head = |j: usize, _: Tensor| Ok(data[j].1.clone());
        let schedule = Schedule::interleaved_1f1b(1, 0, 1, MICROBATCHES)?;
        let mut eager = EagerPasses::new(&p.layers, &KeepOnDevice, &p.s);
        run_schedule(&mut eager, &schedule, &[p.layers.len()], &inputs, None, &mut head)?;
        let mine = grads(&p)?;
        if sum.is_empty() {
            sum = mine;
        } else {
            for ((_, acc), (_, g)) in sum.iter_mut().zip(mine) {
                acc.iter_mut().zip(g).for_each(|(a, b)| *a += b);
            }
        }
    }
    Ok(sum)
}

/// Rank `group`'s place in the grid (every rank splits the world): its stage of its replica's
/// pipeline, graphed, its gradients reduced across the stage's replicas inside the backward
/// graphs. Its layers' gradients.
fn rank(group: &ProcessGroup) -> graphed::Result<Vec<(usize, Vec<f32>)>> {
    let grid = group.grid(STAGES)?;
    let (stage, replica) = (grid.stage(), grid.replica());
    let p = part(group.comm().device(), stage.model_layers(1, PER_STAGE))?;
    let schedule = Schedule::interleaved_1f1b(STAGES, stage.index(), 1, MICROBATCHES)?;
    let data =
        (0..MICROBATCHES).map(|j| microbatch(&p, replica * MICROBATCHES + j)).collect::<graphed::Result<Vec<_>>>()?;
    let callables: Vec<&dyn Callable> = p.layers.iter().map(|l| l as &dyn Callable).collect();
    let samples: Vec<Inputs> = (0..p.layers.len() * MICROBATCHES).map(|_| Inputs::one(&data[0].0)).collect();
    let reduce =
        DataParallel::for_callables(grid.data_parallel(), &p.store, &callables)?.with_reduction(GradReduction::Sum)?;
    let options = GraphOptions::default().reuse_buffers(true).grad_sync(reduce);
    let graphed = make_graphed_schedule(&p.alloc, &callables, &schedule, &samples, options)?;
    let mut links = P2pLinks::graphed(grid.pipeline(), &p.alloc, &p.s, &SHAPE, DType::F32);
    let inputs: Vec<Tensor> = match stage.index() {
        0 => data.iter().map(|(x, _)| x.clone()).collect(),
        _ => Vec::new(),
    };
    let mut head = |j: usize, _: StaticTensor| Ok(data[j].1.clone());
    graphed.run_stage(&p.s, &inputs, None, &mut head, (stage, &mut links))?;
    grads(&p)
}

/// Whether `got` (a rank's layers, all of them) equals those layers of `want`.
fn equal(got: &[(usize, Vec<f32>)], want: &[(usize, Vec<f32>)]) -> bool {
    got.len() == PER_STAGE && got.iter().all(|(l, g)| want.iter().any(|(m, w)| m == l && w == g))
}

fn main() -> graphed::Result<()> {
    let world = STAGES * REPLICAS;
    let Some(env) = RankEnv::from_env()? else {
        let want = replicas_summed(&Device::sim())?;
        let ranks = on_sim_ranks(world, SimConfig::default(), CommOptions::default(), |c| {
            rank(&ProcessGroup::simulated(c.clone())?)
        });
        for (r, got) in ranks.into_iter().enumerate() {
            let same = equal(&got?, &want);
            println!("rank {r}: gradients equal to both replicas on one device, summed, bit for bit: {same}");
            assert!(same);
        }
        return Ok(());
    };
    // One process per rank, on GPU LOCAL_RANK.
    env.require_world(world, &format!("this example's grid is {STAGES} stages × {REPLICAS} replicas"))?;
    let dev = env.gpu()?;
    let group = ProcessGroup::join(&dev, env, "examples/grid", CommOptions::default())?;
    let got = rank(&group)?;
    let r = group.comm().rank();
    let same = equal(&got, &replicas_summed(&dev)?);
    println!("rank {r}: gradients over NCCL equal to both replicas on this GPU, summed, bit for bit: {same}");
    assert!(same, "rank {r}'s gradients must equal the replicas' sum");
    group.leave();
    Ok(())
}
