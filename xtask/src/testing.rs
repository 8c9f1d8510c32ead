//! `cargo xtask test`: every suite on this kernel, then in qemu guests on Debian 12's
//! kernels, then the package; the count of tests that passed and failed at the end.

use std::{
    ffi::OsString,
    fs,
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{
    build::{build, build_dist, cargo, guest_image, run_checked},
    ebpf_object, is_root, workspace_root,
};

/// Test suites that take minutes; `cargo xtask test --quick` leaves them out.
const SLOW_SUITES: &[&str] = &["bench", "torture", "programs"];

pub(crate) fn test(quick: bool, kernel: &str, args: Vec<OsString>) -> Result<()> {
    let guests: Vec<crate::vm::Kernel> = match kernel {
        "all" if quick => Vec::new(),
        "all" => crate::vm::Kernel::ALL.to_vec(),
        "host" => Vec::new(),
        name => vec![crate::vm::Kernel::from_name(name).with_context(|| {
            format!("unknown kernel `{name}` (expected host, all, debian12, debian12-6.12)")
        })?],
    };
    let on_host = matches!(kernel, "all" | "host");
    if !is_root() {
        bail!("the tests load eBPF programs and trace other processes: run `sudo cargo xtask test` (CI runs as root)");
    }
    build()?;
    run_checked(cargo().args(["fmt", "--all", "--", "--check"]))
        .context("formatting (run `cargo fmt --all`)")?;
    run_checked(cargo().args([
        "fmt",
        "--manifest-path",
        "rksm-ebpf/Cargo.toml",
        "--",
        "--check",
    ]))
    .context("formatting of rksm-ebpf")?;
    run_checked(
        cargo()
            .args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--release",
                "--",
                "-D",
                "warnings",
            ])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )
    .context("clippy")?;
    // The qemu guests of the `programs` suite boot this.
    let guest = guest_image()?;
    let test = || {
        let mut test = cargo();
        test.args(["test", "--workspace", "--release"])
            .env("RKSM_EBPF_OBJECT", ebpf_object())
            .env("RKSM_GUEST_INITRD", &guest);
        test
    };
    let mut runs = Vec::new();
    if quick {
        // Every target but the slow suites, named one by one (cargo has no exclusion, and
        // will not mix doc tests with other targets).
        let mut some = test();
        some.args(["--lib", "--bins"]);
        for suite in test_suites()? {
            if !SLOW_SUITES.contains(&suite.as_str()) {
                some.args(["--test", &suite]);
            }
        }
        let mut docs = test();
        docs.arg("--doc");
        runs.extend([some, docs]);
        eprintln!("xtask: --quick: leaving out {}", SLOW_SUITES.join(", "));
    } else {
        runs.push(test());
    }
    if !on_host {
        runs.clear();
    }
    let (mut passed, mut failed) = (0, 0);
    let mut outcome = Ok(());
    let mut lines = Vec::new();
    for mut run in runs {
        let (p, f, result) = cargo_test(run.args(&args))?;
        (passed, failed) = (passed + p, failed + f);
        outcome = outcome.and(result);
    }
    if on_host {
        lines.push(format!("host kernel: {passed} passed, {failed} failed"));
    }
    for guest in guests {
        let run = crate::vm::test(&workspace_root(), guest, &ebpf_object())?;
        (passed, failed) = (passed + run.passed, failed + run.failed);
        let mut line = format!(
            "{}: {} passed, {} failed",
            guest.name(),
            run.passed,
            run.failed
        );
        if !run.problems.is_empty() {
            line += &format!(" ({})", run.problems.join("; "));
            outcome = outcome.and(Err(anyhow::anyhow!(
                "the {} guest: {}",
                guest.name(),
                run.problems.join("; ")
            )));
        }
        lines.push(line);
    }
    // One line totalling every test binary's `test result:` line, so the outcome does not
    // hinge on which binary ran last; and one per kernel.
    for line in lines {
        println!("tests on {line}");
    }
    // The Debian package, built from the dist binary and checked in a scratch root.
    if on_host && !quick {
        let packaged =
            build_dist().and_then(|binary| crate::deb::build(&workspace_root(), &binary));
        match &packaged {
            Ok(deb) => println!(
                "package: {} built, installed into a scratch root, checked",
                deb.display()
            ),
            Err(e) => println!("package: {e:#}"),
        }
        outcome = outcome.and(packaged.map(|_| ()));
    }
    println!("tests: {passed} passed, {failed} failed");
    outcome?;
    if passed == 0 {
        bail!("cargo test ran no test");
    }
    Ok(())
}

/// The integration test suites, as tests/Cargo.toml names them.
fn test_suites() -> Result<Vec<String>> {
    let manifest = fs::read_to_string(workspace_root().join("tests/Cargo.toml"))?;
    let mut suites = Vec::new();
    let mut in_test = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_test = line == "[[test]]";
        } else if let Some(name) = line.strip_prefix("name = ").filter(|_| in_test) {
            suites.push(name.trim_matches('"').to_string());
        }
    }
    if suites.is_empty() {
        bail!("no [[test]] in tests/Cargo.toml");
    }
    Ok(suites)
}

/// Runs `cargo test`, passing its output through; returns the tests passed and failed, as
/// its `test result:` lines count them, and whether it succeeded.
fn cargo_test(cmd: &mut Command) -> Result<(u64, u64, Result<()>)> {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(child.stdout.take().context("cargo test stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some(result) = line.strip_prefix("test result: ") {
            passed += count_before(result, " passed");
            failed += count_before(result, " failed");
        }
    }
    let status = child.wait()?;
    let result = if status.success() {
        Ok(())
    } else {
        Err(anyhow::anyhow!("cargo test failed with {status}"))
    };
    Ok((passed, failed, result))
}

/// In `ok. 6 passed; 0 failed; ...`, the number before `word`.
pub(crate) fn count_before(result: &str, word: &str) -> u64 {
    result
        .split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok.")
                .trim_start_matches("FAILED.")
                .trim()
                .strip_suffix(word.trim())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}
