//! `cargo xtask deb`: a Debian package of rksm, built with dpkg-deb and checked before it is
//! handed over.
//!
//! The package holds the stripped `dist` binary in /usr/bin, its man pages and bash
//! completions, the systemd unit (pointed at /usr/bin), the example configuration as the
//! conffile /etc/rksm/rksm.toml, and the DaemonSet as an example. Its postinst only tells
//! systemd that a unit appeared: nothing is enabled or started, since rksm needs its targets
//! chosen first. The check installs the package into a scratch root with dpkg, looks at every
//! file the package promises, runs the installed binary, and runs lintian when it is
//! installed or installs from the registry.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

/// Where the unit in packaging/ expects the binary, and where the package puts it.
const UNIT_BINARY: (&str, &str) = ("/usr/local/bin/rksm", "/usr/bin/rksm");

/// Maintainer scripts: `configure` reloads systemd's units if systemd runs (and the package
/// is not being installed into another root); nothing is enabled or started.
const POSTINST: &str = r#"#!/bin/sh
set -e
# rksm is not enabled or started here: choose its targets in /etc/rksm/rksm.toml, then
# systemctl enable --now rksm.
if [ "$1" = configure ] && [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
"#;

const POSTRM: &str = r#"#!/bin/sh
set -e
if [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
"#;

const COPYRIGHT: &str = "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: rksm

Files: *
Copyright: 2026 the rksm developers
License: MIT or Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 can be found in
 /usr/share/common-licenses/Apache-2.0. The MIT license:
 .
 Permission is hereby granted, free of charge, to any person obtaining a copy of this
 software and associated documentation files (the \"Software\"), to deal in the Software
 without restriction, including without limitation the rights to use, copy, modify, merge,
 publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons
 to whom the Software is furnished to do so, subject to the following conditions:
 .
 The above copyright notice and this permission notice shall be included in all copies or
 substantial portions of the Software.
 .
 THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
 INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR
 PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE
 FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
 OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
 DEALINGS IN THE SOFTWARE.
";

/// Files the package must install, as paths under the root.
const PROMISED: &[&str] = &[
    "usr/bin/rksm",
    "usr/share/man/man1/rksm.1.gz",
    "usr/share/man/man1/rksm-daemon.1.gz",
    "usr/share/bash-completion/completions/rksm",
    "lib/systemd/system/rksm.service",
    "etc/rksm/rksm.toml",
    "usr/share/doc/rksm/copyright",
    "usr/share/doc/rksm/changelog.gz",
    "usr/share/doc/rksm/examples/rksm-daemonset.yaml",
];

/// Builds target/deb/rksm_VERSION_amd64.deb from the dist binary `binary` and the files of
/// `root` (the workspace), checks it, and returns its path.
pub fn build(root: &Path, binary: &Path) -> Result<PathBuf> {
    let version = version_of(binary)?;
    let out = root.join("target/deb");
    let tree = out.join(format!("rksm_{version}_amd64"));
    if tree.exists() {
        fs::remove_dir_all(&tree).with_context(|| format!("removing {}", tree.display()))?;
    }
    let dir = |p: &str| -> Result<PathBuf> {
        let d = tree.join(p);
        fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        Ok(d)
    };
    let bin = dir("usr/bin")?.join("rksm");
    fs::copy(binary, &bin).with_context(|| format!("copying {}", binary.display()))?;
    set_mode(&bin, 0o755)?;

    let man = dir("usr/share/man/man1")?;
    crate::build::run_checked(Command::new(&bin).arg("man").arg("--out-dir").arg(&man))?;
    for page in fs::read_dir(&man)? {
        crate::build::run_checked(Command::new("gzip").arg("-9n").arg(page?.path()))?;
    }
    let bash = Command::new(&bin).args(["completions", "bash"]).output()?;
    if !bash.status.success() {
        bail!("rksm completions bash failed");
    }
    fs::write(
        dir("usr/share/bash-completion/completions")?.join("rksm"),
        bash.stdout,
    )?;

    let packaging = root.join("packaging");
    let unit = fs::read_to_string(packaging.join("rksm.service"))?;
    if !unit.contains(UNIT_BINARY.0) {
        bail!("packaging/rksm.service no longer starts {}", UNIT_BINARY.0);
    }
    fs::write(
        dir("lib/systemd/system")?.join("rksm.service"),
        unit.replace(UNIT_BINARY.0, UNIT_BINARY.1),
    )?;
    fs::copy(
        packaging.join("rksm.toml"),
        dir("etc/rksm")?.join("rksm.toml"),
    )?;
    let doc = dir("usr/share/doc/rksm")?;
    fs::write(doc.join("copyright"), COPYRIGHT)?;
    fs::write(doc.join("changelog"), changelog(&version))?;
    crate::build::run_checked(Command::new("gzip").arg("-9n").arg(doc.join("changelog")))?;
    fs::copy(
        packaging.join("rksm-daemonset.yaml"),
        dir("usr/share/doc/rksm/examples")?.join("rksm-daemonset.yaml"),
    )?;

    let debian = dir("DEBIAN")?;
    fs::write(
        debian.join("control"),
        control(&version, installed_kib(&tree)?),
    )?;
    fs::write(debian.join("conffiles"), "/etc/rksm/rksm.toml\n")?;
    for (name, text) in [("postinst", POSTINST), ("postrm", POSTRM)] {
        fs::write(debian.join(name), text)?;
        set_mode(&debian.join(name), 0o755)?;
    }
    fs::write(debian.join("md5sums"), md5sums(&tree)?)?;

    let deb = out.join(format!("rksm_{version}_amd64.deb"));
    crate::build::run_checked(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&tree)
            .arg(&deb),
    )
    .context("dpkg-deb --build")?;
    check(&out, &deb, &version)?;
    Ok(deb)
}

/// The version the binary reports (`rksm --version`: "rksm X.Y.Z"): the package's.
fn version_of(binary: &Path) -> Result<String> {
    let out = Command::new(binary).arg("--version").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.trim().strip_prefix("rksm ") {
        Some(version) if out.status.success() && !version.is_empty() => Ok(version.to_string()),
        _ => bail!("{} --version said {text:?}", binary.display()),
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

fn control(version: &str, installed_kib: u64) -> String {
    format!(
        "Package: rksm
Version: {version}
Architecture: amd64
Maintainer: rksm developers <rksm@users.noreply.github.com>
Installed-Size: {installed_kib}
Depends: libc6 (>= 2.34)
Section: admin
Priority: optional
Description: deduplicates identical anonymous memory across processes
 rksm finds pages of memory that processes hold with the same contents and hands
 them to the kernel's KSM to merge, like ksmd, at a fraction of its CPU: an eBPF
 program traces page-write faults, so pages that were not written are not read
 again. Candidates are checksummed and compared before anything is merged.
 .
 The service is installed but not enabled: choose its targets in
 /etc/rksm/rksm.toml, then run systemctl enable --now rksm.
"
    )
}

fn changelog(version: &str) -> String {
    format!(
        "rksm ({version}) unstable; urgency=medium\n\n  * Packaged by cargo xtask deb.\n\n -- rksm developers <rksm@users.noreply.github.com>  Wed, 02 Dec 2026 00:00:00 +0000\n"
    )
}

/// The size of everything but DEBIAN/, in KiB, as Installed-Size wants it.
fn installed_kib(tree: &Path) -> Result<u64> {
    let out = Command::new("du")
        .args(["-sk", "--exclude=DEBIAN"])
        .arg(tree)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .context("du -sk of the package tree")
}

/// DEBIAN/md5sums: every file but the control files and conffiles, relative to the root.
fn md5sums(tree: &Path) -> Result<String> {
    let mut files = Vec::new();
    let mut dirs = vec![tree.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in fs::read_dir(&d)? {
            let path = entry?.path();
            let rel = path.strip_prefix(tree)?.to_path_buf();
            if rel.starts_with("DEBIAN") || rel.starts_with("etc") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(rel);
            }
        }
    }
    files.sort();
    let out = Command::new("md5sum")
        .current_dir(tree)
        .args(&files)
        .output()?;
    if !out.status.success() {
        bail!("md5sum failed");
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Installs `deb` into a scratch root under `out` and checks what it put there; then asks
/// `dpkg-deb --info` and lintian.
fn check(out: &Path, deb: &Path, version: &str) -> Result<()> {
    let scratch = out.join("scratch-root");
    if scratch.exists() {
        fs::remove_dir_all(&scratch)?;
    }
    let admin = scratch.join("var/lib/dpkg");
    fs::create_dir_all(admin.join("info"))?;
    fs::create_dir_all(admin.join("updates"))?;
    fs::write(admin.join("status"), "")?;
    // Without a chroot: the scratch root has no shell; the scripts see DPKG_ROOT and leave
    // this machine's systemd alone. It has no libc6 package either, only this machine's.
    crate::build::run_checked(
        Command::new("dpkg")
            .arg(format!("--root={}", scratch.display()))
            .args([
                "--force-script-chrootless",
                "--force-not-root",
                "--force-depends",
                "--log=/dev/null",
                "-i",
            ])
            .arg(deb),
    )
    .context("installing the package into a scratch root")?;
    for file in PROMISED {
        let path = scratch.join(file);
        if !path.is_file() {
            bail!("the package did not install /{file}");
        }
    }
    let unit = fs::read_to_string(scratch.join("lib/systemd/system/rksm.service"))?;
    if !unit.contains(&format!("ExecStart={} daemon", UNIT_BINARY.1)) {
        bail!("the installed unit does not start {}", UNIT_BINARY.1);
    }
    if scratch
        .join("etc/systemd/system/multi-user.target.wants")
        .exists()
    {
        bail!("installing the package enabled a unit");
    }
    let installed =
        version_of(&scratch.join("usr/bin/rksm")).context("running the installed rksm")?;
    if installed != version {
        bail!("the installed rksm is {installed}, the package {version}");
    }
    let status = fs::read_to_string(admin.join("status"))?;
    if !status.contains("Package: rksm") || !status.contains("Status: install ok installed") {
        bail!("dpkg does not list rksm as installed in the scratch root");
    }
    crate::build::run_checked(Command::new("dpkg-deb").arg("--info").arg(deb))?;
    lintian(deb)
}

/// lintian on `deb`, installed from the registry if missing; no error and no warning may
/// remain. Where it cannot be had, says so and passes.
fn lintian(deb: &Path) -> Result<()> {
    if Command::new("lintian").arg("--version").output().is_err()
        && crate::setup::apt_install(&["lintian"]).is_err()
    {
        eprintln!("xtask: lintian is not installed and could not be: not run");
        return Ok(());
    }
    crate::build::run_checked(
        Command::new("lintian")
            .args(["--fail-on", "error,warning", "--suppress-tags"])
            // A package built outside a Debian source tree, uploaded nowhere.
            .arg("initial-upload-closes-no-bugs")
            .arg(deb),
    )
    .context("lintian")
}
