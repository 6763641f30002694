//! The fused kernels of one decode step (one token), each one pass over its weights through
//! the GEMV of matmul.rs with the steps around it done in registers:
//!
//! - `attn_qkv`: RMSNorm, the q, k and v projections with their biases, NeoX RoPE on q and k,
//!   and k and v into row `pos[0]` of the KV cache;
//! - `ffn_gate_up`: RMSNorm and SwiGLU's `silu(w_gate·x)·(w_up·x)`;
//! - `gemv_residual`: `y += w·v + bias`, the attention output and FFN down projections;
//! - `logits`: RMSNorm, the vocabulary projection and, optionally, its arg-max.
//!
//! CPU twins: the compositions of `orcd::cpu::{rms_norm, matmul, rope_neox, silu_mul, add,
//! argmax}` the forward pass runs.
//!
//! An RMSNorm ahead of a GEMV is no pass of its own: `w·(x·s ∘ g) = s·(w·(x ∘ g))`, so the GEMV
//! multiplies by `x ∘ g` (a [`Normed`] operand), sums `x²` from the same loads, and the scale
//! `s = 1/sqrt(mean(x²) + eps)` multiplies the finished products. No block waits for a norm
//! before it issues its weight loads.
//!
//! The weights are a matrix's raw bytes and its ggml type id (`quant::F32` and so on); each
//! block dispatches once on the id (`with_weights!`), so the loops are monomorphised per
//! format. The host checks that rows are whole groups of 8 and that every vector and matrix
//! starts 16-byte aligned, so only the GEMV's vector-load path is built here.
//!
//! Work comes in GEMV units (one output row, or two that are used together), `split` warps
//! per unit; a block runs `blockDim / 32 / split` units at a time and strides over the grid.
use core::arch::nvptx;
use core::intrinsics::sqrtf32;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::matmul::{
    Bf16, Blocks, GEMV_UNROLL, Operand, Plain, Weights, aligned, fma, gemv_dots, gemv_meet, load_x8,
};
use crate::quant::{self, BlockQ4_0, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0};
use crate::util::{
    WARP, better, block, block_dim, block_sum, exp, grid_dim, shared, sync_threads, thread,
    threadfence,
};

/// An RMSNorm's input `x` times its weights `g`, elementwise, with `x`'s sum of squares.
struct Normed {
    x: *const f32,
    g: *const f32,
}

impl Operand for Normed {
    const SQUARES: bool = true;

    #[inline(always)]
    fn vector(&self) -> bool {
        aligned(self.x, 16) && aligned(self.g, 16)
    }

    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, _u: usize, k: u32) -> ([f32; 8], f32) {
        let (x, g) = (load_x8::<VEC>(self.x, k), load_x8::<VEC>(self.g, k));
        let ss = x.iter().fold(0.0, |s, v| fma(*v, *v, s));
        (core::array::from_fn(|j| x[j] * g[j]), ss)
    }

    #[inline(always)]
    unsafe fn load1(&self, k: usize) -> (f32, f32) {
        let x = unsafe { *self.x.add(k) };
        (x * unsafe { *self.g.add(k) }, x * x)
    }
}

/// A [`Normed`] operand loaded once per warp and kept in registers for every row the warp
/// multiplies, with the norm's scale found once per block: slot `u` holds the 8 products that
/// `gemv_dots` takes in slot `u` of its first step, so rows must be one step long:
/// `n_in <= 8·128·split`. It frees each row from re-reading `x` and `g` and from reducing
/// `x²`, at the price of a wait for them before the first row.
struct Held {
    xg: [[f32; 8]; GEMV_UNROLL],
}

