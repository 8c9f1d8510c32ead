//! The status server: a thread that answers the root-only unix socket with the latest status
//! as JSON and, if asked for, HTTP clients with Prometheus text; every write bounded in time,
//! at most a few clients at once, and a pause instead of a spin when no file is left.

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::{
        fd::AsFd,
        unix::{
            fs::FileTypeExt,
            net::{UnixListener, UnixStream},
        },
    },
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::{
        socket::{setsockopt, sockopt},
        time::TimeVal,
    },
};

use super::{
    metrics::{render_metrics, render_public_metrics},
    Status, StatusError,
};

/// Who may see what over HTTP: without `token`, daemon-wide and per-domain series only.
#[derive(Debug, Clone, Default)]
pub struct HttpAccess {
    /// The address to serve `GET /metrics` on.
    pub address: Option<SocketAddr>,
    /// A bearer token (`Authorization: Bearer ...`) that also gets the per-target series.
    pub token: Option<String>,
}

impl HttpAccess {
    /// Reads the token from `path`: one line, in a file owned by rksm's user (root) and
    /// kept from other users (mode 0600 or narrower), or a one-line reason why not. The
    /// checks are made on the file opened, so a file swapped in between is not read; a link
    /// (a Kubernetes secret volume's) is followed to the file it names.
    pub fn read_token(path: &Path) -> Result<String, TokenError> {
        use std::os::unix::fs::MetadataExt;
        let path_buf = || path.to_path_buf();
        let unreadable = |source| TokenError::Unreadable {
            path: path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(unreadable)?;
        let meta = file.metadata().map_err(unreadable)?;
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(TokenError::Owner {
                path: path_buf(),
                me,
                owner: meta.uid(),
            });
        }
        if meta.mode() & 0o077 != 0 {
            return Err(TokenError::Open(path_buf()));
        }
        let mut token = String::new();
        file.read_to_string(&mut token).map_err(unreadable)?;
        let token = token.trim().to_string();
        if token.len() < 16 || token.contains(char::is_whitespace) {
            return Err(TokenError::NotAToken(path_buf()));
        }
        Ok(token)
    }
}

/// Why the metrics token file is not used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// It cannot be opened or read.
    #[error("{}: {source}", .path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// It belongs to another user.
    #[error("{}: the metrics token file must be owned by uid {me}, rksm's user, not uid {owner} (chown)", .path.display())]
    Owner {
        /// The file.
        path: PathBuf,
        /// rksm's user.
        me: u32,
        /// Its owner.
        owner: u32,
    },
    /// Its group or others may read it.
    #[error("{}: the metrics token file must not be readable by group or others (chmod 600)", .0.display())]
    Open(PathBuf),
    /// It does not hold one word of at least 16 characters.
    #[error("{}: the metrics token must be one word of at least 16 characters", .0.display())]
    NotAToken(PathBuf),
}

/// How long one client of the status server may take, reading its request and the answer:
/// each client has a thread and a deadline of its own, so a slow one delays nobody else.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// Clients served at once, on the socket and on the HTTP port each; more wait in the
/// listen queue.
const MAX_CLIENTS: usize = 16;

/// Serves the latest [`Status`] from a thread, until dropped.
pub struct StatusServer {
    latest: Arc<Mutex<Status>>,
    stop: Arc<AtomicBool>,
    /// Dropped to wake the accept loop: it sleeps until a client or this.
    waker: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
    socket: PathBuf,
}

