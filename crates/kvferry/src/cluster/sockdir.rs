//! A private temporary directory for one leader's Unix socket, unique per leader (process
//! id + a per-process counter + a random part), created `0700`, and removed with
//! everything in it when dropped. A leader killed outright cannot remove it; the next
//! leader started on the machine sweeps such directories (their leader process gone).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::ClusterError;

/// Longest path a Unix socket address can hold (`sun_path` less the NUL).
const MAX_SOCKET_PATH: usize = 107;

const PREFIX: &str = "kvferry-cluster-";
const SOCKET_NAME: &str = "leader.sock";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A per-leader socket directory, removed on drop.
#[derive(Debug)]
pub(crate) struct SocketDir {
    dir: PathBuf,
}

impl SocketDir {
    /// Creates a fresh directory under the system temporary directory (or `/tmp` when
    /// that path would be too long for a socket address).
    pub(crate) fn create() -> Result<SocketDir, ClusterError> {
        let name = format!(
            "{PREFIX}{}-{}-{:016x}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            rand::random::<u64>()
        );
        let mut base = std::env::temp_dir();
        if base.join(&name).join(SOCKET_NAME).as_os_str().len() > MAX_SOCKET_PATH {
            base = PathBuf::from("/tmp");
        }
        sweep_stale(&base);
        let dir = base.join(name);
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| ClusterError::io(format!("cannot create socket directory {}", dir.display()), e))?;
        Ok(SocketDir { dir })
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// The leader's socket path inside it.
    pub(crate) fn socket_path(&self) -> PathBuf {
        self.dir.join(SOCKET_NAME)
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(target: "kvferry::cluster", dir = %self.dir.display(), "cannot remove socket directory: {e}")
            }
        }
    }
}

/// Removes socket directories left behind by leaders that were killed (a killed leader
/// cannot clean up, and its workers die with it). Only directories named like ours whose
/// leader process no longer exists and whose socket accepts no connection are touched;
/// errors are ignored (best effort).
fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let leader_gone = pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists();
        // A leader in another pid namespace sharing this directory may look gone: leave
        // the directory alone while its socket still accepts connections.
        let listening = std::os::unix::net::UnixStream::connect(entry.path().join(SOCKET_NAME)).is_ok();
        if leader_gone && !listening {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_private_and_removed_on_drop() {
        let a = SocketDir::create().unwrap();
        let b = SocketDir::create().unwrap();
        assert_ne!(a.path(), b.path());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(a.socket_path(), b"x").unwrap();
        let p = a.path().to_path_buf();
        drop(a);
        assert!(!p.exists());
        assert!(b.socket_path().as_os_str().len() <= MAX_SOCKET_PATH);
        drop(b);
    }

    #[test]
    fn directories_of_dead_leaders_are_swept() {
        let base = std::env::temp_dir();
        // pid 0 never names a live leader; our own pid is never swept.
        let stale = base.join(format!("{PREFIX}0-7-00000000"));
        let ours = base.join(format!("{PREFIX}{}-999999-00000000", std::process::id()));
        let other = base.join("kvferry-unrelated-0-1");
        for d in [&stale, &ours, &other] {
            std::fs::create_dir_all(d).unwrap();
        }
        // A test running in parallel may sweep the stale directory first: that is the
        // behaviour under test, so a vanished directory is fine here.
        let _ = std::fs::write(stale.join(SOCKET_NAME), b"");
        let fresh = SocketDir::create().unwrap();
        assert!(!stale.exists());
        assert!(ours.exists() && other.exists() && fresh.path().exists());
        std::fs::remove_dir(&ours).unwrap();
        std::fs::remove_dir(&other).unwrap();
    }
}
