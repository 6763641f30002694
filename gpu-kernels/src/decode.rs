//! The fused kernels of one decode step (one token), each one pass over its weights through
//! the GEMV of matmul.rs (`gemv_units`) with the steps around it done in registers:
//!
//! - `attn_qkv`: RMSNorm, the q, k and v projections with their biases, NeoX RoPE on q and k,
//!   and k and v into row `pos[0]` of the KV cache (whose rows `0..=pos[0]` it also brings
//!   into L2 for the attention kernel after it, below `ONE_TILE_KEYS` keys), and zeroes the
//!   sums that the attention adds into;
//! - `attn_output`: `y += wo·v` with `v` the attention's sums normalised as they are loaded
//!   (the attention's split-K combine), the attention output projection;
//! - `ffn_gate_up`: RMSNorm and SwiGLU's `silu(w_gate·x)·(w_up·x)`;
//! - `gemv_residual`: `y += w·v + bias`, the FFN down projection;
//! - `logits`: RMSNorm, the vocabulary projection and, optionally, its arg-max;
//! - `logit_bounds` and `argmax_bounded` (`_q8_0`, `_f16`): greedy decoding's arg-max of a
//!   vocabulary projection in two passes, the first bounding every logit from the top bits
//!   of its weights (q8_0: 18 of each chunk's 34 bytes; f16: the high bytes), the second
//!   computing only the rows that can win.
//!
//! CPU twins: the compositions of `orcd::cpu::{rms_norm, matmul, rope_neox, silu_mul, add,
//! argmax}` the forward pass runs, and `orcd::cpu::{logit_bounds_q8_0, logit_bounds_f16}`.
//!
//! An RMSNorm ahead of a GEMV is no pass of its own: `w·(x·s ∘ g) = s·(w·(x ∘ g))`, so the
//! block stages `x ∘ g` in shared memory (`matmul::stage`) and sums `x²` from the same loads,
//! each lane takes its chunk ([`Held`]), and the scale `s = 1/sqrt(mean(x²) + eps)` multiplies
//! the finished products. The first round's weight loads are issued before the norm's barrier.
//! FFN gate/up and down stage their vector as two int8 digits an element for packed weights,
//! and greedy's first pass turns each lane's chunk into them (`quant::digits4`), so that their
//! dots run on `dp4a`.
//!
//! The weights are a matrix (packed, or plain floats) and its ggml type id; each block
//! dispatches once on the id (`with_weights!`), so the loops are monomorphised per format. The
//! host checks that rows are whole chunks of 32, at most `32·split` of them, and that every
//! vector and matrix starts 16-byte aligned, so only the GEMV's vector-load path is built here.
//!
//! Work comes in GEMV units (two output rows that are used together), `split` warps per unit;
//! a block runs `blockDim / 32 / split` units at a time and strides over the grid.
use core::arch::nvptx;
use core::cell::Cell;
use core::intrinsics::sqrtf32;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::attention::{ONE_TILE_KEYS, Sums};
use crate::matmul::{
    GgmlType, Held, Plain, Vector, Weights, after_staging, gemv_units, lane_chunk, stage,
    with_weights,
};
use crate::params::{
    ArgmaxBounded, AttnOutput, AttnQkv, FfnGateUp, GemvResidual, LogitBounds, Logits,
};
use crate::quant::{DIGIT_RADIUS, Packed, Q8_0, RADIUS, TopChunk, id, prmt};
use crate::sampling::{best_key, end_step};
use crate::util::{
    WARP, allow_next_grid, ballot, better, block, block_dim, block_sum, count_last, exp, fma,
    from_lane, grid_dim, load_early, load_streaming, prefetch_l2, shared, sync_threads, thread,
    wait_prior_grids, warp_max_u32, warp_sum,
};

/// This lane's chunk of `x ∘ g` (`n_in` long) for `split` warps per unit, staged by the block
/// (as digits with `DIGITS`, see `matmul::stage`), and the RMSNorm's scale `1/sqrt(mean(x²) +
/// eps)` (correctly rounded square root and division, as the CPU's). Every thread of the block
/// must call it (it syncs).
#[inline(always)]
fn held_norm<W: Weights, const DIGITS: bool>(
    x: *const f32,
    g: *const f32,
    n_in: u32,
    eps: f32,
    split: u32,
) -> (Held, f32) {
    let ss = stage::<W, DIGITS>(x, Some(g), n_in);
    // The sum's barrier also publishes the staged vector.
    let s = 1.0 / sqrtf32(block_sum(ss) / n_in as f32 + eps);
    let c = lane_chunk(split, n_in / 32);
    (Held::staged::<W, DIGITS>(c, n_in / 32), s)
}

