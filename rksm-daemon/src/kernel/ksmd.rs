//! ksmd's settings: owned while rksm runs, restored when it stops.
//!
//! rksm does not merge pages itself; it marks verified duplicates `MADV_MERGEABLE` and lets
//! ksmd do the page-table work. For that ksmd must run, and fast enough to sweep the marked
//! set soon after it is marked; but only the marked set is mergeable, so a fast ksmd costs
//! little. rksm sets `run`, `pages_to_scan` and `sleep_millisecs` while it runs and puts back
//! exactly what it found when it stops. It never writes `run=2` (which unmerges everything).
//! The counters in the same directory are read here too, once.
//!
//! Ownership is exclusive: [`KsmdOwner::take`] takes a lock beside the saved settings
//! (`daemon.lock`) and holds it for as long as it owns ksmd, so the daemon and `rksm bench`,
//! whichever comes second, are told that someone else owns ksmd instead of mistaking the
//! other's saved settings for a crash's.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

/// Where the kernel exposes KSM.
pub const KSM_SYSFS: &str = "/sys/kernel/mm/ksm";

/// Where the settings found at take-over are kept while rksm owns ksmd, so that a start after
/// an rksm that died without restoring them (SIGKILL, a crash, a power cut of the process)
/// can still put them back.
pub const STATE_PATH: &str = "/run/rksm/ksmd-settings";

/// The lock file, in the saved settings' directory.
pub const LOCK_NAME: &str = "daemon.lock";

/// Errors with ksmd's sysfs files.
#[derive(Debug, thiserror::Error)]
pub enum KsmdError {
    /// Another rksm (a daemon, or a bench) owns ksmd.
    #[error("another rksm owns ksmd (it holds {0}); two would fight over ksmd's settings")]
    Busy(PathBuf),
    /// No KSM in this kernel.
    #[error("KSM is not available on this kernel ({0} is missing); rksm cannot merge here, but `rksm estimate` still works")]
    Absent(PathBuf),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// A file held something that is not a number.
    #[error("{0}: not a number")]
    Malformed(PathBuf),
    /// ksmd's files exist but cannot be written (a read-only /sys, a container).
    #[error("cannot control ksmd: {path}: {source}; rksm must write /sys/kernel/mm/ksm to merge, but `rksm estimate` still works")]
    NotWritable {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Someone else changed `run` while rksm owned ksmd.
    #[error("ksmd's run was set to {0} by someone else while rksm owned it; rksm stops pacing ksmd and will not start it again")]
    TakenBack(u64),
}

/// The settings rksm owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KsmdSettings {
    /// 0 stopped, 1 running (2, unmerge everything, is never written by rksm).
    pub run: u64,
    /// Pages ksmd looks at per wake-up.
    pub pages_to_scan: u64,
    /// Sleep between wake-ups.
    pub sleep_millisecs: u64,
}

/// ksmd's counters (names as in /sys/kernel/mm/ksm).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct KsmdCounters {
    /// KSM pages in use.
    pub pages_shared: u64,
    /// Further mappings of KSM pages: the memory saved.
    pub pages_sharing: u64,
    /// Mergeable pages ksmd found unique.
    pub pages_unshared: u64,
    /// Mergeable pages changing too fast to be merged.
    pub pages_volatile: u64,
    /// Complete sweeps of the mergeable areas.
    pub full_scans: u64,
    /// Pages ksmd has looked at since boot (Linux 6.7 and later): unchanged, it has merged
    /// nothing since.
    pub pages_scanned: Option<u64>,
}

fn read_number(path: &Path) -> Result<u64, KsmdError> {
    let text = fs::read_to_string(path).map_err(|source| KsmdError::Io {
        path: path.into(),
        source,
    })?;
    text.trim()
        .parse()
        .map_err(|_| KsmdError::Malformed(path.into()))
}

fn write_number(path: &Path, value: u64) -> Result<(), KsmdError> {
    fs::write(path, value.to_string()).map_err(|source| KsmdError::Io {
        path: path.into(),
        source,
    })
}

