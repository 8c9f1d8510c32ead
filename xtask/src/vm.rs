//! The kernel matrix: rksm's kernel-facing tests on the kernels people run, booted in qemu.
//!
//! The host runs one kernel; rksm's dirty bit depends on what the kernel offers
//! (userfaultfd write protection from 6.7, soft-dirty where it is built in), so the tests
//! that prove the dirty bit also run under Debian 12's own kernels, the way aya tests itself:
//! the test binaries, rksm, its test child and the few tools they call go into an initramfs
//! with a busybox `/init` that mounts what a host has (proc, sysfs, tracefs, bpffs, tmpfs),
//! runs each suite and prints its results on the serial console; the guest then powers off.
//! qemu uses KVM where it boots a guest and software emulation (TCG) otherwise.

use std::{
    collections::BTreeSet,
    env, fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// A kernel the tests can boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Debian 12's default kernel package, `linux-image-amd64` (Linux 6.1): soft-dirty, no
    /// asynchronous userfaultfd write protection.
    Debian12,
    /// Debian 12's Linux 6.12 package (`linux-image-6.12.*-amd64-unsigned`, as Debian 13
    /// ships): soft-dirty and userfaultfd write protection both.
    Debian12Linux612,
}

impl Kernel {
    /// Every kernel of the matrix.
    pub const ALL: [Kernel; 2] = [Kernel::Debian12, Kernel::Debian12Linux612];

    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Debian12 => "debian12",
            Kernel::Debian12Linux612 => "debian12-6.12",
        }
    }

    /// The kernel named `name`.
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The bzImage to boot, once set-up has put it in place.
    pub fn image(self, root: &Path) -> Option<PathBuf> {
        let (dir, prefix) = match self {
            Kernel::Debian12 => (PathBuf::from("/boot"), "vmlinuz-6.1."),
            Kernel::Debian12Linux612 => (kernels_dir(root).join("6.12/boot"), "vmlinuz-6.12."),
        };
        let mut found: Vec<PathBuf> = fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
            })
            .collect();
        found.sort();
        found.pop()
    }
}

/// Where set-up unpacks kernels that are not installed on the host.
pub fn kernels_dir(root: &Path) -> PathBuf {
    root.join("target/kernels")
}

