//! Products with f16 weights: `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` with `w` f16
//! `[n_out, n_in]` row-major and f32 accumulation (by FMA). One token: `gemv_f16`; several:
//! `gemm_f16`. CPU twins: `orcd::cpu::matmul` (and `orcd::cpu::gemv_f16` without bias).
use crate::util::{WARP, block, block_dim, f16_to_f32, shared, sync_threads, thread, warp_sum};

/// 16 bytes, for one vector load of 4 floats.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct F32x4([f32; 4]);

/// 16 bytes, for one vector load of 8 halves.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct F16x8([u16; 8]);

#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

#[inline(always)]
fn aligned<T>(p: *const T, bytes: usize) -> bool {
    (p as usize).is_multiple_of(bytes)
}

/// `y[o] = w[o, :]·x + bias[o]` for one token; `bias` may be null. One warp per output.
/// Grid: `ceil(n_out / (blockDim / 32))` blocks; block: a multiple of 32 threads; no shared
/// memory. Each lane reads 8 halves (16 bytes) and 8 floats at a time when `n_in % 8 == 0`
/// and `w` and `x` are 16-byte aligned, else 2 halves (4 bytes) when `n_in` is even and `w`
/// 4-byte aligned, else one.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gemv_f16(
    y: *mut f32,
    x: *const f32,
    w: *const u16,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
) {
    let lane = thread() % WARP;
    let o = block() * (block_dim() / WARP) + thread() / WARP;
    // The whole warp leaves together, so the shuffles below see full warps.
    if o >= n_out {
        return;
    }
    let w = unsafe { w.add(o as usize * n_in as usize) };
    let mut acc = 0.0f32;
    if n_in.is_multiple_of(8) && aligned(w, 16) && aligned(x, 16) {
        // Four 16-byte chunks per lane in flight at once: a long row with few warps
        // (ffn_down: 896 rows of 4864) is otherwise bound by the latency of one load.
        let (w8, x4) = (w as *const F16x8, x as *const F32x4);
        let chunks = n_in as usize / 8;
        let mut c0 = lane as usize;
        while c0 < chunks {
            let mut wv = [[0u16; 8]; 4];
            let mut xv = [[0.0f32; 4]; 8];
            for u in 0..4 {
                let c = c0 + u * WARP as usize;
                if c < chunks {
                    wv[u] = unsafe { *w8.add(c) }.0;
                    xv[2 * u] = unsafe { *x4.add(2 * c) }.0;
                    xv[2 * u + 1] = unsafe { *x4.add(2 * c + 1) }.0;
                }
            }
            for u in 0..4 {
                for k in 0..8 {
                    acc = fma(f16_to_f32(wv[u][k]), xv[2 * u + k / 4][k % 4], acc);
                }
            }
            c0 += 4 * WARP as usize;
        }
    } else if n_in.is_multiple_of(2) && aligned(w, 4) {
        let w2 = w as *const u32;
        let mut c = lane as usize;
        while c < n_in as usize / 2 {
            let p = unsafe { *w2.add(c) };
            acc = fma(f16_to_f32(p as u16), unsafe { *x.add(2 * c) }, acc);
            acc = fma(
                f16_to_f32((p >> 16) as u16),
                unsafe { *x.add(2 * c + 1) },
                acc,
            );
            c += WARP as usize;
        }
    } else {
        let mut c = lane as usize;
        while c < n_in as usize {
            acc = fma(f16_to_f32(unsafe { *w.add(c) }), unsafe { *x.add(c) }, acc);
            c += WARP as usize;
        }
    }
    let acc = warp_sum(acc);
    if lane == 0 {
        let b = if bias.is_null() {
            0.0
        } else {
            unsafe { *bias.add(o as usize) }
        };
        unsafe { *y.add(o as usize) = acc + b };
    }
}

/// Tokens (rows of `x`) and outputs (rows of `w`) per block tile, and the K step.
const TILE_M: usize = 64;
const TILE_N: usize = 64;
const TILE_K: usize = 32;
/// Row stride in floats of the shared `[TILE_K][64]` tiles: 4 floats of padding keep every
/// row 16-byte aligned.
const LDS: usize = 64 + 4;

/// One K step of a block's tiles, in registers on their way to shared memory. Thread `t` holds
/// x rows `t / 8` and `t / 8 + 32` at k `4·(t % 8)..+4`, and w row `t / 4` at k `8·(t % 4)..+8`
/// (converted to f32): 256 threads cover the 64×32 x tile and the 64×32 w tile once.
struct Staged {
    x: [[f32; 4]; 2],
    w: [f32; 8],
}

/// What a block needs to stage its tiles.
struct Tiles {
    x: *const f32,
    w: *const u16,
    rows: usize,
    n_in: usize,
    n_out: usize,
    row0: usize,
    col0: usize,
    /// `n_in % 8 == 0` and `x`, `w` 16-byte aligned: every 4 floats and 8 halves a thread
    /// loads are then aligned and wholly inside or wholly outside `n_in`.
    vector: bool,
}

