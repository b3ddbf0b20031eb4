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

    /// No handler transaction completes a memory record: its handlers get
    /// no completion slot (the suite's `/ctx` shows it).
    #[test]
    fn offers_no_completion_slot() {
        use idem_core::Store;
        assert!(!idem_memory::MemoryStore::new().completes_in_transactions());
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

    /// A Redis record is completed by the store, never inside a handler's
    /// transaction: no completion slot.
    #[test]
    fn offers_no_completion_slot() {
        use idem_core::Store;
        let store = RedisStore::from_url("redis://127.0.0.1:1").expect("store");
        assert!(!store.completes_in_transactions());
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

    /// A handler's transaction on the records' database completes the
    /// record: its handlers get a completion slot.
    #[tokio::test]
    async fn offers_a_completion_slot() {
        use idem_core::Store;
        let Some((store, ())) = store().await else {
            return;
        };
        assert!(store.completes_in_transactions());
    }
}
