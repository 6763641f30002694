//! Products `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` with the weights `w` `[n_out, n_in]`
//! row-major, plain floats or packed quantized chunks (`quant::Packed`), dequantized in
//! registers; f32 accumulation by FMA. One token: `gemv_<type>`; several: `gemm_<type>`, on
//! tensor cores with the f32 operands split into f16 halves (see `gemm_mma`), for the types
//! f32, f16, bf16, q4_0, q5_0, q8_0, q4_k, q5_k and q6_k. CPU twin: `orcd::cpu::matmul` on the
//! dequantized weights.
//!
//! The GEMV and GEMM are written once, generic over [`Weights`] (one implementation per
//! format: plain floats, or `quant::Packed` per quantized type); the entry points only pick
//! the format. The GEMV's body, [`gemv_units`], also serves the fused decode kernels.
use core::arch::asm;

use kernel_abi::gemm::{
    F32_STRIDE, GROUP, MAX_TEAMS, STEP_BYTES, TEAM_SLOTS, TILE_BYTES, TILE_K, TILE_M, TILE_N,
};
use kernel_abi::gemv::{self, STAGED};

use crate::params::{Gemm, Gemv};
use crate::quant::{
    Packed, Q4_0, Q4K, Q5_0, Q5K, Q6K, Q8_0, digit_scale, digit_sum, digits4, dp4a, id, top_bits,
};
use crate::util::{
    F32x4, LO_SCALE, WARP, aligned, allow_next_grid, block, block_dim, fma, grid_dim,
    lanes_max_u32, ldmatrix4, mma, shared, shared_addr, split, store_shared2, store_shared4,
    sync_threads, thread, wait_prior_grids, warp_sum, warp_sum4,
};

/// `T` 16-byte aligned: a vector load of 8 plain floats (16 bytes of f16, 32 of f32), or a
/// vector store.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub(crate) struct Align16<T>(pub(crate) T);

/// `bias[i]`, or 0 for a null bias.
#[inline(always)]
fn bias_at(bias: *const f32, i: usize) -> f32 {
    if bias.is_null() {
        0.0
    } else {
        unsafe { *bias.add(i) }
    }
}

/// A weight matrix `[n_out, n_in]` in one storage format.
pub(crate) trait Weights {
    /// Whether every weight is an f16 value, so that the tensor-core GEMM's split of it has no
    /// low part (see [`gemm_mma`]).
    const F16: bool = false;
    /// A GEMV chunk (32 weights of a row) as loaded, before it is decoded.
    type Chunk: Copy;
    /// The factor of the vector's elements that [`Held`] keeps for `dot`.
    const X_SCALE: f32 = 1.0;
    /// Whether a GEMV that asks for its vector as digits ([`stage`]'s `DIGITS`) gets them for
    /// this format, and takes `dot_digits`; the plain float formats keep floats.
    const DIGITS: bool = false;
    /// The `[n_out, n_in]` matrix at `w`.
    fn new(w: *const u8, n_out: u32, n_in: u32) -> Self;
    /// Whether every row starts 16-byte aligned and `n_in % 8 == 0`, so `load8::<true>` may
    /// use vector loads.
    fn vector(&self) -> bool;
    /// Weights `k..k + 8` of row `row` (`k % 8 == 0`, `k + 8 <= n_in`) in f32, exactly as
    /// `orcd::quant::dequantize` gives them. `VEC`: `vector()` holds.
    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, row: usize, k: u32) -> [f32; 8] {
        Self::decode8(unsafe { self.raw8::<VEC>(row, k) }, k)
    }
    /// What `load8` reads, before it is decoded: a load that stays in flight until
    /// [`decode8`](Weights::decode8) needs it.
    type Raw8: Copy;
    unsafe fn raw8<const VEC: bool>(&self, row: usize, k: u32) -> Self::Raw8;
    /// `load8`'s weights from what `raw8` read for the same `k`.
    fn decode8(raw: Self::Raw8, k: u32) -> [f32; 8];
    /// Weight `k` of row `row`, for the tail of a row that is not whole groups of 8; rows of
    /// quantized weights never have one (they are whole blocks of 32 or 256).
    unsafe fn load1(&self, row: usize, k: usize) -> f32;
    /// Chunk `c` of row `row`: its 4 groups of 8 weights, group `g` from weight
    /// [`group_at`](Weights::group_at)`(c, g, n_in / 32)`. `VEC`: `vector()` holds and
    /// `n_in % 32 == 0`; else the chunk is weights `32c..32c + 32`, zeros past `n_in`.
    unsafe fn load_chunk<const VEC: bool>(&self, row: usize, c: u32) -> Self::Chunk;
    /// The chunk's weights times the same 32 elements of the vector.
    fn dot(chunk: &Self::Chunk, x: &Held) -> f32;
    /// `dot` where the GEMV asked for digits: on them where `DIGITS`, else on the floats
    /// [`stage`] kept.
    #[inline(always)]
    fn dot_digits(chunk: &Self::Chunk, x: &Held) -> f32 {
        Self::dot(chunk, x)
    }
    /// The first of the 8 weights of group `g` of chunk `c`, in a row of `n_chunks` chunks
    /// (vector rows): by default `32c + 8g`, the chunk's own 32 weights, as a quantized
    /// block's scales require.
    #[inline(always)]
    fn group_at(c: u32, g: u32, _n_chunks: u32) -> u32 {
        32 * c + 8 * g
    }
}

/// A plain float format.
pub(crate) trait Float: Copy {
    /// Whether this is f16 (see [`Weights::F16`]).
    const F16: bool = false;
    const ZERO: Self;
    fn to_f32(self) -> f32;
}

