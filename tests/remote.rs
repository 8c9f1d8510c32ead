//! Remote system calls against real processes: they run, and the target is left as it was.

use std::time::{Duration, Instant};

use rksm::kernel::{
    process::{Process, RefusalReason, TargetError},
    reader::ProcMem,
    remote::{nr, Borrower, RemoteError, RemoteRefusal, RemoteSession},
};
use rksm_tests::{
    blocked_syscall, fd_count, proc_status, queue_signal, require_root, vma_mergeable, wait_for,
    TestChild, PAGE,
};

const MADV_MERGEABLE: u64 = 12;

/// Waits until the child is asleep again (blocked in its read of stdin).
fn asleep(pid: u32) -> bool {
    wait_for(Duration::from_secs(5), || {
        proc_status(pid, "State:").starts_with('S')
    })
}

#[test]
fn a_remote_madvise_runs_and_the_target_is_left_exactly_as_it_was() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let region = child.map(64);
    child.write(region, 0, 64, 1);
    let pid = child.pid();
    assert!(asleep(pid));
    let (syscall_before, fds_before) = (blocked_syscall(pid), fd_count(pid));
    assert!(!vma_mergeable(pid, region.base));

    let mut session = RemoteSession::begin(&borrower, &Process::open(pid).unwrap()).unwrap();
    assert_eq!(
        proc_status(pid, "State:").chars().next(),
        Some('t'),
        "held in a trace stop"
    );
    assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
    assert_eq!(
        session
            .syscall(nr::MADVISE, &[region.base, 64 * PAGE, MADV_MERGEABLE])
            .unwrap(),
        0
    );
    assert_eq!(
        session
            .syscall(nr::MADVISE, &[region.base + 1, PAGE, MADV_MERGEABLE])
            .unwrap(),
        -22,
        "EINVAL comes back as -22"
    );
    // The three, and the question every borrow asks first: is the process dumpable?
    assert_eq!(session.finish().unwrap(), 4);

    assert!(
        vma_mergeable(pid, region.base),
        "madvise did not take effect"
    );
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    assert!(
        asleep(pid),
        "target left stopped: {}",
        proc_status(pid, "State:")
    );
    // Same system call, same arguments, same stack and instruction pointer: registers intact.
    assert_eq!(blocked_syscall(pid), syscall_before);
    assert_eq!(fd_count(pid), fds_before);
    // And the read it was sleeping in still works.
    assert!(child.verify(region, 0, 64, 1));
}

#[test]
fn a_target_asleep_in_a_restartable_syscall_finishes_its_sleep() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    let started = Instant::now();
    child.send("sleep 600");
    assert!(
        wait_for(Duration::from_secs(5), || blocked_syscall(pid)
            .starts_with("230 ")),
        "{}",
        blocked_syscall(pid)
    );
    let mut session = RemoteSession::begin(&borrower, &Process::open(pid).unwrap()).unwrap();
    for _ in 0..50 {
        assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
    }
    session.finish().unwrap();
    assert_eq!(child.reply(), "slept");
    let slept = started.elapsed();
    assert!(
        slept >= Duration::from_millis(600),
        "the sleep was cut short: {slept:?}"
    );
    assert!(
        slept < Duration::from_secs(5),
        "the sleep did not resume: {slept:?}"
    );
}

#[test]
fn other_threads_keep_running_while_one_is_borrowed() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let counter = child.threads(3);
    let pid = child.pid();
    let mem = ProcMem::open(pid).unwrap();
    let read_counter = || {
        let mut page = vec![0u8; PAGE as usize];
        let base = counter & !(PAGE - 1);
        assert!(mem.read_page(base, &mut page));
        let at = (counter - base) as usize;
        u64::from_ne_bytes(page[at..at + 8].try_into().unwrap())
    };
    let mut session = RemoteSession::begin(&borrower, &Process::open(pid).unwrap()).unwrap();
    let before = read_counter();
    assert!(
        wait_for(Duration::from_secs(5), || read_counter() > before + 100),
        "threads stopped with the borrowed one"
    );
    assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
    session.finish().unwrap();
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    // The borrowed (main) thread answers commands again.
    let region = child.map(1);
    child.write(region, 0, 1, 5);
    assert!(child.verify(region, 0, 1, 5));
}

