/// Every kernel's parameters, declared once: `kernel_abi::kernels!(m)` invokes the macro `m`
/// with the list below, and each side expands it its own way. gpu-kernels (its lib.rs) makes
/// each kernel's parameters a struct, `params::Name`, and each entry point an
/// `#[unsafe(no_mangle)] extern "gpu-kernel"` function taking them one by one (so the PTX
/// signature is plain scalars and pointers) that calls the body with the struct. orcd
/// (`cuda::kernels`) makes each kernel a struct of typed fields, `kernels::Name`, pointers as
/// device addresses typed by element, with a `launch` method and a constant per entry point.
///
/// A declaration reads
///
/// ```text
/// /// What it computes. Grid: ..., block: ..., shared: ... (the launch contract).
/// Name(param: Type, ...) => module::body { entry, ... }
/// ```
///
/// `Type` is the kernel's own: `*mut T` or `*const T` (device pointers, `T` a primitive;
/// null where the kernel says it may be), `u32`, `u64` or `f32`. `module::body` is the
/// kernel's body in gpu-kernels, `unsafe fn body(p: params::Name)`. Each `entry` is an entry
/// point of that name in the PTX. A kernel built several times (per weight type or family,
/// per head dim) gives each entry point a key, `entry = KEY` (a `u32` constant): the entry
/// calls `body::<KEY>(p)`, and the host picks an entry by its key.
#[macro_export]
macro_rules! kernels {
    ($m:ident) => {
        $m! {
            // Elementwise and norm kernels (gpu-kernels' elementwise.rs, norm.rs).

            /// `out[r, i] = x[r, i] / sqrt(mean(x[r]²) + eps)·w[i]` for every row `r` of `n`
            /// columns. Grid: one block per row; block: a multiple of 32 threads; shared:
            /// `BLOCK_SUM_BYTES`.
            RmsNorm(out: *mut f32, x: *const f32, w: *const f32, n: u32, eps: f32)
                => norm::rms_norm { rms_norm }

            /// `gate[i] = silu(gate[i])·up[i]` for `i < n`, with `silu(g) = g / (1 + e^-g)`
            /// (SwiGLU). Grid: `ceil(n / blockDim)` blocks; any block size; no shared memory.
            SiluMul(gate: *mut f32, up: *const f32, n: u32) => elementwise::silu_mul { silu_mul }

            /// `x[i] += y[i]` for `i < n`, the residual connection. Grid: `ceil(n / blockDim)`
            /// blocks; any block size; no shared memory.
            Add(x: *mut f32, y: *const f32, n: u32) => elementwise::add { add }

            // RoPE, the KV cache and attention (rope.rs, attention.rs). The position `pos[0]`
            // is read on the device, so that a captured CUDA graph replays for any position;
            // a position past the cache or the table traps.

            /// NeoX RoPE in place on `x = [rows, n_heads·2·half]`, row `t` at position
            /// `pos[0] + t`, the angles from `table = [max_pos, half, 2]` (cos, sin). Grid:
            /// `ceil(rows·n_heads·half / blockDim)` blocks, a thread per rotated pair; no
            /// shared memory.
            RopeNeox(
                x: *mut f32,
                pos: *const u32,
                table: *const f32,
                rows: u32,
                n_heads: u32,
                half: u32,
                max_pos: u32,
            ) => rope::rope_neox { rope_neox }

            /// Copies `k, v = [rows, kv_dim]` into rows `pos[0]..pos[0] + rows` of `k_cache,
            /// v_cache = [max_pos, kv_dim]`. Grid: `ceil(rows·kv_dim / blockDim)` blocks; no
            /// shared memory.
            KvAppend(
                k_cache: *mut f32,
                v_cache: *mut f32,
                k: *const f32,
                v: *const f32,
                pos: *const u32,
                rows: u32,
                kv_dim: u32,
                max_pos: u32,
            ) => attention::kv_append { kv_append }

            /// Split-K attention of one query row `q = [n_heads·head_dim]` at position `pos[0]`
            /// over keys `0..=pos[0]` of the caches `[max_pos, n_kv·head_dim]`, added into
            /// `sums = [n_heads·head_dim + n_heads]` f64 (zero before), unnormalised: per head
            /// its output and its softmax's sum, on a reference score all slices share.
            /// `scale` = 1/sqrt(head_dim). Keyed by the padded head dim: 128 serves any
            /// head_dim up to `attention::MAX_HEAD_DIM`; 64 head_dim 64 with `sums`, `q` and
            /// the caches 16-byte aligned (traps on another head_dim). Grid: `(n_kv·ceil(group
            /// / 8), attention::DECODE_SPLITS)` with `group = n_heads / n_kv`; block:
            /// `attention::THREADS`; shared: `attention::DECODE_SHARED_BYTES`. May overlap the
            /// kernel before it, which must not write `pos` or the cache rows before `pos[0]`.
            AttentionDecode(
                sums: *mut f64,
                q: *const f32,
                k_cache: *const f32,
                v_cache: *const f32,
                pos: *const u32,
                n_heads: u32,
                n_kv: u32,
                head_dim: u32,
                max_pos: u32,
                scale: f32,
            ) => attention::attention_decode {
                attention_decode = 128,
                attention_decode_hd64 = 64,
            }

            /// Causal attention of `rows` query rows `q = [rows, n_heads·head_dim]`, row `t` at
            /// position `pos[0] + t` over keys `0..=pos[0] + t` of the caches, into `out` (the
            /// shape of q), on tensor cores at f32 precision. `scale` = 1/sqrt(head_dim),
            /// head_dim up to `attention::MAX_HEAD_DIM`. Grid: `(ceil(rows /
            /// attention::PREFILL_ROWS), n_heads)`; block: `attention::THREADS`; shared:
            /// `attention::PREFILL_SHARED_BYTES`.
            AttentionPrefill(
                out: *mut f32,
                q: *const f32,
                k_cache: *const f32,
                v_cache: *const f32,
                pos: *const u32,
                rows: u32,
                n_heads: u32,
                n_kv: u32,
                head_dim: u32,
                max_pos: u32,
                scale: f32,
            ) => attention::attention_prefill { attention_prefill }

            // Products with a weight matrix `w = [n_out, n_in]` (matmul.rs): plain floats
            // aligned to their size, or packed quantized chunks 16-byte aligned (`orcd::pack`).
            // Built once per weight type, keyed by its ggml id.

            /// `y[o] = w[o, :]·x + bias[o]` for one token; `bias` may be null. `split` warps
            /// per unit of two rows, `32·split >= ceil(n_in / 32)`. Grid: any number of blocks
            /// (they stride over the units); block: a multiple of `32·split` threads; shared:
            /// `gemv::shared_bytes(threads, 0)`.
            Gemv(
                y: *mut f32,
                x: *const f32,
                w: *const u8,
                bias: *const f32,
                n_in: u32,
                n_out: u32,
                split: u32,
            ) => matmul::gemv {
                gemv_f32 = $crate::ggml::F32,
                gemv_f16 = $crate::ggml::F16,
                gemv_bf16 = $crate::ggml::BF16,
                gemv_q4_0 = $crate::ggml::Q4_0,
                gemv_q5_0 = $crate::ggml::Q5_0,
                gemv_q8_0 = $crate::ggml::Q8_0,
                gemv_q4_k = $crate::ggml::Q4_K,
                gemv_q5_k = $crate::ggml::Q5_K,
                gemv_q6_k = $crate::ggml::Q6_K,
            }

            /// `y[t, o] = x[t, :]·w[o, :] + bias[o]` for `rows` tokens; `bias` may be null.
            /// Grid: `ceil(rows / gemm::TILE_M)·ceil(n_out / gemm::TILE_N)` blocks; block:
            /// `gemm::GROUP·(1 + T)` threads for `T` producer teams, 0 (the f32 loop alone) to
            /// `gemm::MAX_TEAMS`; shared: `gemm::shared_bytes(T)`.
            Gemm(
                y: *mut f32,
                x: *const f32,
                w: *const u8,
                bias: *const f32,
                rows: u32,
                n_in: u32,
                n_out: u32,
            ) => matmul::gemm {
                gemm_f32 = $crate::ggml::F32,
                gemm_f16 = $crate::ggml::F16,
                gemm_bf16 = $crate::ggml::BF16,
                gemm_q4_0 = $crate::ggml::Q4_0,
                gemm_q5_0 = $crate::ggml::Q5_0,
                gemm_q8_0 = $crate::ggml::Q8_0,
                gemm_q4_k = $crate::ggml::Q4_K,
                gemm_q5_k = $crate::ggml::Q5_K,
                gemm_q6_k = $crate::ggml::Q6_K,
            }

            // Weight conversions and the embedding gather (quant.rs); `ty` a ggml type id.

            /// `out[i]` = the high byte of the f16 `w[i]` for `i < n`: the plane greedy
            /// decoding's first pass reads of an f16 vocabulary projection. Grid: any (blocks
            /// stride over the elements); block: any size; no shared memory.
            HighBytes(out: *mut u8, w: *const u16, n: u32) => quant::high_bytes { high_bytes }

            /// `out[t, :]` = row `tokens[first + t]` of the `[n_rows, hidden]` table of type
            /// `ty` dequantized, `first` = `pos[0]`, or 0 when `pos` is null. A token id `>=
            /// n_rows` gives a row of NaN; `first + t >= n_ids` traps. May overlap the kernel
            /// before it. Grid: one block per token; block: any size; no shared memory.
            Embed(
                out: *mut f32,
                table: *const u8,
                ty: u32,
                tokens: *const u32,
                pos: *const u32,
                n_ids: u32,
                n_rows: u32,
                hidden: u32,
            ) => quant::embed { embed }

            /// `out = f16(w)`, the `[rows, n_in]` matrix of type `ty` dequantized and rounded
            /// to nearest f16, row-major; `n_in % 8 == 0`, `out` 16-byte aligned. Grid: any
            /// (blocks stride over the groups of 8 weights); block: any size; no shared memory.
            DequantizeF16(out: *mut u32, w: *const u8, ty: u32, rows: u32, n_in: u32)
                => quant::dequantize_f16 { dequantize_f16 }

            // Token choice (sampling.rs).

            /// `out[0]` = the index of the largest of `x[..n]`; the first wins on ties, NaN
            /// never (all NaN: `u32::MAX`). Grid: one block; block: a multiple of 32 threads,
            /// at most 1024; shared: `sampling::ARGMAX_SHARED_BYTES`.
            Argmax(out: *mut u32, x: *const f32, n: u32) => sampling::argmax { argmax }

            /// The sampler's first kernel: block `b` applies the repetition penalty (in place)
            /// to logits `[b·slice, (b + 1)·slice)` below `n` and writes their top `k` (value,
            /// id) to `cand_v`/`cand_i[b·cap..][..cap]`, NaN and `u32::MAX` in the slots left
            /// over. The tokens so far are `tokens[..n_tokens]`, or `tokens[..=pos[0]]` when
            /// `pos` is not null; the penalty's window the last `last_n`. Grid: `ceil(n /
            /// slice)` blocks or more; block: a power of two from 64 to 1024 threads; shared: 4
            /// bytes × max(`sampling::CANDIDATES_SHARED_WORDS`, ceil(slice / 32)).
            SampleCandidates(
                cand_v: *mut f32,
                cand_i: *mut u32,
                cap: u32,
                logits: *mut f32,
                n: u32,
                slice: u32,
                tokens: *const u32,
                n_tokens: u32,
                pos: *const u32,
                last_n: u32,
                penalty: f32,
                k: u32,
            ) => sampling::sample_candidates { sample_candidates }

            /// The sampler's second kernel: the next token into `out[0]`, from the `slots`
            /// candidates of `SampleCandidates` for the same `k`, by the draw `uniform(seed,
            /// step)`; `temperature` 0 is greedy (`k` 1). Grid: one block; block: a power of
            /// two from 64 to 1024 threads; shared: 4 bytes × `sampling::SAMPLE_SHARED_WORDS`.
            Sample(
                out: *mut u32,
                cand_v: *const f32,
                cand_i: *const u32,
                slots: u32,
                k: u32,
                temperature: f32,
                top_p: f32,
                min_p: f32,
                seed: u64,
                step: u64,
            ) => sampling::sample { sample }

            /// `Sample` for a decode step with every per-step value in device memory: the
            /// draw is `uniform(seed, step[0])`; the token goes to `out[0]` and to
            /// `tokens[pos[0] + 1]` (below `n_tokens`), then `pos[0]` and `step[0]` advance.
            /// `pos[0] >= n_tokens` traps. Grid, block and shared memory as `Sample`'s.
            SampleDev(
                out: *mut u32,
                cand_v: *const f32,
                cand_i: *const u32,
                slots: u32,
                k: u32,
                tokens: *mut u32,
                n_tokens: u32,
                pos: *mut u32,
                step: *mut u64,
                temperature: f32,
                top_p: f32,
                min_p: f32,
                seed: u64,
            ) => sampling::sample_dev { sample_dev }

            // The fused kernels of a decode step (decode.rs), each one pass over its weights
            // through the GEMV, its vectors (`x`, `norm`) 16-byte aligned and rows whole
            // chunks of 32, at most `32·split` chunks. Built once per weight family, keyed by
            // its id (`family`), the type ids `ty*` among the family's. Each may overlap the
            // kernel before it (it reads only weights before it waits). Shared:
            // `gemv::shared_bytes(threads, n_in)` where it stages its vector (an RMSNorm
            // before the GEMV), else `gemv::shared_bytes(threads, 0)`.

            /// `xn = rms_norm(x)·norm`, `q = rope(wq·xn + bq)`, and into row `pos[0]` of the
            /// caches `k = rope(wk·xn + bk)`, `v = wv·xn + bv` (biases may be null), RoPE from
            /// `rope = [positions, head_dim/2, 2]`; traps when `pos[0] >= max_pos`. Zeroes
            /// `sums` (`n_heads·(head_dim + 1)` f64) for `AttentionDecode`. Units are the rows
            /// `i`, `i + head_dim/2` of a head. Grid: `q_blocks + 2·kv_blocks` (q, then k, then
            /// v); block: a multiple of `32·split` threads; staged.
            AttnQkv(
                q: *mut f32,
                k_cache: *mut f32,
                v_cache: *mut f32,
                x: *const f32,
                norm: *const f32,
                eps: f32,
                wq: *const u8,
                ty_q: u32,
                bq: *const f32,
                wk: *const u8,
                ty_k: u32,
                bk: *const f32,
                wv: *const u8,
                ty_v: u32,
                bv: *const f32,
                pos: *const u32,
                rope: *const f32,
                n_in: u32,
                n_heads: u32,
                n_kv: u32,
                head_dim: u32,
                max_pos: u32,
                q_blocks: u32,
                kv_blocks: u32,
                split: u32,
                sums: *mut f64,
            ) => decode::attn_qkv {
                attn_qkv_legacy = $crate::family::LEGACY,
                attn_qkv_kquant = $crate::family::KQUANT,
                attn_qkv_f32 = $crate::family::F32,
                attn_qkv_f16 = $crate::family::F16,
                attn_qkv_bf16 = $crate::family::BF16,
                // q, k and v of both packed families in one layer.
                attn_qkv_packed = $crate::family::PACKED,
            }

            /// `h[r] = silu(w_gate[r]·xn)·(w_up[r]·xn)` for `r < n_out`, `xn = rms_norm(x)·norm`;
            /// gate and up of the one type `ty`. Grid: any number of blocks (they stride over
            /// the rows); block: a multiple of `32·split` threads; staged.
            FfnGateUp(
                h: *mut f32,
                x: *const f32,
                norm: *const f32,
                eps: f32,
                w_gate: *const u8,
                w_up: *const u8,
                ty: u32,
                n_in: u32,
                n_out: u32,
                split: u32,
            ) => decode::ffn_gate_up {
                ffn_gate_up_legacy = $crate::family::LEGACY,
                ffn_gate_up_kquant = $crate::family::KQUANT,
                ffn_gate_up_f32 = $crate::family::F32,
                ffn_gate_up_f16 = $crate::family::F16,
                ffn_gate_up_bf16 = $crate::family::BF16,
            }

            /// `y[r] += w[r]·v + bias[r]` for `r < n_out` (`bias` may be null), in place on
            /// the residual stream: the FFN down projection. Grid: a block for every
            /// `blockDim / 32 / split` units of two rows, each one round; block: a multiple of
            /// `32·split` threads; staged for packed weights.
            GemvResidual(
                y: *mut f32,
                v: *const f32,
                w: *const u8,
                ty: u32,
                bias: *const f32,
                n_in: u32,
                n_out: u32,
                split: u32,
            ) => decode::gemv_residual {
                gemv_residual_legacy = $crate::family::LEGACY,
                gemv_residual_kquant = $crate::family::KQUANT,
                gemv_residual_f32 = $crate::family::F32,
                gemv_residual_f16 = $crate::family::F16,
                gemv_residual_bf16 = $crate::family::BF16,
            }

            /// `y[r] += w[r]·v` for `r < n_out`, `v` the `AttentionDecode` sums (`n_in =
            /// n_heads·head_dim`, `head_dim % 4 == 0`) normalised as they are staged: the
            /// attention output projection. Grid as `GemvResidual`'s; staged.
            AttnOutput(
                y: *mut f32,
                sums: *const f64,
                head_dim: u32,
                w: *const u8,
                ty: u32,
                n_in: u32,
                n_out: u32,
                split: u32,
            ) => decode::attn_output {
                attn_output_legacy = $crate::family::LEGACY,
                attn_output_kquant = $crate::family::KQUANT,
                attn_output_f32 = $crate::family::F32,
                attn_output_f16 = $crate::family::F16,
                attn_output_bf16 = $crate::family::BF16,
            }

            /// `logits[r] = w[r]·xn` for `r < n_out`, `xn = rms_norm(x)·norm`. With `best` not
            /// null, also `best[0]` = their arg-max (first index on ties, NaN never), through
            /// `scratch` (2 u64, zero before, zero after); with `tokens` not null too, ends the
            /// greedy decode step as `SampleDev` ends a sampled one (`n_tokens`, `pos`,
            /// `step`). Grid: any number of blocks (they stride over the units of two rows);
            /// block: a multiple of `32·split` threads, at most 32 warps; staged.
            Logits(
                logits: *mut f32,
                x: *const f32,
                norm: *const f32,
                eps: f32,
                w: *const u8,
                ty: u32,
                n_in: u32,
                n_out: u32,
                split: u32,
                best: *mut u32,
                scratch: *mut u64,
                tokens: *mut u32,
                n_tokens: u32,
                pos: *mut u32,
                step: *mut u64,
            ) => decode::logits {
                logits_legacy = $crate::family::LEGACY,
                logits_kquant = $crate::family::KQUANT,
                logits_f32 = $crate::family::F32,
                logits_f16 = $crate::family::F16,
                logits_bf16 = $crate::family::BF16,
            }

            /// Greedy decoding's first pass over a vocabulary projection (`n_in` <= 1024): for
            /// every row an upper bound `upper[r]` of its logit as `Logits` computes it, and
            /// per block `lower[block]` the key of the largest lower bound, both from the top
            /// bits of the weights (q8_0: the quants' high nibbles; f16: the high bytes in
            /// `plane`, from `HighBytes`; null for q8_0). Keyed by the ggml type. Grid: any
            /// number of blocks (they stride over units of four rows, a warp each), `lower`
            /// a word per block; block: a multiple of 32 threads, at most 32 warps; staged.
            LogitBounds(
                upper: *mut f32,
                lower: *mut u32,
                x: *const f32,
                norm: *const f32,
                eps: f32,
                w: *const u8,
                plane: *const u8,
                n_in: u32,
                n_out: u32,
            ) => decode::logit_bounds {
                logit_bounds_q8_0 = $crate::ggml::Q8_0,
                logit_bounds_f16 = $crate::ggml::F16,
            }

            /// Greedy decoding's second pass: `best[0]` = the arg-max of the logits of
            /// `Logits` (the same value for every row it computes), computing only the rows
            /// whose `upper` bound reaches the largest of the `n_lower` lower bounds of the
            /// `LogitBounds` launch just before; ends the step as `Logits` does. Keyed by the
            /// ggml type. Grid: any; block: a multiple of 32 threads, at most 32 warps;
            /// shared: staged, then `1 + ceil(n_out / grid)` words (a block's list of rows).
            ArgmaxBounded(
                best: *mut u32,
                scratch: *mut u64,
                upper: *const f32,
                lower: *const u32,
                n_lower: u32,
                x: *const f32,
                norm: *const f32,
                eps: f32,
                w: *const u8,
                n_in: u32,
                n_out: u32,
                tokens: *mut u32,
                n_tokens: u32,
                pos: *mut u32,
                step: *mut u64,
            ) => decode::argmax_bounded {
                argmax_bounded_q8_0 = $crate::ggml::Q8_0,
                argmax_bounded_f16 = $crate::ggml::F16,
            }

            // Batched steps (gemm_rows.rs, paged.rs, sample_rows.rs).

            /// `y[t, o] = x[t, :]·w[o, :] + bias[o]` for `rows` rows, each row's result the
            /// same whatever the other rows (row independence); `bias` may be null. `n_in % 32
            /// == 0`, `x` 16-byte aligned, `w` plain floats 16-byte aligned or packed (`pack`).
            /// K in `kb` parts (a function of the shape alone): with `kb > 1` each block leaves
            /// its part's sums in `part = [kb, tiles, 16·mt, 16·nw]` and the last block of a
            /// tile adds them in order, counted in `counts` (one word per tile, zero before and
            /// after).
            /// `mt` m16 tiles of rows a block (1, 2, 4 or 8). Keyed by the ggml type. Grid:
            /// `ceil(rows / (16·mt))·ceil(n_out / (16·nw))·kb` blocks; block: `32·nw` threads;
            /// shared: `gemm_rows::shared_bytes(mt)`. May overlap the kernel before.
            GemmRows(
                y: *mut f32,
                x: *const f32,
                w: *const u8,
                bias: *const f32,
                part: *mut f32,
                counts: *mut u32,
                rows: u32,
                n_in: u32,
                n_out: u32,
                kb: u32,
                mt: u32,
            ) => gemm_rows::gemm_rows {
                gemm_rows_f32 = $crate::ggml::F32,
                gemm_rows_f16 = $crate::ggml::F16,
                gemm_rows_bf16 = $crate::ggml::BF16,
                gemm_rows_q4_0 = $crate::ggml::Q4_0,
                gemm_rows_q5_0 = $crate::ggml::Q5_0,
                gemm_rows_q8_0 = $crate::ggml::Q8_0,
                gemm_rows_q4_k = $crate::ggml::Q4_K,
                gemm_rows_q5_k = $crate::ggml::Q5_K,
                gemm_rows_q6_k = $crate::ggml::Q6_K,
            }

            /// Per row `r`: NeoX RoPE at position `positions[r]` on q's `n_heads` heads (in
            /// place) and k's `n_kv` heads, then k (rotated) and v stored as f16 in row
            /// `slots[r]` of `k_cache, v_cache = [slots, n_kv·2·half]`; angles from `table =
            /// [max_pos, half, 2]`, a position outside it traps. Grid: one block per row;
            /// block: a multiple of 32 threads; no shared memory.
            RopeKvPaged(
                q: *mut f32,
                k: *const f32,
                v: *const f32,
                k_cache: *mut u16,
                v_cache: *mut u16,
                positions: *const u32,
                slots: *const u32,
                table: *const f32,
                n_heads: u32,
                n_kv: u32,
                half: u32,
                max_pos: u32,
            ) => paged::rope_kv_paged { rope_kv_paged }

            /// Causal GQA attention over a paged f16 KV cache for rows of many sequences:
            /// item `w` (grid x) is `items[4w..4w + 4] = (first row, rows, position of the first
            /// row, offset of its block table in tables)`, at most `paged::ITEM_ROWS` rows of
            /// one sequence; key `j` is cache row `tables[offset + j / block_tokens]·
            /// block_tokens + j % block_tokens`; kv head from grid y; grid z splits the keys.
            /// `part` holds `paged::partial_floats(hd)` floats per (row of q, query head,
            /// split); `counts` one word per (item, kv head), zero before the first launch
            /// (each launch leaves it zero). Grid: (items, n_kv, `paged::SPLITS`); block:
            /// `paged::WARPS` warps; shared: `paged::attention_shared_bytes(hd, group)`. `hd` a
            /// multiple of 32, at most 128.
            PagedAttention(
                out: *mut f32,
                q: *const f32,
                k_cache: *const u16,
                v_cache: *const u16,
                items: *const u32,
                tables: *const u32,
                part: *mut f32,
                counts: *mut u32,
                n_heads: u32,
                n_kv: u32,
                hd: u32,
                block_tokens: u32,
                scale: f32,
            ) => paged::paged_attention { paged_attention }

            /// `out[r] = x[rows[r]]` for rows of `n` floats. Grid: one block per output row;
            /// any block size; no shared memory.
            GatherRows(out: *mut f32, x: *const f32, rows: *const u32, n: u32)
                => paged::gather_rows { gather_rows }

            /// Positions `first + b` (`b` the block) of one sequence between the contiguous
            /// caches `k, v = [max_pos, kv_dim]` (f32) and the paged ones `k_paged, v_paged =
            /// [slots, kv_dim]` (f16), position `p` in cache row `table[p / block_tokens]·
            /// block_tokens + p % block_tokens`: `kv_from_paged` widens the paged rows into
            /// the contiguous ones, `kv_to_paged` rounds the contiguous rows to nearest into
            /// the paged ones (as `rope_kv_paged` stores). Grid: one block per position; any
            /// block size; no shared memory.
            KvCopyPaged(
                k: *mut f32,
                v: *mut f32,
                k_paged: *mut u16,
                v_paged: *mut u16,
                table: *const u32,
                first: u32,
                kv_dim: u32,
                block_tokens: u32,
            ) => paged::kv_copy_paged {
                kv_from_paged = $crate::paged::FROM_PAGED,
                kv_to_paged = $crate::paged::TO_PAGED,
            }

            /// Per row `r` of `logits = [rows, n]`: its penalties `pen_*[first..first + count]`
            /// applied in place, then the next token into `out[r]` as `sampling::sample`
            /// picks it with the row's `params[sampling::ROW_PARAM_WORDS·r..]`. A greedy row
            /// (temperature 0 or top-k 1) is split over grid y's blocks, which meet in
            /// `scratch[2r..2r + 2]` (zero before the first launch; each launch leaves it
            /// zero); a sampled row takes block 0 alone. Grid: (rows, slices); block: a power
            /// of two from 64 to 512 threads; shared: 4 bytes ×
            /// `sampling::SAMPLE_ROWS_SHARED_WORDS`.
            SampleRows(
                out: *mut u32,
                logits: *mut f32,
                n: u32,
                params: *const u32,
                pen_ids: *const u32,
                pen_scale: *const f32,
                pen_sub: *const f32,
                scratch: *mut u64,
            ) => sample_rows::sample_rows { sample_rows }
        }
    };
}
