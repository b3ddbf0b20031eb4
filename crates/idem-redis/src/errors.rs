//! How the driver's errors become the store's: unavailable (not reached,
//! loading, failing over), refused (the server answered with an error), or
//! a record that does not decode.

use idem_core::StoreError;

/// The store could not do its call; the driver's error stays the source.
/// An error the server answered with (out of memory under `noeviction`, a
/// permission, a script error) is [`StoreError::Refused`], which fail-open
/// never covers; one of a server that could not be reached, is loading or
/// failing over is [`StoreError::Unavailable`].
pub(crate) fn unavailable(
    error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> StoreError {
    let error = error.into();
    // A connection the pool could not open keeps the server's answer as
    // its cause (a refused password, the server's client limit): the pool
    // wraps it, and the class is read through the wrapper.
    let answered = match error.downcast_ref::<deadpool_redis::PoolError>() {
        Some(deadpool_redis::PoolError::Backend(cause)) => answered_by_the_server(cause),
        Some(_) => false,
        None => error
            .downcast_ref::<redis::RedisError>()
            .is_some_and(answered_by_the_server),
    };
    if answered {
        StoreError::Refused(error)
    } else {
        StoreError::Unavailable(error)
    }
}

/// Whether the server was reached and answered with an error of its own.
pub(crate) fn answered_by_the_server(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if error.is_io_error() || error.is_connection_dropped() || error.is_timeout() {
        return false;
    }
    match error.kind() {
        ErrorKind::Server(kind) => !matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ),
        // An error code of the server's own, a refused password (NOAUTH,
        // WRONGPASS), a reply that does not parse or is not of the type
        // asked for: the server was reached and answered.
        ErrorKind::Extension
        | ErrorKind::AuthenticationFailed
        | ErrorKind::Parse
        | ErrorKind::UnexpectedReturnType => true,
        _ => false,
    }
}

/// A record or reply that does not decode.
pub(crate) fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}
