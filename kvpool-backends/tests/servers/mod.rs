//! Test-side helpers over the one server harness (`kvpool-testservers`): the servers' addresses
//! `cargo xtask matrix` passes, and panicking shorthands for tests.
#![allow(dead_code, unused_imports)]

use std::process::Command;
use std::time::Duration;

pub use kvpool_testservers::{MooncakeCluster, RedisCluster, Server, TmpfsMount};

/// The value of `var` (a server's address or a server binary), set by `cargo xtask matrix`.
/// The tests that need one are `#[ignore]`d, so a plain `cargo test` reports them ignored
/// instead of passing them untested; run without their server, they fail.
pub fn server_url(var: &str) -> String {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{var} is not set: this test needs its server; `cargo xtask matrix` starts the \
             servers and runs the tests that need one (they are ignored otherwise)"
        ),
    }
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    kvpool_testservers::free_port().unwrap()
}

/// `redis-server` (`binary`) on `port`, persistence off.
pub fn redis(binary: &str, port: u16) -> Server {
    let args = kvpool_testservers::redis_args(port, &[]);
    Server::start(
        "redis-server",
        Command::new(binary).args(&args),
        port,
        None,
        Duration::from_secs(10),
    )
    .unwrap()
}

/// `moto_server` (`binary`) on `port`, with `bucket` created.
pub fn moto(binary: &str, port: u16, bucket: &str) -> Server {
    let server = kvpool_testservers::start_moto(binary, port, None).unwrap();
    kvpool_testservers::create_bucket(port, bucket).unwrap();
    server
}

/// A tmpfs of `size` (e.g. "8m"). Mounting one needs root: the tests that fill one are
/// `#[ignore]`d, run by `cargo xtask matrix` (as root), and fail where it cannot mount.
pub fn tmpfs(size: &str) -> TmpfsMount {
    TmpfsMount::new(size)
        .unwrap_or_else(|why| panic!("cannot mount a {size} tmpfs to fill (needs root): {why}"))
}