/// Puts Debian's 6.12 kernel image under target/kernels/6.12 (downloaded from the Debian
/// registry and unpacked, not installed: the host's /boot is left alone).
pub fn fetch_linux_612(root: &Path) -> Result<()> {
    if Kernel::Debian12Linux612.image(root).is_some() {
        return Ok(());
    }
    let search = Command::new("apt-cache")
        .args([
            "search",
            "--names-only",
            r"^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$",
        ])
        .output()
        .context("apt-cache search")?;
    let mut packages: Vec<String> = String::from_utf8_lossy(&search.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    packages.sort_by_key(|p| version_key(p));
    let Some(package) = packages.pop() else {
        bail!("no linux-image-6.12.*+deb12-amd64-unsigned package in the Debian registry (apt-get update?)");
    };
    let dir = kernels_dir(root).join("6.12");
    fs::create_dir_all(&dir)?;
    eprintln!("xtask: downloading {package} (the matrix's Linux 6.12)");
    crate::build::run_checked(
        Command::new("apt-get")
            .args(["download", &package])
            .current_dir(&dir),
    )?;
    let deb = fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    crate::build::run_checked(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
    // Only the image is booted; the modules are not needed.
    let _ = fs::remove_dir_all(dir.join("lib"));
    let _ = fs::remove_dir_all(dir.join("usr"));
    fs::remove_file(&deb)?;
    if Kernel::Debian12Linux612.image(root).is_none() {
        bail!("{} held no boot/vmlinuz-6.12.*", package);
    }
    Ok(())
}

/// `linux-image-6.12.107+deb12-...` → [6, 12, 107], for picking the newest.
fn version_key(package: &str) -> Vec<u64> {
    package
        .trim_start_matches("linux-image-")
        .split(['.', '+', '-'])
        .map_while(|part| part.parse().ok())
        .collect()
}

/// One test suite as the guests run it: which of its tests, and why the others are left out.
struct Suite {
    /// The test target's name (`cargo test --test NAME`), or `rksm` for the library's own.
    name: &'static str,
    /// Only these tests; all if empty.
    only: &'static [&'static str],
    /// Tests left out, with why (shown in the output).
    skip: &'static [(&'static str, &'static str)],
}

/// What the guests run: the dirty bit in every mode and every way a page can be written,
/// the daemon around it, the tracer, the probes of what the kernel offers, and the
/// capabilities the shipped unit grants.
const SUITES: &[Suite] = &[
    Suite {
        name: "rksm",
        only: &[
            "kernel::softdirty::",
            "kernel::userfaultfd::",
            "engine::dirty::",
            "kernel::procfs::",
        ],
        skip: &[],
    },
    Suite {
        name: "dirty",
        only: &[],
        skip: &[
            ("copies_read_with_o_direct_are_found_by_the_audit", "O_DIRECT needs a disk file system, and the guest has only tmpfs"),
            ("a_terabyte_arena_with_a_few_pages_touched_is_scanned_in_bounded_memory", "without PAGEMAP_SCAN a pass reads a pagemap entry per virtual page: 2 GiB of them for the arena, minutes under emulation"),
        ],
    },
    Suite {
        name: "softdirty",
        only: &[],
        skip: &[],
    },
    Suite {
        name: "daemon",
        only: &[
            "every_dirty_mode_merges_the_same_pages_and_leaves_memory_intact",
            "ebpf_mode_hashes_a_small_fraction_of_what_hash_only_does_on_static_memory",
            "duplicates_found_at_the_first_read_are_marked_after_a_clean_pass_without_reading_again",
            "pages_the_sample_cannot_tell_apart_are_merged_only_where_they_are_equal_in_full",
            "a_clean_page_only_sampled_is_read_whole_when_a_newcomer_meets_it_and_merged",
            "a_written_page_that_meets_a_page_only_sampled_has_it_read_whole_and_merged",
            "copy_on_write_breaks_are_counted_and_their_region_backs_off",
            "memory_the_target_registered_with_its_own_userfaultfd_is_left_to_it",
            "a_target_that_executes_a_new_program_is_armed_and_merged_again",
            "a_target_skipped_for_a_pass_keeps_its_arming_and_checksums",
            "a_write_between_the_scan_and_the_marking_is_hashed_next_pass",
            "an_outsider_that_marks_and_unmarks_its_memory_between_two_passes_is_seen",
            "a_domains_duplicates_are_marked_whatever_another_domain_holds_and_merges_across_are_undone",
        ],
        skip: &[],
    },
    Suite {
        name: "remote",
        only: &[
            "rksm_is_out_of_the_oom_killers_reach_only_while_it_holds_a_thread",
            "a_thread_borrowed_inside_an_rseq_critical_section_aborts_it_as_the_kernel_would",
            "a_target_killed_while_borrowed_is_reported_gone_without_hanging",
        ],
        skip: &[],
    },
    Suite {
        name: "handover",
        only: &["a_target_that_registers_its_own_userfaultfd_seconds_later_gets_it_in_either_mode"],
        skip: &[],
    },
    Suite {
        name: "trace",
        only: &["records_exactly_the_pages_written_after_attach_and_none_only_read"],
        skip: &[],
    },
    Suite {
        name: "operations",
        only: &["the_systemd_units_capabilities_are_enough_and_each_is_needed"],
        skip: &[],
    },
];

/// What a guest run found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Tests passed and failed, from the suites' `test result:` lines.
    pub passed: u64,
    pub failed: u64,
    /// Suites that did not end with status 0, and why the run is not complete.
    pub problems: Vec<String>,
}