/// `bias[r]` by `load_early`, or 0 for a null bias.
#[inline(always)]
fn bias_early(bias: *const f32, r: usize) -> f32 {
    if bias.is_null() {
        0.0
    } else {
        load_early(unsafe { bias.add(r) })
    }
}

/// `q = rope(wq·xn + bq)`, and `k = rope(wk·xn + bk)`, `v = wv·xn + bv` into row `pos[0]` of
/// `k_cache, v_cache = [max_pos, n_kv·head_dim]`, with `xn = rms_norm(x)·norm` (`n_in` long)
/// and NeoX RoPE at position `pos[0]` from `rope = [positions, head_dim/2, 2]` (cos, sin).
/// Traps when `pos[0] >= max_pos` (the smaller of the cache's and the table's positions).
/// Each weight matrix has its own type id and may have a null bias. Also zeroes `sums =
/// [n_heads·(head_dim + 1)]` f64, which `attention_decode` adds into next.
///
/// Units are the rows `i` and `i + head_dim/2` of a head, which RoPE rotates together.
/// Grid: `q_blocks + 2·kv_blocks`: the first `q_blocks` blocks compute q, the next `kv_blocks`
/// k, the last `kv_blocks` v, each block `blockDim / 32 / split` units at a time. Block: a
/// multiple of `32·split` threads; shared: as `matmul::stage` says.
#[inline(always)]
pub(crate) unsafe fn attn_qkv<const F: u32>(p: AttnQkv) {
    let AttnQkv {
        q,
        k_cache,
        v_cache,
        x,
        norm,
        eps,
        wq,
        ty_q,
        bq,
        wk,
        ty_k,
        bk,
        wv,
        ty_v,
        bv,
        pos,
        rope,
        n_in,
        n_heads,
        n_kv,
        head_dim,
        max_pos,
        q_blocks,
        kv_blocks,
        split,
        sums,
    } = p;
    let b = block();
    // (weights, type, bias, output, its row stride per position, heads, rotated, the matrix's
    // first block and blocks)
    let kv_dim = (n_kv * head_dim) as usize;
    let (w, ty, bias, out, stride, heads, rotate, b0, blocks) = if b < q_blocks {
        (wq, ty_q, bq, q, 0, n_heads, true, 0, q_blocks)
    } else if b < q_blocks + kv_blocks {
        (
            wk, ty_k, bk, k_cache, kv_dim, n_kv, true, q_blocks, kv_blocks,
        )
    } else {
        let kv_end = q_blocks + kv_blocks;
        (
            wv, ty_v, bv, v_cache, kv_dim, n_kv, false, kv_end, kv_blocks,
        )
    };
    let half = head_dim / 2;
    let proj = Qkv {
        bias,
        out,
        stride,
        rope: rotate.then_some(rope),
        half,
        head_dim,
    };
    with_weights!(F, ty, W => {
        let w = W::new(w, heads * head_dim, n_in);
        // The position is read after the wait for the kernels before (it is theirs).
        let held = || {
            // The attention's sums, after the wait: the kernel that last read them, the previous
            // step's attn_output of this layer, has finished.
            let mut i = (b * block_dim() + thread()) as usize;
            while i < (n_heads * (head_dim + 1)) as usize {
                unsafe { *sums.add(i) = 0.0 };
                i += (grid_dim() * block_dim()) as usize;
            }
            let p = unsafe { *pos };
            // The norm's loads fly with the position's; the check waits for both.
            let (x, s) = held_norm::<W, false>(x, norm, n_in, eps, split);
            if p >= max_pos {
                unsafe { nvptx::trap() };
            }
            // The attention after this kernel reads rows 0..=p of both caches, long evicted
            // by the weights of the layers since: into L2 while the projections run, as long
            // as its blocks have one tile each. Beyond, a block loads each tile during the
            // one before's math, and bringing every row in here holds this kernel back more
            // than it saves.
            if p < ONE_TILE_KEYS {
                let bytes = (p as usize + 1) * kv_dim * 4;
                prefetch_l2(k_cache, bytes);
                prefetch_l2(v_cache, bytes);
            }
            (x, (s, p))
        };
        proj.run(&w, held, heads * half, n_in / 32, split, b - b0, blocks)
    })
}

/// One of `attn_qkv`'s three projections.
struct Qkv {
    bias: *const f32,
    /// q, or a cache whose row `p` (`stride` floats each) is written.
    out: *mut f32,
    stride: usize,
    /// The table `[positions, head_dim/2, 2]` (cos, sin), or None for v.
    rope: Option<*const f32>,
    half: u32,
    head_dim: u32,
}

