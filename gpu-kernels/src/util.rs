//! Thread indices and warp/block reductions shared by the kernel families.
use core::arch::{asm, nvptx};
use core::sync::atomic::{AtomicU32, Ordering::Relaxed};

pub use kernel_abi::WARP;
const FULL_MASK: u32 = 0xffff_ffff;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_bfly_i32(mask: u32, v: i32, lane_mask: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn shfl_idx_i32(mask: u32, v: i32, lane: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn vote_ballot(mask: u32, pred: bool) -> u32;
}

#[inline(always)]
pub fn thread() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}

#[inline(always)]
pub fn block() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}

#[inline(always)]
pub fn block_dim() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}

#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// The block's dynamic shared memory, sized at launch.
#[inline(always)]
pub fn shared<T>() -> *mut T {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<T>()
}

/// `v` of lane `lane` of this warp (the whole warp calls it).
#[inline(always)]
pub fn from_lane(v: u32, lane: u32) -> u32 {
    unsafe { shfl_idx_i32(FULL_MASK, v as i32, lane, 0x1f) as u32 }
}

/// The lanes of this warp whose `pred` is true, bit `l` for lane `l` (the whole warp calls it).
#[inline(always)]
pub fn ballot(pred: bool) -> u32 {
    unsafe { vote_ballot(FULL_MASK, pred) }
}

/// Sum over the 32 lanes of a warp; every lane gets the result.
#[inline(always)]
pub fn warp_sum(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v += unsafe { shfl_bfly_f32(FULL_MASK, v, m, 0x1f) };
        m >>= 1;
    }
    v
}

/// Sum over each group of 4 neighbouring lanes (lanes `4i..4i + 4`); every lane of the group
/// gets it.
#[inline(always)]
pub fn warp_sum4(v: f32) -> f32 {
    let v = v + unsafe { shfl_bfly_f32(FULL_MASK, v, 1, 0x1f) };
    v + unsafe { shfl_bfly_f32(FULL_MASK, v, 2, 0x1f) }
}

/// Sum over the whole block (blockDim a multiple of 32, at most 1024); every thread gets it.
/// Needs 32 f32 of dynamic shared memory.
#[inline(always)]
pub fn block_sum(v: f32) -> f32 {
    let smem = shared::<f32>();
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let v = warp_sum(v);
    if lane == 0 {
        unsafe { *smem.add(warp as usize) = v };
    }
    sync_threads();
    let v = if lane < warps {
        unsafe { *smem.add(lane as usize) }
    } else {
        0.0
    };
    let v = warp_sum(v);
    // Keep the shared slots alive until every warp has read them, so the block can reduce again.
    sync_threads();
    v
}

/// The better of two (value, index) pairs: larger value, then smaller index (first wins on ties).
/// NaN never wins.
#[inline(always)]
pub fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    v > bv || (v == bv && i < bi)
}

/// Arg-max over the lanes of a warp; every lane gets the winning (value, index).
#[inline(always)]
pub fn warp_argmax(mut v: f32, mut i: u32) -> (f32, u32) {
    let mut m = 16;
    while m > 0 {
        let ov = unsafe { shfl_bfly_f32(FULL_MASK, v, m, 0x1f) };
        let oi = unsafe { shfl_bfly_i32(FULL_MASK, i as i32, m, 0x1f) } as u32;
        if better(ov, oi, v, i) {
            v = ov;
            i = oi;
        }
        m >>= 1;
    }
    (v, i)
}

#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits) as f32
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.ex2.approx.f"]
    fn ex2_approx(x: f32) -> f32;
}

/// `e^x` as an f64, over f64's range: `2^n` (exact) for the integer part `n` of `x·log2(e)`,
/// times `ex2.approx.f32` of the fraction (the relative error of [`exp`]); 0 below `2^-1022`,
/// infinite above `2^1024`.
#[inline(always)]
pub fn exp_wide(x: f32) -> f64 {
    let x = x * core::f32::consts::LOG2_E;
    let n: f32;
    unsafe {
        asm!("cvt.rmi.f32.f32 {0}, {1};", out(reg32) n, in(reg32) x,
            options(pure, nomem, nostack))
    };
    let two_n = f64::from_bits((((n as i32).clamp(-1023, 1024) + 1023) as u64) << 52);
    two_n * unsafe { ex2_approx(x - n) } as f64
}

