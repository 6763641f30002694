//! Dequantization of ggml blocks on the GPU, and the token-embedding row gather.
//! CPU twin: `orcd::quant::dequantize` (the layouts are the table at the top of host/src/quant.rs).
//!
//! Each quantized format is a [`Block`] whose `group` returns elements `8g..8g + 8` of a block:
//! in every format those eight share one scale and come from consecutive quant bytes, so a
//! GEMV lane can take eight weights at a time. The arithmetic is the CPU's, operation by
//! operation and in the same order (rustc sets no fast-math flags, so LLVM contracts no
//! `a * b - c` into an FMA), so the results are bit-identical; the quants are unpacked four
//! to a word and become floats by the exact `MAGIC` subtraction. Fields are read by halfwords:
//! blocks of 18, 22, 34 or 210 bytes are only 2-byte aligned; q4_K and q5_K blocks (144 and 176
//! bytes) by words, as they are 16-byte aligned when the tensor is (the host checks that it is).
use crate::util::{block, block_dim, f16_to_f32, thread};

/// ggml type ids: the discriminants of `orcd::quant::GgmlType`.
pub const F32: u32 = 0;
pub const F16: u32 = 1;
pub const Q4_0: u32 = 2;
pub const Q5_0: u32 = 6;
pub const Q8_0: u32 = 8;
pub const Q4_K: u32 = 12;
pub const Q5_K: u32 = 13;
pub const Q6_K: u32 = 14;
pub const BF16: u32 = 30;

/// (elements, bytes) of one block of type `ty`; (1, 1) for an unknown type.
#[inline(always)]
pub fn block_shape(ty: u32) -> (u32, u32) {
    match ty {
        F32 => (1, 4),
        F16 | BF16 => (1, 2),
        Q4_0 => (BlockQ4_0::ELEMS, BlockQ4_0::BYTES),
        Q5_0 => (BlockQ5_0::ELEMS, BlockQ5_0::BYTES),
        Q8_0 => (BlockQ8_0::ELEMS, BlockQ8_0::BYTES),
        Q4_K => (BlockQ4K::ELEMS, BlockQ4K::BYTES),
        Q5_K => (BlockQ5K::ELEMS, BlockQ5K::BYTES),
        Q6_K => (BlockQ6K::ELEMS, BlockQ6K::BYTES),
        _ => (1, 1),
    }
}

#[inline(always)]
fn byte(b: *const u8, at: u32) -> u8 {
    unsafe { *b.add(at as usize) }
}

/// The u16 at `b + at`, which must be 2-byte aligned.
#[inline(always)]
fn u16_at(b: *const u8, at: u32) -> u16 {
    unsafe { *(b.add(at as usize) as *const u16) }
}

/// The u32 at `b + at`, which must be 4-byte aligned.
#[inline(always)]
fn u32_at(b: *const u8, at: u32) -> u32 {
    unsafe { *(b.add(at as usize) as *const u32) }
}

/// Bytes `at..at + 8` of `b` as two little-endian words, `b + at` 2-byte aligned: four
/// halfword loads.
#[inline(always)]
fn words_a2(b: *const u8, at: u32) -> [u32; 2] {
    [at, at + 4].map(|at| u16_at(b, at) as u32 | (u16_at(b, at + 2) as u32) << 16)
}

/// Bytes `at..at + 8` of `b` as two little-endian words, `b + at` 8-byte aligned: one load.
#[inline(always)]
fn words_a8(b: *const u8, at: u32) -> [u32; 2] {
    let v = unsafe { *(b.add(at as usize) as *const u64) };
    [v as u32, (v >> 32) as u32]
}

/// 2^23: `f32::from_bits(MAGIC_BITS | n)` is `MAGIC + n` for `n < 2^23`, so subtracting
/// `MAGIC + c` gives `n - c` exactly (and so bit for bit the CPU's `(n - c) as f32`), by an
/// OR and a subtraction instead of an integer-to-float `cvt`, which runs at a quarter of
/// the rate.
const MAGIC: f32 = 8_388_608.0;
const MAGIC_BITS: u32 = 0x4b00_0000;

