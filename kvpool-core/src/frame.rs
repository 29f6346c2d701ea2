//! Length-prefixed postcard frames over a stream: the wire format of kvpool's Unix-socket
//! protocols (the scheduler's lookups, the node-wide pool daemon).
//!
//! A frame is a little-endian `u32` body length, then the postcard encoding of one message.
//! Either side refuses a frame above [`MAX_FRAME_BYTES`] before reading its body, so a peer
//! sending garbage costs at most that much memory.

use std::io::{self, Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Largest frame either side accepts.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

fn invalid_data(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Writes one frame (one `write_all`, so a frame is never interleaved with another writer's).
pub fn write_frame<T: Serialize>(stream: &mut impl Write, message: &T) -> io::Result<()> {
    let body = postcard::to_stdvec(message).map_err(|e| invalid_data(e.to_string()))?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(invalid_data(format!(
            "frame of {} bytes is too large",
            body.len()
        )));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    stream.write_all(&frame)
}

/// Reads one frame; a frame above [`MAX_FRAME_BYTES`] or one that does not decode is an
/// `InvalidData` error.
pub fn read_frame<T: DeserializeOwned>(stream: &mut impl Read) -> io::Result<T> {
    read_frame_within(stream, MAX_FRAME_BYTES)
}

/// [`read_frame`] refusing frames above `max_bytes` (a server whose requests are small bounds
/// what one peer can make it allocate).
pub fn read_frame_within<T: DeserializeOwned>(
    stream: &mut impl Read,
    max_bytes: usize,
) -> io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max_bytes.min(MAX_FRAME_BYTES) {
        return Err(invalid_data(format!("frame of {len} bytes is too large")));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(|e| invalid_data(e.to_string()))
}

/// Decodes one frame's body (read by a caller that checked it first); `InvalidData` when it
/// does not decode.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> io::Result<T> {
    postcard::from_bytes(body).map_err(|e| invalid_data(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_round_trips_and_an_oversized_or_garbled_one_is_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &(7u32, "seven".to_string())).unwrap();
        let back: (u32, String) = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(back, (7, "seven".to_string()));

        let huge = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
        let err = read_frame::<u32>(&mut huge.as_slice()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);

        let mut garbled = 3u32.to_le_bytes().to_vec();
        garbled.extend_from_slice(&[0xff, 0xff, 0xff]);
        let err = read_frame::<(u32, String)>(&mut garbled.as_slice()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
