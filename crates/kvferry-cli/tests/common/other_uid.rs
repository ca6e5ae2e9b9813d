//! Running a binary of the checkout as another user (the tests use uid 65534,
//! "nobody"), wherever the checkout lives: [`runnable_by_others`].
//!
//! The kernel lets a user execute a file only if that user may search every folder
//! above it. A checkout inside a private folder (root's home, anything `mktemp -d`
//! makes: mode 0700) is out of another user's reach, and spawning its binaries as that
//! user fails with `EACCES` before they run (issue 60). [`runnable_by_others`] returns
//! the binary's own path where every user reaches it, or else a copy in a fresh
//! world-searchable folder, removed when the returned [`Runnable`] is dropped.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A binary every user may execute: the original, or a copy removed on drop.
#[derive(Debug)]
pub struct Runnable {
    path: PathBuf,
    copy_dir: Option<PathBuf>,
}

impl Runnable {
    /// Where to execute it from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether it is a copy (the original was out of other users' reach).
    pub fn is_copy(&self) -> bool {
        self.copy_dir.is_some()
    }
}

impl Drop for Runnable {
    fn drop(&mut self) {
        if let Some(dir) = &self.copy_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether `mode` lets users other than the owner and group search or execute.
fn others_may_execute(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
}

/// Whether every user may reach and execute `path`: it and every folder above it
/// grant "execute" to others (symbolic links resolved first).
pub fn reachable_by_others(path: &Path) -> bool {
    let Ok(path) = path.canonicalize() else { return false };
    path.ancestors()
        .filter(|p| !p.as_os_str().is_empty())
        .all(others_may_execute)
}

/// `bin` itself where every user may execute it, else a copy of it in a fresh folder
/// of mode 0755 under the first world-searchable one of the temporary folder, `/tmp`,
/// `/var/tmp` and `/dev/shm`; `Err` says why neither could be arranged.
pub fn runnable_by_others(bin: &Path) -> Result<Runnable, String> {
    if reachable_by_others(bin) {
        return Ok(Runnable {
            path: bin.to_path_buf(),
            copy_dir: None,
        });
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = bin
        .file_name()
        .ok_or_else(|| format!("{} names no file", bin.display()))?;
    let bases = [
        std::env::temp_dir(),
        "/tmp".into(),
        "/var/tmp".into(),
        "/dev/shm".into(),
    ];
    let mut tried = Vec::new();
    for base in bases {
        if !reachable_by_others(&base) {
            tried.push(format!("{} (not searchable by others)", base.display()));
            continue;
        }
        let dir = base.join(format!(
            "kvferry-runnable-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let copied = (|| -> std::io::Result<PathBuf> {
            std::fs::create_dir(&dir)?;
            // Set after creating: the umask may have taken bits away.
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
            let path = dir.join(name);
            std::fs::copy(bin, &path)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
            Ok(path)
        })();
        match copied {
            Ok(path) if reachable_by_others(&path) => {
                return Ok(Runnable {
                    path,
                    copy_dir: Some(dir),
                })
            }
            Ok(_) => tried.push(format!("{} (the copy was not reachable)", base.display())),
            Err(e) => tried.push(format!("{} ({e})", base.display())),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    Err(format!(
        "{} is out of other users' reach (a folder above it is private) and no copy could be \
         made where they reach it; tried {}",
        bin.display(),
        tried.join(", ")
    ))
}
