//! The client side: what `rksm status` asks the socket.

use std::{
    io::{self, Read},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use super::{Status, StatusError};

/// Asks the daemon listening on `socket` for its status.
pub fn query(socket: &Path) -> Result<Status, StatusError> {
    let not_running = |source| StatusError::NotRunning {
        socket: socket.into(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        if e.kind() == io::ErrorKind::PermissionDenied {
            StatusError::NotAllowed(socket.into())
        } else {
            not_running(e)
        }
    })?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(not_running)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).map_err(not_running)?;
    serde_json::from_slice(&reply).map_err(|e| StatusError::BadReply {
        socket: socket.into(),
        reason: if reply.is_empty() {
            "empty reply (only root may ask)".into()
        } else {
            e.to_string()
        },
    })
}
