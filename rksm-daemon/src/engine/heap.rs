//! The daemon's heap: one arena, and freed memory handed back after large work.
//!
//! rksm's tables grow with the memory it watches, and a first pass over a large target
//! builds and drops tens of megabytes of batches and caches. glibc keeps freed memory for
//! reuse, and gives every thread that allocates an arena of its own: the reader threads of
//! a large pass each kept megabytes of freed memory resident in theirs, in a process that
//! otherwise lives on its tables alone. So the daemon asks for one arena (the readers
//! allocate little, and rarely: their buffers go round), and hands freed memory back after a
//! pass that took up much memory.

/// Makes every thread allocate from one arena. Called before the daemon starts threads.
pub fn one_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's tuning; M_ARENA_MAX takes any positive
    // count, and threads that start later use the arenas it allows.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Returns the heap memory freed since to the system (glibc keeps it otherwise): called after
/// work that built and dropped large tables.
pub fn give_back_freed() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}
