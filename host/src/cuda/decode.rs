//! Launch helpers of the fused decode-step kernels (gpu-kernels/src/decode.rs), for one token.
//! The position is read from device memory and every scratch buffer is the caller's, so the
//! launches can be captured into a CUDA graph once and replayed for every token: no helper
//! allocates, copies from the host or synchronises. Every weight matrix is a [`GpuMatrix`], read
//! in its own format (packed quantized chunks, or plain floats).
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};

use super::matmul::{GpuMatrix, gemv_split, one_per_element};
use super::{AttentionSums, Device, allow_shared, check, u32_of};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// Most warps in a block (a unit's `split` warps may make more).
const MAX_WARPS: u32 = 8;

/// Units of `split` warps in a block of `MAX_WARPS` warps: one where a unit has more than half.
fn full_block_units(split: u32) -> u32 {
    (MAX_WARPS / split).max(1)
}
/// Where every vector must start: the kernels read them by 16-byte loads.
const ALIGN: u64 = 16;

/// Checks that `w` is `n_out` rows of `n_in`; `what` names the kernel and the matrix.
fn check_matrix(w: &GpuMatrix, n_out: usize, n_in: usize, what: &str) -> Result<()> {
    check(
        w.rows() == n_out && w.n_in() == n_in,
        &format!("{what}: shapes"),
    )
}

/// An error unless every pointer is 16-byte aligned.
fn check_aligned(ptrs: &[u64], what: &str) -> Result<()> {
    if ptrs.iter().all(|p| p % ALIGN == 0) {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what}: vectors must start {ALIGN}-byte aligned"
        )))
    }
}

/// Warps per GEMV unit for rows of `n_in`: a lane per chunk of 32 weights; rows must be whole
/// chunks, at most 32 warps' worth.
fn split_of(n_in: usize, what: &str) -> Result<u32> {
    if n_in == 0 || !n_in.is_multiple_of(32) {
        return Err(Error::Invalid(format!(
            "{what}: vectors of {n_in} are not a whole number of chunks of 32"
        )));
    }
    gemv_split(n_in).ok_or_else(|| {
        Error::Invalid(format!(
            "{what}: rows of {n_in} are longer than the kernel's 32768"
        ))
    })
}

/// The kernel family of `ty` (gpu-kernels' `matmul::family`): its plain float type, or for the
/// quantized types "legacy" (blocks of 32 weights) or "kquant" (super-blocks of 256).
fn family(ty: GgmlType) -> &'static str {
    use GgmlType::*;
    match ty {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 | Q5_0 | Q8_0 => "legacy",
        Q4K | Q5K | Q6K => "kquant",
    }
}

/// The bounded arg-max's kernel for pass `pass` over a matrix of `ty`: built once per type it
/// serves (q8_0, f16), not per family.
fn bounded_kernel(pass: &str, ty: GgmlType) -> String {
    format!("{pass}_{}", ty.name())
}

/// The input vector of `Device::residual`'s kernels: floats and a bias (or 0), or the decode
/// attention's sums and head_dim (device pointers).
enum Input {
    Floats(u64, u64),
    Sums(u64, u32),
}

/// Whether `ty` is a quantized (packed) type.
fn packed(ty: GgmlType) -> bool {
    ty.block_elems() > 1
}

/// The decode kernel `base` built for the family of `ty` (one build per family keeps each
/// kernel's registers to what its own types need).
fn family_kernel(base: &str, ty: GgmlType) -> String {
    format!("{base}_{}", family(ty))
}

/// Shared memory of a GEMV kernel (these and matmul.rs's) with `threads` per block that stages
/// a vector of `staged` (0: none): the slots of its reductions (the norm's block sum, 32 f32,
/// and the warps' meetings, 2 f32 per warp, which also hold the arg-max's u64), 16-byte
/// aligned, then the vector in chunks of 32 with their halves' sums (36 f32 each; gpu-kernels'
/// `matmul::stage`, which the kernels with an RMSNorm use).
fn gemv_shared(threads: u32, staged: usize) -> Result<u32> {
    let slots = (threads / 32 * 2).max(32).next_multiple_of(4) * 4;
    u32_of(
        slots as usize + staged.div_ceil(32) * 36 * 4,
        "GEMV shared memory",
    )
}

/// How a GEMV kernel (these and matmul.rs's) is launched for `units` units of `split` warps.
pub(super) struct Geometry {
    /// Threads per block.
    threads: u32,
    /// Units per block and round.
    per_block: u32,
    /// Blocks that cover every unit in one round.
    blocks: u32,
    /// Shared memory per block (`gemv_shared`).
    shared: u32,
}

