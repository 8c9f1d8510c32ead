//! Real programs under the daemon in ebpf mode: each keeps working by its own measure.
//!
//! Python, Node.js and Java processes holding the same data, a PostgreSQL server under
//! pgbench, qemu guests that mark their own RAM mergeable, an idle event loop, a process
//! flooded with queued signals, and a process stuck in a vfork wait. Each test checks the
//! program's own notion of working (its answers, its error counts, its memory) and the
//! kernel's evidence of merging (`/proc/PID/ksm_merging_pages`).

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::Duration,
};

use rksm::{
    service::status,
    tools::guest::{self, GuestImage, GuestMemory, GuestProcess},
};
use rksm_tests::{
    ksm_merging_pages, ksm_turn, proc_status, queue_signal, require_root, rksm_command, wait_for,
    Running, TestChild, PAGE,
};

/// The daemon in ebpf mode over some targets, with its status socket.
struct Daemon {
    running: Running,
    socket: PathBuf,
}

impl Daemon {
    /// `rksm daemon --dirty ebpf --interval 0.3` with `targets` (`--pid N`, `--comm RE`).
    fn over(targets: &[String]) -> Daemon {
        static DAEMONS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = DAEMONS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let socket =
            std::env::temp_dir().join(format!("rksm-programs-{}-{n}.sock", std::process::id()));
        let mut cmd = rksm_command();
        cmd.args(["daemon", "--dirty", "ebpf", "--interval", "0.3", "--json"])
            .arg("--socket")
            .arg(&socket)
            .args(targets)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Daemon {
            running: Running::spawn(&mut cmd),
            socket,
        }
    }

    fn pids(pids: &[u32]) -> Daemon {
        let args: Vec<String> = pids
            .iter()
            .flat_map(|p| ["--pid".into(), p.to_string()])
            .collect();
        Daemon::over(&args)
    }

    /// Passes completed so far.
    fn passes(&self) -> u64 {
        status::query(&self.socket)
            .ok()
            .and_then(|s| s.last_pass)
            .map_or(0, |p| p.number)
    }

