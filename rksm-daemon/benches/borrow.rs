//! What a borrow costs: stopping one thread of a sleeping process, one system call inside it,
//! and letting it go (`RemoteSession::begin` + `getpid` + `finish`), and one more call in a
//! borrow already made. Needs root (ptrace of another process).

use std::process::{Command, Stdio};

use criterion::{criterion_group, criterion_main, Criterion};
use rksm::kernel::{
    process::Process,
    remote::{nr, Borrower, RemoteSession},
};

fn borrow(c: &mut Criterion) {
    // A process asleep in clock_nanosleep, as most targets are most of the time.
    let mut sleeper = Command::new("sleep")
        .arg("1000")
        .stdin(Stdio::null())
        .spawn()
        .expect("sleep");
    let pid = sleeper.id();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |c| c.trim() != "sleep")
    {
        assert!(std::time::Instant::now() < deadline, "sleep did not start");
        std::thread::yield_now();
    }
    let process = Process::open(pid).expect("open the sleeper");
    let borrower = Borrower::new();
    let mut group = c.benchmark_group("borrow");
    group.bench_function("begin_getpid_finish", |b| {
        b.iter(|| {
            let mut session = RemoteSession::begin(&borrower, &process).unwrap();
            session.syscall(nr::GETPID, &[]).unwrap();
            session.finish().unwrap()
        })
    });
    let mut session = RemoteSession::begin(&borrower, &process).unwrap();
    group.bench_function("one_more_call", |b| {
        b.iter(|| session.syscall(nr::GETPID, &[]).unwrap())
    });
    drop(session);
    group.finish();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}

criterion_group!(benches, borrow);
criterion_main!(benches);
