//! The store's own connection to a single Redis node over plain TCP.
//!
//! A store call is one command and one reply, and a store sends many at a
//! time over one connection. redis-rs' multiplexed connection does that
//! through a channel to a driver task that packs each command anew and
//! parses replies with a general combinator parser: in process about 8,000
//! instructions per command (`bench/peer/inproc.sh`). This connection
//! writes each command's RESP straight into one shared buffer, next to the
//! sender its reply goes to, under one lock, so the order of replies is the
//! order of the buffer; a writer task sends whatever has gathered in one
//! system call, and a reader task parses the replies (RESP2, the only
//! protocol a store needs) and hands each to the next sender in line.
//!
//! It implements redis-rs' `ConnectionLike`, so every command of the store
//! (scripts, `SCRIPT LOAD`, `WAIT`, `SCAN`) runs on it unchanged; TLS,
//! RESP3 and clusters stay with redis-rs. A broken connection (the server
//! closed it, a write failed, a reply could not be parsed) fails every
//! call waiting on it and every later one with an I/O error, which makes
//! the store replace it.

use std::{collections::VecDeque, io, sync::Arc};

use bytes::{Buf, BytesMut};
use parking_lot::Mutex;
use redis::{Arg, Cmd, RedisError, RedisFuture, RedisResult, Value, aio::ConnectionLike};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::{Notify, oneshot},
    task::AbortHandle,
};

/// At most this many calls wait for replies on one connection; more are
/// refused at once. Only a server that stopped answering gets there: every
/// store call is bounded in time, so callers give up long before.
const MAX_WAITING: usize = 1 << 16;

/// The deepest nesting of arrays a reply may have (a script's answer is
/// at most two deep).
const MAX_DEPTH: usize = 32;

/// A write buffer that grew beyond this (a large response being stored) is
/// not kept for the next writes.
const KEPT_BUFFER: usize = 1 << 20;

type Reply = oneshot::Sender<RedisResult<Value>>;

/// One connection, shared by cloning; closed when the last clone goes.
#[derive(Clone)]
pub(crate) struct DirectConnection {
    handle: Arc<Handle>,
}

struct Handle {
    shared: Arc<Shared>,
    tasks: [AbortHandle; 2],
    db: i64,
}

impl Drop for Handle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.shared
            .break_with(io::ErrorKind::NotConnected, "the connection was closed");
    }
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer: commands were added to an empty buffer, or the
    /// connection broke.
    write: Notify,
}

#[derive(Default)]
struct State {
    /// Commands not yet handed to the socket, in the order of `waiting`.
    out: BytesMut,
    /// Who gets each reply still to come, in order.
    waiting: VecDeque<Reply>,
    broken: Option<(io::ErrorKind, &'static str)>,
}

fn io_error(kind: io::ErrorKind, what: &'static str) -> RedisError {
    RedisError::from(io::Error::new(kind, what))
}

impl Shared {
    /// Marks the connection broken and fails every call waiting on it.
    fn break_with(&self, kind: io::ErrorKind, what: &'static str) {
        let waiting = {
            let mut state = self.state.lock();
            state.broken.get_or_insert((kind, what));
            state.out = BytesMut::new();
            std::mem::take(&mut state.waiting)
        };
        self.write.notify_one();
        for reply in waiting {
            let _ = reply.send(Err(io_error(kind, what)));
        }
    }
}

impl DirectConnection {
    /// Connects to `host:port`, then authenticates and selects the
    /// database `settings` name.
    pub(crate) async fn connect(
        host: &str,
        port: u16,
        settings: &redis::RedisConnectionInfo,
    ) -> RedisResult<Self> {
        let stream = TcpStream::connect((host, port)).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            write: Notify::new(),
        });
        let reader = tokio::spawn(read_replies(Arc::clone(&shared), read)).abort_handle();
        let writer = tokio::spawn(write_commands(Arc::clone(&shared), write)).abort_handle();
        let mut conn = Self {
            handle: Arc::new(Handle {
                shared,
                tasks: [reader, writer],
                db: settings.db(),
            }),
        };
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            auth.arg(password);
            auth.query_async::<()>(&mut conn).await?;
        }
        if settings.db() != 0 {
            redis::cmd("SELECT")
                .arg(settings.db())
                .query_async::<()>(&mut conn)
                .await?;
        }
        Ok(conn)
    }

    /// Queues commands (their RESP, written by `encode`) that answer
    /// `replies` replies, handing `receive` where each will arrive, in
    /// order.
    fn send(
        &self,
        replies: usize,
        encode: impl FnOnce(&mut BytesMut),
        mut receive: impl FnMut(oneshot::Receiver<RedisResult<Value>>),
    ) -> RedisResult<()> {
        let shared = &self.handle.shared;
        let was_empty = {
            let mut state = shared.state.lock();
            if let Some((kind, what)) = state.broken {
                return Err(io_error(kind, what));
            }
            if state.waiting.len() + replies > MAX_WAITING {
                // Not an I/O error: the connection is fine, only slow, and
                // replacing it would not answer sooner.
                return Err(RedisError::from((
                    redis::ErrorKind::Client,
                    "too many calls wait for the Redis server's replies",
                )));
            }
            let was_empty = state.out.is_empty();
            encode(&mut state.out);
            for _ in 0..replies {
                let (reply, receiver) = oneshot::channel();
                state.waiting.push_back(reply);
                receive(receiver);
            }
            was_empty
        };
        // A buffer that held commands already woke the writer.
        if was_empty {
            shared.write.notify_one();
        }
        Ok(())
    }
}

