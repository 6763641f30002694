//! Elementwise steps of the forward pass. CPU twins: `orcd::cpu::silu_mul`, `orcd::cpu::add`.
use crate::util::{block, block_dim, exp, thread};

/// This thread's element: one per thread over the whole grid.
#[inline(always)]
fn index() -> usize {
    block() as usize * block_dim() as usize + thread() as usize
}

/// `gate[i] = silu(gate[i])·up[i]` with `silu(g) = g / (1 + e^-g)` (SwiGLU); `e^x` is
/// `ex2.approx`-based (see `util::exp`). Grid: `ceil(n / blockDim)` blocks; any block size;
/// no shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn silu_mul(gate: *mut f32, up: *const f32, n: u32) {
    let i = index();
    if i < n as usize {
        unsafe {
            let g = *gate.add(i);
            *gate.add(i) = g / (1.0 + exp(-g)) * *up.add(i);
        }
    }
}

/// `x[i] += y[i]`, the residual connection. Grid: `ceil(n / blockDim)` blocks; any block
/// size; no shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn add(x: *mut f32, y: *const f32, n: u32) {
    let i = index();
    if i < n as usize {
        unsafe { *x.add(i) += *y.add(i) };
    }
}
