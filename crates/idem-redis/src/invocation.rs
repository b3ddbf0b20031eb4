//! One script call as it is written: its command built in a buffer kept
//! for the next, its arguments counted as they go.

use idem_core::ScopeHash;
use redis::{ErrorKind, Script, ServerErrorKind, ToRedisArgs, Value};

use crate::keys::record_key_pieces;
use crate::pool::Conn;

/// A script call, written as one `EVALSHA` command straight into the
/// command's buffer (redis-rs' `ScriptInvocation` keeps every key and
/// argument in an allocation of its own and copies them into the command
/// on each call). The script is loaded and the call repeated after
/// `NOSCRIPT` (a restarted server, `SCRIPT FLUSH`).
///
/// The command's buffers are reused: an ended call leaves them to its
/// thread's next calls (see [`SPARE_COMMANDS`]).
pub(crate) struct Invocation<'s> {
    /// The script, or `None` for a native command on a record.
    script: Option<&'s Script>,
    /// Whether the call's first key is a record's (see [`invoke`](Self::invoke)).
    record: bool,
    cmd: redis::Cmd,
    /// The bytes of the call's keys and arguments (what follows `EVALSHA`,
    /// the script's hash and the number of keys).
    bytes: usize,
}

/// What a call answered, typed: its reply, or what the record it met
/// asks of the store.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The command's or the script's reply.
    Reply(Value),
    /// A native command met a record kept as a hash (Redis' `WRONGTYPE`):
    /// its caller runs the script instead.
    HashRecord,
    /// A native write was refused for want of memory (`OOM`, under
    /// `noeviction`): its caller reads instead (a replay needs no write).
    OutOfMemory,
    /// A script met a record kept as one string (format 3, `WRONGTYPE`):
    /// the store converts it and runs the script again
    /// (`string_record::converting`).
    StringRecord,
}

impl Answer {
    /// The reply. A record a script could not take after its conversions
    /// (a key of another type: `WRONGTYPE` each time) is the server's
    /// refusal, which fail-open never covers.
    pub(crate) fn into_reply(self) -> Result<Value, idem_core::StoreError> {
        match self {
            Answer::Reply(value) => Ok(value),
            other => Err(idem_core::StoreError::refused(format!(
                "WRONGTYPE: the record's key holds another type ({other:?})"
            ))),
        }
    }
}