async fn reply(receiver: oneshot::Receiver<RedisResult<Value>>) -> RedisResult<Value> {
    receiver.await.unwrap_or_else(|_| {
        Err(io_error(
            io::ErrorKind::NotConnected,
            "the connection was closed",
        ))
    })
}

impl ConnectionLike for DirectConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let mut receiver = None;
        let sent = self.send(1, |out| encode(cmd, out), |r| receiver = Some(r));
        Box::pin(async move {
            sent?;
            match receiver {
                Some(receiver) => reply(receiver).await,
                None => Ok(Value::Nil),
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        // The packed pipeline (with MULTI and EXEC when atomic) answers
        // `offset` replies to skip, then the `count` wanted.
        let mut receivers = Vec::with_capacity(offset + count);
        let sent = self.send(
            offset + count,
            |out| out.extend_from_slice(&pipeline.get_packed_pipeline()),
            |receiver| receivers.push(receiver),
        );
        Box::pin(async move {
            sent?;
            let mut values = Vec::with_capacity(count);
            for (i, receiver) in receivers.into_iter().enumerate() {
                let value = reply(receiver).await?;
                if i >= offset {
                    values.push(value);
                }
            }
            Ok(values)
        })
    }

    fn get_db(&self) -> i64 {
        self.handle.db
    }
}

/// Writes `cmd` as a RESP array of bulk strings: per argument one copy of
/// its length line (with the line end of the argument before) and one of
/// its bytes.
fn encode(cmd: &Cmd, out: &mut BytesMut) {
    let start = out.len();
    let args = cmd.args_iter();
    let mut line = Line::default();
    line.push(b'*', args.len());
    for arg in args {
        let Arg::Simple(arg) = arg else {
            // A cursor (no call of the store has one), as redis-rs writes it.
            out.truncate(start);
            out.extend_from_slice(&cmd.get_packed_command());
            return;
        };
        line.push(b'$', arg.len());
        out.extend_from_slice(line.take());
        out.extend_from_slice(arg);
        line.end();
    }
    out.extend_from_slice(line.take());
}

/// Length lines gathered on the stack: `\r\n` ending the argument before,
/// then `$<length>\r\n`.
struct Line {
    /// Room for the array's line and a first argument's: two of at most
    /// 1 + 20 + 2 bytes.
    bytes: [u8; 48],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Self {
            bytes: [0; 48],
            len: 0,
        }
    }
}

impl Line {
    /// The line end of an argument.
    fn end(&mut self) {
        self.bytes[..2].copy_from_slice(b"\r\n");
        self.len = 2;
    }

    /// `<kind><number>\r\n`, the number in decimal.
    fn push(&mut self, kind: u8, number: usize) {
        let at = self.len;
        self.bytes[at] = kind;
        let digits = &mut self.bytes[at + 1..];
        let written = if number < 10 {
            digits[0] = b'0' + number as u8;
            1
        } else if number < 100 {
            digits[0] = b'0' + (number / 10) as u8;
            digits[1] = b'0' + (number % 10) as u8;
            2
        } else {
            let mut buffer = itoa::Buffer::new();
            let text = buffer.format(number).as_bytes();
            digits[..text.len()].copy_from_slice(text);
            text.len()
        };
        digits[written..written + 2].copy_from_slice(b"\r\n");
        self.len = at + 1 + written + 2;
    }