impl Held {
    /// This lane's slots for part `part` of `split` (`gemv_dots`'s groups for it), and the
    /// norm's scale. Every thread of the block must call it (it syncs); shared: 32 f32.
    #[inline(always)]
    fn new(x: &Normed, n_in: u32, eps: f32, split: u32) -> (Held, f32) {
        let (warp, lane) = (thread() / WARP, thread() % WARP);
        let (groups, c0) = (n_in / 8, warp % split * WARP + lane);
        let c = [0, 1, 2, 3].map(|u| c0 + u * WARP * split);
        let at = |u: usize| 8 * c[u].min(groups - 1);
        let v = unsafe {
            [
                x.load8::<true>(0, at(0)),
                x.load8::<true>(1, at(1)),
                x.load8::<true>(2, at(2)),
                x.load8::<true>(3, at(3)),
            ]
        };
        // The warps of the block's first unit take every group once: their live slots' squares
        // make the row's.
        let mut ss = 0.0;
        for (c, (_, sq)) in c.iter().zip(&v) {
            ss += if warp < split && *c < groups {
                *sq
            } else {
                0.0
            };
        }
        let scale = rms_scale(block_sum(ss), n_in, eps);
        (Held { xg: v.map(|v| v.0) }, scale)
    }
}

impl Operand for Held {
    const SQUARES: bool = false;

    #[inline(always)]
    fn vector(&self) -> bool {
        true
    }

    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, u: usize, _k: u32) -> ([f32; 8], f32) {
        (self.xg[u], 0.0)
    }

    /// Never called: held rows are whole groups of 8.
    #[inline(always)]
    unsafe fn load1(&self, _k: usize) -> (f32, f32) {
        (f32::NAN, 0.0)
    }
}

/// RMSNorm's scale `1/sqrt(ss/n + eps)` (correctly rounded square root and division, as the
/// CPU's).
#[inline(always)]
fn rms_scale(ss: f32, n: u32, eps: f32) -> f32 {
    1.0 / sqrtf32(ss / n as f32 + eps)
}

/// `bias[i]`, or 0 for a null bias.
#[inline(always)]
fn bias_at(bias: *const f32, i: usize) -> f32 {
    if bias.is_null() {
        0.0
    } else {
        unsafe { *bias.add(i) }
    }
}

/// `$body` with `$W` the [`Weights`] type of ggml type id `$ty`; traps on any other id.
macro_rules! with_weights {
    ($ty:expr, $W:ident => $body:expr) => {
        match $ty {
            quant::F32 => {
                type $W = Plain<f32>;
                $body
            }
            quant::F16 => {
                type $W = Plain<f16>;
                $body
            }
            quant::BF16 => {
                type $W = Plain<Bf16>;
                $body
            }
            quant::Q4_0 => {
                type $W = Blocks<BlockQ4_0>;
                $body
            }
            quant::Q5_0 => {
                type $W = Blocks<BlockQ5_0>;
                $body
            }
            quant::Q8_0 => {
                type $W = Blocks<BlockQ8_0>;
                $body
            }
            quant::Q4_K => {
                type $W = Blocks<BlockQ4K>;
                $body
            }
            quant::Q5_K => {
                type $W = Blocks<BlockQ5K>;
                $body
            }
            quant::Q6_K => {
                type $W = Blocks<BlockQ6K>;
                $body
            }
            _ => unsafe { nvptx::trap() },
        }
    };
}

/// Runs the GEMV units `0..n_units` on this block, number `block` of `blocks`: in rounds of
/// `blockDim / 32 / split` units, `dots(unit, part)` on each of a unit's `split` warps (whole
/// warps), then `out(unit, sums)` on one thread with the sums over the unit's warps. Every
/// thread of the block runs the same rounds, so the meetings' barriers are reached by all.
#[inline(always)]
fn for_units<const M: usize>(
    n_units: u32,
    split: u32,
    block: u32,
    blocks: u32,
    dots: impl Fn(u32, u32) -> [f32; M],
    mut out: impl FnMut(u32, [f32; M]),
) {
    let warp = thread() / WARP;
    let per_block = block_dim() / WARP / split;
    let mut first = block * per_block;
    while first < n_units {
        let unit = first + warp / split;
        let sums = if unit < n_units {
            dots(unit, warp % split)
        } else {
            [0.0; M]
        };
        gemv_meet(sums, split, |u, sums| {
            if first + u < n_units {
                out(first + u, sums)
            }
        });
        first += blocks * per_block;
    }
}