/// `*p += v` in global memory by one `red.global.add.f64` (no return value to wait for).
#[inline(always)]
pub fn red_add_f64(p: *mut f64, v: f64) {
    unsafe {
        asm!("red.global.add.f64 [{0}], {1};", in(reg64) p, in(reg64) v.to_bits(),
            options(nostack))
    };
}

/// `e^x` through `ex2.approx.f32` (max relative error 2^-22 of the result, plus the rounding of
/// `x * log2(e)`, ~|x| * 2^-24 relative); `exp(-inf) = 0`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    unsafe { ex2_approx(x * core::f32::consts::LOG2_E) }
}

/// Maximum over the 32 lanes of a warp; every lane gets the result.
#[inline(always)]
pub fn warp_max(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v = v.max(unsafe { shfl_bfly_f32(FULL_MASK, v, m, 0x1f) });
        m >>= 1;
    }
    v
}

/// Maximum of a `u32` over the 32 lanes of a warp; every lane gets the result.
#[inline(always)]
pub fn warp_max_u32(v: u32) -> u32 {
    lanes_max_u32(v, 32)
}

/// Maximum of a `u32` over each group of `lanes` neighbouring lanes (a power of 2 up to 32);
/// every lane of the group gets it.
#[inline(always)]
pub fn lanes_max_u32(mut v: u32, lanes: u32) -> u32 {
    let mut m = lanes / 2;
    while m > 0 {
        v = v.max(unsafe { shfl_bfly_i32(FULL_MASK, v as i32, m, 0x1f) } as u32);
        m >>= 1;
    }
    v
}

/// The count of the last-block pattern: `*p += 1` (a word in global memory, 0 before the
/// first of `n` callers) by `atom.acq_rel.gpu`; true for the call that makes it `n`, which
/// sets it back to 0 for the next launch. Its release orders this thread's writes before it
/// (and, through a barrier, its block's) before the count; its acquire, in the last caller,
/// orders what the callers before it released before its reads after it (and, through a
/// barrier, its block's). One instruction costs less than the same with a fence before and
/// after a relaxed atomic.
#[inline(always)]
pub unsafe fn count_last(p: *mut u32, n: u32) -> bool {
    let old: u32;
    unsafe {
        asm!("atom.acq_rel.gpu.global.add.u32 {0}, [{1}], 1;", out(reg32) old, in(reg64) p,
            options(nostack))
    };
    let last = old + 1 == n;
    if last {
        // SAFETY: the caller's word, only used atomically while this launch runs.
        unsafe { AtomicU32::from_ptr(p) }.store(0, Relaxed);
    }
    last
}

/// `fence.acq_rel.gpu`: this thread's writes before it are seen by the GPU before its writes
/// after it (a block's partial results before the count that hands them to the last block).
#[inline(always)]
pub fn fence_gpu() {
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) };
}

/// `p[0..4]` (global memory, 16-byte aligned) read from L2, as [`load_l2`].
#[inline(always)]
pub unsafe fn load_l2x4(p: *const f32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    unsafe {
        asm!("ld.global.cg.v4.f32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b,
            out(reg32) c, out(reg32) d, in(reg64) p, options(nostack, readonly))
    };
    [a, b, c, d]
}

/// `*p` (global memory) read from L2 (`ld.global.cg`), never from a stale L1 line: what
/// other blocks of the same launch wrote.
#[inline(always)]
pub fn load_l2(p: *const f32) -> f32 {
    let v: f32;
    unsafe {
        asm!("ld.global.cg.f32 {0}, [{1}];", out(reg32) v, in(reg64) p, options(nostack, readonly))
    };
    v
}

/// Blocks in the grid.
#[inline(always)]
pub fn grid_dim() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}

#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

/// The tensor-core products (`gemm_mma`, `attention_prefill`) split each f32 operand in two f16
/// halves, `v ≈ hi + lo / LO_SCALE` with `hi = f16(v)` and `lo = f16((v - hi)·LO_SCALE)`: scaled
/// so that `lo` is a normal f16 wherever `hi` is (|v - hi| <= 2^-11·|hi|, so |lo| <= |hi| never
/// overflows either). `hi + lo / LO_SCALE` is `v` to 2^-22 of it while `|v| >= 2^-14`, and to
/// 2^-36 absolute below.
pub const LO_SCALE: f32 = 2048.0;