impl Qkv {
    /// Rows `i` and `i + half` of head `h` are unit `h·half + i`.
    #[inline(always)]
    fn rows(&self, unit: u32) -> (usize, usize) {
        let r = (unit / self.half * self.head_dim + unit % self.half) as usize;
        (r, r + self.half as usize)
    }

    /// `held` gives this lane's chunk of the normed `x`, the norm's scale and the position.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn run<W: Weights>(
        &self,
        w: &W,
        held: impl FnOnce() -> (Held, (f32, u32)),
        n_pairs: u32,
        chunks: u32,
        split: u32,
        block: u32,
        blocks: u32,
    ) {
        let rows = |unit| {
            let (r0, r1) = self.rows(unit);
            [(w, r0), (w, r1)]
        };
        let out = |unit, (s, p): (f32, u32)| {
            let (r0, r1) = self.rows(unit);
            let bias = [r0, r1].map(|r| bias_early(self.bias, r));
            // Row `p` of the table.
            let rope = self.rope.map(|t| {
                let at = unsafe { t.add(2 * (p * self.half + unit % self.half) as usize) };
                unsafe { (load_early(at), load_early(at.add(1))) }
            });
            let out = unsafe { self.out.add(p as usize * self.stride) };
            move |[a, b]: [f32; 2]| {
                let (a, b) = (a * s + bias[0], b * s + bias[1]);
                // `cpu::rope_neox`'s rotation, operation for operation.
                let (a, b) = match rope {
                    Some((cos, sin)) => (a * cos - b * sin, a * sin + b * cos),
                    None => (a, b),
                };
                unsafe { (*out.add(r0), *out.add(r1)) = (a, b) };
            }
        };
        gemv_units::<W, _, _, true, true, false>(
            held, chunks, n_pairs, split, block, blocks, rows, out,
        );
    }
}

/// `h[r] = silu(w_gate[r]·xn)·(w_up[r]·xn)` for `r` in `0..n_out`, with `xn = rms_norm(x)·norm`
/// (`n_in` long) and `silu(g) = g / (1 + e^-g)`, `e^x` by `ex2.approx` as in `silu_mul`. Gate
/// and up have the one type id `ty`. Units are rows `r` of both matrices, so that the two
/// products meet in registers. Grid: any number of blocks (they stride over the rows); block:
/// a multiple of `32·split` threads; shared: as `matmul::stage` says.
#[inline(always)]
pub(crate) unsafe fn ffn_gate_up<const F: u32>(p: FfnGateUp) {
    let FfnGateUp {
        h,
        x,
        norm,
        eps,
        w_gate,
        w_up,
        ty,
        n_in,
        n_out,
        split,
    } = p;
    with_weights!(F, ty, W => {
        let (gate, up) = (W::new(w_gate, n_out, n_in), W::new(w_up, n_out, n_in));
        let held = || held_norm::<W, true>(x, norm, n_in, eps, split);
        let rows = |r: u32| [(&gate, r as usize), (&up, r as usize)];
        let out = |r: u32, s: f32| {
            move |[g, u]: [f32; 2]| {
                let (g, u) = (g * s, u * s);
                unsafe { *h.add(r as usize) = g / (1.0 + exp(-g)) * u };
            }
        };
        gemv_units::<W, f32, _, true, false, true>(held, n_in / 32, n_out, split, block(), grid_dim(), rows, out)
    })
}

/// `y[r] += w[r]·v + bias[r]` for `r` in `0..n_out` (`v` `n_in` long, `bias` may be null), in
/// place on the residual stream. See `residual`.
#[inline(always)]
pub(crate) unsafe fn gemv_residual<const F: u32>(p: GemvResidual) {
    let GemvResidual {
        y,
        v,
        w,
        ty,
        bias,
        n_in,
        n_out,
        split,
    } = p;
    unsafe { residual::<F, false, true>(y, v, w, ty, bias, n_in, n_out, split) }
}

/// `y[r] += w[r]·v` for `r` in `0..n_out`, with `v` the decode attention's `sums`
/// (`attention_decode`'s, `n_in = n_heads·head_dim`, `head_dim % 4 == 0`) normalised as they
/// are staged: the attention output projection, which so ends the attention's split-K. Staged
/// for every type (each lane loading its own chunk of the f64 sums was 7% slower with f16
/// weights). See `residual`.
#[inline(always)]
pub(crate) unsafe fn attn_output<const F: u32>(p: AttnOutput) {
    let AttnOutput {
        y,
        sums,
        head_dim,
        w,
        ty,
        n_in,
        n_out,
        split,
    } = p;
    let v = Sums {
        sums,
        n: n_in,
        head_dim,
    };
    unsafe { residual::<F, true, false>(y, v, w, ty, core::ptr::null(), n_in, n_out, split) }
}

