//! Each GPU kernel against its CPU twin in `orcd::cpu`, on random inputs (model sizes and odd
//! sizes) and on the real model's tensors. Every test prints `skipped: no CUDA device` and
//! passes without a GPU, and fails under `REQUIRE_GPU=1`.
mod attention;
mod basic;
mod decode;
mod gemm_rows;
mod matmul;
mod paged;
mod sample_rows;
mod sampling;