/// `q = rope(wq·xn + bq)`, and `k = rope(wk·xn + bk)`, `v = wv·xn + bv` into row `pos[0]` of
/// `k_cache, v_cache = [max_pos, n_kv·head_dim]`, with `xn = rms_norm(x)·norm` (`n_in` long)
/// and NeoX RoPE at position `pos[0]` from `rope = [positions, head_dim/2, 2]` (cos, sin).
/// Traps when `pos[0] >= max_pos` (the smaller of the cache's and the table's positions).
/// Each weight matrix has its own type id and may have a null bias.
///
/// Units are the rows `i` and `i + head_dim/2` of a head, which RoPE rotates together.
/// Grid: `q_blocks + 2·kv_blocks`: the first `q_blocks` blocks compute q, the next `kv_blocks`
/// k, the last `kv_blocks` v, each block `blockDim / 32 / split` units at a time. Block: a
/// multiple of `32·split` threads, `split` a power of two; shared: 3 f32 per warp.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "gpu-kernel" fn attn_qkv(
    q: *mut f32,
    k_cache: *mut f32,
    v_cache: *mut f32,
    x: *const f32,
    norm: *const f32,
    eps: f32,
    wq: *const u8,
    ty_q: u32,
    bq: *const f32,
    wk: *const u8,
    ty_k: u32,
    bk: *const f32,
    wv: *const u8,
    ty_v: u32,
    bv: *const f32,
    pos: *const u32,
    rope: *const f32,
    n_in: u32,
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    max_pos: u32,
    q_blocks: u32,
    kv_blocks: u32,
    split: u32,
) {
    let p = unsafe { *pos };
    if p >= max_pos {
        unsafe { nvptx::trap() };
    }
    let kv_row = p as usize * (n_kv * head_dim) as usize;
    let b = block();
    // (weights, type, bias, output, heads, rotated, the matrix's first block and blocks)
    let (w, ty, bias, out, heads, rotate, b0, blocks) = if b < q_blocks {
        (wq, ty_q, bq, q, n_heads, true, 0, q_blocks)
    } else if b < q_blocks + kv_blocks {
        let k = unsafe { k_cache.add(kv_row) };
        (wk, ty_k, bk, k, n_kv, true, q_blocks, kv_blocks)
    } else {
        let v = unsafe { v_cache.add(kv_row) };
        (
            wv,
            ty_v,
            bv,
            v,
            n_kv,
            false,
            q_blocks + kv_blocks,
            kv_blocks,
        )
    };
    let half = head_dim / 2;
    let proj = Qkv {
        x: Normed { x, g: norm },
        eps,
        bias,
        out,
        // This position's row of the table.
        rope: rotate.then(|| unsafe { rope.add(2 * (p * half) as usize) }),
        n_pairs: heads * half,
        half,
        head_dim,
        n_in,
        split,
    };
    with_weights!(ty, W => proj.run(W::new(w, n_in), b - b0, blocks))
}

/// One of `attn_qkv`'s three projections.
struct Qkv {
    x: Normed,
    eps: f32,
    bias: *const f32,
    out: *mut f32,
    /// `[head_dim/2, 2]` (cos, sin) at the position, or None for v.
    rope: Option<*const f32>,
    n_pairs: u32,
    half: u32,
    head_dim: u32,
    n_in: u32,
    split: u32,
}

impl Qkv {
    /// Rows `i` and `i + half` of head `h` are unit `h·half + i`.
    #[inline(always)]
    fn rows(&self, unit: u32) -> (usize, usize) {
        let r = (unit / self.half * self.head_dim + unit % self.half) as usize;
        (r, r + self.half as usize)
    }

