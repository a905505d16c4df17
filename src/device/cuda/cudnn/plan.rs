//! From an operation graph to an execution plan: cuDNN's heuristics (mode A, as cudnn-frontend
//! and TransformerEngine use) rank engine configurations; the first that cuDNN does not mark
//! nondeterministic and that finalizes is the plan (FE's `build_plans` with its heuristics
//! choice). Nondeterministic engines are skipped because graphed promises bitwise-equal results
//! run to run, and so graphed equals eager; a spec that opts out of determinism takes them too.

use std::fmt::Write as _;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as Ty, cudnnBackendDescriptorType_t as K,
};

use super::descriptor::Descriptor;
use super::graph::{self, OpGraph, Variant};
use crate::device::sdpa::SdpaSpec;
use crate::Result;

/// `CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC`.
const NONDETERMINISTIC: i32 = sys::cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as i32;

/// An execution plan and the graph it runs.
pub(super) struct Plan {
    pub(super) plan: Descriptor,
    _graph: OpGraph,
    pub(super) variant: Variant,
    pub(super) workspace: usize,
}

/// The plan for `spec`, or why there is none: every graph variant tried, with what each engine
/// configuration said.
pub(super) fn build(handle: sys::cudnnHandle_t, spec: &SdpaSpec) -> Result<std::result::Result<Plan, String>> {
    let mut log = String::new();
    for &variant in Variant::for_spec(spec) {
        match build_variant(handle, spec, variant, &mut log) {
            Ok(Some(plan)) => {
                tracing::info!("graphed: cuDNN attention plan for {spec:?}: {log}");
                return Ok(Ok(plan));
            }
            Ok(None) => {}
            Err(e) => {
                let _ = write!(log, "{variant:?}: {e}; ");
            }
        }
    }
    let kind = if spec.deterministic { "deterministic " } else { "" };
    Ok(Err(format!("no {kind}cuDNN engine runs this attention call ({log})")))
}

/// The first plan of `variant`'s graph that finalizes (and is deterministic, where `spec` asks
/// for that), noting in `log` what
/// each configuration was.
fn build_variant(
    handle: sys::cudnnHandle_t,
    spec: &SdpaSpec,
    variant: Variant,
    log: &mut String,
) -> Result<Option<Plan>> {
    let graph = graph::build(handle, spec, variant)?;
    let mut heur = Descriptor::new(K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descriptors(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph.graph])?;
    heur.set_heur_mode(A::CUDNN_ATTR_ENGINEHEUR_MODE, sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A)?;
    heur.finalize()?;
    let count = heur.count_descriptors(A::CUDNN_ATTR_ENGINEHEUR_RESULTS)?;
    let configs =
        heur.get_descriptors(A::CUDNN_ATTR_ENGINEHEUR_RESULTS, K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, count)?;
    let _ = write!(log, "{variant:?}: {} engine configs; ", configs.len());
    for config in configs {
        let engine = &config.get_descriptors(A::CUDNN_ATTR_ENGINECFG_ENGINE, K::CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1)?[0];
        let index = engine.get_i64(A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
        let numerical = engine.get_enums(A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, Ty::CUDNN_TYPE_NUMERICAL_NOTE)?;
        let behavior = engine.get_enums(A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, Ty::CUDNN_TYPE_BEHAVIOR_NOTE)?;
        let _ = write!(log, "engine {index} (numerical notes {numerical:?}, behaviour notes {behavior:?}) ");
        if spec.deterministic && numerical.contains(&NONDETERMINISTIC) {
            let _ = write!(log, "skipped: nondeterministic; ");
            continue;
        }
        match finalize(handle, &config) {
            Ok(plan) => {
                let workspace = plan.get_i64(A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
                let _ = write!(log, "chosen, workspace {workspace} bytes");
                return Ok(Some(Plan { plan, _graph: graph, variant, workspace }));
            }
            Err(e) => {
                let _ = write!(log, "does not finalize: {e}; ");
            }
        }
    }
    Ok(None)
}

/// The execution plan of `config`, finalized.
fn finalize(handle: sys::cudnnHandle_t, config: &Descriptor) -> Result<Descriptor> {
    let mut plan = Descriptor::new(K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set_handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
    plan.set_descriptors(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config])?;
    plan.finalize()?;
    Ok(plan)
}