    fn take(&mut self) -> &[u8] {
        let len = std::mem::take(&mut self.len);
        &self.bytes[..len]
    }
}

/// The writer: hands whatever commands gathered to the socket, one write
/// for all of them, until the connection breaks or closes.
async fn write_commands(shared: Arc<Shared>, mut socket: OwnedWriteHalf) {
    let mut batch = BytesMut::new();
    loop {
        {
            let mut state = shared.state.lock();
            if state.broken.is_some() {
                return;
            }
            // The emptied buffer of the last batch takes the new commands.
            std::mem::swap(&mut state.out, &mut batch);
        }
        if batch.is_empty() {
            shared.write.notified().await;
            continue;
        }
        if socket.write_all(&batch).await.is_err() {
            shared.break_with(
                io::ErrorKind::BrokenPipe,
                "writing to the Redis server failed",
            );
            return;
        }
        if batch.capacity() > KEPT_BUFFER {
            batch = BytesMut::new();
        } else {
            batch.clear();
        }
    }
}

/// The reader: parses replies as they arrive and hands each to the call
/// next in line, until the connection breaks or closes.
async fn read_replies(shared: Arc<Shared>, mut socket: OwnedReadHalf) {
    let mut buffer = BytesMut::with_capacity(16 * 1024);
    let mut parsed = Vec::new();
    let mut replies: Vec<Reply> = Vec::new();
    loop {
        if buffer.capacity() - buffer.len() < 4 * 1024 {
            buffer.reserve(16 * 1024);
        }
        match socket.read_buf(&mut buffer).await {
            Ok(0) => {
                shared.break_with(
                    io::ErrorKind::UnexpectedEof,
                    "the Redis server closed the connection",
                );
                return;
            }
            Ok(_) => {}
            Err(_) => {
                shared.break_with(
                    io::ErrorKind::ConnectionReset,
                    "reading from the Redis server failed",
                );
                return;
            }
        }
        loop {
            match parse(&buffer, 0) {
                Ok(Some((value, used))) => {
                    buffer.advance(used);
                    parsed.push(value);
                }
                Ok(None) => break,
                Err(()) => {
                    shared.break_with(
                        io::ErrorKind::InvalidData,
                        "the Redis server's reply could not be parsed",
                    );
                    return;
                }
            }
        }
        if parsed.is_empty() {
            continue;
        }
        let asked = {
            let mut state = shared.state.lock();
            let asked = state.waiting.len() >= parsed.len();
            if asked {
                replies.extend(state.waiting.drain(..parsed.len()));
            }
            asked
        };
        if !asked {
            shared.break_with(
                io::ErrorKind::InvalidData,
                "the Redis server sent a reply nobody asked for",
            );
            return;
        }
        for (reply, value) in replies.drain(..).zip(parsed.drain(..)) {
            let _ = reply.send(Ok(value));
        }
    }
}

/// The end of the line that starts at `from`: the index of its `\r\n`.
fn line_end(bytes: &[u8], from: usize) -> Option<usize> {
    let rest = bytes.get(from..)?;
    let at = rest.windows(2).position(|pair| pair == b"\r\n")?;
    Some(from + at)
}

fn integer(line: &[u8]) -> Result<i64, ()> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or(())
}

