//! Helpers that make rksm's integration tests read like scenarios: a child process with
//! known memory ([`TestChild`]), the `rksm` binary ([`rksm_command`]), and polling with a
//! deadline ([`wait_for`]) instead of sleeping.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

pub mod fuse;

/// Page size of the machines rksm runs on.
pub const PAGE: u64 = rksm_common::PAGE_SIZE;

/// The content the test child writes for `seed` (its `word` function, page by page).
pub fn seed_content(seed: u64) -> Vec<u8> {
    (0..PAGE as usize / 8)
        .flat_map(|i| {
            {
                (seed.wrapping_add(1))
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    .rotate_left((i % 64) as u32)
                    ^ i as u64
            }
            .to_ne_bytes()
        })
        .collect()
}

/// A file of `pages` pages of `seed`'s content, removed when dropped.
pub struct SeedFile(pub PathBuf);

impl SeedFile {
    /// Writes it on a disk file system (O_DIRECT needs one; tmpfs may not do it).
    pub fn new(name: &str, seed: u64, pages: u64) -> SeedFile {
        let path = PathBuf::from(format!("/var/tmp/rksm-{}-{name}", std::process::id()));
        let page = seed_content(seed);
        let all: Vec<u8> = (0..pages).flat_map(|_| page.iter().copied()).collect();
        std::fs::write(&path, all).unwrap();
        SeedFile(path)
    }
}

impl Drop for SeedFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A running `rksm-testchild`, killed when dropped.
pub struct TestChild {
    child: Option<Child>,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// A region the child mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Region id in the child's protocol.
    pub id: u32,
    /// Address of its first page in the child.
    pub base: u64,
}

impl Region {
    /// Address of page `index` of the region.
    pub fn page(&self, index: u64) -> u64 {
        self.base + index * PAGE
    }
}

impl TestChild {
    /// Starts a child with no memory of its own beyond what a small program has.
    pub fn spawn() -> TestChild {
        Self::spawn_with(Command::new(built_binary("rksm-testchild")))
    }

    /// Starts the child program from `path` (a copy of it somewhere else).
    pub fn spawn_from(path: &Path) -> TestChild {
        Self::spawn_with(Command::new(path))
    }

    /// Starts a child running as user `nobody` (65534), without capabilities.
    pub fn spawn_as_nobody() -> TestChild {
        let mut setpriv = Command::new("setpriv");
        setpriv
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(built_binary("rksm-testchild"));
        Self::spawn_with(setpriv)
    }

    fn spawn_with(mut command: Command) -> TestChild {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning rksm-testchild");
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        TestChild {
            child: Some(child),
            stdin,
            stdout,
        }
    }

    /// Talks to a testchild started by someone else (`rksm run -- rksm-testchild`) through
    /// that process's stdin and stdout.
    pub fn attach(parent: &mut Child) -> TestChild {
        let stdin = parent.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(parent.stdout.take().expect("piped stdout"));
        TestChild {
            child: None,
            stdin,
            stdout,
        }
    }

