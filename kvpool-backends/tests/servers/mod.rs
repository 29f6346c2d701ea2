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

/// A moto_server child process (an S3-compatible server), killed (by PID) on drop.
pub struct MotoProcess {
    pub port: u16,
    child: Child,
}

impl MotoProcess {
    /// Starts `binary` on 127.0.0.1:`port` and creates `bucket`.
    pub fn start(binary: &str, port: u16, bucket: &str) -> Self {
        let child = Command::new(binary)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server starts");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        create_bucket(port, bucket);
        MotoProcess { port, child }
    }

    /// Kills the server and waits for it to exit.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MotoProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates a bucket on a local S3-compatible server with a plain (unsigned) HTTP PUT.
pub fn create_bucket(port: u16, bucket: &str) {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = (|| -> std::io::Result<String> {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            write!(
                s,
                "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )?;
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            Ok(reply)
        })();
        match attempt {
            Ok(reply) if reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.0 200") => {
                return;
            }
            other => assert!(
                Instant::now() < deadline,
                "cannot create bucket {bucket}: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
