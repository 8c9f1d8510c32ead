//! `cargo xtask bench --kernel ...`: what a steady pass costs on each kernel of the matrix.
//!
//! Runs `rksm bench` over the static profile (hash-only, pagemap and ebpf side by side, on
//! fresh workloads) on the host's kernel and in guests booting Debian 12's kernels, once per
//! write-protect source each kernel offers, keeps each run's report (without its time
//! series) in docs/bench-kernels/, and prints the table docs/BENCHMARKS.md shows, built from
//! every report there. Guests run under emulation, so their seconds are not the host's: the
//! table gives counts, and each mode's CPU per pass as a ratio to hash-only's in the same
//! run.

use std::{fs, path::Path, process::Command};

use anyhow::{bail, Context, Result};

use crate::vm::Kernel;

/// One run of the matrix: a kernel (None: the host's) and the write protection asked for.
struct Run {
    kernel: Option<Kernel>,
    write_protect: &'static str,
}

impl Run {
    /// The kernel, and the guest's extra kernel arguments if any.
    fn kernel(&self) -> String {
        let append = crate::vm::extra_append();
        match (self.kernel, append.is_empty()) {
            (None, _) => "host".into(),
            (Some(kernel), true) => kernel.name().into(),
            (Some(kernel), false) => format!("{} ({append})", kernel.name()),
        }
    }

    fn label(&self) -> String {
        let kernel = self.kernel().replace([' ', '(', ')', '='], "-");
        format!("{}-{}", kernel.trim_end_matches('-'), self.write_protect)
    }
}

/// The runs for `--kernel NAME` (`host`, a guest kernel, or `all`).
fn runs(kernel: &str) -> Result<Vec<Run>> {
    let host = || Run {
        kernel: None,
        write_protect: "auto",
    };
    let debian12 = || Run {
        kernel: Some(Kernel::Debian12),
        write_protect: "auto",
    };
    // 6.12 offers both sources: one run each.
    let both = || {
        ["soft-dirty", "userfaultfd"].map(|write_protect| Run {
            kernel: Some(Kernel::Debian12Linux612),
            write_protect,
        })
    };
    Ok(match kernel {
        "host" => vec![host()],
        "debian12" => vec![debian12()],
        "debian12-6.12" => both().into(),
        "all" => {
            let mut all = vec![host(), debian12()];
            all.extend(both());
            all
        }
        other => bail!("unknown kernel `{other}` (expected host, all, debian12, debian12-6.12)"),
    })
}

