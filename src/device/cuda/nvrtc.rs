//! NVRTC compilation to CUBIN for the GPU's exact architecture, cached on disk once per machine
//! (`disk_cache.rs`).
//!
//! A CUBIN for `sm_XY` loads without a JIT step, so a process that finds its kernels in the cache
//! starts without compiling anything. The cache key is everything that determines the CUBIN:
//! NVRTC's version, the options (which name the architecture) and the source; a damaged entry is
//! recompiled and rewritten, never loaded.

use std::ffi::CString;

use super::disk_cache::DiskCache;
use super::error as err;
use super::ffi::{self, Program};
use crate::{Error, Result};

/// Compiles kernel sources for one architecture.
pub(super) struct Compiler {
    arch: String,
    options: Vec<CString>,
    /// Everything in the cache key but the source.
    key_prefix: String,
    cache: DiskCache,
}

impl Compiler {
    /// A compiler for compute capability `major.minor`. Loads NVRTC to learn its version.
    pub(super) fn new((major, minor): (i32, i32)) -> Result<Compiler> {
        let arch = format!("sm_{major}{minor}");
        let (nv_major, nv_minor) = ffi::nvrtc_version().map_err(|e| err::nvrtc("nvrtcVersion", e))?;
        let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-default-device".to_string()];
        let key_prefix = format!("graphed kernel cache 1\nnvrtc {nv_major}.{nv_minor}\n{}\n\n", options.join("\n"));
        let options = options
            .into_iter()
            .map(CString::new)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| Error::Cuda { op: "nvrtc", message: "a compile option contains a NUL byte".into() })?;
        Ok(Compiler { arch, options, key_prefix, cache: DiskCache::from_env() })
    }

    /// The target architecture (`sm_90`).
    pub(super) fn arch(&self) -> &str {
        &self.arch
    }

    /// The CUBIN of `source`, from the cache or compiled (and then cached). `module` names the
    /// source in errors and in NVRTC's log.
    pub(super) fn cubin(&self, module: &str, source: &str) -> Result<Vec<u8>> {
        let key = format!("{}{source}", self.key_prefix);
        let what = format!("kernel module {module}");
        if let Some(cubin) = self.cache.get("cubin", &key, &what) {
            return Ok(cubin);
        }
        let cubin = self.compile(module, source)?;
        self.cache.put("cubin", &key, &cubin, &what);
        Ok(cubin)
    }

    fn compile(&self, module: &str, source: &str) -> Result<Vec<u8>> {
        let failed = |log: String| Error::Compile { module: module.to_string(), arch: self.arch.clone(), log };
        let source = CString::new(source).map_err(|_| failed("the source contains a NUL byte".into()))?;
        let name =
            CString::new(format!("{module}.cu")).map_err(|_| failed("the kernel name contains a NUL byte".into()))?;
        let program = Program::new(source, name).map_err(|e| err::nvrtc("nvrtcCreateProgram", e))?;
        if let Err(e) = program.compile(&self.options) {
            let log = program.log().unwrap_or_default();
            return Err(failed(if log.trim().is_empty() {
                format!("NVRTC returned {:?} with an empty log", e.0)
            } else {
                log
            }));
        }
        let cubin = program.cubin().map_err(|e| err::nvrtc("nvrtcGetCUBIN", e))?;
        program.destroy().map_err(|e| err::nvrtc("nvrtcDestroyProgram", e))?;
        Ok(cubin)
    }
}
