//! The batched pass's product `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` for 1 to 512 rows
//! (`gemm_rows_<type>`), over the weight formats of `matmul.rs` ([`Weights`]), fast where rows
//! are few and outputs narrow, and row-independent: each output row's bits depend only on its
//! own row of `x`, never on how many rows the call has or what they hold. CPU twin:
//! `orcd::cpu::matmul` on the dequantized weights.
//!
//! Tensor cores (`mma.sync` m16n8k16, f16 products exact, f32 sums) at f32 precision as in
//! `matmul::gemm_mma`: every operand split into f16 halves `hi + lo / LO_SCALE`, the sums
//! `hi_x·hi_w` and `lo_x·hi_w + hi_x·lo_w` in separate accumulators (no `lo` of f16 weights).
//! No shared-memory staging: each lane loads its own operands straight into its fragments.
//! Within a chunk of 32 weights, lane `(g, c)` (`g = lane / 4`, `c = lane % 4`) takes the 8
//! consecutive weights `8c..8c + 8` of its output rows (`Weights::load8`, exactly
//! `quant::dequantize`'s values) and the same 8 elements of its rows of `x` (two 16-byte
//! loads). A product's k order is free, so the chunk's two k16 steps `s` map the fragments'
//! logical k `2c + e` to physical `8c + 4s + e` and `2c + 8 + e` to `8c + 4s + 2 + e`, for
//! `a` and `b` alike.
//!
//! Work: a warp owns `NT`·8 = 16 outputs of `mt` (1 to `MT`) m16 tiles of rows, and one of
//! `ks` slices of K: chunks `kw, kw + ks, ...` (`kw` its slice). A block is `ks·nw` warps: `nw`
//! neighbouring 16-output groups (sharing their rows of `x` through L1) times the `ks` slices,
//! which meet in shared memory and are added in the fixed order 0, 1, .., ks - 1. Block `b`
//! takes rows `16·mt·(b % row_tiles)..` and outputs `16·nw·(b / row_tiles)..`.
//!
//! Row independence: `ks` is chosen by the host from the matrix's shape alone, a row always
//! sits at the same place `t % 16` of an m16 tile (tiles start at multiples of 16), the mma
//! computes each output from its own row and column, and the sums run in the same order
//! whatever `mt` and `rows`. An output that is not finite (an operand beyond f16's range,
//! |v| >= 65520, or an inf or NaN input) is redone by its thread in f32 FMAs in k order: a
//! decision on the output's own value, so row-independent too.
use crate::matmul::{Format, GgmlType, Weights};
use crate::params::GemmRows;
use crate::util::{
    F32x4, LO_SCALE, WARP, allow_next_grid, block, block_dim, fma, mma, shared, split,
    sync_threads, thread, wait_prior_grids,
};

use kernel_abi::gemm_rows::{PER_TILE, WARP_OUTS};

/// n8 output tiles per warp.
const NT: usize = kernel_abi::gemm_rows::NT as usize;
/// The most m16 row tiles per warp (`mt`).
const MT: usize = kernel_abi::gemm_rows::MAX_MT as usize;

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