/// Runs the matrix's suites in a guest booting `kernel`, printing the guest's console.
pub fn test(root: &Path, kernel: Kernel, ebpf_object: &Path) -> Result<Outcome> {
    let image = kernel.image(root).with_context(|| {
        format!(
            "no kernel image for {} (run `cargo xtask setup`)",
            kernel.name()
        )
    })?;
    let mut binaries = test_binaries(root, ebpf_object)?;
    // RKSM_VM_SUITES=a,b: only those suites (to look at one quickly).
    if let Ok(only) = env::var("RKSM_VM_SUITES") {
        binaries.retain(|(suite, _)| only.split(',').any(|s| s == suite.name));
    }
    let extra = binaries
        .iter()
        .map(|(suite, exe)| (format!("t/release/deps/{}", suite.name), exe.clone()))
        .collect();
    let initrd = initramfs(root, kernel.name(), extra, &suites_script(&binaries))?;
    eprintln!(
        "xtask: booting {} ({}) with the tests",
        kernel.name(),
        image.display()
    );
    // A guest kernel that panics under emulation (seen once in many runs: a double fault in
    // Debian's 6.12 while it verified a BPF program, under TCG) is booted once more; its
    // console stays above, and a second panic fails the run.
    for attempt in 1..=2 {
        let (outcome, panicked) = boot_tests(&image, &initrd)?;
        if !panicked || attempt == 2 || outcome.problems.is_empty() {
            return Ok(outcome);
        }
        eprintln!(
            "xtask: the {} guest's kernel panicked (its console is above): booting it once more",
            kernel.name()
        );
    }
    unreachable!("the second attempt returns")
}

/// Boots a test initramfs once: what its suites reported, and whether the kernel panicked.
fn boot_tests(image: &Path, initrd: &Path) -> Result<(Outcome, bool)> {
    let mut outcome = Outcome::default();
    let mut panicked = false;
    let done = boot(image, initrd, &mut |line| {
        println!("{line}");
        if line.contains("Kernel panic - not syncing") {
            panicked = true;
        }
        if let Some(result) = line.strip_prefix("test result: ") {
            outcome.passed += crate::testing::count_before(result, " passed");
            outcome.failed += crate::testing::count_before(result, " failed");
        } else if let Some(rest) = line.strip_prefix("rksm-vm: suite ") {
            if let Some((suite, status)) = rest.split_once(" exit ") {
                if status.trim() != "0" {
                    outcome
                        .problems
                        .push(format!("suite {suite} exited with {}", status.trim()));
                }
            }
        }
    })?;
    if let Err(why) = done {
        outcome.problems.push(why);
    }
    Ok((outcome, panicked))
}

/// Runs `rksm ARGS` in a guest booting `kernel` and returns what it printed on stdout (its
/// stderr goes to the console, shown as it comes).
pub fn rksm(root: &Path, kernel: Kernel, args: &[String]) -> Result<String> {
    let image = kernel.image(root).with_context(|| {
        format!(
            "no kernel image for {} (run `cargo xtask setup`)",
            kernel.name()
        )
    })?;
    let body = format!(
        "./release/rksm {} > /tmp/out; echo \"rksm-vm: rksm exit $?\"\n\
         while read -r line; do echo \"rksm-vm: out $line\"; done < /tmp/out\n",
        args.join(" ")
    );
    let initrd = initramfs(root, &format!("{}-rksm", kernel.name()), Vec::new(), &body)?;
    eprintln!(
        "xtask: booting {} to run `rksm {}`",
        kernel.name(),
        args.join(" ")
    );
    let (mut out, mut status) = (String::new(), None);
    let done = boot(&image, &initrd, &mut |line| {
        if let Some(rest) = line.strip_prefix("rksm-vm: out ") {
            out.push_str(rest);
            out.push('\n');
        } else {
            eprintln!("{line}");
            if let Some(code) = line.strip_prefix("rksm-vm: rksm exit ") {
                status = Some(code.trim().to_string());
            }
        }
    })?;
    if let Err(why) = done {
        bail!("the {} guest: {why}", kernel.name());
    }
    match status.as_deref() {
        Some("0") => Ok(out),
        other => bail!(
            "rksm exited with {} in the {} guest",
            other.unwrap_or("nothing"),
            kernel.name()
        ),
    }
}

/// Builds the test binaries and returns each suite's executable.
fn test_binaries(root: &Path, ebpf_object: &Path) -> Result<Vec<(&'static Suite, PathBuf)>> {
    let mut cmd = crate::build::cargo();
    cmd.args([
        "test",
        "--workspace",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ])
    .env("RKSM_EBPF_OBJECT", ebpf_object)
    .stdout(Stdio::piped());
    let out = cmd.output().context("building the test binaries")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        let kind = &msg["target"]["kind"][0];
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        if let Some(suite) = SUITES
            .iter()
            .find(|s| s.name == name && (kind == "test" || (name == "rksm" && kind == "lib")))
        {
            found.push((suite, PathBuf::from(exe)));
        }
    }
    for suite in SUITES {
        if !found.iter().any(|(s, _)| s.name == suite.name) {
            bail!("no test binary for suite {}", suite.name);
        }
    }
    let _ = root;
    Ok(found)
}

