//! Random host delays between replays and random sizes, against eager runs, under every
//! scheduler policy of the simulator (the per-device macro) and on CUDA.

use anyhow::ensure;
use graphed::device::{DType, Device, DeviceKind};
use graphed::graph::{GraphOptions, Replay};
use graphed::nn::KeepOnDevice;
use graphed::offload::OffloadManager;

use super::common::lcg;
use super::fixtures::{config, Dims, Model, Result, DIMS};

pub fn random_delays_and_sizes_change_nothing(dev: &Device) -> Result {
    let draws = lcg(64, 9);
    let pick = |i: usize, choices: &[usize]| choices[((draws[i] + 1.0) * 1000.0) as usize % choices.len()];
    let side = dev.stream()?;
    for round in 0..2 {
        let dims = Dims {
            batch: pick(4 * round, &[1, 2, 3]),
            seq: pick(4 * round + 1, &[4, 8, 12]),
            dim: 32,
            layers: pick(4 * round + 2, &[2, 3, 5]),
            dropout: 0.1,
            ..DIMS
        };
        let eager = Model::new(dev, dims, DType::F32)?;
        let off = Model::new(dev, dims, DType::F32)?;
        let m = OffloadManager::new(&off.alloc, config().min_elements(64))?;
        let e = dev.event()?;
        let g = off.graph(m.graph_options(GraphOptions::default().sync_event(&e)))?;
        for k in 1..4u64 {
            let want = eager.eager(&KeepOnDevice, k)?;
            let (x, dy) = off.data(k)?;
            let y = g.forward(&off.s, &x, Replay::side(&side))?;
            delay(dev, draws[(8 * round + k as usize) % 64]);
            let y = y.get()?.to_f32_vec(&off.s)?;
            let dx = g.backward(&off.s, &dy)?.ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
            delay(dev, draws[(8 * round + 4 + k as usize) % 64]);
            let dx = dx.get()?.to_f32_vec(&off.s)?;
            g.join(&off.s)?;
            ensure!((y, dx) == want, "round {round} ({dims:?}), microbatch {k}: differs from eager");
            ensure!(eager.grads()? == off.grads()?, "round {round}, microbatch {k}: parameter gradients differ");
        }
    }
    Ok(())
}

/// Up to a millisecond of host time on CUDA (copies and kernels run meanwhile); none on the
/// simulator, whose scheduler policies already reorder work.
fn delay(dev: &Device, draw: f32) {
    if dev.kind() == DeviceKind::Cuda {
        std::thread::sleep(std::time::Duration::from_micros((draw.abs() * 1000.0) as u64));
    }
}
