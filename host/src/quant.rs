//! ggml tensor types: their ids, block layouts and sizes, and dequantization to f32 and f16.
//! Block layouts are exactly ggml's (`ggml-common.h`); all multi-byte fields little-endian.

/// A ggml tensor type this engine knows. The discriminants are ggml's type ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q5_0 = 6,
    Q8_0 = 8,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    BF16 = 30,
}

impl GgmlType {
    /// The type for a ggml type id, or `None` for ids this engine does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            6 => Q5_0,
            8 => Q8_0,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            30 => BF16,
            _ => return None,
        })
    }

    /// ggml's name for it (`q4_K`, `f16`, …).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q5_0 => "q5_0",
            Q8_0 => "q8_0",
            Q4K => "q4_K",
            Q5K => "q5_K",
            Q6K => "q6_K",
            BF16 => "bf16",
        }
    }

    /// Elements per block (1 for the plain float types).
    pub fn block_elems(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 => 1,
            Q4_0 | Q5_0 | Q8_0 => 32,
            Q4K | Q5K | Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            Q4_0 => 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q4K => 2 + 2 + 12 + 128,
            Q5K => 2 + 2 + 12 + 32 + 128,
            Q6K => 128 + 64 + 16 + 2,
        }
    }

    /// Bytes taken by one row of `n` elements, or `None` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_elems()).then(|| n / self.block_elems() * self.block_bytes())
    }
}
