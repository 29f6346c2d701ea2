//! kvpool-sim: engine simulators that drive kvpool's vLLM connector (both roles) end to end
//! and compare every KV row they end up with against recomputation.
//!
//! | file | owns |
//! |---|---|
//! | [`vllm_shaped`] | `kvpool sim`: vLLM 0.32's scheduling (several requests a step, incremental block ids, shared prefix blocks, preemption, reused ids, injected load failures) over a pool from `build_pool` |
//! | [`kv_model`] | the deterministic KV model (`model_compute`, `model_mismatches`) the protocol tests check rows against |
//! | [`soak`] | what a chaos soak measures besides wrong rows: RSS after warm-up and at the end, and writes acknowledged after the faults stop read back from every lower tier |
//! | [`engine_side`] | the engine side of the connector for simulators and tests: a worker rank running its copy jobs against a host KV cache in vLLM's order, the ranks' output aggregation, in-process lookups across ranks |

#![warn(missing_docs)]

pub mod engine_side;
pub mod kv_model;
pub mod soak;
pub mod vllm_shaped;