/// Where `logits` puts its fused arg-max, its scratch, and the decode step it may end.
pub type Argmax<'a> = (
    &'a mut dyn DevicePtrMut<u32>,
    &'a mut CudaSlice<u64>,
    Option<StepEnd<'a>>,
);

/// The device words that a decode step advances at its end (`logits` with its arg-max, as
/// `sample_dev` does): the tokens so far, the position and the sampler's draw count.
pub struct StepEnd<'a> {
    pub tokens: &'a mut dyn DevicePtrMut<u32>,
    pub pos: &'a mut dyn DevicePtrMut<u32>,
    pub step: &'a mut dyn DevicePtrMut<u64>,
}

impl<'a> StepEnd<'a> {
    fn valid(&self) -> bool {
        self.pos.len() >= 1 && self.step.len() >= 1 && self.tokens.len() <= u32::MAX as usize
    }

    /// The kernel's (tokens, n_tokens, pos, step), and what keeps them until the launch.
    fn ptrs<'s>(self, s: &'s CudaStream) -> ((u64, u32, u64, u64), [SyncOnDrop<'s>; 3])
    where
        'a: 's,
    {
        let n = self.tokens.len() as u32;
        let (t, tg) = self.tokens.device_ptr_mut(s);
        let (p, pg) = self.pos.device_ptr_mut(s);
        let (st, sg) = self.step.device_ptr_mut(s);
        ((t, n, p, st), [tg, pg, sg])
    }
}

impl Device {
    fn sm_count(&self) -> Result<u32> {
        let n = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(n.max(1) as u32)
    }

    /// `full_block_units` per block, fewer while that leaves SMs
    /// without a block: the small matrices (k and v have 64 units) then still spread over the
    /// GPU. The kernel stages a vector of `staged` (0: none) in shared memory (`gemv_shared`).
    pub(super) fn geometry(&self, units: usize, split: u32, staged: usize) -> Result<Geometry> {
        let sms = self.sm_count()? as usize;
        let mut per_block = full_block_units(split);
        while per_block > 1 && units.div_ceil(per_block as usize) < sms {
            per_block /= 2;
        }
        let threads = 32 * split * per_block;
        Ok(Geometry {
            threads,
            per_block,
            blocks: u32_of(units.div_ceil(per_block as usize), "decode blocks")?,
            shared: gemv_shared(threads, staged)?,
        })
    }

    /// For GEMV kernel `name` whose blocks stage the vector (`staged` long) in shared memory
    /// once for all their units: as many units per block as leave one block per SM, or where
    /// such blocks do not fit (the kernel's registers), two, three or four, but never fewer than
    /// `full_block_units`; else `geometry`'s. The fewer the blocks, the fewer the
    /// copies of the vector read from L2 (rows of 4864 floats, FFN down: 448 blocks read 8.7 MB
    /// of it, 112 blocks 2.2 MB); and a small matrix does better on fewer SMs in larger blocks
    /// than on every SM (H100, wo: 56 blocks of 8 warps +1.5% decode over 112 of 4).
    fn staged_geometry(
        &self,
        name: &str,
        units: usize,
        split: u32,
        staged: usize,
    ) -> Result<Geometry> {
        let sms = self.sm_count()? as usize;
        let f = self.kernel(name);
        // Units >= 1 (the callers return early for none), so blocks have one or more.
        for per_sm in 1..=4 {
            let per_block = units
                .div_ceil(sms * per_sm as usize)
                .max(full_block_units(split) as usize);
            if 32 * split as usize * per_block > 1024 {
                continue;
            }
            let (per_block, threads) = (per_block as u32, 32 * split * per_block as u32);
            let shared = gemv_shared(threads, staged)?;
            allow_shared(f, shared)?;
            if f.occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)?
                >= per_sm
            {
                return Ok(Geometry {
                    threads,
                    per_block,
                    blocks: u32_of(units.div_ceil(per_block as usize), "decode blocks")?,
                    shared,
                });
            }
        }
        self.geometry(units, split, staged)
    }

    /// The launch of GEMV kernel `name` with `blocks` blocks of `g`, its shared memory allowed
    /// where it is more than a block gets without asking.
    fn gemv_launch(&self, name: &str, g: &Geometry, blocks: u32) -> Result<LaunchConfig> {
        allow_shared(self.kernel(name), g.shared)?;
        Ok(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (g.threads, 1, 1),
            shared_mem_bytes: g.shared,
        })
    }

    /// The launch of a kernel whose blocks stride over its units: as many blocks as cover them
    /// in one round, at most as many as the GPU holds at once (the rest go round again, with
    /// no block waiting for a slot).
    pub(super) fn strided_launch(&self, name: &str, g: &Geometry) -> Result<LaunchConfig> {
        let cfg = self.gemv_launch(name, g, g.blocks)?;
        let resident = self
            .kernel(name)
            .occupancy_max_active_blocks_per_multiprocessor(g.threads, g.shared as usize, None)?;
        let most = self.sm_count()? * resident.max(1);
        Ok(LaunchConfig {
            grid_dim: (g.blocks.min(most), 1, 1),
            ..cfg
        })
    }

    /// The attention block's input projections for one token at position `pos[0]`:
    /// `xn = rms_norm(x)·norm`, `q = rope(wq·xn + bq)`, and row `pos[0]` of the caches
    /// `k_cache = rope(wk·xn + bk)`, `v_cache = wv·xn + bv`, with NeoX RoPE from `rope`
    /// (`rope_table`'s `[positions, head_dim/2, 2]`). `qkv` holds the (weights, bias) of q, k
    /// and v; `head_dim = q.len() / n_heads`; the caches are `[max_pos, n_kv_heads·head_dim]`.
    /// The kernel traps when `pos[0]` is past the caches or the table, and prefetches cache
    /// rows `0..=pos[0]` into L2 for the attention (below 2,048 keys). It also zeroes `sums`
    /// for `attention_decode` to add into. Twin: `cpu::rms_norm`, `cpu::matmul` of each,
    /// `cpu::rope_neox` of q and k.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_qkv(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k_cache: &mut impl DevicePtrMut<f32>,
        v_cache: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        norm: &impl DevicePtr<f32>,
        eps: f32,
        qkv: [(&GpuMatrix, Option<&CudaSlice<f32>>); 3],
        pos: &impl DevicePtr<u32>,
        rope: &impl DevicePtr<f32>,
        sums: &mut AttentionSums,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Result<()> {
        const WHAT: &str = "attn_qkv";
        check(
            n_heads > 0
                && n_kv_heads > 0
                && q.len().is_multiple_of(n_heads)
                && (q.len() / n_heads).is_multiple_of(2)
                && q.len() > 0,
            "attn_qkv: n_heads, n_kv_heads and q (an even head_dim)",
        )?;
        let (n_in, hd) = (x.len(), q.len() / n_heads);
        let kv_dim = n_kv_heads * hd;
        check(
            norm.len() == n_in
                && pos.len() >= 1
                && k_cache.len() == v_cache.len()
                && k_cache.len().is_multiple_of(kv_dim)
                && k_cache.len() >= kv_dim
                && rope.len().is_multiple_of(hd)
                && rope.len() >= hd,
            "attn_qkv: shapes of x, norm, pos, the caches and the table",
        )?;
        check(
            sums.n_heads == n_heads && sums.head_dim == hd,
            "attn_qkv: the sums' heads and head_dim",
        )?;
        let max_pos = (k_cache.len() / kv_dim).min(rope.len() / hd);
        u32_of(k_cache.len().max(rope.len()), "attn_qkv: caches and table")?;
        let split = split_of(n_in, WHAT)?;
        for ((w, bias), (n_out, name)) in
            qkv.iter()
                .zip([(q.len(), "q"), (kv_dim, "k"), (kv_dim, "v")])
        {
            check_matrix(w, n_out, n_in, &format!("attn_qkv {name}"))?;
            check(
                bias.is_none_or(|b| b.len() == n_out),
                &format!("attn_qkv {name}: bias and rows"),
            )?;
        }
        // One family, or the build of both packed ones.
        let tys = qkv.map(|(w, _)| w.ty());
        let name = if tys.iter().all(|t| family(*t) == family(tys[0])) {
            family_kernel(WHAT, tys[0])
        } else if tys.iter().all(|t| packed(*t)) {
            format!("{WHAT}_packed")
        } else {
            return Err(Error::Invalid(format!(
                "attn_qkv: q, k and v ({}) must be all quantized or all of one float type",
                tys.map(|t| t.name()).join(", ")
            )));
        };
        // Units: pairs of rows that RoPE rotates together (v's paired the same way).
        let (q_pairs, kv_pairs) = (q.len() / 2, kv_dim / 2);
        let g = self.geometry(q_pairs + 2 * kv_pairs, split, n_in)?;
        let q_blocks = u32_of(q_pairs.div_ceil(g.per_block as usize), WHAT)?;
        let kv_blocks = u32_of(kv_pairs.div_ceil(g.per_block as usize), WHAT)?;
        let cfg = self.gemv_launch(&name, &g, q_blocks + 2 * kv_blocks)?;
        let s = self.stream();
        let (qp, _q) = q.device_ptr_mut(s);
        let (kc, _kc) = k_cache.device_ptr_mut(s);
        let (vc, _vc) = v_cache.device_ptr_mut(s);
        let (xp, _x) = x.device_ptr(s);
        let (np, _n) = norm.device_ptr(s);
        let (pp, _p) = pos.device_ptr(s);
        let (rp, _r) = rope.device_ptr(s);
        let (sp, _s) = sums.sums.device_ptr_mut(s);
        let ws = qkv.each_ref().map(|(w, _)| w.ptr(s));
        let bs = qkv.each_ref().map(|(_, b)| b.map(|b| b.device_ptr(s)));
        check_aligned(&[xp, np], WHAT)?;
        // A null bias pointer: the kernel adds nothing.
        let bp = bs.each_ref().map(|b| b.as_ref().map_or(0, |(p, _)| *p));
        let tys = qkv.each_ref().map(|(w, _)| w.ty() as u32);
        let (n_in, n_heads, n_kv, hd) = (n_in as u32, n_heads as u32, n_kv_heads as u32, hd as u32);
        let max_pos = max_pos as u32;
        let mut l = self.launch(&name);
        l.arg(&qp).arg(&kc).arg(&vc).arg(&xp).arg(&np).arg(&eps);
        for i in 0..3 {
            l.arg(&ws[i].0).arg(&tys[i]).arg(&bp[i]);
        }
        l.arg(&pp).arg(&rp);
        l.arg(&n_in).arg(&n_heads).arg(&n_kv).arg(&hd).arg(&max_pos);
        l.arg(&q_blocks).arg(&kv_blocks).arg(&split).arg(&sp);
        // SAFETY: the parameters are the kernel's (f32*, f32*, f32*, const f32*, const f32*,
        // f32, then (const u8*, u32, const f32* or null) for q, k, v, const u32*, const f32*,
        // then 8 u32, f64*). Every size was checked above: the weights are GpuMatrix rows of
        // n_in (whole chunks of 32, at most 32·split of them), x and norm 16-byte aligned; q
        // holds n_heads·head_dim, sums n_heads·(head_dim + 1); the kernel writes cache row
        // pos[0] and reads table row pos[0] only below max_pos, else traps. Blocks are whole
        // units of `split` warps, shared as `gemv_shared` (the reductions' slots and the
        // staged x).
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { l.run(cfg, true) }?;
        Ok(())
    }

    /// The FFN's first half for one token: `h[r] = silu(gate[r]·xn)·(up[r]·xn)` with
    /// `xn = rms_norm(x)·norm`, for the `h.len()` rows of `gate` and `up` (one type for both).
    /// Twin: `cpu::rms_norm`, `cpu::matmul` of each, `cpu::silu_mul`.
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_gate_up(
        &self,
        h: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        norm: &impl DevicePtr<f32>,
        eps: f32,
        gate: &GpuMatrix,
        up: &GpuMatrix,
    ) -> Result<()> {
        const WHAT: &str = "ffn_gate_up";
        let (n_in, n_out) = (x.len(), h.len());
        check(norm.len() == n_in, "ffn_gate_up: shapes of x and norm")?;
        if gate.ty() != up.ty() {
            return Err(Error::Invalid(format!(
                "ffn_gate_up: gate ({}) and up ({}) must have one type",
                gate.ty().name(),
                up.ty().name()
            )));
        }
        let split = split_of(n_in, WHAT)?;
        check_matrix(gate, n_out, n_in, "ffn_gate_up gate")?;
        check_matrix(up, n_out, n_in, "ffn_gate_up up")?;
        if n_out == 0 {
            return Ok(());
        }
        let n_out32 = u32_of(n_out, WHAT)?;
        let g = self.geometry(n_out, split, n_in)?;
        let name = family_kernel(WHAT, gate.ty());
        let cfg = self.strided_launch(&name, &g)?;
        let s = self.stream();
        let (hp, _h) = h.device_ptr_mut(s);
        let (xp, _x) = x.device_ptr(s);
        let (np, _n) = norm.device_ptr(s);
        let (gp, _g) = gate.ptr(s);
        let (upp, _u) = up.ptr(s);
        check_aligned(&[xp, np], WHAT)?;
        let (ty, n_in) = (gate.ty() as u32, n_in as u32);
        let mut l = self.launch(&name);
        l.arg(&hp)
            .arg(&xp)
            .arg(&np)
            .arg(&eps)
            .arg(&gp)
            .arg(&upp)
            .arg(&ty);
        l.arg(&n_in).arg(&n_out32).arg(&split);
        // SAFETY: parameters (f32*, const f32*, const f32*, f32, const u8*, const u8*, u32, u32,
        // u32, u32). Gate and up are GpuMatrix rows of n_in of one type; x and norm 16-byte
        // aligned; h holds n_out; n_in is whole chunks, one per lane of `split` warps
        // (`split_of`); blocks are whole units of `split` warps, shared as `gemv_shared`.
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { l.run(cfg, true) }?;
        Ok(())
    }

    /// `y[r] += w[r]·v + bias[r]` for the `y.len()` rows of `w`, in place on the residual
    /// stream: the FFN down projection (`v = h`). Twin: `cpu::matmul` then `cpu::add`.
    pub fn gemv_residual(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        w: &GpuMatrix,
        bias: Option<&CudaSlice<f32>>,
        v: &impl DevicePtr<f32>,
    ) -> Result<()> {
        check(
            bias.is_none_or(|b| b.len() == y.len()),
            "gemv_residual: bias and rows",
        )?;
        let s = self.stream();
        let (vp, _v) = v.device_ptr(s);
        let bias = bias.map(|b| b.device_ptr(s));
        let bp = bias.as_ref().map_or(0, |(p, _)| *p);
        self.residual(y, w, v.len(), Input::Floats(vp, bp))
    }

    /// `y[r] += wo[r]·att` for the `y.len()` rows of `wo`, with `att` the decode attention's
    /// output, which it normalises from `sums` as it loads them (`AttentionSums::output`):
    /// the attention output projection. Twin: `cpu::matmul` then `cpu::add`.
    pub fn attn_output(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        wo: &GpuMatrix,
        sums: &AttentionSums,
    ) -> Result<()> {
        if !sums.head_dim.is_multiple_of(4) {
            return Err(Error::Invalid(format!(
                "attn_output: head_dim {} is not a multiple of 4",
                sums.head_dim
            )));
        }
        let (sp, _s) = sums.sums.device_ptr(self.stream());
        let head_dim = sums.head_dim as u32;
        self.residual(
            y,
            wo,
            sums.n_heads * sums.head_dim,
            Input::Sums(sp, head_dim),
        )
    }

    /// `gemv_residual` and `attn_output`: their kernels take the same parameters around the
    /// input's.
    fn residual(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        w: &GpuMatrix,
        n_in: usize,
        input: Input,
    ) -> Result<()> {
        let what = match input {
            Input::Floats(..) => "gemv_residual",
            Input::Sums(..) => "attn_output",
        };
        let n_out = y.len();
        let split = split_of(n_in, what)?;
        check_matrix(w, n_out, n_in, what)?;
        if n_out == 0 {
            return Ok(());
        }
        let n_out32 = u32_of(n_out, what)?;
        // Units are pairs of rows. Packed weights: few blocks of many units, which the kernel
        // serves from one staged copy of v each (H100, decode +2.8%: FFN down 448 blocks ->
        // 112, wo 224 -> 112; wo now 56, `staged_geometry`'s smallest blocks). So too the
        // attention's sums, for every type (f16's wo: +13% over each lane loading its own
        // chunk of the f64 sums). Plain floats otherwise as before: f16's wo so staged was
        // -3.4% when it read floats (its 1.6 MB of weights want every SM's loads).
        let name = family_kernel(what, w.ty());
        let g = if packed(w.ty()) || matches!(input, Input::Sums(..)) {
            self.staged_geometry(&name, n_out.div_ceil(2), split, n_in)?
        } else {
            self.geometry(n_out.div_ceil(2), split, 0)?
        };
        // A block for every `per_block` units, each one round (the kernel holds no next one).
        let cfg = self.gemv_launch(&name, &g, g.blocks)?;
        let s = self.stream();
        let (yp, _y) = y.device_ptr_mut(s);
        let (wp, _w) = w.ptr(s);
        let (ty, n_in) = (w.ty() as u32, u32_of(n_in, what)?);
        let mut l = self.launch(&name);
        l.arg(&yp);
        match &input {
            Input::Floats(vp, bp) => {
                check_aligned(&[*vp], what)?;
                l.arg(vp).arg(&wp).arg(&ty).arg(bp);
            }
            Input::Sums(sp, head_dim) => {
                check_aligned(&[*sp], what)?;
                l.arg(sp).arg(head_dim).arg(&wp).arg(&ty);
            }
        }
        l.arg(&n_in).arg(&n_out32).arg(&split);
        // SAFETY: parameters (f32*, then const f32*, const u8*, u32, const f32* or null
        // (gemv_residual) or const f64*, u32, const u8*, u32 (attn_output), then u32, u32,
        // u32). w is n_out GpuMatrix rows of n_in (whole chunks, one per lane of `split`
        // warps), v or the sums 16-byte aligned; v holds n_in, the sums n_in plus a sum per
        // head (`AttentionSums`' shape), y and bias n_out; blocks are whole units of `split`
        // warps, shared as `gemv_shared` (with the staged vector for packed weights).
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { l.run(cfg, true) }?;
        Ok(())
    }

    /// The scratch of `logits`' fused arg-max: 2 u64, zero. Allocate it once; every launch
    /// leaves it zero again (a launch that faults midway may not: allocate a new one then).
    pub fn logits_scratch(&self) -> Result<CudaSlice<u64>> {
        self.zeros(2)
    }

    /// `logits[r] = output[r]·xn` with `xn = rms_norm(x)·norm`, for the `logits.len()` rows of
    /// `w`. With `best = Some((out, scratch, end))`, also `out[0]` = the arg-max of these
    /// logits (the first index on ties, NaN never; `u32::MAX` if all are NaN), found in the
    /// same pass without reading the logits again; `scratch` from `logits_scratch`, used by one
    /// launch at a time. With `end`, the arg-max also ends a greedy decode step as `sample_dev`
    /// ends a sampled one: the token (0 for all-NaN logits, as the CPU sampler picks) goes to
    /// `out[0]` and `tokens[pos[0] + 1]` (if the buffer holds it), and `pos[0]` and `step[0]`
    /// advance by one. Twin: `cpu::rms_norm`, `cpu::matmul`, `cpu::argmax`.
    #[allow(clippy::too_many_arguments)]
    pub fn logits(
        &self,
        logits: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        norm: &impl DevicePtr<f32>,
        eps: f32,
        w: &GpuMatrix,
        best: Option<Argmax<'_>>,
    ) -> Result<()> {
        const WHAT: &str = "logits";
        let (n_in, n_out) = (x.len(), logits.len());
        check(norm.len() == n_in, "logits: shapes of x and norm")?;
        let split = split_of(n_in, WHAT)?;
        check_matrix(w, n_out, n_in, WHAT)?;
        check(
            n_out > 0
                && best.as_ref().is_none_or(|(o, s, e)| {
                    o.len() >= 1 && s.len() >= 2 && e.as_ref().is_none_or(StepEnd::valid)
                }),
            "logits: rows, best, scratch and step",
        )?;
        let n_out32 = u32_of(n_out, WHAT)?;
        // Units are pairs of rows.
        let g = self.geometry(n_out.div_ceil(2), split, n_in)?;
        let name = family_kernel(WHAT, w.ty());
        let cfg = self.strided_launch(&name, &g)?;
        let s = self.stream();
        let (lp, _l) = logits.device_ptr_mut(s);
        let (xp, _x) = x.device_ptr(s);
        let (np, _n) = norm.device_ptr(s);
        let (wp, _w) = w.ptr(s);
        check_aligned(&[xp, np], WHAT)?;
        let (best, end) = best.map_or((None, None), |(o, sc, e)| {
            (Some((o.device_ptr_mut(s), sc.device_ptr_mut(s))), e)
        });
        let end = end.map(|e| e.ptrs(s));
        // Null pointers: no arg-max, no step's end.
        let (op, sp) = best.as_ref().map_or((0, 0), |((o, _), (sc, _))| (*o, *sc));
        let (tp, nt, pp, stp) = end.as_ref().map_or((0, 0, 0, 0), |(p, _)| *p);
        let (ty, n_in) = (w.ty() as u32, n_in as u32);
        let mut l = self.launch(&name);
        l.arg(&lp).arg(&xp).arg(&np).arg(&eps).arg(&wp).arg(&ty);
        l.arg(&n_in).arg(&n_out32).arg(&split).arg(&op).arg(&sp);
        l.arg(&tp).arg(&nt).arg(&pp).arg(&stp);
        // SAFETY: parameters (f32*, const f32*, const f32*, f32, const u8*, u32, u32, u32, u32,
        // u32* or null, u64* or null, u32* or null, u32, u32* or null, u64* or null). w is
        // n_out GpuMatrix rows of n_in (whole chunks, one per lane of `split` warps), x and
        // norm 16-byte aligned; logits holds n_out; out holds 1 u32 and scratch 2 u64 (zero,
        // as every launch leaves it); the step's end (with the arg-max only) writes tokens
        // below n_tokens, one pos and one step; blocks are whole units of `split` warps,
        // shared as `gemv_shared`.
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { l.run(cfg, true) }?;
        Ok(())
    }
}