#[test]
fn traced_and_seccomp_targets_are_refused_and_untouched() {
    require_root();
    let borrower = Borrower::new();
    // Traced: this test process seizes the child first, as a debugger would.
    let child = TestChild::spawn();
    let pid = child.pid();
    assert!(asleep(pid));
    let before = blocked_syscall(pid);
    let tid = nix::unistd::Pid::from_raw(pid as i32);
    nix::sys::ptrace::seize(tid, nix::sys::ptrace::Options::empty()).unwrap();
    match RemoteSession::begin(&borrower, &Process::open(pid).unwrap()) {
        Err(RemoteError::Refused {
            reason: RemoteRefusal::Traced,
            ..
        }) => {}
        other => panic!(
            "a traced target was not refused: {:?}",
            other.map(|s| s.pid())
        ),
    }
    // A seized tracee can only be detached from a stop.
    nix::sys::ptrace::interrupt(tid).unwrap();
    nix::sys::wait::waitpid(tid, Some(nix::sys::wait::WaitPidFlag::__WALL)).unwrap();
    nix::sys::ptrace::detach(tid, None).unwrap();
    assert!(asleep(pid));
    assert_eq!(blocked_syscall(pid), before);

    let mut filtered = TestChild::spawn();
    filtered.seccomp();
    let pid = filtered.pid();
    assert!(asleep(pid));
    let before = blocked_syscall(pid);
    match RemoteSession::begin(&borrower, &Process::open(pid).unwrap()) {
        Err(RemoteError::Refused {
            reason: RemoteRefusal::Seccomp,
            ..
        }) => {}
        other => panic!(
            "a seccomp target was not refused: {:?}",
            other.map(|s| s.pid())
        ),
    }
    assert_eq!(blocked_syscall(pid), before);
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    assert!(asleep(pid));
}

#[test]
fn a_target_killed_while_borrowed_is_reported_gone_without_hanging() {
    require_root();
    let borrower = Borrower::new();
    let child = TestChild::spawn();
    let pid = child.pid();
    // Once it waits for commands it has exec'd and has its vDSO.
    assert!(asleep(pid));
    let mut session = RemoteSession::begin(&borrower, &Process::open(pid).unwrap()).unwrap();
    assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
    // The kill lands in the middle of a borrow: this test's thread traces the target, and
    // the target sits in a tracing stop, as the kernel itself says.
    assert_eq!(
        proc_status(pid, "TracerPid:"),
        nix::unistd::gettid().to_string(),
        "not borrowed by this thread"
    );
    assert!(
        proc_status(pid, "State:").starts_with("t (tracing stop)"),
        "not held in a tracing stop: {}",
        proc_status(pid, "State:")
    );
    // SAFETY: kill with a valid pid and signal.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    match session.syscall(nr::GETPID, &[]) {
        Err(RemoteError::Gone(p)) => assert_eq!(p, pid),
        other => panic!("expected Gone, got {other:?}"),
    }
    // Letting go of a dead thread is not an error worth more than a log line.
    let _ = session.finish();
    // Its exit is reported to its tracer first: until rksm takes that report, the parent
    // (here the same process, elsewhere a service manager) cannot reap it.
    let me = nix::unistd::gettid().to_string();
    assert!(
        wait_for(Duration::from_secs(5), || {
            borrower.reap_lingering();
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .map_or(true, |s| !s.contains(&format!("TracerPid:\t{me}\n")))
        }),
        "the dead target is still traced by rksm: its parent cannot reap it"
    );
    drop(child);
}

/// Borrows `process` once for a `getpid`.
fn borrow_once(borrower: &Borrower, process: &Process) {
    let mut session = RemoteSession::begin(borrower, process).expect("borrow");
    assert_eq!(
        session.syscall(nr::GETPID, &[]).unwrap(),
        i64::from(process.pid())
    );
    session.finish().unwrap();
}

/// Waits until `pid`'s only thread sleeps in system call `nr`.
fn asleep_in(pid: u32, nr: i64) -> bool {
    asleep_as(pid, nr, 'S')
}

/// Whether `pid` comes to sleep in system call `nr` in state `state` within 5 s.
fn asleep_as(pid: u32, nr: i64, state: char) -> bool {
    wait_for(Duration::from_secs(5), || {
        blocked_syscall(pid).starts_with(&format!("{nr} "))
            && proc_status(pid, "State:").starts_with(state)
    })
}

