//! The op abstraction: a kernel is described once, and its launch arguments declare its accesses.
//!
//! A [`Kernel`] names a CUDA C entry point, its source and its parameters, and gives a CPU path,
//! which reads its arguments by the entry point's parameter names, not positions, so that they
//! cannot drift from the CUDA signature (a unit test checks `params` against the source). A
//! launch passes typed arguments, one per parameter: [`In`], [`Out`] and [`InOut`] views of
//! buffers, and scalars. The declared [`Access`]es are derived from those arguments, so they
//! cannot drift from what the launch passes. On the simulator the CPU path sees exactly its
//! declared regions, gathered into dense slices in region order, and writes back only what it
//! declared as written; on CUDA each view is passed as a pointer to its first element. Scalars
//! are copied when the launch is enqueued, so a captured graph freezes them as CUDA does.
//!
//! ```
//! use graphed::device::{args, Device, In, Kernel, LaunchDims, Out};
//!
//! fn scale_cpu(a: &graphed::device::CpuArgs) -> graphed::Result<()> {
//!     let (x, k) = (a.input::<f32>("x")?, a.f32("k")?);
//!     for (y, x) in a.output::<f32>("y")?.iter_mut().zip(x.iter()) {
//!         *y = k * x;
//!     }
//!     Ok(())
//! }
//! static SCALE: Kernel = Kernel {
//!     name: "scale",
//!     source: r#"extern "C" __global__ void scale(float* y, const float* x, float k, unsigned n) {
//!         unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = k * x[i]; }"#,
//!     params: &["y", "x", "k", "n"],
//!     cpu: scale_cpu,
//!     strided: false,
//! };
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let x = dev.alloc_from(&s, &[1.0f32, 2.0])?;
//! let y = dev.alloc::<f32>(2)?;
//! s.launch(&SCALE, LaunchDims::for_elems(2), &args![Out(&y), In(&x), 3.0f32, 2u32])?;
//! assert_eq!(y.to_vec(&s)?, vec![3.0, 6.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use std::cell::{Ref, RefCell, RefMut};
use std::sync::Arc;

use super::memory::{Block, RawBuffer};
use super::{Access, AccessMode, AccessRole, DType, DeviceBuffer, Elem, Region, View};
use crate::{Error, Result};

/// The CPU path of a kernel.
pub type CpuFn = fn(&CpuArgs) -> Result<()>;

/// A kernel, described once for both devices.
#[derive(Debug)]
pub struct Kernel {
    /// The `extern "C" __global__` entry point in `source`.
    pub name: &'static str,
    /// CUDA C source containing the entry point; compiled by NVRTC on CUDA.
    pub source: &'static str,
    /// The entry point's parameter names, in order. The CPU path reads its arguments by these
    /// names, and [`Stream::launch`](super::Stream::launch) refuses a launch that does not pass
    /// one argument per name.
    pub params: &'static [&'static str],
    /// The CPU path, run by the simulator on the declared regions.
    pub cpu: CpuFn,
    /// Whether the CUDA code indexes its arguments with strides it is given, and so accepts
    /// strided views. A kernel that indexes densely must not be given one: CUDA receives only a
    /// pointer to the first element, while the simulator gathers the region, so the two would
    /// disagree. [`Stream::launch`](super::Stream::launch) refuses such launches.
    pub strided: bool,
}

/// Grid and block sizes of a launch (ignored by the simulator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks per grid.
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem_bytes: u32,
    /// The kernel covers its work with a grid-stride loop, so any number of blocks computes
    /// the same result. A CUDA device then launches at most one wave of `grid.0`: the blocks
    /// its SMs hold at once at the function's occupancy (registers, shared memory). A grid
    /// sized for 8 blocks of 256 threads per SM would otherwise leave a partial second wave for
    /// a kernel whose registers fit 5.
    pub grid_stride: bool,
}

impl LaunchDims {
    /// One thread per element, blocks of 256.
    pub fn for_elems(n: usize) -> LaunchDims {
        let blocks = n.div_ceil(256).max(1) as u32;
        LaunchDims { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0, grid_stride: false }
    }

