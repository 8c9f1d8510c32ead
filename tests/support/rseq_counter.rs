//! A per-CPU counter updated in a real rseq critical section, as tcmalloc and librseq update
//! theirs: the counter is loaded, worked on for a while, and stored by one committing
//! instruction; a preemption anywhere in between sends the thread to the abort handler,
//! which retries. Threads pinned to one CPU share the counter: the counter equals the sum of
//! the commits exactly when no section ever completed after a preemption.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The signature the kernel checks before an abort handler (librseq's for x86).
const RSEQ_SIG: u32 = 0x5305_3053;

/// `struct rseq` as the kernel wants it registered: 32 bytes, 32-aligned.
#[repr(C, align(32))]
struct Rseq {
    cpu_id_start: u32,
    cpu_id: u32,
    rseq_cs: u64,
    flags: u32,
    node_id: u32,
    mm_cid: u32,
    pad: u32,
}

extern "C" {
    /// Offset of glibc's registered area from the thread pointer (glibc 2.35).
    static __rseq_offset: isize;
    /// Its size, 0 if glibc did not register one.
    static __rseq_size: libc::c_uint;
}

thread_local! {
    static OWN: std::cell::UnsafeCell<Rseq> = const {
        std::cell::UnsafeCell::new(Rseq {
            cpu_id_start: 0, cpu_id: u32::MAX, rseq_cs: 0, flags: 0, node_id: 0, mm_cid: 0, pad: 0,
        })
    };
}

/// This thread's registered rseq area: glibc's, or one registered here if glibc has none.
fn area() -> Result<*mut Rseq, String> {
    // SAFETY: glibc defines both symbols (2.35 and later); they are constants after start-up.
    if unsafe { __rseq_size } != 0 {
        let tp: usize;
        // SAFETY: on x86_64 the word at %fs:0 is the thread pointer itself.
        unsafe { core::arch::asm!("mov {}, fs:0", out(reg) tp) };
        // SAFETY: see above.
        return Ok((tp as isize + unsafe { __rseq_offset }) as *mut Rseq);
    }
    let own = OWN.with(|own| own.get());
    // SAFETY: registers this thread's own 32-byte area, which lives as long as the thread
    // (the kernel unregisters it at exit).
    let r = unsafe { libc::syscall(libc::SYS_rseq, own, 32u32, 0, RSEQ_SIG) };
    if r != 0 {
        return Err(format!("rseq: {}", std::io::Error::last_os_error()));
    }
    Ok(own)
}

/// One attempt: adds 1 to `*counter` if the thread stays on `cpu` and is not preempted from
/// the load to the store; false if it was sent to the abort handler. `spin` is how long the
/// section works between the two.
///
/// # Safety
/// `rseq` is this thread's registered area and `counter` a valid u64 only ever written in
/// such sections by threads on `cpu`.
unsafe fn increment(rseq: *mut Rseq, counter: *mut u64, cpu: u32, spin: u64) -> bool {
    let committed: u64;
    // SAFETY: see the function's contract; the descriptor is static data, the section
    // touches only `counter` and the scratch registers declared.
    unsafe {
        core::arch::asm!(
            ".pushsection .data.rksm_rseq_cs, \"aw\"",
            ".balign 32",
            "3:",
            ".long 0, 0",
            ".quad 7f, 8f - 7f, 4f",
            ".popsection",
            "lea rax, [rip + 3b]",
            "mov qword ptr [{rseq} + 8], rax",
            "7:",
            "cmp dword ptr [{rseq} + 4], {cpu:e}",
            "jne 4f",
            "mov rax, qword ptr [{counter}]",
            "mov rcx, {spin}",
            "5:",
            "pause",
            "dec rcx",
            "jnz 5b",
            "inc rax",
            "mov qword ptr [{counter}], rax",
            "8:",
            "mov {committed}, 1",
            "jmp 6f",
            ".long {sig}",
            "4:",
            "mov {committed}, 0",
            "6:",
            rseq = in(reg) rseq,
            counter = in(reg) counter,
            cpu = in(reg) cpu,
            spin = in(reg) spin,
            sig = const RSEQ_SIG,
            committed = out(reg) committed,
            out("rax") _,
            out("rcx") _,
            options(nostack),
        );
    }
    committed == 1
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is the empty set; the calls write only into it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
            return Err(format!(
                "sched_setaffinity: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Runs `threads` threads pinned to CPU 0 for `ms` milliseconds, each adding to one shared
/// counter in rseq sections; returns the reply `rseq counter C commits N aborts A`.
pub fn run(ms: u64, threads: usize, spin: u64) -> Result<String, String> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || -> Result<(u64, u64), String> {
                pin(0)?;
                let rseq = area()?;
                let (mut commits, mut aborts) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: `rseq` is this thread's area, the counter is only written here
                    // by threads pinned to CPU 0.
                    if unsafe { increment(rseq, COUNTER.as_ptr(), 0, spin) } {
                        commits += 1;
                    } else {
                        aborts += 1;
                    }
                }
                Ok((commits, aborts))
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(ms));
    stop.store(true, Ordering::Relaxed);
    let (mut commits, mut aborts) = (0, 0);
    for worker in workers {
        let (c, a) = worker.join().map_err(|_| "a worker panicked")??;
        commits += c;
        aborts += a;
    }
    Ok(format!(
        "rseq counter {} commits {commits} aborts {aborts}",
        COUNTER.load(Ordering::Relaxed)
    ))
}
