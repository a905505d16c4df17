//! Checkpoints in safetensors, the format PyTorch and Hugging Face users already load: named
//! tensors (their bytes exactly, any element type) and string metadata (one JSON object under the
//! header's `graphed` key, so that equal checkpoints are equal files), written to a temporary
//! file and renamed over the old checkpoint only once complete.
//!
//! ```
//! use graphed::checkpoint::Checkpoint;
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
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), graphed::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

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
        _ => return None,
    })
}

fn from_safetensors(dtype: Dtype) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16, DType::U32, DType::I32, DType::U64]
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

    /// Sets metadata `key` to `value`.
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

    /// Writes the checkpoint to `path`: to `path` with `.tmp` appended first, renamed over `path`
    /// once complete, so that an interrupted save leaves the previous checkpoint whole.
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Io`].
    pub fn save(&self, path: &Path) -> Result<()> {
        let shown = path.display().to_string();
        let io = |e: std::io::Error| err(&shown, CheckpointErrorKind::Io(e.to_string()));
        let views = (self.tensors.iter())
            .map(|(name, e)| {
                let dtype = to_safetensors(e.dtype).expect("checked by put");
                let view = TensorView::new(dtype, e.shape.clone(), &e.bytes)
                    .map_err(|x| err(&shown, CheckpointErrorKind::Format(x.to_string())))?;
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let json =
            serde_json::to_string(&self.meta).map_err(|x| err(&shown, CheckpointErrorKind::Format(x.to_string())))?;
        let meta: HashMap<String, String> = HashMap::from([(META_KEY.to_string(), json)]);
        let bytes = safetensors::tensor::serialize(views, Some(meta))
            .map_err(|x| err(&shown, CheckpointErrorKind::Format(x.to_string())))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the checkpoint at `path`.
    ///
    /// # Errors
    /// [`CheckpointErrorKind::Io`]; [`CheckpointErrorKind::Format`] for a file that is not a
    /// whole safetensors file; [`CheckpointErrorKind::UnsupportedDType`].
    pub fn load(path: &Path) -> Result<Checkpoint> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| err(&shown, CheckpointErrorKind::Io(e.to_string())))?;
        let format = |x: safetensors::SafeTensorError| err(&shown, CheckpointErrorKind::Format(x.to_string()));
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format)?;
        let file = SafeTensors::deserialize(&bytes).map_err(format)?;
        let header_meta = header.metadata().clone().unwrap_or_default();
        let meta = match header_meta.get(META_KEY) {
            Some(json) => {
                serde_json::from_str(json).map_err(|x| err(&shown, CheckpointErrorKind::Format(x.to_string())))?
            }
            None => BTreeMap::new(),
        };
        let mut tensors = BTreeMap::new();
        for (name, view) in file.tensors() {
            let Some(dtype) = from_safetensors(view.dtype()) else {
                let kind = CheckpointErrorKind::UnsupportedDType { tensor: name, dtype: format!("{:?}", view.dtype()) };
                return Err(err(&shown, kind));
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
