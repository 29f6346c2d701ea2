//! A server child process on 127.0.0.1, killed by PID on drop; free ports; waiting for a port.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
pub fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

/// Waits until something accepts connections on 127.0.0.1:`port`, for at most `limit`.
pub fn wait_for_port(port: u16, name: &str, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!(
                "{name} did not listen on 127.0.0.1:{port} within {limit:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A running server, stopped (SIGKILL, then reaped) when dropped.
pub struct Server {
    name: String,
    /// The port it listens on (0 when it listens on none the harness knows).
    pub port: u16,
    child: Child,
}

impl Server {
    /// Spawns `command` (stdout and stderr to `log`, else discarded) and waits up to `limit`
    /// for it to listen on `port`. A server that does not come up is killed before the error.
    pub fn start(
        name: &str,
        command: &mut Command,
        port: u16,
        log: Option<&Path>,
        limit: Duration,
    ) -> Result<Server, String> {
        let (out, err) = match log {
            Some(log) => {
                let file = std::fs::File::create(log)
                    .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
                (
                    Stdio::from(file.try_clone().map_err(|e| e.to_string())?),
                    Stdio::from(file),
                )
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let child = command
            .stdout(out)
            .stderr(err)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {name} ({:?}): {e}", command.get_program()))?;
        let server = Server::adopt(name, port, child);
        if port != 0 {
            wait_for_port(port, name, limit).map_err(|e| match log {
                Some(log) => format!("{e} (log: {})", log.display()),
                None => e,
            })?;
        }
        Ok(server)
    }

    /// Takes charge of an already spawned `child` (killed on drop like the others).
    pub fn adopt(name: &str, port: u16, child: Child) -> Server {
        Server {
            name: name.to_string(),
            port,
            child,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name given at start.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Kills the server now and waits for it to exit.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_listens_once_started_and_is_gone_once_dropped() {
        let port = free_port().unwrap();
        let server = Server::start(
            "python http.server",
            Command::new("python3").args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ]),
            port,
            None,
            Duration::from_secs(20),
        )
        .unwrap();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        let pid = server.pid();
        server.kill();
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} still exists after kill"
        );
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    }

    #[test]
    fn a_server_that_never_listens_is_an_error_naming_it() {
        let port = free_port().unwrap();
        let err = Server::start(
            "sleeper",
            Command::new("sleep").arg("30"),
            port,
            None,
            Duration::from_millis(300),
        )
        .err()
        .unwrap();
        assert!(err.contains("sleeper did not listen"), "{err}");
    }
}
