//! The batched pass's product `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` for 1 to 512 rows
//! (`gemm_rows_<type>`), over the weight formats of `matmul.rs` ([`Weights`]), and
//! row-independent: each output row's bits depend only on its own row of `x`, never on how
//! many rows the call has or what they hold. CPU twin: `orcd::cpu::matmul` on the dequantized
//! weights.
//!
//! Tensor cores (`mma.sync` m16n8k16, f16 products exact, f32 sums) on `x` and the weights
//! rounded to f16 (weights as the f16 weight path holds them; exact for f16 weights): each
//! product within ~2^-10 of |x·w|.
//!
//! Work: a block is `nw` warps, warp `v` owning 16 outputs (`NT` n8 tiles), all of them the
//! same `mt` m16 tiles of rows (1 to `MT`) and the same part of K: K's chunks of 32 are cut
//! into `kb` parts, part `p` the chunks `chunks·p / kb..chunks·(p + 1) / kb`. Block `b` takes
//! row tile `b % row_tiles`, part `b / row_tiles % kb` and output block `b / row_tiles / kb`.
//! Its rows of `x` come chunk by chunk into a ring of `STAGES` slots in shared memory by
//! `cp.async`, so the copy of the next chunks overlaps the products of this one, and every
//! warp reads its fragments there. Each lane loads its own weights straight into its
//! fragments, two chunks ahead, decoded when multiplied: within a chunk, lane
//! `(g, c)` (`g = lane / 4`, `c = lane % 4`) takes the 8 consecutive weights `8c..8c + 8` of
//! its output rows (`Weights::raw8`, then `decode8`: exactly `quant::dequantize`'s values) and
//! the same 8 elements of its rows of `x` from the ring. A product's k order is free, so the chunk's two k16 steps `s`
//! map the fragments' logical k `2c + e` to physical `8c + 4s + e` and `2c + 8 + e` to
//! `8c + 4s + 2 + e`, for `a` and `b` alike.
//!
//! With `kb > 1` the parts meet through global memory: each block writes its tile's sums to
//! its part's slot of `part`, and the block that counts last for the tile (`count_last`) adds
//! the parts in the order 0, 1, .., kb - 1, four outputs a thread with every part's load in
//! flight at once.
//!
//! Row independence: `kb` is chosen by the host from the matrix's shape alone, a row always
//! sits at the same place `t % 16` of an m16 tile (tiles start at multiples of 16), the mma
//! computes each output from its own row and column, and the sums run in the same order
//! whatever `mt` and `rows`. An output that is not finite (an operand beyond f16's range,
//! |v| >= 65520, or an inf or NaN input) is redone by its thread in f32 FMAs in k order: a
//! decision on the output's own value, so row-independent too.
use crate::matmul::{Format, GgmlType, Weights};
use crate::params::GemmRows;
use crate::util::{
    F32x4, WARP, allow_next_grid, block, block_dim, count_last, cp_async_commit, cp_async_wait,
    cp_async16, f16x2, fence_gpu, fma, grid_dim, load_l2x4, load_shared4, mma, shared, shared_addr,
    sync_threads, thread, wait_prior_grids,
};

use kernel_abi::gemm_rows::{ROW_FLOATS, STAGES, WARP_OUTS};

/// n8 output tiles per warp.
const NT: usize = kernel_abi::gemm_rows::NT as usize;
/// The most m16 row tiles per block (`mt`).
const MT: usize = kernel_abi::gemm_rows::MAX_MT as usize;
/// The most parts of K.
const MAX_PARTS: usize = kernel_abi::gemm_rows::MAX_PARTS as usize;

/// `bias[i]`, or 0 for a null bias.
#[inline(always)]
fn bias_at(bias: *const f32, i: usize) -> f32 {
    if bias.is_null() {
        0.0
    } else {
        unsafe { *bias.add(i) }
    }
}