    /// The child's pid (only for children spawned here).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("spawned by the test").id()
    }

    /// The child's pid, asked from the child itself.
    pub fn pid_from_proc(&mut self) -> u32 {
        let reply = self.command("pid");
        reply
            .strip_prefix("pid ")
            .and_then(|p| p.parse().ok())
            .expect("pid N")
    }

    /// Sends one command and returns the reply; panics on an `error` reply.
    pub fn command(&mut self, line: &str) -> String {
        self.send(line);
        let reply = self.reply();
        assert!(!reply.is_empty(), "child exited during `{line}`");
        assert!(
            !reply.starts_with("error"),
            "child rejected `{line}`: {reply}"
        );
        reply
    }

    /// Maps `pages` fresh pages (none present yet).
    pub fn map(&mut self, pages: u64) -> Region {
        self.parse_mapped(&format!("map {pages}"))
    }

    /// Maps `pages` fresh pages with MAP_NORESERVE (a sparse arena).
    pub fn map_sparse(&mut self, pages: u64) -> Region {
        self.parse_mapped(&format!("mapsparse {pages}"))
    }

    /// Maps `pages` fresh pages at a 2 MiB boundary, asking for transparent huge pages.
    pub fn map_huge(&mut self, pages: u64) -> Region {
        self.parse_mapped(&format!("maphuge {pages}"))
    }

    /// Clears the child's own soft-dirty bits through /proc/self/clear_refs, which it keeps
    /// open from then on (as Boehm GC's incremental mode does).
    pub fn clear_own_soft_dirty(&mut self) {
        assert_eq!(self.command("clearrefs"), "ok");
    }

    /// How many of pages `first..first+count` the child's own pagemap shows soft-dirty.
    pub fn soft_dirty_pages(&mut self, region: Region, first: u64, count: u64) -> u64 {
        let reply = self.command(&format!("softdirty {} {first} {count}", region.id));
        reply
            .strip_prefix("softdirty ")
            .and_then(|n| n.parse().ok())
            .expect("softdirty N")
    }

    /// Maps `pages` fresh pages at `base` (which must be free).
    pub fn map_at(&mut self, pages: u64, base: u64) -> Region {
        let region = self.parse_mapped(&format!("map {pages} {base:#x}"));
        assert_eq!(region.base, base, "mapped elsewhere");
        region
    }

    fn parse_mapped(&mut self, command: &str) -> Region {
        let reply = self.command(command);
        let mut words = reply.split_whitespace().skip(1);
        let id = words
            .next()
            .and_then(|w| w.parse().ok())
            .expect("region id");
        let base = words
            .next()
            .and_then(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok())
            .expect("region address");
        Region { id, base }
    }

    /// Fills pages `first..first+count` of `region` with the content of `seed`.
    pub fn write(&mut self, region: Region, first: u64, count: u64, seed: u64) {
        let reply = self.command(&format!("write {} {first} {count} {seed}", region.id));
        assert_eq!(reply, "ok");
    }

    /// Gives page `first+i` of `region` the content of `seed+i`.
    pub fn write_unique(&mut self, region: Region, first: u64, count: u64, seed: u64) {
        let reply = self.command(&format!("unique {} {first} {count} {seed}", region.id));
        assert_eq!(reply, "ok");
    }

    /// Writes look-alike pages `first..first+count` of `region`: the sampler's bytes equal,
    /// the rest per `kind` (`sample`, `oddbyte`, `lastline`; see the test child).
    pub fn write_alike(&mut self, kind: &str, region: Region, first: u64, count: u64, seed: u64) {
        let reply = self.command(&format!(
            "alike {kind} {} {first} {count} {seed}",
            region.id
        ));
        assert_eq!(reply, "ok");
    }

    /// Whether pages `first..first+count` of `region` still hold what `write_alike` wrote.
    pub fn verify_alike(
        &mut self,
        kind: &str,
        region: Region,
        first: u64,
        count: u64,
        seed: u64,
    ) -> bool {
        self.command(&format!(
            "verifyalike {kind} {} {first} {count} {seed}",
            region.id
        )) == "ok"
    }

    /// Fills pages with a constant byte (0 gives zero-filled private pages).
    pub fn fill(&mut self, region: Region, first: u64, count: u64, byte: u8) {
        let reply = self.command(&format!("fill {} {first} {count} {byte}", region.id));
        assert_eq!(reply, "ok");
    }

    /// Forks a child that shares all memory copy-on-write and dies with this one; its pid.
    pub fn fork(&mut self) -> u32 {
        let reply = self.command("fork");
        reply
            .strip_prefix("forked ")
            .and_then(|p| p.parse().ok())
            .expect("forked PID")
    }

    /// Starts `n` threads that keep incrementing a counter; returns the counter's address.
    pub fn threads(&mut self, n: u32) -> u64 {
        let reply = self.command(&format!("threads {n}"));
        let hex = reply.strip_prefix("threads 0x").expect("threads ADDR");
        u64::from_str_radix(hex, 16).expect("hex address")
    }

    /// Registers `region` with a userfaultfd of the child's own.
    pub fn own_userfaultfd(&mut self, region: Region) {
        assert_eq!(self.command(&format!("uffd {}", region.id)), "ok");
    }

    /// Puts the child under a seccomp filter (that allows everything).
    pub fn seccomp(&mut self) {
        assert_eq!(self.command("seccomp"), "ok");
    }

    /// Sends `line` without waiting for the reply (read it later with [`TestChild::reply`]).
    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("child stdin");
    }

    /// Reads one reply line.
    pub fn reply(&mut self) -> String {
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).expect("child stdout");
        reply.trim_end().to_string()
    }

    /// Unmaps the region.
    /// Fills pages from the file at `path`, the kernel writing them: `how` is `read`,
    /// `direct` (O_DIRECT) or `recv`.
    pub fn read_into(&mut self, region: Region, first: u64, count: u64, path: &Path, how: &str) {
        let reply = self.command(&format!(
            "readinto {} {first} {count} {} {how}",
            region.id,
            path.display()
        ));
        assert_eq!(reply, "ok", "readinto {how}");
    }

    /// MADV_DONTNEED over the pages.
    pub fn dont_need(&mut self, region: Region, first: u64, count: u64) {
        assert_eq!(
            self.command(&format!("dontneed {} {first} {count}", region.id)),
            "ok"
        );
    }

    /// Moves `region` onto `onto`'s place; returns the moved region.
    pub fn mremap(&mut self, region: Region, onto: Region) -> Region {
        assert_eq!(
            self.command(&format!("mremap {} {}", region.id, onto.id)),
            "ok"
        );
        Region {
            base: onto.base,
            ..region
        }
    }

    pub fn unmap(&mut self, region: Region) {
        assert_eq!(self.command(&format!("unmap {}", region.id)), "ok");
    }

    /// Reads (and only reads) pages `first..first+count` of `region`.
    pub fn read(&mut self, region: Region, first: u64, count: u64) {
        let reply = self.command(&format!("read {} {first} {count}", region.id));
        assert!(reply.starts_with("ok"), "{reply}");
    }

    /// Whether pages `first..first+count` still hold the content of `seed`.
    pub fn verify(&mut self, region: Region, first: u64, count: u64, seed: u64) -> bool {
        self.command(&format!("verify {} {first} {count} {seed}", region.id)) == "ok"
    }

    /// Whether pages written with [`TestChild::write_unique`] still hold their contents.
    pub fn verify_unique(&mut self, region: Region, first: u64, count: u64, seed: u64) -> bool {
        self.command(&format!(
            "verifyunique {} {first} {count} {seed}",
            region.id
        )) == "ok"
    }

    /// Everything the child's stdout still has until it closes (for a child of `rksm run`,
    /// that includes what rksm prints after the child exits).
    pub fn rest_of_output(mut self) -> String {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).expect("child stdout");
        rest
    }

    /// Asks the child to exit and waits for it.
    pub fn exit(mut self) {
        writeln!(self.stdin, "exit").expect("child stdin");
        let mut child = self.child.take().expect("spawned by the test");
        let status = child.wait().expect("waiting for child");
        assert!(status.success(), "child exited with {status}");
    }
}

