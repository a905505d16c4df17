//! cuBLASLt GEMMs: one handle per device, and a plan (descriptors and the algorithm the
//! heuristic picked) per GEMM layout, made once and reused, so a GEMM in a training step costs a
//! lookup and one `cublasLtMatmul`.
//!
//! graphed's GEMMs are row-major; cuBLASLt is column-major. A row-major `C = op(A)·op(B)` is the
//! column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so cuBLASLt gets B as its first operand and A as its second,
//! each described by its stored shape with rows and columns swapped.
//!
//! cuBLASLt defines its epilogues in its own column-major terms, where our `m × n` output is an
//! `n × m` matrix: our per-column bias (`n`, added to every row) is its per-row bias (`BIAS`,
//! `GELU_AUX_BIAS`); our aux matrix with row stride `ld` is its aux with leading dimension `ld`;
//! our column sums of D are its `DGELU_BGRAD` sums along D's rows; and the row sums over `k` of
//! our op(A) are the sums over `k` of its op(B) (our A is its B), one per column of its D:
//! `BGRADB`, not `BGRADA`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::{size_of, MaybeUninit};
use std::sync::{Mutex, PoisonError};

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;

use super::memory;
use super::stream::CuStream;
use crate::device::gemm::{EpilogueKind, GemmSpec, Operand};
use crate::device::kernel::Arg;
use crate::device::DType;
use crate::{Error, Result};

fn fail(op: &'static str) -> impl Fn(CublasError) -> Error {
    move |e| Error::Cuda { op, message: format!("cuBLASLt: {:?}", e.0) }
}

/// A cuBLASLt handle, destroyed with the device.
struct Handle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread; graphed serializes its use with the
// `Blas` lock.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `lt::create_handle` and is destroyed once.
        if let Err(e) = unsafe { lt::destroy_handle(self.0) } {
            // Dropped with its device: no call of the device remains to return the error.
            tracing::warn!("graphed: destroying the cuBLASLt handle failed: {:?}", e.0);
        }
    }
}

/// The descriptors and algorithm of one GEMM layout.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// cuBLASLt's A (our B), its B (our A), and D.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    /// cuBLASLt's C when it is not D (an addend).
    addend: Option<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects, used under the `Blas` lock.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once for this plan and is destroyed once.
        let destroyed = unsafe {
            let layouts = self.layouts.into_iter().chain(self.addend).map(|l| lt::destroy_matrix_layout(l));
            layouts.fold(lt::destroy_matmul_desc(self.desc), Result::and)
        };
        if let Err(e) = destroyed {
            // Dropped with its device, or by a `Plan::new` whose GEMM returns its own error: no
            // call remains to return this one.
            tracing::warn!("graphed: destroying a cuBLASLt GEMM plan failed: {:?}", e.0);
        }
    }
}

#[derive(Default)]
struct State {
    handle: Option<Handle>,
    plans: HashMap<GemmSpec, Plan>,
}

/// The device's cuBLASLt state.
#[derive(Default)]
pub(super) struct Blas {
    state: Mutex<State>,
}

/// cuBLASLt's name of an element type; the public layer admits no other.
fn data_type(dtype: DType) -> std::result::Result<sys::cudaDataType, CublasError> {
    match dtype {
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F8E4M3 => Ok(sys::cudaDataType_t::CUDA_R_8F_E4M3),
        DType::F8E5M2 => Ok(sys::cudaDataType_t::CUDA_R_8F_E5M2),
        _ => Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)),
    }
}

