//! NVRTC compilation to CUBIN for the GPU's exact architecture, cached on disk once per machine.
//!
//! A CUBIN for `sm_XY` loads without a JIT step, so a process that finds its kernels in the cache
//! starts without compiling anything. The cache key is a hash of everything that determines the
//! CUBIN: NVRTC's version, the options (which name the architecture) and the source. The file
//! stores the full key too and a read checks it, so a hash collision is a cache miss, never a wrong
//! kernel. Files are written to a temporary name and renamed, so concurrent processes (parallel
//! test binaries) never read a partial file; any cache failure falls back to compiling.
//!
//! The cache directory is `$GRAPHED_KERNEL_CACHE` if set, else `$XDG_CACHE_HOME/graphed/kernels`,
//! else `$HOME/.cache/graphed/kernels`; with none of them set, nothing is cached.

use std::ffi::{CString, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::error as err;
use super::ffi::{self, Program};
use crate::{Error, Result};

/// Compiles kernel sources for one architecture.
pub(super) struct Compiler {
    arch: String,
    options: Vec<CString>,
    /// Everything in the cache key but the source.
    key_prefix: String,
    dir: Option<PathBuf>,
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
        Ok(Compiler { arch, options, key_prefix, dir: cache_dir(|var| std::env::var_os(var)) })
    }

    /// The target architecture (`sm_90`).
    pub(super) fn arch(&self) -> &str {
        &self.arch
    }

    /// The CUBIN of `source`, from the cache or compiled (and then cached). `module` names the
    /// source in errors and in NVRTC's log.
    pub(super) fn cubin(&self, module: &str, source: &str) -> Result<Vec<u8>> {
        let key = format!("{}{source}", self.key_prefix);
        let path = self.dir.as_ref().map(|d| d.join(format!("{:016x}.cubin", fnv1a64(key.as_bytes()))));
        if let Some(cubin) = path.as_deref().and_then(|p| read_cached(p, &key)) {
            return Ok(cubin);
        }
        let cubin = self.compile(module, source)?;
        if let Some(p) = &path {
            if let Err(e) = write_cached(p, &key, &cubin) {
                tracing::warn!("graphed: could not cache the kernel module {module} at {}: {e}", p.display());
            }
        }
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

/// The cache directory named by the environment, read through `var`.
fn cache_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("GRAPHED_KERNEL_CACHE")
        .or_else(|| set("XDG_CACHE_HOME").map(|d| d.join("graphed").join("kernels")))
        .or_else(|| set("HOME").map(|h| h.join(".cache").join("graphed").join("kernels")))
}

/// 64-bit FNV-1a: stable across Rust versions and platforms, unlike `std`'s hashers.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The first bytes of every cache file; bump the number when the format changes.
const MAGIC: &[u8; 16] = b"graphed-cubin-1\n";

/// A cache file: [`MAGIC`], the key's length (u64, little-endian), the key, the CUBIN.
fn encode(key: &str, cubin: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(MAGIC.len() + 8 + key.len() + cubin.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&(key.len() as u64).to_le_bytes());
    file.extend_from_slice(key.as_bytes());
    file.extend_from_slice(cubin);
    file
}

/// The CUBIN in a cache file, if the file is well-formed and was written for `key`.
fn decode<'f>(file: &'f [u8], key: &str) -> Option<&'f [u8]> {
    let rest = file.strip_prefix(MAGIC.as_slice())?;
    let (len, rest) = rest.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
    let (stored, cubin) = (rest.get(..len)?, rest.get(len..)?);
    (stored == key.as_bytes() && !cubin.is_empty()).then_some(cubin)
}

fn read_cached(path: &Path, key: &str) -> Option<Vec<u8>> {
    let file = std::fs::read(path).ok()?;
    decode(&file, key).map(<[u8]>::to_vec)
}

fn write_cached(path: &Path, key: &str, cubin: &[u8]) -> std::io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.{}.{}.tmp", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&tmp, encode(key, cubin))?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        // The rename's error is the one to report; a leftover temporary file is harmless.
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn a_cache_file_round_trips_only_for_its_key() {
        let file = encode("key one", b"\x7fELF cubin");
        assert_eq!(decode(&file, "key one"), Some(&b"\x7fELF cubin"[..]));
        assert_eq!(decode(&file, "key two"), None);
        assert_eq!(decode(&file[..file.len() - 10], "key one"), None, "truncated into the key");
        assert_eq!(decode(&encode("key one", b""), "key one"), None, "no CUBIN");
        assert_eq!(decode(b"not a cache file", "key one"), None);
    }

    #[test]
    fn cached_files_are_written_atomically_and_read_back() {
        let dir = std::env::temp_dir().join(format!("graphed-nvrtc-test-{}", std::process::id()));
        let path = dir.join("sub").join("0123.cubin");
        write_cached(&path, "k", b"cubin").expect("temporary directory is writable");
        assert_eq!(read_cached(&path, "k"), Some(b"cubin".to_vec()));
        assert_eq!(read_cached(&path, "other"), None);
        let leftovers = std::fs::read_dir(path.parent().expect("has a parent"))
            .expect("directory exists")
            .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp")))
            .count();
        assert_eq!(leftovers, 0);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn the_cache_directory_follows_the_environment() {
        fn env<'a>(pairs: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
            move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v))
        }
        let all = [("GRAPHED_KERNEL_CACHE", "/c"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(cache_dir(env(&all)), Some(PathBuf::from("/c")));
        assert_eq!(
            cache_dir(env(&[("GRAPHED_KERNEL_CACHE", ""), ("XDG_CACHE_HOME", "/x")])),
            Some(PathBuf::from("/x/graphed/kernels"))
        );
        assert_eq!(cache_dir(env(&[("HOME", "/h")])), Some(PathBuf::from("/h/.cache/graphed/kernels")));
        assert_eq!(cache_dir(env(&[])), None);
    }
}
