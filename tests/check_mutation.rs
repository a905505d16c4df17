//! Sync-mutation tests: deleting any one record or wait of a realistic program is reported, or shown redundant.

use std::cell::Cell;

use anyhow::{ensure, Context};
use graphed::check::{Checker, Hazard};
use graphed::device::{Device, Event, Policy, SimConfig, Stream};
use graphed::ops::elementwise;

/// Elements per activation.
const N: usize = 32;
/// The record and wait calls `program` makes.
const SYNC_POINTS: usize = 10;
/// The deletions that change nothing: sync point 2 records `p1_saved`, which nobody waits on
/// (the reload waits on `p2_saved`, recorded later on the same offload stream).
const REDUNDANT: &[usize] = &[2];

/// Numbers every record and wait of a program, and leaves out the one numbered `skip`.
struct Syncs {
    next: Cell<usize>,
    skip: Option<usize>,
}

impl Syncs {
    fn keep(&self) -> bool {
        let i = self.next.get();
        self.next.set(i + 1);
        self.skip != Some(i)
    }

    #[track_caller]
    fn record(&self, stream: &Stream, event: &Event) -> anyhow::Result<()> {
        if self.keep() {
            stream.record(event)?;
        }
        Ok(())
    }

    #[track_caller]
    fn wait(&self, stream: &Stream, event: &Event) -> anyhow::Result<()> {
        if self.keep() {
            stream.wait(event)?;
        }
        Ok(())
    }
}

/// Two layers whose activations are offloaded to pinned host memory during the forward pass and
/// reloaded for the backward pass: `main` computes, `offload` copies device to host, `reload`
/// copies host to device. Returns every buffer's final contents, the pinned ones last.
fn program(dev: &Device, skip: Option<usize>) -> anyhow::Result<Vec<Vec<f32>>> {
    let sync = Syncs { next: Cell::new(0), skip };
    let (main, offload, reload) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let input: Vec<f32> = (0..N).map(|i| i as f32 - 8.0).collect();
    let x = dev.alloc_from(&main, &input)?;
    let (a1, a2, r1, r2, grad) = (dev.alloc(N)?, dev.alloc(N)?, dev.alloc(N)?, dev.alloc(N)?, dev.alloc(N)?);
    let (p1, p2) = (dev.alloc_pinned::<f32>(N)?, dev.alloc_pinned::<f32>(N)?);
    let [a1_ready, p1_saved, a2_ready, p2_saved, reloaded] = [(); 5].map(|()| dev.event());
    let (a1_ready, p1_saved, a2_ready, p2_saved, reloaded) = (a1_ready?, p1_saved?, a2_ready?, p2_saved?, reloaded?);

    // Forward, layer 1: a1 = 2x + 1, offloaded once computed.
    elementwise::scale(a1.view(), x.view(), 2.0, &main)?;
    elementwise::add_scalar(a1.view(), 1.0, &main)?;
    sync.record(&main, &a1_ready)?; // 0
    sync.wait(&offload, &a1_ready)?; // 1
    offload.copy_d2h(&a1, p1.view())?;
    sync.record(&offload, &p1_saved)?; // 2

    // Forward, layer 2: a2 = 3·a1 + x/2, offloaded once computed.
    elementwise::scale(a2.view(), a1.view(), 3.0, &main)?;
    elementwise::axpy(a2.view(), x.view(), 0.5, &main)?;
    sync.record(&main, &a2_ready)?; // 3
    sync.wait(&offload, &a2_ready)?; // 4
    offload.copy_d2h(&a2, p2.view())?;
    sync.record(&offload, &p2_saved)?; // 5

    // The loss gradient, then the activations' memory is reused once both offloads are done.
    elementwise::scale(grad.view(), a2.view(), 0.25, &main)?;
    sync.wait(&main, &p2_saved)?; // 6
    elementwise::fill(a1.view(), -1.0, &main)?;
    elementwise::fill(a2.view(), -1.0, &main)?;

    // Backward: reload both activations, then consume them.
    sync.wait(&reload, &p2_saved)?; // 7
    reload.copy_h2d(p2.view(), &r2)?;
    reload.copy_h2d(p1.view(), &r1)?;
    sync.record(&reload, &reloaded)?; // 8
    sync.wait(&main, &reloaded)?; // 9
    elementwise::axpy(grad.view(), r2.view(), 1.0, &main)?;
    elementwise::axpy(grad.view(), r1.view(), 2.0, &main)?;

    ensure!(sync.next.get() == SYNC_POINTS, "the program made {} sync calls, not {SYNC_POINTS}", sync.next.get());
    dev.synchronize()?;
    let mut out = Vec::new();
    for b in [&x, &a1, &a2, &r1, &r2, &grad] {
        out.push(b.to_vec(&main)?);
    }
    out.push(p1.read()?);
    out.push(p2.read()?);
    Ok(out)
}