#[test]
fn an_event_loop_waiting_without_a_timeout_never_sees_eintr() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    child.send("epoll 4000 -1");
    assert!(asleep_in(pid, libc::SYS_epoll_wait));
    let process = Process::open(pid).unwrap();
    for _ in 0..20 {
        assert!(
            asleep_in(pid, libc::SYS_epoll_wait),
            "{}",
            blocked_syscall(pid)
        );
        borrow_once(&borrower, &process);
    }
    assert_eq!(
        child.reply(),
        "epoll eintr 0",
        "the restarted wait was noticed"
    );
}

#[test]
fn an_event_loop_whose_sigterm_arrives_during_a_borrow_sees_its_eintr_and_stops() {
    require_root();
    let borrower = Borrower::new();
    for round in 0..20 {
        let mut child = TestChild::spawn();
        let pid = child.pid();
        child.send("epollstop");
        assert!(asleep_in(pid, libc::SYS_epoll_wait));
        let process = Process::open(pid).unwrap();
        let mut session = RemoteSession::begin(&borrower, &process).expect("borrow");
        // The signal comes while the thread is held: the kernel would have ended the wait
        // with EINTR and run the handler; so must the thread once let go.
        // SAFETY: kill with a valid pid and signal.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
        assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
        session.finish().unwrap();
        // Stopped, it replies and reads its next command.
        assert!(
            asleep_in(pid, libc::SYS_read),
            "round {round}: the loop never saw its stop (the handler ran, the wait went on): {}",
            blocked_syscall(pid)
        );
        assert!(child.reply().starts_with("stopped after"), "round {round}");
    }
}

#[test]
fn a_timed_wait_a_borrow_interrupts_goes_on_for_the_time_it_had_left() {
    require_root();
    let borrower = Borrower::new();
    let Ok(watch) = rksm::ebpf::waits::install(&mut rksm::ebpf::Object::new()) else {
        eprintln!("skipped: the wait watch does not load here");
        return;
    };
    let mut child = TestChild::spawn();
    let pid = child.pid();
    watch.watch(pid);
    // Waits of 400 ms until a timer fires after 4 s, as an idle event loop between timers.
    child.send("epoll 4000 400 longest");
    assert!(asleep_in(pid, libc::SYS_epoll_wait));
    let process = Process::open(pid).unwrap();
    for _ in 0..15 {
        assert!(asleep_in(pid, libc::SYS_epoll_wait));
        borrow_once(&borrower, &process);
        std::thread::sleep(Duration::from_millis(150));
    }
    let reply = child.reply();
    let words: Vec<&str> = reply.split_whitespace().collect();
    assert_eq!(&words[..3], ["epoll", "eintr", "0"], "{reply}");
    // Entered again with the full 400 ms, a wait cut short at 300 ms would last 700.
    let longest: u64 = words[4].parse().unwrap();
    assert!(
        longest < 480,
        "a wait was lengthened to {longest} ms: {reply}"
    );
    assert!(borrower.counters().timed_restarts >= 15);
    watch.unwatch(pid);
}

#[test]
fn an_eintr_that_cannot_be_avoided_is_counted() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    // A wait with a timeout cannot be restarted without lengthening it: EINTR stands.
    child.send("epoll 2000 60000");
    assert!(asleep_in(pid, libc::SYS_epoll_wait));
    let process = Process::open(pid).unwrap();
    borrow_once(&borrower, &process);
    assert_eq!(child.reply(), "epoll eintr 1");
    assert_eq!(
        borrower.counters().eintr_risk,
        1,
        "the EINTR was not counted"
    );
}

#[test]
fn queued_signals_keep_their_payload_and_order_while_the_target_is_borrowed() {
    require_root();
    const SIGNALS: u64 = 3000;
    let mut child = TestChild::spawn();
    let pid = child.pid();
    child.send(&format!("signals {SIGNALS}"));
    assert_eq!(child.reply(), "listening");
    use std::sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Arc,
    };
    let (done, borrows) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let borrower = {
        let (done, borrows) = (done.clone(), borrows.clone());
        std::thread::spawn(move || {
            let (borrower, process) = (Borrower::new(), Process::open(pid).unwrap());
            while !done.load(SeqCst) {
                borrow_once(&borrower, &process);
                borrows.fetch_add(1, SeqCst);
            }
        })
    };
    for value in 0..SIGNALS {
        if value % 50 == 0 {
            // Interleave: a borrow between every 50 signals.
            let seen = borrows.load(SeqCst);
            assert!(wait_for(Duration::from_secs(10), || borrows.load(SeqCst) > seen));
        }
        assert!(
            queue_signal(pid, value),
            "signal {value} could not be queued"
        );
    }
    let answer = child.reply();
    done.store(true, SeqCst);
    borrower.join().unwrap();
    assert_eq!(answer, "signals ok");
    assert!(borrows.load(SeqCst) >= SIGNALS / 50);
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    assert_eq!(
        proc_status(pid, "SigBlk:"),
        "0000000000000000",
        "mask not restored"
    );
}