/// The guest's initramfs: busybox, rksm and its test child, `extra` binaries (path inside,
/// path here), every library they load, the source-tree files the tests read, and `/init`
/// running `body` after mounting what a host has, then powering off.
fn initramfs(
    root: &Path,
    name: &str,
    extra: Vec<(String, PathBuf)>,
    body: &str,
) -> Result<PathBuf> {
    let release = root.join("target/release");
    let mut files: Vec<(String, PathBuf)> = vec![
        ("bin/busybox".into(), PathBuf::from("/bin/busybox")),
        (
            "usr/local/bin/setpriv".into(),
            PathBuf::from("/usr/bin/setpriv"),
        ),
        ("t/release/rksm".into(), release.join("rksm")),
        (
            "t/release/rksm-testchild".into(),
            release.join("rksm-testchild"),
        ),
    ];
    files.extend(extra);
    // Files the tests read from the source tree, where they expect them.
    for dir in ["packaging", "rksm-daemon/fuzz-corpus"] {
        for path in files_under(&root.join(dir))? {
            let inside = path.to_string_lossy().trim_start_matches('/').to_string();
            files.push((inside, path));
        }
    }
    let mut libraries = BTreeSet::new();
    for (inside, path) in &files {
        if inside.starts_with("t/") || inside.contains("bin/") {
            libraries.extend(shared_libraries(path)?);
        }
    }
    for lib in libraries {
        let inside = lib.to_string_lossy().trim_start_matches('/').to_string();
        files.push((inside, lib));
    }
    let mut cpio = Vec::new();
    let mut dirs = BTreeSet::new();
    for dir in [
        "bin",
        "dev",
        "proc",
        "sys",
        "tmp",
        "run",
        "var/tmp",
        "root",
        "etc",
        "usr/bin",
        "t/release/deps",
    ] {
        add_dirs(&mut cpio, &mut dirs, dir);
    }
    // The crates' directories, which the tests' paths go through (`tests/../packaging`).
    for krate in ["tests", "rksm-daemon"] {
        let dir = root.join(krate);
        add_dirs(&mut cpio, &mut dirs, &dir.to_string_lossy());
    }
    crate::build::newc_entry(&mut cpio, "dev/console", 0o020_600, (5, 1), &[]);
    crate::build::newc_entry(
        &mut cpio,
        "etc/passwd",
        0o100_644,
        (0, 0),
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n",
    );
    for (inside, from) in &files {
        if let Some(parent) = Path::new(inside).parent() {
            add_dirs(&mut cpio, &mut dirs, &parent.to_string_lossy());
        }
        let data = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
        crate::build::newc_entry(&mut cpio, inside, 0o100_755, (0, 0), &data);
    }
    let init = format!("{INIT_HEAD}{body}echo 'rksm-vm: done'\npoweroff -f\n");
    crate::build::newc_entry(&mut cpio, "init", 0o100_755, (0, 0), init.as_bytes());
    crate::build::newc_entry(&mut cpio, "TRAILER!!!", 0, (0, 0), &[]);
    let dir = root.join("target/vm");
    fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.cpio"));
    fs::write(&path, cpio)?;
    Ok(path)
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(files_under(&path)?);
        } else {
            files.push(path);
        }
    }
    Ok(files)
}

fn add_dirs(cpio: &mut Vec<u8>, dirs: &mut BTreeSet<String>, dir: &str) {
    let mut at = String::new();
    for part in dir.split('/').filter(|p| !p.is_empty()) {
        if !at.is_empty() {
            at.push('/');
        }
        at.push_str(part);
        if dirs.insert(at.clone()) {
            crate::build::newc_entry(cpio, &at, 0o040_755, (0, 0), &[]);
        }
    }
}

