//! FP8 scaling on the device (issue 34, item 3): the amax of a tensor ([`amax()`]), the fused cast
//! that writes a matrix and its transpose in FP8 with its amax ([`cast_transpose()`]), the same
//! cast of GELU's backward with its column sums ([`dgelu_cast_transpose()`]), and the
//! recipes that turn amaxes into scales ([`DelayedScaling`], [`CurrentScaling`]). The conversions
//! themselves are [`cast::quantize`](super::cast::quantize)'s.
//!
//! Amaxes, histories and scales are f32 tensors on the device, read and written only by kernels:
//! the host reads nothing per step, nothing is allocated after a state is made, and every op
//! declares what it reads and writes, so a training step with its casts and scale updates can be
//! captured into a graph whose replays use the scales in memory at each replay. Every kernel has
//! a CPU path with the same arithmetic, bit for bit.
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::fp8::{cast_transpose, DelayedScaling, DelayedScalingConfig};
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let recipe = DelayedScaling::new(&alloc, &s, DelayedScalingConfig::default(), 1)?;
//! let x = Tensor::from_host(&alloc, &s, &[1.0f32, -2.0, 3.0, 0.5, 8.0, -4.0], &[2, 3])?;
//! let x_t = Tensor::zeros(&alloc, &s, &[3, 2], DType::F8E4M3)?;
//! // A step: the cast uses the current scale (1) and records the amax; the update sets the next
//! // step's scale from the history (448 / 8).
//! cast_transpose(None, Some(&x_t), &recipe.amax(0)?, &x, &recipe.scale(0)?, &s)?;
//! recipe.update(&s)?;
//! assert_eq!(x_t.to_f32_vec(&s)?, vec![1.0, 0.5, -2.0, 8.0, 3.0, -4.0]);
//! assert_eq!(recipe.scale(0)?.to_vec::<f32>(&s)?, vec![56.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

mod amax;
mod cast_transpose;
mod dgelu_cast;
mod scaling;

pub use amax::{amax, Amax, AMAX, AMAX_BF16};
pub use cast_transpose::{cast_transpose, CAST_TRANSPOSE};
pub use dgelu_cast::{dgelu_cast_transpose, sum_tiles, tile_rows, DGELU_CAST_TRANSPOSE, SUM_TILES};
pub use scaling::{
    AmaxAlgo, CurrentScaling, DelayedScaling, DelayedScalingConfig, ScalingConfigError, AMAX_SCALE, AMAX_SCALE_BF16,
    CURRENT_SCALING_UPDATE, DELAYED_SCALING_UPDATE, SCALE_INV_STRIDE,
};

use crate::device::DType;

/// The CUDA source of every kernel here: float.cu's and fp8.cu's types and conversions, GELU's
/// derivative, then the amax reduction, which the fused casts use too.
const SOURCE: &str = concat!(
    include_str!("../float.cu"),
    include_str!("../fp8.cu"),
    include_str!("../gelu_math.cu"),
    include_str!("amax.cu"),
    include_str!("cast_transpose.cu"),
    include_str!("scaling.cu")
);

/// An FP8 format, for the recipes: its element type and largest finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// [`DType::F8E4M3`], ±448: forward tensors (activations, weights).
    E4M3,
    /// [`DType::F8E5M2`], ±57344: gradients (TransformerEngine's `HYBRID` format; E4M3 is the
    /// other choice for them).
    E5M2,
}

impl Fp8Format {
    /// The largest finite value, which a scaled amax is mapped to.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// `e4m3` or `e5m2`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// The element type of tensors cast to this format.
    pub fn dtype(self) -> DType {
        match self {
            Fp8Format::E4M3 => DType::F8E4M3,
            Fp8Format::E5M2 => DType::F8E5M2,
        }
    }
}
