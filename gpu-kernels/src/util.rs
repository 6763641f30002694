//! Thread indices and warp/block reductions shared by the kernel families.
use core::arch::nvptx;

pub const WARP: u32 = 32;
const FULL_MASK: u32 = 0xffff_ffff;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_bfly_i32(mask: u32, v: i32, lane_mask: u32, clamp: u32) -> i32;
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
    let v = if lane < warps { unsafe { *smem.add(lane as usize) } } else { 0.0 };
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

unsafe extern "C" {
    #[link_name = "llvm.nvvm.membar.gl"]
    fn membar_gl();
}

/// CUDA's `__threadfence()`: this thread's writes before it are seen by the whole GPU before
/// its writes after it, and its reads after it see what other threads published before their
/// own fence and a flag (atomic) that this thread then read.
#[inline(always)]
pub fn threadfence() {
    unsafe { membar_gl() }
}

/// Blocks in the grid.
#[inline(always)]
pub fn grid_dim() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// Programmatic dependent launch (the sm_90 build, `--cfg orcd_pdl`): waits until the kernels
/// this one depends on have finished and their writes are visible. A kernel launched with the
/// host's PDL attribute may start while the kernel before it still runs: it may read only
/// what no kernel writes (weights) before this. Without PDL a no-op (the launch itself waited).
#[inline(always)]
pub fn wait_for_inputs() {
    #[cfg(orcd_pdl)]
    unsafe {
        core::arch::asm!("griddepcontrol.wait;", options(nostack))
    };
}

/// Lets the next kernel of the stream start (its blocks then prefetch and wait in
/// `wait_for_inputs`). Called after this kernel's own wait, so at most two kernels overlap.
#[inline(always)]
pub fn release_next() {
    #[cfg(orcd_pdl)]
    unsafe {
        core::arch::asm!("griddepcontrol.launch_dependents;", options(nostack))
    };
}