/// `y[r] += w[r]·v + bias[r]` for `r` in `0..n_out` (`v` `n_in` long, `bias` may be null), in
/// place on the residual stream. Units are pairs of rows. For packed weights, or with
/// `STAGED`, each block stages `v` once in shared memory for all its units (so that few blocks
/// of many units read few copies of it), as digits with `DIGITS` (`matmul::stage`). Grid: a
/// block for every `blockDim / 32 / split` units, each one round (`gemv_units`' `ONE`); block:
/// a multiple of `32·split` threads; shared: 2 f32 per warp, or staged as `matmul::stage` says.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn residual<const F: u32, const STAGED: bool, const DIGITS: bool>(
    y: *mut f32,
    v: impl Vector,
    w: *const u8,
    ty: u32,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    let chunks = n_in / 32;
    let c = lane_chunk(split, chunks);
    with_weights!(F, ty, W => {
        let w = W::new(w, n_out, n_in);
        let units = n_out.div_ceil(2);
        // Staged where the host launches few blocks of many units (packed weights, and the
        // attention's sums); else each lane loads its own chunk, with no barrier for its loads
        // to wait behind.
        let staged = STAGED || family::serves(family::PACKED, F);
        let held = || {
            if staged {
                stage::<W, DIGITS>(v, None, n_in);
                sync_threads();
                (Held::staged::<W, DIGITS>(c, chunks), ())
            } else {
                (Held::load::<W, true>(v, c, n_in), ())
            }
        };
        let rows = |u: u32| [(&w, 2 * u as usize), (&w, (2 * u + 1).min(n_out - 1) as usize)];
        // The rows of y (and the bias) are loaded before the products, added after.
        let out = |u: u32, _| {
            let rows = [2 * u, (2 * u + 1).min(n_out - 1)].map(|r| r as usize);
            let old = rows.map(|r| (load_early(unsafe { y.add(r) }), bias_early(bias, r)));
            move |sums: [f32; 2]| {
                for (j, s) in sums.into_iter().enumerate() {
                    if 2 * u + (j as u32) < n_out {
                        let (y0, b) = old[j];
                        unsafe { *y.add(rows[j]) = y0 + (s + b) };
                    }
                }
            }
        };
        gemv_units::<W, (), _, true, true, DIGITS>(held, chunks, units, split, block(), grid_dim(), rows, out)
    })
}

/// `logits[r] = w[r]·xn` for `r` in `0..n_out`, with `xn = rms_norm(x)·norm` (`n_in` long).
/// Units are pairs of rows. With `best` non-null, also `best[0]` = the arg-max of the logits
/// (`better`'s order: first index on ties, NaN never; `u32::MAX` if all are NaN), fused: each
/// thread keeps the best of its rows, the block merges them in shared memory and then into
/// `scratch[0]` by one 64-bit atomic max on a key in the same order (`best_key`), and the last
/// block to finish (by the count in `scratch[1]`) writes `best[0]` and zeroes both words for
/// the next launch. `scratch` = 2 u64, zero before the first launch. With `tokens` non-null
/// too, that block also ends the greedy decode step, as `sample` ends a sampled one
/// (`sampling::end_step`, an all-NaN arg-max taken as token 0, as the CPU sampler does):
/// no kernel of its own between this one and the next step's.
/// Grid: any number of blocks (they stride over the units); block: a multiple of `32·split`
/// threads (at most 32 warps); shared: as `matmul::stage` says.
#[inline(always)]
pub(crate) unsafe fn logits<const F: u32>(p: Logits) {
    let Logits {
        logits,
        x,
        norm,
        eps,
        w,
        ty,
        n_in,
        n_out,
        split,
        best,
        scratch,
        tokens,
        n_tokens,
        pos,
        step,
    } = p;
    // This thread's best (value, index), kept by the finishers.
    let best_here = Cell::new((f32::NEG_INFINITY, u32::MAX));
    with_weights!(F, ty, W => {
        let w = W::new(w, n_out, n_in);
        let held = || held_norm::<W, false>(x, norm, n_in, eps, split);
        let rows = |u: u32| [(&w, 2 * u as usize), (&w, (2 * u + 1).min(n_out - 1) as usize)];
        let best_here = &best_here;
        let out = |u: u32, scale: f32| {
            move |sums: [f32; 2]| {
                for (r, s) in [2 * u, 2 * u + 1].into_iter().zip(sums) {
                    if r < n_out {
                        let v = s * scale;
                        unsafe { *logits.add(r as usize) = v };
                        let (bv, bi) = best_here.get();
                        if better(v, r, bv, bi) {
                            best_here.set((v, r));
                        }
                    }
                }
            }
        };
        let units = n_out.div_ceil(2);
        gemv_units::<W, f32, _, true, false, false>(held, n_in / 32, units, split, block(), grid_dim(), rows, out)
    });
    if !best.is_null() {
        let (bv, bi) = best_here.get();
        grid_argmax(bv, bi, best, scratch, (tokens, n_tokens, pos, step));
    }
}