/// Reads ksmd's counters under `root` (normally [`KSM_SYSFS`]).
pub fn counters(root: &Path) -> Result<KsmdCounters, KsmdError> {
    let get = |name: &str| read_number(&root.join(name));
    Ok(KsmdCounters {
        pages_shared: get("pages_shared")?,
        pages_sharing: get("pages_sharing")?,
        pages_unshared: get("pages_unshared")?,
        pages_volatile: get("pages_volatile")?,
        full_scans: get("full_scans")?,
        pages_scanned: get("pages_scanned").ok(),
    })
}

fn read_settings(root: &Path) -> Result<KsmdSettings, KsmdError> {
    if !root.join("run").exists() {
        return Err(KsmdError::Absent(root.into()));
    }
    Ok(KsmdSettings {
        run: read_number(&root.join("run"))?,
        pages_to_scan: read_number(&root.join("pages_to_scan"))?,
        sleep_millisecs: read_number(&root.join("sleep_millisecs"))?,
    })
}

fn write_settings(root: &Path, s: KsmdSettings) -> Result<(), KsmdError> {
    // run last on the way in: ksmd starts with the new pace, not the old one.
    write_number(&root.join("pages_to_scan"), s.pages_to_scan)?;
    write_number(&root.join("sleep_millisecs"), s.sleep_millisecs)?;
    // 2 reads back after an "unmerge everything" as long as ksmd stays stopped: putting it
    // back means stopped, never running, and rksm never unmerges everything itself.
    write_number(&root.join("run"), u64::from(s.run == 1))
}

/// Takes the one-owner lock in `state`'s directory, or says who holds it.
fn lock(state: &Path) -> Result<nix::fcntl::Flock<fs::File>, KsmdError> {
    let dir = state.parent().unwrap_or(Path::new("."));
    let path = dir.join(LOCK_NAME);
    let io_err = |source| KsmdError::Io {
        path: path.clone(),
        source,
    };
    fs::create_dir_all(dir).map_err(io_err)?;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| KsmdError::Busy(path.clone()))
}

/// ksmd's settings, owned: set on [`KsmdOwner::take`], restored on drop.
#[derive(Debug)]
pub struct KsmdOwner {
    root: PathBuf,
    state: PathBuf,
    saved: KsmdSettings,
    current: KsmdSettings,
    restored: bool,
    /// The `run` value someone else wrote while rksm owned ksmd, if anyone did.
    taken_back: Option<u64>,
    /// The lock that makes this the only owner; released when dropped, after restoring.
    _lock: nix::fcntl::Flock<fs::File>,
}

impl KsmdOwner {
    /// Saves ksmd's settings under `root` (to `state` as well) and applies `wanted`. If
    /// `state` exists, an earlier owner died without restoring: the settings it saved are the
    /// ones to put back, not the ones it left in force.
    pub fn take(root: &Path, state: &Path, wanted: KsmdSettings) -> Result<Self, KsmdError> {
        let lock = lock(state)?;
        let in_force = read_settings(root)?;
        // Find out whether ksmd can be controlled at all before recording anything: writing
        // the sleep it already has changes nothing (unlike `run`, where 2 would unmerge again).
        let probe = root.join("sleep_millisecs");
        fs::write(&probe, in_force.sleep_millisecs.to_string()).map_err(|source| {
            KsmdError::NotWritable {
                path: probe,
                source,
            }
        })?;
        let saved = match read_state(state) {
            Some(left) => {
                log::warn!(
                    "{} holds ksmd's settings from an rksm that did not exit cleanly; they will be restored: run={} pages_to_scan={} sleep_millisecs={}",
                    state.display(),
                    left.run,
                    left.pages_to_scan,
                    left.sleep_millisecs
                );
                left
            }
            None => in_force,
        };
        write_state(state, saved)?;
        let mut owner = KsmdOwner {
            root: root.into(),
            state: state.into(),
            saved,
            current: in_force,
            restored: false,
            taken_back: None,
            _lock: lock,
        };
        owner.set(wanted)?;
        Ok(owner)
    }

    /// Puts back settings a dead owner left in `state`, if any; returns whether it did.
    pub fn recover(root: &Path, state: &Path) -> Result<bool, KsmdError> {
        let _lock = lock(state)?;
        let Some(left) = read_state(state) else {
            return Ok(false);
        };
        write_settings(root, left)?;
        let _ = fs::remove_file(state);
        Ok(true)
    }