impl Drop for TestChild {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `n` children, each holding `pages` pages of the same content (`seed`) in one region:
/// duplicates across processes, the thing rksm exists to merge.
pub fn twins(n: usize, pages: u64, seed: u64) -> Vec<(TestChild, Region)> {
    (0..n)
        .map(|_| {
            let mut child = TestChild::spawn();
            let region = child.map(pages);
            child.write(region, 0, pages, seed);
            (child, region)
        })
        .collect()
}

/// The machine's KSM, held by one test at a time: ksmd's settings, its counters and the
/// daemon's lock are one per host, so tests that run a daemon or read ksmd's counters take
/// turns, whatever runs them (`cargo test` runs test binaries one after another; nextest runs
/// every test in a process of its own, in parallel). A file lock, so it holds across
/// processes, and the kernel releases it when a test dies; dropping the guard releases it.
pub struct KsmTurn(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

/// Waits for this test's turn at the machine's KSM (see [`KsmTurn`]).
pub fn ksm_turn() -> KsmTurn {
    let path = std::env::temp_dir().join("rksm-tests-ksm.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .expect("the tests' KSM lock file");
    // Blocking: the other test's turn ends when it does.
    KsmTurn(
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("locking the tests' KSM lock"),
    )
}

/// A host configuration that would change every result if it were read: JSON logs at warn
/// level (nothing on stderr a tool could scrape), hash-only, a minimum age no test process
/// has, a selector that matches nothing, another checksum, domains and socket.
pub const HOSTILE_CONFIG: &str = r#"comm = "^no-such-process$"
min_age = 86400
dirty = "hash-only"
checksum = "crc32c"
domain = "cgroup"
interval = 3600
json = false
log_level = "warn"
log_format = "json"
socket = "/nonexistent/rksm.sock"
"#;

/// `command` as it would run on a host whose `/etc/rksm/rksm.toml` is [`HOSTILE_CONFIG`]: in
/// a mount namespace of its own, with a tmpfs over /etc/rksm holding that file, so the host
/// and the other tests never see it.
pub fn with_hostile_host_config(command: &Command) -> Command {
    // The directory must exist to be mounted over; an empty one is left if it was missing.
    std::fs::create_dir_all("/etc/rksm").expect("creating /etc/rksm");
    let script = format!(
        "set -e; mount -t tmpfs rksm-hostile /etc/rksm; cat > /etc/rksm/rksm.toml <<'EOF'\n{HOSTILE_CONFIG}EOF\nexec \"$@\""
    );
    let mut wrapped = Command::new("unshare");
    wrapped
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "sh",
        ])
        .arg(command.get_program())
        .args(command.get_args());
    wrapped
}

/// A spawned rksm (a daemon, a trace), stopped with SIGTERM when dropped, so that it restores
/// ksmd's settings even when the test that started it fails: one left running would hold the
/// host's ksmd lock and fail every test after it.
pub struct Running {
    child: Option<Child>,
    /// What it printed on stdout and stderr (where they are pipes), read as it goes by a
    /// thread each: a daemon that writes more than a pipe holds while nobody reads would
    /// block in its log, and stop making passes.
    stdout: Option<std::thread::JoinHandle<Vec<u8>>>,
    stderr: Option<std::thread::JoinHandle<Vec<u8>>>,
}

/// A thread that reads `from` to its end.
fn drain(
    from: Option<impl std::io::Read + Send + 'static>,
) -> Option<std::thread::JoinHandle<Vec<u8>>> {
    from.map(|mut from| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = from.read_to_end(&mut bytes);
            bytes
        })
    })
}

