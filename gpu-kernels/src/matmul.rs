//! Products `y[t, o] = sum_i x[t, i]·w[o, i] (+ bias[o])` with the weights `w` `[n_out, n_in]`
//! row-major in one of the model file's formats, read as stored and dequantized in registers
//! to exactly `orcd::quant::dequantize`'s f32 values; f32 accumulation by FMA. One token:
//! `gemv_<type>`; several: `gemm_<type>`, on tensor cores with the f32 operands split into
//! f16 halves (see `gemm_mma`), for the types f32, f16, bf16, q4_0, q5_0, q8_0, q4_k, q5_k and
//! q6_k. CPU twin: `orcd::cpu::matmul` on the dequantized weights.
//!
//! The GEMV and GEMM are written once, generic over [`Weights`] (one implementation per
//! format: plain floats or blocks of `quant::Block`); the entry points only pick the format.
use core::arch::asm;
use core::marker::PhantomData;

use crate::quant::{Block, BlockQ4_0, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0};
use crate::util::{WARP, block, block_dim, f16_to_f32, shared, sync_threads, thread, warp_sum};

/// 16 bytes, for one vector load of 4 floats.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct F32x4([f32; 4]);

/// `T` 16-byte aligned: a vector load of 8 plain floats (16 bytes of f16, 32 of f32).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Align16<T>(T);

#[inline(always)]
pub(crate) fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

#[inline(always)]
pub(crate) fn aligned<T>(p: *const T, bytes: usize) -> bool {
    (p as usize).is_multiple_of(bytes)
}

