//! CUDA-only behaviour of the backend, through the public API: what the conformance suite
//! (`tests/conformance`, run on both devices) cannot express. Each test needs a GPU and is
//! ignored elsewhere, so CI lists it as not run; the first one needs no GPU.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::device::{
    args, CaptureMode, CaptureStatus, CpuArgs, Device, DeviceBuffer, Event, InOut, Kernel, LaunchDims, Out, Stream,
};
use crate::{Error, Result};

fn add_one_cpu(a: &CpuArgs) -> Result<()> {
    a.output::<f32>("x")?.iter_mut().for_each(|x| *x += 1.0);
    Ok(())
}

const SOURCE: &str = r#"
extern "C" __global__ void add_one(float* x, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"#;
static ADD_ONE: Kernel =
    Kernel { name: "add_one", source: SOURCE, params: &["x", "n"], cpu: add_one_cpu, strided: false };

/// Every scalar type, and more arguments than are marshalled on the stack.
const MANY_SOURCE: &str = r#"
extern "C" __global__ void many(float* out, float a, unsigned b, int c, unsigned long long d,
    unsigned p0, unsigned p1, unsigned p2, unsigned p3, unsigned p4, unsigned p5, unsigned p6,
    unsigned p7, unsigned p8, unsigned p9, unsigned p10, unsigned p11, unsigned p12) {
    out[0] = a; out[1] = (float)b; out[2] = (float)c; out[3] = (float)(d >> 40);
    out[4] = (float)(p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7 + p8 + p9 + p10 + p11 + p12);
}
"#;
static MANY: Kernel = Kernel {
    name: "many",
    source: MANY_SOURCE,
    params: &[
        "out", "a", "b", "c", "d", "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9", "p10", "p11", "p12",
    ],
    // Never run: the tests launching it need a GPU.
    cpu: |_| Ok(()),
    strided: false,
};
static BROKEN: Kernel = Kernel {
    name: "broken",
    source: "extern \"C\" __global__ void broken( {",
    // What the source would take if it compiled.
    params: &["x", "n"],
    cpu: add_one_cpu,
    strided: false,
};

/// A grid-stride fill of `out[1..n]` whose block 0 writes the grid it ran with into `out[0]`. Its
/// 40 KiB of shared memory keep an SM of any current GPU (228 KiB at most) below 8 blocks.
const GRID_OF_SOURCE: &str = r#"
extern "C" __global__ void grid_of(unsigned* out, unsigned n) {
    __shared__ unsigned pad[10240];
    pad[threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = gridDim.x;
    unsigned other = threadIdx.x ^ 1u;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i + 1 < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i + 1] = (unsigned)(i + 1) + pad[other] - other;
    }
}
"#;
static GRID_OF: Kernel = Kernel {
    name: "grid_of",
    source: GRID_OF_SOURCE,
    params: &["out", "n"],
    // Never run: the test launching it needs a GPU.
    cpu: |_| Ok(()),
    strided: false,
};

/// Serializes the tests that use the GPU in one process: a global-mode capture in one would
/// refuse the allocations and frees of the others.
pub(super) fn serial() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock().unwrap_or_else(PoisonError::into_inner)
}

fn gpu() -> (Device, MutexGuard<'static, ()>) {
    let serial = serial();
    (Device::cuda(0).unwrap_or_else(|e| panic!("{e}")), serial)
}

fn add_one(s: &Stream, x: &DeviceBuffer<f32>) -> Result<()> {
    s.launch(&ADD_ONE, LaunchDims::for_elems(x.len()), &args![InOut(x), x.len() as u32])
}