/// The libraries `binary` loads, as `ldd` lists them (the loader included).
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .with_context(|| format!("ldd {}", binary.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// What `/init` does before its body: mount what a host has.
const INIT_HEAD: &str = "#!/bin/busybox sh\n\
     /bin/busybox --install -s /bin\n\
     export PATH=/usr/local/bin:/bin:/usr/bin HOME=/root RUST_BACKTRACE=1\n\
     mount -t proc proc /proc\n\
     mount -t sysfs sysfs /sys\n\
     mount -t devtmpfs devtmpfs /dev\n\
     mount -t tracefs tracefs /sys/kernel/tracing\n\
     mount -t debugfs debugfs /sys/kernel/debug\n\
     mount -t bpf bpf /sys/fs/bpf\n\
     for d in /tmp /run /var/tmp; do mount -t tmpfs tmpfs $d; done\n\
     ip link set lo up 2>/dev/null\n\
     ulimit -l unlimited\n\
     echo \"rksm-vm: kernel $(uname -r)\"\n\
     cd /t\n";

/// The body of `/init` that runs each suite and reports its status.
fn suites_script(suites: &[(&Suite, PathBuf)]) -> String {
    let mut script = String::new();
    for (suite, _) in suites {
        let mut args: Vec<String> = vec!["--test-threads=1".into()];
        for name in suite.only {
            args.push(name.to_string());
        }
        for (name, why) in suite.skip {
            script += &format!("echo 'rksm-vm: {} left out: {name}: {why}'\n", suite.name);
            args.extend(["--skip".into(), name.to_string()]);
        }
        // --show-output: what the tests print about the kernel (a huge page there or not).
        args.push("--show-output".into());
        script += &format!(
            "echo 'rksm-vm: suite {0}'\n./release/deps/{0} {1} 2>&1\necho \"rksm-vm: suite {0} exit $?\"\n",
            suite.name,
            args.join(" ")
        );
    }
    script
}

/// How long a guest may run the suites (software emulation is slow).
const DEADLINE: Duration = Duration::from_secs(40 * 60);

/// Boots the guest and hands each console line to `line` until the guest is done; whether
/// it got there (or why not).
fn boot(
    image: &Path,
    initrd: &Path,
    line: &mut dyn FnMut(&str),
) -> Result<std::result::Result<(), String>> {
    let kvm = kvm_boots();
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", if kvm { "kvm" } else { "tcg" }])
        // The guest's RAM is not offered to the host's ksmd: qemu marks it mergeable unless
        // told not to, and the host's tests and benchmarks own that ksmd.
        .args(["-machine", "pc,mem-merge=off"])
        .args(["-cpu", "max", "-m", "4096", "-smp", "2"])
        .args(["-display", "none", "-nodefaults", "-no-reboot"])
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(image)
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            &format!("console=ttyS0 panic=-1 quiet loglevel=3 {}", extra_append()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd
        .spawn()
        .context("starting qemu-system-x86_64 (run `cargo xtask setup`)")?;
    let stdout = child.stdout.take().context("qemu stdout")?;
    let (lines, console) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).split(b'\n').map_while(Result::ok) {
            if lines
                .send(String::from_utf8_lossy(&line).trim_end().to_string())
                .is_err()
            {
                break;
            }
        }
    });
    let started = Instant::now();
    let mut outcome = Err("the guest stopped before it was done".to_string());
    loop {
        let left = DEADLINE.saturating_sub(started.elapsed());
        let next = match console.recv_timeout(left) {
            Ok(next) => next,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                outcome = Err(format!("the guest did not finish within {DEADLINE:?}"));
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if next == "rksm-vm: done" {
            outcome = Ok(());
        }
        line(&next);
    }
    let _ = child.kill();
    let _ = child.wait();
    eprintln!(
        "xtask: guest finished in {:.0} s ({})",
        started.elapsed().as_secs_f64(),
        if kvm { "KVM" } else { "TCG" }
    );
    Ok(outcome)
}

/// Kernel arguments added to the guests' command line from `RKSM_VM_APPEND` (for instance
/// `transparent_hugepage=never`, to measure without huge pages), or none.
pub fn extra_append() -> String {
    env::var("RKSM_VM_APPEND").unwrap_or_default()
}

/// Whether KVM boots guests here: /dev/kvm opens and the CPU shows virtualization
/// extensions to this kernel (a nested hypervisor that hides them has a /dev/kvm that
/// cannot run a guest). `RKSM_VM_ACCEL=tcg` or `kvm` decides instead.
fn kvm_boots() -> bool {
    match env::var("RKSM_VM_ACCEL").as_deref() {
        Ok("tcg") => return false,
        Ok("kvm") => return true,
        _ => {}
    }
    let flags = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let extensions = flags
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    extensions
        && fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok()
}