/// Greedy decoding's bounded arg-max over a q8_0 or f16 vocabulary projection (rows of at most
/// 1,024, one warp each): for f16, the plane of its weights' high bytes that the first pass
/// reads (q8_0's reads the packed matrix's high nibbles); the buffers of its two passes, the
/// rows' upper bounds and a lower bound per block of the first.
pub struct BoundedArgmax {
    plane: Option<CudaSlice<u8>>,
    upper: CudaSlice<f32>,
    lower: CudaSlice<u32>,
    /// Bytes of the matrix and plane the first pass reads.
    first_pass: usize,
}

impl BoundedArgmax {
    /// Whether it applies to a matrix of `ty` with rows of `n_in`: q8_0 or f16, rows of at most
    /// 1,024.
    pub fn applies(ty: GgmlType, n_in: usize) -> bool {
        matches!(ty, GgmlType::Q8_0 | GgmlType::F16) && n_in <= 1024
    }

    /// Bytes of its plane per row of `n_in` of `ty`: f16, a byte per weight; q8_0, none.
    fn plane_bytes(ty: GgmlType, n_in: usize) -> usize {
        if ty == GgmlType::F16 { n_in } else { 0 }
    }

    /// Its bytes on the GPU for `rows` rows of `n_in` of `ty`: the plane and an upper bound per
    /// row (and a lower bound per block of the first pass, a few hundred bytes).
    pub fn bytes(ty: GgmlType, rows: usize, n_in: usize) -> usize {
        rows * (Self::plane_bytes(ty, n_in) + 4)
    }

