//! Processes: a pid pinned by a pidfd, or the precise reason rksm will not touch it.
//!
//! Everything rksm does to a process starts from a pid an operator typed or a scan found, and
//! pids are racy: a process can exit and its pid be reused, a pid can name a thread rather
//! than a process, or name a kernel thread that has no user memory. This module turns a pid
//! into a [`Process`] held by a pidfd (so later checks refer to the same process, not to a
//! recycled pid) or into a precise reason why rksm will not touch it.

use std::{
    fmt, fs, io,
    os::fd::{FromRawFd, OwnedFd},
    time::Duration,
};

use crate::kernel::procfs::{clock_ticks_per_second, read_text, stat_field};

/// `PF_EXITING` in /proc/PID/stat's flags: the task is being torn down.
const PF_EXITING: u64 = 0x0000_0004;
/// `PF_KTHREAD` in /proc/PID/stat's flags: a kernel thread, no user address space.
const PF_KTHREAD: u64 = 0x0020_0000;

/// Why rksm will not work on a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefusalReason {
    /// A kernel thread has no user memory to trace or merge.
    KernelThread,
    /// rksm itself: its own faults are invisible to its tracer, and it must never stop itself.
    Rksm,
    /// The process is exiting or a zombie.
    Exiting,
    /// PID 1: a hang or a SIGKILL while it is borrowed takes the host down.
    Init,
    /// The init of another PID namespace (a container's): the same, for the container.
    NamespaceInit,
    /// A user's process made itself non-dumpable (`PR_SET_DUMPABLE` 0, as ssh-agent does):
    /// it does not want its memory read, and the kernel keeps even its owner from tracing it.
    NonDumpable,
    /// Its real, effective and saved user or group ids differ: a set-id program, holding
    /// privileges its invoker does not have.
    SetId,
}

impl RefusalReason {
    /// A stable short name, used as a counter label.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::KernelThread => "kernel_thread",
            RefusalReason::Rksm => "rksm_itself",
            RefusalReason::Exiting => "exiting",
            RefusalReason::Init => "init",
            RefusalReason::NamespaceInit => "namespace_init",
            RefusalReason::NonDumpable => "non_dumpable",
            RefusalReason::SetId => "set_id",
        }
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RefusalReason::KernelThread => "it is a kernel thread",
            RefusalReason::Rksm => "it is rksm itself",
            RefusalReason::Exiting => "it is exiting",
            RefusalReason::Init => "it is the init process (PID 1)",
            RefusalReason::NamespaceInit => "it is the init of a PID namespace",
            RefusalReason::NonDumpable => "it is not dumpable",
            RefusalReason::SetId => "its real, effective and saved ids differ (a set-id program)",
        })
    }
}

/// Errors turning a pid into a [`Process`].
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// No process or thread has this pid.
    #[error("pid {0} does not exist")]
    NotFound(u32),
    /// The process exists but rksm will not work on it.
    #[error("pid {pid} ({comm}) refused: {reason}")]
    Refused {
        /// The process.
        pid: u32,
        /// Its command name.
        comm: String,
        /// Why.
        reason: RefusalReason,
    },
    /// /proc could not be read for another reason (permissions, a malformed file).
    #[error("cannot inspect pid {pid}: {source}")]
    Io {
        /// The process.
        pid: u32,
        /// What failed.
        source: io::Error,
    },
}

/// Who a process is: its pid and when it started. A later process that reuses the pid has
/// another start time, so nothing keyed by this is ever inherited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessId {
    /// Process id.
    pub pid: u32,
    /// Start time, in clock ticks after boot.
    pub start_ticks: u64,
}

impl ProcessId {
    /// The identity of whatever process has `pid` now (`None` if there is none).
    pub fn of(pid: u32) -> Option<ProcessId> {
        let stat = read_text(format!("/proc/{pid}/stat")).ok()?;
        let start_ticks = stat_field(&stat, 22)?.parse().ok()?;
        Some(ProcessId { pid, start_ticks })
    }
}

/// A live user process, pinned by a pidfd.
#[derive(Debug)]
pub struct Process {
    pid: u32,
    comm: String,
    start_ticks: u64,
    uids: [u32; 4],
    pidfd: OwnedFd,
    image_at_open: Option<Image>,
}

