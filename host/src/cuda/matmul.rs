//! Launch helpers of the matmul, quant and elementwise kernel families
//! (gpu-kernels/src/{matmul,quant,elementwise}.rs).
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::f16;
use kernel_abi::gemm;

use super::kernels::{Add, DequantizeF16, DevPtr, DevPtrMut, Embed, Entry, Gemm, Gemv, SiluMul};
use super::{BLOCK, Device, Overlap, allow_shared, check, u32_of};
use crate::Result;
use crate::pack;
use crate::quant::{GgmlType, dequantize_f16};

/// The most warps of a GEMV unit: each lane takes one chunk of 32 weights per row, and a block
/// holds at most 32 warps, so rows of at most 32 warps' chunks (longer ones go to the GEMM).
const GEMV_MAX_SPLIT: usize = 32;

/// Blocks of `BLOCK` threads for one thread per element.
pub(super) fn one_per_element(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The entry point of kernel `K` for key `key` (`entry`), or an error naming `what`.
pub(super) fn entry_of<K>(entry: Option<Entry<K>>, what: &str) -> Result<Entry<K>> {
    entry.ok_or_else(|| crate::Error::Invalid(format!("{what}: no kernel for it")))
}

/// Warps per unit of the GEMV for rows of `n_in` (a lane per chunk of 32), or `None` when rows
/// are empty or too long for it.
pub(super) fn gemv_split(n_in: usize) -> Option<u32> {
    let split = n_in.div_ceil(32).div_ceil(32);
    (1..=GEMV_MAX_SPLIT)
        .contains(&split)
        .then_some(split as u32)
}

/// A weight matrix `[rows, n_in]` on the GPU as the kernels read it: a quantized type packed
/// (`pack::pack`, 16-byte aligned sections), or plain floats as they are.
pub struct GpuMatrix {
    data: CudaSlice<u8>,
    ty: GgmlType,
    rows: usize,
    n_in: usize,
}

impl GpuMatrix {
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn n_in(&self) -> usize {
        self.n_in
    }

    /// Bytes on the GPU.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The bytes on the GPU, in the kernels' layout (`pack`'s for quantized types).
    pub fn download(&self, dev: &Device) -> Result<Vec<u8>> {
        dev.download(&self.data)
    }

    /// The device address (16-byte aligned) with its stream guard.
    pub(super) fn ptr<'s>(&'s self, stream: &'s CudaStream) -> (DevPtr<u8>, SyncOnDrop<'s>) {
        DevPtr::of(&self.data, stream)
    }
}

impl Device {
    /// The matrix `data`, whole rows of `n_in` elements of `ty` as stored in the file, on the
    /// GPU in the kernels' layout (quantized types packed, losslessly).
    pub fn upload_matrix(&self, ty: GgmlType, data: &[u8], n_in: usize) -> Result<GpuMatrix> {
        let packed = pack::pack(ty, data, n_in)?;
        let rows = data.len() / ty.row_bytes(n_in).unwrap_or(1).max(1);
        Ok(GpuMatrix {
            data: self.upload(&packed)?,
            ty,
            rows,
            n_in,
        })
    }