    /// The rows' upper bounds of the last launch's first pass (the twin of
    /// `cpu::logit_bounds_q8_0` and `cpu::logit_bounds_f16`).
    pub fn upper_bounds(&self, dev: &Device) -> Result<Vec<f32>> {
        dev.download(&self.upper)
    }

    /// Bytes its first pass reads: q8_0, each chunk's high nibbles (16) and scale (2); f16, the
    /// high bytes. The second reads the few rows it computes exactly, not counted.
    pub fn first_pass_bytes(&self) -> usize {
        self.first_pass
    }
}

impl Device {
    /// What [`Device::argmax_bounded`] needs for the matrix `w`; `None` where it does not
    /// apply: other types, rows longer than 1,024.
    pub fn bounded_argmax(&self, w: &GpuMatrix) -> Result<Option<BoundedArgmax>> {
        if !BoundedArgmax::applies(w.ty(), w.n_in()) {
            return Ok(None);
        }
        let n = w.rows() * w.n_in();
        let (plane, first_pass) = if w.ty() == GgmlType::F16 {
            let mut plane = self.zeros::<u8>(n)?;
            let (n32, s) = (u32_of(n, "high_bytes")?, self.stream());
            let cfg = one_per_element(n32.max(1));
            {
                let (op, _o) = plane.device_ptr_mut(s);
                let (wp, _w) = w.ptr(s);
                let mut l = self.launch("high_bytes");
                l.arg(&op).arg(&wp).arg(&n32);
                // SAFETY: parameters (u8*, const u16*, u32): out holds n bytes, w n f16 (rows
                // of n_in plain f16).
                unsafe { l.run(cfg, false) }?;
            }
            (Some(plane), n)
        } else {
            (None, n / 32 * (16 + 2))
        };
        let blocks = self.bounds_launch(w)?.grid_dim.0 as usize;
        Ok(Some(BoundedArgmax {
            plane,
            upper: self.zeros(w.rows())?,
            lower: self.zeros(blocks)?,
            first_pass,
        }))
    }