/// `f16(lo) | f16(hi) << 16`, each rounded to nearest.
#[inline(always)]
pub fn f16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.f16x2.f32 {0}, {1}, {2};", out(reg32) r, in(reg32) hi, in(reg32) lo,
            options(pure, nomem, nostack))
    };
    r
}

/// `a, b` split as at [`LO_SCALE`]: (`f16(a) | f16(b) << 16`, the same of the scaled remainders).
#[inline(always)]
pub fn split_pair(a: f32, b: f32) -> (u32, u32) {
    let hi = f16x2(a, b);
    let (ha, hb) = (f16_to_f32(hi as u16), f16_to_f32((hi >> 16) as u16));
    (hi, f16x2((a - ha) * LO_SCALE, (b - hb) * LO_SCALE))
}

/// Floats `v[2i]`, `v[2i + 1]` split into pairs of halves: (hi words, lo words).
#[inline(always)]
pub fn split<const N: usize, const W: usize>(v: &[f32; N]) -> ([u32; W], [u32; W]) {
    let s: [(u32, u32); W] = core::array::from_fn(|i| split_pair(v[2 * i], v[2 * i + 1]));
    (s.map(|s| s.0), s.map(|s| s.1))
}

/// The shared-window address of `p`, which points into shared memory.
#[inline(always)]
pub fn shared_addr<T>(p: *const T) -> u32 {
    let a: u64;
    unsafe {
        asm!("cvta.to.shared.u64 {0}, {1};", out(reg64) a, in(reg64) p as u64,
            options(pure, nomem, nostack))
    };
    a as u32
}

#[inline(always)]
pub fn store_shared2(at: u32, v: [u32; 2]) {
    unsafe {
        asm!("st.shared.v2.b32 [{0}], {{{1}, {2}}};", in(reg32) at, in(reg32) v[0],
            in(reg32) v[1], options(nostack))
    };
}

#[inline(always)]
pub fn store_shared4(at: u32, v: [u32; 4]) {
    unsafe {
        asm!("st.shared.v4.b32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg32) at, in(reg32) v[0],
            in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack))
    };
}

/// Four words from shared memory at `at` (16-byte aligned).
#[inline(always)]
pub fn load_shared4(at: u32) -> [u32; 4] {
    let v: [u32; 4];
    unsafe {
        let (a, b, c, d): (u32, u32, u32, u32);
        asm!("ld.shared.v4.b32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b,
            out(reg32) c, out(reg32) d, in(reg32) at, options(nostack, readonly));
        v = [a, b, c, d];
    }
    v
}

/// Starts copying 16 bytes from global `src` (16-byte aligned) to shared `at` without the
/// registers (`cp.async`, sm_80+); with `zero` nothing is read and `at` gets zeros. Lands by
/// [`cp_async_wait`] of its group ([`cp_async_commit`]), for this thread's reads.
#[inline(always)]
pub unsafe fn cp_async16(at: u32, src: *const f32, zero: bool) {
    let n: u32 = if zero { 0 } else { 16 };
    unsafe {
        asm!("cp.async.cg.shared.global [{0}], [{1}], 16, {2};", in(reg32) at,
            in(reg64) src, in(reg32) n, options(nostack))
    };
}

/// Closes this thread's group of [`cp_async16`] copies (possibly empty).
#[inline(always)]
pub fn cp_async_commit() {
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// Waits until at most `N` of this thread's newest groups of copies are still in flight.
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
}

/// Four 8×8 matrices of halves from shared memory (`ldmatrix .x4`): lane `l` gives the address
/// of row `l % 8` of matrix `l / 8` (16 bytes) and gets, in word `i`, the halves at row `l / 4`,
/// columns `2·(l % 4)` and `+1` of matrix `i`, or with `TRANS` at column `l / 4`, rows
/// `2·(l % 4)` and `+1` (the lower index in the low half).
#[inline(always)]
pub fn ldmatrix4<const TRANS: bool>(at: u32) -> [u32; 4] {
    let (r0, r1, r2, r3);
    unsafe {
        if TRANS {
            asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
                out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, in(reg32) at,
                options(readonly, nostack));
        } else {
            asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
                out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, in(reg32) at,
                options(readonly, nostack));
        }
    }
    [r0, r1, r2, r3]
}