    /// These dims with at most one wave of blocks on a device of `sms` multiprocessors, each of
    /// which holds `resident` blocks of this launch at once: unchanged unless the launch is
    /// [`grid_stride`](LaunchDims::grid_stride), and never below one block per SM (an
    /// occupancy of 0 means the launch cannot run at all, which the launch itself reports).
    ///
    /// ```
    /// use graphed::device::LaunchDims;
    ///
    /// let dims = LaunchDims { grid: (1056, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0, grid_stride: true };
    /// assert_eq!(dims.one_wave(132, 5).grid, (660, 1, 1));
    /// assert_eq!(LaunchDims { grid_stride: false, ..dims }.one_wave(132, 5).grid, (1056, 1, 1));
    /// ```
    pub fn one_wave(self, sms: u32, resident: u32) -> LaunchDims {
        if !self.grid_stride || resident == 0 {
            return self;
        }
        let wave = sms.saturating_mul(resident).max(1);
        LaunchDims { grid: (self.grid.0.min(wave), self.grid.1, self.grid.2), ..self }
    }
}

/// A scalar kernel argument, copied at enqueue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// `float`
    F32(f32),
    /// `unsigned int`
    U32(u32),
    /// `int`
    I32(i32),
    /// `unsigned long long`
    U64(u64),
}

impl Scalar {
    /// The scalar's bytes, as the kernel parameter receives them.
    pub(crate) fn bytes(&self) -> [u8; 8] {
        let mut out = [0u8; 8];
        match *self {
            Scalar::F32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            Scalar::U32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            Scalar::I32(v) => out[..4].copy_from_slice(&v.to_ne_bytes()),
            Scalar::U64(v) => out.copy_from_slice(&v.to_ne_bytes()),
        }
        out
    }

    fn kind(&self) -> &'static str {
        match self {
            Scalar::F32(_) => "f32 scalar",
            Scalar::U32(_) => "u32 scalar",
            Scalar::I32(_) => "i32 scalar",
            Scalar::U64(_) => "u64 scalar",
        }
    }
}

macro_rules! scalar_from {
    ($($t:ty => $v:ident),*) => { $(impl From<$t> for Arg<'_> { fn from(v: $t) -> Self { Arg::Scalar(Scalar::$v(v)) } })* };
}
scalar_from!(f32 => F32, u32 => U32, i32 => I32, u64 => U64);

/// One launch argument: a buffer region with its access mode, or a scalar.
#[derive(Clone)]
pub enum Arg<'a> {
    /// A buffer region.
    Buf(BufArg<'a>),
    /// A scalar.
    Scalar(Scalar),
}

/// A buffer argument of a launch.
#[derive(Clone)]
pub struct BufArg<'a> {
    pub(crate) block: &'a Arc<Block>,
    /// The block's allocation, which backends address.
    pub(crate) raw: &'a Arc<RawBuffer>,
    /// In elements from the start of `raw`.
    pub(crate) region: Region,
    /// In elements from the start of the block (what the caller wrote).
    pub(crate) view: Region,
    pub(crate) buffer_len: usize,
    pub(crate) dtype: DType,
    pub(crate) mode: AccessMode,
    /// Set for a hidden access of a library call (a workspace), named for reports.
    pub(crate) hidden: Option<&'static str>,
    /// Whether the CUDA code reads this buffer's address from a device table ([`Indirect`]).
    pub(crate) indirect: bool,
}

/// Something that can be viewed as a device region of `Elem`: a buffer or a view.
pub trait IntoView<'a> {
    /// Element type.
    type Elem: Elem;
    /// The view.
    fn into_view(self) -> View<'a, Self::Elem>;
}

impl<'a, T: Elem> IntoView<'a> for View<'a, T> {
    type Elem = T;
    fn into_view(self) -> View<'a, T> {
        self
    }
}

