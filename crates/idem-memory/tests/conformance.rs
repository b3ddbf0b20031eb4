//! The store conformance suite on the memory store, on tokio's paused clock.

use std::time::Duration;

use idem_core::conformance::Harness;
use idem_memory::MemoryStore;

struct MemoryHarness {
    store: MemoryStore,
    paused: bool,
}

impl MemoryHarness {
    async fn new() -> Self {
        // Paused time needs the current-thread runtime; the concurrency check
        // runs on the multi-thread runtime with the real clock.
        let paused = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::CurrentThread;
        if paused {
            tokio::time::pause();
        }
        Self {
            store: MemoryStore::new(),
            paused,
        }
    }
}

impl Harness for MemoryHarness {
    type Store = MemoryStore;

    fn store(&self) -> &MemoryStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        if self.paused {
            tokio::time::advance(by).await;
        } else {
            tokio::time::sleep(by).await;
        }
    }
}

idem_core::conformance_tests!(|| async { Some(MemoryHarness::new().await) }, records_admin);
