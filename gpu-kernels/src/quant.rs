//! Quantized weight matrices in the GPU layout of `orcd::pack` ("packed": the file's bits,
//! rearranged at load into 16-byte-aligned sections), decoded in registers, the
//! token-embedding row gather and the conversion of a matrix to f16. CPU twin:
//! `orcd::pack::dequantize_packed`, which equals `orcd::quant::dequantize` of the file's
//! blocks bit for bit.
//!
//! A chunk is 32 consecutive weights of a row. Lane loads: 16 bytes of low nibbles, 0-16 bytes
//! of high bits, a u16 of scales and (k-quants) a u32 of the super-block's scales. Quants
//! become floats by the exact `MAGIC` subtraction (an OR and a subtraction, where an
//! integer-to-float `cvt` runs at a quarter of the rate). `load8` gives weights exactly as the
//! CPU computes them (same operations, same order; rustc sets no fast-math flags, so nothing is
//! contracted into an FMA); the GEMV's `dot` factors the scales out of each half-chunk's sum.
//!
//! Where a GEMV holds its vector as digits ([`digits4`]: FFN gate/up and down, greedy's first
//! pass), `dot_digits` multiplies the quant bytes by them with `dp4a`, exactly in integers: 16
//! instructions a chunk-row where `dot` takes 32 `prmt` and 32 FMAs.
use core::marker::PhantomData;

use crate::matmul::{Align16, Held, Weights, with_weights};
use crate::params::{DequantizeF16, Embed, HighBytes};
use crate::util::{
    allow_next_grid, block, block_dim, f16_to_f32, f16x2, fma, grid_dim, load_streaming, thread,
    wait_prior_grids,
};

/// ggml type ids, as the kernels' `ty` parameters take them (`kernel_abi::ggml`).
pub use kernel_abi::ggml as id;

/// 2^23: `f32::from_bits(MAGIC_BITS | n)` is `MAGIC + n` for `n < 2^23`, so subtracting
/// `MAGIC + z` gives `n - z` exactly.
const MAGIC: f32 = 8_388_608.0;
const MAGIC_BITS: u32 = 0x4b00_0000;

/// `prmt.b32`: byte `i` of the result is byte `sel`'s nibble `i` of the pair (`b`, `a`): bytes
/// 0-3 are `a`'s, 4-7 `b`'s.
#[inline(always)]
pub(crate) fn prmt(a: u32, b: u32, sel: u32) -> u32 {
    let r: u32;
    unsafe {
        core::arch::asm!("prmt.b32 {0}, {1}, {2}, {3};", out(reg32) r, in(reg32) a, in(reg32) b,
            in(reg32) sel, options(pure, nomem, nostack))
    };
    r
}

/// `dp4a.u32.s32`: `c` plus the sum of the products of `a`'s bytes (unsigned) and `b`'s
/// (signed), exactly.
#[inline(always)]
pub(crate) fn dp4a(a: u32, b: u32, c: i32) -> i32 {
    let r: i32;
    unsafe {
        core::arch::asm!("dp4a.u32.s32 {0}, {1}, {2}, {3};", out(reg32) r, in(reg32) a,
            in(reg32) b, in(reg32) c, options(pure, nomem, nostack))
    };
    r
}

/// A vector's chunk of 32 elements as two int8 digits an element, `x ≈ unit·(256h + l)`: with
/// `e` the biased exponent of the chunk's largest magnitude (at least 14), `t = x·2^(132 - e)`
/// is below 64 in magnitude, `h` is `t` rounded to nearest (even) and `l` is `256·(t - h)` so
/// rounded and cut to 127, and `unit = 2^(e - 140)`. So each element is within `unit` of
/// `unit·(256h + l)` (`unit/2` unless `l` was cut), at most 2^-13 of the chunk's largest; an
/// infinity or NaN in the chunk (`e` 255) makes `unit` NaN. Twin: `orcd::cpu::digits`.
///
/// `(2^(132 - e), unit)` for the chunk whose largest magnitude has the bits `top` ([`top_bits`]).
#[inline(always)]
pub(crate) fn digit_scale(top: u32) -> (f32, f32) {
    let e = (top >> 23).max(14);
    let unit = if e == 255 {
        f32::NAN
    } else {
        f32::from_bits((e - 13) << 23)
    };
    (f32::from_bits((259 - e) << 23), unit)
}

