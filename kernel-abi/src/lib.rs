//! The contract between orcd's GPU kernels (`gpu-kernels/`, compiled to PTX) and the host code
//! that launches them (`orcd::cuda`), in one place that both build against:
//!
//! - every kernel's parameters, declared once in [`kernels!`]: gpu-kernels expands the list into
//!   its `extern "gpu-kernel"` entry points, orcd into one typed launcher per kernel;
//! - the constants that both sides size things by: the ggml type ids the kernels dispatch on,
//!   the weight families that decode kernels are built for, block shapes and shared memory.
//!
//! `no_std` and without dependencies: it is built for nvptx64 with the kernels and for the host
//! with orcd. How to declare and launch a kernel: `docs/kernels.md`.
#![no_std]

mod kernels;

/// Threads of a warp.
pub const WARP: u32 = 32;

/// Shared memory of a block-wide sum (gpu-kernels' `util::block_sum`): a slot per warp, for
/// blocks of up to 32 warps. What `rms_norm` needs.
pub const BLOCK_SUM_BYTES: u32 = WARP * 4;

/// ggml type ids, as the kernels' `ty` parameters take them (the discriminants of
/// `orcd::quant::GgmlType`).
pub mod ggml {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q5_0: u32 = 6;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const Q5_K: u32 = 13;
    pub const Q6_K: u32 = 14;
    pub const BF16: u32 = 30;
}

/// The weight families: the types one compiled kernel serves. A kernel has its hungriest type's
/// registers and every type's code, so the decode kernels are built once per family (their
/// entry points `<kernel>_<family>`, keyed by these ids), the packed types in two. A type's
/// family is [`family::of`]; which types a build serves is gpu-kernels' `matmul::family::serves`.
pub mod family {
    use crate::ggml;

    /// Every type (kernels where registers do not matter).
    pub const ANY: u32 = 0;
    /// The packed quantized types: both families below.
    pub const PACKED: u32 = 1;
    pub const F32: u32 = 2;
    pub const F16: u32 = 3;
    pub const BF16: u32 = 4;
    /// The packed types of 32-weight blocks: q4_0, q5_0, q8_0.
    pub const LEGACY: u32 = 5;
    /// The packed types of 256-weight super-blocks: q4_K, q5_K, q6_K.
    pub const KQUANT: u32 = 6;
    /// What [`of`] gives for an id that is no type of any family.
    pub const NONE: u32 = u32::MAX;

    /// The family of ggml type `ty` (one of the single families, never `ANY` or `PACKED`).
    #[inline]
    pub const fn of(ty: u32) -> u32 {
        match ty {
            ggml::F32 => F32,
            ggml::F16 => F16,
            ggml::BF16 => BF16,
            ggml::Q4_0 | ggml::Q5_0 | ggml::Q8_0 => LEGACY,
            ggml::Q4_K | ggml::Q5_K | ggml::Q6_K => KQUANT,
            _ => NONE,
        }
    }
}

/// The GEMV of gpu-kernels' matmul.rs (`gemv_units`), which the decode kernels share.
pub mod gemv {
    use crate::WARP;

    /// Floats per chunk of a staged vector (`matmul::stage`): its 32 elements, the sums of its
    /// halves and 2 of padding (a stride of 36 words puts the 8 lanes of each phase of a 16-byte
    /// shared load on distinct banks).
    pub const STAGED: usize = 36;

    /// The 4-byte slots of a block's reductions at the start of its shared memory, for
    /// `threads` per block: the norm's block sum (32) or the warps' meetings (2 a warp), 16-byte
    /// aligned. A staged vector follows them.
    #[inline]
    pub const fn slot_words(threads: u32) -> u32 {
        let meetings = 2 * threads / WARP;
        let words = if meetings > WARP { meetings } else { WARP };
        words.next_multiple_of(4)
    }

    /// Shared memory of a GEMV kernel with `threads` per block that stages a vector of `staged`
    /// elements (0: none): the slots, then the vector's chunks.
    pub const fn shared_bytes(threads: u32, staged: u32) -> u32 {
        4 * (slot_words(threads) + STAGED as u32 * staged.div_ceil(32))
    }
}

