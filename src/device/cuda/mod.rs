//! The CUDA backend. Placeholder until the CUDA backend issue lands: an uninhabited type, so no
//! CUDA object can exist and `Device::cuda` returns a typed error.

use super::backend::{Backend, Op};
use super::memory::MemKind;
use super::{BufferId, CaptureMode, CaptureStatus, DeviceId, EventId, NodeInfo, StreamId};
use crate::{Error, Result};

/// No value of this type exists yet.
pub(crate) enum CudaDevice {}

impl CudaDevice {
    pub(crate) fn new(_id: DeviceId, _ordinal: usize) -> Result<CudaDevice> {
        Err(Error::CudaUnavailable { reason: "this build has no CUDA backend yet".into() })
    }

    pub(crate) fn describe(&self) -> String {
        match *self {}
    }
}

/// The raw cudarc baseline needs the CUDA backend.
pub(crate) fn raw_launch_baseline(
    _: usize,
    _: &'static super::Kernel,
    _: usize,
    _: usize,
) -> Result<super::RawLaunchTimes> {
    Err(Error::CudaUnavailable { reason: "this build has no CUDA backend yet".into() })
}

/// Handle types of the placeholder backend; uninhabited like the device.
pub(crate) enum Never {}

impl Backend for CudaDevice {
    type Stream = Never;
    type Event = Never;
    type Mem = Never;
    type Graph = Never;
    type Exec = Never;

    fn create_stream(&self, _: StreamId, _: i32) -> Result<Never> {
        match *self {}
    }
    fn legacy_stream(&self, _: StreamId) -> Result<Never> {
        match *self {}
    }
    fn priority_range(&self) -> Result<(i32, i32)> {
        match *self {}
    }
    fn create_event(&self, _: EventId, _: bool) -> Result<Never> {
        match *self {}
    }
    fn elapsed_ms(&self, _: &Never, _: &Never) -> Result<f32> {
        match *self {}
    }
    fn alloc(&self, _: BufferId, _: usize, _: MemKind) -> Result<Never> {
        match *self {}
    }
    fn load_kernel(&self, _: &'static super::Kernel) -> Result<()> {
        match *self {}
    }
    fn enqueue(&self, _: &Never, _: &Op<'_>) -> Result<()> {
        match *self {}
    }
    fn record(&self, _: &Never, _: &Never, _: bool) -> Result<()> {
        match *self {}
    }
    fn wait(&self, _: &Never, _: &Never, _: bool) -> Result<()> {
        match *self {}
    }
    fn stream_synchronize(&self, _: &Never) -> Result<()> {
        match *self {}
    }
    fn stream_query(&self, _: &Never) -> Result<bool> {
        match *self {}
    }
    fn event_query(&self, _: &Never) -> Result<bool> {
        match *self {}
    }
    fn event_synchronize(&self, _: &Never) -> Result<()> {
        match *self {}
    }
    fn synchronize(&self) -> Result<()> {
        match *self {}
    }
    fn read_blocking(&self, _: &Never, _: &Never, _: usize, _: &mut [u8]) -> Result<()> {
        match *self {}
    }
    fn write_blocking(&self, _: &Never, _: &Never, _: usize, _: &[u8]) -> Result<()> {
        match *self {}
    }
    fn read_pinned(m: &Never, _: &mut [u8]) -> Result<()> {
        match *m {}
    }
    fn write_pinned(m: &Never, _: &[u8]) -> Result<()> {
        match *m {}
    }
    fn begin_capture(&self, _: &Never, _: CaptureMode) -> Result<()> {
        match *self {}
    }
    fn end_capture(&self, _: &Never) -> Result<Never> {
        match *self {}
    }
    fn capture_status(&self, _: &Never) -> Result<CaptureStatus> {
        match *self {}
    }
    fn graph_nodes(&self, _: &Never) -> Result<Vec<NodeInfo>> {
        match *self {}
    }
    fn graph_dot(&self, _: &Never) -> Result<String> {
        match *self {}
    }
    fn instantiate(&self, _: &Never) -> Result<Never> {
        match *self {}
    }
    fn upload(&self, _: &Never, _: &Never) -> Result<()> {
        match *self {}
    }
    fn launch(&self, _: &Never, _: &Never) -> Result<()> {
        match *self {}
    }
}