/// The kernel body (see the module doc). `n_in % 32 == 0`, `x` 16-byte aligned, `w.vector()`,
/// `mt` 1, 2 or `MT` (4), `ks >= 1` and `blockDim` a multiple of `32·ks`. Shared:
/// `ks·nw·mt·PER_TILE` f32 (`nw = blockDim / 32 / ks`).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn gemm_rows_of<W: Weights>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    rows: u32,
    n_in: u32,
    n_out: u32,
    ks: u32,
    mt: u32,
) {
    // `x` is what the kernel before wrote: nothing is read before the wait.
    wait_prior_grids();
    allow_next_grid();
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let nw = block_dim() / WARP / ks;
    let (kw, group) = (warp % ks, warp / ks);
    let row_tiles = rows.div_ceil(16 * mt);
    let b = block();
    let row0 = b % row_tiles * 16 * mt;
    let col_block = b / row_tiles * nw * WARP_OUTS;
    let col0 = col_block + group * WARP_OUTS;
    let (g, c) = (lane / 4, lane % 4);
    let chunks = n_in / 32;
    // This lane's weight rows (n8 tile `j`: output `col0 + 8j + g`) and rows of x (m16 tile
    // `m`: `row0 + 16m + g`, `+ 8`); past the ends the last one again, computed and not written.
    let w_row: [usize; NT] =
        core::array::from_fn(|j| (col0 + 8 * j as u32 + g).min(n_out - 1) as usize);
    let x_row = |m: usize, h: u32| ((row0 + 16 * m as u32 + g + 8 * h).min(rows - 1)) as usize;
    let load_w = |ch: u32| -> [[f32; 8]; NT] {
        core::array::from_fn(|j| unsafe { w.load8::<true>(w_row[j], 32 * ch + 8 * c) })
    };
    let mut main = [[[0.0f32; 4]; NT]; MT];
    let mut cross = [[[0.0f32; 4]; NT]; MT];
    let mut ch = kw;
    if ch < chunks {
        let mut wv = load_w(ch);
        loop {
            let next = ch + ks;
            // The next chunk's weights in flight while this one is multiplied (the last
            // iteration loads its own chunk again, harmlessly).
            let wn = load_w(next.min(chunks - 1));
            let ws: [([u32; 4], [u32; 4]); NT] = core::array::from_fn(|j| split::<8, 4>(&wv[j]));
            let k = (32 * ch + 8 * c) as usize;
            // M16 tile `m` with its accumulators: called with constant indices below, as a
            // loop over `m` would leave the accumulators in local memory.
            let tile = |m: usize, main: &mut [[f32; 4]; NT], cross: &mut [[f32; 4]; NT]| {
                let xv = [0, 1].map(|h| unsafe { load_x8(x, x_row(m, h) * n_in as usize + k) });
                for s in 0..2 {
                    let q = 4 * s;
                    let a = [
                        xv[0][q],
                        xv[0][q + 1],
                        xv[1][q],
                        xv[1][q + 1],
                        xv[0][q + 2],
                        xv[0][q + 3],
                        xv[1][q + 2],
                        xv[1][q + 3],
                    ];
                    let (a_hi, a_lo) = split::<8, 4>(&a);
                    for j in 0..NT {
                        let (w_hi, w_lo) = ws[j];
                        let b_hi = [w_hi[2 * s], w_hi[2 * s + 1]];
                        mma(&mut main[j], a_hi, b_hi);
                        mma(&mut cross[j], a_lo, b_hi);
                        if !W::F16 {
                            mma(&mut cross[j], a_hi, [w_lo[2 * s], w_lo[2 * s + 1]]);
                        }
                    }
                }
            };
            let ([m0, m1, m2, m3], [c0, c1, c2, c3]) = (&mut main, &mut cross);
            tile(0, m0, c0);
            if mt > 1 {
                tile(1, m1, c1);
            }
            if mt > 2 {
                tile(2, m2, c2);
                tile(3, m3, c3);
            }
            if next >= chunks {
                break;
            }
            (wv, ch) = (wn, next);
        }
    }
    // The slices meet: warp (kw, group)'s partial of m16 tile m, n8 tile j, element e of lane
    // l at `((kw·nw + group)·mt + m)·PER_TILE + (4j + e)·32 + l`.
    let part = shared::<f32>();
    let slice = nw * mt * PER_TILE;
    let put = |m: usize, main: &[[f32; 4]; NT], cross: &[[f32; 4]; NT]| {
        for j in 0..NT {
            for e in 0..4 {
                let v = fma(cross[j][e], 1.0 / LO_SCALE, main[j][e]);
                let at = ((kw * nw + group) * mt + m as u32) * PER_TILE
                    + (4 * j as u32 + e as u32) * WARP
                    + lane;
                unsafe { *part.add(at as usize) = v };
            }
        }
    };
    put(0, &main[0], &cross[0]);
    if mt > 1 {
        put(1, &main[1], &cross[1]);
    }
    if mt > 2 {
        put(2, &main[2], &cross[2]);
        put(3, &main[3], &cross[3]);
    }
    sync_threads();
    let mut q = thread();
    while q < slice {
        let mut s = unsafe { *part.add(q as usize) };
        for p in 1..ks {
            s += unsafe { *part.add((p * slice + q) as usize) };
        }
        let (l, je) = (q % WARP, q / WARP % (4 * NT as u32));
        let (m, group) = (q / PER_TILE % mt, q / PER_TILE / mt);
        let (j, e) = (je / 4, je % 4);
        let r = row0 + 16 * m + l / 4 + 8 * (e / 2);
        let col = col_block + group * WARP_OUTS + 8 * j + 2 * (l % 4) + e % 2;
        if r < rows && col < n_out {
            let (r, col) = (r as usize, col as usize);
            if !s.is_finite() {
                // The f32 redo, in k order.
                s = 0.0;
                let mut k = 0;
                while k < n_in {
                    let wv = unsafe { w.load8::<true>(col, k) };
                    let xv = unsafe { load_x8(x, r * n_in as usize + k as usize) };
                    for i in 0..8 {
                        s = fma(xv[i], wv[i], s);
                    }
                    k += 8;
                }
            }
            unsafe { *y.add(r * n_out as usize + col) = s + bias_at(bias, col) };
        }
        q += block_dim();
    }
}

/// The `GemmRows` kernel for weights of ggml type `TY`: `gemm_rows` over them.
#[inline(always)]
pub(crate) unsafe fn gemm_rows<const TY: u32>(p: GemmRows)
where
    GgmlType<TY>: Format,
{
    let GemmRows {
        y,
        x,
        w,
        bias,
        rows,
        n_in,
        n_out,
        ks,
        mt,
    } = p;
    let w = <GgmlType<TY> as Format>::W::new(w, n_out, n_in);
    unsafe { gemm_rows_of(y, x, w, bias, rows, n_in, n_out, ks, mt) }
}
