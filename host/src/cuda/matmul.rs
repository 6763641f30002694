//! Launch helpers of the matmul, quant and elementwise kernel families
//! (gpu-kernels/src/{matmul,quant,elementwise}.rs).
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::f16;

use super::{BLOCK, Device, check};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// The GEMM kernel's output tile (tokens × outputs), its block size and its shared memory:
/// the tensor-core loop's two stages of four `[64][32]` f16 tiles (the f32 loop, for rows of x
/// or w that are not 16-byte aligned, needs 17408 bytes of them). The GEMV's block (8 warps)
/// and shared memory (one f32 per warp). They must match gpu-kernels/src/matmul.rs.
const GEMM_TILE: u32 = 64;
const GEMM_THREADS: u32 = 256;
const GEMM_SHARED_BYTES: u32 = 2 * 4 * 64 * 32 * 2;
const GEMV_THREADS: u32 = 256;
const GEMV_SHARED_BYTES: u32 = GEMV_THREADS / 32 * 4;
/// Groups of 8 weights one GEMV warp reads in one step (32 lanes, 4 groups each).
const GEMV_WARP_GROUPS: usize = 128;
/// Where `matmul_q` and `embed` need the weights to start: q4_K and q5_K blocks are read by
/// words.
const WEIGHTS_ALIGN: u64 = 16;

/// `n` as a kernel's `u32` size, or an error naming `what`.
fn size_u32(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Invalid(format!("{what}: {n} is too large for a kernel")))
}