/// A column-major layout of a row-major operand: its stored shape, rows and columns swapped.
fn layout(
    ty: sys::cudaDataType,
    o: &Operand,
    batch: usize,
) -> std::result::Result<sys::cublasLtMatrixLayout_t, CublasError> {
    let l = lt::create_matrix_layout(ty, o.cols as u64, o.rows as u64, o.ld as i64)?;
    if batch > 1 {
        let count = batch as i32;
        let stride = o.batch_stride as i64;
        // SAFETY: `l` is live; each value is the size the attribute expects (int32, int64).
        unsafe {
            set_layout(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
            set_layout(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride)?;
        }
    }
    Ok(l)
}

/// # Safety
/// `l` must be live and `T` the attribute's type.
unsafe fn set_layout<T>(
    l: sys::cublasLtMatrixLayout_t,
    attr: sys::cublasLtMatrixLayoutAttribute_t,
    v: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: forwarded from the caller.
    unsafe { lt::set_matrix_layout_attribute(l, attr, (v as *const T).cast::<c_void>(), size_of::<T>()) }
}

/// # Safety
/// `d` must be live and `T` the attribute's type.
unsafe fn set_desc<T>(
    d: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: forwarded from the caller.
    unsafe { lt::set_matmul_desc_attribute(d, attr, (v as *const T).cast::<c_void>(), size_of::<T>()) }
}

/// `cublasOperation_t` as the attribute stores it: `CUBLAS_OP_N` = 0, `CUBLAS_OP_T` = 1.
fn operation(transpose: bool) -> i32 {
    i32::from(transpose)
}

/// cuBLASLt's epilogue for ours (see the module doc for the layout), `None` for its default.
fn epilogue(kind: EpilogueKind) -> Option<sys::cublasLtEpilogue_t> {
    use sys::cublasLtEpilogue_t as E;
    match kind {
        EpilogueKind::None => None,
        EpilogueKind::Bias => Some(E::CUBLASLT_EPILOGUE_BIAS),
        EpilogueKind::BiasGeluAux => Some(E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
        EpilogueKind::DGeluBGrad => Some(E::CUBLASLT_EPILOGUE_DGELU_BGRAD),
        EpilogueKind::BGradA => Some(E::CUBLASLT_EPILOGUE_BGRADB),
        EpilogueKind::DGelu => Some(E::CUBLASLT_EPILOGUE_DGELU),
    }
}

impl Plan {
    fn new(handle: &Handle, spec: &GemmSpec, workspace_bytes: usize) -> std::result::Result<Plan, CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let ty = data_type(spec.dtype)?;
        let [a_ty, b_ty] = spec.inputs.map(data_type);
        // IEEE f32 accumulation for every type: bf16 and FP8 inputs, f32 sums; f32 without TF32.
        let desc =
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)?;
        // Built first, so that every descriptor is destroyed once whatever fails below.
        let mut plan = Plan {
            desc,
            layouts: [
                layout(b_ty?, &spec.b, spec.batch)?,
                layout(a_ty?, &spec.a, spec.batch)?,
                layout(ty, &spec.c, spec.batch)?,
            ],
            addend: None,
            // SAFETY: a plain C struct that the heuristic below fills before it is read.
            algo: unsafe { MaybeUninit::zeroed().assume_init() },
        };
        plan.addend = spec.addend.map(|o| layout(ty, &o, spec.batch)).transpose()?;
        // The bias and aux pointers are set per call (`Blas::gemm`); their types default to D's.
        // SAFETY: `desc` is live; the values are int32 operations, a uint32 epilogue and an int64
        // leading dimension.
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &operation(spec.trans_b))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &operation(spec.trans_a))?;
            if let Some(e) = epilogue(spec.epilogue) {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(e as u32))?;
            }
            if let Some(ld) = spec.aux_ld {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(ld as i64))?;
            }
            if let Some(scaled) = spec.scaled {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &i8::from(scaled.fast_accum))?;
            }
        }
        let pref = lt::create_matmul_pref()?;
        let bytes = workspace_bytes as u64;
        // SAFETY: `pref` is live; the workspace limit is a uint64; it is destroyed once, below.
        let found = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast::<c_void>(),
                size_of::<u64>(),
            );
            let found = set.and_then(|_| {
                let [a, b, d] = plan.layouts;
                lt::get_matmul_algo_heuristic(handle.0, desc, a, b, plan.addend.unwrap_or(d), d, pref)
            });
            let _ = lt::destroy_matmul_pref(pref);
            found?
        };
        plan.algo = found.algo;
        Ok(plan)
    }
}