#[test]
fn a_process_in_a_vfork_wait_is_refused_without_waiting() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    child.send("vfork 3000");
    // In the vfork wait: asleep uninterruptibly inside clone(2). (A 'D' alone can be a page
    // fault on the way there, which a cold binary takes: a CI run once looked then.)
    assert!(asleep_as(pid, libc::SYS_clone, 'D'));
    let started = Instant::now();
    let refused = RemoteSession::begin(&borrower, &Process::open(pid).unwrap());
    assert!(
        matches!(
            refused,
            Err(RemoteError::Refused {
                reason: RemoteRefusal::UninterruptibleSleep,
                ..
            })
        ),
        "{:?}",
        refused.map(|_| ())
    );
    assert!(
        started.elapsed() < rksm::kernel::remote::STOP_DEADLINE,
        "it waited"
    );
    assert_eq!(child.reply(), "vforked");
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    // And once the wait is over it is borrowed as any other.
    borrow_once(&Borrower::new(), &Process::open(pid).unwrap());
}

#[test]
fn init_non_dumpable_and_set_id_processes_are_off_limits() {
    require_root();
    let refusal = |pid: u32| match Process::open(pid) {
        Err(TargetError::Refused { reason, .. }) => Some(reason),
        Ok(_) => None,
        Err(e) => panic!("pid {pid}: {e}"),
    };
    assert_eq!(refusal(1), Some(RefusalReason::Init));

    let mut plain = TestChild::spawn();
    let mut nobody = TestChild::spawn_as_nobody();
    let mut secretive = TestChild::spawn_as_nobody();
    let mut setuid = TestChild::spawn();
    secretive.command("nodump");
    setuid.command("setids");
    assert_eq!(refusal(plain.pid_from_proc()), None);
    assert_eq!(
        refusal(nobody.pid_from_proc()),
        None,
        "a dumpable user process"
    );
    assert_eq!(
        refusal(secretive.pid_from_proc()),
        Some(RefusalReason::NonDumpable)
    );
    assert_eq!(refusal(setuid.pid_from_proc()), Some(RefusalReason::SetId));
}

