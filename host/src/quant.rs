//! ggml tensor types: their ids, block layouts and sizes, and dequantization to f32 and f16.
//!
//! Block layouts are exactly ggml's (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`);
//! all multi-byte fields are little-endian, `f16` is IEEE half, blocks are packed (no padding).
//! This table is the reference the GPU kernels are written against.
//!
//! | type | elems | bytes | field: offset, bytes                                              |
//! |------|-------|-------|-------------------------------------------------------------------|
//! | f32  | 1     | 4     | IEEE single                                                       |
//! | f16  | 1     | 2     | IEEE half                                                         |
//! | bf16 | 1     | 2     | the top 16 bits of an f32: `x = f32::from_bits(u16 << 16)`        |
//! | q4_0 | 32    | 18    | `d` f16: 0, 2 · `qs` u8\[16\]: 2, 16                              |
//! | q5_0 | 32    | 22    | `d` f16: 0, 2 · `qh` u32: 2, 4 · `qs` u8\[16\]: 6, 16              |
//! | q8_0 | 32    | 34    | `d` f16: 0, 2 · `qs` i8\[32\]: 2, 32                              |
//! | q4_K | 256   | 144   | `d` f16: 0, 2 · `dmin` f16: 2, 2 · `scales` u8\[12\]: 4, 12 · `qs` u8\[128\]: 16, 128 |
//! | q5_K | 256   | 176   | `d` f16: 0, 2 · `dmin` f16: 2, 2 · `scales` u8\[12\]: 4, 12 · `qh` u8\[32\]: 16, 32 · `qs` u8\[128\]: 48, 128 |
//! | q6_K | 256   | 210   | `ql` u8\[128\]: 0, 128 · `qh` u8\[64\]: 128, 64 · `scales` i8\[16\]: 192, 16 · `d` f16: 208, 2 |
//!
//! Element `i` of a block (`j` runs over 0..16 or 0..32, `l` over 0..32):
//! - q4_0: `x[j] = ((qs[j] & 15) - 8)·d`, `x[j+16] = ((qs[j] >> 4) - 8)·d`.
//! - q5_0: as q4_0 with a fifth bit: element `i` takes bit `i` of `qh` as bit 4 of its quant,
//!   and the offset is 16: `x[j] = ((qs[j] & 15 | bit j of qh << 4) - 16)·d`,
//!   `x[j+16] = ((qs[j] >> 4 | bit j+16 of qh << 4) - 16)·d`.
//! - q8_0: `x[j] = qs[j]·d`.
//! - q4_K: 8 sub-blocks of 32, each with a 6-bit scale `sc` and 6-bit min `m` packed in `scales`
//!   (see `scale_min_k4` below). The 256 elements are 4 chunks of 64: chunk `c` reads `qs[32c..32c+32]`,
//!   the low nibbles are sub-block `2c` (elements `64c + l`), the high nibbles sub-block `2c+1`
//!   (elements `64c + 32 + l`); `x = (d·sc)·q - dmin·m`.
//! - q5_K: as q4_K, and the quant's bit 4 is bit `s` of `qh[l]` for sub-block `s`:
//!   `x = (d·sc)·(nibble | bit << 4) - dmin·m`.
//! - q6_K: 2 halves of 128: half `h` reads `ql[64h..64h+64]` and `qh[32h..32h+32]`. Its element
//!   `32k + l` (k in 0..4) takes the low nibble (k = 0, 1) or high nibble (k = 2, 3) of
//!   `ql[l + 32·(k & 1)]` as bits 0..4 and bits `2k..2k+2` of `qh[l]` as bits 4..6 of `q`;
//!   element `i` of the block is `x = (d·scales[i / 16])·(q - 32)`.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kernel_abi::ggml;
use rayon::prelude::*;

use crate::{Error, Result};

/// A ggml tensor type this engine knows. The discriminants are ggml's type ids, as the kernels
/// take them (`kernel_abi::ggml`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = ggml::F32,
    F16 = ggml::F16,
    Q4_0 = ggml::Q4_0,
    Q5_0 = ggml::Q5_0,
    Q8_0 = ggml::Q8_0,
    Q4K = ggml::Q4_K,
    Q5K = ggml::Q5_K,
    Q6K = ggml::Q6_K,
    BF16 = ggml::BF16,
}

impl GgmlType {
    /// Every type this engine reads.
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type for a ggml type id, or `None` for ids this engine does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            ggml::F32 => F32,
            ggml::F16 => F16,
            ggml::Q4_0 => Q4_0,
            ggml::Q5_0 => Q5_0,
            ggml::Q8_0 => Q8_0,
            ggml::Q4_K => Q4K,
            ggml::Q5_K => Q5K,
            ggml::Q6_K => Q6K,
            ggml::BF16 => BF16,
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
        n.is_multiple_of(self.block_elems())
            .then(|| n / self.block_elems() * self.block_bytes())
    }
}

