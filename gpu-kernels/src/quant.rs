//! Dequantization of ggml blocks on the GPU, and the token-embedding row gather.
//! CPU twin: `orcd::quant::dequantize` (the layouts are the table at the top of host/src/quant.rs).
//!
//! Each quantized format has one function that returns elements `8g..8g + 8` of a block: in
//! every format those eight share one scale and come from consecutive quant bytes, so a
//! quantized GEMV lane can take eight weights at a time. The arithmetic is the CPU's, operation
//! by operation and in the same order (rustc sets no fast-math flags, so LLVM contracts no
//! `a * b - c` into an FMA), so the results are bit-identical. Fields are read byte by byte:
//! blocks of 18, 22, 34 or 210 bytes leave them unaligned. The block functions are `unsafe`:
//! `b` must point at one whole block (`row` at a whole row).
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
        Q4_0 => (32, 18),
        Q5_0 => (32, 22),
        Q8_0 => (32, 34),
        Q4_K => (256, 144),
        Q5_K => (256, 176),
        Q6_K => (256, 210),
        _ => (1, 1),
    }
}

#[inline(always)]
fn byte(b: *const u8, at: u32) -> u8 {
    unsafe { *b.add(at as usize) }
}

#[inline(always)]
fn f16_at(b: *const u8, at: u32) -> f32 {
    f16_to_f32(u16::from_le_bytes([byte(b, at), byte(b, at + 1)]))
}

/// Element `i` of a row of plain floats (f32, f16 or bf16); NaN for any other type.
#[inline(always)]
pub unsafe fn float_at(ty: u32, row: *const u8, i: u32) -> f32 {
    match ty {
        F32 => f32::from_le_bytes(core::array::from_fn(|k| byte(row, 4 * i + k as u32))),
        F16 => f16_at(row, 2 * i),
        // bf16 is the top half of an f32.
        BF16 => f32::from_bits(
            (u16::from_le_bytes([byte(row, 2 * i), byte(row, 2 * i + 1)]) as u32) << 16,
        ),
        _ => f32::NAN,
    }
}

/// q4_0 (`d` f16 at 0, `qs` at 2): `x[j] = (lo(qs[j]) - 8)·d`, `x[j + 16] = (hi(qs[j]) - 8)·d`.
#[inline(always)]
pub unsafe fn q4_0(b: *const u8, g: u32) -> [f32; 8] {
    let d = f16_at(b, 0);
    let (j0, shift) = (8 * (g % 2), 4 * (g / 2));
    core::array::from_fn(|k| {
        let q = byte(b, 2 + j0 + k as u32) >> shift & 15;
        (q as i32 - 8) as f32 * d
    })
}

/// q5_0 (`d` at 0, `qh` u32 at 2, `qs` at 6): as q4_0 with bit `i` of `qh` as bit 4 of element
/// `i`'s quant, offset 16. Elements `8g..8g + 8` take their high bits from byte `g` of `qh`.
#[inline(always)]
pub unsafe fn q5_0(b: *const u8, g: u32) -> [f32; 8] {
    let d = f16_at(b, 0);
    let (j0, shift, qh) = (8 * (g % 2), 4 * (g / 2), byte(b, 2 + g));
    core::array::from_fn(|k| {
        let q = byte(b, 6 + j0 + k as u32) >> shift & 15 | (qh >> k & 1) << 4;
        (q as i32 - 16) as f32 * d
    })
}