/// Floats `k..k + 8` of `x` (16-byte aligned).
#[inline(always)]
unsafe fn load_x8(x: *const f32, at: usize) -> [f32; 8] {
    let p = unsafe { x.add(at) } as *const F32x4;
    let (a, b) = unsafe { ((*p).0, (*p.add(1)).0) };
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Output `(r, col)` in f32 FMAs in k order, over the `[n_out, n_in]` matrix at `w`: for sums
/// the tensor cores could not hold. A call, not inlined: rare, and kept out of the registers.
#[inline(never)]
unsafe fn redo<W: Weights>(
    x: *const f32,
    w: *const u8,
    n_out: u32,
    n_in: u32,
    r: usize,
    col: usize,
) -> f32 {
    let w = W::new(w, n_out, n_in);
    let mut s = 0.0;
    let mut k = 0;
    while k < n_in {
        let wv = unsafe { w.load8::<true>(col, k) };
        let xv = unsafe { load_x8(x, r * n_in as usize + k as usize) };
        for i in 0..8 {
            s = fma(xv[i], wv[i], s);
        }
        k += 8;
    }
    s
}

/// `f(m, &mut acc[m])` for the block's `mt` m16 tiles (1, 2, 4 or `MT`), each index a constant:
/// a loop over `m` would leave the accumulators in local memory.
#[inline(always)]
fn each_tile<T>(mt: u32, acc: &mut [T; MT], mut f: impl FnMut(usize, &mut T)) {
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    f(0, a0);
    if mt > 1 {
        f(1, a1);
    }
    if mt > 2 {
        f(2, a2);
        f(3, a3);
    }
    if mt > 4 {
        f(4, a4);
        f(5, a5);
        f(6, a6);
        f(7, a7);
    }
}

/// The kernel body (see the module doc). `n_in % 32 == 0`, `x` 16-byte aligned, `w.vector()`,
/// `mt` 1, 2, 4 or `MT` (8), `1 <= kb <= n_in / 32`. Shared: `shared_bytes(mt)`.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn gemm_rows_of<W: Weights>(p: GemmRows, w: W) {
    let GemmRows {
        y,
        x,
        w: w_ptr,
        bias,
        part,
        counts,
        rows,
        n_in,
        n_out,
        kb,
        mt,
    } = p;
    // `x` is what the kernel before wrote: nothing is read before the wait.
    wait_prior_grids();
    allow_next_grid();
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let nw = block_dim() / WARP;
    let row_tiles = rows.div_ceil(16 * mt);
    let b = block();
    let (rt, kp, cb) = (b % row_tiles, b / row_tiles % kb, b / row_tiles / kb);
    let row0 = rt * 16 * mt;
    let col0 = (cb * nw + warp) * WARP_OUTS;
    let (g, c) = (lane / 4, lane % 4);
    let chunks = n_in / 32;
    let first = chunks * kp / kb;
    let n = chunks * (kp + 1) / kb - first;

    // Slot `i % STAGES` of the ring holds chunk `first + i`: row `r` of the tile at floats
    // `r·ROW_FLOATS..`, zeros for rows past `rows`; `quad_at(i, 8r + f)` is float4 `f` of
    // row `r`.
    let ring = shared_addr(shared::<f32>());
    let slot_bytes = 4 * 16 * mt * ROW_FLOATS;
    let quad_at =
        |i: u32, q: u32| ring + (i % STAGES) * slot_bytes + 4 * (q / 8 * ROW_FLOATS + 4 * (q % 8));
    // This thread's float4 `f` of rows `r, r + blockDim / 8, ...` of the tile.
    let (r_first, f, r_step) = (thread() / 8, thread() % 8, block_dim() / 8);
    let issue = |i: u32| {
        if i < n {
            let k = 32 * (first + i) + 4 * f;
            let mut r = r_first;
            while r < 16 * mt {
                let row = row0 + r;
                let zero = row >= rows;
                let src = if zero {
                    x
                } else {
                    unsafe { x.add((row * n_in + k) as usize) }
                };
                unsafe { cp_async16(quad_at(i, 8 * r + f), src, zero) };
                r += r_step;
            }
        }
        cp_async_commit();
    };
    // This lane's weight rows (n8 tile `j`: output `col0 + 8j + g`), past the end the last one
    // again, computed and not written.
    let w_row: [usize; NT] =
        core::array::from_fn(|j| (col0 + 8 * j as u32 + g).min(n_out - 1) as usize);
    // Loaded two chunks ahead and decoded when multiplied, so that the loads stay in flight.
    let load_w = |ch: u32| -> [W::Raw8; NT] {
        core::array::from_fn(|j| unsafe { w.raw8::<true>(w_row[j], 32 * ch + 8 * c) })
    };
    let mut acc = [[[0.0f32; 4]; NT]; MT];
    issue(0);
    issue(1);
    // Chunk i's weights in `wv`, chunk i + 1's in `wv1`.
    let mut wv = load_w(first);
    let mut wv1 = load_w(first + 1.min(n - 1));
    for i in 0..n {
        // Chunk i has landed (only the newest group, chunk i + 1, may be in flight); once all
        // threads are here, the slot of chunk i - 1 is free for chunk i + 2.
        cp_async_wait::<1>();
        sync_threads();
        issue(i + 2);
        // Chunk i + 2's weights in flight while this one is multiplied (the last iterations load
        // the last chunk again, harmlessly).
        let wn = load_w(first + (i + 2).min(n - 1));
        let wh: [[u32; 4]; NT] = core::array::from_fn(|j| {
            let wv = W::decode8(wv[j], 8 * c);
            core::array::from_fn(|h| f16x2(wv[2 * h], wv[2 * h + 1]))
        });
        // M16 tile `m` with its accumulators.
        let tile = |m: usize, acc: &mut [[f32; 4]; NT]| {
            // Rows `16m + g` (v[0]) and `+ 8` (v[1]), floats `8c + 4s..8c + 4s + 4` (v[h][s]).
            let r = 16 * m as u32 + g;
            let v: [[[f32; 4]; 2]; 2] = core::array::from_fn(|h| {
                core::array::from_fn(|s| {
                    let q = (r + 8 * h as u32) * 8 + 2 * c + s as u32;
                    load_shared4(quad_at(i, q)).map(f32::from_bits)
                })
            });
            for s in 0..2 {
                let (r0, r1) = (v[0][s], v[1][s]);
                let a = [
                    f16x2(r0[0], r0[1]),
                    f16x2(r1[0], r1[1]),
                    f16x2(r0[2], r0[3]),
                    f16x2(r1[2], r1[3]),
                ];
                for j in 0..NT {
                    mma(&mut acc[j], a, [wh[j][2 * s], wh[j][2 * s + 1]]);
                }
            }
        };
        each_tile(mt, &mut acc, tile);
        (wv, wv1) = (wv1, wn);
    }

    // Element e of n8 tile j of m16 tile m: row `row0 + 16m + g + 8(e / 2)`, output
    // `col0 + 8j + 2c + e % 2`; its sum over this block's part.
    let at = |m: usize, j: usize, e: usize| {
        (
            row0 + 16 * m as u32 + g + 8 * (e as u32 / 2),
            col0 + 8 * j as u32 + 2 * c + e as u32 % 2,
        )
    };
    let put = |r: u32, col: u32, mut s: f32| {
        let (r, col) = (r as usize, col as usize);
        if !s.is_finite() {
            s = unsafe { redo::<W>(x, w_ptr, n_out, n_in, r, col) };
        }
        unsafe { *y.add(r * n_out as usize + col) = s + bias_at(bias, col) };
    };
    // With `kb > 1`, part `q`'s sums of this tile lie in `part` from `part_at(q)`, row `r` of
    // the tile (`16·mt` rows) at `r·16·nw` and the block's output `o` at `o`.
    let tile_floats = 16 * mt * WARP_OUTS * nw;
    let tiles = grid_dim() / kb;
    let part_at = |q: u32| ((q * tiles + cb * row_tiles + rt) * tile_floats) as usize;
    // M16 tile `m`'s sums over this block's part: written, or with `kb > 1` left in `part`.
    let own = |m: usize, acc: &mut [[f32; 4]; NT]| {
        for j in 0..NT {
            for e in 0..4 {
                let s = acc[j][e];
                let (r, col) = at(m, j, e);
                if kb > 1 {
                    let local = (r - row0) * WARP_OUTS * nw + col - cb * nw * WARP_OUTS;
                    unsafe { *part.add(part_at(kp) + local as usize) = s };
                } else if r < rows && col < n_out {
                    put(r, col, s);
                }
            }
        }
    };
    each_tile(mt, &mut acc, own);
    if kb == 1 {
        return;
    }
    // The tile's last block adds the parts in order: each thread four outputs at a time, the
    // parts' loads all in flight before the sums.
    fence_gpu();
    sync_threads();
    let last = unsafe { shared::<u8>().add((STAGES * slot_bytes) as usize) } as *mut u32;
    if thread() == 0 {
        let count = unsafe { counts.add((cb * row_tiles + rt) as usize) };
        unsafe { *last = count_last(count, kb) as u32 };
    }
    sync_threads();
    if unsafe { *last } == 0 {
        return;
    }
    let mut i = thread();
    while i < tile_floats / 4 {
        let v: [[f32; 4]; MAX_PARTS] = core::array::from_fn(|q| {
            if (q as u32) < kb {
                unsafe { load_l2x4(part.add(part_at(q as u32) + 4 * i as usize)) }
            } else {
                [0.0; 4]
            }
        });
        let (r, o) = (row0 + 4 * i / (WARP_OUTS * nw), 4 * i % (WARP_OUTS * nw));
        for e in 0..4 {
            let col = cb * nw * WARP_OUTS + o + e as u32;
            if r < rows && col < n_out {
                let mut s = v[0][e];
                for q in 1..MAX_PARTS {
                    if (q as u32) < kb {
                        s += v[q][e];
                    }
                }
                put(r, col, s);
            }
        }
        i += block_dim();
    }
}

/// The `GemmRows` kernel for weights of ggml type `TY`: `gemm_rows` over them.
#[inline(always)]
pub(crate) unsafe fn gemm_rows<const TY: u32>(p: GemmRows)
where
    GgmlType<TY>: Format,
{
    let w = <GgmlType<TY> as Format>::W::new(p.w, p.n_out, p.n_in);
    unsafe { gemm_rows_of(p, w) }
}