/// Elements per parallel task: large enough that rayon's overhead vanishes, small enough that
/// 2 cores get an even share of a 896-wide norm row or a 151936×896 embedding alike.
const TASK_ELEMS: usize = 1 << 15;
/// The f16 path stages this many f32s on the stack: one block of the largest type.
const STAGE_ELEMS: usize = 256;

/// Dequantizes `data` (whole blocks of `ty`) into `out`, which must hold exactly
/// `data.len() / ty.block_bytes() * ty.block_elems()` elements.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    check_sizes(ty, data.len(), out.len())?;
    let task = (TASK_ELEMS / ty.block_elems()).max(1);
    data.par_chunks(task * ty.block_bytes())
        .zip(out.par_chunks_mut(task * ty.block_elems()))
        .for_each(|(data, out)| dequantize_blocks(ty, data, out));
    Ok(())
}

/// As [`dequantize`], rounding to f16 (round to nearest even; beyond ±65504 becomes ±inf).
/// Each block goes through f32 on the stack, so the result is exactly the f32 result rounded.
pub fn dequantize_f16(ty: GgmlType, data: &[u8], out: &mut [f16]) -> Result<()> {
    check_sizes(ty, data.len(), out.len())?;
    let task = (TASK_ELEMS / ty.block_elems()).max(1);
    let stage_bytes = STAGE_ELEMS / ty.block_elems() * ty.block_bytes();
    data.par_chunks(task * ty.block_bytes())
        .zip(out.par_chunks_mut(task * ty.block_elems()))
        .for_each(|(data, out)| {
            let mut stage = [0f32; STAGE_ELEMS];
            for (data, out) in data.chunks(stage_bytes).zip(out.chunks_mut(STAGE_ELEMS)) {
                let stage = &mut stage[..out.len()];
                dequantize_blocks(ty, data, stage);
                out.convert_from_f32_slice(stage);
            }
        });
    Ok(())
}

/// [`dequantize`] into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>> {
    let mut out = vec![0f32; data.len() / ty.block_bytes() * ty.block_elems()];
    dequantize(ty, data, &mut out)?;
    Ok(out)
}

fn check_sizes(ty: GgmlType, data_len: usize, out_len: usize) -> Result<()> {
    let (bytes, elems) = (ty.block_bytes(), ty.block_elems());
    if !data_len.is_multiple_of(bytes) {
        return Err(Error::Invalid(format!(
            "dequantize {}: {data_len} bytes is not a whole number of {bytes}-byte blocks",
            ty.name()
        )));
    }
    if data_len / bytes * elems != out_len {
        return Err(Error::Invalid(format!(
            "dequantize {}: {} blocks hold {} elements but the output has {out_len}",
            ty.name(),
            data_len / bytes,
            data_len / bytes * elems
        )));
    }
    Ok(())
}

/// Dequantizes whole blocks on this thread; the sizes were checked by the caller.
fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    use GgmlType::*;
    match ty {
        F32 => each_block(data, out, |b: &[u8; 4], y: &mut [f32; 1]| {
            y[0] = f32::from_le_bytes(*b)
        }),
        F16 => each_block(data, out, |b: &[u8; 2], y: &mut [f32; 1]| {
            y[0] = f16::from_le_bytes(*b).to_f32()
        }),
        BF16 => each_block(data, out, |b: &[u8; 2], y: &mut [f32; 1]| {
            y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16)
        }),
        Q4_0 => each_block(data, out, dequantize_q4_0_block),
        Q5_0 => each_block(data, out, dequantize_q5_0_block),
        Q8_0 => each_block(data, out, dequantize_q8_0_block),
        Q4K => each_block(data, out, dequantize_q4_k_block),
        Q5K => each_block(data, out, dequantize_q5_k_block),
        Q6K => each_block(data, out, dequantize_q6_k_block),
    }
}

/// Runs `block` over each `B`-byte block of `data` and its `N` elements of `out`.
fn each_block<const B: usize, const N: usize>(
    data: &[u8],
    out: &mut [f32],
    block: impl Fn(&[u8; B], &mut [f32; N]),
) {
    for (b, y) in data
        .as_chunks::<B>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<N>().0)
    {
        block(b, y);
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn dequantize_q4_0_block(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..].iter().enumerate() {
        y[j] = (i32::from(q & 15) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

fn dequantize_q5_0_block(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..].iter().enumerate() {
        let lo = u32::from(q & 15) | (qh >> j & 1) << 4;
        let hi = u32::from(q >> 4) | (qh >> (j + 16) & 1) << 4;
        y[j] = (lo as i32 - 16) as f32 * d;
        y[j + 16] = (hi as i32 - 16) as f32 * d;
    }
}

fn dequantize_q8_0_block(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..]) {
        *y = f32::from(q as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a q4_K/q5_K block's 12 `scales` bytes:
/// sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` (scale) and `j + 4` (min);
/// sub-blocks 4..8 keep their low 4 bits in the nibbles of byte `j + 4` (scale low, min high)
/// and their top 2 bits in the top 2 bits of bytes `j - 4` (scale) and `j` (min).
pub(crate) fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            s[j + 4] & 15 | (s[j - 4] >> 6) << 4,
            s[j + 4] >> 4 | (s[j] >> 6) << 4,
        )
    }
}