impl Process {
    /// Opens the process `pid`. A thread id is resolved to its process (the tracer and
    /// everything after it work per process).
    pub fn open(pid: u32) -> Result<Self, TargetError> {
        let before = ProcStat::read(pid)?;
        let tgid = before.tgid;
        let pidfd = pidfd_open(tgid).map_err(|e| match e.raw_os_error() {
            Some(libc::ESRCH) => TargetError::NotFound(pid),
            _ => TargetError::Io { pid, source: e },
        })?;
        // Read /proc again now that the pidfd pins the process: what it says is about the
        // process the pidfd refers to, not about an earlier owner of the pid.
        let stat = ProcStat::read(tgid)?;
        let mut process = Process {
            pid: tgid,
            comm: stat.comm.clone(),
            start_ticks: stat.start_ticks,
            uids: stat.uids,
            pidfd,
            image_at_open: None,
        };
        process.image_at_open = process.image();
        if process.has_exited() {
            return Err(TargetError::NotFound(pid));
        }
        let reason = stat.refusal().or_else(|| stat.non_dumpable());
        if let Some(reason) = reason {
            return Err(TargetError::Refused {
                pid: tgid,
                comm: stat.comm,
                reason,
            });
        }
        Ok(process)
    }

    /// The process id (thread-group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its identity (pid and start time).
    pub fn id(&self) -> ProcessId {
        ProcessId {
            pid: self.pid,
            start_ticks: self.start_ticks,
        }
    }

    /// The pidfd that pins the process.
    pub fn pidfd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.pidfd.as_fd()
    }

    /// The command name, as in /proc/PID/comm.
    pub fn comm(&self) -> &str {
        &self.comm
    }

    /// Its real, effective, saved and filesystem user ids when it was opened.
    pub fn uids(&self) -> [u32; 4] {
        self.uids
    }

    /// How long the process has been running.
    pub fn age(&self) -> Duration {
        let started = self.start_ticks as f64 / clock_ticks_per_second();
        Duration::from_secs_f64((uptime_seconds() - started).max(0.0))
    }

    /// Identifies the process's current address space: the executable's path and where its
    /// code and stack start (randomised by every exec). When it changes, the process has
    /// exec'd, and everything rksm knew about its memory is void. Nothing here touches the
    /// executable's file system: reading the link is /proc's own (a `stat` of it would wait
    /// on a FUSE or NFS server that stopped answering).
    pub fn image(&self) -> Option<Image> {
        let exe = fs::read_link(format!("/proc/{}/exe", self.pid)).ok()?;
        let stat = read_text(format!("/proc/{}/stat", self.pid)).ok()?;
        Image::of(&exe.to_string_lossy(), &stat)
    }

    /// True if the process has executed a new program since it was opened (or has exited):
    /// every address known about it is stale.
    pub fn has_new_image(&self) -> bool {
        self.image() != self.image_at_open
    }

    /// [`Process::has_new_image`], as `observed` says.
    pub fn has_new_image_in(&self, observed: Option<&Observed>) -> bool {
        observed.and_then(Observed::image) != self.image_at_open
    }

    /// What the process is now, as `observed` (one read of /proc) says: a process can make
    /// itself off limits after it was opened (`setuid`, `PR_SET_DUMPABLE`) or change its user
    /// ids, so this is asked again every pass. None if its files do not parse.
    pub fn standing_in(&self, observed: &Observed) -> Option<Standing> {
        let stat = ProcStat::parse(self.pid, &observed.stat, &observed.status)?;
        Some(Standing {
            off_limits: stat
                .refusal()
                .filter(|r| matches!(r, RefusalReason::SetId))
                .or_else(|| stat.non_dumpable()),
            uids: stat.uids,
        })
    }

    /// Reads, once, what a pass's checks of the process ask of /proc: its image, its
    /// standing, whether it can be borrowed now. None once it is gone.
    pub fn observe(&self) -> Option<Observed> {
        let stat = read_text(format!("/proc/{}/stat", self.pid)).ok()?;
        let status = read_text(format!("/proc/{}/status", self.pid)).ok()?;
        let exe = fs::read_link(format!("/proc/{}/exe", self.pid))
            .ok()
            .map(|exe| exe.to_string_lossy().into_owned());
        Some(Observed { exe, stat, status })
    }

    /// True once the process has exited (its pidfd became readable). Never blocks.
    pub fn has_exited(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.pidfd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
            && fds[0].revents().is_some_and(|r| !r.is_empty())
    }
}