/// A 32-bit (i386) program of 93 bytes that loops in `pause()` through `int 0x80`: a
/// compat-mode process, where `syscall` and the call numbers mean something else.
fn compat_program() -> std::path::PathBuf {
    const BASE: u32 = 0x0804_8000;
    // mov eax, 29 (pause); int 0x80; jmp back to the mov.
    let code = [0xb8, 0x1d, 0, 0, 0, 0xcd, 0x80, 0xeb, 0xf7];
    let total = (52 + 32 + code.len()) as u32;
    let mut elf = b"\x7fELF\x01\x01\x01".to_vec();
    elf.resize(16, 0);
    for (v, size) in [
        (2, 2),         // e_type: executable
        (3, 2),         // e_machine: i386
        (1, 4),         // e_version
        (BASE + 84, 4), // e_entry: the code, after both headers
        (52, 4),        // e_phoff
        (0, 4),         // e_shoff
        (0, 4),         // e_flags
        (52, 2),        // e_ehsize
        (32, 2),        // e_phentsize
        (1, 2),         // e_phnum
        (0, 2),         // e_shentsize
        (0, 2),         // e_shnum
        (0, 2),         // e_shstrndx
        (1, 4),         // p_type: PT_LOAD
        (0, 4),         // p_offset
        (BASE, 4),      // p_vaddr
        (BASE, 4),      // p_paddr
        (total, 4),     // p_filesz
        (total, 4),     // p_memsz
        (5, 4),         // p_flags: read, execute
        (0x1000, 4),    // p_align
    ] {
        elf.extend_from_slice(&u32::to_le_bytes(v)[..size]);
    }
    elf.extend_from_slice(&code);
    let path = std::env::temp_dir().join(format!("rksm-compat-{}", std::process::id()));
    std::fs::write(&path, &elf).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_32bit_process_is_refused_untouched() {
    require_root();
    let borrower = Borrower::new();
    let program = compat_program();
    // Another test's fork may hold the file open for writing for a moment (ETXTBSY).
    let mut spawned = None;
    assert!(wait_for(Duration::from_secs(5), || {
        spawned = std::process::Command::new(&program).spawn().ok();
        spawned.is_some()
    }));
    let mut child = spawned.unwrap();
    let pid = child.id();
    assert!(
        wait_for(Duration::from_secs(5), || blocked_syscall(pid)
            .starts_with("29 ")),
        "the 32-bit program did not start: {}",
        blocked_syscall(pid)
    );
    let refused = RemoteSession::begin(&borrower, &Process::open(pid).unwrap());
    assert!(
        matches!(
            refused,
            Err(RemoteError::Refused {
                reason: RemoteRefusal::Compat,
                ..
            })
        ),
        "{:?}",
        refused.map(|_| ())
    );
    assert_eq!(proc_status(pid, "TracerPid:"), "0");
    assert!(blocked_syscall(pid).starts_with("29 "), "it was disturbed");
    child.kill().unwrap();
    child.wait().unwrap();
    std::fs::remove_file(program).unwrap();
}

#[test]
fn a_thread_borrowed_inside_an_rseq_critical_section_aborts_it_as_the_kernel_would() {
    require_root();
    let borrower = Borrower::new();
    let mut child = TestChild::spawn();
    // Its answer proves it runs its own program (the exec is done).
    let pid = child.pid_from_proc();
    // Two threads share CPU 0 and one counter; the sections are long, so most borrows stop
    // a thread inside one while the other keeps adding.
    child.send("rseq 6000 2 3000");
    let process = Process::open(pid).unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || proc_status(pid, "Threads:")
            == "3"),
        "the workers did not start"
    );
    let started = Instant::now();
    let mut borrows = 0;
    while started.elapsed() < Duration::from_secs(4) {
        match RemoteSession::begin(&borrower, &process) {
            Ok(mut session) => {
                assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
                session.finish().unwrap();
                borrows += 1;
            }
            Err(e) => panic!("borrow {borrows}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let reply = child.reply();
    let words: Vec<&str> = reply.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"rseq"), "{reply}");
    assert_eq!(
        words[2], words[4],
        "counter vs commits after {borrows} borrows: an update was lost ({reply})"
    );
    assert!(
        borrower.counters().rseq_aborts > 0,
        "no borrow of {borrows} stopped a thread inside a section: the test proves nothing"
    );
}

/// Drops `CAP_SYS_RESOURCE` from the calling thread (capabilities are per thread), as the
/// unit's bounding set leaves rksm without it.
fn drop_sys_resource_in_this_thread() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, as the kernel expects.
    unsafe {
        assert_eq!(
            libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
            0
        );
        let bit = 1 << 24; // CAP_SYS_RESOURCE
        data[0].effective &= !bit;
        data[0].permitted &= !bit;
        assert_eq!(
            libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()),
            0
        );
    }
}

fn oom_score_adj() -> i32 {
    std::fs::read_to_string("/proc/self/oom_score_adj")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn rksm_is_out_of_the_oom_killers_reach_only_while_it_holds_a_thread() {
    require_root();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    assert!(asleep(pid));
    // In a thread of its own: it gives up a capability, as the unit's rksm never has it.
    std::thread::spawn(move || {
        // What the unit's OOMScoreAdjust does before rksm starts (systemd has the capability).
        if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
            eprintln!(
                "skipped: this machine cannot lower oom_score_adj ({e}: no CAP_SYS_RESOURCE even for root); the kernel matrix's guests run it"
            );
            return;
        }
        drop_sys_resource_in_this_thread();
        assert_eq!(rksm::kernel::oom::init().unwrap(), -1000);
        let borrower = Borrower::new();
        assert!(
            wait_for(Duration::from_secs(10), || oom_score_adj() == 0),
            "rksm runs as an ordinary OOM candidate: {}",
            oom_score_adj()
        );
        let mut session = RemoteSession::begin(&borrower, &Process::open(pid).unwrap()).unwrap();
        assert_eq!(oom_score_adj(), -1000, "not shielded while it holds a thread");
        assert_eq!(session.syscall(nr::GETPID, &[]).unwrap(), i64::from(pid));
        session.finish().unwrap();
        assert!(
            wait_for(Duration::from_secs(10), || oom_score_adj() == 0),
            "still shielded after the borrow: {}",
            oom_score_adj()
        );
    })
    .join()
    .unwrap();
    let region = child.map(1);
    child.write(region, 0, 1, 3);
    assert!(child.verify(region, 0, 1, 3));
}
