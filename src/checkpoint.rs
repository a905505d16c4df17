//! Checkpoints in safetensors, the format PyTorch and Hugging Face users already load: named
//! tensors (their bytes exactly, any element type) and string metadata (one JSON object under the
//! header's `graphed` key, so that equal checkpoints are equal files), written to a temporary
//! file and renamed over the old checkpoint only once complete.
//!
//! # Checksums
//!
//! A saved file carries SHA-256 checksums, so that a damaged file (a flipped bit, bytes
//! overwritten, a header edited) is refused by [`Checkpoint::load`] before anything can be
//! restored from it, instead of resuming a run from wrong numbers. They sit in the `graphed`
//! object under the reserved key `graphed.sha256`, whose value is the JSON text
//! `{"meta":HEX,"tensors":{NAME:HEX,...}}`:
//!
//! - `meta` is the SHA-256 of the metadata's JSON as graphed writes it (the `graphed` object
//!   without `graphed.sha256`: keys sorted, no spaces);
//! - each tensor's is the SHA-256 of the JSON `[DTYPE,SHAPE]` as safetensors spells them (for
//!   example `["F32",[2,2]]`) followed by the tensor's bytes.
//!
//! Loading recomputes them all and compares; a file whose tensors are not exactly those the
//! checksums name is refused too. A file without checksums (from an older graphed, or another
//! tool) is refused as [`CheckpointErrorKind::Unverified`] unless the caller accepts it
//! explicitly with [`Checkpoint::load_unverified`]. Checksums find damage, not forgery: whoever
//! edits a file on purpose can recompute them.
//!
//! [`file_digest`] gives a data file's size and SHA-256 ([`FileDigest`]), for a caller to record
//! in the metadata and compare with the file a later run is given.
//!
//! ```
//! use graphed::checkpoint::{Checkpoint, CheckpointErrorKind};
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let w = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0], &[3])?;
//! let mut ckpt = Checkpoint::new();
//! ckpt.put("w", &w, &s)?;
//! ckpt.set_meta("step", "7");
//! let path = std::env::temp_dir().join(format!("graphed-doc-{}.safetensors", std::process::id()));
//! ckpt.save(&path)?;
//! let back = Checkpoint::load(&path)?;
//! let w2 = Tensor::zeros(&alloc, &s, &[3], DType::F32)?;
//! back.restore("w", &w2, &alloc, &s)?;
//! assert_eq!((w2.to_vec::<f32>(&s)?, back.meta("step")), (vec![1.0, 2.0, 3.0], Some("7")));
//!
//! // One flipped bit in w's bytes (the file's last) is found, and named, before any restore.
//! let mut bytes = std::fs::read(&path).unwrap();
//! *bytes.last_mut().unwrap() ^= 1;
//! std::fs::write(&path, bytes).unwrap();
//! match Checkpoint::load(&path) {
//!     Err(graphed::Error::Checkpoint { kind: CheckpointErrorKind::Corrupt { tensor }, .. }) => assert_eq!(tensor, "w"),
//!     other => panic!("{other:?}"),
//! }
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), graphed::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};