impl Running {
    /// Spawns `command`.
    pub fn spawn(command: &mut Command) -> Running {
        let mut child = command.spawn().expect("spawning rksm");
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        Running {
            child: Some(child),
            stdout,
            stderr,
        }
    }

    /// Its pid.
    pub fn id(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Stops it with SIGTERM and returns what it printed.
    pub fn stop(self) -> std::process::Output {
        // SAFETY: kill with a valid pid and signal.
        assert_eq!(unsafe { libc::kill(self.id() as i32, libc::SIGTERM) }, 0);
        self.wait()
    }

    /// Waits for it to end by itself and returns what it printed.
    pub fn wait(mut self) -> std::process::Output {
        let mut child = self.child.take().expect("running");
        let status = child.wait().expect("waiting for rksm");
        let read = |out: Option<std::thread::JoinHandle<Vec<u8>>>| {
            out.map(|t| t.join().expect("reading rksm's output"))
                .unwrap_or_default()
        };
        std::process::Output {
            status,
            stdout: read(self.stdout.take()),
            stderr: read(self.stderr.take()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill with a valid pid and signal.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }
}

/// The `rksm` binary of the same build as this test.
///
/// It never reads the host's `/etc/rksm/rksm.toml` (`--no-config`): a test's outcome must not
/// depend on how the machine running it is configured.
pub fn rksm_command() -> Command {
    let mut command = Command::new(built_binary("rksm"));
    command.arg("--no-config");
    command
}

/// A binary of this workspace from the same target directory and profile as the running test
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`).
pub fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join(name))
        .expect("target directory");
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo xtask test`, which builds it",
        bin.display()
    );
    bin
}

/// The JSON an `rksm ... --json` run printed last (its final counters); panics with what it
/// printed otherwise.
pub fn final_json(output: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "no JSON from rksm ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Polls `condition` every 10 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_for(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Panics with a clear message unless the tests run as root (they load eBPF programs).
pub fn require_root() {
    // SAFETY: geteuid has no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "rksm's integration tests must run as root (cargo xtask test does)"
    );
}

/// The fields of /proc/PID/status that show whether a process was left alone.
pub fn proc_status(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// Number of open fds of a process.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count()
}

/// /proc/PID/syscall of a blocked thread: the call, its arguments, stack and instruction pointers.
pub fn blocked_syscall(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/syscall"))
        .expect("syscall file")
        .trim()
        .to_string()
}

/// The pagemap entries of `region`'s first `pages` pages.
pub fn page_entries(pid: u32, region: Region, pages: u64) -> Vec<u64> {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).expect("pagemap");
    let mut raw = vec![0u8; pages as usize * 8];
    pagemap
        .read_exact_at(&mut raw, region.base / PAGE * 8)
        .expect("pagemap read");
    raw.chunks_exact(8)
        .map(|entry| u64::from_ne_bytes(entry.try_into().unwrap()))
        .collect()
}