/// The tiled GEMM of gpu-kernels' matmul.rs (`gemm`, `gemm_mma`).
pub mod gemm {
    /// Tokens (rows of x) and outputs (rows of w) of a block's tile, and the K step.
    pub const TILE_M: usize = 64;
    pub const TILE_N: usize = 64;
    pub const TILE_K: usize = 32;
    /// Threads of a group of 4 warps: the tensor-core loop's consumer or one team of its
    /// producers, or the f32 loop. A block is `GROUP·(1 + T)` threads for `T` teams.
    pub const GROUP: u32 = 128;
    /// The most producer teams of the tensor-core loop (more warps would idle).
    pub const MAX_TEAMS: u32 = 3;
    /// Slots of K steps in shared memory that each producer team fills in turn.
    pub const TEAM_SLOTS: u32 = 2;
    /// Bytes of one 64-row tile of a K step in shared memory: 64 rows of 32 halves.
    pub const TILE_BYTES: u32 = (TILE_M * TILE_K * 2) as u32;
    /// One K step of 32 in shared memory: the tiles x hi, x lo, w hi, w lo.
    pub const STEP_BYTES: u32 = 4 * TILE_BYTES;
    /// Shared memory of one producer team: its slots.
    pub const TEAM_SHARED_BYTES: u32 = TEAM_SLOTS * STEP_BYTES;
    /// Row stride in floats of the f32 loop's shared `[TILE_K][64]` tiles: 4 floats of padding
    /// keep every row 16-byte aligned.
    pub const F32_STRIDE: usize = TILE_N + 4;
    /// Shared memory of the f32 loop: its x and w tiles.
    pub const F32_SHARED_BYTES: u32 = (2 * TILE_K * F32_STRIDE * 4) as u32;

    /// Shared memory of a block with `teams` producer teams (0: the f32 loop alone).
    pub const fn shared_bytes(teams: u32) -> u32 {
        let mma = teams * TEAM_SHARED_BYTES;
        if mma > F32_SHARED_BYTES {
            mma
        } else {
            F32_SHARED_BYTES
        }
    }
}

/// The attention kernels of gpu-kernels' attention.rs.
pub mod attention {
    use crate::WARP;

    /// Threads of a block of either attention kernel: 8 warps.
    pub const THREADS: u32 = 256;
    /// Query heads of a decode block, one per warp (larger kv groups take several blocks).
    pub const DECODE_HEADS: u32 = THREADS / WARP;
    /// Keys of one tile: one per lane (decode), one warp's share of a round (prefill).
    pub const TILE_KEYS: u32 = 32;
    /// Key slices of the decode kernel, its grid's y: the host launches this many, the kernel
    /// takes no more (up to `DECODE_SPLITS·TILE_KEYS` keys each block has one tile at most).
    /// With 2 kv heads, 128 blocks: about one per SM of an H100.
    pub const DECODE_SPLITS: u32 = 64;
    /// Query rows of a prefill block: 4 row groups of 16 (one mma tile's rows each).
    pub const PREFILL_ROWS: u32 = 64;
    /// The largest head_dim: the kernels keep a head's dims in registers, padded to 64 or 128.
    pub const MAX_HEAD_DIM: u32 = 128;
    /// Shared memory of the decode kernel, for head dims padded to 128: K `[32][132]`, V
    /// `[32][128]`, 8 queries of 128 and 8 × 32 weights, f32.
    pub const DECODE_SHARED_BYTES: u32 = (TILE_KEYS * (MAX_HEAD_DIM + 4)
        + TILE_KEYS * MAX_HEAD_DIM
        + DECODE_HEADS * MAX_HEAD_DIM
        + DECODE_HEADS * TILE_KEYS)
        * 4;
    /// Shared memory of the prefill kernel: one round's K and V tiles as f16 halves (4 tiles of
    /// 8192 bytes).
    pub const PREFILL_SHARED_BYTES: u32 = 32768;
}