use crate::device::{with_dtype, DType, Stream};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What is wrong with a checkpoint file or its use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// The file could not be read or written.
    #[error("{0}")]
    Io(String),
    /// Not a safetensors file, or a damaged one (truncated, a header that does not parse).
    #[error("not a readable safetensors file ({0}); point at a checkpoint graphed wrote")]
    Format(String),
    /// A tensor the model needs is not in the file.
    #[error("tensor `{tensor}` is missing; the checkpoint is of another model")]
    Missing {
        /// Its name.
        tensor: String,
    },
    /// A tensor of another shape or element type than the model's.
    #[error("tensor `{tensor}` is {found} but the model's is {expected}; the checkpoint is of another model")]
    Mismatch {
        /// Its name.
        tensor: String,
        /// The model's shape and type.
        expected: String,
        /// The file's.
        found: String,
    },
    /// A metadata value that differs from the run's.
    #[error("`{key}` is {found} in the checkpoint but {expected} in this run; pass the same settings to resume")]
    Meta {
        /// The key.
        key: String,
        /// This run's value.
        expected: String,
        /// The checkpoint's.
        found: String,
    },
    /// A tensor's bytes, element type, shape or name no longer match the checksum saved with
    /// it (or the checksums name a tensor the file lacks): the file was damaged after it was
    /// written.
    #[error("tensor `{tensor}` differs from what was saved (it no longer matches its checksum): the file was damaged after it was written; use an intact copy or an earlier checkpoint")]
    Corrupt {
        /// Its name.
        tensor: String,
    },
    /// The metadata (the header's `graphed` object, checksums included) does not parse or no
    /// longer matches its checksum: the file was damaged after it was written.
    #[error("the metadata differs from what was saved (it does not parse or no longer matches its checksum): the file was damaged after it was written; use an intact copy or an earlier checkpoint")]
    CorruptMeta,
    /// A file without checksums (written by an older graphed or by another tool), so damage
    /// cannot be ruled out; [`Checkpoint::load`] refuses it.
    #[error("the file has no checksums (an older graphed or another tool wrote it), so damage cannot be ruled out; if you trust it, load it with Checkpoint::load_unverified (and save it again to add them)")]
    Unverified,
    /// Metadata under a key that graphed keeps for itself; [`Checkpoint::save`] refuses it.
    #[error("metadata key `{key}` is reserved for graphed's checksums; set the value under another key")]
    Reserved {
        /// The key.
        key: String,
    },
    /// A string that is not a [`FileDigest`]'s `Display` form.
    #[error("`{found}` is not a file digest (`<size> bytes sha256:<64 lowercase hex digits>`); record the one file_digest returns")]
    Digest {
        /// The string.
        found: String,
    },
    /// A tensor of an element type safetensors has no name for here.
    #[error("tensor `{tensor}` has element type {dtype}, which checkpoints do not store")]
    UnsupportedDType {
        /// Its name.
        tensor: String,
        /// Its element type.
        dtype: String,
    },
}

/// One stored tensor: its element type, shape and bytes.
#[derive(Clone, PartialEq)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Named tensors and metadata on the host, to save or just loaded.
#[derive(Default, Clone)]
pub struct Checkpoint {
    tensors: BTreeMap<String, Entry>,
    meta: BTreeMap<String, String>,
    /// Where it was loaded from, for errors.
    path: String,
}

/// The header metadata key holding the checkpoint's metadata as one JSON object.
const META_KEY: &str = "graphed";

/// The key, inside that object, of the checksums (see "Checksums" in the module doc). Inside,
/// not a second header key: safetensors writes its metadata map in hash order, so one key is
/// what keeps equal checkpoints equal files.
const SUMS_KEY: &str = "graphed.sha256";

/// The checksums a saved file carries, each a lowercase hex SHA-256 (see the module doc).
#[derive(serde::Serialize, serde::Deserialize)]
struct Sums {
    /// Of the metadata's JSON.
    meta: String,
    /// Of each tensor's type, shape and bytes, by name.
    tensors: BTreeMap<String, String>,
}

/// The lowercase hex of a finished SHA-256.
fn hex(hasher: Sha256) -> String {
    format!("{:x}", hasher.finalize())
}

/// The checksum of a tensor of `dtype` and `shape` holding `bytes`.
fn tensor_sum(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(serde_json::json!([dtype.to_string(), shape]).to_string());
    hasher.update(bytes);
    hex(hasher)
}

/// The checksum of the metadata, `meta_json` being its JSON as [`Checkpoint::save`] writes it.
fn meta_sum(meta_json: &str) -> String {
    hex(Sha256::new_with_prefix(meta_json))
}

/// Checks `meta` and the file's `tensors` against `sums`: the metadata first, then the tensors
/// by name, then that no tensor the checksums name is missing.
fn verify(
    sums: &Sums,
    meta: &BTreeMap<String, String>,
    tensors: &BTreeMap<String, TensorView>,
) -> Result<(), CheckpointErrorKind> {
    let meta_json = serde_json::to_string(meta).map_err(|_| CheckpointErrorKind::CorruptMeta)?;
    if meta_sum(&meta_json) != sums.meta {
        return Err(CheckpointErrorKind::CorruptMeta);
    }
    let corrupt = |tensor: &String| CheckpointErrorKind::Corrupt { tensor: tensor.clone() };
    for (name, view) in tensors {
        if sums.tensors.get(name) != Some(&tensor_sum(view.dtype(), view.shape(), view.data())) {
            return Err(corrupt(name));
        }
    }
    match sums.tensors.keys().find(|name| !tensors.contains_key(*name)) {
        Some(name) => Err(corrupt(name)),
        None => Ok(()),
    }
}

fn err(path: &str, kind: CheckpointErrorKind) -> Error {
    Error::Checkpoint { path: path.to_string(), kind }
}

fn to_safetensors(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::U32 => Dtype::U32,
        DType::I32 => Dtype::I32,
        DType::U64 => Dtype::U64,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        _ => return None,
    })
}

