//! cuDNN's fused attention on CUDA: one handle per device and one plan per attention layout
//! ([`SdpaSpec`]), made once and reused behind a lock, as `blas.rs` keeps cuBLASLt's, so an
//! attention call in a training step costs a lookup and one `cudnnBackendExecute`, which stream
//! capture records like any launch.
//!
//! - [`library`] probes and loads cuDNN and makes the handle;
//! - [`descriptor`] owns backend descriptors and sets their attributes by type;
//! - [`graph`] builds the forward and backward operation graphs cuDNN's engines recognise;
//! - [`plan`] asks cuDNN's heuristics for an engine and finalizes the plan.
//!
//! Plans are made before a call is enqueued, in relaxed capture mode, so a first call inside a
//! capture does not invalidate it; graphed's tests and the training loop plan in their eager
//! warm-up step anyway, as cuDNN's first execution also loads its kernels.

mod descriptor;
mod graph;
mod library;
mod plan;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

use cudarc::cudnn::sys::{self, cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as K};

use super::memory;
use super::stream::CuStream;
use crate::device::kernel::{Arg, Scalar};
use crate::device::sdpa::{SdpaPass, SdpaPlan, SdpaSpec};
use crate::{Error, Result};
use descriptor::Descriptor;
use graph::{uid, Variant};
use library::{check, Handle, OP};

#[derive(Default)]
struct State {
    handle: Option<Handle>,
    /// Why cuDNN cannot run on this device, once found out (no library, no handle).
    unavailable: Option<String>,
    /// Each spec's plan, or why it has none.
    plans: HashMap<SdpaSpec, std::result::Result<plan::Plan, String>>,
}

/// The device's cuDNN state.
#[derive(Default)]
pub(super) struct Cudnn {
    state: Mutex<State>,
}

impl Cudnn {
    /// The plan for `spec`, made on first use; the device's context is current.
    pub(super) fn plan(&self, spec: &SdpaSpec) -> Result<SdpaPlan> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let st = &mut *st;
        if st.handle.is_none() && st.unavailable.is_none() {
            match library::probe().and_then(|version| Handle::new().map_err(|e| format!("cuDNN {version}: {e}"))) {
                Ok(handle) => st.handle = Some(handle),
                Err(why) => st.unavailable = Some(why),
            }
        }
        let Some(handle) = &st.handle else {
            return Ok(SdpaPlan::Unavailable(st.unavailable.clone().unwrap_or_default()));
        };
        if !st.plans.contains_key(spec) {
            let built = plan::build(handle.0, spec)?;
            if let Err(why) = &built {
                tracing::warn!("graphed: {why}");
            }
            st.plans.insert(*spec, built);
        }
        Ok(match &st.plans[spec] {
            Ok(p) => {
                SdpaPlan::Ready { workspace: p.workspace, dq_accumulator: p.variant == Variant::BackwardAccumulated }
            }
            Err(why) => SdpaPlan::Unavailable(why.clone()),
        })
    }

    /// Enqueues the planned call on `stream`; `args` are laid out as `Sdpa::args` makes them,
    /// one per name of `params`.
    pub(super) fn execute(&self, stream: &CuStream, spec: &SdpaSpec, params: &[&str], args: &[Arg<'_>]) -> Result<()> {
        let arg = |name: &str| params.iter().position(|p| *p == name).and_then(|i| args.get(i));
        let ptr = |name: &str| -> Result<*mut c_void> {
            match arg(name) {
                Some(Arg::Buf(b)) => {
                    let at = memory::kernel_arg(OP, b.raw, b.region.offset() * b.dtype.size())?;
                    Ok(at as usize as *mut c_void)
                }
                _ => Err(malformed()),
            }
        };
        let Some(Arg::Scalar(Scalar::F32(scale))) = arg("scale") else { return Err(malformed()) };
        let (scale, neg_inf, one) = (*scale, f32::NEG_INFINITY, 1.0f32);
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (Some(handle), Some(Ok(plan))) = (&st.handle, st.plans.get(spec)) else {
            return Err(Error::Cudnn {
                op: OP,
                call: "cudnnBackendExecute",
                message: "the call was not planned first; please report this as a bug".into(),
            });
        };
        let mut bound: Vec<(i64, *mut c_void)> = match spec.pass {
            SdpaPass::Forward => {
                vec![
                    (uid::Q, ptr("q")?),
                    (uid::K, ptr("k")?),
                    (uid::V, ptr("v")?),
                    (uid::O, ptr("out")?),
                    (uid::STATS, ptr("lse")?),
                ]
            }
            SdpaPass::Backward => vec![
                (uid::Q, ptr("q")?),
                (uid::K, ptr("k")?),
                (uid::V, ptr("v")?),
                (uid::O, ptr("out")?),
                (uid::DO, ptr("dout")?),
                (uid::STATS, ptr("lse")?),
                (uid::DQ, ptr("dq")?),
                (uid::DK, ptr("dk")?),
                (uid::DV, ptr("dv")?),
                (uid::SOFTMAX_SUM, ptr("delta")?),
                (uid::ONE, (&one as *const f32).cast_mut().cast()),
            ],
        };
        bound.push((uid::SCALE, (&scale as *const f32).cast_mut().cast()));
        bound.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
        if plan.variant == Variant::BackwardAccumulated {
            bound.push((uid::DQ_ACCUMULATOR, ptr("dq_accumulator")?));
        }
        let mut pack = Descriptor::new(K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set_i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &bound.iter().map(|b| b.0).collect::<Vec<_>>())?;
        pack.set_pointers(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &bound.iter().map(|b| b.1).collect::<Vec<_>>())?;
        pack.set_pointers(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[ptr("workspace")?])?;
        pack.finalize()?;
        handle.bind(stream.raw.cu_stream() as sys::cudaStream_t)?;
        // SAFETY: the handle, plan and pack are live; the pack's device pointers address live,
        // range-checked allocations laid out as the plan's graph says (the public layer checked
        // the views against the spec), the workspace holds the plan's size, and the by-value
        // scalars live until this call returns (cuDNN copies them into the launch, and a capture
        // freezes them). Buffers outlive the work as for kernels.
        let status = unsafe { sys::cudnnBackendExecute(handle.0, plan.plan.raw(), pack.raw()) };
        check("cudnnBackendExecute", status)
    }
}

/// A call whose arguments are not `Sdpa::args`'s: a bug of graphed's.
fn malformed() -> Error {
    Error::Cudnn {
        op: OP,
        call: "cudnnBackendExecute",
        message: "the call's arguments are malformed; please report this as a bug".into(),
    }
}