/// Parses one RESP2 reply from the start of `bytes`: the value and how
/// many bytes it took, `None` while it is incomplete, `Err` when it is not
/// RESP2.
fn parse(bytes: &[u8], depth: usize) -> Result<Option<(Value, usize)>, ()> {
    let Some(&kind) = bytes.first() else {
        return Ok(None);
    };
    let Some(end) = line_end(bytes, 1) else {
        return Ok(None);
    };
    let line = &bytes[1..end];
    let after = end + 2;
    let value = match kind {
        b'+' if line == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
        b':' => Value::Int(integer(line)?),
        b'-' => {
            // Errors are rare: redis-rs' parser gives them their kind.
            let value = redis::parse_redis_value(&bytes[..after]).map_err(|_| ())?;
            if !matches!(value, Value::ServerError(_)) {
                return Err(());
            }
            value
        }
        b'$' => {
            let len = integer(line)?;
            if len < 0 {
                Value::Nil
            } else {
                let len = usize::try_from(len).map_err(|_| ())?;
                let next = after.checked_add(len).and_then(|at| at.checked_add(2));
                let Some(body) = bytes.get(after..next.ok_or(())?) else {
                    return Ok(None);
                };
                if &body[len..] != b"\r\n" {
                    return Err(());
                }
                return Ok(Some((
                    Value::BulkString(body[..len].to_vec()),
                    after + len + 2,
                )));
            }
        }
        b'*' => {
            let len = integer(line)?;
            if len < 0 {
                Value::Nil
            } else {
                if depth >= MAX_DEPTH {
                    return Err(());
                }
                let len = usize::try_from(len).map_err(|_| ())?;
                // Each element takes at least three bytes.
                let mut items = Vec::with_capacity(len.min(bytes.len() / 3 + 1));
                let mut at = after;
                for _ in 0..len {
                    let Some((item, used)) = parse(&bytes[at..], depth + 1)? else {
                        return Ok(None);
                    };
                    items.push(item);
                    at += used;
                }
                return Ok(Some((Value::Array(items), at)));
            }
        }
        _ => return Err(()),
    };
    Ok(Some((value, after)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(bytes: &[u8]) -> Value {
        match parse(bytes, 0) {
            Ok(Some((value, used))) => {
                assert_eq!(used, bytes.len(), "{bytes:?}");
                value
            }
            other => panic!("{bytes:?}: {other:?}"),
        }
    }

    #[test]
    fn parses_every_resp2_reply_a_store_gets() {
        assert_eq!(whole(b"+OK\r\n"), Value::Okay);
        assert_eq!(whole(b"+PONG\r\n"), Value::SimpleString("PONG".to_owned()));
        assert_eq!(whole(b":-42\r\n"), Value::Int(-42));
        assert_eq!(whole(b"$-1\r\n"), Value::Nil);
        assert_eq!(whole(b"*-1\r\n"), Value::Nil);
        assert_eq!(whole(b"$0\r\n\r\n"), Value::BulkString(Vec::new()));
        // Binary-safe: CR LF inside a bulk string is data.
        assert_eq!(
            whole(b"$4\r\na\r\nb\r\n"),
            Value::BulkString(b"a\r\nb".to_vec())
        );
        assert_eq!(
            whole(b"*3\r\n$8\r\nacquired\r\n:2\r\n*1\r\n$-1\r\n"),
            Value::Array(vec![
                Value::BulkString(b"acquired".to_vec()),
                Value::Int(2),
                Value::Array(vec![Value::Nil]),
            ])
        );
        assert_eq!(whole(b"*0\r\n"), Value::Array(Vec::new()));
        let error = whole(b"-NOSCRIPT No matching script\r\n");
        let error = error.extract_error().expect_err("an error reply");
        assert_eq!(
            error.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
    }

    #[test]
    fn an_incomplete_reply_waits_for_more_at_every_cut() {
        let reply: &[u8] = b"*4\r\n$5\r\nhello\r\n:7\r\n*2\r\n+OK\r\n$-1\r\n-ERR bad\r\n";
        let full = whole(reply);
        for cut in 0..reply.len() {
            assert_eq!(parse(&reply[..cut], 0), Ok(None), "cut at {cut}");
        }
        // Two replies back to back: the first is taken alone.
        let mut two = reply.to_vec();
        two.extend_from_slice(b":1\r\n");
        assert_eq!(parse(&two, 0), Ok(Some((full, reply.len()))));
    }

    #[test]
    fn what_is_not_resp2_is_refused() {
        for bad in [
            &b"?x\r\n"[..],
            b":12a\r\n",
            b"$3\r\nabcd\r\n",
            b"$x\r\n",
            b"%1\r\n",
        ] {
            assert_eq!(parse(bad, 0), Err(()), "{bad:?}");
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
        assert_eq!(parse(deep.as_bytes(), 0), Err(()));
    }

    #[test]
    fn commands_are_written_as_redis_rs_packs_them() {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg("abc")
            .arg(1)
            .arg("key")
            .arg(&b"bin\r\nary"[..])
            .arg("");
        let mut out = BytesMut::new();
        encode(&cmd, &mut out);
        assert_eq!(&out[..], &cmd.get_packed_command()[..]);
        // Lengths of one, two and more digits; more than ten arguments.
        for len in [9, 10, 99, 100, 12_345] {
            cmd.arg(vec![b'x'; len]);
        }
        for i in 0..100 {
            cmd.arg(i);
        }
        let mut out = BytesMut::from(&b"before"[..]);
        encode(&cmd, &mut out);
        assert_eq!(&out[..6], b"before");
        assert_eq!(&out[6..], &cmd.get_packed_command()[..]);
    }
}