fn from_safetensors(dtype: Dtype) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16, DType::U32, DType::I32, DType::U64, DType::F8E4M3, DType::F8E5M2]
        .into_iter()
        .find(|d| to_safetensors(*d) == Some(dtype))
}

fn describe(dtype: DType, shape: &[usize]) -> String {
    format!("{dtype} {shape:?}")
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Checkpoint {
        Checkpoint::default()
    }

    /// Copies `t` to the host (after the work queued on `stream`) under `name`.
    ///
    /// # Errors
    /// [`CheckpointErrorKind::UnsupportedDType`]; device errors.
    pub fn put(&mut self, name: &str, t: &Tensor, stream: &Stream) -> Result<()> {
        if to_safetensors(t.dtype()).is_none() {
            let kind = CheckpointErrorKind::UnsupportedDType { tensor: name.into(), dtype: t.dtype().to_string() };
            return Err(err(&self.path, kind));
        }
        let bytes = with_dtype!(t.dtype(), T => bytemuck::cast_slice(&t.to_vec::<T>(stream)?).to_vec());
        self.tensors.insert(name.to_string(), Entry { dtype: t.dtype(), shape: t.shape().to_vec(), bytes });
        Ok(())
    }

    /// Sets metadata `key` to `value` (`graphed.sha256` is reserved: [`Checkpoint::save`]
    /// refuses it).
    pub fn set_meta(&mut self, key: &str, value: impl ToString) {
        self.meta.insert(key.to_string(), value.to_string());
    }

    /// Metadata `key`, if set.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.meta.get(key).map(String::as_str)
    }

    /// Fails unless metadata `key` is `expected` (a resumed run must use the same settings).
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Meta`].
    pub fn expect_meta(&self, key: &str, expected: impl ToString) -> Result<()> {
        let expected = expected.to_string();
        match self.meta(key) {
            Some(found) if found == expected => Ok(()),
            found => {
                let found = found.unwrap_or("missing").to_string();
                Err(err(&self.path, CheckpointErrorKind::Meta { key: key.into(), expected, found }))
            }
        }
    }

    /// The stored tensors' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Writes the checkpoint, with its checksums, to `path`: to `path` with `.tmp` appended
    /// first, renamed over `path` once complete, so that an interrupted save leaves the previous
    /// checkpoint whole.
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Reserved`] for metadata under `graphed.sha256`, before anything
    /// is written; [`CheckpointErrorKind::Io`].
    pub fn save(&self, path: &Path) -> Result<()> {
        let shown = path.display().to_string();
        if self.meta.contains_key(SUMS_KEY) {
            return Err(err(&shown, CheckpointErrorKind::Reserved { key: SUMS_KEY.into() }));
        }
        let io = |e: std::io::Error| err(&shown, CheckpointErrorKind::Io(e.to_string()));
        let format = |x: String| err(&shown, CheckpointErrorKind::Format(x));
        let mut sums = BTreeMap::new();
        let views = (self.tensors.iter())
            .map(|(name, e)| {
                let dtype = to_safetensors(e.dtype).expect("checked by put");
                let view = TensorView::new(dtype, e.shape.clone(), &e.bytes).map_err(|x| format(x.to_string()))?;
                sums.insert(name.clone(), tensor_sum(dtype, &e.shape, &e.bytes));
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta_json = serde_json::to_string(&self.meta).map_err(|x| format(x.to_string()))?;
        let sums = Sums { meta: meta_sum(&meta_json), tensors: sums };
        let mut stored = self.meta.clone();
        stored.insert(SUMS_KEY.into(), serde_json::to_string(&sums).map_err(|x| format(x.to_string()))?);
        let stored = serde_json::to_string(&stored).map_err(|x| format(x.to_string()))?;
        let meta: HashMap<String, String> = HashMap::from([(META_KEY.to_string(), stored)]);
        let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|x| format(x.to_string()))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the checkpoint at `path` and verifies its checksums, so that what it returns is
    /// what was saved.
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Io`]; [`CheckpointErrorKind::Format`] for a file that is not a
    /// whole safetensors file; [`CheckpointErrorKind::Unverified`] for one without checksums;
    /// [`CheckpointErrorKind::CorruptMeta`] and [`CheckpointErrorKind::Corrupt`] (naming the
    /// tensor) for one that no longer matches them; [`CheckpointErrorKind::UnsupportedDType`].
    pub fn load(path: &Path) -> Result<Checkpoint> {
        Checkpoint::read(path, false)
    }

    /// Like [`Checkpoint::load`], but also accepts a file without checksums (one an older
    /// graphed or another tool wrote), whose damage cannot be detected; a file with checksums is
    /// verified all the same. Saving the result adds checksums.
    ///
    /// # Errors
    /// Those of [`Checkpoint::load`] but [`CheckpointErrorKind::Unverified`].
    pub fn load_unverified(path: &Path) -> Result<Checkpoint> {
        Checkpoint::read(path, true)
    }

    /// Reads and verifies the file at `path`; one without checksums only if `allow_unverified`.
    fn read(path: &Path, allow_unverified: bool) -> Result<Checkpoint> {
        let shown = path.display().to_string();
        let fail = |kind| err(&shown, kind);
        let bytes = std::fs::read(path).map_err(|e| fail(CheckpointErrorKind::Io(e.to_string())))?;
        let format = |x: safetensors::SafeTensorError| fail(CheckpointErrorKind::Format(x.to_string()));
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format)?;
        let file = SafeTensors::deserialize(&bytes).map_err(format)?;
        let mut meta: BTreeMap<String, String> = match header.metadata().as_ref().and_then(|m| m.get(META_KEY)) {
            Some(json) => serde_json::from_str(json).map_err(|_| fail(CheckpointErrorKind::CorruptMeta))?,
            None => BTreeMap::new(),
        };
        let views: BTreeMap<String, TensorView> = file.tensors().into_iter().collect();
        match meta.remove(SUMS_KEY) {
            Some(json) => {
                let sums: Sums = serde_json::from_str(&json).map_err(|_| fail(CheckpointErrorKind::CorruptMeta))?;
                verify(&sums, &meta, &views).map_err(fail)?;
            }
            None if allow_unverified => {}
            None => return Err(fail(CheckpointErrorKind::Unverified)),
        }
        let mut tensors = BTreeMap::new();
        for (name, view) in views {
            let Some(dtype) = from_safetensors(view.dtype()) else {
                let kind = CheckpointErrorKind::UnsupportedDType { tensor: name, dtype: view.dtype().to_string() };
                return Err(fail(kind));
            };
            tensors.insert(name, Entry { dtype, shape: view.shape().to_vec(), bytes: view.data().to_vec() });
        }
        Ok(Checkpoint { tensors, meta, path: shown })
    }

    /// Fails unless tensor `name` is stored with `into`'s shape and element type (check every
    /// tensor before restoring any, so that a mismatch changes nothing).
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Missing`], [`CheckpointErrorKind::Mismatch`].
    pub fn check(&self, name: &str, into: &Tensor) -> Result<()> {
        self.entry(name, into).map(|_| ())
    }

    /// Copies tensor `name` into `into` (on `stream`, through a staging buffer from `alloc`).
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Missing`]; [`CheckpointErrorKind::Mismatch`] for another shape
    /// or element type; both before anything is enqueued.
    pub fn restore(&self, name: &str, into: &Tensor, alloc: &CachingAllocator, stream: &Stream) -> Result<()> {
        let e = self.entry(name, into)?;
        with_dtype!(e.dtype, T => {
            let mut values = vec![<T as bytemuck::Zeroable>::zeroed(); e.bytes.len() / e.dtype.size()];
            bytemuck::cast_slice_mut(&mut values).copy_from_slice(&e.bytes);
            into.copy_from(&Tensor::from_host(alloc, stream, &values, &e.shape)?, stream)
        })
    }

    /// The entry `name`, checked against `into`.
    fn entry(&self, name: &str, into: &Tensor) -> Result<&Entry> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| err(&self.path, CheckpointErrorKind::Missing { tensor: name.into() }))?;
        if e.dtype != into.dtype() || e.shape != into.shape() {
            let (expected, found) = (describe(into.dtype(), into.shape()), describe(e.dtype, &e.shape));
            return Err(err(&self.path, CheckpointErrorKind::Mismatch { tensor: name.into(), expected, found }));
        }
        Ok(e)
    }
}

/// Equal tensors (bytes, shapes, types) and metadata, wherever they were read from.
impl PartialEq for Checkpoint {
    fn eq(&self, other: &Checkpoint) -> bool {
        self.tensors == other.tensors && self.meta == other.meta
    }
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoint({} tensors, {:?})", self.tensors.len(), self.meta)
    }
}

/// A file's identity, its size and SHA-256, from [`file_digest`]. Its `Display` form,
/// `<size> bytes sha256:<64 lowercase hex digits>`, is what to record in a checkpoint's
/// metadata; `str::parse` reads it back.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FileDigest {
    /// The file's length in bytes.
    size: u64,
    /// Its SHA-256 in lowercase hex.
    sha256: String,
}

/// The size and SHA-256 of the file at `path`, read a piece at a time (a file of any size takes
/// a megabyte of memory).
///
/// # Errors
/// [`CheckpointErrorKind::Io`], naming `path`, if it cannot be read.
pub fn file_digest(path: &Path) -> Result<FileDigest> {
    let io = |e: std::io::Error| {
        err(&path.display().to_string(), CheckpointErrorKind::Io(format!("cannot read it to take its digest: {e}")))
    };
    let mut reader = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io)?);
    let mut hasher = Sha256::new();
    let size = std::io::copy(&mut reader, &mut hasher).map_err(io)?;
    Ok(FileDigest { size, sha256: hex(hasher) })
}

impl fmt::Display for FileDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes sha256:{}", self.size, self.sha256)
    }
}

/// Reads the `Display` form back, and only that form (no sign or leading zeros in the size, no
/// capitals in the hex), so that equal digests are equal strings.
impl FromStr for FileDigest {
    type Err = CheckpointErrorKind;

    fn from_str(s: &str) -> Result<FileDigest, CheckpointErrorKind> {
        let bad = || CheckpointErrorKind::Digest { found: s.to_string() };
        let (size, sha256) = s.split_once(" bytes sha256:").ok_or_else(bad)?;
        let is_hex = sha256.len() == 64 && sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let digest = FileDigest { size: size.parse().map_err(|_| bad())?, sha256: sha256.to_string() };
        if is_hex && digest.to_string() == s {
            Ok(digest)
        } else {
            Err(bad())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(r: Result<impl fmt::Debug>) -> CheckpointErrorKind {
        match r {
            Err(Error::Checkpoint { kind, .. }) => kind,
            other => panic!("expected a checkpoint error, got {other:?}"),
        }
    }

    #[test]
    fn file_digest_is_the_size_and_sha256_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.txt");
        std::fs::write(&path, "abc").unwrap();
        let abc = file_digest(&path).unwrap();
        // The SHA-256 of "abc" is FIPS 180-2's first example.
        let shown = "3 bytes sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(abc.to_string(), shown);
        assert_eq!(shown.parse::<FileDigest>(), Ok(abc.clone()));
        // Several read buffers long: read a piece at a time, it is the digest of the whole.
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &big).unwrap();
        let whole = file_digest(&path).unwrap();
        assert_eq!(whole.to_string(), format!("3000000 bytes sha256:{:x}", Sha256::digest(&big)));
        // One byte changed, or one more byte: another digest.
        let mut changed = big.clone();
        changed[2_500_000] ^= 1;
        std::fs::write(&path, &changed).unwrap();
        assert_ne!(file_digest(&path).unwrap(), whole);
        changed[2_500_000] ^= 1;
        changed.push(0);
        std::fs::write(&path, &changed).unwrap();
        assert_ne!(file_digest(&path).unwrap(), whole);
        let absent = dir.path().join("absent");
        assert!(matches!(kind(file_digest(&absent)), CheckpointErrorKind::Io(why) if why.contains("digest")));
    }

    #[test]
    fn file_digest_parses_only_its_display_form() {
        let hex = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let upper = hex.to_uppercase();
        let bad = [
            String::new(),
            "3 bytes".into(),
            format!("+3 bytes sha256:{hex}"),
            format!("03 bytes sha256:{hex}"),
            format!("-3 bytes sha256:{hex}"),
            format!("3 bytes sha256:{upper}"),
            format!("3 bytes sha256:{}", &hex[1..]),
            format!("3 bytes sha256:{hex}0"),
            format!("3 bytes sha256:{hex} "),
            format!("3 bytes sha256:{}g", &hex[1..]),
            format!("3 bytes md5:{hex}"),
        ];
        for s in bad {
            assert_eq!(s.parse::<FileDigest>(), Err(CheckpointErrorKind::Digest { found: s.clone() }), "{s:?}");
        }
        let d: FileDigest = format!("0 bytes sha256:{hex}").parse().unwrap();
        assert_eq!(d.to_string(), format!("0 bytes sha256:{hex}"));
    }

    #[test]
    fn the_checksums_key_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let mut ckpt = Checkpoint::new();
        ckpt.set_meta(SUMS_KEY, "{}");
        assert_eq!(kind(ckpt.save(&path)), CheckpointErrorKind::Reserved { key: SUMS_KEY.into() });
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
    }
}