#[test]
fn a_missing_gpu_is_a_typed_error() {
    assert!(matches!(Device::cuda(4096), Err(Error::CudaUnavailable { .. })));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_names_its_gpu() {
    let (dev, _serial) = gpu();
    let name = dev.name();
    assert!(name.contains("(sm_") && name.contains(", driver "), "{name}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn scalars_of_every_type_and_long_argument_lists_are_passed() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let out = dev.alloc::<f32>(5)?;
    let args = args![
        Out(&out),
        1.5f32,
        7u32,
        -3i32,
        5u64 << 40,
        1u32,
        2u32,
        3u32,
        4u32,
        5u32,
        6u32,
        7u32,
        8u32,
        9u32,
        10u32,
        11u32,
        12u32,
        13u32
    ];
    s.launch(&MANY, LaunchDims::for_elems(1), &args)?;
    assert_eq!(out.to_vec(&s)?, vec![1.5, 7.0, -3.0, 5.0, 91.0]);
    Ok(())
}

#[test]
fn the_test_kernels_name_their_parameters_as_their_sources_do() {
    for k in [&ADD_ONE, &MANY, &GRID_OF] {
        assert_eq!(crate::device::kernel::entry_params(k.source, k.name).as_deref(), Some(k.params), "{}", k.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_launch_with_the_wrong_argument_count_is_refused_before_anything_is_enqueued() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[1.0f32, 2.0])?;
    let err = s.launch(&ADD_ONE, LaunchDims::for_elems(2), &args![InOut(&x)]).unwrap_err();
    assert!(matches!(err, Error::KernelArgCount { kernel: "add_one", found: 1, .. }), "{err}");
    assert_eq!(x.to_vec(&s)?, vec![1.0, 2.0]);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_compile_error_carries_the_log() {
    let (dev, _serial) = gpu();
    let s = dev.stream().expect("stream");
    let x = dev.alloc::<f32>(1).expect("alloc");
    match s.launch(&BROKEN, LaunchDims::for_elems(1), &args![InOut(&x), 1u32]) {
        Err(Error::Compile { module, arch, log }) => {
            assert_eq!(module, "broken");
            assert!(arch.starts_with("sm_") && log.contains("error"), "{arch}: {log}");
        }
        other => panic!("expected a compile error, got {:?}", other.err()),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_a_capturing_stream_ends_its_capture() -> Result<()> {
    let (dev, _serial) = gpu();
    let before = super::capture::active_count();
    let s = dev.stream()?;
    s.begin_capture(CaptureMode::Global)?;
    assert_eq!(super::capture::active_count(), before + 1);
    drop(s);
    assert_eq!(super::capture::active_count(), before);
    let x = dev.alloc::<f32>(4)?;
    drop(x);
    dev.synchronize()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_dropped_during_a_capture_is_freed_after_it() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[5.0f32; 4])?;
    let unused = dev.alloc::<f32>(1 << 20)?;
    let cap = s.capture(CaptureMode::Global)?;
    s.memset(&x, 0)?;
    drop(unused);
    assert_eq!(s.capture_status()?, CaptureStatus::Active);
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    assert_eq!(x.to_vec(&s)?, vec![0.0; 4]);
    dev.synchronize()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn timing_events_measure_gpu_time() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(1 << 16)?;
    let (start, end): (Event, Event) = (dev.timing_event()?, dev.timing_event()?);
    s.record(&start)?;
    for _ in 0..10 {
        add_one(&s, &x)?;
    }
    s.record(&end)?;
    end.synchronize()?;
    assert!(end.query()?);
    let ms = start.elapsed_ms(&end)?;
    assert!(ms.is_finite() && ms >= 0.0, "{ms}");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_profile_times_each_launch() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(1 << 20)?;
    let (a, c) = (dev.alloc::<half::bf16>(256 * 256)?, dev.alloc::<half::bf16>(256 * 256)?);
    let profile = s.profile()?;
    add_one(&s, &x)?;
    s.gemm(crate::device::Gemm::new(c.view(), a.view(), a.view(), (256, 256, 256)))?;
    let times = profile.finish()?;
    let names: Vec<_> = times.iter().map(|t| (t.name, t.flops)).collect();
    assert_eq!(names, vec![("add_one", None), ("gemm_bf16", Some(2 * 256 * 256 * 256))]);
    for t in &times {
        assert!(t.elapsed_us.is_some_and(|us| us.is_finite() && us > 0.0), "{t:?}");
    }
    Ok(())
}

/// A graph that holds a collective of an aborted communicator is refused at launch, naming
/// the abort, instead of running NCCL's kernels on freed resources.
#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn a_graph_of_an_aborted_communicator_is_refused() -> Result<()> {
    use crate::device::{CommErrorKind, CommOptions, Communicator, NcclId};
    let (dev, _serial) = gpu();
    let comm = Communicator::nccl(&dev, 0, 1, &NcclId::new()?, CommOptions::default())?;
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[1.5f32; 256])?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    comm.all_reduce(&s, &x)?;
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    s.synchronize()?;
    comm.abort();
    match exec.launch(&s) {
        Err(Error::Comm { kind: CommErrorKind::Nccl(why), .. }) if why.contains("aborted") => Ok(()),
        other => panic!("expected the launch refused, got {other:?}"),
    }
}

/// A grid-stride launch asking for 8 blocks per SM runs the one wave its occupancy allows, eagerly
/// and in a graph alike, and still covers its work; any other launch keeps its grid.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_grid_stride_launch_runs_one_wave_of_blocks() -> Result<()> {
    let (dev, _serial) = gpu();
    let s = dev.stream()?;
    let n = 1u32 << 22;
    let out = dev.alloc::<u32>(n as usize)?;
    let asked = 132 * 8;
    let dims = |grid_stride| LaunchDims { grid: (asked, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0, grid_stride };
    let covered = |got: &[u32]| got[1..].iter().enumerate().all(|(i, &v)| v as usize == i + 1);

    s.launch(&GRID_OF, dims(true), &args![Out(&out), n])?;
    let got = out.to_vec(&s)?;
    let wave = got[0];
    assert!(wave >= 1 && wave < asked, "a grid-stride launch ran {wave} blocks of the {asked} asked");
    assert!(covered(&got), "the trimmed grid left elements unwritten");

    s.memset(&out, 0)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.launch(&GRID_OF, dims(true), &args![Out(&out), n])?;
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    let got = out.to_vec(&s)?;
    assert_eq!(got[0], wave, "the graph's node runs the eager launch's grid");
    assert!(covered(&got));

    s.launch(&GRID_OF, dims(false), &args![Out(&out), n])?;
    assert_eq!(out.to_vec(&s)?[0], asked, "a launch that is not grid-stride keeps its grid");
    dev.synchronize()
}
