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
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U64 => 8,
            DType::U8 => 1,
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
        }
    };
}
pub(crate) use with_dtype;
