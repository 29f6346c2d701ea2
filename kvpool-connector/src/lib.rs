//! kvpool-connector: the engine-facing connector (vLLM KVConnector V1, scheduler and worker sides).
//!
//! Not implemented yet: this crate currently exports nothing. Until it lands, engines embed
//! [`kvpool_core::CacheEngine`] directly, built from a [`kvpool_core::PoolConfig`] with
//! [`kvpool_backends::build_pool`].
