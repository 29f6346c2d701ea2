//! The one harness that starts real servers for kvpool's tests, the backend matrix, the soak and
//! the benchmarks: every server binds 127.0.0.1 on a free port, writes its log where asked, and
//! is killed by PID when its handle drops. Standard library only, so both `xtask` and the test
//! crates can depend on it without building anything else.
//!
//! | file | starts |
//! |---|---|
//! | `process.rs` | any server process ([`Server`]), [`free_port`], [`wait_for_port`] |
//! | `redis.rs` | `redis-server` standalone or with TLS ([`redis_args`], [`self_signed_cert`]), a 3-node [`RedisCluster`] |
//! | `s3.rs` | moto, an S3-compatible server ([`start_moto`]), and its buckets ([`create_bucket`]) |
//! | `mooncake.rs` | a Mooncake Store: `mooncake_master` and a segment holder ([`MooncakeCluster`]) |
//! | `tmpfs.rs` | a small tmpfs to fill up ([`TmpfsMount`], root only) |
//!
//! Errors are `String`s that say what failed and where its log is.

#![warn(missing_docs)]

mod mooncake;
mod process;
mod redis;
mod s3;
mod tmpfs;

pub use mooncake::MooncakeCluster;
pub use process::{Server, free_port, wait_for_port};
pub use redis::{RedisCluster, redis_args, redis_cli, self_signed_cert};
pub use s3::{create_bucket, start_moto};
pub use tmpfs::TmpfsMount;
