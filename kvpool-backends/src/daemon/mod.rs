//! The node-wide pool daemon (`kvpool serve`): one shared-memory pool per node over the lower
//! tiers, which every engine process on the node attaches to as a `kvpool+unix://` tier.
//!
//! - `protocol.rs`: the requests and replies on the Unix socket;
//! - `store.rs`: the values in shared memory, with per-session pins and allocations;
//! - `server.rs`: the daemon (store and lower tiers) and its socket;
//! - `client.rs`: the engine's `kvpool+unix://` tier.
//!
//! Engines store values already encoded in the chunk format (checksummed, bound to their
//! key), so the daemon keeps opaque bytes and every check the engine makes on a lower tier's
//! value holds for the daemon's. docs/design/pool-daemon.md has the design.

mod client;
mod protocol;
mod server;
mod store;

pub use client::{
    DaemonConnector, DaemonFactory, RECONNECT_INTERVAL, SCHEMES, SESSIONS_PER_CONNECTOR,
    socket_path,
};
pub use protocol::{DaemonStats, PROTOCOL_VERSION, Region, Reply, Request};
pub use server::{
    ATTACH_TIMEOUT, DEFAULT_LEASE_TTL, DaemonOptions, DaemonServer, MAX_ITEMS_PER_REQUEST,
    MAX_REQUEST_BYTES, PoolDaemon, SocketAccess,
};
pub use store::{SessionId, SharedStore};

#[cfg(test)]
mod tests;
