//! Launch helper of the row-independent matrix product of the batched pass
//! (gpu-kernels/src/gemm_rows.rs).
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use kernel_abi::gemm_rows::PER_TILE;

use super::kernels::{DevPtr, DevPtrMut, GemmRows};
use super::matmul::entry_of;
use super::{Device, Overlap, allow_shared, check, u32_of};
use crate::Result;

/// Outputs per warp and the most m16 row tiles per block (the kernel's), and the most K slices
/// and output groups per block.
const WARP_OUTS: usize = kernel_abi::gemm_rows::WARP_OUTS as usize;
const MAX_MT: usize = kernel_abi::gemm_rows::MAX_MT as usize;
const MAX_SLICES: usize = 8;
const MAX_GROUPS: usize = 4;
/// Blocks per row tile that the output groups and K slices aim at: enough warps for the
/// H200's 132 SMs where the outputs are few (a function of the shape alone).
const AIM_WARPS: usize = 1056;
const AIM_BLOCKS: usize = 264;

/// `(ks, nw)` for a `[n_out, n_in]` matrix: K slices per block (each output's sum is theirs,
/// added in order, so this depends on the shape alone: row independence) and 16-output groups
/// per block. Wide matrices get 4 groups (which share their rows of x through L1) and few
/// slices; narrow ones a group and up to 8 slices of at least 4 chunks of 32, so that the
/// grid has about `AIM_WARPS` warps a row tile.
pub(super) fn gemm_rows_split(n_in: usize, n_out: usize) -> (u32, u32) {
    let nw = (n_out / (WARP_OUTS * AIM_BLOCKS)).clamp(1, MAX_GROUPS);
    // 1, 2 or 4.
    let nw = if nw == 3 { 2 } else { nw };
    let blocks = n_out.div_ceil(WARP_OUTS * nw);
    let ks = (n_in / 32)
        .div_ceil(4)
        .min(AIM_WARPS.div_ceil(blocks))
        .clamp(1, MAX_SLICES);
    (ks as u32, nw as u32)
}

impl Device {
    /// `y[t, o] = sum_i x[t, i]·w[o, i] + bias[o]` for `t` in `0..rows` (1 to any), as
    /// `matmul`, for the batched pass: each row of `y` is a function of its row of `x` alone,
    /// bit for bit, whatever `rows` and the other rows (the kernel's K split and sum order
    /// depend on the shape of `w` only). Tensor cores with f32 operands split into f16 halves
    /// (as `matmul`'s GEMM: each product within ~3·2^-22 of |x·w|); outputs that come out
    /// non-finite are redone in f32. Rows of `n_in % 32 != 0`, or `x` not 16-byte aligned,
    /// go to `matmul` (a choice by shape and buffer, not by row count). Twin: `cpu::matmul`
    /// on the dequantized weights.
    pub fn matmul_rows(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &super::GpuMatrix,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
    ) -> Result<()> {
        let (n_in, n_out) = (w.n_in(), w.rows());
        check(
            x.len() >= rows * n_in
                && y.len() >= rows * n_out
                && bias.is_none_or(|b| b.len() == n_out),
            "matmul_rows: shapes",
        )?;
        if rows == 0 || n_out == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (x_ptr, _x) = DevPtr::of(x, s);
        if !n_in.is_multiple_of(32) || !x_ptr.is_aligned(16) {
            drop(_x);
            return self.matmul(y, x, w, bias, rows);
        }
        let (y, _y) = DevPtrMut::of(y, s);
        let (wp, _w) = w.ptr(s);
        let bias = bias.map(|b| DevPtr::of(b, s));
        // A null bias pointer: the kernel adds nothing.
        let bias = bias.as_ref().map_or(DevPtr::null(), |(p, _)| *p);
        let (ks, nw) = gemm_rows_split(n_in, n_out);
        let mt = match rows.div_ceil(16) {
            1 => 1,
            2 => 2,
            _ => MAX_MT,
        };
        let entry = entry_of(GemmRows::entry(w.ty() as u32), "matmul_rows")?;
        let f = self.function(entry);
        // As many output groups as the kernel's registers allow (ks·32 threads always fit:
        // ks <= 8 and at most 255 registers a thread).
        let fit = (f.max_threads_per_block()? as u32 / (32 * ks)).max(1);
        let nw = nw.min(fit);
        let shared = 4 * ks * nw * mt as u32 * PER_TILE;
        allow_shared(f, shared)?;
        let blocks = rows.div_ceil(16 * mt) * n_out.div_ceil(WARP_OUTS * nw as usize);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(blocks, "matmul_rows blocks")?, 1, 1),
            block_dim: (32 * ks * nw, 1, 1),
            shared_mem_bytes: shared,
        };
        let p = GemmRows {
            y,
            x: x_ptr,
            w: wp,
            bias,
            rows: u32_of(rows, "matmul_rows rows")?,
            n_in: u32_of(n_in, "matmul_rows n_in")?,
            n_out: u32_of(n_out, "matmul_rows n_out")?,
            ks,
            mt: mt as u32,
        };
        // SAFETY: the kernel reads rows·n_in of x (16-byte aligned, n_in % 32 == 0), the n_out
        // rows of w (a GpuMatrix: packed or plain, 16-byte aligned), n_out of bias and writes
        // rows·n_out of y, all checked above; mt is 1, 2 or 4, the block ks·nw whole warps
        // within the kernel's registers, the shared size ks·nw·mt·PER_TILE f32, allowed above. It
        // reads and writes nothing before its wait, so it may overlap.
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_rows_split;

    /// The model's shapes: narrow outputs get K slices, the vocabulary output groups.
    #[test]
    fn split_by_shape() {
        assert_eq!(gemm_rows_split(896, 896), (7, 1));
        assert_eq!(gemm_rows_split(896, 128), (7, 1));
        assert_eq!(gemm_rows_split(896, 4864), (4, 1));
        assert_eq!(gemm_rows_split(4864, 896), (8, 1));
        assert_eq!(gemm_rows_split(896, 151936), (1, 4));
        assert_eq!(gemm_rows_split(32, 1), (1, 1));
    }
}
