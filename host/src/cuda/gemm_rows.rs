//! Launch helper of the row-independent matrix product of the batched pass
//! (gpu-kernels/src/gemm_rows.rs).
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use kernel_abi::gemm_rows::shared_bytes;

use super::kernels::{DevPtr, DevPtrMut, GemmRows};
use super::matmul::entry_of;
use super::{Device, Overlap, SplitScratch, allow_shared, check, u32_of};
use crate::Result;

/// Outputs per warp and the most m16 row tiles per block (the kernel's).
const WARP_OUTS: usize = kernel_abi::gemm_rows::WARP_OUTS as usize;
const MAX_MT: usize = kernel_abi::gemm_rows::MAX_MT as usize;
/// The most parts of K (the kernel's), each at least `MIN_PART` chunks of 32.
const MAX_PARTS: usize = kernel_abi::gemm_rows::MAX_PARTS as usize;
const MIN_PART: usize = 4;
/// Blocks a row tile aims at: the H200's 132 SMs (a constant, so that the split of K stays a
/// function of the shape alone).
const AIM_BLOCKS: usize = 132;

/// `(nw, kb)` for a `[n_out, n_in]` matrix: warps per block (16 outputs each, sharing the
/// block's staged rows of x: the wider the block, the fewer times x is read) and parts of K
/// (each output's sum is theirs, added in order, so this depends on the shape alone: row
/// independence), enough for about `AIM_BLOCKS` blocks a row tile.
pub(super) fn gemm_rows_plan(n_in: usize, n_out: usize) -> (u32, u32) {
    let nw = match n_out {
        8192.. => 8,
        512.. => 4,
        256.. => 2,
        _ => 1,
    };
    let col_blocks = n_out.div_ceil(WARP_OUTS * nw);
    let kb = AIM_BLOCKS
        .div_ceil(col_blocks)
        .min(MAX_PARTS)
        .min(n_in / 32 / MIN_PART)
        .max(1);
    (nw as u32, kb as u32)
}

/// Floats of `gemm_scratch` a row of `matmul_rows` over a `[n_out, n_in]` matrix takes: its
/// parts' sums (the outputs rounded up to whole blocks), none where K is one part.
pub fn gemm_rows_scratch(n_in: usize, n_out: usize) -> usize {
    match gemm_rows_plan(n_in, n_out) {
        (_, 1) => 0,
        (nw, kb) => kb as usize * n_out.next_multiple_of(WARP_OUTS * nw as usize),
    }
}

impl Device {
    /// The scratch of `matmul_rows` for up to `rows` rows of matrices whose
    /// `gemm_rows_scratch` is at most `per_row`: the parts' sums, and a count per tile.
    pub fn gemm_scratch(&self, rows: usize, per_row: usize) -> Result<SplitScratch> {
        self.split_scratch(
            // Rows rounded up to whole blocks.
            rows.next_multiple_of(16 * MAX_MT) * per_row,
            // A split K has fewer than AIM_BLOCKS output blocks.
            rows.div_ceil(16) * AIM_BLOCKS,
        )
    }

    /// `y[t, o] = sum_i x[t, i]·w[o, i] + bias[o]` for `t` in `0..rows` (1 to any), as
    /// `matmul`, for the batched pass: each row of `y` is a function of its row of `x` alone,
    /// bit for bit, whatever `rows` and the other rows (the kernel's split of K and sum order
    /// depend on the shape of `w` only). Tensor cores on x and the weights rounded to f16
    /// (each product within ~2^-10 of |x·w|);
    /// outputs that come out non-finite are redone in f32. Rows of `n_in % 32 != 0`, or `x`
    /// not 16-byte aligned, go to `matmul` (a choice by shape and buffer, not by row count).
    /// Twin: `cpu::matmul` on the dequantized weights.
    pub fn matmul_rows(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &super::GpuMatrix,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
        scratch: &mut SplitScratch,
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
        let (nw, kb) = gemm_rows_plan(n_in, n_out);
        // Taller tiles decode each weight for more rows, but make fewer blocks: the tallest
        // only where the rows fill the GPU with blocks anyway.
        let mt = match rows.div_ceil(16) {
            1 => 1,
            2 => 2,
            3..=8 => 4,
            _ => MAX_MT,
        };
        let (row_tiles, col_blocks) = (
            rows.div_ceil(16 * mt),
            n_out.div_ceil(WARP_OUTS * nw as usize),
        );
        let tile = 16 * mt * WARP_OUTS * nw as usize;
        if kb > 1
            && (scratch.part.len() < kb as usize * row_tiles * col_blocks * tile
                || scratch.counts.len() < row_tiles * col_blocks)
        {
            return Err(crate::Error::Invalid(format!(
                "matmul_rows: the scratch does not hold {rows} rows of {n_out}x{n_in}"
            )));
        }
        let (y, _y) = DevPtrMut::of(y, s);
        let (wp, _w) = w.ptr(s);
        let bias = bias.map(|b| DevPtr::of(b, s));
        // A null bias pointer: the kernel adds nothing.
        let bias = bias.as_ref().map_or(DevPtr::null(), |(p, _)| *p);
        let (part, _part) = DevPtrMut::of(&mut scratch.part, s);
        let (counts, _counts) = DevPtrMut::of(&mut scratch.counts, s);
        let entry = entry_of(GemmRows::entry(w.ty() as u32), "matmul_rows")?;
        let f = self.function(entry);
        let shared = shared_bytes(mt as u32);
        allow_shared(f, shared)?;
        let blocks = row_tiles * col_blocks * kb as usize;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(blocks, "matmul_rows blocks")?, 1, 1),
            block_dim: (32 * nw, 1, 1),
            shared_mem_bytes: shared,
        };
        let p = GemmRows {
            y,
            x: x_ptr,
            w: wp,
            bias,
            part,
            counts,
            rows: u32_of(rows, "matmul_rows rows")?,
            n_in: u32_of(n_in, "matmul_rows n_in")?,
            n_out: u32_of(n_out, "matmul_rows n_out")?,
            kb,
            mt: mt as u32,
        };
        // SAFETY: the kernel reads rows·n_in of x (16-byte aligned, n_in % 32 == 0), the n_out
        // rows of w (a GpuMatrix: packed or plain, 16-byte aligned), n_out of bias and writes
        // rows·n_out of y, all checked above; with kb > 1 it writes kb whole tiles per tile of
        // part and a count per tile, checked above, the counts left at zero. kb <= n_in / 32; mt is 1, 2
        // 4 or 8, the block 32·nw threads (nw <= 8, within any kernel's registers), the shared
        // size the kernel's, allowed above. It reads and writes nothing before its wait, so it
        // may overlap.
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_rows_plan;

    /// The models' shapes: narrow outputs get parts of K, the vocabulary wide blocks.
    #[test]
    fn plan_by_shape() {
        assert_eq!(gemm_rows_plan(896, 896), (4, 7));
        assert_eq!(gemm_rows_plan(896, 128), (1, 7));
        assert_eq!(gemm_rows_plan(896, 4864), (4, 2));
        assert_eq!(gemm_rows_plan(4864, 896), (4, 8));
        assert_eq!(gemm_rows_plan(896, 151936), (8, 1));
        assert_eq!(gemm_rows_plan(1536, 8960), (8, 2));
        assert_eq!(gemm_rows_plan(8960, 1536), (4, 6));
        assert_eq!(gemm_rows_plan(32, 1), (1, 1));
    }
}