/// What a process runs: see [`Process::image`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    exe: String,
    start_code: u64,
    start_stack: u64,
}

impl Image {
    /// The image of a process whose `exe` link reads `exe` and whose /proc/PID/stat reads
    /// `stat`.
    fn of(exe: &str, stat: &str) -> Option<Image> {
        // An executable replaced on disk (a package upgrade) is the same image.
        let exe = exe.strip_suffix(" (deleted)").unwrap_or(exe).to_string();
        let start_code = stat_field(stat, 26)?.parse().ok()?;
        let start_stack = stat_field(stat, 28)?.parse().ok()?;
        Some(Image {
            exe,
            start_code,
            start_stack,
        })
    }
}

/// What /proc said of a process at one moment ([`Process::observe`]): a pass asks several
/// questions of each target (a new program? off limits now? in another domain? can it be
/// borrowed?), and reading its files once for all of them kept a steady pass over many
/// targets from spending most of its time reading the same files again.
#[derive(Debug, Clone)]
pub struct Observed {
    /// Where its `exe` link points (None for a process without one, a kernel thread).
    exe: Option<String>,
    stat: String,
    status: String,
}

impl Observed {
    /// Its /proc/PID/stat.
    pub fn stat(&self) -> &str {
        &self.stat
    }

    /// Its /proc/PID/status.
    pub fn status(&self) -> &str {
        &self.status
    }

    fn image(&self) -> Option<Image> {
        Image::of(self.exe.as_deref()?, &self.stat)
    }
}

/// What a process is now ([`Process::standing_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Why rksm must not touch it any more, if it must not.
    pub off_limits: Option<RefusalReason>,
    /// Its real, effective, saved and filesystem user ids.
    pub uids: [u32; 4],
}

fn uptime_seconds() -> f64 {
    fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A pidfd for process `pid`.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// What rksm needs from /proc/PID/stat and /proc/PID/status.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProcStat {
    pid: u32,
    tgid: u32,
    comm: String,
    state: char,
    flags: u64,
    /// Field 22: when the process started, in clock ticks after boot.
    start_ticks: u64,
    /// Real, effective, saved and filesystem user ids.
    uids: [u32; 4],
    /// The same for group ids.
    gids: [u32; 4],
    /// Its pid in the innermost PID namespace it belongs to.
    innermost_pid: u32,
}

/// The real, effective, saved and filesystem ids on line `name` (`Uid:` or `Gid:`) of a
/// /proc/PID/status text.
pub fn status_ids(status: &str, name: &str) -> Option<[u32; 4]> {
    let line = status.lines().find_map(|l| l.strip_prefix(name))?;
    let ids: Vec<u32> = line
        .split_whitespace()
        .map(|w| w.parse().ok())
        .collect::<Option<_>>()?;
    ids.try_into().ok()
}

impl ProcStat {
    fn read(pid: u32) -> Result<Self, TargetError> {
        let not_found_or_io = |source: io::Error| match source.kind() {
            io::ErrorKind::NotFound => TargetError::NotFound(pid),
            _ => TargetError::Io { pid, source },
        };
        let stat = read_text(format!("/proc/{pid}/stat")).map_err(not_found_or_io)?;
        let status = read_text(format!("/proc/{pid}/status")).map_err(not_found_or_io)?;
        Self::parse(pid, &stat, &status).ok_or_else(|| TargetError::Io {
            pid,
            source: io::Error::new(io::ErrorKind::InvalidData, "malformed /proc/PID/stat"),
        })
    }