/// q8_0 (`d` at 0, `qs` i8 at 2): `x[j] = qs[j]·d`.
#[inline(always)]
pub unsafe fn q8_0(b: *const u8, g: u32) -> [f32; 8] {
    let d = f16_at(b, 0);
    core::array::from_fn(|k| (byte(b, 2 + 8 * g + k as u32) as i8) as f32 * d)
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 `scales` bytes at `s`
/// (the CPU's `scale_min_k4`).
#[inline(always)]
fn scale_min_k4(s: *const u8, j: u32) -> (u8, u8) {
    if j < 4 {
        (byte(s, j) & 63, byte(s, j + 4) & 63)
    } else {
        (
            byte(s, j + 4) & 15 | (byte(s, j - 4) >> 6) << 4,
            byte(s, j + 4) >> 4 | (byte(s, j) >> 6) << 4,
        )
    }
}

/// q4_K and q5_K: sub-block `sub = g / 4` of 32 reads the low (even `sub`) or high (odd)
/// nibbles of `qs[32·(sub / 2) + l]`; `x = (d·sc)·q - dmin·m`. `qh` is q5_K's fifth bits or null.
#[inline(always)]
fn k4(b: *const u8, qh: *const u8, qs: *const u8, g: u32) -> [f32; 8] {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sub, l0) = (g / 4, 8 * (g % 4));
    let (sc, m) = scale_min_k4(unsafe { b.add(4) }, sub);
    let (scale, min) = (d * sc as f32, dmin * m as f32);
    let (at, shift) = (32 * (sub / 2) + l0, 4 * (sub % 2));
    core::array::from_fn(|k| {
        let k = k as u32;
        let mut q = byte(qs, at + k) >> shift & 15;
        if !qh.is_null() {
            q |= (byte(qh, l0 + k) >> sub & 1) << 4;
        }
        scale * q as f32 - min
    })
}

/// q4_K (`d` at 0, `dmin` at 2, `scales` at 4, `qs` at 16).
#[inline(always)]
pub unsafe fn q4_k(b: *const u8, g: u32) -> [f32; 8] {
    k4(b, core::ptr::null(), unsafe { b.add(16) }, g)
}

/// q5_K (`d` at 0, `dmin` at 2, `scales` at 4, `qh` at 16, `qs` at 48): bit `sub` of `qh[l]` is
/// bit 4 of element `l` of sub-block `sub`.
#[inline(always)]
pub unsafe fn q5_k(b: *const u8, g: u32) -> [f32; 8] {
    unsafe { k4(b, b.add(16), b.add(48), g) }
}

/// q6_K (`ql` at 0, `qh` at 128, `scales` i8 at 192, `d` at 208): element `128h + 32k + l`
/// takes the low (k < 2) or high nibble of `ql[64h + l + 32·(k & 1)]` and bits `2k..2k + 2` of
/// `qh[32h + l]`; `x = (d·scales[i / 16])·(q - 32)`.
#[inline(always)]
pub unsafe fn q6_k(b: *const u8, g: u32) -> [f32; 8] {
    let d = f16_at(b, 208);
    let (h, k, l0) = (g / 16, g % 16 / 4, 8 * (g % 4));
    let scale = d * (byte(b, 192 + g / 2) as i8) as f32;
    let (ql, qh) = (64 * h + 32 * (k & 1) + l0, 128 + 32 * h + l0);
    core::array::from_fn(|j| {
        let j = j as u32;
        let lo = byte(b, ql + j) >> (4 * (k >> 1)) & 15;
        let q = (lo | (byte(b, qh + j) >> (2 * k) & 3) << 4) as i32 - 32;
        scale * q as f32
    })
}

/// Elements `e..e + 8` (`e` a multiple of 8) of a row of quantized type `ty`; NaN for a type
/// that is not quantized.
#[inline(always)]
pub unsafe fn quant8_at(ty: u32, row: *const u8, e: u32) -> [f32; 8] {
    let (elems, bytes) = block_shape(ty);
    let b = unsafe { row.add((e / elems * bytes) as usize) };
    let g = e % elems / 8;
    unsafe {
        match ty {
            Q4_0 => q4_0(b, g),
            Q5_0 => q5_0(b, g),
            Q8_0 => q8_0(b, g),
            Q4_K => q4_k(b, g),
            Q5_K => q5_k(b, g),
            Q6_K => q6_k(b, g),
            _ => [f32::NAN; 8],
        }
    }
}

/// `out[t, :] = ` row `tokens[t]` of the `[n_rows, hidden]` table of type `ty` (its raw file
/// bytes), dequantized. A token id `>= n_rows` gives a row of NaN. `hidden` must be a whole
/// number of blocks (checked by the host). Grid: one block per token; block: any size;
/// no shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn embed(
    out: *mut f32,
    table: *const u8,
    ty: u32,
    tokens: *const u32,
    n_rows: u32,
    hidden: u32,
) {
    let token = unsafe { *tokens.add(block() as usize) };
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