/// A weight matrix `[n_out, n_in]` in one storage format.
pub(crate) trait Weights {
    /// Whether every weight is an f16 value, so that the tensor-core GEMM's split of it has no
    /// low part (see [`gemm_mma`]).
    const F16: bool = false;
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
pub(crate) trait Float: Copy {
    /// Whether this is f16 (see [`Weights::F16`]).
    const F16: bool = false;
    fn to_f32(self) -> f32;
}

impl Float for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Float for f16 {
    const F16: bool = true;
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

impl<T: Float> Plain<T> {
    #[inline(always)]
    pub(crate) fn new(w: *const u8, n_in: u32) -> Self {
        Plain {
            w: w as *const T,
            n_in: n_in as usize,
        }
    }
}

impl<T: Float> Weights for Plain<T> {
    const F16: bool = T::F16;
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
pub(crate) struct Blocks<B> {
    w: *const u8,
    row_bytes: usize,
    format: PhantomData<B>,
}

impl<B: Block> Blocks<B> {
    #[inline(always)]
    pub(crate) fn new(w: *const u8, n_in: u32) -> Self {
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
pub(crate) fn load_x8<const VEC: bool>(x: *const f32, k: u32) -> [f32; 8] {
    let k = k as usize;
    if VEC {
        let [a, b] = [0, 4].map(|j| unsafe { *(x.add(k + j) as *const F32x4) }.0);
        core::array::from_fn(|j| if j < 4 { a[j] } else { b[j - 4] })
    } else {
        core::array::from_fn(|j| unsafe { *x.add(k + j) })
    }
}

/// Groups of 8 weights each lane of the GEMV has in flight at once, per row (written out below).
pub(crate) const GEMV_UNROLL: usize = 4;

/// The vector a GEMV multiplies the weight rows by: `x` itself, or (the fused kernels of
/// decode.rs) `x` times an RMSNorm's weights, with `x`'s sum of squares kept along.
pub(crate) trait Operand {
    /// Whether `load8` returns a sum of squares worth reducing.
    const SQUARES: bool;
    /// Whether `load8::<true>` may use 16-byte vector loads.
    fn vector(&self) -> bool;
    /// The floats `k..k + 8` (`k % 8 == 0`) the products take and their share of the sum of
    /// squares (0 without `SQUARES`), for slot `u` of a step of `gemv_dots`. `VEC`: `vector()`
    /// holds.
    unsafe fn load8<const VEC: bool>(&self, u: usize, k: u32) -> ([f32; 8], f32);
    /// The same for the one float at `k`, in the tail of a row that is not whole groups of 8.
    unsafe fn load1(&self, k: usize) -> (f32, f32);
}

impl Operand for *const f32 {
    const SQUARES: bool = false;

    #[inline(always)]
    fn vector(&self) -> bool {
        aligned(*self, 16)
    }

    #[inline(always)]
    unsafe fn load8<const VEC: bool>(&self, _u: usize, k: u32) -> ([f32; 8], f32) {
        (load_x8::<VEC>(*self, k), 0.0)
    }

    #[inline(always)]
    unsafe fn load1(&self, k: usize) -> (f32, f32) {
        (unsafe { *self.add(k) }, 0.0)
    }
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
    if w.vector() && n_in >= 8 && x.vector() {
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
    let warp = thread() / WARP;
    let first = block() * (block_dim() / WARP / split);
    let o = first + warp / split;
    // The whole warp skips together, so the shuffles see full warps; it still meets below.
    let ([acc], _) = if o < n_out {
        let rows = [(&w, o as usize)];
        unsafe { gemv_dots::<W, _, VEC, 1>(rows, &x, n_in, warp % split, split) }
    } else {
        ([0.0], 0.0)
    };
    gemv_meet([acc], split, |unit, [s]| {
        let o = first + unit;
        if o < n_out {
            let b = if bias.is_null() {
                0.0
            } else {
                unsafe { *bias.add(o as usize) }
            };
            unsafe { *y.add(o as usize) = s + b };
        }
    });
}

/// One GEMV unit's products for part `part` of its `split` warps: the `N` weight rows `rows`
/// (matrix, row) times `x` (`n_in` long), and `x`'s sum of squares if it keeps one, each
/// summed over the warp (every lane gets them). The `32·split` lanes take the rows'
/// 8-weight groups in turn, so that a warp's lanes read consecutive bytes: lane `l` of part
/// `p` takes, in slot `u` of its first step, group `32·p + l + 32·split·u` (clamped to the last
/// group, and then not counted), and each further step the groups `128·split` later. All the
/// loads of one step (`GEMV_UNROLL` groups of every row) are issued before the first is waited
/// for. The whole warp must call it.
#[inline(always)]
pub(crate) unsafe fn gemv_dots<W: Weights, X: Operand, const VEC: bool, const N: usize>(
    rows: [(&W, usize); N],
    x: &X,
    n_in: u32,
    part: u32,
    split: u32,
) -> ([f32; N], f32) {
    let lane = thread() % WARP;
    let (mut acc, mut ss) = ([0.0f32; N], 0.0f32);
    let groups = n_in / 8;
    let mut c0 = part * WARP + lane;
    while c0 < groups {
        // Groups past the row's end are clamped into it (and count as zeros below), so
        // that the loads are straight-line code, all in flight before the first is waited
        // for. Written out: LLVM does not unroll an `array::map` of a dequantizing body.
        let c = [0, 1, 2, 3].map(|u| c0 + u * WARP * split);
        let at = |u: usize| 8 * c[u].min(groups - 1);
        let load = |u: usize| rows.map(|(w, o)| unsafe { w.load8::<VEC>(o, at(u)) });
        let wv = [load(0), load(1), load(2), load(3)];
        let xv = unsafe {
            [
                x.load8::<VEC>(0, at(0)),
                x.load8::<VEC>(1, at(1)),
                x.load8::<VEC>(2, at(2)),
                x.load8::<VEC>(3, at(3)),
            ]
        };
        for (u, (xv, sq)) in xv.iter().enumerate() {
            // A select, as a branch around the products would have LLVM sink the loads
            // into it.
            let live = c[u] < groups;
            for (acc, wv) in acc.iter_mut().zip(&wv[u]) {
                let mut dot = 0.0;
                for (w, x) in wv.iter().zip(xv) {
                    dot = fma(*w, *x, dot);
                }
                *acc += if live { dot } else { 0.0 };
            }
            ss += if live { *sq } else { 0.0 };
        }
        c0 += GEMV_UNROLL as u32 * WARP * split;
    }
    // A row of plain floats that is not whole groups of 8 ends in up to 7 more.
    let k = 8 * groups + lane;
    if part == 0 && k < n_in {
        let k = k as usize;
        let (xk, sq) = unsafe { x.load1(k) };
        for (acc, (w, o)) in acc.iter_mut().zip(&rows) {
            *acc = fma(unsafe { w.load1(*o, k) }, xk, *acc);
        }
        ss += sq;
    }
    let ss = if X::SQUARES { warp_sum(ss) } else { 0.0 };
    (acc.map(warp_sum), ss)
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
    /// The K step at `k0`: zeros past `n_in`, and past the last row of `x` or `w` either zeros
    /// (`!VEC`) or that row's values again (`VEC`), which only reach outputs that are not
    /// written. `VEC`: `n_in % 8 == 0`, `x` 16-byte aligned and `w.vector()`: every 4 floats
    /// and 8 weights a thread loads are then aligned and wholly inside or wholly outside `n_in`.
    #[inline(always)]
    fn load<const VEC: bool>(&self, k0: usize) -> Staged {
        let t = thread() as usize;
        let mut s = Staged {
            x: [[0.0; 4]; 2],
            w: [0.0; 8],
        };
        if VEC {
            // Without a branch around a load, so that all the loads are in flight before the
            // first is waited for (and the compiler may schedule other work in between):
            // indices are clamped into the matrices, and what lies past `n_in` replaced by
            // zeros.
            for (p, xs) in s.x.iter_mut().enumerate() {
                let r = (self.row0 + t / 8 + 32 * p).min(self.rows - 1);
                let k = k0 + 4 * (t % 8);
                let at = unsafe { self.x.add(r * self.n_in + k.min(self.n_in - 4)) };
                let v = unsafe { *(at as *const F32x4) }.0;
                *xs = if k < self.n_in { v } else { [0.0; 4] };
            }
            let (n, k) = ((self.col0 + t / 4).min(self.n_out - 1), k0 + 8 * (t % 4));
            let v = unsafe { self.w.load8::<true>(n, k.min(self.n_in - 8) as u32) };
            s.w = if k < self.n_in { v } else { [0.0; 8] };
            return s;
        }
        for (p, xs) in s.x.iter_mut().enumerate() {
            let (r, k) = (self.row0 + t / 8 + 32 * p, k0 + 4 * (t % 8));
            if r >= self.rows {
                continue;
            }
            let at = unsafe { self.x.add(r * self.n_in) };
            for (j, v) in xs.iter_mut().enumerate() {
                if k + j < self.n_in {
                    *v = unsafe { *at.add(k + j) };
                }
            }
        }
        let (n, k) = (self.col0 + t / 4, k0 + 8 * (t % 4));
        if n < self.n_out {
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
/// products). Consecutive blocks share one weight tile, so each weight tile is read from DRAM
/// about once. Where rows of x and w are 16-byte aligned the tile runs on tensor cores
/// ([`gemm_mma`]), else (or where an operand overflows f16) on the f32 loop `gemm_vec`.
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
        // Tensor cores, unless an operand overflows f16: then the f32 loop redoes the tile.
        if unsafe { !gemm_mma(y, bias, &tiles) } {
            unsafe { gemm_vec::<W, true>(y, bias, &tiles) }
        }
    } else {
        unsafe { gemm_vec::<W, false>(y, bias, &tiles) }
    }
}

/// The f32 loop of [`gemm`]: thread `t` owns the 4×4 outputs at rows `4·(t / 16)` and
/// columns `4·(t % 16)` of the tile, summed by FMA.
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

/// The tensor-core GEMM's operands are split in two f16 halves, `v ≈ hi + lo / LO_SCALE` with
/// `hi = f16(v)` and `lo = f16((v - hi)·LO_SCALE)`: scaled so that `lo` is a normal f16
/// wherever `hi` is (|v - hi| <= 2^-11·|hi|, so |lo| <= |hi| never overflows either).
const LO_SCALE: f32 = 2048.0;
/// Bytes of one 64-row tile of a K step in shared memory: 64 rows of 32 halves.
const MMA_TILE_BYTES: u32 = (TILE_M * TILE_K * 2) as u32;
/// One K step in shared memory: the tiles x hi, x lo, w hi, w lo, in that order.
const MMA_STAGE_BYTES: u32 = 4 * MMA_TILE_BYTES;
/// Row stride in floats of the finished output tile in shared memory.
const OUT_STRIDE: usize = TILE_N + 8;

/// Byte offset of halves `8c..8c + 8` (`c` in 0..4) of row `r` in a tile. The four 16-byte
/// chunks of a row are permuted by `(r / 2) % 4`: the 8 rows that one `ldmatrix` phase reads
/// at one chunk, and the 8 chunks one store phase writes, then fall into distinct banks.
#[inline(always)]
fn chunk_at(r: u32, c: u32) -> u32 {
    64 * r + 16 * (c ^ (r / 2 % 4))
}

/// The shared-window address of `p`, which points into shared memory.
#[inline(always)]
fn shared_addr<T>(p: *const T) -> u32 {
    let a: u64;
    unsafe {
        asm!("cvta.to.shared.u64 {0}, {1};", out(reg64) a, in(reg64) p as u64,
            options(pure, nomem, nostack))
    };
    a as u32
}

#[inline(always)]
fn store_shared2(at: u32, v: [u32; 2]) {
    unsafe {
        asm!("st.shared.v2.b32 [{0}], {{{1}, {2}}};", in(reg32) at, in(reg32) v[0],
            in(reg32) v[1], options(nostack))
    };
}

#[inline(always)]
fn store_shared4(at: u32, v: [u32; 4]) {
    unsafe {
        asm!("st.shared.v4.b32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg32) at, in(reg32) v[0],
            in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack))
    };
}

/// Four 8×8 matrices of halves from shared memory (`ldmatrix .x4`): lane `l` gives the address
/// of row `l % 8` of matrix `l / 8` (16 bytes) and gets, in word `i`, the halves at row `l / 4`,
/// columns `2·(l % 4)` and `+1` of matrix `i` (the lower column in the low half).
#[inline(always)]
fn ldmatrix4(at: u32) -> [u32; 4] {
    let r: [u32; 4];
    unsafe {
        let (r0, r1, r2, r3);
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
            out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, in(reg32) at,
            options(readonly, nostack));
        r = [r0, r1, r2, r3];
    }
    r
}

/// `d += a·b` for one 16×8 tile over k = 16 (`mma.sync` m16n8k16, f16 products exact, f32
/// sums). With `g = lane / 4`, `c = lane % 4`: `a` holds rows `g`, `g + 8`, `g`, `g + 8` at
/// k `2c, 2c + 1` (+8 in words 2, 3); `b` k `2c, 2c + 1` (+8 in word 1) of column `g`; `d`
/// rows `g` (0, 1) and `g + 8` (2, 3) at columns `2c, 2c + 1`.
#[inline(always)]
fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    unsafe {
        asm!("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{0}, {1}, {2}, {3}}}, \
              {{{4}, {5}, {6}, {7}}}, {{{8}, {9}}}, {{{0}, {1}, {2}, {3}}};",
            inout(reg32) d[0], inout(reg32) d[1], inout(reg32) d[2], inout(reg32) d[3],
            in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3],
            in(reg32) b[0], in(reg32) b[1], options(pure, nomem, nostack))
    };
}

/// `f16(lo) | f16(hi) << 16`, each rounded to nearest.
#[inline(always)]
fn f16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.f16x2.f32 {0}, {1}, {2};", out(reg32) r, in(reg32) hi, in(reg32) lo,
            options(pure, nomem, nostack))
    };
    r
}