    #[inline(always)]
    fn run<W: Weights>(&self, w: W, block: u32, blocks: u32) {
        let dots = |unit, part| {
            let (r0, r1) = self.rows(unit);
            let rows = [(&w, r0), (&w, r1)];
            let ([a, b], ss) =
                unsafe { gemv_dots::<W, _, true, 2>(rows, &self.x, self.n_in, part, self.split) };
            [a, b, ss]
        };
        let out = |unit, [a, b, ss]: [f32; 3]| {
            let (r0, r1) = self.rows(unit);
            let s = rms_scale(ss, self.n_in, self.eps);
            let (a, b) = (
                a * s + bias_at(self.bias, r0),
                b * s + bias_at(self.bias, r1),
            );
            // `cpu::rope_neox`'s rotation, operation for operation.
            let (a, b) = match self.rope {
                Some(t) => {
                    let t = unsafe { t.add(2 * (unit % self.half) as usize) };
                    let (cos, sin) = unsafe { (*t, *t.add(1)) };
                    (a * cos - b * sin, a * sin + b * cos)
                }
                None => (a, b),
            };
            unsafe { (*self.out.add(r0), *self.out.add(r1)) = (a, b) };
        };
        for_units(self.n_pairs, self.split, block, blocks, dots, out);
    }
}

/// `h[r] = silu(w_gate[r]·xn)·(w_up[r]·xn)` for `r` in `0..n_out`, with `xn = rms_norm(x)·norm`
/// (`n_in` long) and `silu(g) = g / (1 + e^-g)`, `e^x` by `ex2.approx` as in `silu_mul`. Gate
/// and up have the one type id `ty`. Units are rows `r` of both matrices, one warp computing
/// both products, so that they meet in registers; each warp holds its share of `x ∘ norm` in
/// registers ([`Held`]): `n_in <= 1024·split`.
/// Grid: any number of blocks (they stride over the rows); block: a multiple of `32·split`
/// threads (at most 16 warps), `split` a power of two; shared: 32 f32.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "gpu-kernel" fn ffn_gate_up(
    h: *mut f32,
    x: *const f32,
    norm: *const f32,
    eps: f32,
    w_gate: *const u8,
    w_up: *const u8,
    ty: u32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    let (x, s) = Held::new(&Normed { x, g: norm }, n_in, eps, split);
    with_weights!(ty, W => {
        let (gate, up) = (W::new(w_gate, n_in), W::new(w_up, n_in));
        let dots = |r: u32, part| {
            let rows = [(&gate, r as usize), (&up, r as usize)];
            unsafe { gemv_dots::<W, _, true, 2>(rows, &x, n_in, part, split) }.0
        };
        let out = |r: u32, [g, u]: [f32; 2]| {
            let (g, u) = (g * s, u * s);
            unsafe { *h.add(r as usize) = g / (1.0 + exp(-g)) * u };
        };
        for_units(n_out, split, block(), grid_dim(), dots, out)
    })
}

/// `y[r] += w[r]·v + bias[r]` for `r` in `0..n_out` (`v` `n_in` long, `bias` may be null), in
/// place on the residual stream. Units are rows. Grid: any number of blocks (they stride over
/// the rows); block: a multiple of `32·split` threads, `split` a power of two; shared: 1 f32
/// per warp.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "gpu-kernel" fn gemv_residual(
    y: *mut f32,
    v: *const f32,
    w: *const u8,
    ty: u32,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    with_weights!(ty, W => {
        let w = W::new(w, n_in);
        let dots = |r: u32, part| {
            let rows = [(&w, r as usize)];
            unsafe { gemv_dots::<W, _, true, 1>(rows, &v, n_in, part, split) }.0
        };
        let out = |r: u32, [s]: [f32; 1]| {
            let r = r as usize;
            unsafe { *y.add(r) += s + bias_at(bias, r) };
        };
        for_units(n_out, split, block(), grid_dim(), dots, out)
    })
}

