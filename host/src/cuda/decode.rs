//! Launch helpers of the fused decode-step kernels (gpu-kernels/src/decode.rs), for one token.
//! The position is read from device memory and every scratch buffer is the caller's, so the
//! launches can be captured into a CUDA graph once and replayed for every token: no helper
//! allocates, copies from the host or synchronises. Every weight matrix is a [`GpuMatrix`], read
//! in its own format (packed quantized chunks, or plain floats).
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use kernel_abi::{family, gemv};

use super::kernels::{
    ArgmaxBounded, AttnOutput, AttnQkv, DevPtr, DevPtrMut, Entry, FfnGateUp, GemvResidual,
    HighBytes, LogitBounds, Logits,
};
use super::matmul::{GpuMatrix, entry_of, gemv_split, one_per_element};
use super::{AttentionSums, Device, Overlap, allow_shared, check, u32_of};
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
fn check_aligned<T>(ptrs: &[DevPtr<T>], what: &str) -> Result<()> {
    if ptrs.iter().all(|p| p.is_aligned(ALIGN)) {
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

/// The weight family of `ty` (`kernel_abi::family`), which keys the decode kernels: one build
/// per family keeps each kernel's registers to what its own types need.
fn family(ty: GgmlType) -> u32 {
    family::of(ty as u32)
}

/// The input vector of `Device::residual`'s kernels: floats and a bias (or null), or the
/// decode attention's sums and head_dim.
enum Input {
    Floats(DevPtr<f32>, DevPtr<f32>),
    Sums(DevPtr<f64>, u32),
}

/// Whether `ty` is a quantized (packed) type.
fn packed(ty: GgmlType) -> bool {
    ty.block_elems() > 1
}

/// Shared memory of a GEMV kernel (these and matmul.rs's) with `threads` per block that stages
/// a vector of `staged` (0: none): the slots of its reductions (the norm's block sum and the
/// warps' meetings, which also hold the arg-max's u64), then the vector
/// (`kernel_abi::gemv::shared_bytes`).
fn gemv_shared(threads: u32, staged: usize) -> Result<u32> {
    // Rows longer than 32 warps' chunks never reach a GEMV kernel: no overflow.
    Ok(gemv::shared_bytes(
        threads,
        u32_of(staged, "GEMV shared memory")?,
    ))
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
    fn ptrs<'s>(self, s: &'s CudaStream) -> (StepPtrs, [SyncOnDrop<'s>; 3])
    where
        'a: 's,
    {
        let n = self.tokens.len() as u32;
        let (t, tg) = DevPtrMut::of(self.tokens, s);
        let (p, pg) = DevPtrMut::of(self.pos, s);
        let (st, sg) = DevPtrMut::of(self.step, s);
        ((t, n, p, st), [tg, pg, sg])
    }
}

/// The kernels' (tokens, n_tokens, pos, step) of a step's end; null, 0, null, null for none.
type StepPtrs = (DevPtrMut<u32>, u32, DevPtrMut<u32>, DevPtrMut<u64>);

/// No step's end.
fn no_step_end() -> StepPtrs {
    (DevPtrMut::null(), 0, DevPtrMut::null(), DevPtrMut::null())
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
    /// copies of the vector read from L2 (each block stages the whole vector); and a small
    /// matrix does better on fewer SMs in larger blocks than spread over every SM (measured:
    /// docs/performance.md).
    fn staged_geometry<K>(
        &self,
        entry: Entry<K>,
        units: usize,
        split: u32,
        staged: usize,
    ) -> Result<Geometry> {
        let sms = self.sm_count()? as usize;
        let f = self.function(entry);
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

    /// The launch of GEMV kernel `entry` with `blocks` blocks of `g`, its shared memory
    /// allowed where it is more than a block gets without asking.
    fn gemv_launch<K>(&self, entry: Entry<K>, g: &Geometry, blocks: u32) -> Result<LaunchConfig> {
        allow_shared(self.function(entry), g.shared)?;
        Ok(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (g.threads, 1, 1),
            shared_mem_bytes: g.shared,
        })
    }

    /// The launch of a kernel whose blocks stride over its units: as many blocks as cover them
    /// in one round, at most as many as the GPU holds at once (the rest go round again, with
    /// no block waiting for a slot).
    pub(super) fn strided_launch<K>(&self, entry: Entry<K>, g: &Geometry) -> Result<LaunchConfig> {
        let cfg = self.gemv_launch(entry, g, g.blocks)?;
        let resident = self
            .function(entry)
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
        let entry = if tys.iter().all(|t| family(*t) == family(tys[0])) {
            entry_of(AttnQkv::entry(family(tys[0])), WHAT)?
        } else if tys.iter().all(|t| packed(*t)) {
            AttnQkv::attn_qkv_packed
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
        let cfg = self.gemv_launch(entry, &g, q_blocks + 2 * kv_blocks)?;
        let s = self.stream();
        let (q, _q) = DevPtrMut::of(q, s);
        let (k_cache, _kc) = DevPtrMut::of(k_cache, s);
        let (v_cache, _vc) = DevPtrMut::of(v_cache, s);
        let (x, _x) = DevPtr::of(x, s);
        let (norm, _n) = DevPtr::of(norm, s);
        let (pos, _p) = DevPtr::of(pos, s);
        let (rope, _r) = DevPtr::of(rope, s);
        let (sums, _s) = DevPtrMut::of(&mut sums.sums, s);
        let ws = qkv.each_ref().map(|(w, _)| w.ptr(s));
        let bs = qkv.each_ref().map(|(_, b)| b.map(|b| DevPtr::of(b, s)));
        check_aligned(&[x, norm], WHAT)?;
        // A null bias pointer: the kernel adds nothing.
        let b = bs
            .each_ref()
            .map(|b| b.as_ref().map_or(DevPtr::null(), |(p, _)| *p));
        let ty = qkv.each_ref().map(|(w, _)| w.ty() as u32);
        let p = AttnQkv {
            q,
            k_cache,
            v_cache,
            x,
            norm,
            eps,
            wq: ws[0].0,
            ty_q: ty[0],
            bq: b[0],
            wk: ws[1].0,
            ty_k: ty[1],
            bk: b[1],
            wv: ws[2].0,
            ty_v: ty[2],
            bv: b[2],
            pos,
            rope,
            n_in: n_in as u32,
            n_heads: n_heads as u32,
            n_kv: n_kv_heads as u32,
            head_dim: hd as u32,
            max_pos: max_pos as u32,
            q_blocks,
            kv_blocks,
            split,
            sums,
        };
        // SAFETY: every size was checked above: the weights are GpuMatrix rows of n_in (whole
        // chunks of 32, at most 32·split of them), x and norm 16-byte aligned; q
        // holds n_heads·head_dim, sums n_heads·(head_dim + 1); the kernel writes cache row
        // pos[0] and reads table row pos[0] only below max_pos, else traps. Blocks are whole
        // units of `split` warps, shared as `gemv_shared` (the reductions' slots and the
        // staged x).
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
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
        let entry = entry_of(FfnGateUp::entry(family(gate.ty())), WHAT)?;
        let cfg = self.strided_launch(entry, &g)?;
        let s = self.stream();
        let (h, _h) = DevPtrMut::of(h, s);
        let (x, _x) = DevPtr::of(x, s);
        let (norm, _n) = DevPtr::of(norm, s);
        let (w_gate, _g) = gate.ptr(s);
        let (w_up, _u) = up.ptr(s);
        check_aligned(&[x, norm], WHAT)?;
        let p = FfnGateUp {
            h,
            x,
            norm,
            eps,
            w_gate,
            w_up,
            ty: gate.ty() as u32,
            n_in: n_in as u32,
            n_out: n_out32,
            split,
        };
        // SAFETY: gate and up are GpuMatrix rows of n_in of one type; x and norm 16-byte
        // aligned; h holds n_out; n_in is whole chunks, one per lane of `split` warps
        // (`split_of`); blocks are whole units of `split` warps, shared as `gemv_shared`.
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
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
        let (vp, _v) = DevPtr::of(v, s);
        let bias = bias.map(|b| DevPtr::of(b, s));
        let bp = bias.as_ref().map_or(DevPtr::null(), |(p, _)| *p);
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
        let (sp, _s) = DevPtr::of(&sums.sums, self.stream());
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
        // serves from one staged copy of v each (`staged_geometry`). So too the attention's
        // sums, for every type: staging them beats each lane loading its own chunk of the f64
        // sums. Plain floats otherwise: their larger weights want every SM's loads more than
        // they gain from one staged copy.
        let staged = packed(w.ty()) || matches!(input, Input::Sums(..));
        let (fam, ty, n_in32) = (family(w.ty()), w.ty() as u32, u32_of(n_in, what)?);
        let s = self.stream();
        let (y, _y) = DevPtrMut::of(y, s);
        let (wp, _w) = w.ptr(s);
        // Both launches: w is n_out GpuMatrix rows of n_in (whole chunks, one per lane of
        // `split` warps), v or the sums 16-byte aligned; v holds n_in, the sums n_in plus a sum
        // per head (`AttentionSums`' shape), y and bias n_out; blocks are whole units of
        // `split` warps, shared as `gemv_shared` (with the staged vector where staged). Each
        // may overlap the kernel before: `gemv_units` reads only weights before it waits.
        match input {
            Input::Floats(v, bias) => {
                check_aligned(&[v], what)?;
                let entry = entry_of(GemvResidual::entry(fam), what)?;
                let cfg = self.residual_launch(entry, staged, n_out, split, n_in)?;
                let p = GemvResidual {
                    y,
                    v,
                    w: wp,
                    ty,
                    bias,
                    n_in: n_in32,
                    n_out: n_out32,
                    split,
                };
                // SAFETY: as said above the match.
                unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
            }
            Input::Sums(sums, head_dim) => {
                check_aligned(&[sums], what)?;
                let entry = entry_of(AttnOutput::entry(fam), what)?;
                let cfg = self.residual_launch(entry, staged, n_out, split, n_in)?;
                let p = AttnOutput {
                    y,
                    sums,
                    head_dim,
                    w: wp,
                    ty,
                    n_in: n_in32,
                    n_out: n_out32,
                    split,
                };
                // SAFETY: as said above the match.
                unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
            }
        }
    }

    /// The launch of `residual`'s kernel `entry` for `n_out` rows of `n_in`: a block for every
    /// `per_block` units, each one round (the kernel holds no next one); `staged`, in
    /// `staged_geometry`'s few blocks.
    fn residual_launch<K>(
        &self,
        entry: Entry<K>,
        staged: bool,
        n_out: usize,
        split: u32,
        n_in: usize,
    ) -> Result<LaunchConfig> {
        let g = if staged {
            self.staged_geometry(entry, n_out.div_ceil(2), split, n_in)?
        } else {
            self.geometry(n_out.div_ceil(2), split, 0)?
        };
        self.gemv_launch(entry, &g, g.blocks)
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
        let entry = entry_of(Logits::entry(family(w.ty())), WHAT)?;
        let cfg = self.strided_launch(entry, &g)?;
        let s = self.stream();
        let (logits, _l) = DevPtrMut::of(logits, s);
        let (x, _x) = DevPtr::of(x, s);
        let (norm, _n) = DevPtr::of(norm, s);
        let (wp, _w) = w.ptr(s);
        check_aligned(&[x, norm], WHAT)?;
        let (best, end) = best.map_or((None, None), |(o, sc, e)| {
            (Some((DevPtrMut::of(o, s), DevPtrMut::of(sc, s))), e)
        });
        let end = end.map(|e| e.ptrs(s));
        // Null pointers: no arg-max, no step's end.
        let (best, scratch) = best.as_ref().map_or(
            (DevPtrMut::null(), DevPtrMut::null()),
            |((o, _), (sc, _))| (*o, *sc),
        );
        let (tokens, n_tokens, pos, step) = end.as_ref().map_or(no_step_end(), |(p, _)| *p);
        let p = Logits {
            logits,
            x,
            norm,
            eps,
            w: wp,
            ty: w.ty() as u32,
            n_in: n_in as u32,
            n_out: n_out32,
            split,
            best,
            scratch,
            tokens,
            n_tokens,
            pos,
            step,
        };
        // SAFETY: w is n_out GpuMatrix rows of n_in (whole chunks, one per lane of `split`
        // warps), x and
        // norm 16-byte aligned; logits holds n_out; out holds 1 u32 and scratch 2 u64 (zero,
        // as every launch leaves it); the step's end (with the arg-max only) writes tokens
        // below n_tokens, one pos and one step; blocks are whole units of `split` warps,
        // shared as `gemv_shared`.
        // It may overlap the kernel before: `gemv_units` reads only weights before it waits.
        unsafe { p.launch(self, entry, cfg, Overlap::Allowed) }
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
                let (out, _o) = DevPtrMut::of(&mut plane, s);
                let (wp, _w) = w.ptr(s);
                let p = HighBytes {
                    out,
                    w: wp.cast(),
                    n: n32,
                };
                // SAFETY: out holds n bytes, w n f16 (rows of n_in plain f16).
                unsafe { p.launch(self, HighBytes::high_bytes, cfg, Overlap::Serial) }?;
            }
            (Some(plane), n)
        } else {
            (None, n / 32 * (16 + 2))
        };
        let blocks = self.bounds_launch(w)?.1.grid_dim.0 as usize;
        Ok(Some(BoundedArgmax {
            plane,
            upper: self.zeros(w.rows())?,
            lower: self.zeros(blocks)?,
            first_pass,
        }))
    }

    /// The entry point and launch of `logit_bounds` over `w`: units of four rows, one warp
    /// each.
    fn bounds_launch(&self, w: &GpuMatrix) -> Result<(Entry<LogitBounds>, LaunchConfig)> {
        const WHAT: &str = "logit_bounds";
        let split = split_of(w.n_in(), WHAT)?;
        let entry = entry_of(LogitBounds::entry(w.ty() as u32), WHAT)?;
        let g = self.geometry(w.rows().div_ceil(4), split, w.n_in())?;
        Ok((entry, self.strided_launch(entry, &g)?))
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
        let (bounds, first) = self.bounds_launch(w)?;
        let n_lower = first.grid_dim.0;
        check(
            b.lower.len() >= n_lower as usize,
            "argmax_bounded: lower bounds",
        )?;
        let (n_in, n_out) = (u32_of(n_in, WHAT)?, u32_of(n_out, WHAT)?);
        let s = self.stream();
        let (x, _x) = DevPtr::of(x, s);
        let (norm, _n) = DevPtr::of(norm, s);
        check_aligned(&[x, norm], WHAT)?;
        let (wp, _w) = w.ptr(s);
        let plane = b.plane.as_ref().map(|p| DevPtr::of(p, s));
        let plane = plane.as_ref().map_or(DevPtr::null(), |(p, _)| *p);
        let (upper, _u) = DevPtrMut::of(&mut b.upper, s);
        let (lower, _l) = DevPtrMut::of(&mut b.lower, s);
        let p = LogitBounds {
            upper,
            lower,
            x,
            norm,
            eps,
            w: wp,
            plane,
            n_in,
            n_out,
        };
        // SAFETY: w is n_out q8_0 or f16 GpuMatrix rows of n_in <= 1024 (whole chunks, one
        // warp each) with its plane for f16 (16-byte aligned, as every allocation; null for
        // q8_0, whose sketch reads none); x and norm hold n_in, 16-byte aligned; upper holds
        // n_out and lower a word per block; blocks are whole warps, shared as `gemv_shared`.
        // It may overlap the kernel before: it reads only weights before it waits.
        unsafe { p.launch(self, bounds, first, Overlap::Allowed) }?;

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
        let entry = entry_of(ArgmaxBounded::entry(w.ty() as u32), WHAT)?;
        let second = self.gemv_launch(entry, &g, g.blocks)?;
        let (best, _o) = DevPtrMut::of(out, s);
        let (scratch, _s) = DevPtrMut::of(scratch, s);
        let end = end.map(|e| e.ptrs(s));
        let (tokens, n_tokens, pos, step) = end.as_ref().map_or(no_step_end(), |(p, _)| *p);
        let p = ArgmaxBounded {
            best,
            scratch,
            upper: upper.as_const(),
            lower: lower.as_const(),
            n_lower,
            x,
            norm,
            eps,
            w: wp,
            n_in,
            n_out,
            tokens,
            n_tokens,
            pos,
            step,
        };
        // SAFETY: as above; out holds 1 u32 and scratch 2 u64 (zero, as every launch leaves
        // it); `logit_bounds`
        // wrote upper and n_lower words of lower; the step's end writes tokens below n_tokens,
        // one pos and one step; shared as `gemv_shared` and the list of a block's share.
        // It may overlap `logit_bounds`: it reads x (final before that one's wait) and norm
        // before it waits.
        unsafe { p.launch(self, entry, second, Overlap::Allowed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::{Gemm, Gemv};

    /// Every type the engine reads has an entry point of each kernel that the host keys by its
    /// type or family (a missing one would be an error at its first launch); that each is in
    /// the PTX is `every_declared_kernel_is_in_the_ptx`'s. No GPU needed.
    #[test]
    fn every_type_has_its_kernels() {
        for ty in GgmlType::ALL {
            let (name, fam) = (ty.name(), family(ty));
            assert!(Gemv::entry(ty as u32).is_some(), "gemv {name}");
            assert!(Gemm::entry(ty as u32).is_some(), "gemm {name}");
            assert!(AttnQkv::entry(fam).is_some(), "attn_qkv {name}");
            assert!(FfnGateUp::entry(fam).is_some(), "ffn_gate_up {name}");
            assert!(GemvResidual::entry(fam).is_some(), "gemv_residual {name}");
            assert!(AttnOutput::entry(fam).is_some(), "attn_output {name}");
            assert!(Logits::entry(fam).is_some(), "logits {name}");
            if BoundedArgmax::applies(ty, 896) {
                assert!(
                    LogitBounds::entry(ty as u32).is_some(),
                    "logit_bounds {name}"
                );
                assert!(
                    ArgmaxBounded::entry(ty as u32).is_some(),
                    "argmax_bounded {name}"
                );
            }
        }
    }
}