/// The token-choice kernels of gpu-kernels' sampling.rs.
pub mod sampling {
    /// Shared memory of `argmax`: 32 f32 and 32 u32 of its block reduction.
    pub const ARGMAX_SHARED_BYTES: u32 = 64 * 4;
    /// The most candidates top-k keeps (the largest `top_k`): the shared candidate arrays'
    /// length.
    pub const MAX_K: u32 = 1024;
    /// The samplers' shared memory, in 4-byte words: [0, 64) block reductions, then scalars
    /// passed between threads (`VARS`), two sets of 32 per-warp counts (`WARP_COUNTS`), the
    /// radix histogram of `BINS` (`HIST`) and, in `sample` only, the candidates' values
    /// (`CAND_V`) and ids (`CAND_I`). The penalty's bitmap of a slice's bits reuses it from
    /// word 0 before any of these is live.
    pub const VARS: usize = 64;
    pub const WARP_COUNTS: usize = 96;
    pub const HIST: usize = 160;
    pub const BINS: u32 = 2048;
    pub const CAND_V: usize = HIST + BINS as usize;
    pub const CAND_I: usize = CAND_V + MAX_K as usize;
    /// Words of `sample_candidates` (up to the histogram's end), apart from the bitmap.
    pub const CANDIDATES_SHARED_WORDS: usize = CAND_V;
    /// Words of `sample` and `sample_dev` (up to the candidates' end).
    pub const SAMPLE_SHARED_WORDS: usize = CAND_I + MAX_K as usize;
    /// Words of a row's parameters for `sample_rows`: temperature, top_k, top_p, min_p (f32
    /// bits where floats), the seed's and the draw's low and high halves, the row's first
    /// penalty and their count.
    pub const ROW_PARAM_WORDS: usize = 10;
    /// Threads of a `sample_rows` block: its registers do not fit 1024.
    pub const SAMPLE_ROWS_THREADS: u32 = 512;
    /// Keys (or ids) at which one pass of `sample_rows` sums the candidates at once: a search
    /// narrows its range this many times a pass.
    pub const PROBES: usize = 16;
    /// Words of `sample_rows`: `sample`'s layout (its top-k candidates in `CAND_V`, `CAND_I`),
    /// then each probe's per-warp counts and weights (`PROBE_SUMS`).
    pub const PROBE_SUMS: usize = SAMPLE_SHARED_WORDS;
    pub const SAMPLE_ROWS_SHARED_WORDS: usize = PROBE_SUMS + 2 * PROBES * 32;
    /// Logits a block of a greedy row takes at least, when a row's arg-max is split over
    /// blocks.
    pub const GREEDY_SLICE: u32 = 4096;
}

/// The batched pass's matrix product (gpu-kernels' gemm_rows.rs).
pub mod gemm_rows {
    /// n8 tiles of outputs per warp: a warp computes `8·NT` outputs.
    pub const NT: u32 = 2;
    /// The most m16 tiles of rows a block takes (`mt` is 1, 2, 4 or this).
    pub const MAX_MT: u32 = 8;
    /// Outputs per warp.
    pub const WARP_OUTS: u32 = 8 * NT;
    /// The most parts of K (`kb`).
    pub const MAX_PARTS: u32 = 8;
    /// Chunks of x in flight in a block's shared memory (a ring: the block computes one while
    /// the next ones load).
    pub const STAGES: u32 = 3;
    /// Floats from one row of a staged chunk to the next: its 32, and 4 that put the rows of
    /// an m16 tile's fragment loads on distinct banks.
    pub const ROW_FLOATS: u32 = 36;

    /// Shared bytes of a block of `mt` m16 tiles of rows: the ring, then the word that tells the
    /// block whether it adds up the K parts.
    pub const fn shared_bytes(mt: u32) -> u32 {
        4 * STAGES * 16 * mt * ROW_FLOATS + 16
    }
}

/// The paged KV cache's kernels (gpu-kernels' paged.rs).
pub mod paged {
    /// Query rows of one sequence a `paged_attention` block takes: they share every K/V tile it
    /// loads.
    pub const ITEM_ROWS: u32 = 8;
    /// Keys of a tile.
    pub const TILE: u32 = 32;
    /// Warps of a `paged_attention` block.
    pub const WARPS: u32 = 8;
    /// `kv_copy_paged`'s directions (its keys): paged f16 rows widened into the contiguous
    /// f32 cache, or contiguous rows rounded into paged ones.
    pub const FROM_PAGED: u32 = 0;
    pub const TO_PAGED: u32 = 1;
    /// Blocks that share an item's keys (its grid's z): block `z` takes tiles `z, z + SPLITS,
    /// ...`, so a lone decode row spreads over as many SMs as it has tiles, up to this many. A
    /// constant, not a launch choice: a row's split, and so its bits, follow from its position.
    pub const SPLITS: u32 = 32;

    /// Floats of one block's partial result for one query vector (`paged_attention`'s
    /// scratch): its unnormalised output `[hd]`, then its running max and sum.
    pub const fn partial_floats(hd: u32) -> u32 {
        hd + 2
    }

    /// Shared memory of a `paged_attention` block, in f32, for head dim `hd` and a kv group of
    /// `group` query heads (`vectors = ITEM_ROWS·group`): K `[TILE][hd + 1]`, V `[TILE][hd]`,
    /// the queries and their running outputs `[vectors][hd]` each, each vector's running max
    /// and sum, and each warp's `TILE` softmax weights.
    pub const fn attention_shared_floats(hd: u32, group: u32) -> u32 {
        let vectors = ITEM_ROWS * group;
        TILE * (2 * hd + 1) + 2 * vectors * hd + 2 * vectors + WARPS * TILE
    }

    /// `attention_shared_floats` in bytes.
    pub const fn attention_shared_bytes(hd: u32, group: u32) -> u32 {
        4 * attention_shared_floats(hd, group)
    }
}