impl<'a, T: Elem> IntoView<'a> for &'a DeviceBuffer<T> {
    type Elem = T;
    fn into_view(self) -> View<'a, T> {
        self.view()
    }
}

/// The kernel reads this region.
pub struct In<V>(pub V);
/// The kernel writes every element of this region without reading it.
pub struct Out<V>(pub V);
/// The kernel reads and writes this region.
pub struct InOut<V>(pub V);

fn buf_arg<'a, V: IntoView<'a>>(v: V, mode: AccessMode) -> Arg<'a> {
    let v = v.into_view();
    Arg::Buf(BufArg {
        block: v.block,
        raw: &v.block.raw,
        region: v.absolute(),
        view: v.region,
        buffer_len: v.buffer_len,
        dtype: V::Elem::DTYPE,
        mode,
        hidden: None,
        indirect: false,
    })
}

/// A buffer a library call reads and writes without the caller naming it (a workspace); declared
/// like an argument so that the simulator, the checker and graph summaries see it.
pub(crate) struct Hidden<V>(pub &'static str, pub V);

impl<'a, V: IntoView<'a>> From<Hidden<V>> for Arg<'a> {
    fn from(h: Hidden<V>) -> Self {
        match buf_arg(h.1, AccessMode::ReadWrite) {
            Arg::Buf(b) => Arg::Buf(BufArg { hidden: Some(h.0), ..b }),
            scalar => scalar,
        }
    }
}

/// A buffer argument whose address the CUDA code reads from a device table the caller keeps,
/// not from its parameter: the argument still declares the access (for the checker, the
/// simulator and rebinds), and a rebind of it changes no graph node on CUDA, where the caller
/// rewrites the table instead, ordered on a stream before the launches that read it
/// (`ops::copy::bytes_via`).
pub(crate) struct Indirect<A>(pub A);

impl<'a, A: Into<Arg<'a>>> From<Indirect<A>> for Arg<'a> {
    fn from(a: Indirect<A>) -> Self {
        match a.0.into() {
            Arg::Buf(b) => Arg::Buf(BufArg { indirect: true, ..b }),
            scalar => scalar,
        }
    }
}

impl<'a, V: IntoView<'a>> From<In<V>> for Arg<'a> {
    fn from(v: In<V>) -> Self {
        buf_arg(v.0, AccessMode::Read)
    }
}
impl<'a, V: IntoView<'a>> From<Out<V>> for Arg<'a> {
    fn from(v: Out<V>) -> Self {
        buf_arg(v.0, AccessMode::Write)
    }
}
impl<'a, V: IntoView<'a>> From<InOut<V>> for Arg<'a> {
    fn from(v: InOut<V>) -> Self {
        buf_arg(v.0, AccessMode::ReadWrite)
    }
}

/// Builds a launch's argument list, converting each item with `Into<Arg>`.
#[macro_export]
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$($crate::device::Arg::from($a)),*] };
}
pub use args;

/// The declared accesses of an argument list, in argument order.
pub fn accesses(args: &[Arg<'_>]) -> Vec<Access> {
    args.iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            Arg::Buf(b) => Some(Access {
                buffer: b.block.id,
                memory: b.raw.id,
                at: b.region,
                elem_bytes: b.dtype.size(),
                region: b.view,
                mode: b.mode,
                role: b.hidden.map_or(AccessRole::Arg(i), AccessRole::Hidden),
            }),
            Arg::Scalar(_) => None,
        })
        .collect()
}

/// A buffer region gathered into dense, 8-byte aligned storage.
pub(crate) struct Gathered {
    pub(crate) words: Vec<u64>,
    pub(crate) bytes: usize,
}

impl Gathered {
    pub(crate) fn zeroed(bytes: usize) -> Gathered {
        Gathered { words: vec![0; bytes.div_ceil(8)], bytes }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.bytes]
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.bytes]
    }
}

pub(crate) enum CpuSlot {
    /// `address`: the region's first byte as the device addresses it ([`super::backend::device_address`]).
    Buf {
        dtype: DType,
        mode: AccessMode,
        data: RefCell<Gathered>,
        address: u64,
    },
    Scalar(Scalar),
}

