//! kvpool-sim: engine simulators that drive kvpool's vLLM connector (both roles) end to end
//! and compare every KV row they end up with against recomputation.
//!
//! | file | owns |
//! |---|---|
//! | [`vllm_shaped`] | `kvpool sim`: vLLM 0.32's scheduling (several requests a step, incremental block ids, shared prefix blocks, preemption, reused ids, injected load failures) over a pool from `build_pool` |
//! | [`kv_model`] | the deterministic KV model (`model_compute`, `model_mismatches`) the protocol tests check rows against |
//! | [`soak`] | what a chaos soak measures besides wrong rows: RSS after warm-up and at the end, and writes acknowledged after the faults stop read back from every lower tier |
//! | [`single_request`] | a one-request-at-a-time harness with a deterministic KV model, used by the protocol regression tests (and the only driver of lazy offload) |

#![warn(missing_docs)]

mod gpu_blocks;
pub mod kv_model;
pub mod single_request;
pub mod soak;
pub mod vllm_shaped;
