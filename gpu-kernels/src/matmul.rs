//! Products `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` with the weights `w` `[n_out, n_in]`
//! row-major in one of the model file's formats, read as stored and dequantized in registers
//! to exactly `orcd::quant::dequantize`'s f32 values; f32 accumulation by FMA. One token:
//! `gemv_<type>`; several: `gemm_<type>`, for the types f32, f16, bf16, q4_0, q5_0, q8_0, q4_k,
//! q5_k and q6_k. CPU twin: `orcd::cpu::matmul` on the dequantized weights.
//!
//! The GEMV and GEMM are written once, generic over [`Weights`] (one implementation per
//! format: plain floats or blocks of `quant::Block`); the entry points only pick the format.
use core::marker::PhantomData;

use crate::quant::{Block, BlockQ4_0, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0};
use crate::util::{WARP, block, block_dim, shared, sync_threads, thread, warp_sum};

/// 16 bytes, for one vector load of 4 floats.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct F32x4([f32; 4]);

/// `T` 16-byte aligned: a vector load of 8 plain floats (16 bytes of f16, 32 of f32).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Align16<T>(T);

#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

#[inline(always)]
fn aligned<T>(p: *const T, bytes: usize) -> bool {
    (p as usize).is_multiple_of(bytes)
}

/// A weight matrix `[n_out, n_in]` in one storage format.
trait Weights {
    /// Whether every row starts 16-byte aligned and `n_in % 8 == 0`, so `load8::<true>` may
    /// use vector loads.
    fn vector(&self) -> bool;
    /// Weights `k..k + 8` of row `row` (`k % 8 == 0`, `k + 8 <= n_in`) in f32, exactly as
    /// `orcd::quant::dequantize` gives them. `VEC`: `vector()` holds.
    unsafe fn load8<const VEC: bool>(&self, row: usize, k: u32) -> [f32; 8];
    /// Weight `k` of row `row`, for the tail of a row that is not whole groups of 8; rows of
    /// quantized weights never have one (they are whole blocks of 32 or 256).
    unsafe fn load1(&self, row: usize, k: usize) -> f32;
}

/// A plain float format.
trait Float: Copy {
    fn to_f32(self) -> f32;
}

impl Float for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Float for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// bf16: the top half of an f32.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Bf16(u16);

impl Float for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Rows of `n_in` plain floats (any row length, `T`-aligned).
struct Plain<T> {
    w: *const T,
    n_in: usize,
}

impl<T: Float> Plain<T> {
    #[inline(always)]
    fn new(w: *const u8, n_in: u32) -> Self {
        Plain {
            w: w as *const T,
            n_in: n_in as usize,
        }
    }
}

impl<T: Float> Weights for Plain<T> {
    #[inline(always)]
    fn vector(&self) -> bool {
        self.n_in.is_multiple_of(8) && aligned(self.w, 16)
    }

    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, row: usize, k: u32) -> [f32; 8] {
        let p = unsafe { self.w.add(row * self.n_in + k as usize) };
        if VEC {
            unsafe { *(p as *const Align16<[T; 8]>) }.0.map(T::to_f32)
        } else {
            core::array::from_fn(|j| unsafe { *p.add(j) }.to_f32())
        }
    }

    #[inline(always)]
    unsafe fn load1(&self, row: usize, k: usize) -> f32 {
        unsafe { *self.w.add(row * self.n_in + k) }.to_f32()
    }
}

/// Rows of `n_in / B::ELEMS` quantized blocks (the host checks that the matrix starts
/// 16-byte aligned, which `Block::group` needs).
struct Blocks<B> {
    w: *const u8,
    row_bytes: usize,
    format: PhantomData<B>,
}

impl<B: Block> Blocks<B> {
    #[inline(always)]
    fn new(w: *const u8, n_in: u32) -> Self {
        Blocks {
            w,
            row_bytes: (n_in / B::ELEMS * B::BYTES) as usize,
            format: PhantomData,
        }
    }
}

impl<B: Block> Weights for Blocks<B> {
    #[inline(always)]
    fn vector(&self) -> bool {
        true
    }

    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, row: usize, k: u32) -> [f32; 8] {
        let b = unsafe {
            self.w
                .add(row * self.row_bytes + (k / B::ELEMS * B::BYTES) as usize)
        };
        unsafe { B::group(b, k % B::ELEMS / 8) }
    }

    #[inline(always)]
    unsafe fn load1(&self, _row: usize, _k: usize) -> f32 {
        f32::NAN
    }
}

/// 8 floats of `x` at `k` (`k % 8 == 0`); `VEC`: `x + k` is 16-byte aligned.
#[inline(always)]
fn load_x8<const VEC: bool>(x: *const f32, k: u32) -> [f32; 8] {
    let k = k as usize;
    if VEC {
        let [a, b] = [0, 4].map(|j| unsafe { *(x.add(k + j) as *const F32x4) }.0);
        core::array::from_fn(|j| if j < 4 { a[j] } else { b[j - 4] })
    } else {
        core::array::from_fn(|j| unsafe { *x.add(k + j) })
    }
}