    /// The matrix `data` (as in `upload_matrix`) dequantized to f16 (the `--weights f16` path).
    /// Quantized matrices are uploaded packed and converted on the GPU (`dequantize_f16`,
    /// twin of `quant::dequantize_f16`): the load moves the file's bytes rather than twice as
    /// many, and no CPU time goes to the conversion. Plain floats are converted on the CPU.
    pub fn upload_matrix_f16(&self, ty: GgmlType, data: &[u8], n_in: usize) -> Result<GpuMatrix> {
        let n = data.len() / ty.block_bytes() * ty.block_elems();
        if ty.block_elems() > 1 {
            // The f16 matrix first: the packed copy freed after it leaves a hole that the next
            // matrix's packed copy reuses, not one between the f16 matrices.
            let mut out = self.zeros::<u8>(2 * n)?;
            let packed = self.upload_matrix(ty, data, n_in)?;
            let (rows, n_in32) = (u32_of(packed.rows, "f16 rows")?, u32_of(n_in, "f16 row")?);
            // Quantized rows are whole blocks, so whole groups of 8: a thread per group.
            let cfg = one_per_element(u32_of(n / 8, "f16 weights")?.max(1));
            let s = self.stream();
            let (o, _o) = DevPtrMut::of(&mut out, s);
            let (w, _w) = packed.ptr(s);
            let p = DequantizeF16 {
                out: o.cast(),
                w,
                ty: ty as u32,
                rows,
                n_in: n_in32,
            };
            // SAFETY: `packed` is `rows` packed rows of `n_in` (a multiple of 32) of type `ty`,
            // `out` holds 2·rows·n_in bytes from a fresh (256-byte aligned) allocation.
            unsafe { p.launch(self, DequantizeF16::dequantize_f16, cfg, Overlap::Serial) }?;
            // `packed` is freed in stream order, after the kernel.
            drop((_o, _w));
            return Ok(GpuMatrix {
                data: out,
                ty: GgmlType::F16,
                rows: packed.rows,
                n_in,
            });
        }
        let mut w = vec![f16::ZERO; n];
        dequantize_f16(ty, data, &mut w)?;
        // SAFETY: an f16 is 2 bytes with no padding and any bit pattern is a valid u8.
        let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), 2 * w.len()) };
        // f16 is a plain type: packing borrows the bytes as they are.
        self.upload_matrix(GgmlType::F16, bytes, n_in)
    }

    /// `y[t, o] = sum_i x[t, i]·w[o, i] + bias[o]` for `t` in `0..rows`, with `w` `[n_out,
    /// n_in]` dequantized on the fly to exactly `quant::dequantize`'s values; f32
    /// accumulation. `x` and `y` may be longer than `rows` rows (reused buffers); the rest is
    /// untouched. `rows == 1` runs the GEMV kernel (rows up to 32768), else the tiled GEMM (see
    /// `launch_matmul`). Twin: `cpu::matmul` on the dequantized weights.
    pub fn matmul(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &GpuMatrix,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
    ) -> Result<()> {
        let (wp, _w) = w.ptr(self.stream());
        self.launch_matmul(w.ty, y, x, wp, bias, rows, w.n_in, w.rows, "matmul")
    }

    /// Launches the GEMV (`rows == 1`) or GEMM of weights of type `ty` at `w`, whose size and
    /// alignment the caller checked; `what` names the caller in errors. The GEMM runs on
    /// tensor cores with every f32 operand split into two f16 halves: each product within
    /// ~3·2^-22 of |x·w| (plus 2^-36 of the other operand where one is below 2^-14, f16's
    /// normal range), measured ~1e-7 of sum|x·w| against the f32 product. It falls back to
    /// f32 FMA for rows of x or w that are not 16-byte aligned (`n_in % 8 != 0`, or views that
    /// start unaligned) and for 64×64 tiles with an operand beyond f16's range (|v| >= 65520).
    #[allow(clippy::too_many_arguments)]
    fn launch_matmul(
        &self,
        ty: GgmlType,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: DevPtr<u8>,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
        n_in: usize,
        n_out: usize,
        what: &str,
    ) -> Result<()> {
        check(
            x.len() >= rows * n_in
                && y.len() >= rows * n_out
                && bias.is_none_or(|b| b.len() == n_out),
            &format!("{what}: shapes"),
        )?;
        if rows == 0 || n_out == 0 {
            return Ok(());
        }
        let rows32 = u32_of(rows, &format!("{what} rows"))?;
        let n_in32 = u32_of(n_in, &format!("{what} n_in"))?;
        let n_out32 = u32_of(n_out, &format!("{what} n_out"))?;
        let s = self.stream();
        let (y, _y) = DevPtrMut::of(y, s);
        let (x, _x) = DevPtr::of(x, s);
        let bias = bias.map(|b| DevPtr::of(b, s));
        // A null bias pointer: the kernels add nothing.
        let bias = bias.as_ref().map_or(DevPtr::null(), |(p, _)| *p);
        let gemv = match (rows, gemv_split(n_in)) {
            (1, Some(split)) => {
                let entry = entry_of(Gemv::entry(ty as u32), what)?;
                // A unit wider than the kernel's registers allow a block (long rows of the
                // hungriest types) goes to the GEMM.
                let fits = 32 * split <= self.function(entry).max_threads_per_block()? as u32;
                fits.then_some((entry, split))
            }
            _ => None,
        };
        if let Some((entry, split)) = gemv {
            // Units of 2 rows, `split` warps each; blocks stride over them.
            let g = self.geometry(n_out.div_ceil(2), split, 0)?;
            let cfg = self.strided_launch(entry, &g)?;
            let p = Gemv {
                y,
                x,
                w,
                bias,
                n_in: n_in32,
                n_out: n_out32,
                split,
            };
            // SAFETY: the kernel reads n_in of x, the n_out rows of w, n_out of bias and writes
            // n_out of y, all checked above and by the caller; blocks are whole units of
            // `split` warps with 32·split lanes for the row's chunks, shared at least 2 f32 per
            // warp (`gemv_shared`).
            unsafe { p.launch(self, entry, cfg, Overlap::Serial) }?;
        } else {
            let entry = entry_of(Gemm::entry(ty as u32), what)?;
            let f = self.function(entry);
            // The consumer group and as many producer teams as fit in a block with the
            // kernel's registers (as compiled for this GPU): 3 at up to 128 registers a thread.
            // Below 2 groups the kernel runs the f32 loop (no tensor-core loop without a team).
            let groups =
                (f.max_threads_per_block()? as u32 / gemm::GROUP).clamp(1, 1 + gemm::MAX_TEAMS);
            let shared = gemm::shared_bytes(groups - 1);
            allow_shared(f, shared)?;
            let tiles = rows.div_ceil(gemm::TILE_M) * n_out.div_ceil(gemm::TILE_N);
            let cfg = LaunchConfig {
                grid_dim: (u32_of(tiles, &format!("{what} tiles"))?, 1, 1),
                block_dim: (groups * gemm::GROUP, 1, 1),
                shared_mem_bytes: shared,
            };
            let p = Gemm {
                y,
                x,
                w,
                bias,
                rows: rows32,
                n_in: n_in32,
                n_out: n_out32,
            };
            // SAFETY: the kernel reads rows·n_in of x, the n_out rows of w, n_out of bias and
            // writes rows·n_out of y, all checked above and by the caller; the block is whole
            // groups of 128 threads (the kernel runs any number, the tensor-core loop from 2),
            // no more than the kernel's registers allow, and the shared size is what the
            // kernel needs for them, allowed by the attribute above.
            unsafe { p.launch(self, entry, cfg, Overlap::Serial) }?;
        }
        Ok(())
    }

    /// `out[t, :]` = row `tokens[t]` of the embedding table `table` `[rows, hidden]`
    /// dequantized, for `t` in `0..n_tokens`; a token id beyond its rows gives a row of NaN.
    /// Twin: `quant::dequantize` of the row.
    pub fn embed(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &GpuMatrix,
        tokens: &impl DevicePtr<u32>,
        n_tokens: usize,
    ) -> Result<()> {
        self.embed_rows(out, table, tokens, DevPtr::null(), n_tokens)
    }

    /// `embed` of the one token `tokens[pos[0]]` into `out[..hidden]`, the position read on
    /// the device (so that a captured CUDA graph replays for any position). `pos[0] >=
    /// tokens.len()` makes the kernel trap (an error at the next synchronisation).
    pub fn embed_at(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &GpuMatrix,
        tokens: &impl DevicePtr<u32>,
        pos: &impl DevicePtr<u32>,
    ) -> Result<()> {
        check(pos.len() >= 1, "embed_at: pos")?;
        let (pos, _p) = DevPtr::of(pos, self.stream());
        self.embed_rows(out, table, tokens, pos, 1)
    }

    /// The `embed` kernel over `n_tokens` ids of `tokens` from `pos[0]` on, or from 0 when
    /// `pos` is null.
    fn embed_rows(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &GpuMatrix,
        tokens: &impl DevicePtr<u32>,
        pos: DevPtr<u32>,
        n_tokens: usize,
    ) -> Result<()> {
        let hidden = table.n_in;
        check(
            tokens.len() >= n_tokens && out.len() >= n_tokens * hidden,
            "embed: shapes",
        )?;
        if n_tokens == 0 {
            return Ok(());
        }
        let n_rows = u32_of(table.rows, "embed rows")?;
        let n_ids = u32_of(tokens.len(), "embed tokens")?;
        let hidden = u32_of(hidden, "embed hidden")?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(n_tokens, "embed tokens")?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = self.stream();
        let (out, _o) = DevPtrMut::of(out, s);
        let (t, _t) = table.ptr(s);
        let (tokens, _k) = DevPtr::of(tokens, s);
        let p = Embed {
            out,
            table: t,
            ty: table.ty as u32,
            tokens,
            pos,
            n_ids,
            n_rows,
            hidden,
        };
        // SAFETY: the kernel reads n_tokens ids from tokens[pos[0]] (or tokens[0]) on, below
        // n_ids or it traps, rows below n_rows of the table (a GpuMatrix: its layout, 16-byte
        // aligned) and writes n_tokens·hidden of out; `pos` is null or a live buffer the
        // caller holds. It may overlap the kernel before: it reads nothing before it waits.
        unsafe { p.launch(self, Embed::embed, cfg, Overlap::Allowed) }
    }

    /// `gate[i] = silu(gate[i])·up[i]`. Twin: `cpu::silu_mul`.
    pub fn silu_mul(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let Some(n) = elementwise_len(gate.len(), up.len(), "silu_mul")? else {
            return Ok(());
        };
        let s = self.stream();
        let (gate, _g) = DevPtrMut::of(gate, s);
        let (up, _u) = DevPtr::of(up, s);
        let p = SiluMul { gate, up, n };
        // SAFETY: it touches n elements of each.
        unsafe { p.launch(self, SiluMul::silu_mul, one_per_element(n), Overlap::Serial) }
    }

    /// `x[i] += y[i]`. Twin: `cpu::add`.
    pub fn add(&self, x: &mut impl DevicePtrMut<f32>, y: &impl DevicePtr<f32>) -> Result<()> {
        let Some(n) = elementwise_len(x.len(), y.len(), "add")? else {
            return Ok(());
        };
        let s = self.stream();
        let (x, _x) = DevPtrMut::of(x, s);
        let (y, _y) = DevPtr::of(y, s);
        let p = Add { x, y, n };
        // SAFETY: it touches n elements of each.
        unsafe { p.launch(self, Add::add, one_per_element(n), Overlap::Serial) }
    }
}

/// The length of an elementwise kernel's two operands of `a` and `b` items (which must be
/// equal), or None for none; `what` names the kernel in errors.
fn elementwise_len(a: usize, b: usize, what: &str) -> Result<Option<u32>> {
    check(a == b, &format!("{what}: lengths"))?;
    Ok(if a == 0 { None } else { Some(u32_of(a, what)?) })
}
