//! The node daemon's tenants (`[[tenant]]`, read by `kvpool serve` only): each its own socket,
//! its own shared arena and its own namespace in the lower tiers. A tenant is one trust
//! domain: engines of one tenant share its memory and keys; engines of two tenants share
//! nothing through the daemon.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::byte_size::ByteSize;
use crate::error::ConfigError;

/// One tenant of `kvpool serve`.
///
/// ```
/// let cfg: kvpool_core::PoolConfig = toml::from_str(r#"
///     [[tenant]]
///     name = "team-a"
///     socket = "/run/kvpool/team-a.sock"
///     group = "team-a"
///     memory = "16GiB"
/// "#).unwrap();
/// assert_eq!(cfg.tenants[0].memory.0, 16 << 30);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's name: 1-64 of `a-z`, `0-9`, `-`, `_`. Its values live under
    /// `tenant/<name>/` in the lower tiers.
    pub name: String,
    /// The Unix socket its engines attach to (their `pool = "unix://<socket>"`).
    pub socket: PathBuf,
    /// The group whose members may attach (the socket is then 0660, owned by it); without,
    /// only the daemon's user may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The tenant's shared arena: its memory budget on the node, allocated at start.
    pub memory: ByteSize,
    /// A file holding the tenant's secret (at least 16 bytes; 32 random bytes are usual):
    /// every value the daemon writes to a lower tier for this tenant then carries an
    /// HMAC-SHA256 under it, checked before the value is used, so a value anyone without the
    /// secret put in a shared tier (another node, another program) is a miss. Without, values
    /// carry kvpool's checksum only, which detects damage but not forgery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_key_file: Option<PathBuf>,
}

impl TenantConfig {
    /// The prefix of the tenant's keys in the lower tiers.
    pub fn namespace(&self) -> String {
        format!("tenant/{}/", self.name)
    }
}

/// The shortest secret a `mac_key_file` may hold.
pub const MIN_MAC_KEY_BYTES: usize = 16;

impl TenantConfig {
    /// Reads the tenant's secret (`None` without a `mac_key_file`); refuses one shorter than
    /// [`MIN_MAC_KEY_BYTES`].
    pub fn mac_key(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        let Some(path) = &self.mac_key_file else {
            return Ok(None);
        };
        let key = std::fs::read(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        if key.len() < MIN_MAC_KEY_BYTES {
            return Err(ConfigError::Invalid {
                field: "tenant.mac_key_file",
                reason: format!(
                    "`{}` holds {} bytes: a secret needs at least {MIN_MAC_KEY_BYTES} \
                     (`head -c 32 /dev/urandom > {}`)",
                    path.display(),
                    key.len(),
                    path.display()
                ),
            });
        }
        Ok(Some(key))
    }
}

/// Checks names (well-formed, unique), sockets (unique) and memory (non-zero).
pub fn validate_tenants(tenants: &[TenantConfig]) -> Result<(), ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        field: "tenant",
        reason,
    };
    for (i, t) in tenants.iter().enumerate() {
        let ok = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !ok {
            return Err(invalid(format!(
                "tenant name `{}`: 1-64 of a-z, 0-9, - and _",
                t.name
            )));
        }
        if t.memory.0 == 0 {
            return Err(invalid(format!("tenant `{}` has no memory", t.name)));
        }
        if !t.socket.is_absolute() {
            return Err(invalid(format!(
                "tenant `{}`: socket `{}` must be an absolute path",
                t.name,
                t.socket.display()
            )));
        }
        for other in &tenants[..i] {
            if other.name == t.name {
                return Err(invalid(format!("two tenants named `{}`", t.name)));
            }
            if other.socket == t.socket {
                return Err(invalid(format!(
                    "tenants `{}` and `{}` share the socket {}",
                    other.name,
                    t.name,
                    t.socket.display()
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str, socket: &str) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            socket: socket.into(),
            group: None,
            memory: ByteSize::gib(1),
            mac_key_file: None,
        }
    }

    #[test]
    fn names_and_sockets_are_checked() {
        validate_tenants(&[tenant("a", "/run/a.sock"), tenant("b-2", "/run/b.sock")]).unwrap();
        for (bad, needle) in [
            (vec![tenant("A", "/run/a.sock")], "a-z"),
            (vec![tenant("a/b", "/run/a.sock")], "a-z"),
            (vec![tenant("", "/run/a.sock")], "a-z"),
            (vec![tenant("a", "run/a.sock")], "absolute"),
            (
                vec![tenant("a", "/run/a.sock"), tenant("a", "/run/b.sock")],
                "two tenants",
            ),
            (
                vec![tenant("a", "/run/a.sock"), tenant("b", "/run/a.sock")],
                "share the socket",
            ),
        ] {
            let err = validate_tenants(&bad).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        let mut empty = tenant("a", "/run/a.sock");
        empty.memory = ByteSize(0);
        assert!(validate_tenants(&[empty]).is_err());
        assert_eq!(tenant("a", "/x").namespace(), "tenant/a/");
    }
}