/// What a kernel's CPU path sees: each buffer argument as a dense slice of its declared region
/// (in region order), and the scalars, each read by its parameter name in [`Kernel::params`].
pub struct CpuArgs {
    pub(crate) kernel: &'static Kernel,
    pub(crate) slots: Vec<CpuSlot>,
}

impl CpuArgs {
    /// The position of parameter `param`. A scan of a handful of names: only the simulator
    /// reads arguments this way.
    fn index(&self, param: &str) -> Result<usize> {
        self.kernel.params.iter().position(|p| *p == param).ok_or_else(|| Error::UnknownKernelParam {
            kernel: self.kernel.name,
            param: param.to_string(),
            known: self.kernel.params,
        })
    }

    fn mismatch(&self, param: &str, index: usize, expected: String) -> Error {
        let found = match self.slots.get(index) {
            None => "missing".to_string(),
            Some(CpuSlot::Scalar(s)) => s.kind().to_string(),
            Some(CpuSlot::Buf { dtype, mode, .. }) => format!("a {mode:?} {dtype} buffer"),
        };
        Error::KernelArg { kernel: self.kernel.name, param: param.to_string(), expected, found }
    }

    /// Slot `param`, a buffer the kernel reads (`want_read`) or writes, of element type `dtype`
    /// (any, for `None`).
    fn buf(&self, param: &str, want_read: bool, dtype: Option<DType>) -> Result<(usize, &RefCell<Gathered>)> {
        let index = self.index(param)?;
        match self.slots.get(index) {
            Some(CpuSlot::Buf { dtype: d, mode, data, .. })
                if dtype.is_none_or(|t| t == *d) && (if want_read { mode.reads() } else { mode.writes() }) =>
            {
                Ok((index, data))
            }
            _ => {
                let what = if want_read { "In/InOut" } else { "Out/InOut" };
                let of = dtype.map(|t| format!(" {t}")).unwrap_or_default();
                Err(self.mismatch(param, index, format!("an {what}{of} buffer")))
            }
        }
    }