/// `logits`' arg-max over the grid from each thread's best `(v, i)` (`i == u32::MAX`: none),
/// and the end of the step (`end_step`'s arguments after the token) unless `tokens` is null.
/// Every thread of every block must call it; shared: 8 bytes.
#[inline(always)]
fn grid_argmax(
    v: f32,
    i: u32,
    best: *mut u32,
    scratch: *mut u64,
    (tokens, n_tokens, pos, step): (*mut u32, u32, *mut u32, *mut u64),
) {
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
    let key = unsafe { AtomicU64::from_ptr(scratch) };
    key.fetch_max(unsafe { *slot }, Relaxed);
    // The count releases the max; the last block's acquires every block's.
    if unsafe { count_last(scratch.wrapping_add(1) as *mut u32, grid_dim()) } {
        let k = key.swap(0, Relaxed);
        let token = if k == 0 { u32::MAX } else { !(k as u32) };
        if tokens.is_null() {
            unsafe { *best = token };
        } else {
            let token = if token == u32::MAX { 0 } else { token };
            unsafe { end_step(token, best, tokens, n_tokens, pos, step) };
        }
    }
}

/// The ordered key of a bound: larger floats give larger keys; NaN gives 0, below all.
#[inline(always)]
fn bound_key(v: f32) -> u32 {
    (best_key(v, 0) >> 32) as u32
}

/// The bound of a key of [`bound_key`]; 0 (no bound) gives -inf.
#[inline(always)]
fn key_bound(k: u32) -> f32 {
    match k {
        0 => f32::NEG_INFINITY,
        k if k >> 31 == 1 => f32::from_bits(k & 0x7fff_ffff),
        k => f32::from_bits(!k),
    }
}

/// How far the first pass widens its radius: past the float roundings of its estimate and of
/// `logits`' own sums (each a few 2^-24 of what the radius is a share of: under 2^-11 of it).
const SLACK: f32 = 1.0 / 256.0;

/// What greedy decoding's first pass reads of a vocabulary projection, the top bits of its
/// weights, and what it makes of them: a chunk's product with `x` as an estimate and a radius
/// that holds the exact product, float roundings included.
pub(crate) trait Sketch {
    /// The matrix's own format, which the second pass computes exactly.
    type W: Weights;
    /// A lane's chunk of the top bits.
    type Top: Copy;
    /// The `[rows, n_in]` matrix at `w` and (where the sketch has one) its plane of top bits
    /// at `plane`.
    fn new(w: *const u8, plane: *const u8, rows: u32, n_in: u32) -> Self;
    /// Chunk `c` of `row`, read once.
    unsafe fn top(&self, row: usize, c: u32) -> Self::Top;
    /// The lane's chunk of `x` and its `Σ|x|` (unscaled) as `bound` takes them.
    fn prepare(x: Held, x_abs: f32) -> (Held, f32);
    /// `(estimate, radius)` of the chunk's product with the lane's `x` and `x_abs`, as
    /// `prepare` gives them.
    fn bound(top: &Self::Top, x: &Held, x_abs: f32) -> (f32, f32);
}

/// A q8_0 matrix: 18 of each chunk's 34 bytes, the quants' high nibbles and the scale
/// (`quant::Packed::bound`); it needs no plane of its own.
pub(crate) struct Q8Sketch {
    w: Packed<Q8_0>,
}

impl Sketch for Q8Sketch {
    type W = Packed<Q8_0>;
    type Top = TopChunk;

    #[inline(always)]
    fn new(w: *const u8, _plane: *const u8, rows: u32, n_in: u32) -> Self {
        Q8Sketch {
            w: Packed::new(w, rows, n_in),
        }
    }

    #[inline(always)]
    unsafe fn top(&self, row: usize, c: u32) -> TopChunk {
        unsafe { self.w.top_chunk(row, c) }
    }