thread_local! {
    /// Emptied commands of ended calls, their buffers kept for this
    /// thread's next calls: a call's command would otherwise cost two
    /// allocations and their growth.
    pub(crate) static SPARE_COMMANDS: std::cell::RefCell<Vec<redis::Cmd>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// At most this many spare commands per thread.
pub(crate) const SPARE_COMMANDS_KEPT: usize = 32;

/// A command whose arguments took more bytes than this is not kept: its
/// buffer (at most twice its largest use) would hold a large body's
/// memory for good.
pub(crate) const SPARE_COMMAND_BYTES: usize = 8 * 1024;

impl<'s> Invocation<'s> {
    /// A call of `script` on `keys`; arguments follow with [`arg`](Self::arg).
    pub(crate) fn new(script: &'s Script, keys: &[&str]) -> Self {
        let mut invocation = Self::of(script, keys.len());
        for key in keys {
            invocation.arg(*key);
        }
        invocation
    }

    /// A call of `script` on one key given as bytes (a call's record
    /// key, [`record_key`](Self::record_key)), not itself a record call.
    pub(crate) fn on_key_bytes(script: &'s Script, key: &[u8]) -> Self {
        let mut invocation = Self::of(script, 1);
        invocation.arg(key);
        invocation
    }

    /// A call of `script` on `key`, a record's key (as
    /// [`on_record`](Self::on_record) makes one).
    pub(crate) fn on_record_key(script: &'s Script, key: &str) -> Self {
        let mut invocation = Self::new(script, &[key]);
        invocation.record = true;
        invocation
    }

    /// The native command `name` on the record key of `scope` under
    /// `prefix`; arguments follow with [`arg`](Self::arg). A record kept as
    /// a hash answers it [`Answer::HashRecord`] (see [`invoke`](Self::invoke)).
    pub(crate) fn native(name: &str, prefix: &str, scope: &ScopeHash) -> Self {
        let mut invocation = Self::blank(None);
        invocation.record = true;
        invocation.cmd.arg(name);
        invocation.pieces(&record_key_pieces(prefix, &scope.hex_bytes()));
        invocation
    }

    /// A call of `script` on one key, the record key of `scope` under
    /// `prefix` (see [`RedisStore::record_key`]), written without an
    /// allocation of its own.
    pub(crate) fn on_record(script: &'s Script, prefix: &str, scope: &ScopeHash) -> Self {
        let mut invocation = Self::of(script, 1);
        invocation.record = true;
        invocation.pieces(&record_key_pieces(prefix, &scope.hex_bytes()));
        invocation
    }

    /// The call's head: `EVALSHA <sha> <number of keys>`.
    fn of(script: &'s Script, keys: usize) -> Self {
        let mut invocation = Self::blank(Some(script));
        invocation
            .cmd
            .arg("EVALSHA")
            .arg(script.get_hash())
            .arg(keys);
        invocation
    }

    /// A call with an empty command (a spare one when this thread has
    /// one).
    fn blank(script: Option<&'s Script>) -> Self {
        let cmd = SPARE_COMMANDS
            .with(|spare| spare.borrow_mut().pop())
            .unwrap_or_else(|| redis::Cmd::with_capacity(16, 256));
        Self {
            script,
            record: false,
            cmd,
            bytes: 0,
        }
    }

    /// Appends an argument.
    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut Counting {
            cmd: &mut self.cmd,
            bytes: &mut self.bytes,
        });
        self
    }

    /// Appends one argument made of `pieces`, one after the other: joined
    /// on the stack when short (a record's key, a tenant), so the command
    /// takes them in one piece.
    pub(crate) fn pieces(&mut self, pieces: &[&[u8]]) -> &mut Self {
        let mut joined = [0u8; 256];
        let mut at = 0;
        for piece in pieces {
            match joined.get_mut(at..at + piece.len()) {
                Some(room) => room.copy_from_slice(piece),
                None => return self.written_pieces(pieces),
            }
            at += piece.len();
        }
        self.bytes += at;
        self.cmd.arg(&joined[..at]);
        self
    }

    /// [`pieces`](Self::pieces) written through the command's writer.
    #[cold]
    fn written_pieces(&mut self, pieces: &[&[u8]]) -> &mut Self {
        self.write_arg(|out| {
            for piece in pieces {
                out.write_all(piece)?;
            }
            Ok(())
        })
    }

    /// Appends one argument that `write` writes (into the command's
    /// buffer: writing cannot fail).
    pub(crate) fn write_arg(
        &mut self,
        write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
    ) -> &mut Self {
        use redis::RedisWrite;
        let mut out = Counted {
            inner: self.cmd.writer_for_next_arg(),
            bytes: &mut self.bytes,
        };
        let _ = write(&mut out);
        drop(out);
        self
    }

    /// Appends a UUID in its hyphenated lower-case text (what `to_string`
    /// gives), written from a stack buffer.
    pub(crate) fn uuid(&mut self, id: &uuid::Uuid) -> &mut Self {
        let mut buffer = uuid::Uuid::encode_buffer();
        let text: &str = id.hyphenated().encode_lower(&mut buffer);
        self.arg(text)
    }

    /// Runs the call on `conn`, its answer typed: a native command that
    /// met a record kept as a hash answers [`Answer::HashRecord`], one
    /// refused for memory [`Answer::OutOfMemory`], and a script that met a
    /// record kept as one string [`Answer::StringRecord`] (the store then
    /// converts it: the transport knows no record format).
    ///
    /// The calls off the hot path (loading the script, a cluster's query)
    /// are boxed: a future is as large as its largest state, and every
    /// store call's future is moved whole at least once.
    pub(crate) async fn invoke(&self, conn: &mut Conn) -> redis::RedisResult<Answer> {
        match self.query(conn).await {
            Err(error) => Box::pin(self.recover(error, conn)).await,
            Ok(value) => Ok(Answer::Reply(value)),
        }
    }

    /// After `error`: loads the script and runs it again (`NOSCRIPT`), or
    /// types what the record answered (`WRONGTYPE`, `OOM`); else the
    /// error stands.
    async fn recover(
        &self,
        mut error: redis::RedisError,
        conn: &mut Conn,
    ) -> redis::RedisResult<Answer> {
        if let (Some(script), ErrorKind::Server(ServerErrorKind::NoScript)) =
            (self.script, error.kind())
        {
            load(script, conn).await?;
            match self.query(conn).await {
                Err(again) => error = again,
                Ok(value) => return Ok(Answer::Reply(value)),
            }
        }
        match (self.record, self.script.is_some(), error.code()) {
            (true, false, Some("OOM")) => Ok(Answer::OutOfMemory),
            (true, false, Some("WRONGTYPE")) => Ok(Answer::HashRecord),
            (true, true, Some("WRONGTYPE")) => Ok(Answer::StringRecord),
            _ => Err(error),
        }
    }

    /// The record's key this call is on (the first key of a script call,
    /// the first argument of a native command).
    pub(crate) fn record_key(&self) -> Option<&[u8]> {
        let at = if self.script.is_some() { 3 } else { 1 };
        match self.cmd.args_iter().nth(at) {
            Some(redis::Arg::Simple(key)) => Some(key),
            _ => None,
        }
    }

    async fn query(&self, conn: &mut Conn) -> redis::RedisResult<Value> {
        match conn {
            Conn::Single(c) => self.cmd.query_async(c).await,
            Conn::Cluster(c) => Box::pin(self.cmd.query_async(c)).await,
        }
    }
}