    /// The settings found when rksm took over.
    pub fn saved(&self) -> KsmdSettings {
        self.saved
    }

    /// The `run` value another administrator set while rksm owned ksmd, if one did.
    pub fn taken_back(&self) -> Option<u64> {
        self.taken_back
    }

    /// Applies new settings (while owned). If someone else changed `run` since rksm last
    /// wrote it (an administrator stopping ksmd, or unmerging everything with 2), rksm stops
    /// writing: it does not fight the operator. That is reported once, as
    /// [`KsmdError::TakenBack`]; later calls do nothing.
    pub fn set(&mut self, wanted: KsmdSettings) -> Result<(), KsmdError> {
        if self.taken_back.is_some() {
            return Ok(());
        }
        let run = read_number(&self.root.join("run"))?;
        if run != self.current.run {
            self.taken_back = Some(run);
            return Err(KsmdError::TakenBack(run));
        }
        if wanted != self.current {
            write_settings(&self.root, wanted)?;
            self.current = wanted;
        }
        Ok(())
    }

    /// Puts back the settings found at [`KsmdOwner::take`].
    pub fn restore(mut self) -> Result<(), KsmdError> {
        self.restore_now()
    }

    fn restore_now(&mut self) -> Result<(), KsmdError> {
        if self.restored {
            return Ok(());
        }
        self.restored = true;
        match self.taken_back {
            // `run` stays as the operator set it, and so does any setting they changed too;
            // only what still holds rksm's value goes back.
            Some(run) => {
                for (name, mine, saved) in [
                    (
                        "pages_to_scan",
                        self.current.pages_to_scan,
                        self.saved.pages_to_scan,
                    ),
                    (
                        "sleep_millisecs",
                        self.current.sleep_millisecs,
                        self.saved.sleep_millisecs,
                    ),
                ] {
                    let path = self.root.join(name);
                    if read_number(&path)? == mine {
                        write_number(&path, saved)?;
                    }
                }
                log::info!("ksmd's pace restored; run left at {run}, as someone else set it");
            }
            None => write_settings(&self.root, self.saved)?,
        }
        // Only once they are back is the record of them no longer needed.
        let _ = fs::remove_file(&self.state);
        Ok(())
    }
}

impl Drop for KsmdOwner {
    fn drop(&mut self) {
        if let Err(e) = self.restore_now() {
            log::error!("restoring ksmd's settings: {e}");
        }
    }
}

fn read_state(state: &Path) -> Option<KsmdSettings> {
    let text = fs::read_to_string(state).ok()?;
    let mut numbers = text.split_whitespace().map(|w| w.parse::<u64>().ok());
    Some(KsmdSettings {
        run: numbers.next()??,
        pages_to_scan: numbers.next()??,
        sleep_millisecs: numbers.next()??,
    })
}

fn write_state(state: &Path, s: KsmdSettings) -> Result<(), KsmdError> {
    let io = |source| KsmdError::Io {
        path: state.into(),
        source,
    };
    if let Some(dir) = state.parent() {
        fs::create_dir_all(dir).map_err(io)?;
    }
    // Written to a temporary file and renamed, so a crash never leaves half a record.
    let tmp = state.with_extension("tmp");
    fs::write(
        &tmp,
        format!("{} {} {}\n", s.run, s.pages_to_scan, s.sleep_millisecs),
    )
    .map_err(io)?;
    fs::rename(&tmp, state).map_err(io)
}

/// ksmd as it was found, for when rksm has nothing for it to do: stopped if it was stopped
/// (or unmerging: rksm never writes 2), else at the host's own pace.
pub fn idle(saved: KsmdSettings) -> KsmdSettings {
    KsmdSettings {
        run: u64::from(saved.run == 1),
        ..saved
    }
}

