//! A small tmpfs for one test or soak (root only), unmounted on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A tmpfs mounted at `path`, unmounted (and its directory removed) on drop.
pub struct TmpfsMount {
    /// Where it is mounted.
    pub path: PathBuf,
}

impl TmpfsMount {
    /// Mounts a tmpfs of `size` (e.g. `"8m"`) at a fresh directory under the temp dir.
    pub fn new(size: &str) -> Result<Self, String> {
        let path = std::env::temp_dir().join(format!(
            "kvpool-tmpfs-{}-{}",
            std::process::id(),
            crate::free_port()?
        ));
        Self::at(&path, size)
    }

    /// Mounts a tmpfs of `size` at `path` (created if missing). Fails where mounting is not
    /// permitted (it needs root), with `mount`'s reason.
    pub fn at(path: &Path, size: &str) -> Result<Self, String> {
        std::fs::create_dir_all(path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output();
        match out {
            Ok(o) if o.status.success() => Ok(TmpfsMount {
                path: path.to_path_buf(),
            }),
            other => {
                let _ = std::fs::remove_dir(path);
                Err(match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    Err(e) => format!("cannot run mount: {e}"),
                })
            }
        }
    }
}

impl Drop for TmpfsMount {
    /// Unmounts, retrying while the mount is briefly busy, then detaching it lazily (it is
    /// freed when its last user goes) so no mount outlives its owner.
    fn drop(&mut self) {
        let unmounted = (0..20).any(|_| {
            let ok = Command::new("umount")
                .arg(&self.path)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                std::thread::sleep(Duration::from_millis(50));
            }
            ok
        });
        if !unmounted {
            eprintln!("tmpfs {} busy; detaching it lazily", self.path.display());
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}