/// `MAGIC + ` byte `k` (0..8) of the little-endian words `w`.
#[inline(always)]
fn magic_byte(w: [u32; 2], k: usize) -> f32 {
    f32::from_bits(MAGIC_BITS | (w[k / 4] >> (8 * (k % 4))) & 255)
}

/// Bits 0..4 of `x` moved to bit 0 of bytes 0..4 (the four shifted copies do not overlap).
#[inline(always)]
fn spread4(x: u32) -> u32 {
    (x & 15).wrapping_mul(0x0020_4081) & 0x0101_0101
}

#[inline(always)]
fn f16_at(b: *const u8, at: u32) -> f32 {
    f16_to_f32(u16_at(b, at))
}

/// Element `i` of a row of plain floats (f32, f16 or bf16); NaN for any other type.
#[inline(always)]
pub unsafe fn float_at(ty: u32, row: *const u8, i: u32) -> f32 {
    match ty {
        F32 => f32::from_le_bytes(core::array::from_fn(|k| byte(row, 4 * i + k as u32))),
        F16 => f16_to_f32(u16::from_le_bytes([byte(row, 2 * i), byte(row, 2 * i + 1)])),
        // bf16 is the top half of an f32.
        BF16 => f32::from_bits(
            (u16::from_le_bytes([byte(row, 2 * i), byte(row, 2 * i + 1)]) as u32) << 16,
        ),
        _ => f32::NAN,
    }
}

/// A quantized block format of ggml: `ELEMS` weights in `BYTES` bytes.
pub trait Block {
    const ELEMS: u32;
    const BYTES: u32;
    /// Elements `8g..8g + 8` of the block at `b`. Blocks of 144 or 176 bytes (q4_K, q5_K)
    /// must start 16-byte aligned (they are read by words), the others 2-byte aligned.
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8];
}

/// ggml's `block_q4_0`: `d` f16 at 0, `qs` at 2; `x[j] = (lo(qs[j]) - 8)·d`,
/// `x[j + 16] = (hi(qs[j]) - 8)·d`.
pub enum BlockQ4_0 {}

impl Block for BlockQ4_0 {
    const ELEMS: u32 = 32;
    const BYTES: u32 = 18;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        let d = f16_at(b, 0);
        let (qs, shift) = (words_a2(b, 2 + 8 * (g % 2)), 4 * (g / 2));
        let q = qs.map(|w| w >> shift & 0x0f0f_0f0f);
        core::array::from_fn(|k| (magic_byte(q, k) - (MAGIC + 8.0)) * d)
    }
}

/// ggml's `block_q5_0`: `d` at 0, `qh` u32 at 2, `qs` at 6: as q4_0 with bit `i` of `qh` as
/// bit 4 of element `i`'s quant, offset 16. Elements `8g..8g + 8` take their high bits from
/// byte `g` of `qh`.
pub enum BlockQ5_0 {}

impl Block for BlockQ5_0 {
    const ELEMS: u32 = 32;
    const BYTES: u32 = 22;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        let d = f16_at(b, 0);
        let qh = (u16_at(b, 2 + 2 * (g / 2)) >> (8 * (g % 2))) as u32;
        let (qs, shift) = (words_a2(b, 6 + 8 * (g % 2)), 4 * (g / 2));
        let q = [0, 1].map(|i| qs[i] >> shift & 0x0f0f_0f0f | spread4(qh >> (4 * i)) << 4);
        core::array::from_fn(|k| (magic_byte(q, k) - (MAGIC + 16.0)) * d)
    }
}

/// ggml's `block_q8_0`: `d` at 0, `qs` i8 at 2; `x[j] = qs[j]·d`.
pub enum BlockQ8_0 {}

