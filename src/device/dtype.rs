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
