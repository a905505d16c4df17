//! The batches' way to the GPU. A copy from pageable memory must wait for its stream (see
//! `Buffer::write_from`), which would make the host wait for every step before issuing the next;
//! instead each batch is written into one of two pinned staging slots, used in turn, and copied
//! on the step's stream. A slot is written again only once its copy two steps back has run, so
//! the host runs up to two steps ahead of the GPU.

use graphed::device::{DType, Device, Event, PinnedBuffer, Stream};
use graphed::memory::CachingAllocator;
use graphed::tensor::Tensor;

use super::addition::Batch;

/// A wait for the work before an event, under a process group's watchdog.
pub type WaitFor<'a> = dyn Fn(&Event) -> graphed::Result<()> + 'a;

/// A batch on the GPU: its tokens `[batch, seq]`, and per token its target and loss weight.
pub struct Uploaded {
    pub tokens: Tensor,
    pub targets: Tensor,
    pub weights: Tensor,
}

/// Two pinned slots for batches of `[batch, seq]` tokens.
pub struct Uploader {
    slots: [Slot; 2],
    next: usize,
    shape: [usize; 2],
}

struct Slot {
    inputs: PinnedBuffer<u32>,
    targets: PinnedBuffer<u32>,
    weights: PinnedBuffer<f32>,
    /// Recorded after the slot's copies; `None` before its first use.
    copied: Option<Event>,
}

impl Uploader {
    /// Slots for batches of `batch` rows of `seq` tokens on `dev`.
    pub fn new(dev: &Device, batch: usize, seq: usize) -> graphed::Result<Uploader> {
        let n = batch * seq;
        let slot = || -> graphed::Result<Slot> {
            Ok(Slot {
                inputs: dev.alloc_pinned(n)?,
                targets: dev.alloc_pinned(n)?,
                weights: dev.alloc_pinned(n)?,
                copied: None,
            })
        };
        Ok(Uploader { slots: [slot()?, slot()?], next: 0, shape: [batch, seq] })
    }

    /// Copies `batch` to the GPU on `stream`; blocks only while the slot's copy of two batches
    /// ago has not run. In a process group that wait is `watched` (the group's watchdog): that
    /// copy is queued behind the step's collectives, which a dead or stalled rank never
    /// completes, so a plain wait would outlive the death unseen, and a stall forever.
    pub fn upload(
        &mut self,
        alloc: &CachingAllocator,
        stream: &Stream,
        batch: &Batch,
        watched: Option<&WaitFor<'_>>,
    ) -> graphed::Result<Uploaded> {
        let slot = &mut self.slots[self.next];
        self.next = 1 - self.next;
        match (&slot.copied, watched) {
            (None, _) => {}
            (Some(copied), None) => copied.synchronize()?,
            (Some(copied), Some(wait)) => wait(copied)?,
        }
        slot.inputs.write(&batch.inputs)?;
        slot.targets.write(&batch.targets)?;
        slot.weights.write(&batch.weights)?;
        let n = self.shape[0] * self.shape[1];
        let tokens = Tensor::uninit(alloc, stream, &self.shape, DType::U32)?;
        let targets = Tensor::uninit(alloc, stream, &[n], DType::U32)?;
        let weights = Tensor::uninit(alloc, stream, &[n], DType::F32)?;
        stream.copy_h2d(slot.inputs.view(), tokens.view::<u32>()?)?;
        stream.copy_h2d(slot.targets.view(), targets.view::<u32>()?)?;
        stream.copy_h2d(slot.weights.view(), weights.view::<f32>()?)?;
        let copied = match slot.copied.take() {
            Some(e) => e,
            None => stream.device().event()?,
        };
        stream.record(&copied)?;
        slot.copied = Some(copied);
        Ok(Uploaded { tokens, targets, weights })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphed::device::{CaptureMode, CommErrorKind, CommOptions, SimConfig};
    use graphed::dist::{on_sim_ranks, ProcessGroup};
    use graphed::Error;

    /// A rank whose peer never launches the step's graph: the upload that waits for the copy
    /// queued behind that graph's all-reduce ends at the group's timeout, naming the graph,
    /// instead of polling forever (it used to poll only for a dead rank).
    #[test]
    fn an_upload_behind_a_stalled_graph_ends_at_the_timeout_naming_it() {
        let timeout = std::time::Duration::from_millis(200);
        let rank_0_done = std::sync::Barrier::new(2);
        let out = on_sim_ranks(2, SimConfig::default(), CommOptions { timeout }, |c| {
            let (dev, s) = (c.device(), c.device().stream()?);
            let x = dev.alloc::<f32>(4)?;
            let cap = s.capture(CaptureMode::ThreadLocal)?;
            c.all_reduce(&s, &x)?;
            let graph = cap.finish()?;
            graph.set_name("step");
            let exec = graph.instantiate()?;
            if c.rank() == 1 {
                rank_0_done.wait();
                return Ok(());
            }
            let group = ProcessGroup::simulated(c.clone())?;
            let (alloc, mut uploader) = (CachingAllocator::new(dev), Uploader::new(dev, 1, 2)?);
            let wait = |e: &Event| group.wait_event(e);
            let batch = || Batch { inputs: vec![0; 2], targets: vec![0; 2], weights: vec![1.0; 2] };
            // The third upload reuses the first's slot, whose copy follows the first launch.
            let uploaded = (0..3).try_for_each(|_| {
                exec.launch(&s)?;
                uploader.upload(&alloc, &s, &batch(), Some(&wait)).map(drop)
            });
            rank_0_done.wait();
            uploaded
        });
        match &out[0] {
            Err(Error::Comm { kind: CommErrorKind::Stalled(stalled), .. }) => {
                let launch = stalled.graph.as_ref().map(|g| (g.graph.as_str(), g.launch));
                assert_eq!(launch, Some(("step", 1)), "{stalled}");
                assert_eq!(stalled.missing.as_deref(), Some(&[1][..]), "{stalled}");
            }
            other => panic!("expected the stalled graph, got {other:?}"),
        }
    }
}
