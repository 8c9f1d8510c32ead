//! The sampler: a digest of a few bytes of each new page, without copying the page.
//!
//! A page can equal another only if every byte does, so a page whose sampled bytes equal no
//! other page's cannot be a duplicate, and copying it out of its process to checksum it is
//! wasted. `process_vm_readv` cannot read a sample for less than about a page copy (each
//! remote iovec pins its page under the target's mmap lock), so the sample is read where it
//! costs a few loads: rksm-ebpf's `rksm_sample`, run on demand with `BPF_PROG_TEST_RUN`,
//! reads the sampled words of each frame of a batch (frame numbers from pagemap) through the
//! kernel's direct map with `bpf_probe_read_kernel`, and returns their digests. The job is a
//! map the daemon has mapped into its memory: it writes the frame numbers there and reads
//! the digests back, with no copy of the job in and out through a system call each batch.
//!
//! The direct map's start is randomised with the kernel's memory layout and is not in
//! `/proc/kallsyms` without `CONFIG_KALLSYMS_ALL`, so `rksm_locate` finds it once: the daemon
//! fills a page of its own with random words, locks it, reads its frame from pagemap, and
//! the program tries each 1 GiB boundary below one of its maps' address until that frame reads
//! back as written. The sampler is then checked against the marker page's known digest.
//!
//! A digest is a hint, never a verdict: a page whose sample matches another's is read whole,
//! checksummed and compared before it is anything; a frame freed and reused between pagemap
//! and the sample can only make rksm read a page it could have skipped, or miss a duplicate
//! until the page is next written. It needs what loading a tracing program needs
//! (CAP_BPF, CAP_PERFMON) and a kernel not locked down for confidentiality.

use std::{fs::File, os::unix::fs::FileExt};

use aya::{
    programs::{RawTracePoint, RawTracePointRunOptions, TestRun},
    Ebpf,
};
use rksm_common::sample::{
    self, SampleJob, BATCH, GROUP, HINT, JOB, LOCATE_PROGRAM, SAMPLE_PROGRAM,
};

use crate::{
    ebpf::{
        guard::GuardError,
        mapped::{MappedArray, MappedError},
        tracer::EBPF_OBJECT,
    },
    kernel::procfs::{Pagemap, PagemapEntry},
};