/// Groups of 8 weights each lane of the GEMV has in flight at once (written out below).
const GEMV_UNROLL: usize = 4;

/// Weights `k..k + 8` of row `o` and the matching 8 floats of `x`.
#[inline(always)]
unsafe fn gemv_group<W: Weights, const VEC: bool>(
    w: &W,
    x: *const f32,
    o: usize,
    k: u32,
) -> ([f32; 8], [f32; 8]) {
    (unsafe { w.load8::<VEC>(o, k) }, load_x8::<VEC>(x, k))
}

/// The GEMV: `split` warps per output (a power of two dividing `blockDim / 32`), the
/// `32·split` lanes taking the row's 8-weight groups in turn, so that a warp's lanes read
/// consecutive bytes; with `split > 1` the warps' sums meet in shared memory.
#[inline(always)]
unsafe fn gemv<W: Weights>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    if w.vector() && n_in >= 8 && aligned(x, 16) {
        unsafe { gemv_vec::<W, true>(y, x, w, bias, n_in, n_out, split) }
    } else {
        unsafe { gemv_vec::<W, false>(y, x, w, bias, n_in, n_out, split) }
    }
}

#[inline(always)]
unsafe fn gemv_vec<W: Weights, const VEC: bool>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    n_in: u32,
    n_out: u32,
    split: u32,
) {
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let rows_per_block = block_dim() / WARP / split;
    let o = block() * rows_per_block + warp / split;
    let part = warp % split;
    let mut acc = 0.0f32;
    // The whole warp skips together, so the shuffles see full warps; it still reaches the
    // barrier below.
    if o < n_out {
        let groups = n_in / 8;
        let mut c0 = part * WARP + lane;
        while c0 < groups {
            // Groups past the row's end are clamped into it (and count as zeros below), so
            // that the loads are straight-line code, all in flight before the first is waited
            // for. Written out: LLVM does not unroll an `array::map` of a dequantizing body.
            let c = [0, 1, 2, 3].map(|u| c0 + u * WARP * split);
            let at = |u: usize| 8 * c[u].min(groups - 1);
            let o = o as usize;
            let v = unsafe {
                [
                    gemv_group::<W, VEC>(&w, x, o, at(0)),
                    gemv_group::<W, VEC>(&w, x, o, at(1)),
                    gemv_group::<W, VEC>(&w, x, o, at(2)),
                    gemv_group::<W, VEC>(&w, x, o, at(3)),
                ]
            };
            for (c, (wv, xv)) in c.iter().zip(&v) {
                let mut dot = 0.0;
                for (w, x) in wv.iter().zip(xv) {
                    dot = fma(*w, *x, dot);
                }
                // A select, as a branch around the products would have LLVM sink the loads
                // into it.
                acc += if *c < groups { dot } else { 0.0 };
            }
            c0 += GEMV_UNROLL as u32 * WARP * split;
        }
        // A row of plain floats that is not whole groups of 8 ends in up to 7 more.
        let k = 8 * groups + lane;
        if part == 0 && k < n_in {
            let (o, k) = (o as usize, k as usize);
            acc = fma(unsafe { w.load1(o, k) }, unsafe { *x.add(k) }, acc);
        }
        acc = warp_sum(acc);
    }
    let bias_at = |o: u32| {
        if bias.is_null() {
            0.0
        } else {
            unsafe { *bias.add(o as usize) }
        }
    };
    // `split` is the same for the whole block: all threads leave here, or none.
    if split == 1 {
        if o < n_out && lane == 0 {
            unsafe { *y.add(o as usize) = acc + bias_at(o) };
        }
        return;
    }
    let sums = shared::<f32>();
    if lane == 0 {
        unsafe { *sums.add(warp as usize) = acc };
    }
    sync_threads();
    let t = thread();
    let o = block() * rows_per_block + t;
    if t < rows_per_block && o < n_out {
        let mut s = 0.0;
        for p in 0..split {
            s += unsafe { *sums.add((t * split + p) as usize) };
        }
        unsafe { *y.add(o as usize) = s + bias_at(o) };
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
/// (dequantized): 256 threads cover the 64×32 x tile and the 64×32 w tile once.
struct Staged {
    x: [[f32; 4]; 2],
    w: [f32; 8],
}

/// What a block needs to stage its tiles.
struct Tiles<W> {
    x: *const f32,
    w: W,
    rows: usize,
    n_in: usize,
    n_out: usize,
    row0: usize,
    col0: usize,
}

impl<W: Weights> Tiles<W> {
    /// The K step at `k0`, zeros outside the matrices. `VEC`: `n_in % 8 == 0`, `x` 16-byte
    /// aligned and `w.vector()`: every 4 floats and 8 weights a thread loads are then aligned
    /// and wholly inside or wholly outside `n_in`.
    #[inline(always)]
    fn load<const VEC: bool>(&self, k0: usize) -> Staged {
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
            if VEC {
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
        if VEC {
            // Clamped into the matrix and zeroed outside it: the loads need no branch.
            let k8 = k.min(self.n_in - 8) as u32;
            let v = unsafe { self.w.load8::<true>(n.min(self.n_out - 1), k8) };
            if n < self.n_out && k < self.n_in {
                s.w = v;
            }
        } else if n < self.n_out {
            if k + 8 <= self.n_in {
                s.w = unsafe { self.w.load8::<false>(n, k as u32) };
            } else {
                for (j, v) in s.w.iter_mut().enumerate() {
                    if k + j < self.n_in {
                        *v = unsafe { self.w.load1(n, k + j) };
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

/// The tiled GEMM: block `b` computes the 64×64 output tile at token rows
/// `64·(b % ceil(rows / 64))` and outputs `64·(b / ceil(rows / 64))`, in K steps of 32 staged
/// through shared memory (the next step's global loads are issued before the current step's
/// products); thread `t` owns the 4×4 outputs at rows `4·(t / 16)` and columns `4·(t % 16)` of
/// the tile. Consecutive blocks share one weight tile, so each weight tile is read from DRAM
/// about once.
#[inline(always)]
unsafe fn gemm<W: Weights>(
    y: *mut f32,
    x: *const f32,
    w: W,
    bias: *const f32,
    rows: u32,
    n_in: u32,
    n_out: u32,
) {
    let vector = w.vector() && n_in >= 8 && aligned(x, 16);
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
    };
    if vector {
        unsafe { gemm_vec::<W, true>(y, bias, &tiles) }
    } else {
        unsafe { gemm_vec::<W, false>(y, bias, &tiles) }
    }
}

#[inline(always)]
unsafe fn gemm_vec<W: Weights, const VEC: bool>(y: *mut f32, bias: *const f32, tiles: &Tiles<W>) {
    let (rows, n_in, n_out) = (tiles.rows, tiles.n_in, tiles.n_out);
    // Declared as 16-byte elements so that the shared array is 16-byte aligned.
    let xs = shared::<F32x4>() as *mut f32;
    let ws = unsafe { xs.add(TILE_K * LDS) };
    let t = thread() as usize;
    let (tr, tc) = (4 * (t / 16), 4 * (t % 16));
    let mut acc = [[0.0f32; 4]; 4];
    let mut staged = tiles.load::<VEC>(0);
    let mut k0 = 0;
    // Every thread runs the same number of steps: the barriers are reached by all.
    while k0 < n_in {
        staged.store(xs, ws);
        sync_threads();
        if k0 + TILE_K < n_in {
            staged = tiles.load::<VEC>(k0 + TILE_K);
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

/// The two entry points of one weight format, `$w` built from the raw pointer and `n_in`:
///
/// `$gemv(y, x, w, bias, n_in, n_out, split)`: `y[o] = w[o, :]·x + bias[o]` for one token;
/// `bias` may be null. Grid: `ceil(n_out / (8 / split))` blocks; block: exactly 256 threads;
/// `split` in {1, 2, 4, 8} warps per output; shared: 8 f32 (32 bytes).
///
/// `$gemm(y, x, w, bias, rows, n_in, n_out)`: `y[t, o] = x[t, :]·w[o, :] + bias[o]` for
/// `rows` tokens; `bias` may be null. Grid: `ceil(rows / 64) · ceil(n_out / 64)` blocks;
/// block: exactly 256 threads; shared: `2 · 32 · 68` f32 (17408 bytes).
///
/// `w` holds the tensor's bytes as stored in the file: rows of plain floats aligned to their
/// element size, or rows of whole blocks starting 16-byte aligned.
macro_rules! matmul_kernels {
    ($gemv:ident, $gemm:ident, $w:ty) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $gemv(
            y: *mut f32,
            x: *const f32,
            w: *const u8,
            bias: *const f32,
            n_in: u32,
            n_out: u32,
            split: u32,
        ) {
            let w = <$w>::new(w, n_in);
            unsafe { gemv(y, x, w, bias, n_in, n_out, split) }
        }

        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $gemm(
            y: *mut f32,
            x: *const f32,
            w: *const u8,
            bias: *const f32,
            rows: u32,
            n_in: u32,
            n_out: u32,
        ) {
            let w = <$w>::new(w, n_in);
            unsafe { gemm(y, x, w, bias, rows, n_in, n_out) }
        }
    };
}

matmul_kernels!(gemv_f32, gemm_f32, Plain<f32>);
matmul_kernels!(gemv_f16, gemm_f16, Plain<f16>);
matmul_kernels!(gemv_bf16, gemm_bf16, Plain<Bf16>);
matmul_kernels!(gemv_q4_0, gemm_q4_0, Blocks<BlockQ4_0>);
matmul_kernels!(gemv_q5_0, gemm_q5_0, Blocks<BlockQ5_0>);
matmul_kernels!(gemv_q8_0, gemm_q8_0, Blocks<BlockQ8_0>);
matmul_kernels!(gemv_q4_k, gemm_q4_k, Blocks<BlockQ4K>);
matmul_kernels!(gemv_q5_k, gemm_q5_k, Blocks<BlockQ5K>);
matmul_kernels!(gemv_q6_k, gemm_q6_k, Blocks<BlockQ6K>);
