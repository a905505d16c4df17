//! graphed's on-disk cache, once per machine (compiled kernels, `nvrtc.rs`): each entry a file
//! named by a hash of its key.
//!
//! The file stores the full key too and a read checks it, so a hash collision is a miss, never a
//! wrong entry. It also stores the payload's length and a checksum of key and payload, verified
//! before anything is used: a truncated or overwritten entry is reported once, as a warning, and
//! recomputed, never used. Files are written to a temporary name and renamed, so concurrent
//! processes (parallel test binaries, ranks) never read a partial file; any cache failure falls
//! back to recomputing.
//!
//! The directory is `$GRAPHED_KERNEL_CACHE` if set, else `$XDG_CACHE_HOME/graphed/kernels`, else
//! `$HOME/.cache/graphed/kernels`; with none of them set, nothing is cached.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The cache directory of this process's environment, if any.
#[derive(Clone, Debug)]
pub(super) struct DiskCache {
    dir: Option<PathBuf>,
}

impl DiskCache {
    /// The cache the environment names.
    pub(super) fn from_env() -> DiskCache {
        DiskCache { dir: cache_dir(|var| std::env::var_os(var)) }
    }

    /// The payload stored for `key` in files ending `.{ext}`, if a sound one is; `what` names the
    /// entry in the warning about a damaged file.
    pub(super) fn get(&self, ext: &str, key: &str, what: &str) -> Option<Vec<u8>> {
        let path = self.path(ext, key)?;
        match read_cached(&path, key) {
            Cached::Hit(payload) => Some(payload),
            Cached::Miss => None,
            Cached::Damaged(why) => {
                tracing::warn!("graphed: the cached {what} at {} is damaged ({why}); recomputing it", path.display());
                None
            }
        }
    }

    /// Stores `payload` (not empty) for `key`; a failure is a warning, since the cache only saves
    /// time.
    pub(super) fn put(&self, ext: &str, key: &str, payload: &[u8], what: &str) {
        let Some(path) = self.path(ext, key) else { return };
        if let Err(e) = write_cached(&path, key, payload) {
            tracing::warn!("graphed: could not cache the {what} at {}: {e}", path.display());
        }
    }

    fn path(&self, ext: &str, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{:016x}.{ext}", fnv1a64(key.as_bytes()))))
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
const MAGIC: &[u8; 16] = b"graphed-cubin-2\n";

/// The bytes before the key: [`MAGIC`], then the key's and the payload's lengths and the checksum
/// of key and payload (u64 each, little-endian).
const HEADER: usize = MAGIC.len() + 3 * 8;

/// A cache file: the header, the key, the payload.
fn encode(key: &str, cubin: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(HEADER + key.len() + cubin.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&(key.len() as u64).to_le_bytes());
    file.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    file.extend_from_slice(&checksum(key.as_bytes(), cubin).to_le_bytes());
    file.extend_from_slice(key.as_bytes());
    file.extend_from_slice(cubin);
    file
}

/// FNV-1a over the key, then the payload.
fn checksum(key: &[u8], cubin: &[u8]) -> u64 {
    cubin.iter().fold(fnv1a64(key), |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// What a cache file holds for a key.
#[derive(Debug, PartialEq, Eq)]
enum Cached {
    /// A verified payload for the key.
    Hit(Vec<u8>),
    /// No file, or a sound file written for another key (a hash collision).
    Miss,
    /// A file whose length or content does not match what it says it holds.
    Damaged(&'static str),
}

/// The payload in a cache file, verified: the file is exactly as long as its header says and its
/// content matches the checksum, so a truncated or overwritten file is never used.
fn decode(file: &[u8], key: &str) -> Cached {
    let Some(rest) = file.strip_prefix(MAGIC.as_slice()) else {
        return Cached::Damaged("not a cache file of this version");
    };
    let field = |i: usize| rest.get(8 * i..8 * i + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    let (Some(key_len), Some(cubin_len), Some(sum)) = (field(0), field(1), field(2)) else {
        return Cached::Damaged("truncated header");
    };
    let body = &file[HEADER.min(file.len())..];
    let lengths = usize::try_from(key_len).ok().zip(usize::try_from(cubin_len).ok());
    let Some((key_len, cubin_len)) = lengths.filter(|(k, c)| k.checked_add(*c) == Some(body.len())) else {
        return Cached::Damaged("its length does not match its header");
    };
    let (stored, cubin) = body.split_at(key_len);
    if checksum(stored, cubin) != sum {
        return Cached::Damaged("its content does not match its checksum");
    }
    match stored == key.as_bytes() && cubin_len > 0 {
        true => Cached::Hit(cubin.to_vec()),
        false => Cached::Miss,
    }
}

fn read_cached(path: &Path, key: &str) -> Cached {
    match std::fs::read(path) {
        Ok(file) => decode(&file, key),
        Err(_) => Cached::Miss,
    }
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
        assert_eq!(decode(&file, "key one"), Cached::Hit(b"\x7fELF cubin".to_vec()));
        assert_eq!(decode(&file, "key two"), Cached::Miss);
        assert_eq!(decode(&encode("key one", b""), "key one"), Cached::Miss, "no CUBIN");
        assert!(matches!(decode(b"not a cache file", "key one"), Cached::Damaged(_)));
    }

    #[test]
    fn a_damaged_cache_file_is_never_a_hit() {
        let cubin: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let file = encode("the key", &cubin);
        for cut in [0, 5, HEADER - 1, HEADER + 3, file.len() / 2, file.len() - 1] {
            assert!(matches!(decode(&file[..cut], "the key"), Cached::Damaged(_)), "truncated to {cut} bytes");
        }
        let mut longer = file.clone();
        longer.push(0);
        assert!(matches!(decode(&longer, "the key"), Cached::Damaged(_)), "a byte appended");
        for at in [HEADER + 2, file.len() / 2, file.len() - 64] {
            let mut overwritten = file.clone();
            overwritten[at..at + 64].iter_mut().for_each(|b| *b = !*b);
            assert!(matches!(decode(&overwritten, "the key"), Cached::Damaged(_)), "64 bytes overwritten at {at}");
        }
    }

    #[test]
    fn cached_files_are_written_atomically_and_read_back() {
        let dir = std::env::temp_dir().join(format!("graphed-disk-cache-test-{}", std::process::id()));
        let path = dir.join("sub").join("0123.cubin");
        write_cached(&path, "k", b"cubin").expect("temporary directory is writable");
        assert_eq!(read_cached(&path, "k"), Cached::Hit(b"cubin".to_vec()));
        assert_eq!(read_cached(&path, "other"), Cached::Miss);
        assert_eq!(read_cached(&dir.join("absent.cubin"), "k"), Cached::Miss);
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