    /// Slot `param`'s bytes, read-only (`In` or `InOut`), of element type `dtype` (any, for `None`).
    fn read(&self, param: &str, dtype: Option<DType>) -> Result<Ref<'_, [u8]>> {
        let (index, cell) = self.buf(param, true, dtype)?;
        let r =
            cell.try_borrow().map_err(|_| self.mismatch(param, index, "an argument not borrowed mutably".into()))?;
        Ok(Ref::map(r, Gathered::as_bytes))
    }

    /// Slot `param`'s bytes, mutable (`Out` or `InOut`), of element type `dtype` (any, for `None`).
    fn write(&self, param: &str, dtype: Option<DType>) -> Result<RefMut<'_, [u8]>> {
        let (index, cell) = self.buf(param, false, dtype)?;
        let r = cell
            .try_borrow_mut()
            .map_err(|_| self.mismatch(param, index, "an argument not borrowed elsewhere".into()))?;
        Ok(RefMut::map(r, Gathered::as_bytes_mut))
    }

    /// Argument `param` as a read-only slice (`In` or `InOut`).
    pub fn input<T: Elem>(&self, param: &str) -> Result<Ref<'_, [T]>> {
        Ok(Ref::map(self.read(param, Some(T::DTYPE))?, |b| bytemuck::cast_slice(b)))
    }

    /// Argument `param` as a mutable slice (`Out` or `InOut`); `Out` slices start with the
    /// region's current contents.
    pub fn output<T: Elem>(&self, param: &str) -> Result<RefMut<'_, [T]>> {
        Ok(RefMut::map(self.write(param, Some(T::DTYPE))?, |b| bytemuck::cast_slice_mut(b)))
    }

    /// Argument `param`'s bytes, read-only, whatever its element type (`In` or `InOut`).
    pub fn input_bytes(&self, param: &str) -> Result<Ref<'_, [u8]>> {
        self.read(param, None)
    }

    /// Argument `param`'s bytes, mutable, whatever its element type (`Out` or `InOut`).
    pub fn output_bytes(&self, param: &str) -> Result<RefMut<'_, [u8]>> {
        self.write(param, None)
    }

    /// The device address of buffer argument `param`'s first element: what a table that names
    /// the buffer must hold (the simulator's are its own, unique per byte as CUDA's are).
    pub fn address(&self, param: &str) -> Result<u64> {
        let index = self.index(param)?;
        match self.slots.get(index) {
            Some(CpuSlot::Buf { address, .. }) => Ok(*address),
            _ => Err(self.mismatch(param, index, "a buffer".into())),
        }
    }

    fn scalar<T>(&self, param: &str, expected: &str, pick: fn(Scalar) -> Option<T>) -> Result<T> {
        let index = self.index(param)?;
        match self.slots.get(index) {
            Some(CpuSlot::Scalar(s)) => pick(*s),
            _ => None,
        }
        .ok_or_else(|| self.mismatch(param, index, expected.to_string()))
    }

    /// Argument `param` as an `f32` scalar.
    pub fn f32(&self, param: &str) -> Result<f32> {
        self.scalar(param, "an f32 scalar", |s| match s {
            Scalar::F32(v) => Some(v),
            _ => None,
        })
    }

    /// Argument `param` as a `u32` scalar.
    pub fn u32(&self, param: &str) -> Result<u32> {
        self.scalar(param, "a u32 scalar", |s| match s {
            Scalar::U32(v) => Some(v),
            _ => None,
        })
    }

    /// Argument `param` as an `i32` scalar.
    pub fn i32(&self, param: &str) -> Result<i32> {
        self.scalar(param, "an i32 scalar", |s| match s {
            Scalar::I32(v) => Some(v),
            _ => None,
        })
    }

    /// Argument `param` as a `u64` scalar.
    pub fn u64(&self, param: &str) -> Result<u64> {
        self.scalar(param, "a u64 scalar", |s| match s {
            Scalar::U64(v) => Some(v),
            _ => None,
        })
    }
}

