//! Token choice on the GPU. CPU twin: `orcd::cpu::argmax`.
use crate::util::{WARP, better, block_dim, shared, sync_threads, thread, warp_argmax};

/// Index of the largest of `n` floats; the first index wins on ties, NaN never wins
/// (all NaN gives `u32::MAX`). Grid: one block; block: a multiple of 32 threads, at most 1024;
/// shared: 32 f32 + 32 u32.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn argmax(out: *mut u32, x: *const f32, n: u32) {
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    let mut i = thread();
    while i < n {
        let v = unsafe { *x.add(i as usize) };
        if better(v, i, bv, bi) {
            bv = v;
            bi = i;
        }
        i += block_dim();
    }
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let (bv, bi) = warp_argmax(bv, bi);
    let sv = shared::<f32>();
    let si = unsafe { sv.add(32) } as *mut u32;
    if lane == 0 {
        unsafe {
            *sv.add(warp as usize) = bv;
            *si.add(warp as usize) = bi;
        }
    }
    sync_threads();
    if warp == 0 {
        let (v, i) = if lane < warps {
            unsafe { (*sv.add(lane as usize), *si.add(lane as usize)) }
        } else {
            (f32::NEG_INFINITY, u32::MAX)
        };
        let (_, i) = warp_argmax(v, i);
        if lane == 0 {
            unsafe { *out = i };
        }
    }
}