impl StatusServer {
    /// Listens on `socket` (created mode 0600, so only root can connect; a stale socket left
    /// by a dead daemon is replaced, any other file is not) and, if `http.address` is given,
    /// serves metrics over HTTP there.
    pub fn start(socket: &Path, http: HttpAccess) -> Result<Self, StatusError> {
        let listen_err = |what: String| move |source| StatusError::Listen { what, source };
        let sock_err = listen_err(socket.display().to_string());
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(listen_err(dir.display().to_string()))?;
        }
        match std::fs::symlink_metadata(socket) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(socket).map_err(listen_err(socket.display().to_string()))?
            }
            Ok(_) => {
                return Err(sock_err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a socket",
                )))
            }
            Err(_) => {}
        }
        // The socket file takes its mode from the umask at bind: closed to all but root from
        // its first instant. Nothing else runs in rksm while the umask is narrowed.
        use nix::sys::stat::{umask, Mode};
        let old = umask(Mode::from_bits_truncate(0o177));
        let unix = UnixListener::bind(socket);
        umask(old);
        let unix = unix.map_err(sock_err)?;
        unix.set_nonblocking(true)
            .map_err(listen_err(socket.display().to_string()))?;
        let listener = http
            .address
            .map(|addr| {
                let listener = TcpListener::bind(addr).map_err(listen_err(addr.to_string()))?;
                listener
                    .set_nonblocking(true)
                    .map_err(listen_err(addr.to_string()))?;
                Ok::<_, StatusError>(listener)
            })
            .transpose()?;
        let latest = Arc::new(Mutex::new(Status::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (waker, woken) = UnixStream::pair().map_err(listen_err("status thread".into()))?;
        let thread = {
            let (latest, stop) = (latest.clone(), stop.clone());
            let token = http.token;
            std::thread::Builder::new()
                .name("rksm-status".into())
                .spawn(move || serve(&unix, listener.as_ref(), token, &latest, &stop, &woken))
                .map_err(listen_err("status thread".into()))?
        };
        Ok(StatusServer {
            latest,
            stop,
            waker: Some(waker),
            thread: Some(thread),
            socket: socket.into(),
        })
    }

    /// Replaces the status served.
    pub fn publish(&self, status: Status) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = status;
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Its peer becomes readable (end of file): the accept loop wakes and sees the flag.
        drop(self.waker.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Accepts clients and hands each to a thread of its own, sleeping until one comes, a
/// paused listener is due, or `woken` says to look at `stop`.
fn serve(
    unix: &UnixListener,
    http: Option<&TcpListener>,
    token: Option<String>,
    latest: &Arc<Mutex<Status>>,
    stop: &AtomicBool,
    woken: &UnixStream,
) {
    // Root's socket and the HTTP port each have their own clients' budget, so that a crowd
    // of HTTP clients cannot keep `rksm status` out.
    let (unix_busy, http_busy) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let token = Arc::new(token);
    let spawn = |busy: &Arc<AtomicUsize>,
                 name: String,
                 work: Box<dyn FnOnce(Status) -> io::Result<()> + Send>| {
        busy.fetch_add(1, Ordering::Relaxed);
        let (mine, latest) = (busy.clone(), latest.clone());
        let spawned = std::thread::Builder::new()
            .name("rksm-status-client".into())
            .spawn(move || {
                // The snapshot is taken, and its live values read, in the client's thread.
                let status = latest
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .read_live();
                if let Err(e) = work(status) {
                    log::debug!("{name}: {e}");
                }
                mine.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::Relaxed);
        }
    };
    let has_room = |busy: &AtomicUsize| busy.load(Ordering::Relaxed) < MAX_CLIENTS;
    let (mut unix_backoff, mut http_backoff) = (Backoff::default(), Backoff::default());
    while !stop.load(Ordering::Relaxed) {
        // A listener whose clients are all busy is not accepted from: newcomers wait in its
        // listen queue, not closed. Nor is one whose last accept failed (out of files, say),
        // for a while: its queue stays readable, and polling it again at once would spin.
        let now = Instant::now();
        let unix_open = has_room(&unix_busy) && unix_backoff.ready(now);
        let http_open = http.filter(|_| has_room(&http_busy) && http_backoff.ready(now));
        let mut fds = Vec::with_capacity(3);
        fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
        if unix_open {
            fds.push(PollFd::new(unix.as_fd(), PollFlags::POLLIN));
        }
        if let Some(http) = http_open {
            fds.push(PollFd::new(http.as_fd(), PollFlags::POLLIN));
        }
        // A listener left out because its clients are all busy is looked at again after a
        // while (a client thread ending wakes nobody); one paused, when its pause ends.
        let full = !has_room(&unix_busy) || (http.is_some() && !has_room(&http_busy));
        let wait = [
            unix_backoff.left(now),
            http_backoff.left(now),
            full.then_some(BUSY_POLL),
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout = wait.map_or(PollTimeout::NONE, |w| {
            PollTimeout::try_from(w).unwrap_or(PollTimeout::MAX)
        });
        if poll(&mut fds, timeout).unwrap_or(0) <= 0 {
            continue;
        }
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            continue;
        }
        drop(fds);
        if unix_open {
            match unix.accept() {
                Ok((stream, _)) => {
                    unix_backoff.succeeded();
                    spawn(
                        &unix_busy,
                        "status client".into(),
                        Box::new(move |status| answer_unix(stream, &status)),
                    );
                }
                Err(e) => unix_backoff.failed("the status socket", &e),
            }
        }
        if let Some(http) = http_open {
            match http.accept() {
                Ok((stream, peer)) => {
                    http_backoff.succeeded();
                    let token = token.clone();
                    spawn(
                        &http_busy,
                        format!("metrics client {peer}"),
                        Box::new(move |status| answer_http(stream, &status, token.as_deref())),
                    );
                }
                Err(e) => http_backoff.failed("the metrics port", &e),
            }
        }
    }
}

/// How often the accept loop looks again at a listener whose clients were all busy.
const BUSY_POLL: Duration = Duration::from_millis(50);

/// Pauses a listener after a failed accept: 10 ms, doubling up to a second while accepts
/// keep failing.
#[derive(Debug, Default)]
struct Backoff {
    until: Option<Instant>,
    wait: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|until| now >= until)
    }

    /// How long until the listener is looked at again, while it is paused.
    fn left(&self, now: Instant) -> Option<Duration> {
        self.until
            .filter(|&until| until > now)
            .map(|until| until - now)
    }

    fn succeeded(&mut self) {
        self.until = None;
        self.wait = Duration::ZERO;
    }

    fn failed(&mut self, what: &str, e: &io::Error) {
        // Nothing was waiting after all (another thread took it, or the client left).
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted
                | io::ErrorKind::ConnectionAborted
        ) {
            return;
        }
        if self.wait.is_zero() {
            log::warn!("accepting on {what}: {e}; pausing it, up to a second at a time, until it works again");
        }
        self.wait = (self.wait * 2).clamp(Self::FIRST, Self::MOST);
        self.until = Some(Instant::now() + self.wait);
    }
}

