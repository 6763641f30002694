//! Matrix-vector products. CPU twin: `orcd::cpu::gemv_f16`.
use crate::util::{WARP, block, block_dim, f16_to_f32, thread, warp_sum};

/// `y[r] = sum_c w[r, c] * x[c]` with `w` f16 `[rows, cols]` row-major, f32 accumulation.
/// One warp per row. Grid: `ceil(rows / (blockDim / 32))` blocks; no shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gemv_f16(
    y: *mut f32,
    w: *const u16,
    x: *const f32,
    rows: u32,
    cols: u32,
) {
    let lane = thread() % WARP;
    let row = block() * (block_dim() / WARP) + thread() / WARP;
    if row >= rows {
        return;
    }
    let w = unsafe { w.add(row as usize * cols as usize) };
    let mut acc = 0.0f32;
    if cols % 2 == 0 {
        // Every row starts 4-byte aligned: read two halves at a time.
        let w2 = w as *const u32;
        let mut c = lane;
        while c < cols / 2 {
            let p = unsafe { *w2.add(c as usize) };
            let (c0, c1) = (2 * c as usize, 2 * c as usize + 1);
            acc += f16_to_f32(p as u16) * unsafe { *x.add(c0) };
            acc += f16_to_f32((p >> 16) as u16) * unsafe { *x.add(c1) };
            c += WARP;
        }
    } else {
        let mut c = lane;
        while c < cols {
            acc += f16_to_f32(unsafe { *w.add(c as usize) }) * unsafe { *x.add(c as usize) };
            c += WARP;
        }
    }
    let acc = warp_sum(acc);
    if lane == 0 {
        unsafe { *y.add(row as usize) = acc };
    }
}