/// How fast ksmd should go to sweep `marked_pages` in about `sweep_secs`, waking every
/// `sleep_millisecs`: at least 100 pages per wake-up (ksmd's default), at most 100,000.
pub fn pace(marked_pages: u64, sweep_secs: f64, sleep_millisecs: u64) -> KsmdSettings {
    let wakeups = (sweep_secs * 1000.0 / sleep_millisecs.max(1) as f64).max(1.0);
    let pages_to_scan = ((marked_pages as f64 / wakeups).ceil() as u64).clamp(100, 100_000);
    KsmdSettings {
        run: 1,
        pages_to_scan,
        sleep_millisecs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory that looks like /sys/kernel/mm/ksm, one per test.
    fn fake_sysfs(test: &str, run: u64, pages: u64, sleep: u64) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rksm-ksm-{}-{test}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for (name, value) in [
            ("run", run),
            ("pages_to_scan", pages),
            ("sleep_millisecs", sleep),
        ] {
            fs::write(dir.join(name), format!("{value}\n")).unwrap();
        }
        dir
    }

    fn on_disk(dir: &Path) -> KsmdSettings {
        read_settings(dir).unwrap()
    }

    impl KsmdOwner {
        /// What a SIGKILL does to an owner: nothing restored, the lock released by the kernel.
        fn die(mut self) {
            self.restored = true;
        }
    }

    #[test]
    fn only_one_owner_at_a_time() {
        let dir = fake_sysfs("busy", 0, 100, 20);
        let first = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap();
        let err = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap_err();
        assert!(matches!(err, KsmdError::Busy(_)), "{err}");
        assert!(
            KsmdOwner::recover(&dir, &state(&dir)).is_err(),
            "nor recover"
        );
        assert_eq!(on_disk(&dir).run, 1, "the first owner's settings stand");
        first.restore().unwrap();
        let second = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap();
        second.restore().unwrap();
        fs::remove_dir_all(dir).unwrap();
    }

    fn state(dir: &Path) -> PathBuf {
        dir.join("saved-by-rksm")
    }

    #[test]
    fn a_dead_owners_saved_settings_win_over_what_it_left_in_force() {
        let dir = fake_sysfs("dead", 0, 100, 20);
        let first = KsmdOwner::take(&dir, &state(&dir), pace(50_000, 1.0, 20)).unwrap();
        assert!(state(&dir).exists());
        first.die();
        assert_eq!(on_disk(&dir).run, 1);
        let second = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap();
        assert_eq!(
            second.saved(),
            KsmdSettings {
                run: 0,
                pages_to_scan: 100,
                sleep_millisecs: 20
            }
        );
        second.restore().unwrap();
        assert_eq!(
            on_disk(&dir),
            KsmdSettings {
                run: 0,
                pages_to_scan: 100,
                sleep_millisecs: 20
            }
        );
        assert!(!state(&dir).exists(), "the record outlived the restore");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn recover_puts_back_what_a_dead_owner_saved() {
        let dir = fake_sysfs("recover", 1, 100, 20);
        assert!(
            !KsmdOwner::recover(&dir, &state(&dir)).unwrap(),
            "nothing to recover"
        );
        KsmdOwner::take(&dir, &state(&dir), pace(1, 1.0, 7))
            .unwrap()
            .die();
        assert_eq!(on_disk(&dir).sleep_millisecs, 7);
        assert!(KsmdOwner::recover(&dir, &state(&dir)).unwrap());
        assert_eq!(
            on_disk(&dir),
            KsmdSettings {
                run: 1,
                pages_to_scan: 100,
                sleep_millisecs: 20
            }
        );
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn settings_are_applied_then_restored_exactly() {
        let dir = fake_sysfs("applied", 0, 100, 20);
        let wanted = KsmdSettings {
            run: 1,
            pages_to_scan: 5000,
            sleep_millisecs: 10,
        };
        let owner = KsmdOwner::take(&dir, &state(&dir), wanted).unwrap();
        assert_eq!(on_disk(&dir), wanted);
        assert_eq!(
            owner.saved(),
            KsmdSettings {
                run: 0,
                pages_to_scan: 100,
                sleep_millisecs: 20
            }
        );
        owner.restore().unwrap();
        assert_eq!(
            on_disk(&dir),
            KsmdSettings {
                run: 0,
                pages_to_scan: 100,
                sleep_millisecs: 20
            }
        );
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn dropping_the_owner_restores_too() {
        let dir = fake_sysfs("dropped", 1, 1234, 50);
        {
            let mut owner = KsmdOwner::take(&dir, &state(&dir), pace(10_000, 1.0, 20)).unwrap();
            owner
                .set(KsmdSettings {
                    run: 1,
                    pages_to_scan: 777,
                    sleep_millisecs: 20,
                })
                .unwrap();
            assert_eq!(on_disk(&dir).pages_to_scan, 777);
        }
        assert_eq!(
            on_disk(&dir),
            KsmdSettings {
                run: 1,
                pages_to_scan: 1234,
                sleep_millisecs: 50
            }
        );
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn run_2_is_never_written() {
        let dir = fake_sysfs("run2", 0, 100, 20);
        let owner = KsmdOwner::take(
            &dir,
            &state(&dir),
            KsmdSettings {
                run: 2,
                pages_to_scan: 100,
                sleep_millisecs: 20,
            },
        )
        .unwrap();
        assert_eq!(on_disk(&dir).run, 0, "2 is written as stopped");
        drop(owner);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_ksmd_found_unmerged_is_put_back_stopped() {
        let dir = fake_sysfs("found2", 2, 100, 20);
        let owner = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap();
        assert_eq!(on_disk(&dir).run, 1);
        owner.restore().unwrap();
        assert_eq!(on_disk(&dir).run, 0, "restoring run=2 started ksmd");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_operator_who_stops_ksmd_is_not_overruled() {
        let dir = fake_sysfs("taken", 0, 100, 50);
        let mut owner = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap();
        assert_eq!(on_disk(&dir).run, 1);
        fs::write(dir.join("run"), "0\n").unwrap();
        let err = owner.set(pace(500_000, 1.0, 20)).unwrap_err();
        assert!(matches!(err, KsmdError::TakenBack(0)), "{err}");
        assert_eq!(owner.taken_back(), Some(0));
        owner.set(pace(500_000, 1.0, 20)).unwrap();
        assert_eq!(on_disk(&dir).run, 0, "rksm started ksmd again");
        assert_eq!(on_disk(&dir).pages_to_scan, 100, "rksm kept pacing ksmd");
        // The operator starts it again at their own pace before rksm stops: that stands;
        // the sleep rksm set goes back.
        fs::write(dir.join("run"), "1\n").unwrap();
        fs::write(dir.join("pages_to_scan"), "3000\n").unwrap();
        owner.restore().unwrap();
        assert_eq!(
            on_disk(&dir),
            KsmdSettings {
                run: 1,
                pages_to_scan: 3000,
                sleep_millisecs: 50
            }
        );
        assert!(!state(&dir).exists());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unwritable_ksmd_is_refused_before_anything_is_recorded() {
        let dir = fake_sysfs("readonly", 0, 100, 20);
        // A number that even root cannot write (a sysctl with no write handler, mode 0444).
        fs::remove_file(dir.join("sleep_millisecs")).unwrap();
        std::os::unix::fs::symlink("/proc/sys/kernel/ngroups_max", dir.join("sleep_millisecs"))
            .unwrap();
        let err = KsmdOwner::take(&dir, &state(&dir), pace(10, 1.0, 20)).unwrap_err();
        assert!(matches!(err, KsmdError::NotWritable { .. }), "{err}");
        assert!(err.to_string().contains("cannot control ksmd"), "{err}");
        assert!(!state(&dir).exists(), "a record was left for nothing");
        assert_eq!(on_disk_run(&dir), 0);
        fs::remove_dir_all(dir).unwrap();
    }

    fn on_disk_run(dir: &Path) -> u64 {
        read_number(&dir.join("run")).unwrap()
    }

    #[test]
    fn absent_ksm_is_a_clear_error() {
        let err = KsmdOwner::take(
            Path::new("/nonexistent/ksm"),
            Path::new("/nonexistent/state"),
            pace(1, 1.0, 20),
        )
        .unwrap_err();
        assert!(err.to_string().contains("KSM is not available"), "{err}");
    }

    #[test]
    fn pace_sweeps_the_marked_set_in_time() {
        assert_eq!(pace(0, 1.0, 20).pages_to_scan, 100);
        assert_eq!(pace(100_000, 1.0, 20).pages_to_scan, 2000);
        assert_eq!(pace(u64::MAX / 2, 1.0, 20).pages_to_scan, 100_000);
    }
}