impl Blas {
    /// Enqueues the GEMM on `stream`. `args` are laid out as `Gemm::args` makes them, one per
    /// name of `params`.
    pub(super) fn gemm(
        &self,
        stream: &CuStream,
        spec: &GemmSpec,
        params: &[&str],
        args: &[Arg<'_>],
        (alpha, beta): (f32, f32),
        workspace_bytes: usize,
    ) -> Result<()> {
        const OP: &str = "Stream::gemm";
        let Pointers { d, a, b, c, workspace: ws, bias, aux, scales } = Pointers::of(spec, params, args)?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let st = &mut *st;
        if st.handle.is_none() {
            // SAFETY: only asks whether the library can be loaded.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::CudaUnavailable {
                    reason: "libcublasLt could not be loaded; install cuBLAS or add it to LD_LIBRARY_PATH".into(),
                });
            }
            st.handle = Some(Handle(lt::create_handle().map_err(fail(OP))?));
        }
        let handle = st.handle.as_ref().expect("created above");
        if !st.plans.contains_key(spec) {
            let plan = Plan::new(handle, spec, workspace_bytes).map_err(fail(OP))?;
            st.plans.insert(*spec, plan);
        }
        let plan = &st.plans[spec];
        use sys::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: the plan's descriptor is live; the pointers are device addresses (pointer-sized
        // values, as the attributes expect), set under the lock right before the call that reads
        // them.
        unsafe {
            if let Some(bias) = bias {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias).map_err(fail(OP))?;
            }
            if let Some(aux) = aux {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux).map_err(fail(OP))?;
            }
            if let Some(Scales { a_scale, b_scale }) = scales {
                // cuBLASLt's A is our B.
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale).map_err(fail(OP))?;
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale).map_err(fail(OP))?;
            }
        }
        let [layout_a, layout_b, layout_d] = plan.layouts;
        let layout_c = plan.addend.unwrap_or(layout_d);
        // SAFETY: the pointers (and the epilogue's, set above) address live, range-checked
        // allocations laid out as the plan's layouts and epilogue say (the public layer checked
        // the views against the dimensions and the epilogue); the workspace holds
        // `workspace_bytes`; the stream is live. Buffers outlive the call as for kernels.
        unsafe {
            lt::matmul(
                handle.0,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                b as *const c_void,
                layout_a,
                a as *const c_void,
                layout_b,
                c as *const c_void,
                layout_c,
                d as *mut c_void,
                layout_d,
                &plan.algo,
                ws as *mut c_void,
                workspace_bytes,
                stream.raw.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| Error::Cuda { op: OP, message: format!("cuBLASLt matmul: {:?}", e.0) })
    }
}

/// A GEMM's device addresses, found by name among its launch arguments.
struct Pointers {
    /// The output D (`c` among the arguments).
    d: u64,
    a: u64,
    b: u64,
    /// The matrix C added to the product: the addend, else D itself.
    c: u64,
    workspace: u64,
    /// The epilogue's bias, or its bias gradient: cuBLASLt reads one and writes the other through
    /// the same pointer.
    bias: Option<u64>,
    /// The epilogue's aux matrix.
    aux: Option<u64>,
    /// An FP8 GEMM's scales.
    scales: Option<Scales>,
}

/// The device addresses of an FP8 GEMM's scales (ours: A's is cuBLASLt's B's).
struct Scales {
    a_scale: u64,
    b_scale: u64,
}

impl Pointers {
    /// The addresses in `args`, one per name of `params`, that `spec` uses.
    fn of(spec: &GemmSpec, params: &[&str], args: &[Arg<'_>]) -> Result<Pointers> {
        const OP: &str = "Stream::gemm";
        let ptr = |name: &str| -> Result<u64> {
            match params.iter().position(|p| *p == name).and_then(|i| args.get(i)) {
                Some(Arg::Buf(b)) => memory::kernel_arg(OP, b.raw, b.region.offset() * b.dtype.size()),
                _ => Err(Error::Unsupported {
                    op: OP,
                    backend: "cuda",
                    why: "a GEMM's arguments are malformed; please report this as a bug",
                }),
            }
        };
        let (d, a, b, workspace) = (ptr("c")?, ptr("a")?, ptr("b")?, ptr("workspace")?);
        let c = if spec.addend.is_some() { ptr("addend")? } else { d };
        let bias = match spec.epilogue {
            EpilogueKind::None | EpilogueKind::DGelu => None,
            EpilogueKind::Bias | EpilogueKind::BiasGeluAux => Some(ptr("bias")?),
            EpilogueKind::DGeluBGrad | EpilogueKind::BGradA => Some(ptr("bias_grad")?),
        };
        let aux = if spec.aux_ld.is_some() { Some(ptr("aux")?) } else { None };
        let scales = match spec.scaled {
            None => None,
            Some(_) => Some(Scales { a_scale: ptr("a_scale")?, b_scale: ptr("b_scale")? }),
        };
        Ok(Pointers { d, a, b, c, workspace, bias, aux, scales })
    }
}