    /// `stat` is `pid (comm) state ppid ...`; comm may itself contain spaces and parentheses,
    /// so it ends at the *last* `)`.
    fn parse(pid: u32, stat: &str, status: &str) -> Option<Self> {
        let comm = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?.to_string();
        let state = stat_field(stat, 3)?.chars().next()?;
        let flags = stat_field(stat, 9)?.parse().ok()?;
        let start_ticks = stat_field(stat, 22)?.parse().ok()?;
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name));
        let tgid = field("Tgid:")?.trim().parse().ok()?;
        let ids = |name: &str| status_ids(status, name);
        // Without a namespace line (old kernels), the pid is its own.
        let innermost_pid = match field("NSpid:") {
            Some(ns) => ns.split_whitespace().last()?.parse().ok()?,
            None => tgid,
        };
        Some(ProcStat {
            pid,
            tgid,
            comm,
            state,
            flags,
            start_ticks,
            uids: ids("Uid:")?,
            gids: ids("Gid:")?,
            innermost_pid,
        })
    }

    /// `NonDumpable` if the process made itself so (asks the kernel, see [`is_dumpable`]).
    fn non_dumpable(&self) -> Option<RefusalReason> {
        (!is_dumpable(self.tgid, self.uids[0])).then_some(RefusalReason::NonDumpable)
    }

    fn refusal(&self) -> Option<RefusalReason> {
        if self.flags & PF_KTHREAD != 0 {
            Some(RefusalReason::KernelThread)
        } else if self.tgid == std::process::id() {
            Some(RefusalReason::Rksm)
        } else if self.flags & PF_EXITING != 0 || matches!(self.state, 'Z' | 'X' | 'x') {
            Some(RefusalReason::Exiting)
        } else if self.tgid == 1 {
            Some(RefusalReason::Init)
        } else if self.innermost_pid == 1 {
            Some(RefusalReason::NamespaceInit)
        } else if self.uids[..3].iter().any(|&u| u != self.uids[0])
            || self.gids[..3].iter().any(|&g| g != self.gids[0])
        {
            Some(RefusalReason::SetId)
        } else {
            None
        }
    }
}

/// Whether process `pid`, running as `uid`, is dumpable. /proc does not say in words, but
/// the kernel gives a non-dumpable process's /proc files (its directory aside) to root
/// (`task_dump_owner`), so a process of a user whose /proc/PID/status belongs to root has
/// made itself non-dumpable. For a process running as root the two cannot be told apart,
/// and none needs to be: its memory is root's, as rksm is.
fn is_dumpable(pid: u32, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    match fs::metadata(format!("/proc/{pid}/status")) {
        Ok(meta) => uid == 0 || meta.uid() == uid,
        // Gone meanwhile: not a reason to refuse; the caller finds out.
        Err(_) => true,
    }
}

/// A `sleep` child for tests, killed and reaped when dropped (a test that fails leaves no
/// process behind).
#[cfg(test)]
pub(crate) struct Sleeper(std::process::Child);

#[cfg(test)]
impl Sleeper {
    pub(crate) fn spawn() -> Sleeper {
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep");
        Sleeper(child)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }
}