/// Blocks of `BLOCK` threads for one thread per element.
fn one_per_element(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The (GEMV, GEMM) kernels for weights of type `ty`.
fn matmul_kernels(ty: GgmlType) -> (&'static str, &'static str) {
    use GgmlType::*;
    match ty {
        F32 => ("gemv_f32", "gemm_f32"),
        F16 => ("gemv_f16", "gemm_f16"),
        BF16 => ("gemv_bf16", "gemm_bf16"),
        Q4_0 => ("gemv_q4_0", "gemm_q4_0"),
        Q5_0 => ("gemv_q5_0", "gemm_q5_0"),
        Q8_0 => ("gemv_q8_0", "gemm_q8_0"),
        Q4K => ("gemv_q4_k", "gemm_q4_k"),
        Q5K => ("gemv_q5_k", "gemm_q5_k"),
        Q6K => ("gemv_q6_k", "gemm_q6_k"),
    }
}

/// Warps per output of the GEMV for rows of `n_in`: enough that each warp's share is one
/// step (long rows such as ffn_down's 4864 would otherwise leave most of the GPU idle, with
/// one warp per row waiting on one load after another), at most the block's 8.
fn gemv_split(n_in: usize) -> u32 {
    n_in.div_ceil(8)
        .div_ceil(GEMV_WARP_GROUPS)
        .next_power_of_two()
        .min((GEMV_THREADS / 32) as usize) as u32
}

impl Device {
    /// `y[t, o] = sum_i x[t, i]·w[o, i] + bias[o]` for `t` in `0..rows`, with `w` f16
    /// `[n_out, n_in]` row-major and f32 accumulation. `x` and `y` may be longer than
    /// `rows` rows (reused buffers); the rest is untouched. `rows == 1` runs the GEMV kernel
    /// (1 to 8 warps per output), `rows > 1` the tiled GEMM (see `launch_matmul`). Twin:
    /// `cpu::matmul`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_f16(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f16>,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
        n_in: usize,
        n_out: usize,
    ) -> Result<()> {
        check(w.len() == n_out * n_in, "matmul_f16: shapes")?;
        let (wp, _w) = w.device_ptr(self.stream());
        self.launch_matmul(
            GgmlType::F16,
            y,
            x,
            wp,
            bias,
            rows,
            n_in,
            n_out,
            "matmul_f16",
        )
    }

    /// `y[t, o] = sum_i x[t, i]·w[o, i] + bias[o]` for `t` in `0..rows`, with `w` the raw
    /// file bytes of a `[n_out, n_in]` tensor of type `ty` (`n_out` rows of
    /// `ty.row_bytes(n_in)` bytes, starting 16-byte aligned as GGUF tensor data does),
    /// dequantized on the fly to exactly `quant::dequantize`'s values; f32 accumulation. `x`
    /// and `y` may be longer than `rows` rows; the rest is untouched. `rows == 1` runs the
    /// GEMV kernel, `rows > 1` the tiled GEMM (see `launch_matmul`). Twin: `cpu::matmul` on
    /// the dequantized weights.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_q(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        ty: GgmlType,
        bias: Option<&CudaSlice<f32>>,
        rows: usize,
        n_in: usize,
        n_out: usize,
    ) -> Result<()> {
        let row_bytes = ty.row_bytes(n_in).ok_or_else(|| {
            Error::Invalid(format!(
                "matmul_q: rows of {n_in} are not a whole number of {}-element {} blocks",
                ty.block_elems(),
                ty.name()
            ))
        })?;
        check(w.len() == n_out * row_bytes, "matmul_q: shapes")?;
        let (wp, _w) = w.device_ptr(self.stream());
        if wp % WEIGHTS_ALIGN != 0 {
            return Err(Error::Invalid(format!(
                "matmul_q: the weights must start {WEIGHTS_ALIGN}-byte aligned"
            )));
        }
        self.launch_matmul(ty, y, x, wp, bias, rows, n_in, n_out, "matmul_q")
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
        w: u64,
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
        let rows32 = size_u32(rows, &format!("{what} rows"))?;
        let n_in32 = size_u32(n_in, &format!("{what} n_in"))?;
        let n_out32 = size_u32(n_out, &format!("{what} n_out"))?;
        let (gemv, gemm) = matmul_kernels(ty);
        let stream = self.stream();
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let bias = bias.map(|b| b.device_ptr(stream));
        // A null bias pointer: the kernels add nothing.
        let bp = bias.as_ref().map_or(0, |(p, _)| *p);
        if rows == 1 {
            let split = gemv_split(n_in);
            let rows_per_block = GEMV_THREADS / 32 / split;
            let cfg = LaunchConfig {
                grid_dim: (n_out32.div_ceil(rows_per_block), 1, 1),
                block_dim: (GEMV_THREADS, 1, 1),
                shared_mem_bytes: GEMV_SHARED_BYTES,
            };
            let mut l = stream.launch_builder(self.kernel(gemv));
            l.arg(&yp).arg(&xp).arg(&w).arg(&bp);
            l.arg(&n_in32).arg(&n_out32).arg(&split);
            // SAFETY: parameters (f32*, const f32*, const u8*, const f32* or null, u32, u32,
            // u32); the kernel reads n_in of x, the n_out rows of w, n_out of bias and writes
            // n_out of y, all checked above and by the caller; block and shared size are the
            // kernel's, split one of 1, 2, 4, 8.
            unsafe { l.launch(cfg) }?;
        } else {
            let tiles = rows.div_ceil(GEMM_TILE as usize) * n_out.div_ceil(GEMM_TILE as usize);
            let cfg = LaunchConfig {
                grid_dim: (size_u32(tiles, &format!("{what} tiles"))?, 1, 1),
                block_dim: (GEMM_THREADS, 1, 1),
                shared_mem_bytes: GEMM_SHARED_BYTES,
            };
            let mut l = stream.launch_builder(self.kernel(gemm));
            l.arg(&yp).arg(&xp).arg(&w).arg(&bp);
            l.arg(&rows32).arg(&n_in32).arg(&n_out32);
            // SAFETY: parameters (f32*, const f32*, const u8*, const f32* or null, u32, u32,
            // u32); the kernel reads rows·n_in of x, the n_out rows of w, n_out of bias and
            // writes rows·n_out of y, all checked above and by the caller; block and shared
            // size are the kernel's.
            unsafe { l.launch(cfg) }?;
        }
        Ok(())
    }

    /// `y = w · x` with `w` f16 `[y.len(), x.len()]`. Twin: `cpu::gemv_f16`.
    pub fn gemv_f16(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        w: &impl DevicePtr<f16>,
        x: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let (n_out, n_in) = (y.len(), x.len());
        self.matmul_f16(y, x, w, None, 1, n_in, n_out)
    }

    /// `out[t, :]` = row `tokens[t]` of the embedding table dequantized, for `t` in
    /// `0..n_tokens`. `table` holds the raw file bytes of a `[rows, hidden]` tensor of type `ty`,
    /// starting 16-byte aligned; a token id beyond its rows gives a row of NaN. Twin: `quant::dequantize` of the row.
    pub fn embed(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<u8>,
        ty: GgmlType,
        tokens: &impl DevicePtr<u32>,
        n_tokens: usize,
        hidden: usize,
    ) -> Result<()> {
        self.embed_rows(out, table, ty, tokens, 0, n_tokens, hidden)
    }

    /// `embed` of the one token `tokens[pos[0]]` into `out[..hidden]`, the position read on
    /// the device (so that a captured CUDA graph replays for any position). `pos[0] >=
    /// tokens.len()` makes the kernel trap (an error at the next synchronisation).
    pub fn embed_at(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<u8>,
        ty: GgmlType,
        tokens: &impl DevicePtr<u32>,
        pos: &impl DevicePtr<u32>,
        hidden: usize,
    ) -> Result<()> {
        check(pos.len() >= 1, "embed_at: pos")?;
        let (pp, _p) = pos.device_ptr(self.stream());
        self.embed_rows(out, table, ty, tokens, pp, 1, hidden)
    }

    /// The `embed` kernel over `n_tokens` ids of `tokens` from `pos[0]` on (`pos` a device
    /// pointer), or from 0 when `pos` is 0.
    #[allow(clippy::too_many_arguments)]
    fn embed_rows(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        table: &impl DevicePtr<u8>,
        ty: GgmlType,
        tokens: &impl DevicePtr<u32>,
        pos: u64,
        n_tokens: usize,
        hidden: usize,
    ) -> Result<()> {
        let row_bytes = ty.row_bytes(hidden).filter(|&b| b > 0).ok_or_else(|| {
            Error::Invalid(format!(
                "embed: rows of {hidden} are not a whole number of {}-element {} blocks",
                ty.block_elems(),
                ty.name()
            ))
        })?;
        check(
            tokens.len() >= n_tokens
                && out.len() >= n_tokens * hidden
                && table.len() >= row_bytes
                && table.len().is_multiple_of(row_bytes),
            "embed: shapes",
        )?;
        if n_tokens == 0 {
            return Ok(());
        }
        let n_rows = size_u32(table.len() / row_bytes, "embed rows")?;
        let n_ids = size_u32(tokens.len(), "embed tokens")?;
        let (hidden, ty) = (size_u32(hidden, "embed hidden")?, ty as u32);
        let cfg = LaunchConfig {
            grid_dim: (size_u32(n_tokens, "embed tokens")?, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.stream();
        let (op, _o) = out.device_ptr_mut(stream);
        let (tp, _t) = table.device_ptr(stream);
        if tp % WEIGHTS_ALIGN != 0 {
            return Err(Error::Invalid(format!(
                "embed: the table must start {WEIGHTS_ALIGN}-byte aligned"
            )));
        }
        let (kp, _k) = tokens.device_ptr(stream);
        let mut l = stream.launch_builder(self.kernel("embed"));
        l.arg(&op)
            .arg(&tp)
            .arg(&ty)
            .arg(&kp)
            .arg(&pos)
            .arg(&n_ids)
            .arg(&n_rows)
            .arg(&hidden);
        // SAFETY: parameters (f32*, const u8*, u32, const u32*, const u32* or null, u32, u32,
        // u32); the kernel reads n_tokens ids from tokens[pos[0]] (or tokens[0]) on, below
        // n_ids or it traps, rows below n_rows of the table (whole rows, checked above) and
        // writes n_tokens·hidden of out; `pos` is null or a live buffer the caller holds.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// `gate[i] = silu(gate[i])·up[i]`. Twin: `cpu::silu_mul`.
    pub fn silu_mul(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<()> {
        self.elementwise("silu_mul", gate, up)
    }

    /// `x[i] += y[i]`. Twin: `cpu::add`.
    pub fn add(&self, x: &mut impl DevicePtrMut<f32>, y: &impl DevicePtr<f32>) -> Result<()> {
        self.elementwise("add", x, y)
    }

    /// Launches the elementwise kernel `name(a*, const b*, n)` over `a.len() == b.len()` items.
    fn elementwise(
        &self,
        name: &str,
        a: &mut impl DevicePtrMut<f32>,
        b: &impl DevicePtr<f32>,
    ) -> Result<()> {
        check(a.len() == b.len(), &format!("{name}: lengths"))?;
        if a.is_empty() {
            return Ok(());
        }
        let n = size_u32(a.len(), name)?;
        let stream = self.stream();
        let (ap, _a) = a.device_ptr_mut(stream);
        let (bp, _b) = b.device_ptr(stream);
        let mut l = stream.launch_builder(self.kernel(name));
        l.arg(&ap).arg(&bp).arg(&n);
        // SAFETY: both kernels take (f32*, const f32*, u32) and touch n elements of each.
        unsafe { l.launch(one_per_element(n)) }?;
        Ok(())
    }
}
