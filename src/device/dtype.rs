//! Element types a buffer can hold.

use std::fmt;

/// The element type of a buffer or kernel argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// IEEE half ([`half::f16`]).
    F16,
    /// 32-bit unsigned integer.
    U32,
    /// 32-bit signed integer.
    I32,
    /// 64-bit unsigned integer.
    U64,
    /// Byte.
    U8,
    /// FP8 with 4 exponent and 3 mantissa bits ([`float8::F8E4M3`], NVIDIA's E4M3: no
    /// infinities, ±448 at most): FP8 training's forward tensors.
    F8E4M3,
    /// FP8 with 5 exponent and 2 mantissa bits ([`float8::F8E5M2`], IEEE-like, ±57344 at most):
    /// FP8 training's gradients.
    F8E5M2,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U64 => 8,
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        };
        f.write_str(s)
    }
}

/// A plain element type that can live in device memory.
pub trait Elem: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// Its [`DType`].
    const DTYPE: DType;
}

macro_rules! elem {
    ($($t:ty => $d:ident),*) => { $(impl Elem for $t { const DTYPE: DType = DType::$d; })* };
}
elem!(f32 => F32, half::bf16 => BF16, half::f16 => F16, u32 => U32, i32 => I32, u64 => U64, u8 => U8);
elem!(float8::F8E4M3 => F8E4M3, float8::F8E5M2 => F8E5M2);

/// Floating-point element types: stored narrow, computed in f32 (bf16 and f16 round to nearest,
/// ties to even, exactly as the GPU's conversions do).
pub trait Float: Elem + Copy {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// `v` rounded to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Float for half::bf16 {
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl Float for half::f16 {
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// FP8 element types: storage for scaled tensors (`ops::cast::quantize`), never computed in.
/// Conversions are CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, …)` and its inverse, bit
/// for bit (Note [FP8 conversions]).
pub trait Float8: Elem + Copy {
    /// The value as f32 (exact; NaN as the canonical f32 NaN, `0x7fffffff`).
    fn to_f32(self) -> f32;
    /// `v` rounded to nearest, ties to even; beyond the largest finite value (±inf included)
    /// saturates to it; any NaN becomes `0x7f`.
    fn from_f32(v: f32) -> Self;
}

// Note [FP8 conversions]
// The `float8` crate ports cuda_fp8.hpp's `__nv_cvt_double_to_fp8` (rounding, saturation,
// subnormals, ±0 match it) and its fp8 → f16 widening, but not `__nv_cvt_float_to_fp8`'s first
// step, which makes every NaN the positive, all-ones f32 NaN (so the result is `0x7f` in both
// formats; the crate keeps the sign, and E5M2 takes the payload's top bits: `f32::NAN` gives
// `0x7e`, `-f32::NAN` `0xfe`). NaNs are canonicalized here before the crate sees them, and NaNs
// widened to f32 are canonical too, as the GPU's f32 arithmetic returns them. `ops/fp8.cu` does the
// same conversions by integer operations, and tests/ops_fp8.rs checks both devices against the
// formats' definitions and against the GPU's own `cvt.rn.satfinite` instruction.
macro_rules! float8 {
    ($($t:ty),*) => {$(
        impl Float8 for $t {
            fn to_f32(self) -> f32 {
                let v = <$t>::to_f32(&self);
                if v.is_nan() { f32::from_bits(0x7fff_ffff) } else { v }
            }
            fn from_f32(v: f32) -> Self {
                if v.is_nan() { <$t>::from_bits(0x7f) } else { <$t>::from_f32(v) }
            }
        }
    )*};
}
float8!(float8::F8E4M3, float8::F8E5M2);

/// Runs `$body` with `$t` bound to the Rust type of the [`DType`] `$dtype`: how a run-time
/// element type becomes a compile-time one for code that takes every type (copies, zeroing);
/// `ops::with_float!` is its counterpart for the f32 and bf16 kernels.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::device::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::device::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::device::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::device::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::device::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::device::DType::U64 => {
                type $t = u64;
                $body
            }
            $crate::device::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::device::DType::F8E4M3 => {
                type $t = float8::F8E4M3;
                $body
            }
            $crate::device::DType::F8E5M2 => {
                type $t = float8::F8E5M2;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

#[cfg(test)]
mod tests {
    use super::*;
    use float8::{F8E4M3, F8E5M2};

    #[test]
    fn fp8_types_are_one_byte_and_named_as_in_the_cli() {
        assert_eq!([DType::F8E4M3.size(), DType::F8E5M2.size()], [1, 1]);
        assert_eq!([DType::F8E4M3.to_string(), DType::F8E5M2.to_string()], ["f8e4m3", "f8e5m2"]);
        assert_eq!([F8E4M3::DTYPE, F8E5M2::DTYPE], [DType::F8E4M3, DType::F8E5M2]);
    }

    /// Note [FP8 conversions]: where the crate alone would differ from CUDA, and that `Float8`
    /// does not.
    #[test]
    fn nans_are_cudas_not_the_crates() {
        let nans = [f32::NAN, -f32::NAN];
        assert_eq!(nans.map(|v| F8E4M3::from_f32(v).to_bits()), [0x7f, 0xff], "the crate keeps the sign");
        assert_eq!(nans.map(|v| F8E5M2::from_f32(v).to_bits()), [0x7e, 0xfe], "and E5M2 the payload's top bits");
        assert_eq!(nans.map(|v| <F8E4M3 as Float8>::from_f32(v).to_bits()), [0x7f; 2]);
        assert_eq!(nans.map(|v| <F8E5M2 as Float8>::from_f32(v).to_bits()), [0x7f; 2]);
        for b in [0x7f, 0xff] {
            assert_eq!(Float8::to_f32(F8E4M3::from_bits(b)).to_bits(), 0x7fff_ffff);
        }
        for b in [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff] {
            assert_eq!(Float8::to_f32(F8E5M2::from_bits(b)).to_bits(), 0x7fff_ffff);
        }
    }
}