/// Runs the bench for `kernel` with `repeat` runs of `seconds` each, writes the reports,
/// and prints the table.
pub fn bench(root: &Path, kernel: &str, repeat: u32, seconds: u32) -> Result<()> {
    let dir = root.join("docs/bench-kernels");
    fs::create_dir_all(&dir)?;
    // The binaries were built just now: the tree as it is now is what they were built from,
    // whatever changes during the runs.
    let built_from = commit(root);
    for run in runs(kernel)? {
        let mut args: Vec<String> = [
            "--no-config",
            "--log-level",
            "warn",
            "bench",
            "--profile",
            "static",
            "--only",
            "hash-only,pagemap,ebpf",
            "--checksum",
            "xxh64",
            "--interval",
            "1",
            "--json",
            "--write-protect",
            run.write_protect,
        ]
        .map(String::from)
        .into();
        args.extend(["--repeat".into(), repeat.to_string()]);
        args.extend(["--seconds".into(), seconds.to_string()]);
        let out = match run.kernel {
            None => {
                let out = Command::new(root.join("target/release/rksm"))
                    .args(&args)
                    .output()
                    .context("running rksm bench")?;
                if !out.status.success() {
                    bail!(
                        "rksm bench failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                String::from_utf8(out.stdout)?
            }
            Some(kernel) => crate::vm::rksm(root, kernel, &args)?,
        };
        let mut report: serde_json::Value =
            serde_json::from_str(out.trim()).context("rksm bench's JSON")?;
        for r in report["runs"].as_array_mut().into_iter().flatten() {
            if let Some(r) = r.as_object_mut() {
                r.remove("samples");
            }
        }
        report["kernel"] = run.kernel().into();
        report["write_protect_asked"] = run.write_protect.into();
        report["commit"] = built_from.as_str().into();
        report["command"] = match crate::vm::extra_append().as_str() {
            "" => format!("cargo xtask bench --kernel {kernel} --repeat {repeat} --seconds {seconds}"),
            append => format!("RKSM_VM_APPEND='{append}' cargo xtask bench --kernel {kernel} --repeat {repeat} --seconds {seconds}"),
        }
        .into();
        let path = dir.join(format!("{}.json", run.label()));
        fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
        eprintln!("xtask: wrote {}", path.display());
    }
    print!("{}", table(&dir)?);
    Ok(())
}

/// The commit the binaries were built from, `+` if the tree had changes.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short", "HEAD"]);
    match git(&["status", "--porcelain", "--untracked-files=no"]).is_empty() {
        true => head,
        false => format!("{head}+"),
    }
}

/// The kernels table from every report in `dir`.
fn table(dir: &Path) -> Result<String> {
    let mut reports: Vec<(String, serde_json::Value)> = Vec::new();
    for entry in fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = fs::read_to_string(&path)?;
            reports.push((
                path.file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into(),
                serde_json::from_str(&text)?,
            ));
        }
    }
    reports.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::from(
        "| kernel | mode | write protection (targets) | pages hashed / steady pass | written bits read / steady pass | rksm CPU / steady pass, vs hash-only | soft-dirty clears in the run | ms per clear | commit |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for (_, report) in &reports {
        let runs = report["runs"].as_array().cloned().unwrap_or_default();
        let cpu = |r: &serde_json::Value| r["steady_rksm_cpu_per_pass"].as_f64();
        let base = runs
            .iter()
            .find(|r| r["mode"] == "hash-only" && r["checksum"] == "xxh64")
            .and_then(cpu);
        for r in runs.iter().filter(|r| r["checksum"] == "xxh64") {
            let show = |v: &serde_json::Value| match v {
                serde_json::Value::Null => "-".to_string(),
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            let ratio = match (cpu(r), base) {
                (Some(c), Some(b)) if b > 0.0 => format!("{:.3}", c / b),
                _ => "-".into(),
            };
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                show(&report["kernel"]),
                show(&r["mode"]),
                show(&r["write_protect"]),
                show(&r["pages_hashed"]),
                show(&r["written_bits_read"]),
                ratio,
                show(&r["soft_dirty_clears"]),
                r["ms_per_clear"]
                    .as_f64()
                    .map_or("-".into(), |ms| format!("{ms:.2}")),
                show(&report["commit"]),
            );
        }
    }
    out.push('\n');
    // What a clear costs, against what rehashing a page costs in the same run.
    for (_, report) in &reports {
        let runs = report["runs"].as_array().cloned().unwrap_or_default();
        let row = |mode: &str| {
            runs.iter()
                .find(|r| r["mode"] == mode && r["checksum"] == "xxh64")
                .cloned()
        };
        let (Some(hash), Some(pagemap)) = (row("hash-only"), row("pagemap")) else {
            continue;
        };
        let Some(ms) = pagemap["ms_per_clear"].as_f64() else {
            continue;
        };
        let targets: f64 = pagemap["write_protect"]
            .as_str()
            .and_then(|s| s.rsplit(": ").next()?.parse().ok())
            .unwrap_or(1.0);
        let armed = pagemap["written_bits_read"].as_f64().unwrap_or(0.0) / targets;
        let rehash_ns = match (
            hash["steady_rksm_cpu_per_pass"].as_f64(),
            hash["pages_hashed"].as_f64(),
        ) {
            (Some(cpu), Some(pages)) if pages > 0.0 => cpu * 1e9 / pages,
            _ => continue,
        };
        out += &format!(
            "- {}: one clear took {ms:.2} ms for a target of {armed:.0} armed pages (the kernel walks its whole address space: {:.0} ns per armed page); a steady hash-only pass cost {rehash_ns:.0} ns of rksm's CPU per page hashed, so one clear costs about as much as rehashing {:.0} pages ({:.1}% of the armed ones).\n",
            report["kernel"].as_str().unwrap_or("?"),
            ms * 1e6 / armed.max(1.0),
            ms * 1e6 / rehash_ns,
            ms * 1e6 / rehash_ns / armed.max(1.0) * 100.0,
        );
    }
    Ok(out)
}