/// `logits[r] = w[r]·xn` for `r` in `0..n_out`, with `xn = rms_norm(x)·norm` (`n_in` long).
/// Units are rows; each warp holds its share of `x ∘ norm` in registers ([`Held`]):
/// `n_in <= 1024·split`. With `best` non-null, also `best[0]` = the arg-max of the logits (`better`'s
/// order: first index on ties, NaN never; `u32::MAX` if all are NaN), fused: each thread keeps
/// the best of its rows, the block merges them in shared memory and then into `scratch[0]`
/// by one 64-bit atomic max on a key in the same order (`best_key`), and the last block to
/// finish (by the count in `scratch[1]`) writes `best[0]` and zeroes both words for the next
/// launch. `scratch` = 2 u64, zero before the first launch.
/// Grid: any number of blocks (they stride over the rows); block: a multiple of `32·split`
/// threads (at most 32 warps), `split` a power of two; shared: 32 f32.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "gpu-kernel" fn logits(
    logits: *mut f32,
    x: *const f32,
    norm: *const f32,
    eps: f32,
    w: *const u8,
    ty: u32,
    n_in: u32,
    n_out: u32,
    split: u32,
    best: *mut u32,
    scratch: *mut u64,
) {
    let (x, scale) = Held::new(&Normed { x, g: norm }, n_in, eps, split);
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    with_weights!(ty, W => {
        let w = W::new(w, n_in);
        let dots = |r: u32, part| {
            let rows = [(&w, r as usize)];
            unsafe { gemv_dots::<W, _, true, 1>(rows, &x, n_in, part, split) }.0
        };
        let out = |r: u32, [s]: [f32; 1]| {
            let v = s * scale;
            unsafe { *logits.add(r as usize) = v };
            if better(v, r, bv, bi) {
                (bv, bi) = (v, r);
            }
        };
        for_units(n_out, split, block(), grid_dim(), dots, out)
    });
    if !best.is_null() {
        grid_argmax(bv, bi, best, scratch);
    }
}

/// A u64 ordered as `better` orders (value, index) pairs: larger values first (-0 equal to
/// +0), then smaller indices; NaN gives 0, below every other key.
#[inline(always)]
fn best_key(v: f32, i: u32) -> u64 {
    if v.is_nan() {
        return 0;
    }
    let b = (v + 0.0).to_bits();
    let ord = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (ord as u64) << 32 | !i as u64
}

/// `logits`' arg-max over the grid from each thread's best `(v, i)` (`i == u32::MAX`: none).
/// Every thread of every block must call it; shared: 8 bytes.
#[inline(always)]
fn grid_argmax(v: f32, i: u32, best: *mut u32, scratch: *mut u64) {
    // The meetings are over (their last barrier passed): the shared memory is free.
    let slot = shared::<u64>();
    if thread() == 0 {
        unsafe { *slot = 0 };
    }
    sync_threads();
    if i != u32::MAX {
        // SAFETY: the block's slot in shared memory, only used atomically until the barrier.
        unsafe { AtomicU64::from_ptr(slot) }.fetch_max(best_key(v, i), Relaxed);
    }
    sync_threads();
    if thread() != 0 {
        return;
    }
    // SAFETY: the two scratch words in global memory are only used atomically while blocks
    // of this launch run.
    let (key, count) = unsafe {
        (
            AtomicU64::from_ptr(scratch),
            AtomicU32::from_ptr(scratch.add(1) as *mut u32),
        )
    };
    key.fetch_max(unsafe { *slot }, Relaxed);
    // Release: the max is in before the count says so.
    threadfence();
    if count.fetch_add(1, Relaxed) + 1 == grid_dim() {
        // Acquire: every block's max is read after its count.
        threadfence();
        let k = key.swap(0, Relaxed);
        count.store(0, Relaxed);
        unsafe { *best = if k == 0 { u32::MAX } else { !(k as u32) } };
    }
}