#[cfg(test)]
impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(pid: u32, tgid: u32, comm: &str, state: char, flags: u64) -> ProcStat {
        let line =
            format!("{pid} ({comm}) {state} 1 1 1 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0");
        ProcStat::parse(
            pid,
            &line,
            &format!("Name:\tx\nTgid:\t{tgid}\nPid:\t{pid}\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t100\nNSpid:\t{pid}\n"),
        )
        .unwrap()
    }

    #[test]
    fn parses_comm_with_spaces_and_parentheses() {
        let s = stat(42, 42, "evil ) (name", 'S', 4194560);
        assert_eq!(s.comm, "evil ) (name");
        assert_eq!(s.state, 'S');
        assert_eq!(s.flags, 4194560);
        assert_eq!(s.start_ticks, 4242);
    }

    #[test]
    fn refusal_reasons_follow_flags_and_state() {
        assert_eq!(
            stat(2, 2, "kthreadd", 'S', PF_KTHREAD).refusal(),
            Some(RefusalReason::KernelThread)
        );
        assert_eq!(
            stat(9, 9, "dying", 'R', PF_EXITING).refusal(),
            Some(RefusalReason::Exiting)
        );
        assert_eq!(
            stat(9, 9, "zombie", 'Z', 0).refusal(),
            Some(RefusalReason::Exiting)
        );
        let me = std::process::id();
        assert_eq!(
            stat(me, me, "rksm", 'R', 0).refusal(),
            Some(RefusalReason::Rksm)
        );
        assert_eq!(stat(9, 9, "worker", 'S', 0x400100).refusal(), None);
        assert_eq!(
            stat(1, 1, "systemd", 'S', 0).refusal(),
            Some(RefusalReason::Init)
        );
    }

    #[test]
    fn set_id_programs_and_namespace_inits_are_refused() {
        let line = "77 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0";
        let status = |uid: &str, gid: &str, nspid: &str| {
            format!("Tgid:\t77\nUid:\t{uid}\nGid:\t{gid}\nNSpid:\t{nspid}\n")
        };
        let refusal = |uid, gid, nspid| {
            ProcStat::parse(77, line, &status(uid, gid, nspid))
                .unwrap()
                .refusal()
        };
        assert_eq!(refusal("5 5 5 5", "5 5 5 5", "77"), None);
        assert_eq!(
            refusal("1000 0 0 0", "5 5 5 5", "77"),
            Some(RefusalReason::SetId),
            "setuid root"
        );
        assert_eq!(
            refusal("5 5 5 5", "5 42 42 42", "77"),
            Some(RefusalReason::SetId),
            "setgid"
        );
        assert_eq!(
            refusal("5 5 5 5", "5 5 5 5", "77 1"),
            Some(RefusalReason::NamespaceInit)
        );
        assert_eq!(
            refusal("5 5 5 5", "5 5 5 5", "77 12"),
            None,
            "a container's other processes"
        );
    }

    proptest::proptest! {
        /// /proc/PID/stat and status text of any shape: rejected or parsed, never a panic.
        #[test]
        fn stat_parsing_never_panics(stat in "\\PC*", status in "\\PC*") {
            let _ = ProcStat::parse(1, &stat, &status);
        }

        /// Command names with any characters, parentheses included, come back intact.
        #[test]
        fn comm_survives_any_characters(comm in "[^\\n]{0,15}") {
            let line = format!("7 ({comm}) S 1 1 1 0 -1 64 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0");
            let parsed = ProcStat::parse(7, &line, "Tgid:\t7\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n").expect("well-formed");
            proptest::prop_assert_eq!(parsed.comm, comm);
            proptest::prop_assert_eq!(parsed.start_ticks, 99);
        }
    }

    #[test]
    fn the_corpus_stat_and_status_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        let init = ProcStat::parse(1, &read("stat-1.txt"), &read("status-1.txt")).unwrap();
        assert_eq!((init.pid, init.tgid), (1, 1));
        assert_eq!(init.refusal(), Some(RefusalReason::Init));
        let kthreadd = ProcStat::parse(
            2,
            &read("stat-2.txt"),
            "Tgid:\t2\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n",
        )
        .unwrap();
        assert_eq!(kthreadd.refusal(), Some(RefusalReason::KernelThread));
    }

    #[test]
    fn malformed_stat_is_rejected_not_panicked_on() {
        assert_eq!(ProcStat::parse(1, "1 (init", "Tgid:\t1"), None);
        assert_eq!(ProcStat::parse(1, "1 (init) S 0", "Tgid:\t1"), None);
        assert_eq!(
            ProcStat::parse(1, "1 (init) S 0 1 1 0 -1 4194560", "Pid:\t1"),
            None
        );
    }

    #[test]
    fn opens_a_live_child_and_sees_it_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let process = Process::open(child.id()).unwrap();
        assert_eq!(process.pid(), child.id());
        assert_eq!(process.comm(), "sleep");
        assert!(!process.has_exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(process.has_exited());
    }

    #[test]
    fn refuses_itself_and_kernel_threads() {
        let err = Process::open(std::process::id()).unwrap_err();
        assert!(
            matches!(
                err,
                TargetError::Refused {
                    reason: RefusalReason::Rksm,
                    ..
                }
            ),
            "{err}"
        );
        // kthreadd is pid 2 wherever there is a kernel with kernel threads visible in /proc.
        let err = Process::open(2).unwrap_err();
        assert!(
            matches!(
                err,
                TargetError::Refused {
                    reason: RefusalReason::KernelThread,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_thread_id_resolves_to_its_process() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::spawn(move || {
            // SAFETY: gettid has no arguments and cannot fail.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            done_rx.recv().ok();
        });
        let tid = rx.recv().unwrap();
        let err = Process::open(tid).unwrap_err();
        // It resolves to this test process, which is then refused as "rksm itself".
        assert!(
            matches!(err, TargetError::Refused { pid, reason: RefusalReason::Rksm, .. } if pid == std::process::id()),
            "{err}"
        );
        done_tx.send(()).unwrap();
        handle.join().unwrap();
    }

    #[test]
    fn a_missing_pid_is_not_found() {
        // pid_max is at most 2^22, so this pid cannot exist.
        let err = Process::open(4_194_305).unwrap_err();
        assert!(matches!(err, TargetError::NotFound(4_194_305)), "{err}");
    }
}