    /// The lane's chunk as digits (taken once a pass), and `Σ|x|` widened
    /// to cover them (`quant::DIGIT_RADIUS`).
    #[inline(always)]
    fn prepare(x: Held, x_abs: f32) -> (Held, f32) {
        let x = x.digits(1.0 / Packed::<Q8_0>::X_SCALE);
        let x_abs = x_abs + DIGIT_RADIUS * x.unit();
        (x, x_abs)
    }

    #[inline(always)]
    fn bound(top: &TopChunk, x: &Held, x_abs: f32) -> (f32, f32) {
        let (e, m) = Packed::<Q8_0>::bound(top, x, x_abs);
        (e, (RADIUS + SLACK) * m)
    }
}

/// An f16 matrix and the plane of its weights' high bytes (sign, exponent, the top 2 mantissa
/// bits; `quant::high_bytes`): half its bytes. A weight `w` whose high byte reads `t` lies in
/// `[t, t + 2^(E-17))` by magnitude (E its exponent, 1 for subnormals), so `1.125·t` is within
/// `0.125·|t| + 2^-16` of it.
pub(crate) struct F16Sketch {
    top: *const u8,
    n_in: usize,
}

impl Sketch for F16Sketch {
    type W = Plain<f16>;
    type Top = [u32; 8];

    #[inline(always)]
    fn new(_w: *const u8, plane: *const u8, _rows: u32, n_in: u32) -> Self {
        F16Sketch {
            top: plane,
            n_in: n_in as usize,
        }
    }

    /// The high bytes of chunk `c`'s weights, in `Plain`'s order (`Weights::group_at`).
    #[inline(always)]
    unsafe fn top(&self, row: usize, c: u32) -> [u32; 8] {
        let n_chunks = self.n_in as u32 / 32;
        let group = |g: u32| {
            let k = Plain::<f16>::group_at(c, g, n_chunks) as usize;
            unsafe { load_streaming(self.top.wrapping_add(row * self.n_in + k) as *const [u32; 2]) }
        };
        let (g0, g1, g2, g3) = (group(0), group(1), group(2), group(3));
        [g0[0], g0[1], g1[0], g1[1], g2[0], g2[1], g3[0], g3[1]]
    }

    /// Floats, as staged.
    #[inline(always)]
    fn prepare(x: Held, x_abs: f32) -> (Held, f32) {
        (x, x_abs)
    }

    #[inline(always)]
    fn bound(top: &[u32; 8], x: &Held, x_abs: f32) -> (f32, f32) {
        let (mut e, mut m) = ([0.0f32; 2], [0.0f32; 2]);
        // Word `q`: its bytes 0 and 1, 2 and 3 as the high bytes of two halves each.
        let mut word = |q: usize| {
            let (lo, hi) = (prmt(top[q], 0, 0x1404), prmt(top[q], 0, 0x3424));
            let t = [lo as u16, (lo >> 16) as u16, hi as u16, (hi >> 16) as u16];
            for k in 0..4 {
                let (t, v) = (f16::from_bits(t[k]) as f32, x.x[4 * q + k]);
                e[k % 2] = fma(t, v, e[k % 2]);
                m[k % 2] = fma(t.abs(), v.abs(), m[k % 2]);
            }
        };
        // Written out: a loop over the words would keep `x` in local memory.
        word(0);
        word(1);
        word(2);
        word(3);
        word(4);
        word(5);
        word(6);
        word(7);
        (
            1.125 * (e[0] + e[1]),
            (0.125 + SLACK) * (m[0] + m[1]) + x_abs / 65536.0,
        )
    }
}