/// q4_K and q5_K differ only in q5_K's fifth bit, `high(l, sub_block)` (16 or 0).
fn dequantize_k4_block(
    d: f32,
    dmin: f32,
    scales: &[u8; 12],
    qs: &[u8; 128],
    high: impl Fn(usize, usize) -> u8,
    y: &mut [f32; 256],
) {
    for c in 0..4 {
        for half in 0..2 {
            let sub = 2 * c + half;
            let (sc, m) = scale_min_k4(sub, scales);
            let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
            for l in 0..32 {
                let q = qs[32 * c + l] >> (4 * half) & 15 | high(l, sub);
                y[32 * sub + l] = scale * f32::from(q) - min;
            }
        }
    }
}

fn dequantize_q4_k_block(b: &[u8; 144], y: &mut [f32; 256]) {
    let (scales, qs) = (b[4..16].try_into().unwrap(), b[16..].try_into().unwrap());
    dequantize_k4_block(f16_at(b, 0), f16_at(b, 2), scales, qs, |_, _| 0, y);
}

fn dequantize_q5_k_block(b: &[u8; 176], y: &mut [f32; 256]) {
    let (scales, qh, qs) = (
        b[4..16].try_into().unwrap(),
        &b[16..48],
        b[48..].try_into().unwrap(),
    );
    let high = |l: usize, sub: usize| (qh[l] >> sub & 1) << 4;
    dequantize_k4_block(f16_at(b, 0), f16_at(b, 2), scales, qs, high, y);
}