/// The bits of the largest magnitude of `v` (sign clear), [`digit_scale`]'s `top`: an integer
/// maximum, so that a NaN counts.
#[inline(always)]
pub(crate) fn top_bits<const N: usize>(v: &[f32; N]) -> u32 {
    v.iter().fold(0, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// 1.5·2^23: adding it rounds a float under 2^22 in magnitude to an integer (nearest, even on
/// ties), which the sum's low bits hold in two's complement.
const ROUND: f32 = 12_582_912.0;

/// The digits of four elements `v` of a chunk (`t = v·p2`, `p2` from [`digit_scale`]): the word
/// of their `h` bytes and the word of their `l` bytes.
#[inline(always)]
pub(crate) fn digits4(v: [f32; 4], p2: f32) -> (u32, u32) {
    let (mut h, mut l) = (0u32, 0u32);
    // Indexed: an iterator over `v` puts it in local memory.
    for k in 0..4 {
        let t = v[k] * p2;
        let th = t + ROUND;
        // `t - h` is exact, and so is its product by 256.
        let tl = fma(t - (th - ROUND), 256.0, ROUND).min(ROUND + 127.0);
        // The low bytes of the sums (shifts and ORs: `prmt`s here cost the first pass 33
        // registers).
        h |= (th.to_bits() & 0xff) << (8 * k);
        l |= (tl.to_bits() & 0xff) << (8 * k);
    }
    (h, l)
}

/// `Σ(256h + l)` of the four elements of [`digits4`]' words `h` and `l`, exactly.
#[inline(always)]
pub(crate) fn digit_sum(h: u32, l: u32) -> i32 {
    const ONES: u32 = 0x0101_0101;
    256 * dp4a(ONES, h, 0) + dp4a(ONES, l, 0)
}

/// `MAGIC +` byte `k` of `w`: one `prmt` puts the byte under `MAGIC`'s exponent.
#[inline(always)]
fn magic_byte(w: u32, k: u32) -> f32 {
    f32::from_bits(prmt(w, MAGIC_BITS, 0x7440 | k))
}

/// What [`Packed`]'s `dot` holds `x` times (`X_SCALE`) and multiplies its sums by: 2^100 and
/// 2^49, so that `q·2^-149 · x·2^100 · 2^49 = q·x`.
const X_SCALE: f32 = 1.2676506e30;
const Q_SCALE: f32 = 562949953421312.0;

/// How a quantized type packs (`orcd::pack`): weights are `s·(q - ZERO) - m` for the
/// `4 + BITS`-bit quant `q`, `s` the scale of the element's half of the chunk.
pub trait Packing {
    /// Quant bits above the low 4 (0, 1, 2 or 4), in the `hi` section.
    const BITS: u32;
    const ZERO: u32;
    /// Whether chunks take scales from a super-block word (the k-quants).
    const SUPER: bool;
    /// Whether weights have a min `m`.
    const MIN: bool;
    /// (scale of elements 0..16, of 16..32, min) from the chunk's `sc` and `sup` words.
    fn scales(sc: u32, sup: u32) -> (f32, f32, f32);
    /// The weight from `q - ZERO` as the CPU computes it.
    fn weight(q: f32, s: f32, m: f32) -> f32;
}

/// `(q - z)·d` with the f16 `d` in `sc`: q4_0 (z 8), q5_0 (16), q8_0 (i8 stored + 128).
macro_rules! plain_block {
    ($name:ident, $bits:expr, $zero:expr) => {
        pub enum $name {}
        impl Packing for $name {
            const BITS: u32 = $bits;
            const ZERO: u32 = $zero;
            const SUPER: bool = false;
            const MIN: bool = false;
            #[inline(always)]
            fn scales(sc: u32, _sup: u32) -> (f32, f32, f32) {
                let d = f16_to_f32(sc as u16);
                (d, d, 0.0)
            }
            #[inline(always)]
            fn weight(q: f32, s: f32, _m: f32) -> f32 {
                q * s
            }
        }
    };
}

plain_block!(Q4_0, 0, 8);
plain_block!(Q5_0, 1, 16);
plain_block!(Q8_0, 4, 128);

/// `(d·sc)·q - dmin·m`: `sc`, `m` the sub-block's 6-bit scale and min, `d | dmin << 16` the
/// super-block's; q4_K and (`BITS` 1) q5_K.
pub enum Q4K {}
pub enum Q5K {}

macro_rules! k4_block {
    ($name:ident, $bits:expr) => {
        impl Packing for $name {
            const BITS: u32 = $bits;
            const ZERO: u32 = 0;
            const SUPER: bool = true;
            const MIN: bool = true;
            #[inline(always)]
            fn scales(sc: u32, sup: u32) -> (f32, f32, f32) {
                let s = f16_to_f32(sup as u16) * (sc & 255) as f32;
                (
                    s,
                    s,
                    f16_to_f32((sup >> 16) as u16) * (sc >> 8 & 255) as f32,
                )
            }
            #[inline(always)]
            fn weight(q: f32, s: f32, m: f32) -> f32 {
                s * q - m
            }
        }
    };
}

k4_block!(Q4K, 0);
k4_block!(Q5K, 1);

/// q6_K: `(d·sc)·(q - 32)`, an i8 `sc` per half-chunk, `d` the super-block's.
pub enum Q6K {}

impl Packing for Q6K {
    const BITS: u32 = 2;
    const ZERO: u32 = 32;
    const SUPER: bool = true;
    const MIN: bool = false;
    #[inline(always)]
    fn scales(sc: u32, sup: u32) -> (f32, f32, f32) {
        let d = f16_to_f32(sup as u16);
        (
            d * (sc as u8 as i8) as f32,
            d * ((sc >> 8) as u8 as i8) as f32,
            0.0,
        )
    }
    #[inline(always)]
    fn weight(q: f32, s: f32, _m: f32) -> f32 {
        s * q
    }
}

/// One chunk as loaded: `lo` words, `hi` words (the first `BITS` used), `sc` and `sup`.
#[derive(Clone, Copy)]
pub struct Chunk {
    lo: [u32; 4],
    hi: [u32; 4],
    sc: u32,
    sup: u32,
}

#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct U32x4([u32; 4]);

/// A `[rows, n_in]` matrix of packing `P` at `w` (16-byte aligned): its sections' addresses as
/// `orcd::pack::layout` places them.
pub struct Packed<P> {
    lo: *const u8,
    hi: *const u8,
    sc: *const u16,
    sup: *const u32,
    /// Chunks per row.
    chunks: u32,
    packing: PhantomData<P>,
}

#[inline(always)]
fn align16(n: usize) -> usize {
    n.next_multiple_of(16)
}

impl<P: Packing> Packed<P> {
    /// Chunk `c` of the matrix (rows one after another), read once (`load_streaming`): the
    /// GEMV's.
    #[inline(always)]
    unsafe fn chunk(&self, c: usize) -> Chunk {
        let lo = unsafe { load_streaming(self.lo.add(16 * c) as *const U32x4) }.0;
        let mut hi = [0u32; 4];
        unsafe {
            match P::BITS {
                0 => {}
                1 => hi[0] = load_streaming(self.hi.add(4 * c) as *const u32),
                2 => {
                    let v = load_streaming(self.hi.add(8 * c) as *const u64);
                    hi[..2].copy_from_slice(&[v as u32, (v >> 32) as u32]);
                }
                _ => hi = load_streaming(self.hi.add(16 * c) as *const U32x4).0,
            }
        }
        let sc = unsafe { load_streaming(self.sc.add(c)) } as u32;
        let sup = if P::SUPER {
            // Shared by the super-block's 8 chunks: an ordinary load.
            unsafe { *self.sup.add(c / 8) }
        } else {
            0
        };
        Chunk { lo, hi, sc, sup }
    }

    /// The quants of the elements of `lo` word `j` (`lo`), a byte each: elements `4j..4j + 4`
    /// and `16 + 4j..16 + 4j + 4`, their high bits from `hi`, the chunk's hi word `j·BITS / 4`.
    #[inline(always)]
    fn quant_bytes(lo: u32, hi: u32, j: u32) -> (u32, u32) {
        let (mut a, mut b) = (lo & 0x0f0f_0f0f, lo >> 4 & 0x0f0f_0f0f);
        if P::BITS > 0 {
            let s = 2 * P::BITS * j % 8;
            let mask = ((1 << P::BITS) - 1) * 0x0101_0101;
            a |= (hi >> s & mask) << 4;
            b |= (hi >> (s + P::BITS) & mask) << 4;
        }
        (a, b)
    }

    /// `q - ZERO` of those elements, exactly, as floats.
    #[inline(always)]
    fn quants(lo: u32, hi: u32, j: u32) -> ([f32; 4], [f32; 4]) {
        let (a, b) = Self::quant_bytes(lo, hi, j);
        let f = |w: u32, k: u32| magic_byte(w, k) - (MAGIC + P::ZERO as f32);
        (
            [f(a, 0), f(a, 1), f(a, 2), f(a, 3)],
            [f(b, 0), f(b, 1), f(b, 2), f(b, 3)],
        )
    }
}

impl<P: Packing> Weights for Packed<P> {
    type Chunk = Chunk;
    const X_SCALE: f32 = X_SCALE;
    const DIGITS: bool = true;

    #[inline(always)]
    fn new(w: *const u8, rows: u32, n_in: u32) -> Self {
        let chunks = n_in / 32;
        let all = rows as usize * chunks as usize;
        let hi = align16(16 * all);
        let sc = hi + align16(4 * P::BITS as usize * all);
        let sup = sc + align16(2 * all);
        Packed {
            lo: w,
            hi: w.wrapping_add(hi),
            sc: w.wrapping_add(sc) as *const u16,
            sup: w.wrapping_add(sup) as *const u32,
            chunks,
            packing: PhantomData,
        }
    }

    #[inline(always)]
    fn vector(&self) -> bool {
        true
    }

    /// The chunk's `sc` and `sup` words and the `lo` and `hi` words that hold the 8 weights.
    type Raw8 = (u32, u32, u64, u64);

    #[inline(always)]
    unsafe fn raw8<const VEC: bool>(&self, row: usize, k: u32) -> Self::Raw8 {
        // Elements 8g..8g + 8: the low (g < 2) or high nibbles of lo words 2h, 2h + 1
        // (h = g % 2), read on their own: picking them out of a whole chunk by a dynamic index
        // would put the chunk in local memory.
        let c = row * self.chunks as usize + (k / 32) as usize;
        let (g, sc) = (k % 32 / 8, unsafe { *self.sc.add(c) } as u32);
        let h = (g % 2) as usize;
        let sup = if P::SUPER {
            unsafe { *self.sup.add(c / 8) }
        } else {
            0
        };
        let lo = unsafe { *(self.lo.add(16 * c + 8 * h) as *const u64) };
        let hi = unsafe {
            match P::BITS {
                0 => 0,
                1 => *(self.hi.add(4 * c) as *const u32) as u64 * 0x1_0000_0001,
                2 => *(self.hi.add(8 * c + 4 * h) as *const u32) as u64 * 0x1_0000_0001,
                _ => *(self.hi.add(16 * c + 8 * h) as *const u64),
            }
        };
        (sc, sup, lo, hi)
    }

    #[inline(always)]
    fn decode8((sc, sup, lo, hi): Self::Raw8, k: u32) -> [f32; 8] {
        let g = k % 32 / 8;
        let j = 2 * (g % 2);
        let (a0, b0) = Self::quants(lo as u32, hi as u32, j);
        let (a1, b1) = Self::quants((lo >> 32) as u32, (hi >> 32) as u32, j + 1);
        let (s0, s1, m) = P::scales(sc, sup);
        let (q0, q1, s) = if g >= 2 { (b0, b1, s1) } else { (a0, a1, s0) };
        let w = |i: usize| P::weight(if i < 4 { q0[i] } else { q1[i - 4] }, s, m);
        [w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7)]
    }

    #[inline(always)]
    unsafe fn load1(&self, _row: usize, _k: usize) -> f32 {
        f32::NAN
    }

    #[inline(always)]
    unsafe fn load_chunk<const VEC: bool>(&self, row: usize, c: u32) -> Chunk {
        unsafe { self.chunk(row * self.chunks as usize + c as usize) }
    }

    /// `s0·Σ(q - z)·x` over the first half, `s1·` that of the second, `- m·Σx`. Each quant
    /// becomes a float by one `prmt` and no arithmetic: the word whose low byte is `q` is the
    /// subnormal `q·2^-149` exactly, and `x` is held times `X_SCALE = 2^100`, so the FMA adds
    /// `q·x·2^-49` exactly rounded (no denormal is flushed: no `.ftz`); `z·Σx` comes off
    /// after the sum. Exact while `2^-77 < |x| < 2^28` (products stay normal, `x·2^100`
    /// finite); the cancellation in `Σq·x - z·Σx` costs at most a few bits of `Σ|(q - z)·x|`.
    #[inline(always)]
    fn dot(ch: &Chunk, x: &Held) -> f32 {
        let (mut lo, mut hi) = ([0.0f32; 2], [0.0f32; 2]);
        for j in 0..4 {
            let (a, b) = Self::quant_bytes(ch.lo[j], ch.hi[j * P::BITS as usize / 4], j as u32);
            for k in 0..4 {
                let q = |w: u32| f32::from_bits(prmt(w, 0, 0x4440 | k as u32));
                lo[j % 2] = fma(q(a), x.x[4 * j + k], lo[j % 2]);
                hi[j % 2] = fma(q(b), x.x[16 + 4 * j + k], hi[j % 2]);
            }
        }
        let z = P::ZERO as f32;
        let half = |acc: [f32; 2], sum: f32| (acc[0] + acc[1]) * Q_SCALE - z * sum;
        let (a, b) = (half(lo, x.sum[0]), half(hi, x.sum[1]));
        let (s0, s1, m) = P::scales(ch.sc, ch.sup);
        let d = s0 * a + s1 * b;
        if P::MIN {
            d - m * (x.sum[0] + x.sum[1])
        } else {
            d
        }
    }

    /// `dot` on digits: `Σ(q - z)·(256h + l)` of each half from 4 `dp4a`s, exact in i32 (at
    /// most 16·255·16,512 plus `z·Σ`), then times `unit` and the half's scale.
    #[inline(always)]
    fn dot_digits(ch: &Chunk, x: &Held) -> f32 {
        let acc = x
            .digit_dots(|j| Self::quant_bytes(ch.lo[j], ch.hi[j * P::BITS as usize / 4], j as u32));
        let ([s0x, s1x], unit) = (x.digit_sums(), x.unit());
        let z = P::ZERO as i32;
        let half = |h: i32, l: i32, sum: i32| (256 * h + l - z * sum) as f32 * unit;
        let (a, b) = (half(acc[0], acc[1], s0x), half(acc[2], acc[3], s1x));
        let (s0, s1, m) = P::scales(ch.sc, ch.sup);
        let d = s0 * a + s1 * b;
        if P::MIN {
            d - m * ((s0x + s1x) as f32 * unit)
        } else {
            d
        }
    }
}

/// The high nibbles `u >> 4` of the quants `u = q + 128` of a q8_0 chunk (its packed `hi`
/// section) and its scale: 18 of the chunk's 34 bytes, what the greedy arg-max's bounds read
/// ([`Packed::bound`]).
#[derive(Clone, Copy)]
pub struct TopChunk {
    hi: [u32; 4],
    sc: u32,
}

/// What [`Packed::bound`] puts in place of the low nibble `u & 15` of each quant: the middle of
/// its range 0..=15, off by at most as much, so each weight by at most `RADIUS·|d|`.
pub const RADIUS: f32 = 7.5;

impl Packed<Q8_0> {
    /// The high nibbles and scale of chunk `c` of `row`, read once (`load_streaming`).
    #[inline(always)]
    pub unsafe fn top_chunk(&self, row: usize, c: u32) -> TopChunk {
        let c = row * self.chunks as usize + c as usize;
        unsafe {
            TopChunk {
                hi: load_streaming(self.hi.add(16 * c) as *const U32x4).0,
                sc: load_streaming(self.sc.add(c)) as u32,
            }
        }
    }

    /// The chunk's dot product with `x` (held as digits, `Held::digits`) from its high nibbles
    /// `t = u >> 4`: `(e, m)` with the exact `Σ d·(u - 128)·x` within `e ± RADIUS·m`, `m =
    /// |d|·x_abs` (`x_abs`: the lane's `Σ|x|` plus [`DIGIT_RADIUS`] times its digits' unit).
    /// `e = d·Σ(16t + RADIUS - 128)·x` over the digits, from 4 `dp4a`s a half in integers
    /// (`32·Σt·(256h + l) - 241·Σ(256h + l)`: at most 32·15·32·16,512 plus 241·32·16,512).
    #[inline(always)]
    pub fn bound(ch: &TopChunk, x: &Held, x_abs: f32) -> (f32, f32) {
        // Byte `k` of `hi` word `j`: element `4j + k`'s nibble low, `16 + 4j + k`'s high.
        let acc = x.digit_dots(|j| (ch.hi[j] & 0x0f0f_0f0f, ch.hi[j] >> 4 & 0x0f0f_0f0f));
        let n = 256 * (acc[0] + acc[2]) + (acc[1] + acc[3]);
        let [s0, s1] = x.digit_sums();
        // `16·Σt·x - (ZERO - RADIUS)·Σx`, twice over so that 2·(ZERO - RADIUS) = 241 is whole.
        const TWICE_OFF: i32 = (2.0 * (Q8_0::ZERO as f32 - RADIUS)) as i32;
        let e = (32 * n - TWICE_OFF * (s0 + s1)) as f32 * (0.5 * x.unit());
        let d = f16_to_f32(ch.sc as u16);
        (d * e, d.abs() * x_abs)
    }
}

/// What [`Packed::bound`]'s `x_abs` adds per unit of the lane's digits: each element within a
/// unit of its digits moves `Σ(16t + RADIUS - 128)·x` by at most 120.5 units, 32·120.5 in all,
/// which `RADIUS` times this covers.
pub const DIGIT_RADIUS: f32 = 515.0;

/// `out[i]` = the high byte of the f16 `w[i]` (sign, exponent, top 2 mantissa bits), for `i <
/// n`: the plane greedy decoding's first pass reads of an f16 vocabulary projection
/// (`decode::F16Sketch`). Grid: any (blocks stride over the elements); block: any size.
/// Twin: `w >> 8` (`orcd::cpu::logit_bounds_f16` takes the high bytes so).
#[inline(always)]
pub(crate) unsafe fn high_bytes(p: HighBytes) {
    let HighBytes { out, w, n } = p;
    let stride = grid_dim() * block_dim();
    let mut i = block() * block_dim() + thread();
    while i < n {
        unsafe { *out.add(i as usize) = (*w.add(i as usize) >> 8) as u8 };
        i += stride;
    }
}

/// `out[t, :] = ` row `tokens[first + t]` of the `[n_rows, hidden]` table of type `ty` (packed,
/// as every weight matrix), dequantized, where `first` is `pos[0]`, or 0 when `pos` is null: a
/// decode step reads its token at the position in device memory, so a captured CUDA graph
/// replays for any position. A token id `>= n_rows` gives a row of NaN; an index
/// `first + t >= n_ids` (past `tokens`) traps. `table` 16-byte aligned (checked by the host).
/// It may overlap the kernel before it, which may write `pos` and `tokens` (a decode step's
/// last): nothing is read before the wait. Grid: one block per token; block: any size; no
/// shared memory.
#[inline(always)]
pub(crate) unsafe fn embed(p: Embed) {
    let Embed {
        out,
        table,
        ty,
        tokens,
        pos,
        n_ids,
        n_rows,
        hidden,
    } = p;
    wait_prior_grids();
    allow_next_grid();
    let first = if pos.is_null() { 0 } else { unsafe { *pos } };
    let at = first as u64 + block() as u64;
    if at >= n_ids as u64 {
        unsafe { core::arch::nvptx::trap() };
    }
    let token = unsafe { *tokens.add(at as usize) };
    let out = unsafe { out.add(block() as usize * hidden as usize) };
    let (row, valid) = (token as usize, token < n_rows);
    with_weights!(crate::matmul::family::ANY, ty, W => {
        let w = W::new(table, n_rows, hidden);
        let mut e = 8 * thread();
        while e < hidden {
            let v: [f32; 8] = if !valid {
                [f32::NAN; 8]
            } else if e + 8 <= hidden {
                unsafe { w.load8::<false>(row, e) }
            } else {
                core::array::from_fn(|k| {
                    let k = e as usize + k;
                    if k < hidden as usize { unsafe { w.load1(row, k) } } else { 0.0 }
                })
            };
            for (k, v) in v.iter().enumerate() {
                if e + (k as u32) < hidden {
                    unsafe { *out.add(e as usize + k) = *v };
                }
            }
            e += 8 * block_dim();
        }
    })
}

/// `out = f16(w)`: the `[rows, n_in]` matrix `w` of type `ty` (packed, as every weight matrix)
/// dequantized and rounded to nearest f16, row-major: the `--weights f16` path's conversion at
/// load, done where the weights already are. `n_in` a multiple of 8 (quantized rows are
/// whole blocks of 32 or 256), `out` 16-byte aligned (checked by the host). Grid: any (blocks
/// stride over the groups of 8 weights); block: any size; no shared memory.
/// Twin: `orcd::quant::dequantize_f16` (the same weights, `load8`'s, and the same rounding).
#[inline(always)]
pub(crate) unsafe fn dequantize_f16(p: DequantizeF16) {
    let DequantizeF16 {
        out,
        w,
        ty,
        rows,
        n_in,
    } = p;
    let per_row = (n_in / 8) as usize;
    let stride = grid_dim() as usize * block_dim() as usize;
    with_weights!(crate::matmul::family::ANY, ty, W => {
        let w = W::new(w, rows, n_in);
        let mut i = (block() * block_dim() + thread()) as usize;
        while i < rows as usize * per_row {
            let (r, k) = (i / per_row, 8 * (i % per_row) as u32);
            let v = unsafe { w.load8::<false>(r, k) };
            let h = [0, 2, 4, 6].map(|j| f16x2(v[j], v[j + 1]));
            unsafe { *(out.add(4 * i) as *mut Align16<[u32; 4]>) = Align16(h) };
            i += stride;
        }
    })
}