impl Float for f32 {
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Float for f16 {
    const F16: bool = true;
    const ZERO: f16 = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// bf16: the top half of an f32.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Bf16(u16);

impl Float for Bf16 {
    const ZERO: Bf16 = Bf16(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Rows of `n_in` plain floats (any row length, `T`-aligned).
pub(crate) struct Plain<T> {
    w: *const T,
    n_in: usize,
}

impl<T: Float> Weights for Plain<T> {
    const F16: bool = T::F16;
    type Chunk = [Align16<[T; 8]>; 4];

    #[inline(always)]
    fn new(w: *const u8, _n_out: u32, n_in: u32) -> Self {
        Plain {
            w: w as *const T,
            n_in: n_in as usize,
        }
    }

    #[inline(always)]
    fn vector(&self) -> bool {
        self.n_in.is_multiple_of(8) && aligned(self.w, 16)
    }

    type Raw8 = [T; 8];

    #[inline(always)]
    unsafe fn raw8<const VEC: bool>(&self, row: usize, k: u32) -> [T; 8] {
        let p = unsafe { self.w.add(row * self.n_in + k as usize) };
        if VEC {
            unsafe { *(p as *const Align16<[T; 8]>) }.0
        } else {
            core::array::from_fn(|j| unsafe { *p.add(j) })
        }
    }

    #[inline(always)]
    fn decode8(raw: [T; 8], _k: u32) -> [f32; 8] {
        raw.map(T::to_f32)
    }

    #[inline(always)]
    unsafe fn load1(&self, row: usize, k: usize) -> f32 {
        unsafe { *self.w.add(row * self.n_in + k) }.to_f32()
    }

    #[inline(always)]
    unsafe fn load_chunk<const VEC: bool>(&self, row: usize, c: u32) -> Self::Chunk {
        let (w, n_chunks) = (
            unsafe { self.w.add(row * self.n_in) },
            self.n_in as u32 / 32,
        );
        core::array::from_fn(|g| {
            if VEC {
                let k = Self::group_at(c, g as u32, n_chunks) as usize;
                unsafe { *(w.add(k) as *const Align16<[T; 8]>) }
            } else {
                Align16(core::array::from_fn(|j| {
                    let k = 32 * c as usize + 8 * g + j;
                    if k < self.n_in {
                        unsafe { *w.add(k) }
                    } else {
                        T::ZERO
                    }
                }))
            }
        })
    }

    #[inline(always)]
    fn dot(chunk: &Self::Chunk, x: &Held) -> f32 {
        let mut acc = [0.0f32; 4];
        for (g, w) in chunk.iter().enumerate() {
            for (j, w) in w.0.iter().enumerate() {
                acc[g] = fma(w.to_f32(), x.x[8 * g + j], acc[g]);
            }
        }
        (acc[0] + acc[1]) + (acc[2] + acc[3])
    }

    /// Group `g` of every chunk in one stretch, chunk by chunk: a warp's lanes, which take
    /// neighbouring chunks, then read neighbouring 8-weight groups, each load one coalesced
    /// run (with a whole chunk a lane, each 16-byte f16 load would stride 64 bytes from lane
    /// to lane).
    #[inline(always)]
    fn group_at(c: u32, g: u32, n_chunks: u32) -> u32 {
        8 * (g * n_chunks + c)
    }
}

/// The types one compiled kernel serves: a kernel has its hungriest type's registers and every
/// type's code, so decode kernels are built per family (`decode.rs`), the packed types in two.
/// One build per type is slower still: a model's FFN down then alternates between two kernels
/// from layer to layer.
pub mod family {
    // The families' ids, and the family of each type (`of`).
    pub use kernel_abi::family::*;

    /// Whether a kernel built for family `built` serves the types of family `own`.
    pub const fn serves(built: u32, own: u32) -> bool {
        built == ANY || built == own || (built == PACKED && (own == LEGACY || own == KQUANT))
    }
}

/// ggml type `ID` (`quant::id`), for what is built per type: `GgmlType<ID>: Format` for every
/// type a matrix may have.
pub(crate) struct GgmlType<const ID: u32>;

/// The [`Weights`] that a matrix of a ggml type is read as.
pub(crate) trait Format {
    type W: Weights;
}

macro_rules! formats {
    ($($id:ident $T:ty),*) => {
        $(impl Format for GgmlType<{ id::$id }> {
            type W = $T;
        })*
    };
}

formats!(
    F32 Plain<f32>, F16 Plain<f16>, BF16 Plain<Bf16>, Q4_0 Packed<Q4_0>, Q5_0 Packed<Q5_0>,
    Q8_0 Packed<Q8_0>, Q4_K Packed<Q4K>, Q5_K Packed<Q5K>, Q6_K Packed<Q6K>
);

/// `$body` with `$W` the [`Weights`] type of ggml type id `$ty`, among the types of kernel
/// family `$family` (a constant: the other types' code is never built); traps on any other id.
macro_rules! with_weights {
    ($family:expr, $ty:expr, $W:ident => $body:expr) => {
        with_weights!(@ $family, $ty, $W => $body;
            F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)
    };
    (@ $family:expr, $ty:expr, $W:ident => $body:expr; $($id:ident),*) => {{
        use crate::matmul::{Format, GgmlType, family};
        use crate::quant::id;
        let (ty, fam) = ($ty, $family);
        $(
            if family::serves(fam, const { family::of(id::$id) }) && ty == id::$id {
                type $W = <GgmlType<{ id::$id }> as Format>::W;
                $body
            } else
        )* {
            unsafe { core::arch::nvptx::trap() }
        }
    }};
}
pub(crate) use with_weights;

/// The 32 elements of the vector that a GEMV lane multiplies its chunk of every row by (times
/// the weights' `X_SCALE`), group `g` of 8 from element `W::group_at(c, g, ..)` as the chunk's
/// weights, loaded by the lane or read from the block's [`stage`]d copy, and the sums of its two
/// halves (what the packed formats' offsets multiply).
///
/// Or the chunk as digits (`quant::digits4`), in `x`'s words: 0..8 the `h` bytes of elements
/// `4w..4w + 4`, 8..16 their `l` bytes, 16 the unit, 17 and 18 the halves' `Σ(256h + l)` (i32).
pub(crate) struct Held {
    pub(crate) x: [f32; 32],
    pub(crate) sum: [f32; 2],
}

impl Held {
    /// Digits: the `h` bytes of elements `4w..4w + 4`.
    #[inline(always)]
    pub(crate) fn high(&self, w: usize) -> u32 {
        self.x[w].to_bits()
    }

    /// Digits: the `l` bytes of elements `4w..4w + 4`.
    #[inline(always)]
    pub(crate) fn low(&self, w: usize) -> u32 {
        self.x[8 + w].to_bits()
    }

    /// Digits: their unit.
    #[inline(always)]
    pub(crate) fn unit(&self) -> f32 {
        self.x[16]
    }

    /// Digits: `Σ(256h + l)` of each half.
    #[inline(always)]
    pub(crate) fn digit_sums(&self) -> [i32; 2] {
        [self.x[17].to_bits() as i32, self.x[18].to_bits() as i32]
    }

    /// Digits: the `dp4a` sums of a chunk's bytes, `bytes(j)` those of elements `4j..4j + 4`
    /// and `16 + 4j..16 + 4j + 4` (unsigned), with the digits: `[Σ·h, Σ·l]` of the first half,
    /// then of the second.
    #[inline(always)]
    pub(crate) fn digit_dots(&self, bytes: impl Fn(usize) -> (u32, u32)) -> [i32; 4] {
        let mut acc = [0i32; 4];
        for j in 0..4 {
            // Elements 4j..4j + 4 (`a`) and 16 + 4j.. (`b`): digit words j and 4 + j.
            let (a, b) = bytes(j);
            acc[0] = dp4a(a, self.high(j), acc[0]);
            acc[1] = dp4a(a, self.low(j), acc[1]);
            acc[2] = dp4a(b, self.high(4 + j), acc[2]);
            acc[3] = dp4a(b, self.low(4 + j), acc[3]);
        }
        acc
    }

    /// This lane's floats times `scale`, as digits (the scale from the 32 of them).
    #[inline(always)]
    pub(crate) fn digits(&self, scale: f32) -> Held {
        let v = self.x.map(|v| v * scale);
        let (p2, unit) = digit_scale(top_bits(&v));
        // Written out word by word: in a loop, LLVM keeps `x` in local memory.
        let word = |w: usize| digits4([v[4 * w], v[4 * w + 1], v[4 * w + 2], v[4 * w + 3]], p2);
        let ws = [
            word(0),
            word(1),
            word(2),
            word(3),
            word(4),
            word(5),
            word(6),
            word(7),
        ];
        let bits = |w: u32| f32::from_bits(w);
        let sum = |w: usize| digit_sum(ws[w].0, ws[w].1);
        let half = |k: usize| (sum(k) + sum(k + 1)) + (sum(k + 2) + sum(k + 3));
        let sums = [half(0), half(4)].map(|s| bits(s as u32));
        let x = [
            bits(ws[0].0),
            bits(ws[1].0),
            bits(ws[2].0),
            bits(ws[3].0),
            bits(ws[4].0),
            bits(ws[5].0),
            bits(ws[6].0),
            bits(ws[7].0),
            bits(ws[0].1),
            bits(ws[1].1),
            bits(ws[2].1),
            bits(ws[3].1),
            bits(ws[4].1),
            bits(ws[5].1),
            bits(ws[6].1),
            bits(ws[7].1),
            unit,
            sums[0],
            sums[1],
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ];
        Held { x, sum: [0.0; 2] }
    }
}

/// A GEMV's input vector: floats in global memory, or the decode attention's sums
/// (`attention::Sums`), which become floats as they are loaded.
pub(crate) trait Vector: Copy {
    /// Elements `k..k + 4` (`k % 4 == 0`; floats 16-byte aligned).
    fn load4(self, k: usize) -> [f32; 4];
    /// Element `k`.
    fn load(self, k: usize) -> f32;
}

impl Vector for *const f32 {
    #[inline(always)]
    fn load4(self, k: usize) -> [f32; 4] {
        unsafe { *(self.add(k) as *const F32x4) }.0
    }

    #[inline(always)]
    fn load(self, k: usize) -> f32 {
        unsafe { *self.add(k) }
    }
}

/// Where the block's staged vector starts in its shared memory: after the slots of its
/// reductions (`block_sum`'s 32 f32, `gemv_meet`'s 2 per warp), 16-byte aligned
/// (`kernel_abi::gemv::slot_words`, which the host sizes the shared memory by).
#[inline(always)]
fn staging() -> *mut f32 {
    shared::<f32>().wrapping_add(gemv::slot_words(block_dim()) as usize)
}

/// Where the block's shared memory ends for a kernel that [`stage`]s `n` floats: what it may
/// use beyond the staged vector (16-byte aligned; `kernel_abi::gemv::shared_bytes`).
#[inline(always)]
pub(crate) fn after_staging(n: u32) -> *mut u32 {
    staging().wrapping_add(STAGED * n.div_ceil(32) as usize) as *mut u32
}

/// Stages `x ∘ g` (`n` long, `g` an RMSNorm's weights; `x` itself for None) in shared memory for
/// the block's GEMV lanes: element `32c + i` (times `W::X_SCALE`) at `STAGED·c + i`, the sums of
/// chunk `c`'s halves (unscaled) at `STAGED·c + 32` and `+ 33`; or with `DIGITS` (where
/// `W::DIGITS`), chunk `c` as digits at `STAGED·c` in [`Held`]'s words. Each element is loaded
/// once per block, not once per warp. Returns this thread's share of the sum of the squares of
/// `x`. Every thread of the block calls it; the staged vector may be read after the next
/// barrier. `x` and `g` 16-byte aligned, `n % 32 == 0`. Shared (of the kernels that stage):
/// `max(32, 2·warps)` f32 (rounded up to a multiple of 4) of reductions' slots, then `STAGED`
/// f32 per chunk.
///
/// Digits only where they pay: FFN gate/up and down, whose many warps an SM hide the staging's
/// extra steps; not the attention's q/k/v and output projection, whose few warps wait on
/// those steps more than they gain from shorter dots.
#[inline(always)]
pub(crate) fn stage<W: Weights, const DIGITS: bool>(
    x: impl Vector,
    g: Option<*const f32>,
    n: u32,
) -> f32 {
    let (at, groups) = (staging(), n as usize / 4);
    // Groups of 4 elements, 8 a chunk; a thread takes groups `thread() + k·blockDim`, so each
    // half chunk is 4 neighbouring lanes, which add up their sums by two shuffles. A pass takes
    // two groups a thread, both loaded before either is used: one L2 round trip where a block
    // has fewer threads than groups (FFN down's 4864 floats over 640).
    let (mut ss, mut first) = (0.0, 0);
    while first < groups {
        let i = [0, 1].map(|j| first + thread() as usize + j * block_dim() as usize);
        // Dead groups load the last one again (in bounds) and count zeros.
        let k = i.map(|i| 4 * i.min(groups - 1));
        let v = k.map(|k| x.load4(k));
        // A constant at every call site once inlined: no branch in the loop.
        let g4 = k.map(|k| match g {
            Some(g) => unsafe { (*(g.add(k) as *const F32x4)).0 },
            None => [1.0; 4],
        });
        for j in 0..2 {
            let (i, live, mut v) = (i[j], i[j] < groups, v[j]);
            // Indexed: LLVM keeps a zip of the two arrays on the stack, in local memory.
            for e in 0..4 {
                if live {
                    ss = fma(v[e], v[e], ss);
                }
                v[e] *= g4[j][e];
            }
            if DIGITS && W::DIGITS {
                // The 8 neighbouring lanes of a chunk find its largest magnitude, each then
                // its 4 elements' digits; the 4 of each half add their sums.
                let (p2, unit) = digit_scale(lanes_max_u32(top_bits(&v), 8));
                let (h, l) = digits4(v, p2);
                // Exact in f32: at most 16·16,512.
                let sum = warp_sum4(digit_sum(h, l) as f32);
                if live {
                    let c = unsafe { at.add(STAGED * (i / 8)) };
                    unsafe {
                        *c.add(i % 8) = f32::from_bits(h);
                        *c.add(8 + i % 8) = f32::from_bits(l);
                        if i % 4 == 0 {
                            *c.add(17 + i % 8 / 4) = f32::from_bits(sum as i32 as u32);
                        }
                        if i % 8 == 0 {
                            *c.add(16) = unit;
                        }
                    }
                }
                continue;
            }
            let sum = warp_sum4(if live {
                (v[0] + v[1]) + (v[2] + v[3])
            } else {
                0.0
            });
            if live {
                let c = unsafe { at.add(STAGED * (i / 8)) };
                unsafe { *(c.add(4 * (i % 8)) as *mut F32x4) = F32x4(v.map(|v| v * W::X_SCALE)) };
                if i % 4 == 0 {
                    unsafe { *c.add(32 + i % 8 / 4) = sum };
                }
            }
        }
        first += 2 * block_dim() as usize;
    }
    ss
}

impl Held {
    /// Chunk `c` of `x` (`n` long), loaded by this lane: for kernels that do not [`stage`] the
    /// vector (no barrier for the lane's loads to wait behind). `VEC`: `n % 32 == 0`, by
    /// [`Vector::load4`]; else element by element, elements `32c..32c + 32`, zeros past `n`.
    #[inline(always)]
    pub(crate) fn load<W: Weights, const VEC: bool>(x: impl Vector, c: u32, n: u32) -> Held {
        let (k0, n_chunks, n) = (32 * c as usize, n / 32, n as usize);
        let mut v = [0.0f32; 32];
        for q in 0..8 {
            let k = if VEC {
                W::group_at(c, q as u32 / 2, n_chunks) as usize + 4 * (q % 2)
            } else {
                k0 + 4 * q
            };
            let v4 = if VEC {
                x.load4(k)
            } else {
                core::array::from_fn(|j| if k + j < n { x.load(k + j) } else { 0.0 })
            };
            v[4 * q..4 * q + 4].copy_from_slice(&v4);
        }
        let half = |h: usize| v[16 * h..16 * h + 16].iter().fold(0.0, |s, v| s + v);
        Held {
            x: v.map(|v| v * W::X_SCALE),
            sum: [half(0), half(1)],
        }
    }

    /// Chunk `c` of the vector [`stage`]d in shared memory (after the barrier that follows it),
    /// `n_chunks` long, with `stage`'s `DIGITS`.
    #[inline(always)]
    pub(crate) fn staged<W: Weights, const DIGITS: bool>(c: u32, n_chunks: u32) -> Held {
        let at = |k: u32| unsafe { staging().add(STAGED * (k / 32) as usize + (k % 32) as usize) };
        let mut x = [0.0f32; 32];
        if DIGITS && W::DIGITS {
            for q in 0..5 {
                let p = at(32 * c + 4 * q as u32);
                x[4 * q..4 * q + 4].copy_from_slice(&unsafe { *(p as *const F32x4) }.0);
            }
            return Held { x, sum: [0.0; 2] };
        }
        for q in 0..8 {
            let p = at(W::group_at(c, q as u32 / 2, n_chunks) + 4 * (q as u32 % 2));
            x[4 * q..4 * q + 4].copy_from_slice(&unsafe { *(p as *const F32x4) }.0);
        }
        // Chunk `c`'s own halves: the formats whose chunks are not their own 32 elements
        // (plain floats) have no offsets to multiply.
        let sums = unsafe { *(at(32 * c).add(32) as *const F32x4) }.0;
        Held {
            x,
            sum: [sums[0], sums[1]],
        }
    }
}

/// The GEMV: units `0..n_units` of 2 weight rows each (`rows(unit)`: matrix and row), every
/// row times the vector that `held()` gives this lane, with `split` warps per unit
/// (`n_chunks <= 32·split`): lane `l` of part `p` (warp `w`: part `w % split` of unit
/// `w / split` of a round) takes chunk `32p + l` of every row, the chunk it holds, and lanes
/// past `n_chunks` count zeros. The first round's chunks are loaded before `held` runs (which
/// may wait on a barrier), and each next round's before this round's are multiplied. The block
/// runs rounds of `blockDim / 32 / split` units, block `block` of `blocks` striding over them.
/// `out(unit, t)` (with `held`'s `t`) runs in every thread before a round's products, for the
/// unit the thread finishes (or its block's last), so that what it loads (a bias, the rows of
/// `y` that it adds to) arrives while they are computed; the finisher it gives takes the 2 dot
/// products, on the one thread that finishes `unit` (for units past the end, `out` sees the
/// last unit and its finisher is not called).
/// With `ONE`, the grid has a block for every `blockDim / 32 / split` units (`blocks` is not
/// read) and each block runs one round, so no next round's chunks are held in registers
/// (ptxas: attn_qkv packed 120 → 80, gemv_residual packed 95 → 72, f16 127 → 90; FFN down
/// with f16 weights then takes its 448 units in one wave, 4 blocks an SM, not 3 and a second
/// round).
/// With `DIGITS`, the products are `W::dot_digits`, for a vector staged with digits asked for.
/// Every thread of the block must call it (with `split > 1` the meetings sync the block).
/// Shared: 2 f32 per warp.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn gemv_units<
    'a,
    W: Weights + 'a,
    T: Copy,
    F: FnOnce([f32; 2]),
    const VEC: bool,
    const ONE: bool,
    const DIGITS: bool,
>(
    held: impl FnOnce() -> (Held, T),
    n_chunks: u32,
    n_units: u32,
    split: u32,
    block: u32,
    blocks: u32,
    rows: impl Fn(u32) -> [(&'a W, usize); 2],
    out: impl Fn(u32, T) -> F,
) {
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let per_block = block_dim() / WARP / split;
    let stride = blocks * per_block;
    let c = warp % split * WARP + lane;
    let (live, c) = (c < n_chunks, c.min(n_chunks - 1));
    // Units past the end load the last one's chunks again (cached), so that every load is
    // unconditional and in flight before the products that wait for it. Two rows written
    // out: an array indexed in a loop would live in local memory.
    let load = |first: u32| {
        let [(w0, r0), (w1, r1)] = rows((first + warp / split).min(n_units - 1));
        unsafe { (w0.load_chunk::<VEC>(r0, c), w1.load_chunk::<VEC>(r1, c)) }
    };
    let mut first = block * per_block;
    let (mut a, mut b) = load(first);
    // Only the weights are read before the kernels this one may overlap have finished.
    wait_prior_grids();
    allow_next_grid();
    let (x, t) = held();
    // The unit of the round that this thread finishes (`gemv_meet`'s `u`); a thread that
    // finishes none takes the block's last, so that its loads stay in the block's own rows.
    let mine = if split == 1 {
        warp
    } else {
        thread().min(per_block - 1)
    };
    while first < n_units {
        let next = (!ONE).then(|| load(first + stride));
        let finish = out((first + mine).min(n_units - 1), t);
        // A select, as a branch around the products would have LLVM sink the loads into it.
        let dot = |ch: &W::Chunk| {
            warp_sum(if live {
                if DIGITS {
                    W::dot_digits(ch, &x)
                } else {
                    W::dot(ch, &x)
                }
            } else {
                0.0
            })
        };
        let sums = [dot(&a), dot(&b)];
        gemv_meet(sums, split, |u, sums| {
            if first + u < n_units {
                finish(sums)
            }
        });
        let Some(next) = next else { break };
        (a, b) = next;
        first += stride;
    }
}

/// This lane's chunk for `split` warps per unit (`thread() / 32 % split · 32 + lane`),
/// clamped into `0..n_chunks`.
#[inline(always)]
pub(crate) fn lane_chunk(split: u32, n_chunks: u32) -> u32 {
    (thread() / WARP % split * WARP + thread() % WARP).min(n_chunks - 1)
}

/// The GEMV, one entry point per weight type (ggml type `TY`): `y[o] = w[o, :]·x + bias[o]`
/// for one token; `bias` may be null. Units of two rows, `split` warps each, `32·split >=
/// ceil(n_in / 32)` (each lane one chunk of 32 weights per row). Grid: any number of blocks
/// (they stride over the units); block: a multiple of `32·split` threads; shared: 2 f32 per
/// warp.
#[inline(always)]
pub(crate) unsafe fn gemv<const TY: u32>(p: Gemv)
where
    GgmlType<TY>: Format,
{
    let Gemv {
        y,
        x,
        w,
        bias,
        n_in,
        n_out,
        split,
    } = p;
    let w = <GgmlType<TY> as Format>::W::new(w, n_out, n_in);
    unsafe { gemv_weights(y, x, w, bias, n_in, n_out, split) }
}

/// [`gemv`] of weights `w`.
#[inline(always)]
unsafe fn gemv_weights<W: Weights>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    if w.vector() && n_in.is_multiple_of(32) && aligned(x, 16) {
        unsafe { gemv_rows::<W, true>(y, x, w, bias, n_in, n_out, split) }
    } else {
        unsafe { gemv_rows::<W, false>(y, x, w, bias, n_in, n_out, split) }
    }
}

#[inline(always)]
unsafe fn gemv_rows<W: Weights, const VEC: bool>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    let n_chunks = n_in.div_ceil(32);
    let c = lane_chunk(split, n_chunks);
    let held = || (Held::load::<W, VEC>(x, c, n_in), ());
    let rows = |u: u32| {
        [
            (&w, 2 * u as usize),
            (&w, (2 * u + 1).min(n_out - 1) as usize),
        ]
    };
    let out = |u: u32, _| {
        move |sums: [f32; 2]| {
            for (r, s) in [2 * u, 2 * u + 1].into_iter().zip(sums) {
                if r < n_out {
                    unsafe { *y.add(r as usize) = s + bias_at(bias, r as usize) };
                }
            }
        }
    };
    let units = n_out.div_ceil(2);
    gemv_units::<W, (), _, VEC, false, false>(
        held,
        n_chunks,
        units,
        split,
        block(),
        grid_dim(),
        rows,
        out,
    );
}

/// Where the `split` warps of each GEMV unit meet: `out(unit, sums)` runs once for each unit
/// `0..blockDim / 32 / split` of the block, on one thread, with the sum over the unit's warps
/// of their `sums` (warp `w` is part `w % split` of unit `w / split`). Every thread of the
/// block must call it: with `split > 1` it syncs the block. Shared: `M` f32 per warp.
#[inline(always)]
pub(crate) fn gemv_meet<const M: usize>(
    sums: [f32; M],
    split: u32,
    out: impl FnOnce(u32, [f32; M]),
) {
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    // `split` is the same for the whole block: all threads leave here, or none.
    if split == 1 {
        if lane == 0 {
            out(warp, sums);
        }
        return;
    }
    let slots = shared::<f32>();
    if lane == 0 {
        for (m, s) in sums.iter().enumerate() {
            unsafe { *slots.add(warp as usize * M + m) = *s };
        }
    }
    sync_threads();
    let t = thread();
    if t < block_dim() / WARP / split {
        let mut s = [0.0; M];
        for p in 0..split {
            for (m, s) in s.iter_mut().enumerate() {
                *s += unsafe { *slots.add((t * split + p) as usize * M + m) };
            }
        }
        out(t, s);
    }
    // Keep the slots until every unit has read them, so that the block can meet again.
    sync_threads();
}

/// One K step of a tile, in registers on their way to shared memory. Thread `t` of a group
/// holds x rows `t / 8 + 16p` (`p` in 0..4) at k `4·(t % 8)..+4`, and w rows `t / 4 + 32p`
/// (`p` in 0..2) at k `8·(t % 4)..+8` (dequantized): the group's 128 threads cover the 64×32
/// x tile and the 64×32 w tile once.
#[derive(Clone, Copy)]
struct Staged {
    x: [[f32; 4]; 4],
    w: [[f32; 8]; 2],
}

impl Staged {
    const ZERO: Staged = Staged {
        x: [[0.0; 4]; 4],
        w: [[0.0; 8]; 2],
    };
}

/// What a block needs to stage its tiles (sizes as the kernel got them, `u32`, which keeps the
/// index math in 32-bit registers).
struct Tiles<W> {
    x: *const f32,
    w: W,
    rows: u32,
    n_in: u32,
    n_out: u32,
    row0: u32,
    col0: u32,
}

impl<W: Weights> Tiles<W> {
    /// The K step at `k0` as thread `t` of a group stages it. Past the last row of `x` or `w`:
    /// zeros (`!VEC`) or that row's values again (`VEC`), which only reach outputs that are not
    /// written. Past `n_in`: zeros in x; in w zeros (`!VEC`) or the row's last 8 weights again
    /// (`VEC`), whose products with those zeros vanish (`Staged::store` zeroes them for the f32
    /// loop, where an infinite weight would make them NaN). `VEC`: `n_in % 8 == 0`, `x` 16-byte
    /// aligned and `w.vector()`: every 4 floats and 8 weights a thread loads are then aligned
    /// and wholly inside or wholly outside `n_in`.
    #[inline(always)]
    fn load<const VEC: bool>(&self, k0: u32, t: u32) -> Staged {
        let mut s = Staged::ZERO;
        let (n_in, kx, kw) = (self.n_in, k0 + 4 * (t % 8), k0 + 8 * (t % 4));
        // Float `k` of row `r` of x.
        let x_at = |r: u32, k: u32| unsafe { self.x.add(r as usize * n_in as usize + k as usize) };
        if VEC {
            // Without a branch around a load or its use, so that all the loads are in flight
            // before the first is waited for and the compiler may schedule other work before
            // the uses: indices are clamped into the matrices, and x past `n_in` replaced by
            // zeros by a select.
            for (p, xs) in s.x.iter_mut().enumerate() {
                let r = (self.row0 + t / 8 + 16 * p as u32).min(self.rows - 1);
                let v = unsafe { *(x_at(r, kx.min(n_in - 4)) as *const F32x4) }.0;
                *xs = if kx < n_in { v } else { [0.0; 4] };
            }
            for (p, ws) in s.w.iter_mut().enumerate() {
                let n = (self.col0 + t / 4 + 32 * p as u32).min(self.n_out - 1);
                *ws = unsafe { self.w.load8::<true>(n as usize, kw.min(n_in - 8)) };
            }
            return s;
        }
        for (p, xs) in s.x.iter_mut().enumerate() {
            let r = self.row0 + t / 8 + 16 * p as u32;
            if r >= self.rows {
                continue;
            }
            for (j, v) in xs.iter_mut().enumerate() {
                let k = kx + j as u32;
                if k < n_in {
                    *v = unsafe { *x_at(r, k) };
                }
            }
        }
        for (p, ws) in s.w.iter_mut().enumerate() {
            let n = self.col0 + t / 4 + 32 * p as u32;
            if n >= self.n_out {
                continue;
            }
            if kw + 8 <= n_in {
                *ws = unsafe { self.w.load8::<false>(n as usize, kw) };
            } else {
                for (j, v) in ws.iter_mut().enumerate() {
                    let k = kw as usize + j;
                    if k < n_in as usize {
                        *v = unsafe { self.w.load1(n as usize, k) };
                    }
                }
            }
        }
        s
    }
}

impl Staged {
    /// Writes the step at `k0`, as thread `t` of a group staged it, into the f32 loop's shared
    /// tiles, transposed to `[k][row]` so that the product loop reads consecutive rows with
    /// 16-byte loads; weights at or past `n_in` as zeros.
    #[inline(always)]
    fn store(&self, xs: *mut f32, ws: *mut f32, t: usize, k0: u32, n_in: u32) {
        for (p, v) in self.x.iter().enumerate() {
            let (r, k) = (t / 8 + 16 * p, 4 * (t % 8));
            for (j, v) in v.iter().enumerate() {
                unsafe { *xs.add((k + j) * F32_STRIDE + r) = *v };
            }
        }
        let k = 8 * (t % 4);
        let live = k0 + (k as u32) < n_in;
        for (p, v) in self.w.iter().enumerate() {
            let n = t / 4 + 32 * p;
            for (j, v) in v.iter().enumerate() {
                unsafe { *ws.add((k + j) * F32_STRIDE + n) = if live { *v } else { 0.0 } };
            }
        }
    }
}

/// The tiled GEMM, one entry point per weight type (ggml type `TY`): `y[t, o] = x[t, :]·w[o, :]
/// + bias[o]` for `rows` tokens; `bias` may be null. Grid: `ceil(rows / 64) · ceil(n_out / 64)`
/// blocks; block: `128·(1 + T)` threads, `T` producer teams from 1 to 3 (or one group of 128,
/// the f32 loop alone); shared: `max(17408, T·32768)` bytes.
///
/// Block `b` computes the 64×64 output tile at token rows `64·(b % ceil(rows / 64))` and
/// outputs `64·(b / ceil(rows / 64))`, in K steps of 32 staged through shared memory.
/// Consecutive blocks share one weight tile, so each weight tile is read from DRAM about once.
/// Where rows of x and w are 16-byte aligned (and the block has at least 2 groups of 128
/// threads) the tile runs on tensor cores ([`gemm_mma`]), else (or where an operand overflows
/// f16) on the f32 loop `gemm_vec`.
#[inline(always)]
pub(crate) unsafe fn gemm<const TY: u32>(p: Gemm)
where
    GgmlType<TY>: Format,
{
    let Gemm {
        y,
        x,
        w,
        bias,
        rows,
        n_in,
        n_out,
    } = p;
    let w = <GgmlType<TY> as Format>::W::new(w, n_out, n_in);
    unsafe { gemm_weights(y, x, w, bias, rows, n_in, n_out) }
}

/// [`gemm`] of weights `w`.
#[inline(always)]
unsafe fn gemm_weights<W: Weights>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    rows: u32,
    n_in: u32,
    n_out: u32,
) {
    let vector = w.vector() && n_in >= 8 && aligned(x, 16);
    let row_tiles = rows.div_ceil(TILE_M as u32);
    let b = block();
    let tiles = Tiles {
        x,
        w,
        rows,
        n_in,
        n_out,
        row0: b % row_tiles * TILE_M as u32,
        col0: b / row_tiles * TILE_N as u32,
    };
    // The tensor-core loop needs a producer team besides its consumer.
    if vector && block_dim() >= 2 * GROUP {
        // Tensor cores, unless an operand overflows f16: then the f32 loop redoes the tile.
        if unsafe { !gemm_mma(y, bias, &tiles) } {
            unsafe { gemm_vec::<W, true>(y, bias, &tiles) }
        }
    } else {
        unsafe { gemm_vec::<W, false>(y, bias, &tiles) }
    }
}

/// The f32 loop of [`gemm`], on the block's first group (the other threads only meet at its
/// barriers): thread `t` owns the 8×4 outputs at rows `8·(t / 16)` and columns `4·(t % 16)` of
/// the tile, summed by FMA. Shared: 17408 bytes.
#[inline(always)]
unsafe fn gemm_vec<W: Weights, const VEC: bool>(y: *mut f32, bias: *const f32, tiles: &Tiles<W>) {
    let (rows, n_in, n_out) = (tiles.rows as usize, tiles.n_in, tiles.n_out as usize);
    // Declared as 16-byte elements so that the shared array is 16-byte aligned.
    let xs = shared::<F32x4>() as *mut f32;
    let ws = unsafe { xs.add(TILE_K * F32_STRIDE) };
    let t = thread() as usize;
    let live = t < GROUP as usize;
    let (tr, tc) = (8 * (t / 16), 4 * (t % 16));
    let load = |k0: u32| {
        if live {
            tiles.load::<VEC>(k0, t as u32)
        } else {
            Staged::ZERO
        }
    };
    let mut acc = [[0.0f32; 4]; 8];
    let mut staged = load(0);
    let mut k0 = 0;
    // Every thread runs the same number of steps: the barriers are reached by all.
    while k0 < n_in {
        if live {
            staged.store(xs, ws, t, k0, n_in);
        }
        sync_threads();
        if k0 + (TILE_K as u32) < n_in {
            staged = load(k0 + TILE_K as u32);
        }
        if live {
            // Not unrolled (an opaque trip count): the f32 loop only redoes rare tiles, and its
            // registers count for the whole kernel.
            for k in 0..opaque(TILE_K as u32) as usize {
                let a =
                    [0, 4].map(|i| unsafe { *(xs.add(k * F32_STRIDE + tr + i) as *const F32x4) }.0);
                let b = unsafe { *(ws.add(k * F32_STRIDE + tc) as *const F32x4) }.0;
                for (i, acc) in acc.iter_mut().enumerate() {
                    for (j, acc) in acc.iter_mut().enumerate() {
                        *acc = fma(a[i / 4][i % 4], b[j], *acc);
                    }
                }
            }
        }
        sync_threads();
        k0 += TILE_K as u32;
    }
    if !live {
        return;
    }
    for (i, acc) in acc.iter().enumerate() {
        let r = tiles.row0 as usize + tr + i;
        if r >= rows {
            break;
        }
        for (j, acc) in acc.iter().enumerate() {
            let c = tiles.col0 as usize + tc + j;
            if c < n_out {
                unsafe { *y.add(r * n_out + c) = acc + bias_at(bias, c) };
            }
        }
    }
}

/// The named barriers of the tensor-core loop's slots (`TEAM_SLOTS` for each of up to
/// `MAX_TEAMS` teams, see [`gemm_mma`]): `MMA_FULL + slot` (the slot's step is stored) and
/// `MMA_EMPTY + slot` (it has been read), ids 1 to 14 (of 16; 0 is the block's).
const MMA_FULL: u32 = 1;
const MMA_EMPTY: u32 = MMA_FULL + TEAM_SLOTS * MAX_TEAMS;

/// Byte offset of halves `8c..8c + 8` (`c` in 0..4) of row `r` in a tile. The four 16-byte
/// chunks of a row are permuted by `(r / 2) % 4`: the 8 rows that one `ldmatrix` phase reads
/// at one chunk, and the 8 chunks one store phase writes, then fall into distinct banks. For
/// `c < 2`, chunk `c + 2` is at `chunk_at(r, c) ^ 32`.
#[inline(always)]
fn chunk_at(r: u32, c: u32) -> u32 {
    64 * r + 16 * (c ^ (r / 2 % 4))
}

/// `v`, through an instruction the compiler cannot see through.
#[inline(always)]
fn opaque(v: u32) -> u32 {
    let r: u32;
    unsafe { asm!("mov.b32 {0}, {1};", out(reg32) r, in(reg32) v, options(pure, nomem, nostack)) };
    r
}

impl Staged {
    /// Writes the step, as thread `t` of a group staged it, into the shared stage at `stage` as
    /// split halves, row-major (the fragments' order); `w_lo`: with the weights' low halves.
    #[inline(always)]
    fn store_split(&self, stage: u32, w_lo: bool, t: u32) {
        for (p, v) in self.x.iter().enumerate() {
            let (r, k) = (t / 8 + 16 * p as u32, 4 * (t % 8));
            let at = stage + chunk_at(r, k / 8) + 2 * (k % 8);
            let (hi, lo) = split::<4, 2>(v);
            store_shared2(at, hi);
            store_shared2(at + TILE_BYTES, lo);
        }
        for (p, v) in self.w.iter().enumerate() {
            let at = stage + 2 * TILE_BYTES + chunk_at(t / 4 + 32 * p as u32, t % 4);
            let (hi, lo) = split::<8, 4>(v);
            store_shared4(at, hi);
            if w_lo {
                store_shared4(at + TILE_BYTES, lo);
            }
        }
    }
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.barrier0.or"]
    fn barrier_or(p: i32) -> i32;
    #[link_name = "llvm.nvvm.barrier.cta.sync.aligned.count"]
    fn barrier_sync(id: u32, threads: u32);
    #[link_name = "llvm.nvvm.barrier.cta.arrive.aligned.count"]
    fn barrier_arrive(id: u32, threads: u32);
}

/// The 64×64 tile of [`gemm`] on tensor cores (`mma.sync` m16n8k16: f16 products, exact, summed
/// in f32) at f32 precision: with every operand split as at [`LO_SCALE`],
/// `x·w ≈ hi_x·hi_w + (hi_x·lo_w + lo_x·hi_w) / LO_SCALE`, the two sums in separate
/// accumulators, the `lo_x·lo_w` term (< 2^-22·|x·w|) left out, and none of the `lo` products
/// for f16 weights (`W::F16`: their `lo` is 0). `hi + lo / LO_SCALE` is the operand to 2^-22
/// of it while `|v| >= 2^-14` (`hi` a normal f16), and to 2^-36 absolute below.
///
/// The block's warps specialize, so that waiting on global loads never holds up the products:
/// warps 0-3, the consumer, multiply the K steps of 32 in order, warp `w` the 32×32 quarter `w`
/// of the tile (2×4 m16n8 tiles over both k16 halves of every step); each further 4 warps are
/// a team of producers (`T = blockDim / 128 - 1` teams, at most `MAX_TEAMS`: more warps idle),
/// team `p` staging the steps `p, p + T, p + 2T, ...` (global loads, dequantization, split)
/// into its own `TEAM_SLOTS` shared slots in turn: step `s` goes to slot
/// `TEAM_SLOTS·(s % T) + (s / T) % TEAM_SLOTS`. A slot is handed over by its two named
/// barriers (`bar.arrive` by the side that is done with it, `bar.sync` by the side that waits
/// for it); as only one team ever fills it, each barrier's generations alternate between that
/// team and the consumer (a slot shared by two teams would let one team's wait complete with
/// the consumer's release meant for the other). So each team waits on its loads (issued before
/// it waits for its slot) while the consumer multiplies the steps that other teams staged. The
/// consumer writes the tile out. Block: 128·(1 + T) threads, `T` >= 1; shared:
/// `T·TEAM_SLOTS` slots of 4 tiles `[64][32]` f16 (`T`·32768 bytes).
///
/// An operand of |v| >= 65520 has `hi = inf` (f16 overflow) and makes its sums non-finite: then
/// `false` is returned (for the whole block), and the caller redoes the tile in f32 (as it
/// does, harmlessly, for inf and NaN inputs, whose outputs are not finite either way).
#[inline(always)]
unsafe fn gemm_mma<W: Weights>(y: *mut f32, bias: *const f32, tiles: &Tiles<W>) -> bool {
    let base = shared_addr(shared::<F32x4>());
    let t = thread();
    let steps = tiles.n_in.div_ceil(TILE_K as u32);
    let teams = (block_dim() / GROUP - 1).min(MAX_TEAMS);
    let mut finite = true;
    if t < GROUP {
        finite = unsafe { mma_consume::<W>(y, bias, tiles, base, steps, teams) };
    } else if t / GROUP <= teams {
        let (team, tg) = (t / GROUP - 1, t % GROUP);
        // The team's `turn`-th step.
        let (mut s, mut turn) = (team, 0);
        while s < steps {
            // The loads first: the wait for the slot, the dequantization and split after.
            let staged = tiles.load::<true>(s * TILE_K as u32, tg);
            let slot = TEAM_SLOTS * team + turn % TEAM_SLOTS;
            if turn >= TEAM_SLOTS {
                unsafe { barrier_sync(MMA_EMPTY + slot, 2 * GROUP) };
            }
            staged.store_split(base + slot * STEP_BYTES, !W::F16, tg);
            unsafe { barrier_arrive(MMA_FULL + slot, 2 * GROUP) };
            (s, turn) = (s + teams, turn + 1);
        }
    }
    // The block's vote.
    unsafe { barrier_or(!finite as i32) == 0 }
}

/// The consumer of [`gemm_mma`] (its warps 0-3): multiplies the `steps` steps out of the slots
/// at `base` that `teams` teams fill and writes the tile out (plus `bias`); whether every sum
/// is finite.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn mma_consume<W: Weights>(
    y: *mut f32,
    bias: *const f32,
    tiles: &Tiles<W>,
    base: u32,
    steps: u32,
    teams: u32,
) -> bool {
    let t = thread();
    let (lane, quarter) = (t % WARP, t / WARP);
    let (qm, qn) = (32 * (quarter / 2), 32 * (quarter % 2));
    // The lanes' ldmatrix rows in the first k16 half of a step (the second: `^ 32`). x:
    // matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of each m16 tile are
    // its fragment's words 0-3. w (rows are outputs): matrices (n 0-7, k 0-7), (0-7, 8-15),
    // (8-15, 0-7), (8-15, 8-15) are the fragments of the n8 tiles 2j and 2j + 1.
    let x_at = [0, 1].map(|i| chunk_at(qm + 16 * i + lane % 16, lane / 16));
    let w_at = [0, 1].map(|j| chunk_at(qn + 16 * j + lane % 8 + 8 * (lane / 16), lane / 8 % 2));
    let mut main = [[[0.0f32; 4]; 4]; 2];
    let mut cross = [[[0.0f32; 4]; 4]; 2];
    // Step `s` is the `turn`-th of team `team`.
    let (mut team, mut turn) = (0, 0);
    for s in 0..steps {
        let slot = TEAM_SLOTS * team + turn % TEAM_SLOTS;
        (team, turn) = if team + 1 == teams {
            (0, turn + 1)
        } else {
            (team + 1, turn)
        };
        unsafe { barrier_sync(MMA_FULL + slot, 2 * GROUP) };
        let step = base + slot * STEP_BYTES;
        for h in 0..2 {
            // The k16 half's chunks.
            let half = 32 * h;
            let frags = |tile: u32, at: [u32; 2]| {
                at.map(|at| ldmatrix4::<false>(step + tile * TILE_BYTES + (at ^ half)))
            };
            let (x_hi, x_lo, w_hi) = (frags(0, x_at), frags(1, x_at), frags(2, w_at));
            for i in 0..2 {
                for j in 0..4 {
                    let b = [w_hi[j / 2][2 * (j % 2)], w_hi[j / 2][2 * (j % 2) + 1]];
                    mma(&mut main[i][j], x_hi[i], b);
                    mma(&mut cross[i][j], x_lo[i], b);
                }
            }
            if !W::F16 {
                let w_lo = frags(3, w_at);
                for i in 0..2 {
                    for j in 0..4 {
                        let b = [w_lo[j / 2][2 * (j % 2)], w_lo[j / 2][2 * (j % 2) + 1]];
                        mma(&mut cross[i][j], x_hi[i], b);
                    }
                }
            }
        }
        // Only hand back slots that their team waits for, so that every barrier completes.
        if s + TEAM_SLOTS * teams < steps {
            unsafe { barrier_arrive(MMA_EMPTY + slot, 2 * GROUP) };
        }
    }
    // Fragment element `e` of m16n8 tile (i, j) is output row `g` (`e < 2`) or `g + 8`,
    // column `2c + e % 2`, with `g = lane / 4`, `c = lane % 4`.
    let (rows, n_out) = (tiles.rows as usize, tiles.n_out as usize);
    let mut finite = true;
    for i in 0..2 {
        for j in 0..4 {
            for e in 0..4 {
                let v = fma(cross[i][j][e], 1.0 / LO_SCALE, main[i][j][e]);
                finite &= v.is_finite();
                let r = (tiles.row0 + qm + 16 * i as u32 + lane / 4 + 8 * (e as u32 / 2)) as usize;
                let c = (tiles.col0 + qn + 8 * j as u32 + 2 * (lane % 4) + e as u32 % 2) as usize;
                if r < rows && c < n_out {
                    unsafe { *y.add(r * n_out + c) = v + bias_at(bias, c) };
                }
            }
        }
    }
    finite
}