/// Floats `v[2i]`, `v[2i + 1]` split into pairs of halves: (hi words, lo words).
#[inline(always)]
fn split<const N: usize, const W: usize>(v: &[f32; N]) -> ([u32; W], [u32; W]) {
    let hi: [u32; W] = core::array::from_fn(|i| f16x2(v[2 * i], v[2 * i + 1]));
    let lo = core::array::from_fn(|i| {
        let (h0, h1) = (f16_to_f32(hi[i] as u16), f16_to_f32((hi[i] >> 16) as u16));
        f16x2((v[2 * i] - h0) * LO_SCALE, (v[2 * i + 1] - h1) * LO_SCALE)
    });
    (hi, lo)
}

impl Staged {
    /// Writes the step into the shared stage at `stage` as split halves, row-major (the
    /// fragments' order); `w_lo`: with the weights' low halves.
    #[inline(always)]
    fn store_split(&self, stage: u32, w_lo: bool) {
        let t = thread();
        for (p, v) in self.x.iter().enumerate() {
            let (r, k) = (t / 8 + 32 * p as u32, 4 * (t % 8));
            let at = stage + chunk_at(r, k / 8) + 2 * (k % 8);
            let (hi, lo) = split::<4, 2>(v);
            store_shared2(at, hi);
            store_shared2(at + MMA_TILE_BYTES, lo);
        }
        let at = stage + 2 * MMA_TILE_BYTES + chunk_at(t / 4, t % 4);
        let (hi, lo) = split::<8, 4>(&self.w);
        store_shared4(at, hi);
        if w_lo {
            store_shared4(at + MMA_TILE_BYTES, lo);
        }
    }
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.barrier0.or"]
    fn barrier_or(p: i32) -> i32;
}

