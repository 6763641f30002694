//! Elementwise steps of the forward pass. CPU twins: `orcd::cpu::silu_mul`, `orcd::cpu::add`.
use crate::params::{Add, SiluMul};
use crate::util::{block, block_dim, exp, thread};

/// This thread's element: one per thread over the whole grid.
#[inline(always)]
fn index() -> usize {
    block() as usize * block_dim() as usize + thread() as usize
}

/// `gate[i] = silu(gate[i])·up[i]` with `silu(g) = g / (1 + e^-g)` (SwiGLU); `e^x` is
/// `ex2.approx`-based (see `util::exp`). Grid: `ceil(n / blockDim)` blocks; any block size;
/// no shared memory.
#[inline(always)]
pub(crate) unsafe fn silu_mul(p: SiluMul) {
    let SiluMul { gate, up, n } = p;
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
#[inline(always)]
pub(crate) unsafe fn add(p: Add) {
    let Add { x, y, n } = p;
    let i = index();
    if i < n as usize {
        unsafe { *x.add(i) += *y.add(i) };
    }
}
