//! Shared test helpers: the per-device test macro and small assertions.
#![allow(dead_code)]

use graphed::CaptureErrorKind;

/// Generates, for each case `fn name(dev: &Device) -> Result<()>`, a `sim::name` test that runs it
/// under every scheduler policy (and several seeds of the random one) and a `cuda::name` test,
/// ignored unless run with `--ignored` on a machine with a GPU.
#[macro_export]
macro_rules! per_device {
    ($($name:ident),* $(,)?) => {
        mod sim {
            use graphed::device::{Device, Policy, SimConfig};
            $(
                #[test]
                fn $name() {
                    let mut configs: Vec<SimConfig> = Policy::ALL.iter().map(|p| SimConfig::with_policy(*p)).collect();
                    configs.extend((1..4).map(|seed| SimConfig { policy: Policy::Random, seed, ..SimConfig::default() }));
                    for config in configs {
                        let dev = Device::sim_with(config);
                        if let Err(e) = super::$name(&dev) {
                            panic!("{} under {config:?}: {e}", stringify!($name));
                        }
                        let hazards = graphed::check::Checker::of(&dev).expect("the simulator is checked").hazards();
                        assert!(hazards.is_empty(), "{} under {config:?}: the checker reported {} hazards:\n{}", stringify!($name), hazards.len(), hazards.iter().map(|h| h.to_string()).collect::<Vec<_>>().join("\n"));
                    }
                }
            )*
        }
        mod cuda {
            use graphed::device::Device;
            $(
                #[test]
                #[ignore = "needs a CUDA GPU"]
                fn $name() {
                    let dev = Device::cuda_checked(0).unwrap_or_else(|e| panic!("{e}"));
                    if let Err(e) = super::$name(&dev) {
                        panic!("{} on CUDA: {e}", stringify!($name));
                    }
                    let hazards = graphed::check::Checker::of(&dev).expect("checked").hazards();
                    assert!(hazards.is_empty(), "{} on CUDA: the checker reported:\n{}", stringify!($name), hazards.iter().map(|h| h.to_string()).collect::<Vec<_>>().join("\n"));
                }
            )*
        }
    };
}

/// Fails unless `r` is a capture error of `kind`.
pub fn expect_capture<T: std::fmt::Debug>(r: graphed::Result<T>, kind: CaptureErrorKind) -> anyhow::Result<()> {
    match r {
        Err(e) if e.capture_kind() == Some(kind) => Ok(()),
        other => anyhow::bail!("expected capture error {kind:?}, got {other:?}"),
    }
}

/// Fails unless the device's checker reported exactly one hazard, of `kind`; forgets it.
pub fn expect_only_hazard(dev: &graphed::device::Device, kind: graphed::check::HazardKind) -> anyhow::Result<()> {
    let checker = graphed::check::Checker::of(dev).ok_or_else(|| anyhow::anyhow!("the device has no checker"))?;
    let hazards = checker.take_hazards();
    anyhow::ensure!(hazards.len() == 1 && hazards[0].kind == kind, "expected one {kind:?}, got {hazards:#?}");
    Ok(())
}

/// Central finite differences of a scalar function of `x` (in f64 on the host), for gradient
/// checks on the simulator: `f` runs the forward on the device and returns the loss.
pub fn numeric_grad(mut f: impl FnMut(&[f32]) -> anyhow::Result<f64>, x: &[f32], eps: f32) -> anyhow::Result<Vec<f64>> {
    let mut grad = Vec::with_capacity(x.len());
    let mut probe = x.to_vec();
    for i in 0..x.len() {
        probe[i] = x[i] + eps;
        let up = f(&probe)?;
        probe[i] = x[i] - eps;
        let down = f(&probe)?;
        probe[i] = x[i];
        grad.push((up - down) / (2.0 * f64::from(eps)));
    }
    Ok(grad)
}

/// Fails unless `got` and `want` agree within `atol + rtol·|want|` everywhere.
pub fn ensure_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) -> anyhow::Result<()> {
    anyhow::ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(*g);
        anyhow::ensure!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
    Ok(())
}

/// `n` deterministic values uniform in `[-1, 1)` from `seed` (Knuth's MMIX generator).
pub fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// PyTorch's AdamW step (`torch.optim.AdamW`, single-tensor path) in f64.
pub fn adamw_f64(
    p: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    g: &[f32],
    lr: f64,
    t: i32,
    h: &graphed::ops::adamw::AdamWHyper,
) {
    let (b1, b2, eps, wd) = (f64::from(h.beta1), f64::from(h.beta2), f64::from(h.eps), f64::from(h.weight_decay));
    let (bias1, bias2_sqrt) = (1.0 - b1.powi(t), (1.0 - b2.powi(t)).sqrt());
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = f64::from(g);
        *p *= 1.0 - lr * wd;
        *m += (1.0 - b1) * (g - *m);
        *v = b2 * *v + (1.0 - b2) * g * g;
        *p -= lr / bias1 * *m / (v.sqrt() / bias2_sqrt + eps);
    }
}

/// Where a test's ranks run: simulated devices under a scheduling policy (in CI), or the GPUs
/// of this process through NCCL, each checked (the `two_gpus` tests, ignored without GPUs).
#[derive(Debug, Clone, Copy)]
pub enum Ranks {
    /// Simulated devices, one thread each.
    Sim(graphed::device::Policy),
    /// GPUs 0, 1, … of this machine, one thread each.
    Gpus,
}

impl Ranks {
    /// Runs `f` on `n` ranks whose collectives wait `options.timeout`; every rank's result.
    ///
    /// # Errors
    /// Opening the GPUs (fewer than `n`) or joining NCCL.
    pub fn run<T: Send>(
        self,
        n: usize,
        options: graphed::device::CommOptions,
        f: impl Fn(&graphed::device::Communicator) -> graphed::Result<T> + Sync,
    ) -> anyhow::Result<Vec<graphed::Result<T>>> {
        use graphed::device::{Communicator, Device, SimConfig};
        Ok(match self {
            Ranks::Sim(policy) => graphed::dist::on_sim_ranks(n, SimConfig::with_policy(policy), options, f),
            Ranks::Gpus => {
                let gpus = (0..n).map(Device::cuda_checked).collect::<graphed::Result<Vec<_>>>()?;
                graphed::dist::on_ranks(Communicator::nccl_group(&gpus, options)?, f)
            }
        })
    }
}
