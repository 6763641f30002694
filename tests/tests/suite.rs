//! orcd's end-to-end tests, one module per area, built as one executable. GPU tests print
//! `skipped: no CUDA device` without a GPU and fail under `REQUIRE_GPU=1`.
mod batch;
mod batch_gpu;
mod cpu_reference;
mod cuda_model;
mod gguf_validation;
mod kernels;
mod models;
mod quant_real;
mod shapes;
mod tokenizer;
