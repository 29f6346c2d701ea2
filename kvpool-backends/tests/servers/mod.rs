//! Test-server plumbing shared by the tests that need a real server.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The value of `var`, or `None` after printing why the test is skipped. Under
/// `cargo xtask matrix` (`KVPOOL_MATRIX=1`) a missing server is a failure, not a skip.
pub fn server_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var("KVPOOL_MATRIX").is_err(),
                "{var} must be set under `cargo xtask matrix`"
            );
            println!(
                "SKIP: {var} is not set; run `cargo xtask matrix` to test against a real server"
            );
            None
        }
    }
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A redis-server child process on 127.0.0.1, killed (by PID) on drop.
pub struct RedisProcess {
    pub port: u16,
    child: Child,
}

impl RedisProcess {
    /// Starts `binary` on `port` with persistence off; waits until it accepts connections.
    pub fn start(binary: &str, port: u16) -> Self {
        let child = Command::new(binary)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        RedisProcess { port, child }
    }

    /// Kills the server and waits for it to exit.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
