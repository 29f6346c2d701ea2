//! moto, an S3-compatible server from PyPI, on 127.0.0.1, and bucket creation.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::Server;

/// Starts `moto_server` (the binary at `binary`) on `port`.
pub fn start_moto(binary: &str, port: u16, log: Option<&Path>) -> Result<Server, String> {
    Server::start(
        "moto (S3)",
        Command::new(binary).args(["-H", "127.0.0.1", "-p", &port.to_string()]),
        port,
        log,
        Duration::from_secs(30),
    )
}

/// Creates `bucket` on the S3-compatible server at 127.0.0.1:`port` with a plain (unsigned)
/// HTTP PUT, retrying for up to 30 s while the server finishes starting.
pub fn create_bucket(port: u16, bucket: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = (|| -> std::io::Result<String> {
            let mut s = TcpStream::connect(("127.0.0.1", port))?;
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
                return Ok(());
            }
            other if Instant::now() > deadline => {
                let why = match other {
                    Ok(reply) => reply.lines().next().unwrap_or("").to_string(),
                    Err(e) => e.to_string(),
                };
                return Err(format!("cannot create bucket {bucket}: {why}"));
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
