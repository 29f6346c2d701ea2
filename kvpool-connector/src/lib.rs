//! kvpool-connector: kvpool inside inference engines, one folder per integration: vLLM's
//! KVConnector V1 ([`vllm`]: scheduler and worker sides, their metadata, lookups across
//! processes; its engine simulators live in kvpool-sim), a secondary tier of vLLM's native
//! offloading ([`vllm_tier`]) and SGLang's HiCache L3 storage backend ([`sglang`]), the last
//! two handing kvpool fixed-size values ([`opaque_values`]). What they share: extra keys
//! ([`extra_keys`]), checked host addresses ([`address_range`]), spans of host memory
//! ([`host_spans`]) and the engine side of copy jobs on host memory ([`host_blocks`]).
//!
//! The vLLM connector's types are re-exported here, as its Python binding uses them.

#![warn(missing_docs)]

pub mod address_range;
pub mod extra_keys;
pub mod host_blocks;
pub mod host_spans;
pub mod opaque_values;
pub mod sglang;
pub mod vllm;
pub mod vllm_tier;

pub use vllm::{
    BlockUpdate, ConnectorConfig, ConnectorError, ConnectorMetadata, ConnectorOutput,
    ConnectorScheduler, ConnectorWorker, CopyDirection, CopyJob, EngineLookup, EngineRequest,
    HostPlanes, LeaseTable, LeasedChunk, LoadLimits, LoadSpec, LoadTiming, LookupAnswer,
    LookupCounters, LookupServer, MetadataError, PoolLookup, ReqMeta, RequestTrace, RequestTracker,
    SaveDiscard, SaveSpec, ScheduledRequest, SchedulerCounters, SocketLookup, StepReport,
    TransferResults, WorkerInfo, WorkerStats, probe_hash, probe_hash_of,
};
