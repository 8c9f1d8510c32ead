//! A FUSE file system serving one executable file, whose server can be told to stop
//! answering: what a hung network mount or a user's `fusermount` does to whoever touches it.
//!
//! It speaks the kernel's protocol on /dev/fuse directly (INIT, LOOKUP, GETATTR, OPEN, READ,
//! RELEASE, FLUSH; everything else is ENOSYS), with no attribute caching, so every `stat` of
//! the file is a request. Once silenced, requests are taken and never answered; dropping the
//! mount aborts the connection (every waiter gets ENOTCONN) and detaches it.

use std::{
    ffi::CString,
    fs::File,
    io::{Read, Write},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_BATCH_FORGET: u32 = 42;
const ROOT: u64 = 1;
const FILE: u64 = 2;
/// FOPEN_KEEP_CACHE: the file's pages stay cached across opens.
const FOPEN_KEEP_CACHE: u32 = 1 << 1;

/// A mounted file system with one file, `prog`.
pub struct SilentFuse {
    dir: PathBuf,
    /// The server's end of the connection; closing it aborts the connection.
    device: Option<OwnedFd>,
    silent: Arc<AtomicBool>,
}

impl SilentFuse {
    /// Mounts a file system at a fresh directory under /run whose only file, `prog`, holds
    /// `content` with mode 0755.
    pub fn mount(name: &str, content: Vec<u8>) -> SilentFuse {
        let dir = PathBuf::from(format!("/run/rksm-test-fuse-{name}"));
        let _ = std::fs::create_dir_all(&dir);
        let device = File::options()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .expect("/dev/fuse");
        let fd = device.as_raw_fd();
        let options = CString::new(format!(
            "fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        ))
        .unwrap();
        let target = CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let r = unsafe {
            libc::mount(
                c"rksm-test".as_ptr(),
                target.as_ptr(),
                c"fuse".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                options.as_ptr().cast(),
            )
        };
        assert_eq!(r, 0, "mounting FUSE: {}", std::io::Error::last_os_error());
        let silent = Arc::new(AtomicBool::new(false));
        // SAFETY: a new fd for the same open file description, owned by the server thread;
        // close-on-exec, or every process the test starts would hold the connection open.
        let served = unsafe { File::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) };
        let quiet = silent.clone();
        std::thread::spawn(move || serve(served, content, &quiet));
        SilentFuse {
            dir,
            device: Some(device.into()),
            silent,
        }
    }

    /// The executable's path.
    pub fn prog(&self) -> PathBuf {
        self.dir.join("prog")
    }

    /// From now on no request is answered.
    pub fn silence(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }

    /// Where it is mounted.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Aborts the connection: every process waiting on the silent server (even in the
    /// uninterruptible part of a request) gets ENOTCONN. Through fusectl (mounted if it is
    /// not), where the connection is named by the mount's minor device number, taken from
    /// mountinfo (a stat of the mount would wait for the server).
    pub fn abort(&self) {
        self.silence();
        let connections = Path::new("/sys/fs/fuse/connections");
        if std::fs::read_dir(connections).is_ok_and(|mut d| d.next().is_none()) {
            // SAFETY: mount(2) with NUL-terminated strings.
            unsafe {
                libc::mount(
                    c"fusectl".as_ptr(),
                    c"/sys/fs/fuse/connections".as_ptr(),
                    c"fusectl".as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dir = self.dir.to_string_lossy();
        let id = mountinfo.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(4) == Some(&&*dir)).then(|| fields[2].split(':').nth(1))?
        });
        if let Some(id) = id {
            let _ = std::fs::write(connections.join(id).join("abort"), "1");
        }
    }
}

impl Drop for SilentFuse {
    fn drop(&mut self) {
        // Abort first, so that the detach cannot hang.
        self.abort();
        drop(self.device.take());
        let target = CString::new(self.dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: umount2 with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// `struct fuse_attr` of the root or the file.
fn attr(node: u64, size: u64) -> Vec<u8> {
    let mut a = Vec::with_capacity(88);
    let (mode, nlink) = match node {
        ROOT => (0o040755u32, 2u32),
        _ => (0o100755, 1),
    };
    for v in [node, size, size.div_ceil(512), 0, 0, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0u32, 0, 0, mode, nlink, 0, 0, 0, 4096, 0] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    a
}

fn serve(mut device: File, content: Vec<u8>, silent: &AtomicBool) {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match device.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue, // interrupted request
            Err(_) => return,                                             // aborted, unmounted
        };
        if silent.load(Ordering::SeqCst) {
            continue;
        }
        let req = &buf[..n];
        let (opcode, unique, node) = (le32(req, 4), le64(req, 8), le64(req, 16));
        let body = &req[40..];
        let reply: Result<Vec<u8>, i32> = match opcode {
            FUSE_INIT => {
                let mut out = Vec::with_capacity(64);
                for v in [7u32, 31, le32(body, 8), 0] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&0u16.to_le_bytes()); // max_background
                out.extend_from_slice(&0u16.to_le_bytes()); // congestion_threshold
                out.extend_from_slice(&(128u32 << 10).to_le_bytes()); // max_write
                out.extend_from_slice(&1u32.to_le_bytes()); // time_gran
                out.resize(64, 0);
                Ok(out)
            }
            FUSE_LOOKUP if node == ROOT && body.starts_with(b"prog\0") => {
                let mut out = Vec::new();
                // nodeid, generation, entry_valid, attr_valid (0: ask every time), nsecs
                for v in [FILE, 1, 0, 0] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&[0u8; 8]);
                out.extend(attr(FILE, content.len() as u64));
                Ok(out)
            }
            FUSE_LOOKUP => Err(libc::ENOENT),
            FUSE_GETATTR => {
                let mut out = vec![0u8; 16];
                out.extend(attr(node, content.len() as u64));
                Ok(out)
            }
            FUSE_OPEN => {
                let mut out = Vec::new();
                out.extend_from_slice(&0u64.to_le_bytes());
                out.extend_from_slice(&FOPEN_KEEP_CACHE.to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                Ok(out)
            }
            FUSE_READ => {
                let (offset, size) = (le64(body, 8) as usize, le32(body, 16) as usize);
                let start = offset.min(content.len());
                let end = (offset + size).min(content.len());
                Ok(content[start..end].to_vec())
            }
            FUSE_RELEASE | FUSE_FLUSH => Ok(Vec::new()),
            FUSE_FORGET | FUSE_BATCH_FORGET => continue,
            _ => Err(libc::ENOSYS),
        };
        let (error, payload) = match reply {
            Ok(payload) => (0, payload),
            Err(errno) => (-errno, Vec::new()),
        };
        let mut out = Vec::with_capacity(16 + payload.len());
        out.extend_from_slice(&(16 + payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&error.to_le_bytes());
        out.extend_from_slice(&unique.to_le_bytes());
        out.extend(payload);
        if device.write_all(&out).is_err() && silent.load(Ordering::SeqCst) {
            return;
        }
    }
}