impl Tiles {
    /// The K step at `k0`, zeros outside the matrices.
    #[inline(always)]
    fn load(&self, k0: usize) -> Staged {
        let t = thread() as usize;
        let mut s = Staged {
            x: [[0.0; 4]; 2],
            w: [0.0; 8],
        };
        for (p, xs) in s.x.iter_mut().enumerate() {
            let (r, k) = (self.row0 + t / 8 + 32 * p, k0 + 4 * (t % 8));
            if r >= self.rows {
                continue;
            }
            let at = unsafe { self.x.add(r * self.n_in) };
            if self.vector {
                if k < self.n_in {
                    *xs = unsafe { *(at.add(k) as *const F32x4) }.0;
                }
            } else {
                for (j, v) in xs.iter_mut().enumerate() {
                    if k + j < self.n_in {
                        *v = unsafe { *at.add(k + j) };
                    }
                }
            }
        }
        let (n, k) = (self.col0 + t / 4, k0 + 8 * (t % 4));
        if n < self.n_out {
            let at = unsafe { self.w.add(n * self.n_in) };
            if self.vector {
                if k < self.n_in {
                    let h = unsafe { *(at.add(k) as *const F16x8) }.0;
                    s.w = h.map(f16_to_f32);
                }
            } else {
                for (j, v) in s.w.iter_mut().enumerate() {
                    if k + j < self.n_in {
                        *v = f16_to_f32(unsafe { *at.add(k + j) });
                    }
                }
            }
        }
        s
    }
}

impl Staged {
    /// Writes the step into the shared tiles, transposed to `[k][row]` so that the product
    /// loop reads 4 consecutive rows with one 16-byte load.
    #[inline(always)]
    fn store(&self, xs: *mut f32, ws: *mut f32) {
        let t = thread() as usize;
        for (p, v) in self.x.iter().enumerate() {
            let (r, k) = (t / 8 + 32 * p, 4 * (t % 8));
            for (j, v) in v.iter().enumerate() {
                unsafe { *xs.add((k + j) * LDS + r) = *v };
            }
        }
        let (n, k) = (t / 4, 8 * (t % 4));
        for (j, v) in self.w.iter().enumerate() {
            unsafe { *ws.add((k + j) * LDS + n) = *v };
        }
    }
}

/// `y[t, o] = x[t, :]·w[o, :] + bias[o]` for `rows` tokens; `bias` may be null. Tiled: block
/// `b` computes the 64×64 output tile at token rows `64·(b % ceil(rows / 64))` and outputs
/// `64·(b / ceil(rows / 64))`, in K steps of 32 staged through shared memory (the next step's
/// global loads are issued before the current step's products); thread `t` owns the 4×4
/// outputs at rows `4·(t / 16)` and columns `4·(t % 16)` of the tile. Consecutive blocks share
/// one weight tile, so each weight tile is read from DRAM about once.
/// Grid: `ceil(rows / 64) · ceil(n_out / 64)` blocks; block: exactly 256 threads; shared:
/// `2 · 32 · 68` f32 (17408 bytes).
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gemm_f16(
    y: *mut f32,
    x: *const f32,
    w: *const u16,
    bias: *const f32,
    rows: u32,
    n_in: u32,
    n_out: u32,
) {
    let (rows, n_in, n_out) = (rows as usize, n_in as usize, n_out as usize);
    let row_tiles = rows.div_ceil(TILE_M);
    let b = block() as usize;
    let tiles = Tiles {
        x,
        w,
        rows,
        n_in,
        n_out,
        row0: b % row_tiles * TILE_M,
        col0: b / row_tiles * TILE_N,
        vector: n_in.is_multiple_of(8) && aligned(x, 16) && aligned(w, 16),
    };
    // Declared as 16-byte elements so that the shared array is 16-byte aligned.
    let xs = shared::<F32x4>() as *mut f32;
    let ws = unsafe { xs.add(TILE_K * LDS) };
    let t = thread() as usize;
    let (tr, tc) = (4 * (t / 16), 4 * (t % 16));
    let mut acc = [[0.0f32; 4]; 4];
    let mut staged = tiles.load(0);
    let mut k0 = 0;
    // Every thread runs the same number of steps: the barriers are reached by all.
    while k0 < n_in {
        staged.store(xs, ws);
        sync_threads();
        if k0 + TILE_K < n_in {
            staged = tiles.load(k0 + TILE_K);
        }
        // Unrolled by 8 by hand (LLVM unrolls this loop by 2 on its own).
        let mut k8 = 0;
        while k8 < TILE_K {
            for k in k8..k8 + 8 {
                let a = unsafe { *(xs.add(k * LDS + tr) as *const F32x4) }.0;
                let b = unsafe { *(ws.add(k * LDS + tc) as *const F32x4) }.0;
                for i in 0..4 {
                    for j in 0..4 {
                        acc[i][j] = fma(a[i], b[j], acc[i][j]);
                    }
                }
            }
            k8 += 8;
        }
        sync_threads();
        k0 += TILE_K;
    }
    for (i, acc) in acc.iter().enumerate() {
        let r = tiles.row0 + tr + i;
        if r >= rows {
            break;
        }
        for (j, acc) in acc.iter().enumerate() {
            let c = tiles.col0 + tc + j;
            if c < n_out {
                let b = if bias.is_null() {
                    0.0
                } else {
                    unsafe { *bias.add(c) }
                };
                unsafe { *y.add(r * n_out + c) = acc + b };
            }
        }
    }
}