fn dequantize_q6_k_block(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        for k in 0..4 {
            for l in 0..32 {
                let i = 128 * h + 32 * k + l;
                let lo = ql[l + 32 * (k & 1)] >> (4 * (k >> 1)) & 15;
                let q = i32::from(lo | (qh[l] >> (2 * k) & 3) << 4) - 32;
                y[i] = d * f32::from(b[192 + i / 16] as i8) * q as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block of `ty` built from `fields` laid end to end, checked to fill it exactly.
    fn block(ty: GgmlType, fields: &[&[u8]]) -> Vec<u8> {
        let b = fields.concat();
        assert_eq!(b.len(), ty.block_bytes(), "test block of {}", ty.name());
        b
    }

    /// `qs[i] = i % 16 | (15 - i % 16) << 4`: each byte's two nibbles sum to 15.
    fn nibble_ramp<const N: usize>() -> [u8; N] {
        std::array::from_fn(|i| (i % 16) as u8 | (15 - (i % 16) as u8) << 4)
    }

    // f16 bit patterns used below.
    const F16_MINUS_ONE: [u8; 2] = 0xbc00u16.to_le_bytes();
    const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes();
    const F16_MINUS_HALF: [u8; 2] = 0xb800u16.to_le_bytes();
    const F16_QUARTER: [u8; 2] = 0x3400u16.to_le_bytes();
    const F16_MINUS_QUARTER: [u8; 2] = 0xb400u16.to_le_bytes();
    const F16_MINUS_TWO: [u8; 2] = 0xc000u16.to_le_bytes();
    const F16_MAX: [u8; 2] = 0x7bffu16.to_le_bytes(); // 65504
    const F16_MINUS_MAX: [u8; 2] = 0xfbffu16.to_le_bytes(); // -65504
    const F16_TINY: [u8; 2] = 0x0001u16.to_le_bytes(); // smallest subnormal, 2^-24
    const F16_ZERO: [u8; 2] = [0, 0];
    const TINY: f32 = 5.960_464_5e-8; // 2^-24

    fn deq(ty: GgmlType, data: &[u8]) -> Vec<f32> {
        dequantize_to_vec(ty, data).unwrap()
    }

    #[test]
    fn plain_floats() {
        let f32s = [1.5f32, -0.0, f32::MAX, -3.25e-40]
            .map(f32::to_le_bytes)
            .concat();
        let y = deq(GgmlType::F32, &f32s);
        assert_eq!(y.map_bits(), [1.5f32, -0.0, f32::MAX, -3.25e-40].map_bits());

        // 0x3c00 = 1.0, 0xc000 = -2.0, 0x7bff = 65504, 0x0001 = 2^-24, 0xfc00 = -inf
        let f16s = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0xfc00]
            .map(u16::to_le_bytes)
            .concat();
        let y = deq(GgmlType::F16, &f16s);
        assert_eq!(y, [1.0, -2.0, 65504.0, TINY, f32::NEG_INFINITY]);

        // bf16 is the top half of an f32: 0x3f80 -> 0x3f80_0000 = 1.0, 0xc040 -> -3.0,
        // 0x7f7f -> 0x7f7f_0000 = 2^127 · (1 + 127/128), 0x0001 -> 0x0001_0000 (a subnormal)
        let bf16s = [0x3f80u16, 0xc040, 0x7f7f, 0x0001]
            .map(u16::to_le_bytes)
            .concat();
        let y = deq(GgmlType::BF16, &bf16s);
        let big = 2f32.powi(127) * (1.0 + 127.0 / 128.0);
        assert_eq!(
            y.map_bits(),
            [1.0, -3.0, big, f32::from_bits(0x0001_0000)].map_bits()
        );
    }

    trait MapBits {
        fn map_bits(&self) -> Vec<u32>;
    }
    impl MapBits for [f32] {
        fn map_bits(&self) -> Vec<u32> {
            self.iter().map(|x| x.to_bits()).collect()
        }
    }

    #[test]
    fn q4_0_negative_scale() {
        // d = -0.5; qs = nibble_ramp: element j < 16 has q = j, element 16 + j has q = 15 - j.
        // x = (q - 8)·(-0.5): q = 0 -> 4.0, q = 15 -> -3.5.
        let b = block(GgmlType::Q4_0, &[&F16_MINUS_HALF, &nibble_ramp::<16>()]);
        #[rustfmt::skip]
        let expected = [
            4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5,
            -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0,
        ];
        assert_eq!(deq(GgmlType::Q4_0, &b), expected);
    }

    #[test]
    fn q4_0_extremes() {
        // d = 65504: all nibbles 0 -> -8·65504, all nibbles 15 -> 7·65504.
        let zeros = block(GgmlType::Q4_0, &[&F16_MAX, &[0; 16]]);
        assert_eq!(deq(GgmlType::Q4_0, &zeros), [-524032.0; 32]);
        let max = block(GgmlType::Q4_0, &[&F16_MAX, &[0xff; 16]]);
        assert_eq!(deq(GgmlType::Q4_0, &max), [458528.0; 32]);
        // d = 2^-24 (subnormal f16): q = 15 -> 7·2^-24.
        let tiny = block(GgmlType::Q4_0, &[&F16_TINY, &[0xff; 16]]);
        assert_eq!(deq(GgmlType::Q4_0, &tiny), [7.0 * TINY; 32]);
        // d = 0: all zeros whatever the quants.
        let zero = block(GgmlType::Q4_0, &[&F16_ZERO, &[0x3c; 16]]);
        assert_eq!(deq(GgmlType::Q4_0, &zero), [0.0; 32]);
    }

    #[test]
    fn q5_0_negative_scale() {
        // d = -0.25; qh bytes 01 80 00 ff = u32 0xff00_8001: bits 0, 15 and 24..32 set.
        // qs[j] = j (high nibbles 0). Element j < 16: q = j + 16·bit j; element 16 + j:
        // q = 0 + 16·bit (16 + j). x = (q - 16)·(-0.25).
        let qs: [u8; 16] = std::array::from_fn(|j| j as u8);
        let b = block(
            GgmlType::Q5_0,
            &[&F16_MINUS_QUARTER, &[0x01, 0x80, 0x00, 0xff], &qs],
        );
        #[rustfmt::skip]
        let expected = [
            // j = 0: q = 16 -> 0; j = 1..15: q = j -> (16 - j)/4; j = 15: q = 31 -> -3.75
            0.0, 3.75, 3.5, 3.25, 3.0, 2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, -3.75,
            // bits 16..24 clear: q = 0 -> 4.0; bits 24..32 set: q = 16 -> 0
            4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        assert_eq!(deq(GgmlType::Q5_0, &b), expected);
    }

    #[test]
    fn q5_0_extremes() {
        // d = 65504: q = 31 -> 15·65504; q = 0 -> -16·65504.
        let max = block(GgmlType::Q5_0, &[&F16_MAX, &[0xff; 4], &[0xff; 16]]);
        assert_eq!(deq(GgmlType::Q5_0, &max), [982560.0; 32]);
        let zeros = block(GgmlType::Q5_0, &[&F16_MAX, &[0; 4], &[0; 16]]);
        assert_eq!(deq(GgmlType::Q5_0, &zeros), [-1048064.0; 32]);
        // d = 2^-24: q = 0 -> -16·2^-24.
        let tiny = block(GgmlType::Q5_0, &[&F16_TINY, &[0; 4], &[0; 16]]);
        assert_eq!(deq(GgmlType::Q5_0, &tiny), [-16.0 * TINY; 32]);
    }

    #[test]
    fn q8_0_negative_scale_and_extremes() {
        // d = -2; qs = -128, 127, 0, 1, -1, 2, -2, … : x = q·(-2)
        let mut qs = [0i8; 32];
        qs[..7].copy_from_slice(&[-128, 127, 0, 1, -1, 2, -2]);
        let qs = qs.map(|q| q as u8);
        let b = block(GgmlType::Q8_0, &[&F16_MINUS_TWO, &qs]);
        let mut expected = [0.0f32; 32];
        expected[..7].copy_from_slice(&[256.0, -254.0, -0.0, -2.0, 2.0, -4.0, 4.0]);
        assert_eq!(deq(GgmlType::Q8_0, &b), expected);
        // d = 65504: q = -128 -> -8384512, q = 127 -> 8319008.
        let min = block(GgmlType::Q8_0, &[&F16_MAX, &[0x80; 32]]);
        assert_eq!(deq(GgmlType::Q8_0, &min), [-8384512.0; 32]);
        let max = block(GgmlType::Q8_0, &[&F16_MAX, &[0x7f; 32]]);
        assert_eq!(deq(GgmlType::Q8_0, &max), [8319008.0; 32]);
        // d = 2^-24: q = -1 -> -2^-24.
        let tiny = block(GgmlType::Q8_0, &[&F16_TINY, &[0xff; 32]]);
        assert_eq!(deq(GgmlType::Q8_0, &tiny), [-TINY; 32]);
    }

    /// Sub-block scales and mins for the K-quant tests, and their packing into 12 bytes:
    /// bytes 0..4:  sc[j] | (sc[j+4] >> 4) << 6
    /// bytes 4..8:  m[j] | (m[j+4] >> 4) << 6
    /// bytes 8..12: sc[j+4] & 15 | (m[j+4] & 15) << 4
    const K_SC: [u8; 8] = [1, 2, 3, 63, 16, 33, 0, 47];
    const K_M: [u8; 8] = [0, 1, 63, 2, 5, 16, 32, 48];
    const K_SCALES: [u8; 12] = [
        1 | 1 << 6,  // sc0 = 1, sc4 = 16 -> top bits 1
        2 | 2 << 6,  // sc1 = 2, sc5 = 33 -> top bits 2
        3,           // sc2 = 3, sc6 = 0
        63 | 2 << 6, // sc3 = 63, sc7 = 47 -> top bits 2
        0,           // m0 = 0, m4 = 5 -> top bits 0
        1 | 1 << 6,  // m1 = 1, m5 = 16 -> top bits 1
        63 | 2 << 6, // m2 = 63, m6 = 32 -> top bits 2
        2 | 3 << 6,  // m3 = 2, m7 = 48 -> top bits 3
        5 << 4,      // sc4 low 0, m4 low 5
        1,           // sc5 low 1, m5 low 0
        0,           // sc6 low 0, m6 low 0
        15,          // sc7 low 15, m7 low 0
    ];

    #[test]
    fn k4_scale_min_unpacking() {
        for j in 0..8 {
            assert_eq!(
                scale_min_k4(j, &K_SCALES),
                (K_SC[j], K_M[j]),
                "sub-block {j}"
            );
        }
        // All ones: every 6-bit field is 63.
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &[0xff; 12]), (63, 63), "sub-block {j}");
        }
    }

    #[test]
    fn q4_k_negative_scale() {
        // d = -0.5, dmin = 0.25; x = (d·sc)·q - dmin·m. qs = nibble_ramp: qs[i] low = i % 16,
        // high = 15 - i % 16. Element 64c + l reads qs[32c + l] low (sub-block 2c),
        // element 64c + 32 + l its high nibble (sub-block 2c + 1).
        let b = block(
            GgmlType::Q4K,
            &[
                &F16_MINUS_HALF,
                &F16_QUARTER,
                &K_SCALES,
                &nibble_ramp::<128>(),
            ],
        );
        let y = deq(GgmlType::Q4K, &b);
        let expected = [
            (0, 0.0),      // sub 0 (sc 1, m 0), q = 0
            (5, -2.5),     // sub 0, q = 5: -0.5·5
            (35, -12.25),  // sub 1 (sc 2, m 1), qs[3] high = 12: -1·12 - 0.25
            (79, -38.25),  // sub 2 (sc 3, m 63), qs[47] low = 15: -1.5·15 - 15.75
            (96, -473.0),  // sub 3 (sc 63, m 2), qs[32] high = 15: -31.5·15 - 0.5
            (129, -9.25),  // sub 4 (sc 16, m 5), qs[65] low = 1: -8·1 - 1.25
            (162, -218.5), // sub 5 (sc 33, m 16), qs[66] high = 13: -16.5·13 - 4
            (199, -8.0),   // sub 6 (sc 0, m 32): -0.25·32
            (224, -364.5), // sub 7 (sc 47, m 48), qs[96] high = 15: -23.5·15 - 12
            (255, -12.0),  // sub 7, qs[127] high = 0: -0.25·48
        ];
        for (i, x) in expected {
            assert_eq!(y[i], x, "element {i}");
        }
    }

    #[test]
    fn q4_k_extremes() {
        // d = dmin = 65504, every sc = m = 63: d·sc = dmin·m = 4126752.
        // q = 15 -> 4126752·15 - 4126752 = 57774528; q = 0 -> -4126752.
        let max = block(
            GgmlType::Q4K,
            &[&F16_MAX, &F16_MAX, &[0xff; 12], &[0xff; 128]],
        );
        assert_eq!(deq(GgmlType::Q4K, &max), [57774528.0; 256]);
        let zeros = block(GgmlType::Q4K, &[&F16_MAX, &F16_MAX, &[0xff; 12], &[0; 128]]);
        assert_eq!(deq(GgmlType::Q4K, &zeros), [-4126752.0; 256]);
        // d = 2^-24, dmin = 0, sc = 1 (bytes 0..4 = 1, 8..12 low nibbles = 1): q = 15 -> 15·2^-24.
        let scales = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1];
        let tiny = block(
            GgmlType::Q4K,
            &[&F16_TINY, &F16_ZERO, &scales, &[0xff; 128]],
        );
        assert_eq!(deq(GgmlType::Q4K, &tiny), [15.0 * TINY; 256]);
        // All-zero block.
        let zero = block(GgmlType::Q4K, &[&[0; 144]]);
        assert_eq!(deq(GgmlType::Q4K, &zero), [0.0; 256]);
    }

    #[test]
    fn q5_k_negative_min() {
        // d = 0.5, dmin = -1: x = (0.5·sc)·q + m. qs = nibble_ramp as for q4_K;
        // qh[l] = 0x55 for l < 16 (even bits: low-nibble sub-blocks get +16),
        // 0xaa for l >= 16 (odd bits: high-nibble sub-blocks get +16). Bit s of qh[l] is the
        // fifth bit of element l of sub-block s.
        let qh: [u8; 32] = std::array::from_fn(|l| if l < 16 { 0x55 } else { 0xaa });
        let b = block(
            GgmlType::Q5K,
            &[
                &F16_HALF,
                &F16_MINUS_ONE,
                &K_SCALES,
                &qh,
                &nibble_ramp::<128>(),
            ],
        );
        let y = deq(GgmlType::Q5K, &b);
        let expected = [
            (0, 8.0),     // sub 0 (sc 1, m 0), q = 0 + 16: 0.5·16
            (20, 2.0),    // sub 0, qs[20] low = 4, qh[20] bit 0 clear: 0.5·4
            (35, 13.0),   // sub 1 (sc 2, m 1), qs[3] high = 12, qh[3] bit 1 clear: 1·12 + 1
            (49, 31.0),   // sub 1, qs[17] high = 14, qh[17] bit 1 set -> 30: 1·30 + 1
            (79, 109.5), // sub 2 (sc 3, m 63), qs[47] low = 15, qh[15] bit 2 set -> 31: 1.5·31 + 63
            (127, 506.0), // sub 3 (sc 63, m 2), qs[63] high = 0, qh[31] bit 3 set -> 16: 31.5·16 + 2
            (128, 133.0), // sub 4 (sc 16, m 5), qs[64] low = 0, qh[0] bit 4 set -> 16: 8·16 + 5
            (176, 527.5), // sub 5 (sc 33, m 16), qs[80] high = 15, qh[16] bit 5 set -> 31: 16.5·31 + 16
            (193, 32.0),  // sub 6 (sc 0, m 32): 0 + 32
            (254, 447.5), // sub 7 (sc 47, m 48), qs[126] high = 1, qh[30] bit 7 set -> 17: 23.5·17 + 48
        ];
        for (i, x) in expected {
            assert_eq!(y[i], x, "element {i}");
        }
    }

    #[test]
    fn q5_k_extremes() {
        // d = dmin = 65504, sc = m = 63, q = 31: 4126752·31 - 4126752 = 123802560.
        let max = block(
            GgmlType::Q5K,
            &[&F16_MAX, &F16_MAX, &[0xff; 12], &[0xff; 32], &[0xff; 128]],
        );
        assert_eq!(deq(GgmlType::Q5K, &max), [123802560.0; 256]);
        // d = -65504, dmin = 65504, sc = m = 63, q = 31:
        // -4126752·31 - 4126752 = -4126752·32 = -132056064.
        let neg = block(
            GgmlType::Q5K,
            &[
                &F16_MINUS_MAX,
                &F16_MAX,
                &[0xff; 12],
                &[0xff; 32],
                &[0xff; 128],
            ],
        );
        assert_eq!(deq(GgmlType::Q5K, &neg), [-132056064.0; 256]);
        let zero = block(GgmlType::Q5K, &[&[0; 176]]);
        assert_eq!(deq(GgmlType::Q5K, &zero), [0.0; 256]);
    }

    #[test]
    fn q6_k_negative_scales() {
        // d = 0.25; scales (i8) below; x = (d·sc[i/16])·(q - 32).
        // ql = nibble_ramp; qh[l] = 0xe4 = 11_10_01_00 for the first half (k = 0..4 get high
        // bits 0, 1, 2, 3) and 0x1b = 00_01_10_11 for the second (high bits 3, 2, 1, 0).
        let sc: [i8; 16] = [1, -1, 2, -2, 127, -128, 0, 3, 4, -5, 6, -7, 8, -9, 10, -11];
        let qh: [u8; 64] = std::array::from_fn(|i| if i < 32 { 0xe4 } else { 0x1b });
        let b = block(
            GgmlType::Q6K,
            &[
                &nibble_ramp::<128>(),
                &qh,
                &sc.map(|s| s as u8),
                &F16_QUARTER,
            ],
        );
        let y = deq(GgmlType::Q6K, &b);
        let expected = [
            (0, -8.0),    // k 0, ql[0] low 0, high 0 -> q = -32; sc 1: 0.25·-32
            (17, 7.75),   // k 0, ql[17] low 1 -> -31; sc -1: -0.25·-31
            (37, -5.5),   // k 1, ql[37] low 5, high 1 -> 21 - 32 = -11; sc 2: 0.5·-11
            (64, 476.25), // k 2, ql[0] high 15, high 2 -> 47 - 32 = 15; sc 127: 31.75·15
            (84, -352.0), // k 2, ql[20] high 11, high 2 -> 43 - 32 = 11; sc -128: -32·11
            (96, 0.0),    // sc 0
            (127, 12.0),  // k 3, ql[63] high 0, high 3 -> 48 - 32 = 16; sc 3: 0.75·16
            (128, 16.0),  // half 1, k 0, ql[64] low 0, high 3 -> 16; sc 4: 1·16
            (177, -1.75), // half 1, k 1, ql[113] low 1, high 2 -> 33 - 32 = 1; sc -7: -1.75·1
            (202, -22.0), // half 1, k 2, ql[74] high 5, high 1 -> 21 - 32 = -11; sc 8: 2·-11
            (255, 88.0),  // half 1, k 3, ql[127] high 0, high 0 -> -32; sc -11: -2.75·-32
        ];
        for (i, x) in expected {
            assert_eq!(y[i], x, "element {i}");
        }
    }

    #[test]
    fn q6_k_extremes() {
        let sc = |s: i8| [s as u8; 16];
        // d = 65504, sc = -128, q = -32 (all zero quants): 65504·-128·-32 = 268304384.
        let min = block(GgmlType::Q6K, &[&[0; 128], &[0; 64], &sc(-128), &F16_MAX]);
        assert_eq!(deq(GgmlType::Q6K, &min), [268304384.0; 256]);
        // d = 65504, sc = 127, q = 63 - 32 = 31: 8319008·31 = 257889248.
        let max = block(
            GgmlType::Q6K,
            &[&[0xff; 128], &[0xff; 64], &sc(127), &F16_MAX],
        );
        assert_eq!(deq(GgmlType::Q6K, &max), [257889248.0; 256]);
        // d = -1, sc = -128, q = -32: -1·-128·-32 = -4096.
        let neg = block(
            GgmlType::Q6K,
            &[&[0; 128], &[0; 64], &sc(-128), &F16_MINUS_ONE],
        );
        assert_eq!(deq(GgmlType::Q6K, &neg), [-4096.0; 256]);
        // d = 2^-24, sc = 1, q = 31.
        let tiny = block(
            GgmlType::Q6K,
            &[&[0xff; 128], &[0xff; 64], &sc(1), &F16_TINY],
        );
        assert_eq!(deq(GgmlType::Q6K, &tiny), [31.0 * TINY; 256]);
    }

    /// xorshift64*, for random blocks.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// A random finite f16 (any sign, normal, subnormal or zero), as bytes.
        fn finite_f16(&mut self) -> [u8; 2] {
            loop {
                let bits = self.next() as u16;
                if bits & 0x7c00 != 0x7c00 {
                    return bits.to_le_bytes();
                }
            }
        }
    }

    /// The block-quantized types of `GgmlType::ALL`.
    fn quantized() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.into_iter().filter(|t| t.block_elems() > 1)
    }

    /// `n` blocks of `ty` with random quants and random finite f16 scales, and for each block
    /// the bound on |x| from the format: max |q·sc|·|d| + max m·|dmin|.
    fn random_blocks(ty: GgmlType, n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
        let mut data = Vec::with_capacity(n * ty.block_bytes());
        let mut bounds = Vec::with_capacity(n);
        for _ in 0..n {
            let mut b: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.next() as u8).collect();
            let d = rng.finite_f16();
            let dmin = rng.finite_f16();
            let abs = |h: [u8; 2]| f16::from_le_bytes(h).to_f32().abs();
            let bound = match ty {
                GgmlType::Q4_0 => 8.0 * abs(d),
                GgmlType::Q5_0 => 16.0 * abs(d),
                GgmlType::Q8_0 => 128.0 * abs(d),
                GgmlType::Q4K => 15.0 * 63.0 * abs(d) + 63.0 * abs(dmin),
                GgmlType::Q5K => 31.0 * 63.0 * abs(d) + 63.0 * abs(dmin),
                GgmlType::Q6K => 32.0 * 128.0 * abs(d),
                _ => unreachable!(),
            };
            let d_at = if ty == GgmlType::Q6K { 208 } else { 0 };
            b[d_at..d_at + 2].copy_from_slice(&d);
            if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
                b[2..4].copy_from_slice(&dmin);
            }
            data.extend_from_slice(&b);
            bounds.push(bound);
        }
        (data, bounds)
    }

    #[test]
    fn finite_scales_give_finite_bounded_values() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for ty in quantized() {
            let (data, bounds) = random_blocks(ty, 10_000, &mut rng);
            let y = deq(ty, &data);
            for (i, (block, bound)) in y.chunks(ty.block_elems()).zip(bounds).enumerate() {
                for &x in block {
                    // Three roundings (d·sc, ·q, - min) add at most a few ulps to the bound.
                    assert!(
                        x.is_finite() && x.abs() <= bound * (1.0 + 1e-6),
                        "{} block {i}: {x} vs bound {bound}",
                        ty.name()
                    );
                }
            }
        }
    }

    #[test]
    fn f16_output_is_f32_output_rounded() {
        let mut rng = Rng(42);
        for ty in quantized() {
            // 3000 blocks span several parallel tasks and staging chunks.
            let (data, _) = random_blocks(ty, 3000, &mut rng);
            let y = deq(ty, &data);
            let mut h = vec![f16::ZERO; y.len()];
            dequantize_f16(ty, &data, &mut h).unwrap();
            for (i, (&x, &h)) in y.iter().zip(&h).enumerate() {
                assert_eq!(
                    f16::from_f32(x).to_bits(),
                    h.to_bits(),
                    "{} element {i}",
                    ty.name()
                );
            }
        }
        // Plain floats too, including an f32 beyond f16's range (-> inf) and one that rounds.
        let f32s = [1.0f32 + 1.0 / 4096.0, 70000.0, -1e-9, 0.1]
            .map(f32::to_le_bytes)
            .concat();
        let mut h = [f16::ZERO; 4];
        dequantize_f16(GgmlType::F32, &f32s, &mut h).unwrap();
        // 1 + 2^-12 is a tie between 1 and 1 + 2^-10: to even -> 1.0; 70000 -> inf;
        // -1e-9 underflows to -0; 0.1 -> 0x2e66.
        assert_eq!(h.map(f16::to_bits), [0x3c00, 0x7c00, 0x8000, 0x2e66]);
    }

    #[test]
    fn size_mismatches_are_errors() {
        let mut out = [0f32; 64];
        let err = dequantize(GgmlType::Q4_0, &[0; 35], &mut out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dequantize q4_0: 35 bytes is not a whole number of 18-byte blocks"
        );
        let err = dequantize(GgmlType::Q4_0, &[0; 18], &mut out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dequantize q4_0: 1 blocks hold 32 elements but the output has 64"
        );
        let mut h = [f16::ZERO; 255];
        let err = dequantize_f16(GgmlType::Q6K, &[0; 210], &mut h).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dequantize q6_K: 1 blocks hold 256 elements but the output has 255"
        );
        assert!(dequantize_to_vec(GgmlType::F32, &[0; 7]).is_err());
        assert!(dequantize_to_vec(GgmlType::Q8_0, &[]).unwrap().is_empty());
    }
}