/// `d += a·b` for one 16×8 tile over k = 16 (`mma.sync` m16n8k16, f16 products exact, f32
/// sums). With `g = lane / 4`, `c = lane % 4`: `a` holds rows `g`, `g + 8`, `g`, `g + 8` at
/// k `2c, 2c + 1` (+8 in words 2, 3); `b` k `2c, 2c + 1` (+8 in word 1) of column `g`; `d`
/// rows `g` (0, 1) and `g + 8` (2, 3) at columns `2c, 2c + 1`.
#[inline(always)]
pub fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    unsafe {
        asm!("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{0}, {1}, {2}, {3}}}, \
              {{{4}, {5}, {6}, {7}}}, {{{8}, {9}}}, {{{0}, {1}, {2}, {3}}};",
            inout(reg32) d[0], inout(reg32) d[1], inout(reg32) d[2], inout(reg32) d[3],
            in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3],
            in(reg32) b[0], in(reg32) b[1], options(pure, nomem, nostack))
    };
}

/// 16 bytes, for one vector access of 4 floats.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct F32x4(pub [f32; 4]);

/// Whether `p` is a multiple of `bytes`.
#[inline(always)]
pub fn aligned<T>(p: *const T, bytes: usize) -> bool {
    (p as usize).is_multiple_of(bytes)
}

/// `*p` (global memory), loaded where it is written: LLVM sinks an ordinary load to its first
/// use (past a GEMV's products, say), which puts its latency after them; an `asm!` with
/// side effects stays put.
#[inline(always)]
pub fn load_early(p: *const f32) -> f32 {
    let v: f32;
    unsafe {
        asm!("ld.global.f32 {0}, [{1}];", out(reg32) v, in(reg64) p, options(nostack, readonly))
    };
    v
}

/// Brings `bytes` from `p` (global memory) into L2, one `prefetch.global.L2` per 128-byte line,
/// the lines dealt over the grid's threads: data the next kernel reads arrives while this one
/// runs. Every thread of a 1-D grid calls it.
#[inline(always)]
pub fn prefetch_l2(p: *const f32, bytes: usize) {
    let (all, mut line) = (
        (grid_dim() * block_dim()) as usize,
        (block() * block_dim() + thread()) as usize,
    );
    while line * 128 < bytes {
        let a = p.wrapping_byte_add(line * 128);
        unsafe { asm!("prefetch.global.L2 [{0}];", in(reg64) a, options(nostack, readonly)) };
        line += all;
    }
}

/// Programmatic dependent launch (sm_90 and later; a no-op in the sm_80 build): waits until
/// the grid this one was launched behind has finished and its writes are visible. A kernel
/// launched with the host's overlap attribute calls it before it writes anything, or reads
/// what that grid may write; until then it may read weights, and what earlier grids wrote
/// (they finished before that grid let this one start: [`allow_next_grid`] comes after this).
/// Launched without the attribute, it returns at once.
#[inline(always)]
pub fn wait_prior_grids() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    };
}

/// Lets the next grid in the stream, launched with the overlap attribute, start its blocks
/// (its weight loads) while this one runs; called after [`wait_prior_grids`], so that at
/// most two grids overlap. A no-op in the sm_80 build.
#[inline(always)]
pub fn allow_next_grid() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack))
    };
}

/// `*p` for a weight (global memory, aligned to its size of 2, 4, 8 or 16 bytes) that this
/// kernel reads once: `ld.global.cs` allocates its lines evict-first in L1 and L2, so that a
/// matrix streamed through does not evict what is read again (activations, the KV cache, the
/// kernels' code).
#[inline(always)]
pub unsafe fn load_streaming<T: Copy>(p: *const T) -> T {
    let mut w = [0u32; 4];
    unsafe {
        match size_of::<T>() {
            2 => {
                let v: u16;
                asm!("ld.global.cs.u16 {0}, [{1}];", out(reg16) v, in(reg64) p,
                    options(pure, readonly, nostack));
                w[0] = v as u32;
            }
            4 => asm!("ld.global.cs.u32 {0}, [{1}];", out(reg32) w[0], in(reg64) p,
                options(pure, readonly, nostack)),
            8 => asm!("ld.global.cs.v2.u32 {{{0}, {1}}}, [{2}];", out(reg32) w[0],
                out(reg32) w[1], in(reg64) p, options(pure, readonly, nostack)),
            16 => asm!("ld.global.cs.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) w[0],
                out(reg32) w[1], out(reg32) w[2], out(reg32) w[3], in(reg64) p,
                options(pure, readonly, nostack)),
            _ => nvptx::trap(),
        }
        core::mem::transmute_copy(&w)
    }
}
