//! The copier: whole pages of another process read through the kernel's direct map, kept
//! to measure against `process_vm_readv`; the daemon does not use it.
//!
//! `process_vm_readv` copies a page out of a target at well under memory's speed: each call
//! takes the target's mmap lock, walks its page tables, and pins every page (a write to its
//! `struct page`) before the copy and unpins it after. The pages a pass must checksum
//! already have their frames (pagemap gives them to the sampler), so rksm-ebpf's
//! `rksm_copy`, run with `BPF_PROG_TEST_RUN`, copies each frame through the direct map with
//! `bpf_probe_read_kernel` into a slot of a map the daemon has mapped, with no lock, no pin
//! and no copy out to user memory. `cargo bench -p rksm --bench sample` reads pages both
//! ways, and the copier is no faster (docs/BENCHMARKS.md): the lock and the pin are not what
//! a read costs, so the daemon keeps the system call, which needs no frame numbers and
//! reads nothing stale.
//!
//! A frame can be freed and reused between pagemap and the copy (the page migrated, or was
//! unmapped); the slot then holds some other page's bytes.

use aya::{
    programs::{RawTracePoint, RawTracePointRunOptions, TestRun},
    Ebpf,
};
use rksm_common::{
    copy::{CopyJob, BATCH, COPY_PROGRAM, JOB, PAGES, SLOTS},
    PAGE,
};

use crate::ebpf::{
    guard::GuardError,
    mapped::{MappedArray, MappedError},
    tracer::EBPF_OBJECT,
};

/// Errors setting up or running the copier.
#[derive(Debug, thiserror::Error)]
pub enum CopierError {
    /// The object or its programs and maps.
    #[error(transparent)]
    Ebpf(#[from] GuardError),
    /// The kernel refused to load or run the program.
    #[error("the copier program: {0}")]
    Program(aya::programs::ProgramError),
    /// A map could not be mapped into the daemon.
    #[error("the copier's maps: {0}")]
    Map(#[from] MappedError),
}

/// The loaded copier.
pub struct Copier {
    job: MappedArray,
    pages: MappedArray,
    base: u64,
    /// Holds the program.
    ebpf: Ebpf,
}

impl Copier {
    /// Loads the program, with the direct map at `base` (the sampler's).
    pub fn load(object: &mut super::Object, base: u64) -> Result<Self, CopierError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn.into());
        }
        let mut ebpf = object.load(&[JOB, PAGES], &[]).map_err(GuardError::from)?;
        let program: &mut RawTracePoint = ebpf
            .program_mut(COPY_PROGRAM)
            .ok_or(GuardError::Missing(COPY_PROGRAM))?
            .try_into()
            .map_err(CopierError::Program)?;
        program.load().map_err(CopierError::Program)?;
        let job = MappedArray::take(&mut ebpf, JOB, size_of::<CopyJob>())?;
        let pages = MappedArray::take(&mut ebpf, PAGES, SLOTS as usize * PAGE)?;
        Ok(Copier {
            job,
            pages,
            base,
            ebpf,
        })
    }

    /// The slots, [`SLOTS`] pages.
    pub fn slots(&self) -> &[u8] {
        // SAFETY: the pages' mapping, alive as long as self; the program writes it only
        // during a run, which takes `&mut self`.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr(), SLOTS as usize * PAGE) }
    }

    /// Copies frames `pfns` into slots `first..`, and sets `copied[i]` for each page copied.
    pub fn copy(
        &mut self,
        pfns: &[u64],
        first: u32,
        copied: &mut [bool],
    ) -> Result<(), CopierError> {
        assert!(first as usize + pfns.len() <= SLOTS as usize && copied.len() >= pfns.len());
        let job = self.job.as_ptr().cast::<CopyJob>();
        for (k, (pfns, copied)) in pfns.chunks(BATCH).zip(copied.chunks_mut(BATCH)).enumerate() {
            // SAFETY: the job's mapping; the program touches it only during the run below,
            // and `pfns` is at most BATCH long, as the job's array is.
            unsafe {
                (*job).base = self.base;
                (*job).count = pfns.len() as u32;
                (*job).first = first + (k * BATCH) as u32;
                (&raw mut (*job).pfns)
                    .cast::<u64>()
                    .copy_from_nonoverlapping(pfns.as_ptr(), pfns.len());
            }
            let program: &mut RawTracePoint = self
                .ebpf
                .program_mut(COPY_PROGRAM)
                .ok_or(GuardError::Missing(COPY_PROGRAM))?
                .try_into()
                .map_err(CopierError::Program)?;
            program
                .test_run(RawTracePointRunOptions::new())
                .map_err(CopierError::Program)?;
            // SAFETY: as above; the run is over.
            let flags = unsafe { &(*job).copied };
            for (c, &f) in copied.iter_mut().zip(flags).take(pfns.len()) {
                *c = f != 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ebpf::sampler::{Marker, Sampler};

    /// Runs only as root with the eBPF object built in; elsewhere it says why and passes.
    #[test]
    fn copies_pages_of_this_process_byte_for_byte() {
        let mut object = crate::ebpf::Object::new();
        let loaded = Sampler::load(&mut object)
            .map_err(|e| e.to_string())
            .and_then(|s| Copier::load(&mut object, s.direct_map()).map_err(|e| e.to_string()));
        let mut copier = match loaded {
            Ok(c) => c,
            Err(e) if !nix::unistd::Uid::effective().is_root() || EBPF_OBJECT.is_empty() => {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let pages: Vec<Marker> = (0..3).map(|_| Marker::new().unwrap()).collect();
        let mut pfns: Vec<u64> = pages.iter().map(|m| m.pfn().unwrap()).collect();
        // A frame beyond any memory this machine has: not in the direct map, never copied.
        pfns.push(1 << 40);
        let mut copied = vec![false; pfns.len()];
        copier.copy(&pfns, 5, &mut copied).unwrap();
        assert_eq!(copied, [true, true, true, false]);
        for (i, page) in pages.iter().enumerate() {
            let slot = &copier.slots()[(5 + i) * PAGE..(6 + i) * PAGE];
            assert!(slot == page.bytes(), "page {i}");
        }
    }
}