/// The frame (pagemap PFN) of each of `region`'s first `pages` pages, None where absent.
pub fn page_frames(pid: u32, region: Region, pages: u64) -> Vec<Option<u64>> {
    page_entries(pid, region, pages)
        .into_iter()
        .map(|entry| (entry >> 63 == 1).then_some(entry & ((1 << 55) - 1)))
        .collect()
}

/// The indices of `region`'s first `pages` pages that the kernel shows mapped to KSM pages:
/// pagemap gives the frame and says it is mapped more than once (a merged page is shared),
/// /proc/kpageflags bit 21 says KSM. (Some kernels set bit 21 on every anonymous page, as
/// Debian's 6.12.117 does; the frame's sharing keeps the evidence right there.)
pub fn ksm_pages(pid: u32, region: Region, pages: u64) -> Vec<u64> {
    use std::os::unix::fs::FileExt;
    let kpageflags = std::fs::File::open("/proc/kpageflags").expect("kpageflags");
    (0..pages)
        .zip(page_entries(pid, region, pages))
        .filter_map(|(i, entry)| {
            let exclusive = entry >> 56 & 1 == 1;
            let pfn = (entry >> 63 == 1 && !exclusive).then_some(entry & ((1 << 55) - 1))?;
            let mut flags = [0u8; 8];
            (kpageflags.read_exact_at(&mut flags, pfn * 8).is_ok()
                && u64::from_ne_bytes(flags) >> 21 & 1 == 1)
                .then_some(i)
        })
        .collect()
}

/// /proc/PID/ksm_merging_pages: how many of the process's pages KSM has merged.
pub fn ksm_merging_pages(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_merging_pages"))
        .map_or(0, |s| s.trim().parse().unwrap_or(0))
}

/// Whether the VMA of `pid` that contains `address` is marked MADV_MERGEABLE (`mg` among
/// its VmFlags in /proc/PID/smaps).
pub fn vma_mergeable(pid: u32, address: u64) -> bool {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let header = line.split_whitespace().next().and_then(|range| {
            let (start, end) = range.split_once('-')?;
            Some((
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(end, 16).ok()?,
            ))
        });
        if let Some((start, end)) = header {
            inside = (start..end).contains(&address);
        } else if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().any(|f| f == "mg");
            }
        }
    }
    false
}

/// Whether any VMA of `pid` is marked MADV_MERGEABLE.
pub fn any_vma_mergeable(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .expect("smaps")
        .lines()
        .filter_map(|l| l.strip_prefix("VmFlags:"))
        .any(|flags| flags.split_whitespace().any(|f| f == "mg"))
}

/// ksmd's settings, to check they are restored.
pub fn ksmd_settings() -> (String, String, String) {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/ksm/{name}"))
            .unwrap()
            .trim()
            .to_string()
    };
    (read("run"), read("pages_to_scan"), read("sleep_millisecs"))
}

/// Queues SIGRTMIN with `value` as its `si_value` to `pid` (`sigqueue`), retrying while the
/// receiver's queue is full, for up to 10 s; false if it never went.
pub fn queue_signal(pid: u32, value: u64) -> bool {
    wait_for(Duration::from_secs(10), || {
        // SAFETY: sigqueue takes plain values.
        unsafe {
            libc::sigqueue(
                pid as i32,
                libc::SIGRTMIN(),
                libc::sigval {
                    sival_ptr: value as usize as *mut libc::c_void,
                },
            ) == 0
        }
    })
}