/// Loads `script` on `conn`'s server (after `NOSCRIPT`).
async fn load(script: &Script, conn: &mut Conn) -> redis::RedisResult<()> {
    match conn {
        Conn::Single(c) => script.load_async(c).await?,
        Conn::Cluster(c) => script.load_async(c).await?,
    };
    Ok(())
}

/// A command's writer that counts the bytes of the arguments written
/// through it (kept in [`Invocation::bytes`] as they are written, instead
/// of summed over every argument when the call ends).
pub(crate) struct Counting<'c> {
    cmd: &'c mut redis::Cmd,
    bytes: &'c mut usize,
}

impl redis::RedisWrite for Counting<'_> {
    fn write_arg(&mut self, arg: &[u8]) {
        *self.bytes += arg.len();
        self.cmd.write_arg(arg);
    }

    fn write_arg_fmt(&mut self, arg: impl std::fmt::Display) {
        use std::io::Write;
        let mut out = self.writer_for_next_arg();
        let _ = write!(out, "{arg}");
    }

    fn writer_for_next_arg(&mut self) -> impl std::io::Write + '_ {
        Counted {
            inner: self.cmd.writer_for_next_arg(),
            bytes: &mut *self.bytes,
        }
    }

    fn reserve_space_for_args(&mut self, additional: impl IntoIterator<Item = usize>) {
        self.cmd.reserve_space_for_args(additional);
    }
}

/// An argument's writer that adds what it writes to a count.
pub(crate) struct Counted<'b, W> {
    inner: W,
    bytes: &'b mut usize,
}

