//! NeoX rotary embedding. CPU twin: `orcd::cpu::rope_neox`.
use core::arch::nvptx;

use crate::params::RopeNeox;
use crate::util::{block, block_dim, thread};

/// In place on `x = [rows, n_heads * 2 * half]`: in each head, element `i < half` rotates with
/// element `i + half` by the angle of position `pos[0] + row`. The angles come from `table =
/// [max_pos, half, 2]` (cos, sin), computed on the host as the CPU twin computes them, so GPU
/// and CPU agree bit for bit. Traps when a position is outside the table.
/// Grid: `ceil(rows * n_heads * half / blockDim)` blocks, one thread per rotated pair;
/// no shared memory.
#[inline(always)]
pub(crate) unsafe fn rope_neox(p: RopeNeox) {
    let RopeNeox {
        x,
        pos,
        table,
        rows,
        n_heads,
        half,
        max_pos,
    } = p;
    let p0 = unsafe { *pos };
    if p0 > max_pos - rows {
        unsafe { nvptx::trap() };
    }
    let idx = block() * block_dim() + thread();
    if idx >= rows * n_heads * half {
        return;
    }
    let (i, head) = ((idx % half) as usize, idx / half);
    let p = (p0 + head / n_heads) as usize;
    let half = half as usize;
    let (cos, sin) = unsafe {
        let t = table.add(2 * (p * half + i));
        (*t, *t.add(1))
    };
    unsafe {
        let a = x.add(head as usize * 2 * half + i);
        let b = a.add(half);
        let (va, vb) = (*a, *b);
        *a = va * cos - vb * sin;
        *b = va * sin + vb * cos;
    }
}
