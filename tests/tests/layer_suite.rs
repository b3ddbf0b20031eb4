//! The layer's behaviours (`idem_tests::layer_suite`) on every store:
//! memory, Redis (a private server per test) and PostgreSQL (a database
//! per test on the binary's private server).

mod memory {
    idem_tests::layer_tests!(|| async { Some((idem_memory::MemoryStore::new(), ())) });

    #[tokio::test]
    async fn layers_claim_the_store_by_how_they_hash_scopes() {
        let store = idem_memory::MemoryStore::new();
        idem_tests::layer_suite::layers_claim_the_store_by_how_they_hash_scopes(store, false).await;
    }
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layers_claim_the_store_by_how_they_hash_scopes() {
        let Some((store, _server)) = store().await else {
            return;
        };
        idem_tests::layer_suite::layers_claim_the_store_by_how_they_hash_scopes(store, true).await;
    }
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layers_claim_the_store_by_how_they_hash_scopes() {
        let Some((store, ())) = store().await else {
            return;
        };
        idem_tests::layer_suite::layers_claim_the_store_by_how_they_hash_scopes(store, true).await;
    }
}