impl Block for BlockQ8_0 {
    const ELEMS: u32 = 32;
    const BYTES: u32 = 34;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        let d = f16_at(b, 0);
        // i8 to u8 plus 128.
        let q = words_a2(b, 2 + 8 * g).map(|w| w ^ 0x8080_8080);
        core::array::from_fn(|k| (magic_byte(q, k) - (MAGIC + 128.0)) * d)
    }
}

/// q4_K and q5_K (block 16-byte aligned): sub-block `sub = g / 4` of 32 reads the low (even
/// `sub`) or high (odd) nibbles of `qs[32·(sub / 2) + l]`; `x = (d·sc)·q - dmin·m`, with the
/// 6-bit scale `sc` and min `m` of the CPU's `scale_min_k4`. `qh` is q5_K's fifth bits or None.
#[inline(always)]
fn k4(b: *const u8, qh: Option<u32>, qs: u32, g: u32) -> [f32; 8] {
    let dm = u32_at(b, 0);
    let (d, dmin) = (f16_to_f32(dm as u16), f16_to_f32((dm >> 16) as u16));
    let (sub, l0) = (g / 4, 8 * (g % 4));
    // The 12 scale bytes as 3 words: sub-block `j` needs byte `j % 4` of each, `s[j % 4]`,
    // `s[j % 4 + 4]` and `s[j % 4 + 8]`. With `hi = j / 4`, the CPU's `scale_min_k4` is
    // `sc = s[j] & 63`, `m = s[j + 4] & 63` (hi = 0) or `sc = s[j + 4] & 15 | s[j - 4] >> 6 << 4`,
    // `m = s[j + 4] >> 4 | s[j] >> 6 << 4` (hi = 1): written with shifts by `hi`, as a select
    // between the two would become a branch with a load in it.
    let at = 8 * (sub % 4);
    let [s0, s1, s2] = [4, 8, 12].map(|w| (u32_at(b, w) >> at) & 255);
    let hi = sub / 4;
    let sc = (s0 | s2 << 8) >> (8 * hi) & 15 | (s0 >> (4 + 2 * hi) & 3) << 4;
    let m = (s1 | s2 << 8) >> (12 * hi) & 15 | (s1 >> (4 + 2 * hi) & 3) << 4;
    let (scale, min) = (d * sc as f32, dmin * m as f32);
    let shift = 4 * (sub % 2);
    let mut q = words_a8(b, qs + 32 * (sub / 2) + l0).map(|w| w >> shift & 0x0f0f_0f0f);
    if let Some(at) = qh {
        let q5 = words_a8(b, at + l0);
        q = [0, 1].map(|i| q[i] | (q5[i] >> sub & 0x0101_0101) << 4);
    }
    core::array::from_fn(|k| scale * (magic_byte(q, k) - MAGIC) - min)
}

/// ggml's `block_q4_K`: `d` at 0, `dmin` at 2, `scales` at 4, `qs` at 16.
pub enum BlockQ4K {}

impl Block for BlockQ4K {
    const ELEMS: u32 = 256;
    const BYTES: u32 = 144;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        k4(b, None, 16, g)
    }
}

/// ggml's `block_q5_K`: `d` at 0, `dmin` at 2, `scales` at 4, `qh` at 16, `qs` at 48: bit `sub`
/// of `qh[l]` is bit 4 of element `l` of sub-block `sub`.
pub enum BlockQ5K {}

impl Block for BlockQ5K {
    const ELEMS: u32 = 256;
    const BYTES: u32 = 176;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        k4(b, Some(16), 48, g)
    }
}

/// ggml's `block_q6_K`: `ql` at 0, `qh` at 128, `scales` i8 at 192, `d` at 208. Element
/// `128h + 32k + l` takes the low (k < 2) or high nibble of `ql[64h + l + 32·(k & 1)]` and bits
/// `2k..2k + 2` of `qh[32h + l]`; `x = (d·scales[i / 16])·(q - 32)`.
pub enum BlockQ6K {}