/// Greedy decoding's first pass over a vocabulary projection of sketch `S`: for every row `r`,
/// `upper[r]` >= `logits[r]` as `logits` computes it (`xn = rms_norm(x)·norm`, `n_in` <= 1024
/// long), and `lower[block]` = the [`bound_key`] of the largest lower bound over the block's rows
/// (0 for none), each `s·(estimate ± radius)` from `S::bound`. Only rows whose upper bound
/// reaches the largest lower bound can be the arg-max: [`argmax_bounded`] computes those
/// exactly. Units are four rows, one warp each; shared: as `matmul::stage` says, for one warp
/// per unit. Grid: any number of blocks (they stride over the units), `lower` holds one word
/// per block; block: a multiple of 32 threads (at most 32 warps).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn logit_bounds_with<S: Sketch>(
    upper: *mut f32,
    lower: *mut u32,
    x: *const f32,
    norm: *const f32,
    eps: f32,
    w: *const u8,
    plane: *const u8,
    n_in: u32,
    n_out: u32,
) {
    let w = S::new(w, plane, n_out, n_in);
    let n_chunks = n_in / 32;
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let (live, c) = (lane < n_chunks, lane_chunk(1, n_chunks));
    let (units, stride) = (n_out.div_ceil(4), grid_dim() * warps);
    let row = |u: u32, k: u32| (4 * u.min(units - 1) + k).min(n_out - 1);
    // Units past the end load the last one again, so that every load is unconditional. Four
    // rows a warp: what a warp has in flight is what keeps this pass near the DRAM's pace,
    // more than the blocks an SM that fewer registers would allow.
    let load = |u: u32| unsafe {
        (
            w.top(row(u, 0) as usize, c),
            w.top(row(u, 1) as usize, c),
            w.top(row(u, 2) as usize, c),
            w.top(row(u, 3) as usize, c),
        )
    };
    let mut u = block() * warps + warp;
    let mut chunks = load(u);
    wait_prior_grids();
    allow_next_grid();
    let (xs, s) = held_norm::<S::W, false>(x, norm, n_in, eps, 1);
    let mut x_abs = 0.0;
    for i in 0..32 {
        x_abs += xs.x[i].abs();
    }
    let (xs, x_abs) = S::prepare(xs, x_abs / S::W::X_SCALE);
    let mut most = 0u32;
    while u < units {
        let next = load(u + stride);
        // The row's (upper, lower) bound.
        let bound = |top: &S::Top| {
            let (e, r) = S::bound(top, &xs, x_abs);
            let (e, r) = (
                warp_sum(if live { e } else { 0.0 }),
                warp_sum(if live { r } else { 0.0 }),
            );
            (s * (e + r), s * (e - r))
        };
        let (b0, b1, b2, b3) = (
            bound(&chunks.0),
            bound(&chunks.1),
            bound(&chunks.2),
            bound(&chunks.3),
        );
        if lane == 0 {
            // Written out: an array of them would live in local memory.
            unsafe { *upper.add(row(u, 0) as usize) = b0.0 };
            unsafe { *upper.add(row(u, 1) as usize) = b1.0 };
            unsafe { *upper.add(row(u, 2) as usize) = b2.0 };
            unsafe { *upper.add(row(u, 3) as usize) = b3.0 };
            most = most.max(bound_key(b0.1)).max(bound_key(b1.1));
            most = most.max(bound_key(b2.1)).max(bound_key(b3.1));
        }
        chunks = next;
        u += stride;
    }
    // The block's largest, through the reductions' slots (free since the norm's sum).
    let slots = shared::<u32>();
    if lane == 0 {
        unsafe { *slots.add(warp as usize) = most };
    }
    sync_threads();
    if thread() == 0 {
        for k in 1..warps {
            most = most.max(unsafe { *slots.add(k as usize) });
        }
        unsafe { *lower.add(block() as usize) = most };
    }
}