impl<W: std::io::Write> std::io::Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        *self.bytes += written;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl Drop for Invocation<'_> {
    fn drop(&mut self) {
        if self.bytes > SPARE_COMMAND_BYTES {
            return;
        }
        let mut cmd = std::mem::take(&mut self.cmd);
        cmd.clear();
        // A thread being torn down keeps nothing.
        let _ = SPARE_COMMANDS.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_COMMANDS_KEPT {
                spare.push(cmd);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spare() -> usize {
        SPARE_COMMANDS.with(|spare| spare.borrow().len())
    }

    fn args(invocation: &Invocation<'_>) -> Vec<Vec<u8>> {
        invocation
            .cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(arg) => arg.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// An ended call's command is kept, emptied, for the thread's next
    /// call; one that held a large argument is not.
    #[test]
    fn ended_commands_are_reused_emptied_unless_large() {
        let script = Script::new("return 1");
        let before = spare();
        let mut first = Invocation::new(&script, &["k1"]);
        first.arg("value").pieces(&[b"a", b"b"]);
        assert_eq!(
            args(&first)[3..],
            [b"k1".to_vec(), b"value".to_vec(), b"ab".to_vec()]
        );
        drop(first);
        assert_eq!(spare(), before + 1);
        // The next call takes it and starts from nothing.
        let scope = ScopeHash::from_bytes([0xab; 32]);
        let second = Invocation::on_record(&script, "p:", &scope);
        assert_eq!(spare(), before);
        let written = args(&second);
        assert_eq!(written.len(), 4, "{written:?}");
        assert_eq!(written[0], b"EVALSHA");
        assert_eq!(written[2], b"1");
        assert_eq!(
            written[3],
            format!("p:{{{}}}", "ab".repeat(32)).into_bytes()
        );
        drop(second);
        assert_eq!(spare(), before + 1);
        // A call that carried a large body leaves nothing behind, however
        // its arguments were written: one large argument, several that
        // add up, long pieces, a writer, an integer past the rest.
        let half = SPARE_COMMAND_BYTES / 2;
        let big = vec![b'x'; SPARE_COMMAND_BYTES + 1];
        let writes: [&dyn Fn(&mut Invocation<'_>); 6] = [
            &|call| {
                call.arg(&big[..]);
            },
            &|call| {
                call.arg(&big[..half]).arg(&big[..half]).arg("1");
            },
            &|call| {
                call.pieces(&[&big[..half], &big[..half + 1]]);
            },
            &|call| {
                call.write_arg(|out| out.write_all(&big));
            },
            &|call| {
                call.arg(&big[..SPARE_COMMAND_BYTES - 1]).arg(7u8);
            },
            &|call| {
                call.arg(&big[..SPARE_COMMAND_BYTES - 100])
                    .pieces(&[&big[..100], b"y"]);
            },
        ];
        for (case, write) in writes.iter().enumerate() {
            let mut large = Invocation::new(&script, &["k"]);
            write(&mut large);
            let taken = spare();
            drop(large);
            assert_eq!(spare(), taken, "case {case}");
        }
        // At the bound (the key's byte counted) it is kept.
        let mut bound = Invocation::new(&script, &["k"]);
        bound.arg(&big[..SPARE_COMMAND_BYTES - 2]).arg(7u8);
        let taken = spare();
        drop(bound);
        assert_eq!(spare(), taken + 1);
    }

    /// Pieces make one argument whatever their length: short ones joined
    /// on the stack, up to and past its size, and long ones written
    /// through the command's writer.
    #[test]
    fn pieces_make_one_argument_at_every_length() {
        let script = Script::new("return 1");
        for total in [0, 1, 100, 255, 256, 257, 300, 4096] {
            let text: Vec<u8> = (0..total).map(|n| b'a' + (n % 26) as u8).collect();
            let third = total / 3;
            let pieces = [&text[..third], &text[third..2 * third], &text[2 * third..]];
            let mut invocation = Invocation::new(&script, &["k"]);
            invocation.pieces(&pieces).arg("after");
            let written = args(&invocation);
            assert_eq!(written[4], text, "{total}");
            assert_eq!(written[5], b"after", "{total}");
        }
    }
}