impl Block for BlockQ6K {
    const ELEMS: u32 = 256;
    const BYTES: u32 = 210;
    #[inline(always)]
    unsafe fn group(b: *const u8, g: u32) -> [f32; 8] {
        let d = f16_at(b, 208);
        let (h, k, l0) = (g / 16, g % 16 / 4, 8 * (g % 4));
        let sc = (u16_at(b, 192 + 2 * (g / 4)) >> (8 * (g / 2 % 2))) as i8;
        let scale = d * sc as f32;
        let ql = words_a2(b, 64 * h + 32 * (k & 1) + l0);
        let qh = words_a2(b, 128 + 32 * h + l0);
        let q = [0, 1]
            .map(|i| ql[i] >> (4 * (k >> 1)) & 0x0f0f_0f0f | (qh[i] >> (2 * k) & 0x0303_0303) << 4);
        core::array::from_fn(|j| scale * (magic_byte(q, j) - (MAGIC + 32.0)))
    }
}

/// Elements `e..e + 8` (`e` a multiple of 8) of a row of blocks `B`.
#[inline(always)]
pub unsafe fn group_at<B: Block>(row: *const u8, e: u32) -> [f32; 8] {
    unsafe {
        B::group(
            row.add((e / B::ELEMS * B::BYTES) as usize),
            e % B::ELEMS / 8,
        )
    }
}

/// Elements `e..e + 8` (`e` a multiple of 8) of a row of quantized type `ty`; NaN for a type
/// that is not quantized.
#[inline(always)]
pub unsafe fn quant8_at(ty: u32, row: *const u8, e: u32) -> [f32; 8] {
    unsafe {
        match ty {
            Q4_0 => group_at::<BlockQ4_0>(row, e),
            Q5_0 => group_at::<BlockQ5_0>(row, e),
            Q8_0 => group_at::<BlockQ8_0>(row, e),
            Q4_K => group_at::<BlockQ4K>(row, e),
            Q5_K => group_at::<BlockQ5K>(row, e),
            Q6_K => group_at::<BlockQ6K>(row, e),
            _ => [f32::NAN; 8],
        }
    }
}

/// `out[t, :] = ` row `tokens[first + t]` of the `[n_rows, hidden]` table of type `ty` (its raw
/// file bytes), dequantized, where `first` is `pos[0]`, or 0 when `pos` is null: a decode
/// step reads its token at the position in device memory, so a captured CUDA graph replays
/// for any position. A token id `>= n_rows` gives a row of NaN; an index `first + t >= n_ids`
/// (past `tokens`) traps. `hidden` must be a whole number of blocks and `table` 16-byte
/// aligned (both checked by the host). Grid: one block per token; block: any size; no shared
/// memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn embed(
    out: *mut f32,
    table: *const u8,
    ty: u32,
    tokens: *const u32,
    pos: *const u32,
    n_ids: u32,
    n_rows: u32,
    hidden: u32,
) {
    let first = if pos.is_null() { 0 } else { unsafe { *pos } };
    let at = first as u64 + block() as u64;
    if at >= n_ids as u64 {
        unsafe { core::arch::nvptx::trap() };
    }
    let token = unsafe { *tokens.add(at as usize) };
    let out = unsafe { out.add(block() as usize * hidden as usize) };
    let (elems, bytes) = block_shape(ty);
    // Wrapping: an out-of-range token's row is never read.
    let row = table.wrapping_add(token as usize * (hidden / elems * bytes) as usize);
    if elems == 1 {
        let mut i = thread();
        while i < hidden {
            let v = if token < n_rows {
                unsafe { float_at(ty, row, i) }
            } else {
                f32::NAN
            };
            unsafe { *out.add(i as usize) = v };
            i += block_dim();
        }
    } else {
        let mut e = 8 * thread();
        while e < hidden {
            let v = if token < n_rows {
                unsafe { quant8_at(ty, row, e) }
            } else {
                [f32::NAN; 8]
            };
            for (k, v) in v.iter().enumerate() {
                unsafe { *out.add(e as usize + k) = *v };
            }
            e += 8 * block_dim();
        }
    }
}