/// Every policy, and a few seeds of the random one.
fn configs() -> Vec<SimConfig> {
    let mut configs: Vec<SimConfig> = Policy::ALL.iter().map(|p| SimConfig::with_policy(*p)).collect();
    configs.extend((1..8).map(|seed| SimConfig { policy: Policy::Random, seed, ..SimConfig::default() }));
    configs
}

/// `program` with `skip` on a fresh simulator under `config`: its results and the checker's reports.
fn run(config: SimConfig, skip: Option<usize>) -> (Vec<Vec<f32>>, Vec<Hazard>) {
    let dev = Device::sim_with(config);
    let out = program(&dev, skip).unwrap_or_else(|e| panic!("skip {skip:?} under {config:?}: {e}"));
    let hazards = Checker::of(&dev).context("the simulator is checked").unwrap().hazards();
    (out, hazards)
}

fn expected() -> Vec<Vec<f32>> {
    let x: Vec<f32> = (0..N).map(|i| i as f32 - 8.0).collect();
    let a1: Vec<f32> = x.iter().map(|x| 2.0 * x + 1.0).collect();
    let a2: Vec<f32> = a1.iter().zip(&x).map(|(a, x)| 0.5f32.mul_add(*x, 3.0 * a)).collect();
    let grad: Vec<f32> =
        a2.iter().zip(&a1).map(|(a2, a1)| 2.0f32.mul_add(*a1, 1.0f32.mul_add(*a2, 0.25 * a2))).collect();
    vec![x, vec![-1.0; N], vec![-1.0; N], a1.clone(), a2.clone(), grad, a1, a2]
}

#[test]
fn unmutated_program_is_clean_and_schedule_independent() {
    for config in configs() {
        let (out, hazards) = run(config, None);
        assert!(hazards.is_empty(), "{config:?}: {hazards:#?}");
        assert_eq!(out, expected(), "{config:?}");
    }
}

#[test]
fn each_deleted_sync_is_reported_or_redundant() {
    let reference = run(SimConfig::with_policy(Policy::InOrder), None).0;
    let mut redundant = Vec::new();
    for skip in 0..SYNC_POINTS {
        let runs: Vec<_> = configs().into_iter().map(|c| (c, run(c, Some(skip)))).collect();
        let counts: Vec<usize> = runs.iter().map(|(_, (_, h))| h.len()).collect();
        assert!(counts.iter().all(|c| *c == counts[0]), "sync {skip}: the reports depend on the schedule: {counts:?}");
        let reported = counts[0] > 0;
        let unchanged = runs.iter().all(|(_, (out, _))| *out == reference);
        if reported {
            let (_, (_, hazards)) = &runs[0];
            let changed = runs.iter().filter(|(_, (out, _))| *out != reference).count();
            println!(
                "deleting sync {skip} is reported (results change under {changed} of {} schedules): {}",
                runs.len(),
                hazards[0]
            );
        } else if unchanged {
            println!("deleting sync {skip} is redundant: no report, and results are identical under every schedule");
            redundant.push(skip);
        } else {
            let changed: Vec<SimConfig> =
                runs.iter().filter(|(_, (out, _))| *out != reference).map(|(c, _)| *c).collect();
            let quiet: Vec<SimConfig> = runs.iter().filter(|(_, (_, h))| h.is_empty()).map(|(c, _)| *c).collect();
            panic!("deleting sync {skip} changes results under {changed:?} but the checker was silent under {quiet:?}");
        }
    }
    assert!(redundant.len() < SYNC_POINTS, "no deletion was reported");
    assert_eq!(redundant, REDUNDANT, "the deletions that change nothing");
}