    /// Stops it and returns its counters.
    fn stop(self) -> serde_json::Value {
        let output = self.running.stop();
        assert!(
            output.status.success(),
            "rksm failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).expect("JSON counters")
    }
}

/// A program that prints `ready` once its data is in place and answers each `check` line
/// with `ok` when its data is intact.
struct Program {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Program {
    fn start(command: &mut Command) -> Program {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "{command:?} did not start");
        Program {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn check(&mut self) -> String {
        writeln!(self.stdin, "check").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `text` to a scratch file named `name` and returns its path.
fn script(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rksm-programs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Waits until every process of `pids` has at least `pages` pages merged.
fn merged(pids: &[u32], pages: u64, timeout: Duration) -> bool {
    wait_for(timeout, || {
        pids.iter().all(|&p| ksm_merging_pages(p) >= pages)
    })
}

/// Runs the same program three times, merges their data, and checks they still answer.
fn same_data_in_three(command: impl Fn() -> Command, data_pages: u64) {
    require_root();
    let _turn = ksm_turn();
    let mut programs: Vec<Program> = (0..3).map(|_| Program::start(&mut command())).collect();
    let pids: Vec<u32> = programs.iter().map(Program::pid).collect();
    let daemon = Daemon::pids(&pids);
    let enough = merged(&pids, data_pages / 2, Duration::from_secs(90));
    let counts: Vec<u64> = pids.iter().map(|&p| ksm_merging_pages(p)).collect();
    for program in &mut programs {
        assert_eq!(program.check(), "ok", "pid {} lost its data", program.pid());
    }
    let stats = daemon.stop();
    assert!(
        enough,
        "merging pages {counts:?}, expected at least {} each",
        data_pages / 2
    );
    for pid in pids {
        assert_eq!(proc_status(pid, "TracerPid:"), "0");
    }
    eprintln!(
        "merging pages {counts:?}; {} remote syscalls, eintr_risk {}",
        stats["remote_syscalls"], stats["eintr_risk"]
    );
}

#[test]
fn python_workers_holding_the_same_data() {
    let worker = script(
        "worker.py",
        r#"
import hashlib, sys
# 64 MiB of weights, the same in every worker, in one buffer.
data = bytearray(b"".join(hashlib.sha256(b"w%d" % i).digest() * 128 for i in range(16384)))
expected = hashlib.sha256(data).hexdigest()
print("ready", flush=True)
for line in sys.stdin:
    print("ok" if hashlib.sha256(data).hexdigest() == expected else "bad", flush=True)
"#,
    );
    same_data_in_three(
        || {
            let mut c = Command::new("python3");
            c.arg(&worker);
            c
        },
        16384,
    );
}

#[test]
fn node_processes_computing_over_the_same_buffer() {
    let program = script(
        "buffer.js",
        r#"
const crypto = require('crypto');
const n = 32 << 20;
const b = Buffer.allocUnsafeSlow(n);
for (let i = 0; i < n; i++) b[i] = ((i * 31 + 7) ^ (i >>> 12)) & 0xff;
const digest = () => crypto.createHash('sha256').update(b).digest('hex');
const expected = digest();
let sum = 0;
// A timer keeps the event loop busy: epoll_wait with a timeout, as in any server.
setInterval(() => { for (let i = 0; i < n; i += 4096) sum = (sum + b[i]) >>> 0; }, 20);
console.log('ready');
require('readline').createInterface({ input: process.stdin }).on('line', () => {
  console.log(digest() === expected ? 'ok' : 'bad');
});
"#,
    );
    same_data_in_three(
        || {
            let mut c = Command::new("node");
            c.arg(&program);
            c
        },
        8192,
    );
}

#[test]
fn java_processes_computing_over_the_same_array() {
    let program = script(
        "Dup.java",
        r#"
import java.io.*;
import java.security.MessageDigest;
import java.util.Arrays;

public class Dup {
    static String digest(byte[] d) throws Exception {
        return Arrays.toString(MessageDigest.getInstance("SHA-256").digest(d));
    }
    public static void main(String[] args) throws Exception {
        byte[] d = new byte[32 << 20];
        for (int i = 0; i < d.length; i++) d[i] = (byte) ((i * 31 + 7) ^ (i >>> 12));
        String expected = digest(d);
        Thread worker = new Thread(() -> {
            long sum = 0;
            while (true) {
                for (int i = 0; i < d.length; i += 4096) sum += d[i];
                try { Thread.sleep(20); } catch (InterruptedException e) { return; }
            }
        });
        worker.setDaemon(true);
        worker.start();
        System.out.println("ready");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        while (in.readLine() != null) System.out.println(digest(d).equals(expected) ? "ok" : "bad");
    }
}
"#,
    );
    same_data_in_three(
        || {
            let mut c = Command::new("java");
            c.args([
                "-Xmx256m",
                "-XX:+UseSerialGC",
                "-XX:-UseTransparentHugePages",
            ])
            .arg(&program);
            c
        },
        8192,
    );
}

/// The newest PostgreSQL's binaries (Debian's layout).
fn postgres_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed (/usr/lib/postgresql)")
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("postgres").exists())
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL server binary")
}

/// Runs `program args` as the postgres user and checks it succeeded; returns its stdout.
fn as_postgres(program: &Path, args: &[&str]) -> String {
    let output = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{} {args:?}: {}",
        program.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A PostgreSQL cluster in a scratch directory, listening on a unix socket there only;
/// stopped and removed when dropped.
struct Postgres {
    bin: PathBuf,
    dir: PathBuf,
}

impl Postgres {
    const PORT: &'static str = "54329";

    fn start() -> Postgres {
        let bin = postgres_bin();
        let dir = std::env::temp_dir().join(format!("rksm-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let chown = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success());
        let data = dir.join("data");
        let (data_s, dir_s) = (data.to_str().unwrap(), dir.to_str().unwrap());
        as_postgres(
            &bin.join("initdb"),
            &["-D", data_s, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        let options = format!(
            "-k {dir_s} -p {} -c listen_addresses='' -c shared_buffers=64MB -c fsync=off",
            Self::PORT
        );
        let log = dir.join("log");
        as_postgres(
            &bin.join("pg_ctl"),
            &[
                "-D",
                data_s,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
        Postgres { bin, dir }
    }

    /// Runs pgbench with `args`, as the postgres user; returns its output.
    fn pgbench(&self, args: &[&str]) -> String {
        let mut all = vec!["-h", self.dir.to_str().unwrap(), "-p", Self::PORT];
        all.extend_from_slice(args);
        as_postgres(&self.bin.join("pgbench"), &all)
    }

    fn query(&self, sql: &str) -> String {
        let dir = self.dir.to_str().unwrap();
        as_postgres(
            &self.bin.join("psql"),
            &["-h", dir, "-p", Self::PORT, "-At", "-c", sql, "postgres"],
        )
        .trim()
        .to_string()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn postgres_under_pgbench_commits_every_transaction() {
    require_root();
    let _turn = ksm_turn();
    let pg = Postgres::start();
    pg.pgbench(&["-i", "-s", "2", "-q", "postgres"]);
    // Every postgres process, backends coming and going included.
    let daemon = Daemon::over(&["--comm".into(), "^postgres$".into()]);
    assert!(wait_for(Duration::from_secs(30), || daemon.passes() >= 2));
    let report = pg.pgbench(&["-c", "4", "-j", "2", "-T", "15", "postgres"]);
    let passes = daemon.passes();
    let stats = daemon.stop();
    let failed = report
        .lines()
        .find(|l| l.starts_with("number of failed transactions"))
        .unwrap_or("number of failed transactions: 0");
    assert!(failed.contains(": 0 "), "{report}");
    let processed: u64 = report
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|n| n.split('/').next()?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{report}"));
    assert!(processed > 100, "{report}");
    assert_eq!(pg.query("select count(*) from pgbench_accounts"), "200000");
    assert!(passes >= 10, "only {passes} passes during the benchmark");
    eprintln!(
        "pgbench: {processed} transactions; rksm: {} pages sharing, {} remote syscalls, eintr_risk {}",
        stats["pages_sharing"], stats["remote_syscalls"], stats["eintr_risk"]
    );
}

/// The guest image `cargo xtask test` builds (or `RKSM_GUEST_INITRD`).
fn guest_image() -> GuestImage {
    let initrd = std::env::var_os("RKSM_GUEST_INITRD").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/guest/initrd.cpio"),
        PathBuf::from,
    );
    GuestImage::new(&initrd, None).unwrap_or_else(|e| {
        panic!("{e} (run the tests with `cargo xtask test`, which builds the image)")
    })
}

#[test]
fn qemu_guests_that_mark_their_own_ram_keep_running_and_keep_their_memory() {
    require_root();
    let _turn = ksm_turn();
    let image = guest_image();
    let memory = GuestMemory {
        ram_mib: 256,
        duplicate_mib: 64,
        unique_mib: 32,
    };
    let mut guests: Vec<GuestProcess> = (0..2)
        .map(|i| GuestProcess::start(&image, memory, i).unwrap())
        .collect();
    let deadline = std::time::Instant::now() + guest::BOOT_DEADLINE;
    for g in &mut guests {
        g.ready(deadline).unwrap();
    }
    let pids: Vec<u32> = guests.iter().map(GuestProcess::pid).collect();
    let daemon = Daemon::pids(&pids);
    // 64 MiB the same in both guests: 16384 pages each.
    let enough = merged(&pids, 12_000, Duration::from_secs(120));
    let counts: Vec<u64> = pids.iter().map(|&p| ksm_merging_pages(p)).collect();
    for g in &mut guests {
        assert_eq!(g.verify(), "ok", "guest {} lost memory", g.pid());
    }
    let stats = daemon.stop();
    assert!(enough, "merging pages {counts:?}");
    for g in &mut guests {
        assert_eq!(g.verify(), "ok", "guest {} after rksm", g.pid());
        assert_eq!(proc_status(g.pid(), "TracerPid:"), "0");
    }
    eprintln!(
        "guests merging {counts:?}; {} remote syscalls, eintr_risk {}",
        stats["remote_syscalls"], stats["eintr_risk"]
    );
}

/// Keeps giving `child` fresh duplicates (the same new content in two pages of `region`,
/// written from outside with process_vm_writev) so that every pass has something to mark
/// and borrows it, until `done`.
fn keep_making_work(
    pid: u32,
    base: u64,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut round = 0u64;
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            round += 1;
            let page = vec![(round % 251) as u8 + 1; PAGE as usize];
            for slot in 0..2 {
                let local = libc::iovec {
                    iov_base: page.as_ptr() as *mut libc::c_void,
                    iov_len: page.len(),
                };
                let remote = libc::iovec {
                    iov_base: (base + ((round * 2 + slot) % 256) * PAGE) as *mut libc::c_void,
                    iov_len: page.len(),
                };
                // SAFETY: one local iovec over `page`, one remote; the kernel checks the
                // remote range.
                unsafe { libc::process_vm_writev(pid as i32, &local, 1, &remote, 1, 0) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        round
    })
}

#[test]
fn an_idle_event_loop_sees_no_eintr_and_queued_signals_arrive_intact() {
    require_root();
    let _turn = ksm_turn();
    let mut idle = TestChild::spawn();
    let mut flooded = TestChild::spawn();
    let mut timed = TestChild::spawn();
    let regions = [idle.map(256), flooded.map(256), timed.map(256)];
    let pids = [
        idle.pid_from_proc(),
        flooded.pid_from_proc(),
        timed.pid_from_proc(),
    ];
    let daemon = Daemon::pids(&pids);
    assert!(wait_for(Duration::from_secs(10), || daemon.passes() >= 1));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let makers: Vec<_> = pids
        .iter()
        .zip(&regions)
        .map(|(&pid, r)| keep_making_work(pid, r.base, done.clone()))
        .collect();
    let passes_before = daemon.passes();
    idle.send("epoll 6000 -1");
    // An event loop between timers: waits of 50 ms.
    timed.send("epoll 6000 50 longest");
    flooded.send("signals 20000");
    assert_eq!(flooded.reply(), "listening");
    for value in 0..20_000u64 {
        assert!(
            queue_signal(pids[1], value),
            "signal {value} could not be queued"
        );
        if value % 1000 == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let signals = flooded.reply();
    let epoll = idle.reply();
    let timed_epoll = timed.reply();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for m in makers {
        m.join().unwrap();
    }
    let passes = daemon.passes() - passes_before;
    let stats = daemon.stop();
    assert_eq!(signals, "signals ok");
    assert_eq!(epoll, "epoll eintr 0");
    assert!(
        timed_epoll.starts_with("epoll eintr 0 "),
        "{timed_epoll}: {stats}"
    );
    assert!(passes >= 10, "only {passes} passes meanwhile");
    assert!(
        stats["remote_syscalls"].as_u64().unwrap() >= 10,
        "the targets were hardly borrowed: {stats}"
    );
    assert_eq!(stats["eintr_risk"].as_u64(), Some(0), "{stats}");
}

/// Blocks `stuck` in the kernel with `block`, checks the daemon's passes go on while it is
/// (the target is refused for those passes), then lets it go with `unblock` and checks it
/// is intact and untraced.
fn stuck_target_does_not_hold_the_daemon_up(
    block: impl FnOnce(&mut TestChild),
    unblock: impl FnOnce(),
    answer: &str,
) {
    require_root();
    let _turn = ksm_turn();
    let mut stuck = TestChild::spawn();
    let region = stuck.map(64);
    stuck.write(region, 0, 64, 3);
    let pid = stuck.pid_from_proc();
    let daemon = Daemon::pids(&[pid]);
    assert!(wait_for(Duration::from_secs(10), || daemon.passes() >= 1));
    block(&mut stuck);
    assert!(wait_for(Duration::from_secs(5), || proc_status(
        pid, "State:"
    )
    .starts_with('D')));
    let before = daemon.passes();
    let went_on = wait_for(Duration::from_secs(3), || daemon.passes() >= before + 3);
    let still_stuck = proc_status(pid, "State:").starts_with('D');
    unblock();
    assert!(
        went_on,
        "passes stopped while the target was stuck in the kernel"
    );
    assert!(still_stuck, "the wait ended early");
    assert!(stuck.reply().starts_with(answer));
    let stats = daemon.stop();
    assert!(
        stats["targets_refused"]["uninterruptible_sleep"].as_u64() >= Some(1),
        "{stats}"
    );
    assert!(stuck.verify(region, 0, 64, 3));
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
}

#[test]
fn a_process_stuck_in_a_vfork_wait_does_not_hold_the_daemon_up() {
    stuck_target_does_not_hold_the_daemon_up(|child| child.send("vfork 4000"), || {}, "vforked");
}

/// A FUSE file system whose server never answers (it never reads /dev/fuse): every access
/// waits in the kernel, killable only, until the connection is aborted when dropped.
struct DeadFuse {
    dir: PathBuf,
    device: Option<std::fs::File>,
}

impl DeadFuse {
    fn mount() -> DeadFuse {
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("rksm-fuse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let device = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .expect("/dev/fuse");
        let options = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            device.as_raw_fd()
        );
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (source, target, fstype, data) = (
            c("rksm-dead"),
            c(dir.to_str().unwrap()),
            c("fuse"),
            c(&options),
        );
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let r = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                data.as_ptr() as *const libc::c_void,
            )
        };
        assert_eq!(r, 0, "mount fuse: {}", std::io::Error::last_os_error());
        DeadFuse {
            dir,
            device: Some(device),
        }
    }

    /// Aborts the connection (closing the device): waiting requests fail with ENOTCONN.
    fn abort(&mut self) {
        self.device.take();
    }
}

impl Drop for DeadFuse {
    fn drop(&mut self) {
        self.abort();
        let target = std::ffi::CString::new(self.dir.to_str().unwrap()).unwrap();
        // SAFETY: umount2 with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_process_stuck_on_an_unanswered_fuse_request_does_not_hold_the_daemon_up() {
    let fuse = std::cell::RefCell::new(DeadFuse::mount());
    let path = fuse.borrow().dir.join("anything");
    stuck_target_does_not_hold_the_daemon_up(
        |child| child.send(&format!("stat {}", path.display())),
        || fuse.borrow_mut().abort(),
        "stat error",
    );
}