/// The parameter names of entry point `name` in CUDA `source`: the last identifier of each
/// parameter of its `extern "C" __global__ void name(...)`, or `None` if there is no such entry
/// point. Tests check every [`Kernel::params`] against it.
#[cfg(test)]
pub(crate) fn entry_params<'s>(source: &'s str, name: &str) -> Option<Vec<&'s str>> {
    const ENTRY: &str = "extern \"C\" __global__ void ";
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    source.match_indices(ENTRY).find_map(|(at, _)| {
        let rest = source[at + ENTRY.len()..].trim_start();
        let open = rest.find('(')?;
        if rest[..open].trim_end() != name {
            return None;
        }
        let list = &rest[open + 1..open + rest[open..].find(')')?];
        if list.trim().is_empty() {
            return Some(Vec::new());
        }
        list.split(',').map(|p| p.split(|c| !is_ident(c)).rfind(|w| !w.is_empty())).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    fn accesses_follow_the_argument_list() {
        let dev = Device::sim();
        let (x, y) = (dev.alloc::<f32>(12).unwrap(), dev.alloc::<half::bf16>(8).unwrap());
        let head = x.strided(1, &[(3, 4), (2, 1)]).unwrap();
        let list = args![Out(y.slice(2..6)), In(head), 1.5f32, InOut(&x), 7u32];
        let acc = accesses(&list);
        assert_eq!(acc.len(), 3, "scalars declare no access");
        assert_eq!((acc[0].buffer, acc[0].mode, acc[0].role), (y.id(), AccessMode::Write, AccessRole::Arg(0)));
        assert_eq!((acc[0].region, acc[0].elem_bytes), (Region::contiguous(2, 4), 2));
        assert_eq!((acc[1].buffer, acc[1].mode, acc[1].role), (x.id(), AccessMode::Read, AccessRole::Arg(1)));
        assert_eq!(acc[1].region.indices().collect::<Vec<_>>(), vec![1, 2, 5, 6, 9, 10]);
        assert_eq!(
            (acc[2].mode, acc[2].role, acc[2].region),
            (AccessMode::ReadWrite, AccessRole::Arg(3), Region::contiguous(0, 12))
        );
    }

    static TWO: Kernel = Kernel { name: "two", source: "", params: &["x", "n"], cpu: |_| Ok(()), strided: false };

    #[test]
    fn cpu_args_refuse_the_wrong_form() {
        let slots = vec![
            CpuSlot::Buf {
                dtype: DType::F32,
                mode: AccessMode::Read,
                data: RefCell::new(Gathered::zeroed(8)),
                address: 0,
            },
            CpuSlot::Scalar(Scalar::U32(3)),
        ];
        let a = CpuArgs { kernel: &TWO, slots };
        assert_eq!(a.input::<f32>("x").unwrap().len(), 2);
        let err = a.output::<f32>("x").unwrap_err();
        assert!(matches!(&err, Error::KernelArg { param, .. } if param == "x"), "an In buffer is not writable: {err}");
        assert!(err.to_string().contains("argument `x` is a Read f32 buffer"), "{err}");
        assert!(matches!(a.input::<u32>("x"), Err(Error::KernelArg { .. })), "dtype is checked");
        assert_eq!(a.u32("n").unwrap(), 3);
        assert!(
            matches!(a.f32("n"), Err(Error::KernelArg { .. })) && matches!(a.u32("x"), Err(Error::KernelArg { .. }))
        );
    }

    #[test]
    fn an_unknown_parameter_name_is_a_typed_error() {
        let a = CpuArgs { kernel: &TWO, slots: vec![CpuSlot::Scalar(Scalar::U32(3))] };
        for err in [a.u32("m").unwrap_err(), a.input::<f32>("y").map(|_| ()).unwrap_err()] {
            assert!(matches!(err, Error::UnknownKernelParam { kernel: "two", known: ["x", "n"], .. }), "{err}");
            assert!(err.to_string().contains("[\"x\", \"n\"]"), "{err}");
        }
    }

    #[test]
    fn a_launch_with_the_wrong_argument_count_enqueues_nothing() {
        fn write_y(a: &CpuArgs) -> Result<()> {
            a.output::<f32>("y")?.fill(1.0);
            Ok(())
        }
        static WRITE: Kernel = Kernel { name: "write", source: "", params: &["y", "n"], cpu: write_y, strided: false };
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let y = dev.alloc::<f32>(2).unwrap();
        for list in [&args![Out(&y)][..], &args![Out(&y), 2u32, 2u32]] {
            let err = s.launch(&WRITE, LaunchDims::for_elems(2), list).unwrap_err();
            assert!(
                matches!(err, Error::KernelArgCount { kernel: "write", params: ["y", "n"], found: 1 | 3 }),
                "{err}"
            );
        }
        assert_eq!(y.to_vec(&s).unwrap(), vec![0.0; 2], "nothing ran");
        s.launch(&WRITE, LaunchDims::for_elems(2), &args![Out(&y), 2u32]).unwrap();
        assert_eq!(y.to_vec(&s).unwrap(), vec![1.0; 2]);
    }

    #[test]
    fn entry_params_reads_the_signature() {
        let src = "__device__ float f(float a) { return a; }\n\
                   extern \"C\" __global__ void other(int q) {}\n\
                   extern \"C\" __global__ void k(float* __restrict__ y, const unsigned long long *step,\n  unsigned n) {}\n\
                   extern \"C\" __global__ void none() {}";
        assert_eq!(entry_params(src, "k"), Some(vec!["y", "step", "n"]));
        assert_eq!(entry_params(src, "other"), Some(vec!["q"]));
        assert_eq!(entry_params(src, "none"), Some(vec![]));
        assert_eq!(entry_params(src, "f"), None, "only entry points count");
        assert_eq!(entry_params(src, "missing"), None);
    }
}