/// Greedy decoding's second pass: `best[0]` = the arg-max of the logits of `logits` (same
/// rules, and the same value for every row it computes: the same staged vector, products and
/// sums), from the bounds of [`logit_bounds`], the grid before this one: the threshold `T` is
/// the largest of its `n_lower` lower bounds, and only rows with `upper[r] >= T` (or NaN) are
/// computed, as every row at least as large as the arg-max is. Ends the step as `logits` does
/// (`grid_argmax`, `scratch` its 2 u64, zero). Each block takes a contiguous share of the rows,
/// lists those that pass in shared memory, and its warps take the list's rows in turn. Grid:
/// any; block: a multiple of 32 threads (at most 32 warps); shared: as `matmul::stage` says,
/// for one warp per unit, then `1 + ceil(n_out / grid)` words (the list and its length).
#[inline(always)]
unsafe fn argmax_bounded_with<W: Weights>(p: ArgmaxBounded) {
    let ArgmaxBounded {
        best,
        scratch,
        upper,
        lower,
        n_lower,
        x,
        norm,
        eps,
        w,
        n_in,
        n_out,
        tokens,
        n_tokens,
        pos,
        step,
    } = p;
    let w = W::new(w, n_out, n_in);
    let n_chunks = n_in / 32;
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let (live, c) = (lane < n_chunks, lane_chunk(1, n_chunks));
    // The list's length, then the list.
    let count = after_staging(n_in);
    let list = count.wrapping_add(1);
    if thread() == 0 {
        // Published by the norm's barrier.
        unsafe { *count = 0 };
    }
    // `x` is final before the grid before this one passed its wait (see `wait_prior_grids`).
    let (xs, s) = held_norm::<W, false>(x, norm, n_in, eps, 1);
    wait_prior_grids();
    allow_next_grid();
    let share = n_out.div_ceil(grid_dim());
    let end = n_out.min((block() + 1) * share);
    // Two of the block's rows a thread: their upper bounds, loaded with the lower bounds
    // below (one L2 round trip for both).
    let uppers = |first: u32| {
        [0, 1].map(|k| {
            let r = first + k * block_dim() + thread();
            (r, unsafe { *upper.add(r.min(end - 1) as usize) })
        })
    };
    let mut first = block() * share;
    let mut next = uppers(first);
    // Loads in batches of `BATCH` a lane, all in flight at once: a loop of one load at a
    // time would wait for each in turn.
    const BATCH: u32 = 8;
    let mut t = 0u32;
    let mut i0 = 0;
    while i0 < n_lower {
        for k in 0..BATCH {
            let i = i0 + WARP * k + lane;
            if i < n_lower {
                t = t.max(unsafe { *lower.add(i as usize) });
            }
        }
        i0 += WARP * BATCH;
    }
    let t = key_bound(warp_max_u32(t));
    // The block's rows that may be the arg-max, onto the list: a warp's by one shared atomic.
    while first < end {
        let now = next;
        first += 2 * block_dim();
        if first < end {
            next = uppers(first);
        }
        let r = now.map(|(r, _)| r);
        let pass = now.map(|(r, u)| r < end && !(u < t));
        for k in 0..2 {
            let lanes = ballot(pass[k]);
            if lanes != 0 {
                let leader = lanes.trailing_zeros();
                let at = if lane == leader {
                    // SAFETY: the block's count in shared memory, only used atomically here.
                    unsafe { AtomicU32::from_ptr(count) }.fetch_add(lanes.count_ones(), Relaxed)
                } else {
                    0
                };
                let at = from_lane(at, leader) + (lanes & ((1 << lane) - 1)).count_ones();
                if pass[k] {
                    unsafe { *list.add(at as usize) = r[k] };
                }
            }
        }
    }
    sync_threads();
    let n = unsafe { *count };
    // Two rows a warp at a time, both loaded before either is used. The list's order is the
    // atomics', but `better` breaks ties by row, so the pick does not depend on it.
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    let mut i = warp;
    while i < n {
        let row = |i: u32| unsafe { *list.add(i.min(n - 1) as usize) };
        let (r0, r1) = (row(i), row(i + warps));
        let chunk = |r: u32| unsafe { w.load_chunk::<true>(r as usize, c) };
        let (c0, c1) = (chunk(r0), chunk(r1));
        // As `gemv_units` and `logits` compute it, bit for bit. Written out: an array of the
        // chunks would live in local memory.
        let mut take = |ch: &W::Chunk, r: u32| {
            let v = warp_sum(if live { W::dot(ch, &xs) } else { 0.0 }) * s;
            if better(v, r, bv, bi) {
                (bv, bi) = (v, r);
            }
        };
        take(&c0, r0);
        take(&c1, r1);
        i += 2 * warps;
    }
    grid_argmax(bv, bi, best, scratch, (tokens, n_tokens, pos, step));
}

/// The [`Sketch`] of the ggml types that greedy decoding's bounded arg-max serves.
pub(crate) trait Sketched {
    type S: Sketch;
}

impl Sketched for GgmlType<{ id::Q8_0 }> {
    type S = Q8Sketch;
}

impl Sketched for GgmlType<{ id::F16 }> {
    type S = F16Sketch;
}

/// Greedy decoding's first pass ([`logit_bounds_with`]) over a matrix of ggml type `TY`, one
/// entry point per type it serves (`Sketched`).
#[inline(always)]
pub(crate) unsafe fn logit_bounds<const TY: u32>(p: LogitBounds)
where
    GgmlType<TY>: Sketched,
{
    let LogitBounds {
        upper,
        lower,
        x,
        norm,
        eps,
        w,
        plane,
        n_in,
        n_out,
    } = p;
    unsafe {
        logit_bounds_with::<<GgmlType<TY> as Sketched>::S>(
            upper, lower, x, norm, eps, w, plane, n_in, n_out,
        )
    }
}

/// Greedy decoding's second pass ([`argmax_bounded_with`]) over a matrix of ggml type `TY`,
/// one entry point per type [`logit_bounds`] serves.
#[inline(always)]
pub(crate) unsafe fn argmax_bounded<const TY: u32>(p: ArgmaxBounded)
where
    GgmlType<TY>: Sketched,
{
    unsafe { argmax_bounded_with::<<<GgmlType<TY> as Sketched>::S as Sketch>::W>(p) }
}
