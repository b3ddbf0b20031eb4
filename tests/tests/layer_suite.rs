//! The layer's behaviours (`idem_tests::layer_suite`) on every store:
//! memory, Redis (a private server per test) and PostgreSQL (a database
//! per test on the binary's private server).

mod memory {
    idem_tests::layer_tests!(|| async { Some((idem_memory::MemoryStore::new(), ())) });
}

mod redis {
    use idem_redis::RedisStore;
    use idem_tests::redis_server::RedisServer;

    async fn store() -> Option<(RedisStore, RedisServer)> {
        let server = RedisServer::spawn()?;
        let store = RedisStore::from_url(&server.url()).expect("store");
        Some((store, server))
    }

    idem_tests::layer_tests!(store);
}

mod postgres {
    use idem_postgres::PgStore;
    use idem_tests::postgres_server::PgServer;

    async fn store() -> Option<(PgStore, ())> {
        let server = PgServer::shared()?;
        let store = PgStore::from_url(&server.database()).expect("store");
        store.migrate().await.expect("migrate");
        Some((store, ()))
    }

    idem_tests::layer_tests!(store);
}
