-- The idempotency records of idem-postgres. `PgStore::migrate()` runs this
-- same text (with the configured table name); apply it yourself if your
-- migrations are managed elsewhere.
--
-- Times are milliseconds since the Unix epoch on the database's clock
-- (clock_timestamp()), never the application's.
CREATE TABLE IF NOT EXISTS idem_records (
    scope               bytea PRIMARY KEY,  -- SHA-256 or HMAC-SHA256 of tenant, operation and key
    tenant              text NOT NULL,
    operation           text NOT NULL,
    key                 text NOT NULL,
    fingerprint         bytea NOT NULL,
    state               text NOT NULL,      -- processing, completed, cancelled, released
    generation          bigint NOT NULL,
    owner               uuid,               -- the lease owner's token while processing
    lease_ms            bigint NOT NULL,
    retention_ms        bigint NOT NULL,
    lease_expires_at_ms bigint NOT NULL,
    created_at_ms       bigint NOT NULL,
    updated_at_ms       bigint NOT NULL,
    completed_at_ms     bigint,
    expires_at_ms       bigint NOT NULL,
    status              integer,            -- completed: the response status
    stored              boolean,            -- completed: whether the response is replayable
    header_names        text[],
    header_values       bytea[],
    body                bytea,
    attempts            jsonb NOT NULL      -- newest 8 attempts, oldest first (the newest superseded one always kept)
);

-- The sweep deletes expired records in expiry order.
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at_ms);

-- Which identity the instances sharing the table have (how they derive
-- tenants and scopes): one row, claimed through `PgStore::claim_identity`.
CREATE TABLE IF NOT EXISTS idem_records_identity (
    id            boolean PRIMARY KEY DEFAULT true CHECK (id),
    marker        text NOT NULL,
    expires_at_ms bigint NOT NULL
);

-- Who does each fleet-wide chore (the gateway's count of lapsed records),
-- and until when: claimed through `PgStore::claim_duty`.
CREATE TABLE IF NOT EXISTS idem_records_duties (
    name          text PRIMARY KEY,
    holder        text NOT NULL,
    expires_at_ms bigint NOT NULL
);

-- Events that leave with the write (the transactional outbox): a handler
-- adds them through `IdemTransaction::emit`; they commit or roll back with
-- its writes and the completed record, and a relay
-- (`idem_postgres::relay`) publishes them in `seq` order, marks them
-- published, and deletes them once they have been published a while.
CREATE TABLE IF NOT EXISTS idem_records_outbox (
    seq             bigserial PRIMARY KEY,
    id              text NOT NULL UNIQUE,  -- the message id: scope, generation and position
    scope           bytea,                 -- the record's scope (NULL: emitted without the layer)
    generation      bigint,                -- the attempt's generation that committed it
    attempt         uuid,                  -- that attempt's id (as in the record's attempts)
    position        integer NOT NULL,      -- 1, 2, ... in the order the handler emitted them
    subject         text NOT NULL,
    payload         bytea NOT NULL,
    created_at_ms   bigint NOT NULL,       -- written in the committing transaction
    published_at_ms bigint,                -- NULL until the broker acknowledged it
    refused_at_ms   bigint,                -- the broker refused it for good (too large): set aside
    refusal         text                   -- why
);

-- The relay reads the unpublished events in order; the sweep, the
-- published; the backlog gauges, the ones set aside.
CREATE INDEX IF NOT EXISTS idem_records_outbox_unpublished
    ON idem_records_outbox (seq) WHERE published_at_ms IS NULL AND refused_at_ms IS NULL;
CREATE INDEX IF NOT EXISTS idem_records_outbox_published
    ON idem_records_outbox (published_at_ms) WHERE published_at_ms IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_records_outbox_refused
    ON idem_records_outbox (seq) WHERE refused_at_ms IS NOT NULL;