fn answer_unix(mut stream: UnixStream, status: &Status) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(CLIENT_DEADLINE))?;
    // Only root: the socket's mode says so already; the peer's credentials say it again.
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(io::Error::from)?;
    if peer.uid() != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("uid {} is not root", peer.uid()),
        ));
    }
    let mut body = serde_json::to_vec(status).map_err(io::Error::other)?;
    body.push(b'\n');
    write_by(
        &mut stream,
        &body,
        std::time::Instant::now() + CLIENT_DEADLINE,
    )
}

/// Writes all of `bytes` to `stream` by `deadline`, or fails with `TimedOut`: a client that
/// stops reading holds its thread no longer than that. Each write is given the time left as
/// the socket's send timeout.
pub(super) fn write_by<S: Write + AsFd>(
    stream: &mut S,
    mut bytes: &[u8],
    deadline: std::time::Instant,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "client too slow"));
        }
        set_write_deadline(stream, left)?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "client too slow"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Bounds `stream`'s next writes to `left` (SO_SNDTIMEO, a unix or a TCP socket alike),
/// rounded up to a microsecond: a zero timeout would be none.
fn set_write_deadline(stream: &impl AsFd, left: Duration) -> io::Result<()> {
    let micros = left.as_micros().clamp(1, i64::MAX as u128) as i64;
    let timeout = TimeVal::new(micros / 1_000_000, micros % 1_000_000);
    setsockopt(stream, sockopt::SendTimeout, &timeout).map_err(io::Error::from)
}

/// True if `a` equals `b`, in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn answer_http(mut stream: TcpStream, status: &Status, token: Option<&str>) -> io::Result<()> {
    let deadline = std::time::Instant::now() + CLIENT_DEADLINE;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(CLIENT_DEADLINE))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request too slow"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&request);
    let target = text.split_whitespace().nth(1).unwrap_or("");
    let presented = text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("authorization")
            .then(|| value.trim().strip_prefix("Bearer ").map(str::trim))?
    });
    let trusted =
        matches!((token, presented), (Some(t), Some(p)) if same_secret(t.as_bytes(), p.as_bytes()));
    let (code, body) = match (text.starts_with("GET "), target) {
        (true, "/metrics") if trusted => ("200 OK", render_metrics(status)),
        (true, "/metrics") => ("200 OK", render_public_metrics(status)),
        (true, _) => ("404 Not Found", "rksm serves /metrics\n".into()),
        (false, _) => ("405 Method Not Allowed", "GET only\n".into()),
    };
    let answer = format!(
        "HTTP/1.1 {code}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    write_by(&mut stream, answer.as_bytes(), deadline)
}