/// Errors setting up or running the sampler.
#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    /// The object or its programs and maps.
    #[error(transparent)]
    Ebpf(#[from] GuardError),
    /// The kernel refused to load or run a program.
    #[error("the sampler program {0}: {1}")]
    Program(&'static str, aya::programs::ProgramError),
    /// The job's map could not be mapped into the daemon.
    #[error("the sampler's job: {0}")]
    Job(#[from] MappedError),
    /// The marker page could not be set up.
    #[error("the sampler's marker page: {0}")]
    Marker(std::io::Error),
    /// No 1 GiB boundary read the marker page back.
    #[error("the kernel's direct map was not found (a kernel locked down for confidentiality, or not x86_64's layout)")]
    NotFound,
    /// The direct map was found but a sample of the marker page came back wrong.
    #[error("the sampler read the marker page wrong (digest {got:#x}, expected {expected:#x})")]
    Mismatch {
        /// What it read.
        got: u32,
        /// What the page holds.
        expected: u32,
    },
}

/// The loaded sampler.
pub struct Sampler {
    job: MappedArray,
    base: u64,
    /// Holds the programs.
    ebpf: Ebpf,
}

/// A page of the daemon's own, filled with random words and locked while the sampler is set
/// up, so that its frame cannot move.
pub(super) struct Marker {
    page: *mut u8,
}

impl Marker {
    pub(super) fn new() -> Result<Self, std::io::Error> {
        let size = rksm_common::PAGE;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let marker = Marker { page: page.cast() };
        // SAFETY: the page is ours, `size` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts_mut(marker.page, size) };
        File::open("/dev/urandom")?.read_exact_at(bytes, 0)?;
        // SAFETY: locks the page just mapped; unlocked with it in drop.
        if unsafe { libc::mlock(page, size) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(marker)
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: the page mapped in new, alive until drop.
        unsafe { std::slice::from_raw_parts(self.page, rksm_common::PAGE) }
    }

    /// Its frame, from the daemon's own pagemap.
    pub(super) fn pfn(&self) -> Result<u64, std::io::Error> {
        let mut entry = [PagemapEntry(0)];
        Pagemap::open(std::process::id())
            .and_then(|pagemap| pagemap.read(self.page as u64, &mut entry))
            .map_err(std::io::Error::other)?;
        entry[0].pfn().filter(|&pfn| pfn != 0).ok_or_else(|| {
            std::io::Error::other("no frame number in pagemap (needs CAP_SYS_ADMIN)")
        })
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new, not used after this.
        unsafe { libc::munmap(self.page.cast(), rksm_common::PAGE) };
    }
}

impl Sampler {
    /// Loads the programs, finds the direct map and checks a sample of a known page.
    pub fn load(object: &mut super::Object) -> Result<Self, SamplerError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn.into());
        }
        let mut ebpf = object.load(&[JOB, HINT], &[]).map_err(GuardError::from)?;
        for name in [SAMPLE_PROGRAM, LOCATE_PROGRAM] {
            let program: &mut RawTracePoint = ebpf
                .program_mut(name)
                .ok_or(GuardError::Missing(name))?
                .try_into()
                .map_err(|e| SamplerError::Program(name, e))?;
            program.load().map_err(|e| SamplerError::Program(name, e))?;
        }
        let job = MappedArray::take(&mut ebpf, JOB, size_of::<SampleJob>())?;
        let mut sampler = Sampler { job, base: 0, ebpf };
        let marker = Marker::new().map_err(SamplerError::Marker)?;
        let pfn = marker.pfn().map_err(SamplerError::Marker)?;
        let mixed = sample::mix(&sample::words_of(marker.bytes()));
        let job = sampler.job.as_ptr().cast::<SampleJob>();
        // SAFETY: the job's mapping, which the program touches only during a run.
        unsafe {
            (*job).base = mixed;
            (*job).count = 0;
            (*job).pfns[0] = pfn;
        }
        sampler.run(LOCATE_PROGRAM)?;
        // SAFETY: as above; the run is over.
        let (count, base) = unsafe { ((*job).count, (*job).base) };
        if count != 1 {
            return Err(SamplerError::NotFound);
        }
        sampler.base = base;
        let mut digest = [0u32];
        sampler.sample(&[pfn], &mut digest)?;
        let expected = sample::digest(mixed);
        if digest[0] != expected {
            return Err(SamplerError::Mismatch {
                got: digest[0],
                expected,
            });
        }
        log::debug!("sampler: direct map at {:#x}", sampler.base);
        Ok(sampler)
    }

    /// Where the kernel's direct map begins, for the copier.
    pub fn direct_map(&self) -> u64 {
        self.base
    }

    fn run(&mut self, name: &'static str) -> Result<i32, SamplerError> {
        let program: &mut RawTracePoint = self
            .ebpf
            .program_mut(name)
            .ok_or(GuardError::Missing(name))?
            .try_into()
            .map_err(|e| SamplerError::Program(name, e))?;
        let result = program
            .test_run(RawTracePointRunOptions::new())
            .map_err(|e| SamplerError::Program(name, e))?;
        Ok(result.return_value as i32)
    }

    /// The digests of frames `pfns` into `digests` (as long): [`sample::UNREAD`] for a frame
    /// that could not be read.
    pub fn sample(&mut self, pfns: &[u64], digests: &mut [u32]) -> Result<(), SamplerError> {
        let job = self.job.as_ptr().cast::<SampleJob>();
        for (pfns, digests) in pfns.chunks(BATCH).zip(digests.chunks_mut(BATCH)) {
            let count = pfns.len().next_multiple_of(GROUP);
            let last = pfns.last().copied().unwrap_or(0);
            // SAFETY: the job's mapping; the program touches it only during the run below,
            // and `pfns` and `digests` are at most BATCH long, as its arrays are (BATCH is
            // a multiple of GROUP, so `count` is at most BATCH too).
            unsafe {
                (*job).base = self.base;
                (*job).count = count as u32;
                let to = (&raw mut (*job).pfns).cast::<u64>();
                to.copy_from_nonoverlapping(pfns.as_ptr(), pfns.len());
                // The program samples whole groups: the last frame again fills this one.
                for i in pfns.len()..count {
                    to.add(i).write(last);
                }
            }
            self.run(SAMPLE_PROGRAM)?;
            // SAFETY: as above; the run is over.
            unsafe {
                digests
                    .as_mut_ptr()
                    .copy_from_nonoverlapping((&raw const (*job).digests).cast(), digests.len());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs only as root with the eBPF object built in; elsewhere it says why and passes.
    #[test]
    fn samples_pages_of_this_process_as_their_bytes_say() {
        let mut sampler = match Sampler::load(&mut crate::ebpf::Object::new()) {
            Ok(s) => s,
            Err(e) if !nix::unistd::Uid::effective().is_root() || EBPF_OBJECT.is_empty() => {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let pages: Vec<Marker> = (0..3).map(|_| Marker::new().unwrap()).collect();
        let pfns: Vec<u64> = pages.iter().map(|m| m.pfn().unwrap()).collect();
        let mut digests = vec![0; pfns.len()];
        sampler.sample(&pfns, &mut digests).unwrap();
        for (page, digest) in pages.iter().zip(&digests) {
            assert_eq!(*digest, sample::digest_of(page.bytes()));
        }
        assert_ne!(digests[0], digests[1]);
    }
}
