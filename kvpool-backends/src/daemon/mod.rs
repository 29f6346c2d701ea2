//! The node-wide pool daemon (`kvpool serve`): one shared-memory pool per node over the lower
//! tiers, which every engine process on the node attaches to as a `kvpool+unix://` tier.
//!
//! - `protocol.rs`: the requests and replies on the Unix socket;
//! - `store.rs`: the values in shared memory, with per-session pins and allocations;
//! - `pool.rs`: the daemon's pool (the store over the lower tiers), answering requests;
//! - `write_behind.rs`: committed values written to the lower tiers in the background;
//! - `copy_buffers.rs`: the reused buffers those values are copied into out of the arena;
//! - `lower_tiers.rs`: what may cross to and from a lower tier (kvpool keys, checked values);
//! - `server.rs`: the daemon's socket and the engines' sessions;
//! - `client/`: the engine's `kvpool+unix://` tier;
//! - `namespace.rs`: a tenant's view of the lower tiers (its keys under its prefix).
//!
//! Trust: one daemon (one socket, one arena) is one trust domain: every engine that can
//! attach can read and write every value in it. Tenants (`[[tenant]]`) are separate domains:
//! each its own daemon here (socket, arena, write-behind) over the shared lower tiers, its
//! keys under its own prefix there. docs/reliability.md states what an engine can do to
//! another.
//!
//! Engines store values already encoded in the chunk format (checksummed, bound to their
//! key), so the daemon keeps opaque bytes and every check the engine makes on a lower tier's
//! value holds for the daemon's. docs/design/pool-daemon.md has the design.

mod client;
mod copy_buffers;
mod lower_tiers;
mod namespace;
mod pool;
mod protocol;
mod server;
mod store;
mod write_behind;

pub use client::{
    DaemonConnector, DaemonFactory, RECONNECT_INTERVAL, SCHEMES, SESSIONS_PER_CONNECTOR,
    socket_path,
};
pub use namespace::{MAC_BYTES, NamespacedConnector};
pub use pool::{
    ATTACH_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_TENANT, DaemonOptions, MAX_ITEMS_PER_REQUEST,
    MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_IN_FLIGHT, PoolDaemon, default_copy_buffer_bytes,
};
pub use protocol::{
    DaemonStats, MAX_CLIENT_NAME, PRECHECK_BYTES, PROTOCOL_VERSION, Precheck, Region, Reply,
    Request,
};
pub use server::{DaemonServer, SocketAccess};
pub use store::{SessionId, SharedStore};

#[cfg(test)]
mod tests;