    /// The launch of `logit_bounds` over `w`: units of four rows, one warp each.
    fn bounds_launch(&self, w: &GpuMatrix) -> Result<LaunchConfig> {
        let split = split_of(w.n_in(), "logit_bounds")?;
        let g = self.geometry(w.rows().div_ceil(4), split, w.n_in())?;
        self.strided_launch(&bounded_kernel("logit_bounds", w.ty()), &g)
    }

    /// What `logits` with `best` gives in `best`'s words (the same token, and the same end
    /// of the step), without the logits: a first pass bounds every row's logit from the top
    /// bits of its weights (q8_0: the quants' high nibbles, 18 of each chunk's 34 bytes; f16:
    /// the high bytes, half), a second computes exactly, as `logits` does, only the rows whose
    /// upper bound reaches the largest lower bound (the arg-max is one of them). `w` the matrix
    /// `b` was made for. Twin: `cpu::logit_bounds_q8_0` or `cpu::logit_bounds_f16` (the first
    /// pass), `cpu::argmax`.
    pub fn argmax_bounded(
        &self,
        b: &mut BoundedArgmax,
        x: &impl DevicePtr<f32>,
        norm: &impl DevicePtr<f32>,
        eps: f32,
        w: &GpuMatrix,
        best: Argmax<'_>,
    ) -> Result<()> {
        const WHAT: &str = "argmax_bounded";
        let (n_in, n_out) = (x.len(), w.rows());
        check(norm.len() == n_in, "argmax_bounded: shapes of x and norm")?;
        check_matrix(w, n_out, n_in, WHAT)?;
        let (out, scratch, end) = best;
        check(
            BoundedArgmax::applies(w.ty(), n_in)
                && b.plane.as_ref().map_or(0, |p| p.len())
                    == n_out * BoundedArgmax::plane_bytes(w.ty(), n_in)
                && b.upper.len() == n_out
                && out.len() >= 1
                && scratch.len() >= 2
                && end.as_ref().is_none_or(StepEnd::valid),
            "argmax_bounded: matrix, bounds, best, scratch and step",
        )?;
        let first = self.bounds_launch(w)?;
        let n_lower = first.grid_dim.0;
        check(
            b.lower.len() >= n_lower as usize,
            "argmax_bounded: lower bounds",
        )?;
        let (n_in, n_out) = (u32_of(n_in, WHAT)?, u32_of(n_out, WHAT)?);
        let s = self.stream();
        let (xp, _x) = x.device_ptr(s);
        let (np, _n) = norm.device_ptr(s);
        check_aligned(&[xp, np], WHAT)?;
        let (wp, _w) = w.ptr(s);
        let plane = b.plane.as_ref().map(|p| p.device_ptr(s));
        let pp = plane.as_ref().map_or(0, |(p, _)| *p);
        let (up, _u) = b.upper.device_ptr_mut(s);
        let (lp, _l) = b.lower.device_ptr_mut(s);
        let mut l = self.launch(&bounded_kernel("logit_bounds", w.ty()));
        l.arg(&up).arg(&lp).arg(&xp).arg(&np).arg(&eps);
        l.arg(&wp).arg(&pp).arg(&n_in).arg(&n_out);
        // SAFETY: parameters (f32*, u32*, const f32*, const f32*, f32, const u8*, const u8*,
        // u32, u32). w is n_out q8_0 or f16 GpuMatrix rows of n_in <= 1024 (whole chunks, one
        // warp each) with its plane for f16 (16-byte aligned, as every allocation; null for
        // q8_0, whose sketch reads none); x and norm hold n_in, 16-byte aligned; upper holds
        // n_out and lower a word per block; blocks are whole warps, shared as `gemv_shared`.
        // It may overlap the kernel before: it reads only weights before it waits.
        unsafe { l.run(first, true) }?;

        // A block a multiprocessor, or more where a block's share of the rows (listed in its
        // shared memory) would pass `LIST`.
        const LIST: u32 = 4096;
        let blocks = self.sm_count()?.max(n_out.div_ceil(LIST));
        let list = 4 * (1 + n_out.div_ceil(blocks));
        let g = Geometry {
            threads: 32 * MAX_WARPS,
            per_block: MAX_WARPS,
            blocks,
            shared: gemv_shared(32 * MAX_WARPS, n_in as usize)? + list,
        };
        let name = bounded_kernel(WHAT, w.ty());
        let second = self.gemv_launch(&name, &g, g.blocks)?;
        let (op, _o) = out.device_ptr_mut(s);
        let (sp, _s) = scratch.device_ptr_mut(s);
        let end = end.map(|e| e.ptrs(s));
        let (tp, nt, pos, stp) = end.as_ref().map_or((0, 0, 0, 0), |(p, _)| *p);
        let mut l = self.launch(&name);
        l.arg(&op).arg(&sp).arg(&up).arg(&lp).arg(&n_lower);
        l.arg(&xp).arg(&np).arg(&eps).arg(&wp).arg(&n_in);
        l.arg(&n_out).arg(&tp).arg(&nt).arg(&pos).arg(&stp);
        // SAFETY: parameters (u32*, u64*, const f32*, const u32*, u32, const f32*, const f32*,
        // f32, const u8*, u32, u32, u32* or null, u32, u32* or null, u64* or null). As above;
        // out holds 1 u32 and scratch 2 u64 (zero, as every launch leaves it); `logit_bounds`
        // wrote upper and n_lower words of lower; the step's end writes tokens below n_tokens,
        // one pos and one step; shared as `gemv_shared` and the list of a block's share.
        // It may overlap `logit_bounds`: it reads x (final before that one's wait) and norm
        // before it waits.
        unsafe { l.run(second, true) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every decode kernel the host names for a type is in both PTX builds (a missing one
    /// would panic at its first launch). Reads the embedded PTX: no GPU needed.
    #[test]
    fn every_decode_kernel_named_is_in_the_ptx() {
        for ptx in [crate::PTX, crate::PTX_SM90] {
            let entries: Vec<&str> = ptx.lines().filter_map(super::super::entry_name).collect();
            let mut names = vec!["attn_qkv_packed".to_string()];
            for ty in GgmlType::ALL {
                for base in ["attn_qkv", "ffn_gate_up", "gemv_residual", "logits"] {
                    names.push(family_kernel(base, ty));
                }
                if BoundedArgmax::applies(ty, 896) {
                    for pass in ["logit_bounds", "argmax_bounded"] {
                        names.push(bounded_kernel(pass, ty));
                    }
                }
            }
            for name in names {
                assert!(entries.contains(&name.as_str()), "{name} is not in the PTX");
            }
        }
    }
}