/// The 64×64 tile of [`gemm`] on tensor cores (`mma.sync` m16n8k16: f16 products, exact, summed
/// in f32) at f32 precision: with every operand split as at [`LO_SCALE`],
/// `x·w ≈ hi_x·hi_w + (hi_x·lo_w + lo_x·hi_w) / LO_SCALE`, the two sums in separate
/// accumulators, the `lo_x·lo_w` term (< 2^-22·|x·w|) left out, and none of the `lo` products
/// for f16 weights (`W::F16`: their `lo` is 0). `hi + lo / LO_SCALE` is the operand to 2^-22
/// of it while `|v| >= 2^-14` (`hi` a normal f16), and to 2^-36 absolute below.
///
/// The K steps of 32 are staged through two shared stages (the next step's global loads are
/// issued before the current step's products, and its split halves stored after them). Warp
/// `w` takes the k half `w / 4` (16 of the 32) of every step for the 32×32 quarter `w % 4` of
/// the tile: 2×4 m16n8 tiles; at the end warps 4-7 hand their sums to warps 0-3 through shared
/// memory. Shared: 2 stages of 4 tiles `[64][32]` f16 (32768 bytes).
///
/// An operand of |v| >= 65520 has `hi = inf` (f16 overflow) and makes its sums non-finite: then
/// the tile is left unwritten and `false` returned (for the whole block), and the caller redoes
/// it in f32 (as it does, harmlessly, for inf and NaN inputs, whose outputs are not finite
/// either way).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn gemm_mma<W: Weights>(y: *mut f32, bias: *const f32, tiles: &Tiles<W>) -> bool {
    let smem = shared::<F32x4>();
    let base = shared_addr(smem);
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let (half, quarter) = (warp / 4, warp % 4);
    let (qm, qn) = (32 * (quarter / 2), 32 * (quarter % 2));
    // The lanes' ldmatrix rows. x: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
    // (8-15, 8-15) of each m16 tile are its fragment's words 0-3. w (rows are outputs):
    // matrices (n 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) are the fragments of
    // the n8 tiles 2j and 2j + 1.
    let x_at = [0, 1].map(|i| chunk_at(qm + 16 * i + lane % 16, 2 * half + lane / 16));
    let w_at = [0, 1].map(|j| {
        chunk_at(
            qn + 16 * j + lane % 8 + 8 * (lane / 16),
            2 * half + lane / 8 % 2,
        )
    });
    let mut main = [[[0.0f32; 4]; 4]; 2];
    let mut cross = [[[0.0f32; 4]; 4]; 2];
    let steps = tiles.n_in.div_ceil(TILE_K);
    let mut staged = tiles.load::<true>(0);
    staged.store_split(base, !W::F16);
    sync_threads();
    // Every thread runs the same steps: the barriers are reached by all. No branch in a step
    // (the last one loads and stores its own step again, into the stage no longer read), so
    // that the compiler can schedule the products between the loads and their uses.
    for s in 0..steps {
        staged = tiles.load::<true>((s + 1).min(steps - 1) * TILE_K);
        let stage = base + (s % 2) as u32 * MMA_STAGE_BYTES;
        let x_hi = x_at.map(|at| ldmatrix4(stage + at));
        let x_lo = x_at.map(|at| ldmatrix4(stage + MMA_TILE_BYTES + at));
        let w_hi = w_at.map(|at| ldmatrix4(stage + 2 * MMA_TILE_BYTES + at));
        for i in 0..2 {
            for j in 0..4 {
                let b = [w_hi[j / 2][2 * (j % 2)], w_hi[j / 2][2 * (j % 2) + 1]];
                mma(&mut main[i][j], x_hi[i], b);
                mma(&mut cross[i][j], x_lo[i], b);
            }
        }
        if !W::F16 {
            let w_lo = w_at.map(|at| ldmatrix4(stage + 3 * MMA_TILE_BYTES + at));
            for i in 0..2 {
                for j in 0..4 {
                    let b = [w_lo[j / 2][2 * (j % 2)], w_lo[j / 2][2 * (j % 2) + 1]];
                    mma(&mut cross[i][j], x_hi[i], b);
                }
            }
        }
        staged.store_split(base + ((s + 1) % 2) as u32 * MMA_STAGE_BYTES, !W::F16);
        sync_threads();
    }
    // The tile's sums meet in shared memory (the stages, no longer read: the loop ended on a
    // barrier), `[64][64 + 8]` f32: rows 8 floats apart put a fragment's 8 rows in distinct
    // banks. Warps 4-7 store theirs, warps 0-3 add theirs, then the block writes the tile out
    // row by row.
    let out = smem as *mut f32;
    let at = |i: usize, j: usize, e: usize| {
        let r = qm as usize + 16 * i + (lane / 4) as usize + 8 * (e / 2);
        r * OUT_STRIDE + qn as usize + 8 * j + 2 * (lane % 4) as usize + e % 2
    };
    // Indexed loops, each simple enough to be unrolled, so that every index is a constant and
    // the sums stay in registers.
    let mut finite = true;
    for i in 0..2 {
        for j in 0..4 {
            for e in 0..4 {
                let v = fma(cross[i][j][e], 1.0 / LO_SCALE, main[i][j][e]);
                finite &= v.is_finite();
                main[i][j][e] = v;
            }
        }
    }
    if half == 1 {
        for i in 0..2 {
            for j in 0..4 {
                for e in 0..4 {
                    unsafe { *out.add(at(i, j, e)) = main[i][j][e] };
                }
            }
        }
    }
    // The handover's barrier, and the block's vote.
    if unsafe { barrier_or(!finite as i32) } != 0 {
        return false;
    }
    if half == 0 {
        for i in 0..2 {
            for j in 0..4 {
                for e in 0..4 {
                    unsafe { *out.add(at(i, j, e)) += main[i][j][e] };
                }
            }
        }
    }
    sync_threads();
    let t = thread() as usize;
    for n in (t..TILE_M * TILE_N).step_by(256) {
        let (r, c) = (tiles.row0 + n / TILE_N, tiles.col0 + n % TILE_N);
        if r < tiles.rows && c < tiles.n_out {
            let b = if bias.is_null() {
                0.0
            } else {
                unsafe { *bias.add(c) }
            };
            let v = unsafe { *out.add(n / TILE_N * OUT_STRIDE + n % TILE_N) };
            unsafe { *y.add(r * tiles.n_out + c) = v + b };
        }
    }
    true
}

/// The two entry points of one weight format, `$w` built from the raw pointer and `n_in`:
///
/// `$gemv(y, x, w, bias, n_in, n_out, split)`: `y[o] = w[o, :]·x + bias[o]` for one token;
/// `bias` may be null. Grid: `ceil(n_out / (8 / split))` blocks; block: exactly 256 threads;
/// `split` in {1, 2, 4, 8} warps per output; shared: 8 f32 (32 bytes).
///
/// `$gemm(y, x, w, bias, rows, n_in, n_out)`: `y[t, o] = x[t, :]·w[o, :] + bias[o]` for
/// `rows` tokens; `bias` may be null. Grid: `ceil(rows / 64) · ceil(n_out / 64)` blocks;
/// block: exactly 256 threads; shared: 32768 bytes (the tensor-core loop's two stages).
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
